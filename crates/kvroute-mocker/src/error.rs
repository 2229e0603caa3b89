//! What starting a simulated engine can fail with.

/// Why a simulated engine could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MockerError {
    #[error(transparent)]
    Model(#[from] kvroute_preprocess::PreprocessError),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

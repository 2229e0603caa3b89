//! The router service's error.

/// Everything the router service can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("the publisher's connection was lost")]
    PublisherLost,
    #[error("replay: no reply in time")]
    ReplayTimeout,
    #[error("replay: a bad frame")]
    ReplayFrame(#[source] kvroute_wire::WireError),
    #[error("block size")]
    BlockSize(#[from] kvroute_core::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

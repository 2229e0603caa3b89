//! What a stack can fail with at start-up.

use crate::settings;

/// Everything a stack can fail with at start-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StackError {
    #[error(transparent)]
    Config(#[from] settings::Invalid),
    /// The local NATS server (tests, the bench) could not be started.
    #[error("no randomness for a worker token")]
    Randomness(#[source] getrandom::Error),
    #[error("the stack has no front door")]
    NoFrontDoor,
    #[error(transparent)]
    Settings(#[from] settings::SettingsError),
    #[error(transparent)]
    Router(#[from] kvroute_router::RouterError),
    #[error(transparent)]
    RouterConfig(#[from] kvroute_router::ConfigError),
    #[error(transparent)]
    Nats(#[from] kvroute_router::config::replicas::NatsConfigError),
    #[error("a simulated worker")]
    Mocker(#[from] kvroute_mocker::MockerError),
    #[error("the model")]
    Model(#[from] kvroute_preprocess::PreprocessError),
    #[error("I/O")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Credentials(#[from] kvroute_http::auth::CredentialsError),
    #[error(transparent)]
    Tls(#[from] kvroute_http::server::TlsError),
    #[error("adapters: {0}")]
    Adapters(String),
    /// The engines report different block sizes, and none was given.
    #[error(transparent)]
    BlockSizes(#[from] kvroute_router::load::BlockSizesDiffer),
}

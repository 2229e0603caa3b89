//! kvroute's simulated engine: a GPU-free worker whose cache behaves like vLLM's (paged,
//! prefix-cached, LRU-evicting), whose scheduler batches like vLLM's (continuous batching,
//! chunked prefill, preemption), and whose steps take the time Dynamo's mocker model says, on
//! a simulated clock so tests run fast and exactly. It reports real cache hits (the ground
//! truth of benchmarks) and emits vLLM-format KV events.
//!
//! - [`engine`]: the engine core, stepped by hand (tests, simulations);
//! - [`service`]: the engine in real time, publishing KV events and load reports;
//! - [`http`]: its OpenAI-compatible API.

pub mod engine;
pub mod http;
mod kv;
pub mod service;
pub mod timing;

pub use engine::{
    Engine, EngineConfig, EngineError, EngineRequest, EngineStats, Output, Step, Usage,
};
pub use kvroute_preprocess::fetch::FetchConfig;
pub use service::{Endpoints, EngineHandle, Snapshot};
pub use timing::Timing;

use std::path::PathBuf;
use std::sync::Arc;

/// Everything a simulated engine needs.
#[derive(Clone, Debug)]
pub struct MockerConfig {
    pub engine: EngineConfig,
    pub endpoints: Endpoints,
    /// Tokenizer and chat template (default: the repository's `models/kvroute-tiny`).
    pub model_dir: PathBuf,
    /// Seeds the generated words.
    pub seed: u64,
    pub dp_rank: u32,
    /// Limits on fetching `http(s)://` image URLs (private addresses refused by default).
    pub fetch: kvroute_preprocess::fetch::FetchConfig,
}

impl Default for MockerConfig {
    fn default() -> Self {
        Self {
            engine: EngineConfig::default(),
            endpoints: Endpoints::default(),
            model_dir: kvroute_preprocess::Preprocessor::default_model_dir(),
            seed: 0,
            dp_rank: 0,
            fetch: kvroute_preprocess::fetch::FetchConfig::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MockerError {
    #[error(transparent)]
    Model(#[from] kvroute_preprocess::PreprocessError),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
}

/// Loads the model, starts the engine task and its publishers on the current runtime; serve
/// [`http::app`] with the returned state.
pub async fn start(config: MockerConfig) -> Result<Arc<http::AppState>, MockerError> {
    let preprocessor = Arc::new(kvroute_preprocess::Preprocessor::load(&config.model_dir)?);
    let engine = EngineHandle::start(config.engine, &config.endpoints, config.dp_rank).await?;
    let fetcher = kvroute_preprocess::fetch::Fetcher::new(config.fetch)?;
    Ok(Arc::new(http::AppState::new(engine, preprocessor, config.seed, fetcher)))
}

#[cfg(test)]
mod tests;

//! kvroute's simulated engine: a GPU-free worker whose cache behaves like vLLM's (paged,
//! prefix-cached, LRU-evicting), whose scheduler batches like vLLM's (continuous batching,
//! chunked prefill, preemption), and whose steps take the time Dynamo's mocker model says, on
//! a simulated clock so tests run fast and exactly. It reports real cache hits (the ground
//! truth of benchmarks) and emits vLLM-format KV events.
//!
//! - [`engine`]: the engine core, stepped by hand (tests, simulations);
//! - [`service`]: the engine in real time, publishing KV events and load reports;
//! - [`http`]: its OpenAI-compatible API; [`vllm`]: vLLM's endpoints for routers.

pub mod app;
mod derender;
pub mod disagg;
pub mod engine;
mod error;
pub mod generate;
pub mod handoff;
mod holds;
pub mod host;
pub mod http;
mod kv;
mod legs;
pub mod loads;
mod logprobs;
pub mod lora;
mod lora_api;
mod media;
pub mod metrics;
mod sequence;
pub mod service;
mod sglang;
pub mod store;
pub mod timing;
pub mod vllm;
pub mod window;

pub use disagg::{DisaggConfig, Handoff, LoadFailurePolicy, Role, TransferTiming};
pub use engine::{
    Engine, EngineConfig, EngineError, EngineRequest, EngineStats, HostConfig, Output, OutputPlan,
    SchedulingPolicy, Step, Usage,
};
pub use error::MockerError;
pub use handoff::Peers;
pub use kvroute_preprocess::fetch::FetchConfig;
pub use loads::TierLoads;
pub use service::{Endpoints, EngineHandle, Snapshot};
pub use timing::Timing;

use std::path::PathBuf;
use std::sync::Arc;

/// Everything a simulated engine needs.
#[derive(Clone, Debug, Default)]
pub struct MockerConfig {
    pub engine: EngineConfig,
    pub endpoints: Endpoints,
    /// Tokenizer and chat template (`None`: the built-in `kvroute-tiny`).
    pub model_path: Option<PathBuf>,
    /// A chat template of its own (Jinja text) instead of the model's, as vLLM's
    /// `--chat-template`: chats are then rendered unlike a front door that uses the model's.
    pub chat_template: Option<String>,
    /// Seeds the generated words (the same seed, the same answers on every engine).
    pub seed: u64,
    /// The longest prompt plus output accepted (`None`: the model's, at most the KV capacity).
    pub max_model_len: Option<u64>,
    pub dp_rank: u32,
    /// Limits on fetching `http(s)://` image URLs (private addresses refused by default).
    pub fetch: kvroute_preprocess::fetch::FetchConfig,
    /// Keys every route but `/health` needs (`Authorization: Bearer`), as vLLM's
    /// `--api-key`; empty: open.
    pub api_keys: kvroute_http::Credentials,
    /// Adapters served from the start (vLLM's `--lora-modules NAME=PATH`; the path is only
    /// listed).
    pub lora_modules: Vec<(String, Option<String>)>,
    /// Serve vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (its
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub runtime_lora_updating: bool,
    /// Where a prefill engine serves its side channel to decode engines (vLLM's
    /// `VLLM_NIXL_SIDE_CHANNEL_HOST`/`PORT`, SGLang's `--disaggregation-bootstrap-port`);
    /// `None`: a free loopback port. Only a prefill engine serves one.
    pub side_channel: Option<String>,
    /// A store every engine of the fleet shares (`--store-url`, [`store`]): the engine writes
    /// the blocks it computes to it and loads from it the blocks it lacks.
    pub store_url: Option<String>,
    /// The fleet's token (the side channel and the store need it; the engine's own pulls
    /// and store calls send it) and a decode engine's prefill peers (docs/security.md).
    pub peers: handoff::Peers,
}
/// An engine started by [`spawn`]: where to reach it, and its state (for tests that look
/// inside or inject faults).
#[derive(Clone, Debug)]
pub struct Spawned {
    pub url: String,
    pub events: Option<String>,
    pub replay: Option<String>,
    pub metrics: Option<String>,
    pub state: Arc<http::AppState>,
}

/// Starts an engine serving its API on `listener`, publishing where `config.endpoints` says
/// ([`Endpoints::ephemeral`]: all on free loopback ports), on the current runtime.
pub async fn spawn(
    config: MockerConfig,
    listener: tokio::net::TcpListener,
) -> Result<Spawned, MockerError> {
    let state = start(config).await?;
    let addr = listener.local_addr()?;
    let bound = state.engine.bound.clone();
    let app = http::app(Arc::clone(&state));
    tokio::spawn(kvroute_http::serve(listener, app, std::future::pending()));
    Ok(Spawned {
        url: format!("http://{addr}"),
        events: bound.events,
        replay: bound.replay,
        metrics: bound.metrics,
        state,
    })
}

/// Loads the model, starts the engine task and its publishers on the current runtime; serve
/// [`http::app`] with the returned state.
pub async fn start(config: MockerConfig) -> Result<Arc<http::AppState>, MockerError> {
    // Tokenizing as an engine's server does, every prompt in full: what openai-chat costs it.
    let mut preprocessor =
        kvroute_preprocess::Preprocessor::load_or_builtin(config.model_path.as_deref())?
            .without_prefix_cache();
    if let Some(template) = config.chat_template {
        preprocessor = preprocessor.with_chat_template(template)?;
    }
    let preprocessor = Arc::new(preprocessor);
    let engine = EngineHandle::start(config.engine, &config.endpoints, config.dp_rank).await?;
    let fetcher = kvroute_preprocess::fetch::Fetcher::new(config.fetch)?;
    let mut state =
        http::AppState::new(engine, preprocessor, config.seed, fetcher, config.max_model_len);
    state.api_keys = config.api_keys;
    state.peers = config.peers;
    if let Some(url) = &config.store_url {
        let link = store::StoreLink::new(url, state.peers.token.as_deref());
        state.engine.attach_store(link.clone(), format!("{}-{}", state.engine_id, config.dp_rank));
        state.store = Some(link);
    }
    state.runtime_lora_updating = config.runtime_lora_updating;
    let side_channel = match config.engine.disagg.role {
        Role::Prefill => {
            let addr = config.side_channel.as_deref().unwrap_or("127.0.0.1:0");
            let listener = tokio::net::TcpListener::bind(addr).await?;
            state.side_channel = Some(listener.local_addr()?);
            Some(listener)
        }
        _ => None,
    };
    for (name, path) in &config.lora_modules {
        state.catalog.insert(name, path.as_deref()).map_err(|e| {
            MockerError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("--lora-modules {name}: {e}"),
            ))
        })?;
    }
    let state = Arc::new(state);
    if let Some(listener) = side_channel {
        let app = handoff::side_channel(Arc::clone(&state));
        tokio::spawn(kvroute_http::serve(listener, app, std::future::pending()));
    }
    Ok(state)
}

#[cfg(test)]
mod tests;

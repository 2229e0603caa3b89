//! kvroute's router service: subscribes to every worker's KV events (vLLM/SGLang ZMQ +
//! msgpack, TensorRT-LLM dicts, kvroute JSON), keeps the sharded KV index and the scheduler,
//! and answers "which worker?" over HTTP (SPEC sections 5, 8 and 10).
//!
//! ```text
//!  workers' PUB sockets ──▶ subscriber tasks (one per rank) ──▶ RouterState { index, scheduler }
//!  workers' load (ZMQ / HTTP) ▶ load tasks (load.rs) ──────────┘        ▲
//!  HTTP clients / the front door ──▶ axum app (http.rs) ────────────────┘
//!  other replicas ◀─ decisions (nats.rs) ─▶ in-flight accounting    ▲
//!  JetStream stream (stream.rs: relay in, ordered consumer, snapshots) ┘
//! ```
//!
//! With NATS (`RouterConfig::nats`) a replica shares its decisions with the others and may
//! take its workers' events from a JetStream stream instead of their ZMQ sockets: see
//! [`nats`] and [`stream`].

pub mod checks;
pub mod config;
pub mod http;
pub mod load;
pub mod metrics;
pub mod nats;
pub mod state;
pub mod stream;
pub mod subscriber;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use config::{EventFormat, RouterConfig, WorkerKey, WorkerSpec, workers_client};
use kvroute_core::{BlockSize, WorkerWithDpRank};
use kvroute_wire::ConvertConfig;
pub use kvroute_wire::ConvertStats;
pub use state::{CacheMode, Parity, Placement, RouterState, WorkerStatus};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Everything the router service can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("ZMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("replay: no reply in time")]
    ReplayTimeout,
    #[error("replay: a bad frame")]
    ReplayFrame(#[source] kvroute_wire::WireError),
    #[error("block size")]
    BlockSize(#[from] kvroute_core::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Background tasks of a running router; dropping it stops them.
#[derive(Debug, Default)]
pub struct Tasks(Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// The event subscriptions of every configured worker rank.
pub(crate) fn subscriptions(state: &RouterState) -> Vec<subscriber::Subscription> {
    let mut out = Vec::new();
    for spec in &state.config.workers {
        let block_size = spec.block_size.and_then(|bs| BlockSize::new(bs).ok());
        let convert = ConvertConfig {
            block_size: block_size.unwrap_or(state.config.block_size),
            image_token_id: spec.image_token_id,
            vocab_size: spec.vocab_size,
        };
        let Some(events) = &spec.events else { continue };
        for rank in 0..spec.dp_size {
            // Validated at start: the endpoints are tcp:// with a port.
            let Ok(endpoint) = WorkerSpec::endpoint_for_rank(events, rank) else { continue };
            let replay =
                spec.replay.as_deref().and_then(|r| WorkerSpec::endpoint_for_rank(r, rank).ok());
            out.push(subscriber::Subscription {
                worker: WorkerWithDpRank::new(spec.id, rank),
                endpoint,
                replay,
                format: spec.format,
                convert,
                resume_after: None,
            });
        }
    }
    out
}

/// Starts the event and load subscriptions of every configured worker, NATS (replica sync,
/// the event stream) when configured, and the reclaiming of requests whose end was never
/// reported.
pub fn spawn_background(state: &Arc<RouterState>) -> Result<Tasks, RouterError> {
    state.config.validate()?;
    for spec in &state.config.workers {
        if let Some(bs) = spec.block_size {
            BlockSize::new(bs)?;
        }
        for endpoint in [&spec.events, &spec.replay].into_iter().flatten() {
            for rank in 0..spec.dp_size {
                WorkerSpec::endpoint_for_rank(endpoint, rank)?;
            }
        }
    }
    let mut tasks = Vec::new();
    let events_via = state.config.nats.as_ref().map(|n| n.events).unwrap_or_default();
    if events_via == nats::EventsVia::Zmq {
        for sub in subscriptions(state) {
            tasks.push(tokio::spawn(subscriber::run(Arc::clone(state), sub)));
        }
    }
    if let Some(config) = &state.config.nats {
        // The relay starts the subscriptions itself, once it knows where the stream ends.
        tasks.extend(nats::spawn(state, config.clone()));
    }
    for spec in &state.config.workers {
        if let Some(metrics) = &spec.metrics {
            tasks.push(tokio::spawn(load::run(Arc::clone(state), spec.id, metrics.clone())));
        }
    }
    if state.has_approximate() {
        let approx = Arc::clone(state);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                approx.expire_approximate(Instant::now());
            }
        }));
    }
    let reclaim = Arc::clone(state);
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let n = reclaim.reclaim_stale();
            if n > 0 {
                tracing::warn!(
                    requests = n,
                    "reclaimed in-flight requests whose end was never reported"
                );
            }
        }
    }));
    Ok(Tasks(tasks))
}

/// Serves the HTTP API, open (no admin token), on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<RouterState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    kvroute_http::serve(listener, http::app(state, Default::default()), shutdown).await?;
    Ok(())
}

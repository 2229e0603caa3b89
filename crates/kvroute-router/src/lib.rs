//! kvroute's router service: subscribes to every worker's KV events (vLLM/SGLang ZMQ +
//! msgpack, TensorRT-LLM dicts, kvroute JSON), keeps the sharded KV index and the scheduler,
//! and answers "which worker?" over HTTP (docs/architecture.md).
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

pub mod check_status;
pub mod config;
mod error;
pub mod http;
pub mod links;
pub mod load;
pub mod members;
pub mod metrics;
pub mod nats;
mod plane;
pub mod saved;
pub mod state;
pub mod stream;
pub mod subscriber;
mod tasks;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use config::{
    ConfigError, Dialect, EventFormat, RouterConfig, WorkerKey, WorkerSpec, workers_client,
};
pub use error::RouterError;
use kvroute_core::BlockSize;
pub use kvroute_wire::ConvertStats;
pub use state::{CacheMode, Decision, Parity, PlaceRequest, Refusal, RouterState, WorkerStatus};
pub use tasks::Tasks;
use tokio::net::TcpListener;

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
    for spec in &state.config.workers {
        if events_via == nats::EventsVia::Zmq {
            // Its subscriptions and load reader are its own: stopped when it leaves.
            members::start_tasks(state, spec)?;
        } else if let Some(metrics) = &spec.metrics {
            tasks.push(tokio::spawn(load::run(Arc::clone(state), spec.id, metrics.clone())));
        }
    }
    if let Some(config) = &state.config.nats {
        // A relay starts the subscriptions itself, once it knows where the stream ends.
        let relays = events_via == nats::EventsVia::Relay
            && state.config.workers.iter().any(|w| w.events.is_some());
        let plane = if relays { Some(state.roster.plane()?) } else { None };
        tasks.extend(nats::spawn(state, config.clone(), plane));
    }
    if state.fleet.has_approximate() {
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
            let n = reclaim.scheduling.reclaim_stale();
            if n > 0 {
                tracing::warn!(
                    requests = n,
                    "reclaimed in-flight requests whose end was never reported"
                );
            }
        }
    }));
    if state.config.scheduler.flow.enabled {
        // Deadlines, and what time alone frees (a step's end the router cannot see, a
        // correction returning to the fleet's): the queues are looked at every 50 ms too.
        let flow = Arc::clone(state);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut reported = state::Reported::default();
            loop {
                tick.tick().await;
                flow.release();
                flow.report_queues(&mut reported);
            }
        }));
    }
    Ok(Tasks::new(tasks, Arc::clone(state)))
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

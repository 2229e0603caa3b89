//! [`RouterState`]: the owners composed, and made from the configuration. Its verbs, the only
//! code that crosses owners, are written in the sibling modules: `decide.rs`, `ingest.rs`,
//! `observe.rs` and `workers.rs`.

use std::sync::OnceLock;

use kvroute_core::WorkerWithDpRank;
use kvroute_core::index::ShardedIndex;
use kvroute_wire::transport::ZmqLimits;

use super::fleet::Fleet;
use super::queues::Flow;
use super::roster::Roster;
use super::scheduling::Scheduling;
use super::self_checks::SelfChecks;
use super::status::WorkerStatus;
use crate::config::RouterConfig;
use crate::links::NatsLinks;
use crate::metrics::Metrics;

/// The router's state: its owners, composed (see the module docs).
#[derive(Debug)]
pub struct RouterState {
    pub config: RouterConfig,
    /// The KV index (its shards lock themselves; a leaf of the lock order).
    pub(crate) index: ShardedIndex,
    pub(crate) metrics: Metrics,
    /// The scheduler, in-flight accounting and approximate mode.
    pub(crate) scheduling: Scheduling,
    /// The worker registry and its health.
    pub(crate) fleet: Fleet,
    /// Predictions against answers.
    pub(crate) checks: SelfChecks,
    /// Flow control's queues; their lock comes before the scheduler's.
    pub(crate) flow: Flow,
    /// The fleet's membership as its sources and the front door see it, with each member's
    /// tasks.
    pub(crate) roster: Roster,
    /// Replica sync and the event stream, when NATS is configured (set once, as it starts).
    pub(crate) nats: OnceLock<NatsLinks>,
    /// What every ZMQ socket of the router may receive; refusals count in `metrics`.
    pub(crate) zmq: ZmqLimits,
    /// The sampled decision log, when configured (and its file opened).
    pub(crate) decision_log: Option<super::DecisionLog>,
}

impl RouterState {
    pub fn new(config: RouterConfig) -> Self {
        let state = Self {
            zmq: ZmqLimits::new(config.zmq_max_message_bytes),
            index: ShardedIndex::new(config.shards, config.index),
            metrics: Metrics::new(),
            scheduling: Scheduling::new(&config),
            fleet: Fleet::new(&config),
            checks: SelfChecks::default(),
            flow: Flow::new(config.scheduler.flow),
            roster: Roster::default(),
            nats: OnceLock::new(),
            decision_log: config.decision_log.as_ref().and_then(|c| {
                super::DecisionLog::open(c)
                    .inspect_err(|e| {
                        tracing::error!(path = %c.path.display(), error = %e, "no decision log");
                    })
                    .ok()
            }),
            config,
        };
        for spec in &state.config.workers {
            let mut status = WorkerStatus::new(spec, true);
            if let Some(nats) = state.config.nats.as_ref().filter(|n| n.events.from_stream()) {
                // Its events come from the stream: ready once the stream's consumer caught up.
                status.follow_stream(format!("jetstream:{}.events.{}.*", nats.prefix, spec.id));
            }
            state.scheduling.add_worker(spec, &status.ready);
            for rank in 0..spec.dp_size {
                state.index.register_worker(WorkerWithDpRank::new(spec.id, rank));
            }
            state.fleet.insert(status);
            state.roster.insert(spec, "config");
        }
        state
    }
}

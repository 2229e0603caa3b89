//! The router's shared state: the KV index, the scheduler, approximate mode, worker status
//! (with readiness) and metrics.
//!
//! A worker rank is **ready** when its event stream is connected and its replay has caught up
//! (workers without `events` need none), and, for a worker with `metrics`, a first load report
//! has arrived. A rank that is not ready is routed to only when no ready one is left, so the
//! first requests after start-up, or after an engine went away, do not land on a cache the
//! router cannot see.
//!
//! The state is split by concern, each part in its own file: the worker registry and health
//! (`state/fleet.rs`), events into the index (`state/events.rs`), the scheduler and in-flight
//! accounting (`state/placing.rs`), the self-checks (`state/answers.rs`); replica sync lives
//! in [`crate::nats`] and [`crate::stream`], which reach the core through [`NatsLinks`].
//!
//! **Lock order.** Where two locks are held at once, they are taken in this order, and never
//! the other way: `placing.approx` → `fleet.workers` → `checks.per_worker`. The scheduler
//! (`placing.scheduler`) and `checks.resync` are taken with no other lock of the state held,
//! except that the scheduler reads the index while it routes; the index's shard locks are
//! leaves (nothing is taken under them). Everything else is an atomic.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError, RwLock};

use kvroute_core::index::{ApproxTracker, ShardedIndex};
use kvroute_core::schedule::Scheduler;
use kvroute_core::{LocalBlockHash, StorageTier, WorkerId, WorkerWithDpRank};
use kvroute_http::metrics::Registry;
use kvroute_wire::transport::ZmqLimits;

use crate::checks::Checks;
use crate::config::RouterConfig;
use crate::links::NatsLinks;
use crate::metrics::{BlocksLabels, Metrics, TierLabels, WorkerIdLabels, WorkerLabels};

mod answers;
mod events;
mod fleet;
mod placing;

pub use fleet::{CacheMode, Parity, RankRefused, WorkerStatus};

/// A request to place, as the HTTP API (or an embedding front door) gives it.
#[derive(Clone, Debug)]
pub struct PlaceRequest<'a> {
    pub local_hashes: &'a [LocalBlockHash],
    pub num_tokens: usize,
    pub request_id: Option<&'a str>,
    pub overlap_weight: Option<f64>,
    pub temperature: Option<f64>,
    /// Caches not to choose.
    pub exclude: &'a [WorkerWithDpRank],
    /// Its LoRA adapter, if any (its hashes are salted with it already).
    pub adapter: Option<&'a str>,
    /// Its session (`prompt_cache_key` or `x-session-id`), if any.
    pub session: Option<&'a str>,
}

/// The router's state, by concern; each part owns its locks.
#[derive(Debug)]
pub struct RouterState {
    pub config: RouterConfig,
    /// The KV index (its shards lock themselves; a leaf of the lock order).
    pub index: ShardedIndex,
    pub metrics: Metrics,
    /// The scheduler with its in-flight accounting, and approximate mode.
    placing: Placing,
    /// The worker registry and its health.
    fleet: Fleet,
    /// Predictions against answers, and the resyncs they ask for.
    checks: SelfChecks,
    /// Replica sync and the event stream, when NATS is configured (set once it starts).
    nats: OnceLock<NatsLinks>,
    /// What every ZMQ socket of the router may receive; refusals count in `metrics`.
    pub zmq: ZmqLimits,
}

#[derive(Debug)]
struct Placing {
    scheduler: Mutex<Scheduler>,
    /// Approximate mode's bookkeeping; its events go to the index under this lock, so each
    /// worker's assumed blocks are applied in order.
    approx: Mutex<ApproxTracker>,
}

#[derive(Debug)]
struct Fleet {
    workers: RwLock<BTreeMap<WorkerId, WorkerStatus>>,
    /// Signalled whenever a rank's readiness may have changed.
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct SelfChecks {
    /// Predictions against answers, per worker.
    per_worker: Mutex<Checks>,
    /// Ranks whose subscription should replay all its engine still buffers (after a drift).
    resync: Mutex<BTreeSet<WorkerWithDpRank>>,
    /// Whether `resync` may hold anything (checked on every event batch without the lock).
    pending: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RouterState {
    pub fn new(config: RouterConfig) -> Self {
        let mut scheduler_config = config.scheduler;
        scheduler_config.block_size = config.block_size;
        let state = Self {
            zmq: ZmqLimits::new(config.zmq_max_message_bytes),
            index: ShardedIndex::new(config.shards, config.index),
            metrics: Metrics::new(),
            placing: Placing {
                scheduler: Mutex::new(Scheduler::new(scheduler_config)),
                approx: Mutex::new(ApproxTracker::new(config.approx)),
            },
            fleet: Fleet { workers: RwLock::new(BTreeMap::new()), changed: Default::default() },
            checks: SelfChecks::default(),
            nats: OnceLock::new(),
            config,
        };
        for spec in &state.config.workers {
            state.add_worker(spec, true);
        }
        state
    }

    /// What `/health` says: always ok while the process serves (NATS away is degraded, not
    /// down: routing goes on from local state), with the NATS link's state when there is one.
    pub fn health(&self) -> serde_json::Value {
        match self.nats.get() {
            Some(n) => serde_json::json!({
                "status": "ok",
                "degraded": !n.status.connected(),
                "nats": n.summary(),
            }),
            None => serde_json::json!({"status": "ok", "degraded": false}),
        }
    }

    pub(crate) fn set_nats(&self, links: NatsLinks) {
        if self.nats.set(links).is_err() {
            tracing::warn!("NATS links set twice; keeping the first");
        }
    }

    /// The replica's NATS links (`None` without NATS).
    pub fn nats(&self) -> Option<&NatsLinks> {
        self.nats.get()
    }

    pub fn workers(&self) -> Vec<WorkerStatus> {
        let workers = self.read_workers();
        let lower = self.index.lower_tier_sizes();
        workers
            .values()
            .cloned()
            .map(|mut w| {
                w.tree_size = (0..w.dp_size)
                    .map(|r| self.index.tree_size(WorkerWithDpRank::new(w.id, r)))
                    .collect();
                w.lower_tier_blocks = (0..w.dp_size)
                    .map(|r| {
                        let rank = WorkerWithDpRank::new(w.id, r);
                        lower
                            .binary_search_by_key(&rank, |&(k, _)| k)
                            .map_or([0; 3], |i| lower[i].1)
                    })
                    .collect();
                if let Some(c) = lock(&self.checks.per_worker).workers.get(&w.id) {
                    w.checks = c.clone();
                }
                w
            })
            .collect()
    }

    /// The metrics registry, with the sizes read at scrape time brought up to date.
    pub fn registry(&self) -> &Registry {
        let m = &self.metrics;
        let stats = self.index.stats();
        m.index_blocks.set(stats.blocks as i64);
        m.index_held_blocks.set(stats.held_blocks as i64);
        m.index_budget.set(self.index.budget().map_or(-1, |b| b as i64));
        m.index_evicted.sync(stats.evicted_blocks);
        m.sync_zmq_refused();
        m.in_flight.set(self.in_flight() as i64);
        let (affinity, sessions) = self.affinity();
        m.sync_sessions(affinity, sessions);
        match self.nats.get() {
            Some(n) => {
                m.nats_connected.set(i64::from(n.status.connected()));
                m.replica_peers
                    .set(n.status.peers.load(std::sync::atomic::Ordering::Relaxed) as i64);
                let seq = n.status.applied_seq.load(std::sync::atomic::Ordering::Relaxed);
                m.stream_sequence.set(seq as i64);
            }
            None => {
                m.nats_connected.set(-1);
            }
        }
        for w in self.workers() {
            for rank in 0..w.dp_size {
                let labels = WorkerLabels { worker_id: w.id.0, dp_rank: rank };
                let r = rank as usize;
                m.worker_ready.get_or_create(&labels).set(i64::from(w.ready[r]));
                let blocks = BlocksLabels { worker_id: w.id.0, dp_rank: rank, mode: w.mode.name() };
                m.worker_blocks.get_or_create(&blocks).set(w.tree_size[r] as i64);
                for (tier, n) in StorageTier::LOWER.iter().zip(w.lower_tier_blocks[r]) {
                    let labels = TierLabels { worker_id: w.id.0, dp_rank: rank, tier: tier.name() };
                    m.worker_tier_blocks.get_or_create(&labels).set(n as i64);
                }
            }
            let id = WorkerIdLabels { worker_id: w.id.0 };
            m.worker_drifted.get_or_create(&id).set(i64::from(w.checks.drifted));
            m.worker_silent.get_or_create(&id).set(i64::from(w.checks.silent));
        }
        &m.registry
    }

    /// The Prometheus exposition of the router's metrics.
    pub fn render_metrics(&self) -> String {
        kvroute_http::metrics::encode(&[self.registry()]).unwrap_or_default()
    }
}

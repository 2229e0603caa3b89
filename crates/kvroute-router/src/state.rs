//! The router's shared state: the KV index, the scheduler, approximate mode, worker status
//! (with readiness) and metrics.
//!
//! A worker rank is **ready** when its event stream is connected and its replay has caught up
//! (workers without `events` need none), and, for a worker with `metrics`, a first load report
//! has arrived. A rank that is not ready is routed to only when no ready one is left, so the
//! first requests after start-up, or after an engine went away, do not land on a cache the
//! router cannot see.
//!
//! The state is split by owner, each a type with its own lock and methods: [`Fleet`], the
//! worker registry and health (`state/fleet.rs`); [`Placing`], the scheduler, in-flight
//! accounting and approximate mode (`state/placing.rs`); [`SelfChecks`], predictions against
//! answers (`state/answers.rs`); and the KV index, whose shards lock themselves. Events come
//! in through `state/events.rs` (a subscription's [`Ingest`] handle). `RouterState` composes
//! them: its own methods are the ones that cross owners, and each takes one owner's lock at a
//! time, except where written below. Replica sync lives in [`crate::nats`] and
//! [`crate::stream`], which reach the core through [`NatsLinks`].
//!
//! **Lock order.** No owner takes another's lock. Two are held at once only in this order:
//! `placing.approx` → the fleet's registry (a worker leaving or entering approximate mode,
//! so no assumed block is applied across the change); `placing.approx` → an index shard
//! (assumed blocks applied); `placing.scheduler` → an index shard (the scheduler reads the
//! index while it routes); the index's hybrid `groups` → a shard (a hybrid event); `flow`'s
//! queues → `placing`'s locks (a request placed as it leaves the queue, [`flow`]). The index's
//! shard locks are leaves. Everything else is an atomic.

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use kvroute_core::index::ShardedIndex;
use kvroute_core::{LocalBlockHash, StorageTier, WorkerId, WorkerWithDpRank};
use kvroute_http::metrics::Registry;
use kvroute_wire::transport::ZmqLimits;

use crate::config::RouterConfig;
use crate::links::NatsLinks;
use crate::metrics::{BlocksLabels, Metrics, TierLabels, WorkerIdLabels, WorkerLabels};

mod answers;
mod events;
mod fleet;
pub mod flow;
mod placing;

pub use answers::SelfChecks;
pub use events::Ingest;
use events::apply_one;
pub use fleet::{CacheMode, Fleet, Link, Parity, RankRefused, WorkerStatus};
pub(crate) use placing::PeerRouted;
pub use placing::Placing;

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
    /// Tokens its answer may run to (`max_tokens`; 0 when unknown).
    pub output_tokens: usize,
}

/// The router's state: its owners, composed (see the module docs).
#[derive(Debug)]
pub struct RouterState {
    pub config: RouterConfig,
    /// The KV index (its shards lock themselves; a leaf of the lock order).
    pub index: ShardedIndex,
    pub metrics: Metrics,
    placing: Placing,
    fleet: Fleet,
    checks: SelfChecks,
    /// Flow control's queues ([`flow`]); their lock comes before the scheduler's.
    flow: flow::Flow,
    /// Replica sync and the event stream, when NATS is configured (set once it starts).
    nats: OnceLock<NatsLinks>,
    /// What every ZMQ socket of the router may receive; refusals count in `metrics`.
    pub zmq: ZmqLimits,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RouterState {
    pub fn new(config: RouterConfig) -> Self {
        let state = Self {
            zmq: ZmqLimits::new(config.zmq_max_message_bytes),
            index: ShardedIndex::new(config.shards, config.index),
            metrics: Metrics::new(),
            placing: Placing::new(&config),
            fleet: Fleet::new(&config),
            checks: SelfChecks::default(),
            flow: flow::Flow::new(config.scheduler.flow),
            nats: OnceLock::new(),
            config,
        };
        for spec in &state.config.workers {
            let mut status = WorkerStatus::new(spec, true);
            if let Some(nats) = state.config.nats.as_ref().filter(|n| n.events.from_stream()) {
                // Its events come from the stream: ready once the stream's consumer caught up.
                status.follow_stream(format!("jetstream:{}.events.{}.*", nats.prefix, spec.id));
            }
            state.placing.add_worker(spec, &status.ready);
            for rank in 0..spec.dp_size {
                state.index.register_worker(WorkerWithDpRank::new(spec.id, rank));
            }
            state.fleet.insert(status);
        }
        state
    }

    /// The worker registry and its health.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// The scheduler, in-flight accounting and approximate mode.
    pub fn placing(&self) -> &Placing {
        &self.placing
    }

    /// Predictions against answers.
    pub fn checks(&self) -> &SelfChecks {
        &self.checks
    }

    /// Flow control's queues.
    pub fn flow(&self) -> &flow::Flow {
        &self.flow
    }

    /// Records a worker's parity probe. A failure (with its cause) makes its events untrusted:
    /// its blocks are cleared, its events ignored (counted as rejected `parity`) and it is
    /// routed approximately; `Ok` (or `Unchecked`, before a new probe) trusts them again. A
    /// probe put off (`Retrying`) does not undo a failure: the worker stays failed until a
    /// probe is made.
    pub fn set_parity(&self, worker: WorkerId, parity: Parity) {
        let mut approx = self.placing.approx();
        let change = self.fleet.set_parity(worker, parity);
        if change.leave_approximate {
            approx.remove_worker(worker);
        }
        if change.clear {
            self.index.clear_all_blocks(worker);
        }
    }

    /// Forgets every block of `worker` (all ranks): its engine is gone, its cache with it.
    pub fn forget_blocks(&self, worker: WorkerId) {
        let ranks = self.fleet.ranks(worker).unwrap_or(0);
        let held: usize =
            (0..ranks).map(|r| self.index.tree_size(WorkerWithDpRank::new(worker, r))).sum();
        if held == 0 {
            return;
        }
        self.index.clear_all_blocks(worker);
        tracing::info!(%worker, blocks = held, "its engine is unreachable: its blocks are forgotten");
    }

    /// Records a change to a rank's event subscription; the scheduler hears when its
    /// readiness changed.
    pub fn link(&self, worker: WorkerWithDpRank, link: Link) {
        if let Some(ready) = self.fleet.link(worker, link) {
            self.placing.scheduler().set_ready(worker, ready);
        }
        self.fleet.signal();
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

    /// Every worker's status, with its blocks in the index and its self-checks.
    pub fn workers(&self) -> Vec<WorkerStatus> {
        let lower = self.index.lower_tier_sizes();
        self.fleet
            .statuses()
            .into_iter()
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
                if let Some(c) = self.checks.status(w.id) {
                    w.checks = c;
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
        m.in_flight.set(self.placing.in_flight() as i64);
        let (affinity, sessions) = self.placing.affinity();
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
        for p in self.placing.prediction_stats() {
            m.ttft_correction.get_or_create(&WorkerLabels::from(p.worker)).set(p.factor);
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

//! The worker registry and health: what the router knows of each worker and rank (its
//! cache mode, parity, connection, readiness), and the one check of a rank named by outside
//! bytes. The registry is `RouterState::fleet` (a read-write lock and the readiness signal).

use std::collections::BTreeMap;
use std::sync::{PoisonError, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use kvroute_core::schedule::WorkerLoad;
use kvroute_core::{DpRank, WorkerId, WorkerWithDpRank};
use kvroute_wire::ConvertStats;
use serde::{Deserialize, Serialize};

use super::{RouterState, lock};
use crate::checks::CheckStatus;
use crate::config::WorkerSpec;

/// How the router knows a worker's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    /// From the KV events the engine publishes.
    Events,
    /// From its own routing decisions, for engines without events.
    Approximate,
}

impl CacheMode {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Events => "events",
            Self::Approximate => "approximate",
        }
    }
}

/// Whether a worker's KV events describe the blocks the front door hashes (the parity probe
/// at join: a known prompt sent to the worker, its announced blocks compared).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "cause")]
pub enum Parity {
    #[default]
    Unchecked,
    /// Not probed yet, and why: it is tried again after a backoff (its events trusted
    /// meanwhile).
    Retrying(String),
    Ok,
    /// Its events cannot be trusted: ignored, the worker routed approximately.
    Failed(String),
}

/// What the router knows of one worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerStatus {
    pub id: WorkerId,
    pub url: Option<String>,
    pub events: Option<String>,
    pub replay: Option<String>,
    pub metrics: Option<String>,
    pub mode: CacheMode,
    pub dp_size: u32,
    /// Per rank: ready to be routed to (see the module docs).
    pub ready: Vec<bool>,
    /// Per rank: is the event subscription connected, has its first replay caught up, and
    /// the last sequence number seen.
    pub connected: Vec<bool>,
    pub caught_up: Vec<bool>,
    pub last_seq: Vec<Option<u64>>,
    /// Per rank: blocks in the index and the last load report.
    pub tree_size: Vec<usize>,
    /// Per rank: blocks it keeps below its device, by tier (host, disk, external), by its
    /// events (filled in when read, like `tree_size`).
    pub lower_tier_blocks: Vec<[usize; 3]>,
    pub load: Vec<Option<WorkerLoad>>,
    /// What conversion did with the worker's event blocks (all ranks).
    pub conversion: ConvertStats,
    /// Known from configuration (false: it appeared through events).
    pub configured: bool,
    /// Its predictions against what it served: drift and silence (see [`crate::checks`]).
    pub checks: CheckStatus,
    pub parity: Parity,
    /// Ranks with an event subscription of their own (the configured ones).
    #[serde(skip)]
    subscribed: usize,
}

impl WorkerStatus {
    pub(super) fn new(spec: &WorkerSpec, configured: bool) -> Self {
        let n = spec.dp_size as usize;
        let mode = match (&spec.events, configured) {
            (None, true) => CacheMode::Approximate,
            _ => CacheMode::Events,
        };
        let mut status = Self {
            id: spec.id,
            url: spec.url.clone(),
            events: spec.events.clone(),
            replay: spec.replay.clone(),
            metrics: spec.metrics.clone(),
            mode,
            dp_size: spec.dp_size,
            ready: vec![false; n],
            connected: vec![false; n],
            caught_up: vec![false; n],
            last_seq: vec![None; n],
            tree_size: vec![0; n],
            lower_tier_blocks: vec![[0; 3]; n],
            load: vec![None; n],
            conversion: ConvertStats::default(),
            configured,
            checks: CheckStatus::default(),
            parity: Parity::Unchecked,
            subscribed: if configured { n } else { 0 },
        };
        for rank in 0..n {
            status.ready[rank] = status.rank_ready(rank);
        }
        status
    }

    pub(super) fn follow_stream(&mut self, source: String) {
        self.events = Some(source);
        self.mode = CacheMode::Events;
        for rank in 0..self.ready.len() {
            self.ready[rank] = self.rank_ready(rank);
        }
    }

    pub(super) fn rank_ready(&self, rank: usize) -> bool {
        // Workers and ranks learned from events are as ready as what brought them.
        rank >= self.subscribed || (self.stream_up(rank) && self.load_in(rank))
    }

    /// Its event stream (if it has one) connected and caught up at `rank`.
    pub(super) fn stream_up(&self, rank: usize) -> bool {
        self.events.is_none()
            || (self.connected.get(rank) == Some(&true) && self.caught_up.get(rank) == Some(&true))
    }

    /// Its first load report (if it sends any) in at `rank`.
    pub(super) fn load_in(&self, rank: usize) -> bool {
        self.metrics.is_none() || self.load.get(rank).is_some_and(Option::is_some)
    }

    /// What `rank` still waits for before it is ready: its event stream, its first load
    /// report, its parity probe (with the cause when the probe could not be made yet).
    pub fn waiting_for(&self, rank: usize) -> Vec<String> {
        let mut missing = Vec::new();
        if !self.stream_up(rank) {
            missing.push("its event stream".to_owned());
        }
        if !self.load_in(rank) {
            missing.push("its first load report".to_owned());
        }
        match &self.parity {
            Parity::Retrying(cause) => missing.push(format!("its parity probe ({cause})")),
            Parity::Unchecked if self.events.is_some() => {
                missing.push("its parity probe".to_owned());
            }
            _ => {}
        }
        missing
    }

    pub(super) fn grow(&mut self, n: usize) {
        if n <= self.connected.len() {
            return;
        }
        self.dp_size = n as u32;
        self.connected.resize(n, false);
        self.caught_up.resize(n, false);
        self.last_seq.resize(n, None);
        self.tree_size.resize(n, 0);
        self.lower_tier_blocks.resize(n, [0; 3]);
        self.load.resize(n, None);
        self.ready.resize(n, true);
    }
}

/// Why a rank named from outside was refused ([`RouterState::check_rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RankRefused {
    #[error("the worker is configured with dp_size {dp_size}")]
    NotConfigured { dp_size: u32 },
    #[error("dp_rank must be below max_dp_size {max_dp_size}")]
    AboveMax { max_dp_size: u32 },
}

/// What the router knows of an event's worker.
pub(super) enum Known {
    No,
    /// The worker, not this rank.
    Worker {
        configured: bool,
    },
    Rank,
}

impl RouterState {
    pub(super) fn add_worker(&self, spec: &WorkerSpec, configured: bool) {
        let mut status = WorkerStatus::new(spec, configured);
        if let Some(nats) = self.config.nats.as_ref().filter(|n| n.events.from_stream()) {
            // Its events come from the stream: ready once the stream's consumer caught up.
            status.follow_stream(format!("jetstream:{}.events.{}.*", nats.prefix, spec.id));
        }
        let mut scheduler = lock(&self.placing.scheduler);
        for rank in 0..spec.dp_size {
            let w = WorkerWithDpRank::new(spec.id, rank);
            scheduler.add_worker(w);
            scheduler.set_ready(w, status.ready[rank as usize]);
            scheduler.set_role(
                w,
                spec.role,
                kvroute_core::schedule::pairs::node_id(spec.node.as_deref()),
            );
            if let Some(slots) = spec.max_loras {
                scheduler.adapters_mut().report(w, Some(slots), &[]);
            }
            self.index.register_worker(w);
        }
        drop(scheduler);
        self.write_workers().entry(spec.id).or_insert(status);
    }

    /// A worker seen in events but not configured becomes a candidate (the standalone router
    /// learns its fleet from `/events` and `/debug/inject_event`).
    pub(super) fn ensure_worker(&self, worker: WorkerWithDpRank) {
        let (known, approximate) =
            self.read_workers().get(&worker.worker_id).map_or((false, false), |w| {
                (worker.dp_rank.0 < w.dp_size, w.mode == CacheMode::Approximate)
            });
        if approximate {
            self.leave_approximate(worker.worker_id);
        }
        if known {
            return;
        }
        let mut workers = self.write_workers();
        match workers.get_mut(&worker.worker_id) {
            // A rank beyond the known ones: grow the per-rank tables.
            Some(status) => status.grow(worker.dp_rank.0 as usize + 1),
            None => {
                let mut spec = WorkerSpec::new(worker.worker_id.0);
                spec.dp_size = worker.dp_rank.0 + 1;
                workers.insert(worker.worker_id, WorkerStatus::new(&spec, false));
            }
        }
        drop(workers);
        lock(&self.placing.scheduler).add_worker(worker);
    }

    /// A worker configured without `events` whose events arrive all the same (posted to
    /// `/events`): what the router assumed of it gives way to what it says.
    pub(super) fn leave_approximate(&self, worker: WorkerId) {
        let mut approx = lock(&self.placing.approx);
        let mut workers = self.write_workers();
        let Some(status) = workers.get_mut(&worker) else { return };
        if status.mode != CacheMode::Approximate {
            return;
        }
        status.mode = CacheMode::Events;
        approx.remove_worker(worker);
        self.index.clear_all_blocks(worker);
        tracing::info!(%worker, "events arrive for a worker routed approximately: following its events");
    }

    /// Whether the worker's last parity probe failed.
    pub fn parity_failed(&self, worker: WorkerId) -> bool {
        self.read_workers().get(&worker).is_some_and(|w| matches!(w.parity, Parity::Failed(_)))
    }

    /// Records a worker's parity probe. A failure (with its cause) makes its events untrusted:
    /// its blocks are cleared, its events ignored (counted as rejected `parity`) and it is
    /// routed approximately; `Ok` (or `Unchecked`, before a new probe) trusts them again. A
    /// probe put off (`Retrying`) does not undo a failure: the worker stays failed until a
    /// probe is made.
    pub fn set_parity(&self, worker: WorkerId, parity: Parity) {
        let failed = matches!(parity, Parity::Failed(_));
        let mut approx = lock(&self.placing.approx);
        let mut workers = self.write_workers();
        let Some(status) = workers.get_mut(&worker) else { return };
        let was_failed = matches!(status.parity, Parity::Failed(_));
        if was_failed && matches!(parity, Parity::Retrying(_)) {
            return;
        }
        status.parity = parity;
        if failed && status.mode == CacheMode::Events {
            status.mode = CacheMode::Approximate;
            self.index.clear_all_blocks(worker);
        } else if !failed && was_failed && status.events.is_some() {
            status.mode = CacheMode::Events;
            approx.remove_worker(worker);
            self.index.clear_all_blocks(worker);
        }
    }

    /// Forgets every block of `worker` (all ranks): its engine is gone, its cache with it.
    pub fn forget_blocks(&self, worker: WorkerId) {
        let ranks = self.read_workers().get(&worker).map_or(0, |w| w.dp_size);
        let held: usize =
            (0..ranks).map(|r| self.index.tree_size(WorkerWithDpRank::new(worker, r))).sum();
        if held == 0 {
            return;
        }
        self.index.clear_all_blocks(worker);
        tracing::info!(%worker, blocks = held, "its engine is unreachable: its blocks are forgotten");
    }

    /// Whether `rank` is within the configured bound of data-parallel ranks.
    pub fn valid_dp_rank(&self, rank: DpRank) -> bool {
        rank.0 < self.config.max_dp_size
    }

    /// The one check of a rank named by outside bytes (engine events, `/events`,
    /// `/answers`, `/debug/inject_event`). A configured worker has exactly the ranks of its
    /// `dp_size`: bytes never add one. A worker the router learned from posted events (no
    /// worker configured) may be named at any rank below `max_dp_size`, as may one not
    /// known yet.
    pub fn check_rank(&self, worker: WorkerWithDpRank) -> Result<(), RankRefused> {
        match self.knows(worker) {
            Known::Rank => Ok(()),
            Known::Worker { configured: true } => {
                let dp_size = self.read_workers().get(&worker.worker_id).map_or(1, |w| w.dp_size);
                Err(RankRefused::NotConfigured { dp_size })
            }
            Known::Worker { configured: false } | Known::No
                if self.valid_dp_rank(worker.dp_rank) =>
            {
                Ok(())
            }
            _ => Err(RankRefused::AboveMax { max_dp_size: self.config.max_dp_size }),
        }
    }

    pub(super) fn knows(&self, worker: WorkerWithDpRank) -> Known {
        match self.read_workers().get(&worker.worker_id) {
            None => Known::No,
            Some(w) if worker.dp_rank.0 < w.dp_size => Known::Rank,
            Some(w) => Known::Worker { configured: w.configured },
        }
    }

    /// Whether the worker is configured or was learned.
    pub fn knows_worker(&self, worker: WorkerId) -> bool {
        self.read_workers().contains_key(&worker)
    }

    pub(super) fn knows_rank(&self, worker: WorkerWithDpRank) -> bool {
        matches!(self.knows(worker), Known::Rank)
    }

    /// Whether a posted event may add a worker.
    pub(super) fn may_learn(&self) -> bool {
        self.config.workers.is_empty()
            && self.read_workers().len() < self.config.max_learned_workers
    }

    pub(super) fn mode(&self, worker: WorkerId) -> Option<CacheMode> {
        self.read_workers().get(&worker).map(|w| w.mode)
    }

    /// Whether any configured worker is routed in approximate mode.
    pub fn has_approximate(&self) -> bool {
        self.read_workers().values().any(|w| w.mode == CacheMode::Approximate)
    }

    /// The event stream's consumer has seen what the stream held: every worker that follows
    /// it is connected and caught up.
    pub(crate) fn stream_caught_up(&self) {
        let ranks: Vec<WorkerWithDpRank> = self
            .read_workers()
            .values()
            .filter(|w| w.configured)
            .flat_map(|w| (0..w.dp_size).map(move |r| WorkerWithDpRank::new(w.id, r)))
            .collect();
        for w in ranks {
            self.update_rank(w, |s, rank| {
                s.connected[rank] = true;
                s.caught_up[rank] = true;
            });
        }
    }

    /// Records a subscription's state (connection, last sequence number seen).
    pub fn set_connection(&self, worker: WorkerWithDpRank, connected: bool, last_seq: Option<u64>) {
        self.update_rank(worker, |w, rank| {
            w.connected[rank] = connected;
            if !connected {
                w.caught_up[rank] = false;
            }
            w.last_seq[rank] = last_seq.or(w.last_seq[rank]);
        });
    }

    /// A subscription's first replay after connecting is done (or there is no replay).
    pub fn set_caught_up(&self, worker: WorkerWithDpRank) {
        self.update_rank(worker, |w, rank| w.caught_up[rank] = true);
    }

    /// Changes one rank's status and re-derives its readiness.
    pub(super) fn update_rank(
        &self,
        worker: WorkerWithDpRank,
        f: impl FnOnce(&mut WorkerStatus, usize),
    ) {
        let rank = worker.dp_rank.0 as usize;
        let mut workers = self.write_workers();
        let Some(w) = workers.get_mut(&worker.worker_id) else { return };
        if rank >= w.connected.len() {
            return;
        }
        f(w, rank);
        let ready = w.rank_ready(rank);
        if ready != w.ready[rank] {
            w.ready[rank] = ready;
            drop(workers);
            lock(&self.placing.scheduler).set_ready(worker, ready);
            tracing::debug!(%worker, ready, "readiness changed");
        } else {
            drop(workers);
        }
        self.fleet.changed.notify_waiters();
    }

    /// The ranks not ready now.
    pub fn not_ready(&self) -> Vec<WorkerWithDpRank> {
        let workers = self.read_workers();
        workers
            .values()
            .flat_map(|w| {
                w.ready
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| !**r)
                    .map(|(rank, _)| WorkerWithDpRank::new(w.id, rank as u32))
            })
            .collect()
    }

    /// Waits until every rank is ready or `timeout` passes; returns the ranks still not ready.
    pub async fn wait_ready(&self, timeout: Duration) -> Vec<WorkerWithDpRank> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.fleet.changed.notified();
            let waiting = self.not_ready();
            if waiting.is_empty() || tokio::time::Instant::now() >= deadline {
                return waiting;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    pub(super) fn read_workers(&self) -> RwLockReadGuard<'_, BTreeMap<WorkerId, WorkerStatus>> {
        self.fleet.workers.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn write_workers(&self) -> RwLockWriteGuard<'_, BTreeMap<WorkerId, WorkerStatus>> {
        self.fleet.workers.write().unwrap_or_else(PoisonError::into_inner)
    }
}

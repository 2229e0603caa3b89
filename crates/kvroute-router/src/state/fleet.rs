//! The fleet: what the router knows of each worker and rank (its cache mode, parity,
//! connection, readiness), and the one check of a rank named by outside bytes.
//!
//! [`Fleet`] owns the registry (one read-write lock) and the readiness signal, and takes no
//! other lock of the router: where a change here must reach the scheduler or the index (a
//! rank's readiness, a worker's mode), its method says so in what it returns and
//! [`super::RouterState`] carries it over. What an event subscription writes on every batch
//! (the last sequence number, conversion counts, whether the worker's events are trusted)
//! is a worker's [`Live`] part, shared with the subscription's
//! [`super::events::Ingest`] handle, so a batch takes no registry lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use kvroute_core::schedule::WorkerLoad;
use kvroute_core::{BlockSize, DpRank, WorkerId, WorkerWithDpRank};
use kvroute_wire::ConvertStats;
use serde::{Deserialize, Serialize};

use super::lock::lock;
use crate::checks::CheckStatus;
use crate::config::{RouterConfig, WorkerSpec};

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
    pub(crate) fn name(self) -> &'static str {
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
    /// What its subscriptions write per batch (`last_seq` and `conversion` are read from it).
    #[serde(skip)]
    pub(super) live: Arc<Live>,
}

/// The part of a worker's status its event subscriptions write on every batch, without the
/// registry's lock: atomics, and one mutex no other path takes while it is held.
#[derive(Debug, Default)]
pub(crate) struct Live {
    /// Its parity probe failed: its events are ignored (counted as rejected `parity`).
    pub(super) untrusted: AtomicBool,
    /// Per configured rank: the last sequence number seen, plus one (0: none yet).
    last_seq: Box<[AtomicU64]>,
    /// What conversion did with its event blocks (all ranks).
    conversion: Mutex<ConvertStats>,
}

impl Live {
    fn new(ranks: usize) -> Self {
        Self { last_seq: (0..ranks).map(|_| AtomicU64::new(0)).collect(), ..Self::default() }
    }

    /// Batch `seq` of `rank` was handled.
    pub(super) fn seen(&self, rank: usize, seq: u64) {
        if let Some(last) = self.last_seq.get(rank) {
            last.store(seq.saturating_add(1), Ordering::Relaxed);
        }
    }

    fn last_seq(&self, rank: usize) -> Option<u64> {
        let n = self.last_seq.get(rank)?.load(Ordering::Relaxed);
        n.checked_sub(1)
    }

    /// Adds what conversion did with one message of `worker`'s; the first blocks of another
    /// size are logged as an error (its events cannot be used).
    pub(super) fn converted(&self, worker: WorkerWithDpRank, stats: &ConvertStats, bs: BlockSize) {
        let mut total = lock(&self.conversion);
        if total.wrong_block_size == 0 && stats.wrong_block_size > 0 {
            tracing::error!(
                worker = %worker,
                engine_block_size = ?stats.seen_block_size,
                router_block_size = bs.get(),
                "the worker publishes blocks of another size: its KV events are ignored (set block_size for this worker or the router to match the engine)"
            );
        }
        *total += *stats;
    }
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
            live: Arc::new(Live::new(if configured { n } else { 0 })),
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

/// Why a rank named from outside was refused ([`Fleet::check_rank`]).
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

/// A change to one rank's event subscription.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Connected; the last sequence number seen before, if any.
    Connected(Option<u64>),
    Disconnected,
    /// Its first replay after connecting is done (or there is no replay).
    CaughtUp,
}

/// What a change of parity asks of the index and approximate mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ParityChange {
    /// Forget every block of the worker.
    pub clear: bool,
    /// Forget what approximate mode assumed of it.
    pub leave_approximate: bool,
}

/// What learning an event's rank asks of the scheduler and approximate mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Learned {
    /// The rank is new: the scheduler must know it.
    pub new_rank: bool,
    /// The worker was routed approximately and now follows its events.
    pub left_approximate: bool,
}

/// The worker registry and its health (see the module docs).
#[derive(Debug)]
pub struct Fleet {
    workers: RwLock<BTreeMap<WorkerId, WorkerStatus>>,
    /// Signalled whenever a rank's readiness may have changed.
    changed: tokio::sync::Notify,
    max_dp_size: u32,
    /// Posted events may add workers (none configured), up to this many.
    learn_up_to: usize,
}

impl Fleet {
    pub(super) fn new(config: &RouterConfig) -> Self {
        Self {
            workers: RwLock::new(BTreeMap::new()),
            changed: Default::default(),
            max_dp_size: config.max_dp_size,
            learn_up_to: if config.workers.is_empty() { config.max_learned_workers } else { 0 },
        }
    }

    pub(super) fn insert(&self, status: WorkerStatus) {
        self.write().entry(status.id).or_insert(status);
    }

    /// Every worker's status (`tree_size`, `lower_tier_blocks` and `checks` are left to the
    /// caller, who owns them).
    pub fn statuses(&self) -> Vec<WorkerStatus> {
        let workers = self.read();
        workers
            .values()
            .map(|w| {
                let mut w = w.clone();
                for (rank, seq) in w.last_seq.iter_mut().enumerate() {
                    *seq = w.live.last_seq(rank);
                }
                w.conversion = *lock(&w.live.conversion);
                w
            })
            .collect()
    }

    /// A worker's ranks (`dp_size`), `None` when it is not known.
    pub fn ranks(&self, worker: WorkerId) -> Option<u32> {
        self.read().get(&worker).map(|w| w.dp_size)
    }

    /// A worker's per-batch part, for an event subscription.
    pub(super) fn live(&self, worker: WorkerId) -> Option<Arc<Live>> {
        self.read().get(&worker).map(|w| Arc::clone(&w.live))
    }

    /// Whether the worker's last parity probe failed.
    pub fn parity_failed(&self, worker: WorkerId) -> bool {
        self.read().get(&worker).is_some_and(|w| matches!(w.parity, Parity::Failed(_)))
    }

    /// Records a parity probe (see [`super::RouterState::set_parity`]); returns what the
    /// index and approximate mode must forget.
    pub(super) fn set_parity(&self, worker: WorkerId, parity: Parity) -> ParityChange {
        let failed = matches!(parity, Parity::Failed(_));
        let mut workers = self.write();
        let Some(status) = workers.get_mut(&worker) else { return ParityChange::default() };
        let was_failed = matches!(status.parity, Parity::Failed(_));
        if was_failed && matches!(parity, Parity::Retrying(_)) {
            return ParityChange::default();
        }
        status.parity = parity;
        status.live.untrusted.store(failed, Ordering::Release);
        if failed && status.mode == CacheMode::Events {
            status.mode = CacheMode::Approximate;
            return ParityChange { clear: true, leave_approximate: false };
        }
        if !failed && was_failed && status.events.is_some() {
            status.mode = CacheMode::Events;
            return ParityChange { clear: true, leave_approximate: true };
        }
        ParityChange::default()
    }

    /// Whether `rank` is within the configured bound of data-parallel ranks.
    pub fn valid_dp_rank(&self, rank: DpRank) -> bool {
        rank.0 < self.max_dp_size
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
                let dp_size = self.ranks(worker.worker_id).unwrap_or(1);
                Err(RankRefused::NotConfigured { dp_size })
            }
            Known::Worker { configured: false } | Known::No
                if self.valid_dp_rank(worker.dp_rank) =>
            {
                Ok(())
            }
            _ => Err(RankRefused::AboveMax { max_dp_size: self.max_dp_size }),
        }
    }

    pub(super) fn knows(&self, worker: WorkerWithDpRank) -> Known {
        match self.read().get(&worker.worker_id) {
            None => Known::No,
            Some(w) if worker.dp_rank.0 < w.dp_size => Known::Rank,
            Some(w) => Known::Worker { configured: w.configured },
        }
    }

    /// Whether the worker is configured or was learned.
    pub fn knows_worker(&self, worker: WorkerId) -> bool {
        self.read().contains_key(&worker)
    }

    /// Whether a posted event may add a worker.
    pub(super) fn may_learn(&self) -> bool {
        self.learn_up_to > 0 && self.read().len() < self.learn_up_to
    }

    pub fn mode(&self, worker: WorkerId) -> Option<CacheMode> {
        self.read().get(&worker).map(|w| w.mode)
    }

    /// Whether any configured worker is routed in approximate mode.
    pub fn has_approximate(&self) -> bool {
        self.read().values().any(|w| w.mode == CacheMode::Approximate)
    }

    /// A rank seen in events becomes known (the standalone router learns its fleet from
    /// `/events` and `/debug/inject_event`), and a worker configured without `events` whose
    /// events arrive all the same (posted to `/events`) follows them from now on.
    pub(super) fn learn(&self, worker: WorkerWithDpRank) -> Learned {
        let (known, approximate) = self.read().get(&worker.worker_id).map_or((false, false), |w| {
            (worker.dp_rank.0 < w.dp_size, w.mode == CacheMode::Approximate)
        });
        if known && !approximate {
            return Learned::default();
        }
        let mut workers = self.write();
        let mut learned = Learned::default();
        match workers.get_mut(&worker.worker_id) {
            Some(status) => {
                if status.mode == CacheMode::Approximate {
                    status.mode = CacheMode::Events;
                    learned.left_approximate = true;
                    tracing::info!(worker = %worker.worker_id, "events arrive for a worker routed approximately: following its events");
                }
                if worker.dp_rank.0 >= status.dp_size {
                    // A rank beyond the known ones: grow the per-rank tables.
                    status.grow(worker.dp_rank.0 as usize + 1);
                    learned.new_rank = true;
                }
            }
            None => {
                let mut spec = WorkerSpec::new(worker.worker_id.0);
                spec.dp_size = worker.dp_rank.0 + 1;
                workers.insert(worker.worker_id, WorkerStatus::new(&spec, false));
                learned.new_rank = true;
            }
        }
        learned
    }

    /// The ranks of every configured worker.
    pub fn configured_ranks(&self) -> Vec<WorkerWithDpRank> {
        self.read()
            .values()
            .filter(|w| w.configured)
            .flat_map(|w| (0..w.dp_size).map(move |r| WorkerWithDpRank::new(w.id, r)))
            .collect()
    }

    /// Records a change to a rank's subscription; returns its readiness when that changed
    /// (the caller tells the scheduler, then [`Self::signal`]s).
    pub(super) fn link(&self, worker: WorkerWithDpRank, link: Link) -> Option<bool> {
        self.update_rank(worker, |w, rank| match link {
            Link::Connected(last) => {
                w.connected[rank] = true;
                if let Some(seq) = last {
                    w.live.seen(rank, seq);
                }
            }
            Link::Disconnected => {
                w.connected[rank] = false;
                w.caught_up[rank] = false;
            }
            Link::CaughtUp => w.caught_up[rank] = true,
        })
    }

    /// Records a rank's load report; returns its readiness when that changed.
    pub(super) fn set_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) -> Option<bool> {
        self.update_rank(worker, |w, rank| w.load[rank] = Some(load))
    }

    /// Changes one rank's status and re-derives its readiness; returns it when it changed.
    fn update_rank(
        &self,
        worker: WorkerWithDpRank,
        f: impl FnOnce(&mut WorkerStatus, usize),
    ) -> Option<bool> {
        let rank = worker.dp_rank.0 as usize;
        let changed = {
            let mut workers = self.write();
            let w = workers.get_mut(&worker.worker_id)?;
            if rank >= w.connected.len() {
                return None;
            }
            f(w, rank);
            let ready = w.rank_ready(rank);
            let changed = ready != w.ready[rank];
            w.ready[rank] = ready;
            changed.then_some(ready)
        };
        if let Some(ready) = changed {
            tracing::debug!(%worker, ready, "readiness changed");
        }
        changed
    }

    /// Wakes whoever waits for readiness ([`Self::wait_ready`]): called once the change
    /// reached the scheduler too, so a waiter that sees a rank ready can be routed to it.
    pub(super) fn signal(&self) {
        self.changed.notify_waiters();
    }

    /// The ranks not ready now.
    pub fn not_ready(&self) -> Vec<WorkerWithDpRank> {
        let workers = self.read();
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
            let changed = self.changed.notified();
            let waiting = self.not_ready();
            if waiting.is_empty() || tokio::time::Instant::now() >= deadline {
                return waiting;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<WorkerId, WorkerStatus>> {
        self.workers.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, BTreeMap<WorkerId, WorkerStatus>> {
        self.workers.write().unwrap_or_else(PoisonError::into_inner)
    }
}

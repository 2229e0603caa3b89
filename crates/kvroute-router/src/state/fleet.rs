//! The fleet: what the router knows of each worker and rank (its cache mode, parity,
//! connection, readiness), and the one check of a rank named by outside bytes.
//!
//! [`Fleet`] owns the registry (one read-write lock) and the readiness signal, and takes no
//! other lock of the router: where a change here must reach the scheduler or the index (a
//! rank's readiness, a worker's mode), its method says so in what it returns and
//! [`super::RouterState`] carries it over. What an event subscription writes on every batch
//! (the last sequence number, conversion counts, whether the worker's events are trusted)
//! is a worker's [`Live`] part (`status.rs`), shared with the subscription's
//! [`super::ingest::Ingest`] handle, so a batch takes no registry lock.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use kvroute_core::schedule::WorkerLoad;
use kvroute_core::{DpRank, WorkerId, WorkerWithDpRank};

use super::lock::lock;
use crate::config::{RouterConfig, WorkerSpec};

use super::status::{CacheMode, Live, Parity, WorkerStatus};

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

/// What a change of parity asks of the index, approximate mode and the scheduler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ParityChange {
    /// Forget every block of the worker.
    pub clear: bool,
    /// Forget what approximate mode assumed of it.
    pub leave_approximate: bool,
    /// Ranks whose readiness changed (a worker that waited for its probe).
    pub ready: Vec<(WorkerWithDpRank, bool)>,
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
    /// Tokens per block the router reads events as (a worker's own `block_size` aside).
    block_size: u32,
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
            block_size: config.block_size.get(),
            learn_up_to: if config.workers.is_empty() { config.max_learned_workers } else { 0 },
        }
    }

    pub(super) fn insert(&self, status: WorkerStatus) {
        self.write().entry(status.id).or_insert(status);
    }

    /// Adds a worker joining while the router runs; `false` (nothing changed) when its id is
    /// known already.
    pub(super) fn join(&self, status: WorkerStatus) -> bool {
        let mut workers = self.write();
        if workers.contains_key(&status.id) {
            return false;
        }
        workers.insert(status.id, status);
        true
    }

    /// Marks a worker as leaving; its ranks (`None`: not known).
    pub(super) fn drain(&self, worker: WorkerId) -> Option<u32> {
        let mut workers = self.write();
        let status = workers.get_mut(&worker)?;
        status.draining = true;
        Some(status.dp_size)
    }

    /// Takes a worker out of the registry.
    pub(super) fn remove(&self, worker: WorkerId) -> Option<WorkerStatus> {
        let status = self.write().remove(&worker)?;
        status.live.gone.store(true, Ordering::SeqCst);
        Some(status)
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

    /// `rank`'s event stream resumes after batch `seq` (a saved state, [`crate::saved`]).
    pub(crate) fn resume_at(&self, rank: WorkerWithDpRank, seq: u64) {
        if let Some(live) = self.live(rank.worker_id) {
            live.seen(rank.dp_rank.0 as usize, seq);
        }
    }

    /// The last event batch seen of `rank`, when any.
    pub(crate) fn last_seq(&self, rank: WorkerWithDpRank) -> Option<u64> {
        self.live(rank.worker_id)?.last_seq(rank.dp_rank.0 as usize)
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
        let mut change = ParityChange::default();
        for rank in 0..status.ready.len() {
            let ready = status.rank_ready(rank);
            if ready != status.ready[rank] {
                status.ready[rank] = ready;
                change.ready.push((WorkerWithDpRank::new(worker, rank as u32), ready));
            }
        }
        if failed && status.mode == CacheMode::Events {
            status.mode = CacheMode::Approximate;
            change.clear = true;
        } else if !failed && was_failed && status.events.is_some() {
            status.mode = CacheMode::Events;
            (change.clear, change.leave_approximate) = (true, true);
        }
        change
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

    /// Records a rank's load report; returns its readiness when that changed (refused when
    /// its engine's block size is not the router's).
    pub(super) fn set_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) -> Option<bool> {
        let router = self.block_size;
        self.update_rank(worker, |w, rank| {
            w.load[rank] = Some(load);
            if let Some(engine) = load.block_size {
                w.engine_block_size(engine, router);
            }
        })
    }

    /// The worker's events carry blocks of `engine` tokens, not the router's: it is refused.
    /// Its ranks, when that is new (none else).
    pub(super) fn refuse_block_size(&self, worker: WorkerId, engine: u32) -> Vec<WorkerWithDpRank> {
        let mut workers = self.write();
        let Some(w) = workers.get_mut(&worker) else { return Vec::new() };
        if !w.engine_block_size(engine, self.block_size) {
            return Vec::new();
        }
        w.ready.iter_mut().for_each(|r| *r = false);
        (0..w.ready.len()).map(|rank| WorkerWithDpRank::new(worker, rank as u32)).collect()
    }

    /// Whether the worker is refused (see [`WorkerStatus::refused`]).
    pub fn refused(&self, worker: WorkerId) -> bool {
        self.read().get(&worker).is_some_and(|w| w.refused.is_some())
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

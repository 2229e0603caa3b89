//! The self-checks as they act on the router: answers recorded, drifted workers discounted
//! and resynchronised, event streams seen (the checks themselves are [`crate::check_status`]).
//! [`SelfChecks`] owns two mutexes, never held together and never with another lock of the
//! router held under them.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvroute_core::index::OverlapScores;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::router_api::Answered;

use super::lock::lock;
use crate::check_status::{Change, CheckStatus, Checks, Outcome};

/// Predictions against answers, and the resyncs they ask for.
#[derive(Debug, Default)]
pub struct SelfChecks {
    /// Predictions against answers, per worker.
    per_worker: Mutex<Checks>,
    /// Ranks whose subscription should replay all its engine still buffers (after a drift).
    resync: Mutex<BTreeSet<WorkerWithDpRank>>,
    /// Whether `resync` may hold anything (checked on every event batch without the lock).
    pending: AtomicBool,
}

impl SelfChecks {
    /// Forgets a worker that left the fleet.
    pub(super) fn forget(&self, worker: WorkerId) {
        lock(&self.per_worker).workers.remove(&worker);
        lock(&self.resync).retain(|w| w.worker_id != worker);
    }

    /// A worker's record, if it has one.
    pub fn status(&self, worker: WorkerId) -> Option<CheckStatus> {
        lock(&self.per_worker).workers.get(&worker).cloned()
    }

    /// Records one answer's prediction against what was served.
    pub(super) fn record(&self, a: &Answered, expects_events: bool) -> (Outcome, Change) {
        let mut checks = lock(&self.per_worker);
        let status = checks.workers.entry(a.worker_id).or_default();
        let recorded = status.record(a.predicted_cached_tokens, a.cached_tokens, expects_events);
        status.tiers.record(a.predicted_tier_tokens, recorded.0);
        recorded
    }

    /// Asks each of `ranks` to replay all its engine buffers, once.
    pub(super) fn ask_resync(&self, ranks: impl IntoIterator<Item = WorkerWithDpRank>) {
        lock(&self.resync).extend(ranks);
        self.pending.store(true, Ordering::Release);
    }

    /// Whether `worker`'s subscription should replay everything its engine buffers (once).
    pub fn take_resync(&self, worker: WorkerWithDpRank) -> bool {
        if !self.pending.load(Ordering::Acquire) {
            return false;
        }
        let mut resync = lock(&self.resync);
        let taken = resync.remove(&worker);
        if resync.is_empty() {
            self.pending.store(false, Ordering::Release);
        }
        taken
    }

    /// A drifted worker's score counts half (asked per scored worker, not of every worker:
    /// a decision over a thousand workers scores a few).
    pub(super) fn halve_drifted(&self, scores: &mut OverlapScores) {
        if scores.scores.is_empty() {
            return;
        }
        let checks = lock(&self.per_worker);
        for (w, score) in &mut scores.scores {
            if checks.workers.get(&w.worker_id).is_some_and(|c| c.drifted) {
                *score /= 2;
            }
        }
    }

    /// The worker's event stream delivered something (it is not silent).
    pub(super) fn event_seen(&self, worker: WorkerId) {
        lock(&self.per_worker).workers.entry(worker).or_default().event_seen(Instant::now());
    }
}

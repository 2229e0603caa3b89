//! The self-checks as they act on the router: answers recorded, drifted workers discounted
//! and resynchronised, event streams seen (the checks themselves are [`crate::checks`]).
//! [`SelfChecks`] owns two mutexes, never held together and never with another lock of the
//! router held under them.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvroute_core::index::OverlapScores;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::router_api::Answered;

use super::{CacheMode, RouterState, lock};
use crate::checks::{Change, CheckStatus, Checks, Outcome};

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
    /// A worker's record, if it has one.
    pub fn status(&self, worker: WorkerId) -> Option<CheckStatus> {
        lock(&self.per_worker).workers.get(&worker).cloned()
    }

    /// Records one answer's prediction against what was served.
    fn record(&self, a: &Answered, expects_events: bool) -> (Outcome, Change) {
        let mut checks = lock(&self.per_worker);
        let status = checks.workers.entry(a.worker_id).or_default();
        let recorded = status.record(a.predicted_cached_tokens, a.cached_tokens, expects_events);
        status.tiers.record(a.predicted_tier_tokens, recorded.0);
        recorded
    }

    /// Asks each of `ranks` to replay all its engine buffers, once.
    fn ask_resync(&self, ranks: impl IntoIterator<Item = WorkerWithDpRank>) {
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
use crate::metrics::{PredictionLabels, TierPredictionLabels, TierTokenLabels, WorkerIdLabels};

impl RouterState {
    /// Records an answered request (from this process's front door, or one posted to
    /// `/answers`): the cached tokens predicted against those the engine served. Counts it,
    /// and acts on what it shows: a worker found drifted is logged, its blocks cleared and its
    /// subscription asked to replay; one serving without events is flagged. A worker the
    /// router does not know is refused (`false`).
    pub fn record_answer(&self, a: &Answered) -> bool {
        let id = a.worker_id;
        if !self.fleet.knows_worker(id) || self.fleet.check_rank(a.worker()).is_err() {
            return false;
        }
        let (predicted, actual) = (a.predicted_cached_tokens, a.cached_tokens);
        // Only an answer for which the engine computed a full block it did not hold must have
        // produced an event (see `checks`); a worker routed approximately publishes none by
        // design.
        let bs = self.config.block_size.tokens() as u64;
        let stores = a.prompt_tokens >= actual.saturating_add(2 * bs);
        let expects_events = self.fleet.mode(id) == Some(CacheMode::Events);
        let (outcome, change) = self.checks.record(a, stores && expects_events);
        let m = &self.metrics;
        let labels = WorkerIdLabels { worker_id: id.0 };
        m.prompt_tokens.get_or_create(&labels).inc_by(a.prompt_tokens);
        m.cached_tokens.get_or_create(&labels).inc_by(actual.min(a.prompt_tokens));
        m.predicted_tokens.get_or_create(&labels).inc_by(predicted.min(a.prompt_tokens));
        m.predictions
            .get_or_create(&PredictionLabels { worker_id: id.0, outcome: outcome.name() })
            .inc();
        m.prediction_error
            .get_or_create(&WorkerIdLabels { worker_id: id.0 })
            .observe(predicted.abs_diff(actual) as f64);
        let tiers = crate::checks::TierChecks::NAMES.into_iter().zip(a.predicted_tier_tokens);
        for (tier, tokens) in tiers.filter(|&(_, n)| n > 0) {
            let outcome = outcome.name();
            m.tier_predictions
                .get_or_create(&TierPredictionLabels { worker_id: id.0, tier, outcome })
                .inc();
            m.tier_tokens.get_or_create(&TierTokenLabels { worker_id: id.0, tier }).inc_by(tokens);
        }
        match change {
            Change::None => {}
            Change::Drifted => {
                m.drifts.get_or_create(&WorkerIdLabels { worker_id: id.0 }).inc();
                tracing::warn!(worker = %id, "the index no longer matches the worker's cache (predictions over what it serves): resynchronising, its overlaps discounted until they agree");
                self.index.clear_all_blocks(id);
                let ranks = self.fleet.ranks(id).unwrap_or(1);
                self.checks.ask_resync((0..ranks).map(|r| WorkerWithDpRank::new(id, r)));
            }
            Change::Recovered => {
                tracing::info!(worker = %id, "predictions agree with the worker again");
            }
            Change::Silent => tracing::warn!(
                worker = %id,
                "the worker serves requests but publishes no KV events (started without them, or on another port?): its cache is invisible to the router"
            ),
        }
        true
    }
}

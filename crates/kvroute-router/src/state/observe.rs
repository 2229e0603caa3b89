//! An answered request's prediction against what was served, acted on (what an observer
//! reads of the router is [`super::view`]).

use kvroute_core::WorkerWithDpRank;
use kvroute_http::router_api::Answered;

use super::composite::RouterState;
use super::status::CacheMode;
use crate::check_status::Change;
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
        let tiers = crate::check_status::TierChecks::NAMES.into_iter().zip(a.predicted_tier_tokens);
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

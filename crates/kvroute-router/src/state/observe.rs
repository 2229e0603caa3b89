//! The verbs that read across owners for an observer: `/health`, the workers' statuses, the
//! metrics at scrape time, and an answered request's prediction against what was served.

use kvroute_core::{StorageTier, WorkerWithDpRank};
use kvroute_http::metrics::Registry;

use super::composite::RouterState;
use super::status::WorkerStatus;
use kvroute_http::router_api::Answered;

use super::status::CacheMode;
use crate::check_status::Change;
use crate::metrics::{
    BlocksLabels, PredictionLabels, TierLabels, TierPredictionLabels, TierTokenLabels,
    WorkerIdLabels, WorkerLabels,
};

impl RouterState {
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
        m.avoidable_prefill.sync(self.placing.avoidable_prefill_tokens());
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

//! What the rest of the house reads of the router: [`RouterState::view`] and its [`View`], the
//! owners' answers, read-only. Other crates read the router here and change it by its verbs;
//! the owners themselves are the state module's (`pub(crate)`).

use std::time::Duration;

use kvroute_core::index::IndexStats;
use kvroute_core::schedule::pairs::PairCounts;
use kvroute_core::schedule::predict::PredictionStats;
use kvroute_core::schedule::{AffinityCounts, DecisionRecord};
use kvroute_core::{
    LocalBlockHash, OverlapScores, RouterEvent, StorageTier, WorkerId, WorkerWithDpRank,
};
use kvroute_http::metrics::Registry;
use tokio::sync::watch;

use super::composite::RouterState;
use super::roster::{Member, Members};
use super::status::WorkerStatus;
use crate::metrics::{BlocksLabels, EventKind, TierLabels, WorkerIdLabels, WorkerLabels};

/// The router, read (see the module).
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    s: &'a RouterState,
}

impl RouterState {
    /// What the router knows, read-only: the owners' answers for other crates.
    pub fn view(&self) -> View<'_> {
        View { s: self }
    }
}

impl<'a> View<'a> {
    /// What `/health` says: always ok while the process serves (NATS away is degraded, not
    /// down: routing goes on from local state), with the NATS link's state when there is one.
    pub fn health(&self) -> serde_json::Value {
        match self.s.nats.get() {
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
        let lower = self.s.index.lower_tier_sizes();
        self.s
            .fleet
            .statuses()
            .into_iter()
            .map(|mut w| {
                w.tree_size = (0..w.dp_size)
                    .map(|r| self.s.index.tree_size(WorkerWithDpRank::new(w.id, r)))
                    .collect();
                w.lower_tier_blocks = (0..w.dp_size)
                    .map(|r| {
                        let rank = WorkerWithDpRank::new(w.id, r);
                        lower
                            .binary_search_by_key(&rank, |&(k, _)| k)
                            .map_or([0; 3], |i| lower[i].1)
                    })
                    .collect();
                if let Some(c) = self.s.checks.status(w.id) {
                    w.checks = c;
                }
                w
            })
            .collect()
    }

    /// The metrics registry, with the sizes read at scrape time brought up to date.
    pub fn registry(&self) -> &'a Registry {
        let m = &self.s.metrics;
        let stats = self.s.index.stats();
        m.index_blocks.set(stats.blocks as i64);
        m.index_held_blocks.set(stats.held_blocks as i64);
        m.index_budget.set(self.s.index.budget().map_or(-1, |b| b as i64));
        m.index_evicted.sync(stats.evicted_blocks);
        m.avoidable_prefill.sync(self.s.scheduling.avoidable_prefill_tokens());
        m.sync_zmq_refused();
        m.in_flight.set(self.s.scheduling.in_flight() as i64);
        let (affinity, sessions) = self.s.scheduling.affinity();
        m.sync_sessions(affinity, sessions);
        match self.s.nats.get() {
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
        for p in self.s.scheduling.prediction_stats() {
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

    /// Requests in flight (placed, not yet finished).
    pub fn in_flight(&self) -> usize {
        self.s.scheduling.in_flight()
    }

    /// What the pair choice did (a disaggregated fleet's split and in-place decisions).
    pub fn pair_counts(&self) -> PairCounts {
        self.s.scheduling.pair_counts()
    }

    /// Whether requests are placed in pairs (the fleet has prefill workers).
    pub fn disaggregated(&self) -> bool {
        self.s.scheduling.disaggregated()
    }

    /// The sessions' affinity counts, and how many sessions are held.
    pub fn affinity(&self) -> (AffinityCounts, usize) {
        self.s.scheduling.affinity()
    }

    /// The record of request `id`'s decision, while it is among the recent ones.
    pub fn decision_of(&self, id: &str) -> Option<DecisionRecord> {
        self.s.scheduling.decision_of(id)
    }

    /// Request `id`'s decision as the decision log wrote it, else its recent record.
    pub fn explained(&self, id: &str) -> Option<serde_json::Value> {
        super::decision_of(self.s.decision_log.as_ref(), &self.s.scheduling, id)
    }

    /// The recent decisions' records.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        self.s.scheduling.recent_decisions()
    }

    /// Each worker's learned first-token correction.
    pub fn prediction_stats(&self) -> Vec<PredictionStats> {
        self.s.scheduling.prediction_stats()
    }

    /// Whether `worker` is in the fleet.
    pub fn knows_worker(&self, worker: WorkerId) -> bool {
        self.s.fleet.knows_worker(worker)
    }

    /// The ranks not ready yet (their events not caught up, or no load report yet).
    pub fn not_ready(&self) -> Vec<WorkerWithDpRank> {
        self.s.fleet.not_ready()
    }

    /// Waits until every rank is ready or `timeout` passes; those still not ready.
    pub async fn wait_ready(self, timeout: Duration) -> Vec<WorkerWithDpRank> {
        self.s.fleet.wait_ready(timeout).await
    }

    /// A member's description (its source, whether it drains).
    pub fn member(&self, worker: WorkerId) -> Option<Member> {
        self.s.roster.get(worker)
    }

    /// The members now (draining ones included).
    pub fn members(&self) -> Members {
        self.s.roster.members()
    }

    /// The membership as it changes.
    pub fn follow_members(&self) -> watch::Receiver<Members> {
        self.s.roster.subscribe()
    }

    /// The blocks the index holds of `worker`'s rank.
    pub fn tree_size(&self, worker: WorkerWithDpRank) -> usize {
        self.s.index.tree_size(worker)
    }

    /// The index's figures (blocks, held blocks, evicted).
    pub fn index_stats(&self) -> IndexStats {
        self.s.index.stats()
    }

    /// KV events of `kind` applied (`ok`) or refused, counted.
    pub fn events(&self, kind: EventKind, ok: bool) -> u64 {
        self.s.metrics.events(kind, ok)
    }

    /// The ranks the index holds blocks of.
    pub fn indexed(&self) -> Vec<WorkerWithDpRank> {
        self.s.index.workers()
    }

    /// Each worker's overlap with `query`.
    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        self.s.index.find_matches(query)
    }

    /// Each worker's overlap with the first `max_blocks` of `query` (a replica's bounded
    /// look, the router API's `max_blocks`).
    pub fn find_matches_within(
        &self,
        query: &[LocalBlockHash],
        max_blocks: usize,
        block_size: usize,
    ) -> OverlapScores {
        self.s.index.find_matches_within(query, max_blocks, block_size)
    }

    /// The whole index as the events that would build it (a replica's snapshot).
    pub fn index_as_events(&self) -> Vec<RouterEvent> {
        self.s.index.dump_as_events()
    }

    /// Requests waiting in flow control's queues, and their bytes.
    pub fn waiting(&self) -> (usize, usize) {
        self.s.flow.waiting()
    }

    /// Whether `tenant` is over its share of the fleet by flow control.
    pub fn over_share(&self, tenant: &str) -> bool {
        self.s.config.scheduler.flow.enabled && self.s.flow.over_share(tenant)
    }

    /// The router's counters, to read (a scrape renders them: [`View::render_metrics`]).
    pub fn metrics(&self) -> &'a crate::metrics::Metrics {
        &self.s.metrics
    }

    /// Flow control's queues, to read (their bands, tenants and bytes waiting).
    pub fn flow(&self) -> &'a super::Flow {
        &self.s.flow
    }

    /// The sampled decision log, when configured.
    pub fn decision_log(&self) -> Option<&'a super::DecisionLog> {
        self.s.decision_log.as_ref()
    }

    /// The replicas' links over NATS, once started (none without NATS).
    pub fn nats_links(&self) -> Option<&'a crate::links::NatsLinks> {
        self.s.nats.get()
    }

    /// The replicas' link, summed up (none without NATS).
    pub fn nats(&self) -> Option<serde_json::Value> {
        self.s.nats.get().map(|n| n.summary())
    }
}

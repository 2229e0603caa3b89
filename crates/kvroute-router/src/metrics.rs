//! The router's Prometheus metrics, registered once in a [`Registry`] (names as constants;
//! counters get `_total` when encoded). Sizes the index and the scheduler know (blocks,
//! evictions, in-flight requests, per-worker state) are read at scrape time by
//! [`View::registry`](crate::state::View::registry).

use std::time::Duration;

use kvroute_core::WorkerWithDpRank;
use kvroute_http::metrics::{Counter, CounterOf, Family, Gauge, Histogram, Registry};
use kvroute_wire::ConvertStats;

mod admission;
mod kinds;
mod labels;
pub use admission::{FLOW_REQUESTS, FLOW_WAIT_SECONDS, FLOW_WAITING, FlowMetrics, FlowOutcome};
pub use kinds::EventKind;
pub use labels::*;

pub const EVENTS: &str = "kvroute_router_events";
pub const REJECTED: &str = "kvroute_router_events_rejected";
pub const GAPS: &str = "kvroute_router_event_gaps";
pub const REPLAYS: &str = "kvroute_router_replays";
pub const REPLAYED_BATCHES: &str = "kvroute_router_replayed_batches";
pub const GARBAGE: &str = "kvroute_router_undecodable_messages";
pub const RESTARTS: &str = "kvroute_router_publisher_restarts";
pub const CONVERTED: &str = "kvroute_router_converted_blocks";
pub const INDEX_BLOCKS: &str = "kvroute_router_index_blocks";
pub const INDEX_HELD_BLOCKS: &str = "kvroute_router_index_held_blocks";
pub const INDEX_BUDGET: &str = "kvroute_router_index_budget_blocks";
pub const INDEX_EVICTED: &str = "kvroute_router_index_evicted_blocks";
pub const AVOIDABLE_PREFILL: &str = "kvroute_router_avoidable_prefill_tokens";
pub const DECISIONS: &str = "kvroute_router_decisions";
pub const DECISION_SECONDS: &str = "kvroute_router_decision_seconds";
pub const WORKER_DECISIONS: &str = "kvroute_router_worker_decisions";
pub const WORKER_READY: &str = "kvroute_router_worker_ready";
pub const WORKER_BLOCKS: &str = "kvroute_router_worker_blocks";
pub const WORKER_TIER_BLOCKS: &str = "kvroute_router_worker_tier_blocks";
pub const IN_FLIGHT: &str = "kvroute_router_in_flight_requests";
pub const PREDICTIONS: &str = "kvroute_router_predictions";
pub const PREDICTION_ERROR: &str = "kvroute_router_prediction_error_tokens";
pub const TIER_PREDICTIONS: &str = "kvroute_router_tier_predictions";
pub const TIER_TOKENS: &str = "kvroute_router_predicted_tier_tokens";
pub const DRIFTS: &str = "kvroute_router_worker_drifts";
pub const WORKER_DRIFTED: &str = "kvroute_router_worker_drifted";
pub const WORKER_SILENT: &str = "kvroute_router_worker_silent";
pub const ANSWERED_PROMPT_TOKENS: &str = "kvroute_router_answered_prompt_tokens";
pub const ANSWERED_CACHED_TOKENS: &str = "kvroute_router_answered_cached_tokens";
pub const ANSWERED_PREDICTED_TOKENS: &str = "kvroute_router_answered_predicted_cached_tokens";
pub const NATS_CONNECTED: &str = "kvroute_nats_connected";
pub const REPLICA_MESSAGES: &str = "kvroute_replica_messages";
pub const REPLICA_PEERS: &str = "kvroute_replica_peers";
pub const REPLICA_EXPIRED: &str = "kvroute_replica_expired_requests";
pub const RECONCILED: &str = "kvroute_router_reconciled_requests";
pub const REPLICA_AGREEMENT: &str = "kvroute_replica_agreement";
pub const STREAM_MESSAGES: &str = "kvroute_stream_messages";
pub const STREAM_SEQUENCE: &str = "kvroute_stream_applied_sequence";
pub const SNAPSHOTS: &str = "kvroute_stream_snapshots";
pub const ZMQ_REFUSED: &str = "kvroute_zmq_refused_messages";
pub const SESSION_REQUESTS: &str = "kvroute_router_session_requests";
pub const SESSIONS: &str = "kvroute_router_sessions";
pub const TTFT_ERROR: &str = "kvroute_router_ttft_prediction_error_ratio";
pub const TTFT_PREDICTED: &str = "kvroute_router_ttft_predicted_seconds";
pub const TTFT_OBSERVED: &str = "kvroute_router_ttft_observed_seconds";
pub const TTFT_CORRECTION: &str = "kvroute_router_ttft_correction";
pub const MEMBERSHIP: &str = "kvroute_router_membership_changes";

/// Upper bounds (tokens) of the prediction-error histogram.
const ERROR_BUCKETS: [f64; 8] = [0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0];

fn error_histogram() -> Histogram {
    Histogram::new(ERROR_BUCKETS)
}

/// Upper bounds of the relative first-token error (|predicted - observed| / observed).
const TTFT_ERROR_BUCKETS: [f64; 9] = [0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 1.0, 2.0, 5.0];

/// Upper bounds (seconds) of the predicted and observed first-token times.
const TTFT_BUCKETS: [f64; 12] =
    [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0];

fn event_labels(kind: EventKind, ok: bool) -> EventLabels {
    EventLabels { kind: kind.label(), status: if ok { "ok" } else { "error" } }
}

/// Upper bounds (seconds) of the decision-latency histogram.
const BUCKETS: [f64; 18] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 3e-5, 4e-5, 5e-5, 7e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 1e-3,
    3e-3, 1e-2, 1e-1,
];

/// Every metric of the router, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    events: Family<EventLabels, Counter>,
    rejected: Family<ReasonLabels, Counter>,
    pub gaps: Counter,
    pub replays: Counter,
    pub replayed_batches: Counter,
    pub garbage: Counter,
    pub restarts: Counter,
    converted: Family<ConvertLabels, Counter>,
    pub index_blocks: Gauge,
    pub index_held_blocks: Gauge,
    pub index_budget: Gauge,
    pub index_evicted: CounterOf,
    pub avoidable_prefill: CounterOf,
    pub decisions: Counter,
    decision_seconds: Histogram,
    pub worker_decisions: Family<WorkerLabels, Counter>,
    pub worker_ready: Family<WorkerLabels, Gauge>,
    pub worker_blocks: Family<BlocksLabels, Gauge>,
    pub worker_tier_blocks: Family<TierLabels, Gauge>,
    pub in_flight: Gauge,
    pub predictions: Family<PredictionLabels, Counter>,
    pub prediction_error: Family<WorkerIdLabels, Histogram>,
    pub tier_predictions: Family<TierPredictionLabels, Counter>,
    pub tier_tokens: Family<TierTokenLabels, Counter>,
    pub drifts: Family<WorkerIdLabels, Counter>,
    pub worker_drifted: Family<WorkerIdLabels, Gauge>,
    pub worker_silent: Family<WorkerIdLabels, Gauge>,
    pub prompt_tokens: Family<WorkerIdLabels, Counter>,
    pub cached_tokens: Family<WorkerIdLabels, Counter>,
    pub predicted_tokens: Family<WorkerIdLabels, Counter>,
    pub nats_connected: Gauge,
    replica_messages: Family<OutcomeLabels, Counter>,
    pub replica_peers: Gauge,
    pub replica_expired: Counter,
    /// Placements freed because their engine's load reports never showed them.
    pub reconciled: Counter,
    replica_agreement: Family<OutcomeLabels, Counter>,
    stream_messages: Family<OutcomeLabels, Counter>,
    pub stream_sequence: Gauge,
    snapshots: Family<OutcomeLabels, Counter>,
    /// ZMQ messages over the size limit, by socket: this process's (see
    /// [`kvroute_wire::transport::refused`]), brought up to date at scrape time.
    zmq_refused: Family<SocketLabels, Counter>,
    zmq_refused_seen: [std::sync::atomic::AtomicU64; 4],
    session_requests: Family<AffinityLabels, Counter>,
    session_seen: [std::sync::atomic::AtomicU64; 3],
    pub sessions: Gauge,
    ttft_error: Family<WorkerLabels, Histogram>,
    ttft_predicted: Family<WorkerLabels, Histogram>,
    ttft_observed: Family<WorkerLabels, Histogram>,
    pub ttft_correction: Family<WorkerLabels, kvroute_http::metrics::FloatGauge>,
    pub flow_metrics: FlowMetrics,
    membership: Family<MemberLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Self {
            events: Family::default(),
            rejected: Family::default(),
            gaps: Counter::default(),
            replays: Counter::default(),
            replayed_batches: Counter::default(),
            garbage: Counter::default(),
            restarts: Counter::default(),
            converted: Family::default(),
            index_blocks: Gauge::default(),
            index_held_blocks: Gauge::default(),
            index_budget: Gauge::default(),
            index_evicted: CounterOf::default(),
            avoidable_prefill: CounterOf::default(),
            decisions: Counter::default(),
            decision_seconds: Histogram::new(BUCKETS),
            worker_decisions: Family::default(),
            zmq_refused: Family::default(),
            zmq_refused_seen: Default::default(),
            session_requests: Family::default(),
            session_seen: Default::default(),
            sessions: Gauge::default(),
            ttft_error: Family::new_with_constructor(|| Histogram::new(TTFT_ERROR_BUCKETS)),
            ttft_predicted: Family::new_with_constructor(|| Histogram::new(TTFT_BUCKETS)),
            ttft_observed: Family::new_with_constructor(|| Histogram::new(TTFT_BUCKETS)),
            ttft_correction: Family::default(),
            flow_metrics: FlowMetrics::new(),
            membership: Family::default(),
            worker_ready: Family::default(),
            worker_blocks: Family::default(),
            worker_tier_blocks: Family::default(),
            in_flight: Gauge::default(),
            predictions: Family::default(),
            prediction_error: Family::new_with_constructor(error_histogram),
            tier_predictions: Family::default(),
            tier_tokens: Family::default(),
            drifts: Family::default(),
            worker_drifted: Family::default(),
            worker_silent: Family::default(),
            prompt_tokens: Family::default(),
            cached_tokens: Family::default(),
            predicted_tokens: Family::default(),
            nats_connected: Gauge::default(),
            replica_messages: Family::default(),
            replica_peers: Gauge::default(),
            replica_expired: Counter::default(),
            reconciled: Counter::default(),
            replica_agreement: Family::default(),
            stream_messages: Family::default(),
            stream_sequence: Gauge::default(),
            snapshots: Family::default(),
            registry: Registry::default(),
        };
        r.register(
            EVENTS,
            "KV events applied (ok) or refused by the index (error)",
            m.events.clone(),
        );
        r.register(
            REJECTED,
            "KV events refused before the index (e.g. an out-of-range dp rank)",
            m.rejected.clone(),
        );
        r.register(
            ZMQ_REFUSED,
            "ZMQ messages refused before allocation for exceeding the maximum message size, by socket",
            m.zmq_refused.clone(),
        );
        r.register(
            SESSION_REQUESTS,
            "Requests of a session: new (placed afresh), kept on its worker, or moved (another was cheaper by the margin)",
            m.session_requests.clone(),
        );
        r.register(SESSIONS, "Sessions remembered", m.sessions.clone());
        r.register(GAPS, "Jumps in a publisher's sequence numbers", m.gaps.clone());
        r.register(REPLAYS, "Replay requests sent to engines", m.replays.clone());
        r.register(
            REPLAYED_BATCHES,
            "Event batches recovered by replay",
            m.replayed_batches.clone(),
        );
        r.register(GARBAGE, "Messages that could not be decoded", m.garbage.clone());
        r.register(RESTARTS, "Publishers seen restarting (sequence back to 0)", m.restarts.clone());
        r.register(
            CONVERTED,
            "Engine blocks by what conversion did with them",
            m.converted.clone(),
        );
        r.register(INDEX_BLOCKS, "Distinct blocks in the index", m.index_blocks.clone());
        r.register(
            INDEX_HELD_BLOCKS,
            "(worker, block) pairs in the index",
            m.index_held_blocks.clone(),
        );
        r.register(
            INDEX_BUDGET,
            "Most (worker, block) pairs the index keeps",
            m.index_budget.clone(),
        );
        r.register(
            INDEX_EVICTED,
            "(worker, block) pairs evicted to stay within the budget",
            m.index_evicted.counter.clone(),
        );
        r.register(
            AVOIDABLE_PREFILL,
            "Prompt tokens prefilled on the chosen worker that another candidate held in its cache",
            m.avoidable_prefill.counter.clone(),
        );
        r.register(DECISIONS, "Routing decisions", m.decisions.clone());
        r.register(DECISION_SECONDS, "Time to decide, seconds", m.decision_seconds.clone());
        r.register(WORKER_DECISIONS, "Routing decisions per worker", m.worker_decisions.clone());
        r.register(
            WORKER_READY,
            "1 when the worker's event stream and load reports are up",
            m.worker_ready.clone(),
        );
        r.register(
            WORKER_BLOCKS,
            "Blocks the index holds per worker, by mode (events or approximate)",
            m.worker_blocks.clone(),
        );
        r.register(
            WORKER_TIER_BLOCKS,
            "Blocks a worker keeps below its device, by tier (host, disk, external), by its events",
            m.worker_tier_blocks.clone(),
        );
        r.register(IN_FLIGHT, "Requests routed and not yet finished", m.in_flight.clone());
        r.register(
            PREDICTIONS,
            "Answered requests by how the predicted cached tokens compared with the engine's",
            m.predictions.clone(),
        );
        r.register(
            PREDICTION_ERROR,
            "Absolute difference of predicted and served cached tokens, tokens",
            m.prediction_error.clone(),
        );
        r.register(
            TIER_PREDICTIONS,
            "Answered requests whose prediction counted tokens from a tier below the GPU, by tier and by how the whole prediction went",
            m.tier_predictions.clone(),
        );
        r.register(
            TIER_TOKENS,
            "Cached tokens answered requests were predicted to load from a tier below the GPU",
            m.tier_tokens.clone(),
        );
        r.register(
            DRIFTS,
            "Times a worker's index was found drifted and resynchronised",
            m.drifts.clone(),
        );
        r.register(
            WORKER_DRIFTED,
            "1 while a worker's predictions are discounted",
            m.worker_drifted.clone(),
        );
        r.register(
            WORKER_SILENT,
            "1 while a worker serves without publishing KV events",
            m.worker_silent.clone(),
        );
        r.register(
            ANSWERED_PROMPT_TOKENS,
            "Prompt tokens of answered requests (the fleet's hit rate is cached over prompt)",
            m.prompt_tokens.clone(),
        );
        r.register(
            ANSWERED_CACHED_TOKENS,
            "Prompt tokens answered requests were served from the engines' caches (their own count)",
            m.cached_tokens.clone(),
        );
        r.register(
            ANSWERED_PREDICTED_TOKENS,
            "Prompt tokens the router predicted cached for answered requests (the predicted hit rate is these over prompt)",
            m.predicted_tokens.clone(),
        );
        m.register_first_tokens(&mut r);
        m.register_replicas(&mut r);
        m.flow_metrics.register(&mut r);
        r.register(
            MEMBERSHIP,
            "Workers that joined, drained, were removed or were refused, by the source that asked",
            m.membership.clone(),
        );
        Self { registry: r, ..m }
    }

    fn register_first_tokens(&self, r: &mut Registry) {
        r.register(
            TTFT_ERROR,
            "Relative error of each first-token prediction, |predicted - observed| / observed, by worker",
            self.ttft_error.clone(),
        );
        r.register(
            TTFT_PREDICTED,
            "Time to first token the router predicted when it placed the request, by worker",
            self.ttft_predicted.clone(),
        );
        r.register(
            TTFT_OBSERVED,
            "Time from placing a request to its first token, as the router saw it, by worker",
            self.ttft_observed.clone(),
        );
        r.register(
            TTFT_CORRECTION,
            "Factor a worker's engine-model predictions are multiplied by (observed / model, learned)",
            self.ttft_correction.clone(),
        );
    }

    /// A first token arrived where one was predicted.
    pub fn first_token(&self, seen: &kvroute_core::schedule::predict::Observation) {
        let labels = WorkerLabels::from(seen.worker);
        self.ttft_error.get_or_create(&labels).observe(seen.relative_error());
        self.ttft_predicted.get_or_create(&labels).observe(seen.predicted_ms / 1e3);
        self.ttft_observed.get_or_create(&labels).observe(seen.observed_ms / 1e3);
    }

    fn register_replicas(&self, r: &mut Registry) {
        r.register(
            NATS_CONNECTED,
            "1 while NATS is reachable (-1 without NATS); 0 is degraded: routing on local state",
            self.nats_connected.clone(),
        );
        r.register(
            REPLICA_MESSAGES,
            "Decisions shared with other replicas: received, unsent (NATS away or outbox full), garbage, unknown_worker, peer_full, too_many_peers",
            self.replica_messages.clone(),
        );
        r.register(REPLICA_PEERS, "Other replicas heard from", self.replica_peers.clone());
        r.register(
            RECONCILED,
            "Placements freed because their engine's load reports showed fewer requests than kvroute held there, for longer than the window, before any first token",
            self.reconciled.clone(),
        );
        r.register(
            REPLICA_EXPIRED,
            "Peers' in-flight requests freed because their replica went silent",
            self.replica_expired.clone(),
        );
        r.register(
            REPLICA_AGREEMENT,
            "Peers' decisions this replica would have made too (agree) or not (disagree)",
            self.replica_agreement.clone(),
        );
        r.register(
            STREAM_MESSAGES,
            "Event stream messages: relayed, duplicate, retried, applied, lost (outside retention)",
            self.stream_messages.clone(),
        );
        r.register(
            STREAM_SEQUENCE,
            "Event stream sequence applied last",
            self.stream_sequence.clone(),
        );
        r.register(SNAPSHOTS, "Index snapshots written, loaded or failed", self.snapshots.clone());
    }

    pub fn replica_message(&self, outcome: &'static str) {
        self.replica_messages.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn replica_messages(&self, outcome: &'static str) -> u64 {
        self.replica_messages.get_or_create(&OutcomeLabels { outcome }).get()
    }

    pub fn agreement(&self, agree: bool) {
        let outcome = if agree { "agree" } else { "disagree" };
        self.replica_agreement.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn agreements(&self, agree: bool) -> u64 {
        let outcome = if agree { "agree" } else { "disagree" };
        self.replica_agreement.get_or_create(&OutcomeLabels { outcome }).get()
    }

    pub fn stream_message(&self, outcome: &'static str) {
        self.stream_messages.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn stream_messages(&self, outcome: &'static str) -> u64 {
        self.stream_messages.get_or_create(&OutcomeLabels { outcome }).get()
    }

    pub fn snapshot(&self, outcome: &'static str) {
        self.snapshots.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn snapshots(&self, outcome: &'static str) -> u64 {
        self.snapshots.get_or_create(&OutcomeLabels { outcome }).get()
    }

    pub fn event(&self, kind: EventKind, ok: bool) {
        self.events.get_or_create(&event_labels(kind, ok)).inc();
    }

    /// A batch's events counted at once: `counts[kind][ok]`, kinds in [`EventKind`]'s order.
    pub fn event_counts(&self, counts: &[[u64; 2]; 3]) {
        let kinds = [EventKind::Stored, EventKind::Removed, EventKind::Cleared];
        for (kind, by_ok) in kinds.into_iter().zip(counts) {
            for (ok, &n) in [false, true].into_iter().zip(by_ok) {
                if n > 0 {
                    self.events.get_or_create(&event_labels(kind, ok)).inc_by(n);
                }
            }
        }
    }

    pub fn events(&self, kind: EventKind, ok: bool) -> u64 {
        self.events.get_or_create(&event_labels(kind, ok)).get()
    }

    /// Brings the ZMQ refusal counts up to what the process's sockets refused.
    pub fn sync_zmq_refused(&self) {
        use kvroute_wire::transport::{SocketRole, refused};
        for role in SocketRole::ALL {
            let total = refused(role);
            let seen = self.zmq_refused_seen[role as usize]
                .swap(total, std::sync::atomic::Ordering::Relaxed);
            let counter = self.zmq_refused.get_or_create(&SocketLabels { socket: role.label() });
            counter.inc_by(total.saturating_sub(seen));
        }
    }

    /// Brings the session counters up to the scheduler's totals.
    pub fn sync_sessions(&self, counts: kvroute_core::schedule::AffinityCounts, sessions: usize) {
        let totals = [("new", counts.new), ("kept", counts.kept), ("moved", counts.moved)];
        for (i, (affinity, total)) in totals.into_iter().enumerate() {
            let seen = self.session_seen[i].swap(total, std::sync::atomic::Ordering::Relaxed);
            let counter = self.session_requests.get_or_create(&AffinityLabels { affinity });
            counter.inc_by(total.saturating_sub(seen));
        }
        self.sessions.set(sessions as i64);
    }

    pub fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn rejected_n(&self, reason: &'static str, n: u64) {
        self.rejected.get_or_create(&ReasonLabels { reason }).inc_by(n);
    }

    pub fn decision(&self, worker: WorkerWithDpRank, took: Duration) {
        self.decisions.inc();
        self.decision_seconds.observe(took.as_secs_f64());
        self.worker_decisions.get_or_create(&worker.into()).inc();
    }

    /// Drops every label set of a worker that left the fleet (its `dp_size` ranks): a
    /// scrape no longer shows it.
    pub fn forget_worker(&self, worker: kvroute_core::WorkerId, dp_size: u32) {
        let worker_id = worker.0;
        let id = WorkerIdLabels { worker_id };
        for f in [&self.drifts, &self.prompt_tokens, &self.cached_tokens, &self.predicted_tokens] {
            f.remove(&id);
        }
        for f in [&self.worker_drifted, &self.worker_silent] {
            f.remove(&id);
        }
        self.prediction_error.remove(&id);
        for outcome in PREDICTION_OUTCOMES {
            self.predictions.remove(&PredictionLabels { worker_id, outcome });
        }
        for (outcome, _) in ConvertStats::default().counts() {
            self.converted.remove(&ConvertLabels { worker_id, outcome });
        }
        for tier in kvroute_core::StorageTier::LOWER.map(|t| t.name()) {
            self.tier_tokens.remove(&TierTokenLabels { worker_id, tier });
            for outcome in PREDICTION_OUTCOMES {
                self.tier_predictions.remove(&TierPredictionLabels { worker_id, tier, outcome });
            }
        }
        for dp_rank in 0..dp_size {
            let w = WorkerLabels { worker_id, dp_rank };
            self.worker_decisions.remove(&w);
            self.worker_ready.remove(&w);
            for f in [&self.ttft_error, &self.ttft_predicted, &self.ttft_observed] {
                f.remove(&w);
            }
            self.ttft_correction.remove(&w);
            for mode in ["events", "approximate"] {
                self.worker_blocks.remove(&BlocksLabels { worker_id, dp_rank, mode });
            }
            for tier in kvroute_core::StorageTier::LOWER.map(|t| t.name()) {
                self.worker_tier_blocks.remove(&TierLabels { worker_id, dp_rank, tier });
            }
        }
    }

    /// Counts `n` membership changes of one kind asked by `source`.
    pub fn membership(&self, source: &str, change: &'static str, n: usize) {
        if n > 0 {
            let labels = MemberLabels { source: source.to_owned(), change };
            self.membership.get_or_create(&labels).inc_by(n as u64);
        }
    }

    /// Counts what conversion did with one message's blocks.
    pub fn converted(&self, worker: u64, stats: &ConvertStats) {
        for (outcome, n) in stats.counts() {
            if n > 0 {
                self.converted
                    .get_or_create(&ConvertLabels { worker_id: worker, outcome })
                    .inc_by(n);
            }
        }
    }
}

//! Placement: the scheduler with its in-flight accounting, and approximate mode's
//! bookkeeping ([`Placing`]); placing a request, its prefill and end, the peers' requests
//! (replica sync), load reports.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use kvroute_core::index::{ApproxTracker, OverlapScores, ShardedIndex};
use kvroute_core::schedule::adapters::WorkerAdapters;
use kvroute_core::schedule::flow::{Gate, Outlook};
use kvroute_core::schedule::pairs::{PairCounts, prefill_leg_id};
use kvroute_core::schedule::{
    AffinityCounts, DecisionRecord, PairDecision, RequestBlocks, RouteDecision, RouteRequest,
    Scheduler, WorkerLoad,
};
use kvroute_core::{LocalBlockHash, RouterEvent, SequenceHash, WorkerWithDpRank, sequence_hashes};
use kvroute_wire::replica::SyncMessage;

use super::{CacheMode, PlaceRequest, RouterState, apply_one, lock};
use crate::config::{RouterConfig, WorkerSpec};
use crate::metrics::Metrics;

/// The scheduler and approximate mode. Each is a mutex; where both are held, `approx` is
/// taken first. The scheduler reads the index while it routes (the index's shard locks are
/// leaves).
#[derive(Debug)]
pub struct Placing {
    scheduler: Mutex<Scheduler>,
    /// Approximate mode's bookkeeping; its events go to the index under this lock, so each
    /// worker's assumed blocks are applied in order.
    approx: Mutex<ApproxTracker>,
}

impl Placing {
    pub(super) fn new(config: &RouterConfig) -> Self {
        let mut scheduler_config = config.scheduler;
        scheduler_config.block_size = config.block_size;
        Self {
            scheduler: Mutex::new(Scheduler::new(scheduler_config)),
            approx: Mutex::new(ApproxTracker::new(config.approx)),
        }
    }

    pub(super) fn scheduler(&self) -> MutexGuard<'_, Scheduler> {
        lock(&self.scheduler)
    }

    pub(super) fn approx(&self) -> MutexGuard<'_, ApproxTracker> {
        lock(&self.approx)
    }

    /// A configured worker's ranks become candidates (ready or not).
    pub(super) fn add_worker(&self, spec: &WorkerSpec, ready: &[bool]) {
        let mut scheduler = self.scheduler();
        for rank in 0..spec.dp_size {
            let w = WorkerWithDpRank::new(spec.id, rank);
            scheduler.add_worker(w);
            scheduler.set_ready(w, ready[rank as usize]);
            let node = kvroute_core::schedule::pairs::node_id(spec.node.as_deref());
            scheduler.set_role(w, spec.role, node);
            if let Some(slots) = spec.max_loras {
                scheduler.adapters_mut().report(w, Some(slots), &[]);
            }
        }
    }

    /// Whether the fleet has prefill workers (requests are then placed in pairs).
    pub fn disaggregated(&self) -> bool {
        self.scheduler().disaggregated()
    }

    /// What the pair choice did so far.
    pub fn pair_counts(&self) -> PairCounts {
        self.scheduler().pair_counts()
    }

    /// A peer replica routed a request: this replica first checks which worker it would have
    /// chosen (counted as agreement, nothing accounted), then tracks the peer's as in flight.
    /// Returns whether the worker is one of ours.
    pub(crate) fn track_peer(
        &self,
        index: &ShardedIndex,
        metrics: &Metrics,
        key: &str,
        peer: PeerRouted<'_>,
    ) -> bool {
        let now = Instant::now();
        let PeerRouted { worker, isl_tokens, prefill_tokens, local, block_size, output_tokens } =
            peer;
        let scores =
            index.find_matches_within(local, isl_tokens.saturating_sub(1) / block_size, block_size);
        let sequence = sequence_hashes(local);
        let request = RouteRequest {
            id: None,
            isl_tokens,
            local_hashes: local,
            sequence_hashes: &sequence,
            overlap_weight: None,
            temperature: None,
            exclude: &[],
            adapter: None,
            session: None,
            output_tokens,
        };
        let mut scheduler = self.scheduler();
        if let Some(mine) = scheduler.route(&request, &scores, index, now) {
            metrics.agreement(mine.worker == worker);
        }
        let blocks = RequestBlocks { local, sequence: &sequence };
        let tracked = scheduler.track(key, worker, prefill_tokens, blocks, now);
        if tracked {
            scheduler.hold_private(key, isl_tokens, output_tokens);
        }
        tracked
    }

    pub(crate) fn peer_prefill_done(&self, key: &str) {
        self.scheduler().mark_prefill_done_untimed(key);
    }

    /// Frees a peer's request without telling the peers.
    pub(crate) fn free_peer(&self, key: &str) {
        self.scheduler().free(key);
    }

    pub fn reclaim_stale(&self) -> usize {
        self.scheduler().reclaim_stale(Instant::now())
    }

    /// The adapters a worker rank lists (`None`: not known, taken as any).
    pub fn set_served_adapters(&self, worker: WorkerWithDpRank, served: Option<BTreeSet<String>>) {
        self.scheduler().adapters_mut().set_served(worker, served);
    }

    /// A worker rank's adapters as it reports them (its slots, the adapters in them).
    pub fn report_adapters(&self, worker: WorkerWithDpRank, report: &crate::load::AdapterReport) {
        let names: Vec<&str> = report.in_slots.iter().map(String::as_str).collect();
        self.scheduler().adapters_mut().report(worker, report.max_loras, &names);
    }

    /// Each worker's adapters as the router knows them.
    pub fn adapters(&self) -> BTreeMap<WorkerWithDpRank, WorkerAdapters> {
        self.scheduler().adapters().workers().clone()
    }

    /// What session affinity did so far, and how many sessions are remembered.
    pub fn affinity(&self) -> (AffinityCounts, usize) {
        self.scheduler().affinity()
    }

    /// The scheduler's last decisions of tracked requests, oldest first.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        self.scheduler().recent_decisions()
    }

    /// Each worker's first-token predictions as they turned out.
    pub fn prediction_stats(&self) -> Vec<kvroute_core::schedule::predict::PredictionStats> {
        self.scheduler().prediction_stats(Instant::now())
    }

    /// The in-flight requests the scheduler tracks.
    pub fn in_flight(&self) -> usize {
        self.scheduler().active().len()
    }
}

/// A peer replica's decision, as its sync message names it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PeerRouted<'a> {
    pub worker: WorkerWithDpRank,
    pub isl_tokens: usize,
    pub prefill_tokens: usize,
    pub local: &'a [LocalBlockHash],
    pub block_size: usize,
    /// Tokens its answer may run to (0: unknown).
    pub output_tokens: usize,
}

impl RouterState {
    /// Chooses a worker. `None` when there is none to choose. A drifted worker's overlap counts
    /// half until its predictions agree again (not nothing: it must still be routed the
    /// prefixes only it holds, or its predictions could never be seen to agree).
    pub fn place(&self, p: &PlaceRequest<'_>) -> Option<(RouteDecision, OverlapScores)> {
        place_gated(self, p, None).unwrap_or(None)
    }

    /// Chooses the legs of a request in a disaggregated fleet ([`Scheduler::route_pair`]):
    /// a prefill and a decode worker, or a decode worker alone. `None` when there is none.
    pub fn place_pair(&self, p: &PlaceRequest<'_>) -> Option<PairDecision> {
        place_pair_gated(self, p, None).unwrap_or(None)
    }

    /// The request's first token arrived. `timed`: when it did is when its first token was
    /// (a streamed answer), so it teaches the predictions; an answer sent whole is not.
    pub fn prefill_done(&self, request_id: &str, timed: bool) {
        let mut scheduler = self.placing.scheduler();
        let seen = match timed {
            true => scheduler.mark_prefill_done(request_id),
            false => {
                scheduler.mark_prefill_done_untimed(request_id);
                None
            }
        };
        drop(scheduler);
        if let Some(seen) = seen {
            self.metrics.first_token(&seen);
        }
        if let Some(nats) = self.nats.get() {
            nats.send(&self.metrics, SyncMessage::PrefillDone { id: request_id.to_owned() });
        }
        super::flow::release(self);
    }

    /// Returns whether the request was in flight.
    pub fn finish(&self, request_id: &str) -> bool {
        let tracked = self.placing.scheduler().free(request_id);
        if let (true, Some(nats)) = (tracked, self.nats.get()) {
            nats.send(&self.metrics, SyncMessage::Freed { id: request_id.to_owned() });
        }
        super::flow::release(self);
        tracked
    }

    /// A rank's load report: the scheduler's load, approximate mode's capacity, readiness.
    pub fn update_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) {
        self.placing.scheduler().update_load(worker, load);
        if self.fleet.mode(worker.worker_id) == Some(CacheMode::Approximate) {
            let capacity = load.kv_total_blocks.map(|b| b as usize);
            self.placing.approx().set_capacity(worker, capacity);
        }
        if let Some(ready) = self.fleet.set_load(worker, load) {
            self.placing.scheduler().set_ready(worker, ready);
        }
        self.fleet.signal();
        super::flow::release(self);
    }
}

/// [`RouterState::place`], through flow control's gate when given: only a worker that can
/// take the request now ([`Scheduler::route_gated`]); the fleet's best offer when none can.
pub(super) fn place_gated(
    state: &RouterState,
    p: &PlaceRequest<'_>,
    gate: Option<&Gate>,
) -> Result<Option<(RouteDecision, OverlapScores)>, Outlook> {
    let start = Instant::now();
    let (scores, sequence) = scores_for(state, p);
    let request = route_request(p, &sequence);
    // The scheduler's lock is released before `placed` (which may take approximate mode's).
    let decision =
        state.placing.scheduler().route_gated(&request, &scores, &state.index, start, gate);
    let Some(d) = decision? else { return Ok(None) };
    placed(state, p.request_id, &d, p, start);
    Ok(Some((d, scores)))
}

/// [`RouterState::place_pair`], when the gate (if given) lets the fleet's best offer through
/// (any worker of either pool; the pair is then chosen as always). The index is read once.
pub(super) fn place_pair_gated(
    state: &RouterState,
    p: &PlaceRequest<'_>,
    gate: Option<&Gate>,
) -> Result<Option<PairDecision>, Outlook> {
    let start = Instant::now();
    let (scores, sequence) = scores_for(state, p);
    let request = route_request(p, &sequence);
    let mut scheduler = state.placing.scheduler();
    if let Some(gate) = gate {
        let outlook = scheduler.outlook(&request, &scores, &state.index, start);
        if let Some(o) = outlook.filter(|o| !gate.admits(o.wait_ms, o.ttft_ms)) {
            return Err(o);
        }
    }
    let pair = scheduler.route_pair(&request, &scores, &state.index, start);
    drop(scheduler);
    let Some(pair) = pair else { return Ok(None) };
    if let Some(prefill) = &pair.prefill {
        let id = p.request_id.map(prefill_leg_id);
        placed(state, id.as_deref(), prefill, p, start);
    }
    placed(state, p.request_id, &pair.decode, p, start);
    Ok(Some(pair))
}

/// The index's scores of a request (a drifted worker's halved), and its chained hashes when
/// it is tracked.
fn scores_for(state: &RouterState, p: &PlaceRequest<'_>) -> (OverlapScores, Vec<SequenceHash>) {
    let bs = state.config.block_size.tokens();
    let max_blocks = p.num_tokens.saturating_sub(1) / bs;
    let mut scores = state.index.find_matches_within(p.local_hashes, max_blocks, bs);
    state.checks.halve_drifted(&mut scores);
    // Only a tracked request keeps its chained hashes (for the in-flight accounting).
    let sequence = match p.request_id {
        Some(_) => sequence_hashes(p.local_hashes),
        None => Vec::new(),
    };
    (scores, sequence)
}

/// A decision made: the replicas hear of it, an approximate worker assumes its blocks, the
/// metrics count it.
fn placed(
    state: &RouterState,
    id: Option<&str>,
    d: &RouteDecision,
    p: &PlaceRequest<'_>,
    start: Instant,
) {
    if let (Some(id), Some(nats)) = (id, state.nats.get()) {
        nats.send(
            &state.metrics,
            SyncMessage::Routed {
                id: id.to_owned(),
                worker_id: d.worker.worker_id.0,
                dp_rank: d.worker.dp_rank.0,
                isl_tokens: p.num_tokens,
                prefill_tokens: d.predicted_prefill_tokens,
                local_hashes: p.local_hashes.iter().map(|h| h.0).collect(),
                output_tokens: p.output_tokens,
            },
        );
    }
    if state.fleet.mode(d.worker.worker_id) == Some(CacheMode::Approximate) {
        let mut approx = state.placing.approx();
        let assumed: Vec<RouterEvent> = approx.record_routed(d.worker, p.local_hashes, start);
        for e in &assumed {
            apply_one(state, e);
        }
    }
    state.metrics.decision(d.worker, start.elapsed());
}

/// The scheduler's view of a request to place.
fn route_request<'a>(p: &PlaceRequest<'a>, sequence: &'a [SequenceHash]) -> RouteRequest<'a> {
    RouteRequest {
        id: p.request_id,
        isl_tokens: p.num_tokens,
        local_hashes: p.local_hashes,
        sequence_hashes: sequence,
        overlap_weight: p.overlap_weight,
        temperature: p.temperature,
        exclude: p.exclude,
        adapter: p.adapter,
        session: p.session,
        output_tokens: p.output_tokens,
    }
}

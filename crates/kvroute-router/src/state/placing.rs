//! The scheduler and in-flight accounting: placing a request, its prefill and end, the
//! peers' requests (replica sync), load reports.

use std::time::Instant;

use kvroute_core::index::OverlapScores;
use kvroute_core::schedule::PairDecision;
use kvroute_core::schedule::pairs::prefill_leg_id;
use kvroute_core::schedule::{
    DecisionRecord, RequestBlocks, RouteDecision, RouteRequest, WorkerLoad,
};
use kvroute_core::{LocalBlockHash, SequenceHash, WorkerWithDpRank, sequence_hashes};
use kvroute_wire::replica::SyncMessage;

use super::{CacheMode, PlaceRequest, RouterState, lock};

impl RouterState {
    /// Chooses a worker. `None` when there is none to choose. A drifted worker's overlap counts
    /// half until its predictions agree again (not nothing: it must still be routed the
    /// prefixes only it holds, or its predictions could never be seen to agree).
    pub fn place(&self, p: &PlaceRequest<'_>) -> Option<(RouteDecision, OverlapScores)> {
        let start = Instant::now();
        let (scores, sequence) = self.scores_for(p);
        let request = route_request(p, &sequence);
        let decision =
            lock(&self.placing.scheduler).route(&request, &scores, &self.index, start)?;
        self.placed(p.request_id, &decision, p, start);
        Some((decision, scores))
    }

    /// Chooses the legs of a request in a disaggregated fleet ([`Scheduler::route_pair`]):
    /// a prefill and a decode worker, or a decode worker alone. `None` when there is none.
    ///
    /// [`Scheduler::route_pair`]: kvroute_core::schedule::Scheduler::route_pair
    pub fn place_pair(&self, p: &PlaceRequest<'_>) -> Option<PairDecision> {
        let start = Instant::now();
        let (scores, sequence) = self.scores_for(p);
        let request = route_request(p, &sequence);
        let pair =
            lock(&self.placing.scheduler).route_pair(&request, &scores, &self.index, start)?;
        if let Some(prefill) = &pair.prefill {
            let id = p.request_id.map(prefill_leg_id);
            self.placed(id.as_deref(), prefill, p, start);
        }
        self.placed(p.request_id, &pair.decode, p, start);
        Some(pair)
    }

    /// Whether the fleet has prefill workers (requests are then placed in pairs).
    pub fn disaggregated(&self) -> bool {
        lock(&self.placing.scheduler).disaggregated()
    }

    /// What the pair choice did so far.
    pub fn pair_counts(&self) -> kvroute_core::schedule::pairs::PairCounts {
        lock(&self.placing.scheduler).pair_counts()
    }

    /// The index's scores of a request (a drifted worker's halved), and its chained hashes
    /// when it is tracked.
    fn scores_for(&self, p: &PlaceRequest<'_>) -> (OverlapScores, Vec<SequenceHash>) {
        let bs = self.config.block_size.tokens();
        let max_blocks = p.num_tokens.saturating_sub(1) / bs;
        let mut scores = self.index.find_matches_within(p.local_hashes, max_blocks, bs);
        self.halve_drifted(&mut scores);
        // Only a tracked request keeps its chained hashes (for the in-flight accounting).
        let sequence = match p.request_id {
            Some(_) => sequence_hashes(p.local_hashes),
            None => Vec::new(),
        };
        (scores, sequence)
    }

    /// A decision made: the replicas hear of it, an approximate worker assumes its blocks,
    /// the metrics count it.
    fn placed(&self, id: Option<&str>, d: &RouteDecision, p: &PlaceRequest<'_>, start: Instant) {
        if let (Some(id), Some(nats)) = (id, self.nats.get()) {
            nats.send(
                &self.metrics,
                SyncMessage::Routed {
                    id: id.to_owned(),
                    worker_id: d.worker.worker_id.0,
                    dp_rank: d.worker.dp_rank.0,
                    isl_tokens: p.num_tokens,
                    prefill_tokens: d.predicted_prefill_tokens,
                    local_hashes: p.local_hashes.iter().map(|h| h.0).collect(),
                },
            );
        }
        if self.mode(d.worker.worker_id) == Some(CacheMode::Approximate) {
            let mut approx = lock(&self.placing.approx);
            for e in approx.record_routed(d.worker, p.local_hashes, start) {
                self.apply_one(&e);
            }
        }
        self.metrics.decision(d.worker, start.elapsed());
    }

    pub fn prefill_done(&self, request_id: &str) {
        lock(&self.placing.scheduler).mark_prefill_done(request_id);
        if let Some(nats) = self.nats.get() {
            nats.send(&self.metrics, SyncMessage::PrefillDone { id: request_id.to_owned() });
        }
    }

    /// Returns whether the request was in flight.
    pub fn finish(&self, request_id: &str) -> bool {
        let tracked = lock(&self.placing.scheduler).free(request_id);
        if let (true, Some(nats)) = (tracked, self.nats.get()) {
            nats.send(&self.metrics, SyncMessage::Freed { id: request_id.to_owned() });
        }
        tracked
    }

    /// A peer replica routed a request: this replica first checks which worker it would have
    /// chosen (counted as agreement, nothing accounted), then tracks the peer's as in flight.
    /// Returns whether the worker is one of ours.
    pub(crate) fn track_peer(
        &self,
        key: &str,
        worker: WorkerWithDpRank,
        isl_tokens: usize,
        prefill_tokens: usize,
        local: &[LocalBlockHash],
    ) -> bool {
        let now = Instant::now();
        let bs = self.config.block_size.tokens();
        let scores = self.index.find_matches_within(local, isl_tokens.saturating_sub(1) / bs, bs);
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
        };
        let mut scheduler = lock(&self.placing.scheduler);
        if let Some(mine) = scheduler.route(&request, &scores, &self.index, now) {
            self.metrics.agreement(mine.worker == worker);
        }
        let blocks = RequestBlocks { local, sequence: &sequence };
        scheduler.track(key, worker, prefill_tokens, blocks, now)
    }

    pub(crate) fn peer_prefill_done(&self, key: &str) {
        lock(&self.placing.scheduler).prefill_done_elsewhere(key);
    }

    /// Frees a peer's request without telling the peers.
    pub(crate) fn free_peer(&self, key: &str) {
        lock(&self.placing.scheduler).free(key);
    }

    pub fn reclaim_stale(&self) -> usize {
        lock(&self.placing.scheduler).reclaim_stale(Instant::now())
    }

    pub fn update_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) {
        lock(&self.placing.scheduler).update_load(worker, load);
        if self.mode(worker.worker_id) == Some(CacheMode::Approximate) {
            let capacity = load.kv_total_blocks.map(|b| b as usize);
            lock(&self.placing.approx).set_capacity(worker, capacity);
        }
        self.update_rank(worker, |w, rank| w.load[rank] = Some(load));
    }

    /// The adapters a worker rank lists (`None`: not known, taken as any).
    pub fn set_served_adapters(
        &self,
        worker: WorkerWithDpRank,
        served: Option<std::collections::BTreeSet<String>>,
    ) {
        lock(&self.placing.scheduler).adapters_mut().set_served(worker, served);
    }

    /// A worker rank's adapters as it reports them (its slots, the adapters in them).
    pub fn report_adapters(&self, worker: WorkerWithDpRank, report: &crate::load::AdapterReport) {
        let names: Vec<&str> = report.in_slots.iter().map(String::as_str).collect();
        lock(&self.placing.scheduler).adapters_mut().report(worker, report.max_loras, &names);
    }

    /// Each worker's adapters as the router knows them.
    pub fn adapters(
        &self,
    ) -> std::collections::BTreeMap<
        WorkerWithDpRank,
        kvroute_core::schedule::adapters::WorkerAdapters,
    > {
        lock(&self.placing.scheduler).adapters().workers().clone()
    }

    /// What session affinity did so far, and how many sessions are remembered.
    pub fn affinity(&self) -> (kvroute_core::schedule::AffinityCounts, usize) {
        lock(&self.placing.scheduler).affinity()
    }

    /// The scheduler's last decisions of tracked requests, oldest first.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        lock(&self.placing.scheduler).recent_decisions()
    }

    /// The in-flight requests the scheduler tracks.
    pub fn in_flight(&self) -> usize {
        lock(&self.placing.scheduler).active().len()
    }
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
    }
}

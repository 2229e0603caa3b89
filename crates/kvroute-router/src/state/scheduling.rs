//! Placement: the scheduler with its in-flight accounting, and approximate mode's
//! bookkeeping ([`Scheduling`]); placing a request, its prefill and end, the peers' requests
//! (replica sync), load reports.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use kvroute_core::index::{ApproxTracker, ShardedIndex};
use kvroute_core::schedule::adapters::WorkerAdapters;
use kvroute_core::schedule::pairs::PairCounts;
use kvroute_core::schedule::{
    AffinityCounts, DecisionRecord, RequestBlocks, RouteRequest, Scheduler,
};
use kvroute_core::{LocalBlockHash, WorkerWithDpRank, sequence_hashes};

use super::lock::lock;
use crate::config::{RouterConfig, WorkerSpec};
use crate::metrics::Metrics;

/// The scheduler and approximate mode. Each is a mutex; where both are held, `approx` is
/// taken first. The scheduler reads the index while it routes (the index's shard locks are
/// leaves).
#[derive(Debug)]
pub struct Scheduling {
    scheduler: Mutex<Scheduler>,
    /// Approximate mode's bookkeeping; its events go to the index under this lock, so each
    /// worker's assumed blocks are applied in order.
    approx: Mutex<ApproxTracker>,
}

impl Scheduling {
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

    /// A worker rank's adapters as it reports them: its slots, the adapters in them.
    pub fn report_adapters(
        &self,
        worker: WorkerWithDpRank,
        slots: Option<usize>,
        in_slots: &[&str],
    ) {
        self.scheduler().adapters_mut().report(worker, slots, in_slots);
    }

    /// Each worker's adapters as the router knows them.
    pub fn adapters(&self) -> BTreeMap<WorkerWithDpRank, WorkerAdapters> {
        self.scheduler().adapters().workers().clone()
    }

    /// Prompt tokens prefilled on a chosen worker that another candidate held, so far.
    pub fn avoidable_prefill_tokens(&self) -> u64 {
        self.scheduler().avoidable_prefill_tokens()
    }

    /// What session affinity did so far, and how many sessions are remembered.
    pub fn affinity(&self) -> (AffinityCounts, usize) {
        self.scheduler().affinity()
    }

    /// The decision of request `id`, while it is among the scheduler's recent ones.
    pub fn decision_of(&self, id: &str) -> Option<DecisionRecord> {
        self.scheduler().decision_of(id)
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

    /// The in-flight requests on a worker's ranks.
    pub fn in_flight_on(&self, worker: kvroute_core::WorkerId, ranks: u32) -> usize {
        let scheduler = self.scheduler();
        (0..ranks).map(|r| scheduler.active().load(WorkerWithDpRank::new(worker, r)).requests).sum()
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

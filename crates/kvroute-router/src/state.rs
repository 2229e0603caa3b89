//! The router's shared state: the KV index, the scheduler, worker status and metrics.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

use kvroute_core::index::{OverlapScores, ShardedIndex};
use kvroute_core::schedule::{RouteDecision, RouteRequest, Scheduler, WorkerLoad};
use kvroute_core::{
    KvCacheEventData, LocalBlockHash, RouterEvent, WorkerId, WorkerWithDpRank, sequence_hashes,
};
use serde::Serialize;

use crate::config::{RouterConfig, WorkerSpec};
use crate::metrics::{EventKind, Metrics};

/// What the router knows of one worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerStatus {
    pub id: WorkerId,
    pub url: Option<String>,
    pub events: Option<String>,
    pub dp_size: u32,
    /// Per rank: is the event subscription connected, and the last sequence number seen.
    pub connected: Vec<bool>,
    pub last_seq: Vec<Option<u64>>,
    /// Per rank: blocks in the index and the last load report.
    pub tree_size: Vec<usize>,
    pub load: Vec<Option<WorkerLoad>>,
    /// Known from configuration (false: it appeared through events).
    pub configured: bool,
}

impl WorkerStatus {
    fn new(spec: &WorkerSpec, configured: bool) -> Self {
        let n = spec.dp_size as usize;
        Self {
            id: spec.id,
            url: spec.url.clone(),
            events: spec.events.clone(),
            dp_size: spec.dp_size,
            connected: vec![false; n],
            last_seq: vec![None; n],
            tree_size: vec![0; n],
            load: vec![None; n],
            configured,
        }
    }
}

/// A request to place, as the HTTP API (or an embedding front door) gives it.
#[derive(Clone, Debug)]
pub struct Placement<'a> {
    pub local_hashes: &'a [LocalBlockHash],
    pub num_tokens: usize,
    pub request_id: Option<&'a str>,
    pub overlap_weight: Option<f64>,
    pub temperature: Option<f64>,
    /// Caches not to choose.
    pub exclude: &'a [WorkerWithDpRank],
}

#[derive(Debug)]
pub struct RouterState {
    pub config: RouterConfig,
    pub index: ShardedIndex,
    pub metrics: Metrics,
    scheduler: Mutex<Scheduler>,
    workers: RwLock<BTreeMap<WorkerId, WorkerStatus>>,
    decisions: Mutex<BTreeMap<WorkerWithDpRank, u64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RouterState {
    pub fn new(config: RouterConfig) -> Self {
        let mut scheduler_config = config.scheduler;
        scheduler_config.block_size = config.block_size;
        let state = Self {
            index: ShardedIndex::new(config.shards, config.index),
            metrics: Metrics::default(),
            scheduler: Mutex::new(Scheduler::new(scheduler_config)),
            workers: RwLock::new(BTreeMap::new()),
            decisions: Mutex::new(BTreeMap::new()),
            config,
        };
        for spec in &state.config.workers {
            state.add_worker(spec, true);
        }
        state
    }

    fn add_worker(&self, spec: &WorkerSpec, configured: bool) {
        let mut scheduler = lock(&self.scheduler);
        for rank in 0..spec.dp_size {
            let w = WorkerWithDpRank::new(spec.id, rank);
            scheduler.add_worker(w);
            self.index.register_worker(w);
        }
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        workers.entry(spec.id).or_insert_with(|| WorkerStatus::new(spec, configured));
    }

    /// A worker seen in events but not configured becomes a candidate (the standalone router
    /// learns its fleet from `/events` and `/debug/inject_event`).
    fn ensure_worker(&self, worker: WorkerWithDpRank) {
        let known = {
            let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
            workers.get(&worker.worker_id).is_some_and(|w| worker.dp_rank.0 < w.dp_size)
        };
        if !known {
            let mut spec = WorkerSpec::new(worker.worker_id.0);
            spec.dp_size = worker.dp_rank.0 + 1;
            let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
            if let Some(status) = workers.get_mut(&worker.worker_id) {
                // A rank beyond the configured ones: grow the per-rank vectors.
                let n = spec.dp_size as usize;
                status.dp_size = status.dp_size.max(spec.dp_size);
                status.connected.resize(n.max(status.connected.len()), false);
                status.last_seq.resize(n.max(status.last_seq.len()), None);
                status.tree_size.resize(n.max(status.tree_size.len()), 0);
                status.load.resize(n.max(status.load.len()), None);
            } else {
                workers.insert(worker.worker_id, WorkerStatus::new(&spec, false));
            }
            drop(workers);
            lock(&self.scheduler).add_worker(worker);
        }
    }

    /// Whether `rank` is within the configured bound of data-parallel ranks.
    pub fn valid_dp_rank(&self, rank: kvroute_core::DpRank) -> bool {
        rank.0 < self.config.max_dp_size
    }

    /// Applies core events to the index; returns how many were applied cleanly. Events naming
    /// a data-parallel rank at or above `max_dp_size` are refused (counted) before they can
    /// register anything.
    pub fn apply(&self, events: &[RouterEvent]) -> usize {
        let mut ok = 0;
        for e in events {
            if !self.valid_dp_rank(e.event.dp_rank) {
                self.metrics.rejected_dp_rank.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(worker = %e.worker_id, dp_rank = %e.event.dp_rank, "event refused: dp rank out of range");
                continue;
            }
            self.ensure_worker(e.worker());
            let kind = match e.event.data {
                KvCacheEventData::Stored(_) => EventKind::Stored,
                KvCacheEventData::Removed(_) => EventKind::Removed,
                KvCacheEventData::Cleared => EventKind::Cleared,
            };
            let result = self.index.apply_event(e);
            if let Err(err) = &result {
                tracing::debug!(worker = %e.worker(), %err, "event not applied cleanly");
            }
            self.metrics.event(kind, result.is_ok());
            ok += usize::from(result.is_ok());
        }
        ok
    }

    /// Chooses a worker. `None` when there is none to choose.
    pub fn place(&self, p: &Placement<'_>) -> Option<(RouteDecision, OverlapScores)> {
        let start = Instant::now();
        let scores = self.index.find_matches(p.local_hashes);
        let sequence = sequence_hashes(p.local_hashes);
        let request = RouteRequest {
            id: p.request_id,
            isl_tokens: p.num_tokens,
            local_hashes: p.local_hashes,
            sequence_hashes: &sequence,
            overlap_weight: p.overlap_weight,
            temperature: p.temperature,
            exclude: p.exclude,
        };
        let decision = lock(&self.scheduler).route(&request, &scores, &self.index, start)?;
        self.metrics.decision_latency.observe(start.elapsed());
        self.metrics.decisions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *lock(&self.decisions).entry(decision.worker).or_insert(0) += 1;
        Some((decision, scores))
    }

    pub fn prefill_done(&self, request_id: &str) {
        lock(&self.scheduler).mark_prefill_done(request_id, Instant::now());
    }

    /// Returns whether the request was in flight.
    pub fn finish(&self, request_id: &str) -> bool {
        lock(&self.scheduler).free(request_id)
    }

    pub fn reclaim_stale(&self) -> usize {
        lock(&self.scheduler).reclaim_stale(Instant::now())
    }

    pub fn update_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) {
        lock(&self.scheduler).update_load(worker, load);
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = workers
            .get_mut(&worker.worker_id)
            .and_then(|w| w.load.get_mut(worker.dp_rank.0 as usize))
        {
            *slot = Some(load);
        }
    }

    /// Records a subscription's state for `/workers`.
    pub fn set_connection(&self, worker: WorkerWithDpRank, connected: bool, last_seq: Option<u64>) {
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = workers.get_mut(&worker.worker_id) {
            let rank = worker.dp_rank.0 as usize;
            if let Some(c) = w.connected.get_mut(rank) {
                *c = connected;
            }
            if let Some(s) = w.last_seq.get_mut(rank) {
                *s = last_seq.or(*s);
            }
        }
    }

    pub fn workers(&self) -> Vec<WorkerStatus> {
        let workers = self.workers.read().unwrap_or_else(PoisonError::into_inner);
        workers
            .values()
            .cloned()
            .map(|mut w| {
                w.tree_size = (0..w.dp_size)
                    .map(|r| self.index.tree_size(WorkerWithDpRank::new(w.id, r)))
                    .collect();
                w
            })
            .collect()
    }

    /// The in-flight requests the scheduler tracks.
    pub fn in_flight(&self) -> usize {
        lock(&self.scheduler).active().len()
    }

    pub fn render_metrics(&self) -> String {
        let per_worker: Vec<(u64, u32, u64)> =
            lock(&self.decisions).iter().map(|(w, &n)| (w.worker_id.0, w.dp_rank.0, n)).collect();
        self.metrics.render(&self.index.stats(), &per_worker)
    }
}

//! The router's shared state: the KV index, the scheduler, approximate mode, worker status
//! (with readiness) and metrics.
//!
//! A worker rank is **ready** when its event stream is connected and its replay has caught up
//! (workers without `events` need none), and, for a worker with `metrics`, a first load report
//! has arrived. A rank that is not ready is routed to only when no ready one is left, so the
//! first requests after start-up, or after an engine went away, do not land on a cache the
//! router cannot see.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use kvroute_core::index::{ApproxTracker, OverlapScores, ShardedIndex};
use kvroute_core::schedule::{
    DecisionRecord, RequestBlocks, RouteDecision, RouteRequest, Scheduler, WorkerLoad,
};
use kvroute_core::{
    DpRank, KvCacheEventData, LocalBlockHash, RouterEvent, WorkerId, WorkerWithDpRank,
    sequence_hashes,
};
use kvroute_http::metrics::Registry;
use kvroute_http::router_api::Answered;
use kvroute_wire::ConvertStats;
use kvroute_wire::replica::SyncMessage;
use kvroute_wire::transport::ZmqLimits;
use serde::Serialize;

use crate::checks::{Change, CheckStatus, Checks};
use crate::config::{RouterConfig, WorkerSpec};
use crate::links::{NatsLinks, Relayed};
use crate::metrics::{
    BlocksLabels, EventKind, Metrics, PredictionLabels, WorkerIdLabels, WorkerLabels,
};

/// How the router knows a worker's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    /// From the KV events the engine publishes.
    Events,
    /// From its own routing decisions, for engines without events.
    Approximate,
}

impl CacheMode {
    fn name(self) -> &'static str {
        match self {
            Self::Events => "events",
            Self::Approximate => "approximate",
        }
    }
}

/// Whether a worker's KV events describe the blocks the front door hashes (the parity probe
/// at join: a known prompt sent to the worker, its announced blocks compared).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "cause")]
pub enum Parity {
    #[default]
    Unchecked,
    /// Not probed yet, and why: it is tried again after a backoff (its events trusted
    /// meanwhile).
    Retrying(String),
    Ok,
    /// Its events cannot be trusted: ignored, the worker routed approximately.
    Failed(String),
}

/// What the router knows of one worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerStatus {
    pub id: WorkerId,
    pub url: Option<String>,
    pub events: Option<String>,
    pub replay: Option<String>,
    pub metrics: Option<String>,
    pub mode: CacheMode,
    pub dp_size: u32,
    /// Per rank: ready to be routed to (see the module docs).
    pub ready: Vec<bool>,
    /// Per rank: is the event subscription connected, has its first replay caught up, and
    /// the last sequence number seen.
    pub connected: Vec<bool>,
    pub caught_up: Vec<bool>,
    pub last_seq: Vec<Option<u64>>,
    /// Per rank: blocks in the index and the last load report.
    pub tree_size: Vec<usize>,
    pub load: Vec<Option<WorkerLoad>>,
    /// What conversion did with the worker's event blocks (all ranks).
    pub conversion: ConvertStats,
    /// Known from configuration (false: it appeared through events).
    pub configured: bool,
    /// Its predictions against what it served: drift and silence (see [`crate::checks`]).
    pub checks: CheckStatus,
    pub parity: Parity,
    /// Ranks with an event subscription of their own (the configured ones).
    #[serde(skip)]
    subscribed: usize,
}

impl WorkerStatus {
    fn new(spec: &WorkerSpec, configured: bool) -> Self {
        let n = spec.dp_size as usize;
        let mode = match (&spec.events, configured) {
            (None, true) => CacheMode::Approximate,
            _ => CacheMode::Events,
        };
        let mut status = Self {
            id: spec.id,
            url: spec.url.clone(),
            events: spec.events.clone(),
            replay: spec.replay.clone(),
            metrics: spec.metrics.clone(),
            mode,
            dp_size: spec.dp_size,
            ready: vec![false; n],
            connected: vec![false; n],
            caught_up: vec![false; n],
            last_seq: vec![None; n],
            tree_size: vec![0; n],
            load: vec![None; n],
            conversion: ConvertStats::default(),
            configured,
            checks: CheckStatus::default(),
            parity: Parity::Unchecked,
            subscribed: if configured { n } else { 0 },
        };
        for rank in 0..n {
            status.ready[rank] = status.rank_ready(rank);
        }
        status
    }

    fn follow_stream(&mut self, source: String) {
        self.events = Some(source);
        self.mode = CacheMode::Events;
        for rank in 0..self.ready.len() {
            self.ready[rank] = self.rank_ready(rank);
        }
    }

    fn rank_ready(&self, rank: usize) -> bool {
        // Workers and ranks learned from events are as ready as what brought them.
        rank >= self.subscribed || (self.stream_up(rank) && self.load_in(rank))
    }

    /// Its event stream (if it has one) connected and caught up at `rank`.
    fn stream_up(&self, rank: usize) -> bool {
        self.events.is_none()
            || (self.connected.get(rank) == Some(&true) && self.caught_up.get(rank) == Some(&true))
    }

    /// Its first load report (if it sends any) in at `rank`.
    fn load_in(&self, rank: usize) -> bool {
        self.metrics.is_none() || self.load.get(rank).is_some_and(Option::is_some)
    }

    /// What `rank` still waits for before it is ready: its event stream, its first load
    /// report, its parity probe (with the cause when the probe could not be made yet).
    pub fn waiting_for(&self, rank: usize) -> Vec<String> {
        let mut missing = Vec::new();
        if !self.stream_up(rank) {
            missing.push("its event stream".to_owned());
        }
        if !self.load_in(rank) {
            missing.push("its first load report".to_owned());
        }
        match &self.parity {
            Parity::Retrying(cause) => missing.push(format!("its parity probe ({cause})")),
            Parity::Unchecked if self.events.is_some() => {
                missing.push("its parity probe".to_owned());
            }
            _ => {}
        }
        missing
    }

    fn grow(&mut self, n: usize) {
        if n <= self.connected.len() {
            return;
        }
        self.dp_size = n as u32;
        self.connected.resize(n, false);
        self.caught_up.resize(n, false);
        self.last_seq.resize(n, None);
        self.tree_size.resize(n, 0);
        self.load.resize(n, None);
        self.ready.resize(n, true);
    }
}

/// Why a rank named from outside was refused ([`RouterState::check_rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RankRefused {
    #[error("the worker is configured with dp_size {dp_size}")]
    NotConfigured { dp_size: u32 },
    #[error("dp_rank must be below max_dp_size {max_dp_size}")]
    AboveMax { max_dp_size: u32 },
}

/// What the router knows of an event's worker.
enum Known {
    No,
    /// The worker, not this rank.
    Worker {
        configured: bool,
    },
    Rank,
}

fn kind_of(e: &RouterEvent) -> EventKind {
    match e.event.data {
        KvCacheEventData::Stored(_) => EventKind::Stored,
        KvCacheEventData::Removed(_) => EventKind::Removed,
        KvCacheEventData::Cleared => EventKind::Cleared,
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
    /// Approximate mode's bookkeeping; its events go to `index` under this lock, so each
    /// worker's assumed blocks are applied in order.
    approx: Mutex<ApproxTracker>,
    /// Signalled whenever a rank's readiness may have changed.
    changed: tokio::sync::Notify,
    /// Predictions against answers, per worker.
    checks: Mutex<Checks>,
    /// Ranks whose subscription should replay all its engine still buffers (after a drift).
    resync: Mutex<std::collections::BTreeSet<WorkerWithDpRank>>,
    /// Whether `resync` may hold anything (checked on every event batch without the lock).
    resync_pending: std::sync::atomic::AtomicBool,
    /// Replica sync and the event stream, when NATS is configured (set once it starts).
    nats: OnceLock<NatsLinks>,
    /// What every ZMQ socket of the router may receive; refusals count in `metrics`.
    pub zmq: ZmqLimits,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RouterState {
    pub fn new(config: RouterConfig) -> Self {
        let mut scheduler_config = config.scheduler;
        scheduler_config.block_size = config.block_size;
        let state = Self {
            zmq: ZmqLimits::new(config.zmq_max_message_bytes),
            index: ShardedIndex::new(config.shards, config.index),
            metrics: Metrics::new(),
            scheduler: Mutex::new(Scheduler::new(scheduler_config)),
            workers: RwLock::new(BTreeMap::new()),
            approx: Mutex::new(ApproxTracker::new(config.approx)),
            changed: tokio::sync::Notify::new(),
            checks: Mutex::new(Checks::default()),
            resync: Mutex::new(std::collections::BTreeSet::new()),
            resync_pending: std::sync::atomic::AtomicBool::new(false),
            nats: OnceLock::new(),
            config,
        };
        for spec in &state.config.workers {
            state.add_worker(spec, true);
        }
        state
    }

    fn read_workers(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<WorkerId, WorkerStatus>> {
        self.workers.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_workers(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<WorkerId, WorkerStatus>> {
        self.workers.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn add_worker(&self, spec: &WorkerSpec, configured: bool) {
        let mut status = WorkerStatus::new(spec, configured);
        if let Some(nats) = self.config.nats.as_ref().filter(|n| n.events.from_stream()) {
            // Its events come from the stream: ready once the stream's consumer caught up.
            status.follow_stream(format!("jetstream:{}.events.{}.*", nats.prefix, spec.id));
        }
        let mut scheduler = lock(&self.scheduler);
        for rank in 0..spec.dp_size {
            let w = WorkerWithDpRank::new(spec.id, rank);
            scheduler.add_worker(w);
            scheduler.set_ready(w, status.ready[rank as usize]);
            self.index.register_worker(w);
        }
        drop(scheduler);
        self.write_workers().entry(spec.id).or_insert(status);
    }

    /// A worker seen in events but not configured becomes a candidate (the standalone router
    /// learns its fleet from `/events` and `/debug/inject_event`).
    fn ensure_worker(&self, worker: WorkerWithDpRank) {
        let (known, approximate) =
            self.read_workers().get(&worker.worker_id).map_or((false, false), |w| {
                (worker.dp_rank.0 < w.dp_size, w.mode == CacheMode::Approximate)
            });
        if approximate {
            self.leave_approximate(worker.worker_id);
        }
        if known {
            return;
        }
        let mut workers = self.write_workers();
        match workers.get_mut(&worker.worker_id) {
            // A rank beyond the known ones: grow the per-rank tables.
            Some(status) => status.grow(worker.dp_rank.0 as usize + 1),
            None => {
                let mut spec = WorkerSpec::new(worker.worker_id.0);
                spec.dp_size = worker.dp_rank.0 + 1;
                workers.insert(worker.worker_id, WorkerStatus::new(&spec, false));
            }
        }
        drop(workers);
        lock(&self.scheduler).add_worker(worker);
    }

    /// A worker configured without `events` whose events arrive all the same (posted to
    /// `/events`): what the router assumed of it gives way to what it says.
    fn leave_approximate(&self, worker: WorkerId) {
        let mut approx = lock(&self.approx);
        let mut workers = self.write_workers();
        let Some(status) = workers.get_mut(&worker) else { return };
        if status.mode != CacheMode::Approximate {
            return;
        }
        status.mode = CacheMode::Events;
        approx.remove_worker(worker);
        self.index.clear_all_blocks(worker);
        tracing::info!(%worker, "events arrive for a worker routed approximately: following its events");
    }

    /// Whether the worker's last parity probe failed.
    pub fn parity_failed(&self, worker: WorkerId) -> bool {
        self.read_workers().get(&worker).is_some_and(|w| matches!(w.parity, Parity::Failed(_)))
    }

    /// Records a worker's parity probe. A failure (with its cause) makes its events untrusted:
    /// its blocks are cleared, its events ignored (counted as rejected `parity`) and it is
    /// routed approximately; `Ok` (or `Unchecked`, before a new probe) trusts them again.
    pub fn set_parity(&self, worker: WorkerId, parity: Parity) {
        let failed = matches!(parity, Parity::Failed(_));
        let mut approx = lock(&self.approx);
        let mut workers = self.write_workers();
        let Some(status) = workers.get_mut(&worker) else { return };
        let was_failed = matches!(status.parity, Parity::Failed(_));
        status.parity = parity;
        if failed && status.mode == CacheMode::Events {
            status.mode = CacheMode::Approximate;
            self.index.clear_all_blocks(worker);
        } else if !failed && was_failed && status.events.is_some() {
            status.mode = CacheMode::Events;
            approx.remove_worker(worker);
            self.index.clear_all_blocks(worker);
        }
    }

    /// Workers whose predictions are discounted now.
    fn drifted(&self) -> Vec<WorkerId> {
        let checks = lock(&self.checks);
        checks.workers.iter().filter(|(_, c)| c.drifted).map(|(w, _)| *w).collect()
    }

    /// The worker's event stream delivered something (it is not silent).
    fn event_seen(&self, worker: WorkerId) {
        lock(&self.checks).workers.entry(worker).or_default().event_seen(Instant::now());
    }

    /// Records an answered request (from this process's front door, or one posted to
    /// `/answers`): the cached tokens predicted against those the engine served. Counts it,
    /// and acts on what it shows: a worker found drifted is logged, its blocks cleared and its
    /// subscription asked to replay; one serving without events is flagged. A worker the
    /// router does not know is refused (`false`).
    pub fn record_answer(&self, a: &Answered) -> bool {
        let id = a.worker_id;
        if !self.knows_worker(id) || self.check_rank(a.worker()).is_err() {
            return false;
        }
        let (predicted, actual) = (a.predicted_cached_tokens, a.cached_tokens);
        // Only an answer for which the engine computed a full block it did not hold must have
        // produced an event (see `checks`); a worker routed approximately publishes none by
        // design.
        let bs = self.config.block_size.tokens() as u64;
        let stores = a.prompt_tokens >= actual.saturating_add(2 * bs);
        let expects_events = self.mode(id) == Some(CacheMode::Events);
        let (outcome, change) = lock(&self.checks).workers.entry(id).or_default().record(
            predicted,
            actual,
            stores && expects_events,
        );
        let m = &self.metrics;
        let labels = WorkerIdLabels { worker_id: id.0 };
        m.prompt_tokens.get_or_create(&labels).inc_by(a.prompt_tokens);
        m.cached_tokens.get_or_create(&labels).inc_by(actual.min(a.prompt_tokens));
        m.predictions
            .get_or_create(&PredictionLabels { worker_id: id.0, outcome: outcome.name() })
            .inc();
        m.prediction_error
            .get_or_create(&WorkerIdLabels { worker_id: id.0 })
            .observe(predicted.abs_diff(actual) as f64);
        match change {
            Change::None => {}
            Change::Drifted => {
                m.drifts.get_or_create(&WorkerIdLabels { worker_id: id.0 }).inc();
                tracing::warn!(worker = %id, "the index no longer matches the worker's cache (predictions over what it serves): resynchronising, its overlaps discounted until they agree");
                self.index.clear_all_blocks(id);
                let ranks = self.read_workers().get(&id).map_or(1, |w| w.dp_size);
                let mut resync = lock(&self.resync);
                resync.extend((0..ranks).map(|r| WorkerWithDpRank::new(id, r)));
                self.resync_pending.store(true, std::sync::atomic::Ordering::Release);
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

    /// The scheduler's last decisions of tracked requests, oldest first.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        lock(&self.scheduler).recent_decisions()
    }

    /// Whether `worker`'s subscription should replay everything its engine buffers (once).
    pub fn take_resync(&self, worker: WorkerWithDpRank) -> bool {
        if !self.resync_pending.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        let mut resync = lock(&self.resync);
        let taken = resync.remove(&worker);
        if resync.is_empty() {
            self.resync_pending.store(false, std::sync::atomic::Ordering::Release);
        }
        taken
    }

    /// Forgets every block of `worker` (all ranks): its engine is gone, its cache with it.
    pub fn forget_blocks(&self, worker: WorkerId) {
        let ranks = self.read_workers().get(&worker).map_or(0, |w| w.dp_size);
        let held: usize =
            (0..ranks).map(|r| self.index.tree_size(WorkerWithDpRank::new(worker, r))).sum();
        if held == 0 {
            return;
        }
        self.index.clear_all_blocks(worker);
        tracing::info!(%worker, blocks = held, "its engine is unreachable: its blocks are forgotten");
    }

    /// Whether `rank` is within the configured bound of data-parallel ranks.
    pub fn valid_dp_rank(&self, rank: DpRank) -> bool {
        rank.0 < self.config.max_dp_size
    }

    /// The one check of a rank named by outside bytes (engine events, `/events`,
    /// `/answers`, `/debug/inject_event`). A configured worker has exactly the ranks of its
    /// `dp_size`: bytes never add one. A worker the router learned from posted events (no
    /// worker configured) may be named at any rank below `max_dp_size`, as may one not
    /// known yet.
    pub fn check_rank(&self, worker: WorkerWithDpRank) -> Result<(), RankRefused> {
        match self.knows(worker) {
            Known::Rank => Ok(()),
            Known::Worker { configured: true } => {
                let dp_size = self.read_workers().get(&worker.worker_id).map_or(1, |w| w.dp_size);
                Err(RankRefused::NotConfigured { dp_size })
            }
            Known::Worker { configured: false } | Known::No
                if self.valid_dp_rank(worker.dp_rank) =>
            {
                Ok(())
            }
            _ => Err(RankRefused::AboveMax { max_dp_size: self.config.max_dp_size }),
        }
    }

    /// Applies events from the engines' own streams to the index; returns how many were applied
    /// cleanly. Events naming a data-parallel rank at or above `max_dp_size` are refused
    /// (counted) before they can register anything.
    pub fn apply(&self, events: &[RouterEvent]) -> usize {
        self.apply_from(events, false)
    }

    /// Applies events posted over HTTP (`/events`, `/debug/inject_event`). A worker the router
    /// does not know is learned only when no worker is configured (the standalone router learns
    /// its fleet this way), at most `max_learned_workers` of them, and only by a Stored event
    /// that stores something; anything else naming an unknown worker is refused (counted as
    /// `unknown_worker`) and registers nothing.
    pub fn apply_posted(&self, events: &[RouterEvent]) -> usize {
        self.apply_from(events, true)
    }

    fn apply_from(&self, events: &[RouterEvent], posted: bool) -> usize {
        let mut ok = 0;
        let mut seen: Option<(WorkerId, bool)> = None;
        for e in events {
            if seen.is_none_or(|(w, _)| w != e.worker_id) {
                let failed = self.parity_failed(e.worker_id);
                if !failed && self.knows_worker(e.worker_id) {
                    self.event_seen(e.worker_id);
                }
                seen = Some((e.worker_id, failed));
            }
            if seen.is_some_and(|(_, failed)| failed) {
                self.metrics.rejected("parity");
                continue;
            }
            let worker = e.worker();
            if let Err(why) = self.check_rank(worker) {
                self.metrics.rejected("dp_rank");
                tracing::debug!(%worker, %why, "event refused");
                continue;
            }
            match self.knows(worker) {
                Known::No if posted && !self.may_learn() => {
                    self.metrics.rejected("unknown_worker");
                    tracing::debug!(%worker, "posted event refused: unknown worker");
                    continue;
                }
                _ => {}
            }
            if self.knows_rank(worker) {
                // Known: what it says overrides approximate mode, before it applies.
                self.ensure_worker(worker);
                ok += usize::from(self.apply_one(e));
                continue;
            }
            if !matches!(e.event.data, KvCacheEventData::Stored(_)) {
                // Nothing to remove or clear: it must not register the worker either.
                self.metrics.event(kind_of(e), false);
                continue;
            }
            let applied = self.apply_one(e);
            if self.index.tree_size(worker) > 0 {
                self.ensure_worker(worker);
            }
            ok += usize::from(applied);
        }
        ok
    }

    fn knows(&self, worker: WorkerWithDpRank) -> Known {
        match self.read_workers().get(&worker.worker_id) {
            None => Known::No,
            Some(w) if worker.dp_rank.0 < w.dp_size => Known::Rank,
            Some(w) => Known::Worker { configured: w.configured },
        }
    }

    /// Whether the worker is configured or was learned.
    pub fn knows_worker(&self, worker: WorkerId) -> bool {
        self.read_workers().contains_key(&worker)
    }

    fn knows_rank(&self, worker: WorkerWithDpRank) -> bool {
        matches!(self.knows(worker), Known::Rank)
    }

    /// Whether a posted event may add a worker.
    fn may_learn(&self) -> bool {
        self.config.workers.is_empty()
            && self.read_workers().len() < self.config.max_learned_workers
    }

    fn apply_one(&self, e: &RouterEvent) -> bool {
        let kind = kind_of(e);
        let result = self.index.apply_event(e);
        if let Err(err) = &result {
            tracing::debug!(worker = %e.worker(), %err, "event not applied cleanly");
        }
        self.metrics.event(kind, result.is_ok());
        result.is_ok()
    }

    /// Chooses a worker. `None` when there is none to choose. A drifted worker's overlap counts
    /// half until its predictions agree again (not nothing: it must still be routed the
    /// prefixes only it holds, or its predictions could never be seen to agree).
    pub fn place(&self, p: &Placement<'_>) -> Option<(RouteDecision, OverlapScores)> {
        let start = Instant::now();
        let mut scores = self.index.find_matches(p.local_hashes);
        let drifted = self.drifted();
        for (w, score) in &mut scores.scores {
            if drifted.contains(&w.worker_id) {
                *score /= 2;
            }
        }
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
        if let (Some(id), Some(nats)) = (p.request_id, self.nats.get()) {
            nats.send(
                &self.metrics,
                SyncMessage::Routed {
                    id: id.to_owned(),
                    worker_id: decision.worker.worker_id.0,
                    dp_rank: decision.worker.dp_rank.0,
                    isl_tokens: p.num_tokens,
                    prefill_tokens: decision.predicted_prefill_tokens,
                    local_hashes: p.local_hashes.iter().map(|h| h.0).collect(),
                },
            );
        }
        if self.mode(decision.worker.worker_id) == Some(CacheMode::Approximate) {
            let mut approx = lock(&self.approx);
            for e in approx.record_routed(decision.worker, p.local_hashes, start) {
                self.apply_one(&e);
            }
        }
        self.metrics.decision(decision.worker, start.elapsed());
        Some((decision, scores))
    }

    fn mode(&self, worker: WorkerId) -> Option<CacheMode> {
        self.read_workers().get(&worker).map(|w| w.mode)
    }

    /// Forgets approximate-mode blocks whose time is up.
    pub fn expire_approximate(&self, now: Instant) {
        let mut approx = lock(&self.approx);
        for e in approx.expire(now) {
            self.apply_one(&e);
        }
    }

    /// Whether any configured worker is routed in approximate mode.
    pub fn has_approximate(&self) -> bool {
        self.read_workers().values().any(|w| w.mode == CacheMode::Approximate)
    }

    pub fn prefill_done(&self, request_id: &str) {
        lock(&self.scheduler).mark_prefill_done(request_id, Instant::now());
        if let Some(nats) = self.nats.get() {
            nats.send(&self.metrics, SyncMessage::PrefillDone { id: request_id.to_owned() });
        }
    }

    /// Returns whether the request was in flight.
    pub fn finish(&self, request_id: &str) -> bool {
        let tracked = lock(&self.scheduler).free(request_id);
        if let (true, Some(nats)) = (tracked, self.nats.get()) {
            nats.send(&self.metrics, SyncMessage::Freed { id: request_id.to_owned() });
        }
        tracked
    }

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

    pub(crate) fn set_nats(&self, links: NatsLinks) {
        if self.nats.set(links).is_err() {
            tracing::warn!("NATS links set twice; keeping the first");
        }
    }

    /// The replica's NATS links (`None` without NATS).
    pub fn nats(&self) -> Option<&NatsLinks> {
        self.nats.get()
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
        let scores = self.index.find_matches(local);
        let sequence = sequence_hashes(local);
        let request = RouteRequest {
            id: None,
            isl_tokens,
            local_hashes: local,
            sequence_hashes: &sequence,
            overlap_weight: None,
            temperature: None,
            exclude: &[],
        };
        let mut scheduler = lock(&self.scheduler);
        if let Some(mine) = scheduler.route(&request, &scores, &self.index, now) {
            self.metrics.agreement(mine.worker == worker);
        }
        let blocks = RequestBlocks { local, sequence: &sequence };
        scheduler.track(key, worker, prefill_tokens, blocks, now)
    }

    pub(crate) fn peer_prefill_done(&self, key: &str) {
        lock(&self.scheduler).prefill_done_elsewhere(key);
    }

    /// Frees a peer's request without telling the peers.
    pub(crate) fn free_peer(&self, key: &str) {
        lock(&self.scheduler).free(key);
    }

    /// Hands an engine's converted batch on: into the event stream (relay) or the index.
    pub(crate) async fn ingest(
        &self,
        worker: WorkerWithDpRank,
        seq: Option<u64>,
        events: Vec<RouterEvent>,
    ) {
        let relay = self.nats.get().and_then(|n| n.relay.as_ref());
        match relay {
            Some(relay) => {
                let batch = Relayed { worker, seq, events };
                if let Err(tokio::sync::mpsc::error::SendError(batch)) = relay.send(batch).await {
                    self.apply(&batch.events);
                }
            }
            None => {
                self.apply(&events);
            }
        }
    }

    /// The event stream's consumer has seen what the stream held: every worker that follows
    /// it is connected and caught up.
    pub(crate) fn stream_caught_up(&self) {
        let ranks: Vec<WorkerWithDpRank> = self
            .read_workers()
            .values()
            .filter(|w| w.configured)
            .flat_map(|w| (0..w.dp_size).map(move |r| WorkerWithDpRank::new(w.id, r)))
            .collect();
        for w in ranks {
            self.update_rank(w, |s, rank| {
                s.connected[rank] = true;
                s.caught_up[rank] = true;
            });
        }
    }

    pub fn reclaim_stale(&self) -> usize {
        lock(&self.scheduler).reclaim_stale(Instant::now())
    }

    pub fn update_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) {
        lock(&self.scheduler).update_load(worker, load);
        if self.mode(worker.worker_id) == Some(CacheMode::Approximate) {
            let capacity = load.kv_total_blocks.map(|b| b as usize);
            lock(&self.approx).set_capacity(worker, capacity);
        }
        self.update_rank(worker, |w, rank| w.load[rank] = Some(load));
    }

    /// Records a subscription's state (connection, last sequence number seen).
    pub fn set_connection(&self, worker: WorkerWithDpRank, connected: bool, last_seq: Option<u64>) {
        self.update_rank(worker, |w, rank| {
            w.connected[rank] = connected;
            if !connected {
                w.caught_up[rank] = false;
            }
            w.last_seq[rank] = last_seq.or(w.last_seq[rank]);
        });
    }

    /// A subscription's first replay after connecting is done (or there is no replay).
    pub fn set_caught_up(&self, worker: WorkerWithDpRank) {
        self.update_rank(worker, |w, rank| w.caught_up[rank] = true);
    }

    /// Adds what conversion did with one message of a worker's blocks; the first blocks of
    /// another size are logged as an error (its events cannot be used).
    pub fn record_conversion(&self, worker: WorkerWithDpRank, stats: &ConvertStats) {
        if *stats == ConvertStats::default() {
            return;
        }
        self.metrics.converted(worker.worker_id.0, stats);
        let mut workers = self.write_workers();
        let Some(w) = workers.get_mut(&worker.worker_id) else { return };
        if w.conversion.wrong_block_size == 0 && stats.wrong_block_size > 0 {
            tracing::error!(
                worker = %worker,
                engine_block_size = ?stats.seen_block_size,
                router_block_size = self.config.block_size.get(),
                "the worker publishes blocks of another size: its KV events are ignored (set block_size for this worker or the router to match the engine)"
            );
        }
        w.conversion += *stats;
    }

    /// Changes one rank's status and re-derives its readiness.
    fn update_rank(&self, worker: WorkerWithDpRank, f: impl FnOnce(&mut WorkerStatus, usize)) {
        let rank = worker.dp_rank.0 as usize;
        let mut workers = self.write_workers();
        let Some(w) = workers.get_mut(&worker.worker_id) else { return };
        if rank >= w.connected.len() {
            return;
        }
        f(w, rank);
        let ready = w.rank_ready(rank);
        if ready != w.ready[rank] {
            w.ready[rank] = ready;
            drop(workers);
            lock(&self.scheduler).set_ready(worker, ready);
            tracing::debug!(%worker, ready, "readiness changed");
        } else {
            drop(workers);
        }
        self.changed.notify_waiters();
    }

    /// The ranks not ready now.
    pub fn not_ready(&self) -> Vec<WorkerWithDpRank> {
        let workers = self.read_workers();
        workers
            .values()
            .flat_map(|w| {
                w.ready
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| !**r)
                    .map(|(rank, _)| WorkerWithDpRank::new(w.id, rank as u32))
            })
            .collect()
    }

    /// Waits until every rank is ready or `timeout` passes; returns the ranks still not ready.
    pub async fn wait_ready(&self, timeout: Duration) -> Vec<WorkerWithDpRank> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.changed.notified();
            let waiting = self.not_ready();
            if waiting.is_empty() || tokio::time::Instant::now() >= deadline {
                return waiting;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    pub fn workers(&self) -> Vec<WorkerStatus> {
        let workers = self.read_workers();
        workers
            .values()
            .cloned()
            .map(|mut w| {
                w.tree_size = (0..w.dp_size)
                    .map(|r| self.index.tree_size(WorkerWithDpRank::new(w.id, r)))
                    .collect();
                if let Some(c) = lock(&self.checks).workers.get(&w.id) {
                    w.checks = c.clone();
                }
                w
            })
            .collect()
    }

    /// The in-flight requests the scheduler tracks.
    pub fn in_flight(&self) -> usize {
        lock(&self.scheduler).active().len()
    }

    /// The metrics registry, with the sizes read at scrape time brought up to date.
    pub fn registry(&self) -> &Registry {
        let m = &self.metrics;
        let stats = self.index.stats();
        m.index_blocks.set(stats.blocks as i64);
        m.index_held_blocks.set(stats.held_blocks as i64);
        m.index_budget.set(self.index.budget().map_or(-1, |b| b as i64));
        m.index_evicted.sync(stats.evicted_blocks);
        m.sync_zmq_refused();
        m.in_flight.set(self.in_flight() as i64);
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
        for w in self.workers() {
            for rank in 0..w.dp_size {
                let labels = WorkerLabels { worker_id: w.id.0, dp_rank: rank };
                let r = rank as usize;
                m.worker_ready.get_or_create(&labels).set(i64::from(w.ready[r]));
                let blocks = BlocksLabels { worker_id: w.id.0, dp_rank: rank, mode: w.mode.name() };
                m.worker_blocks.get_or_create(&blocks).set(w.tree_size[r] as i64);
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
}

//! KV events into the index: from the engines' streams (through a subscription's [`Ingest`]
//! handle, or the JetStream relay) and posted over HTTP; approximate mode's expiry.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvroute_core::{KvCacheEventData, RouterEvent, WorkerId, WorkerWithDpRank};
use kvroute_wire::ConvertStats;

use kvroute_core::index::ShardedIndex;

use super::composite::RouterState;
use super::fleet::{Fleet, Known};
use super::scheduling::Scheduling;
use super::status::{CacheMode, Live};
use crate::links::Relayed;
use crate::metrics::{EventKind, Metrics};

fn kind_of(e: &RouterEvent) -> EventKind {
    match e.event.data {
        KvCacheEventData::Stored(_) => EventKind::Stored,
        KvCacheEventData::Removed(_) => EventKind::Removed,
        KvCacheEventData::Cleared => EventKind::Cleared,
    }
}

impl RouterState {
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

    /// The way in for one configured rank's event subscription; `None` for a worker not
    /// configured.
    pub fn ingest_for(&self, worker: WorkerWithDpRank) -> Option<Ingest<'_>> {
        let live = self.fleet.live(worker.worker_id)?;
        self.fleet.check_rank(worker).ok()?;
        Some(Ingest { state: self, worker, live })
    }

    /// The general way in: each event's worker and rank checked against the registry.
    fn apply_from(&self, events: &[RouterEvent], posted: bool) -> usize {
        let mut ok = 0;
        let mut seen: Option<(WorkerId, bool)> = None;
        let fleet = &self.fleet;
        for e in events {
            if seen.is_none_or(|(w, _)| w != e.worker_id) {
                let failed = fleet.parity_failed(e.worker_id);
                if !failed && fleet.knows_worker(e.worker_id) {
                    self.checks.event_seen(e.worker_id);
                }
                seen = Some((e.worker_id, failed));
            }
            if seen.is_some_and(|(_, failed)| failed) {
                self.metrics.rejected("parity");
                continue;
            }
            let worker = e.worker();
            if let Err(why) = fleet.check_rank(worker) {
                self.metrics.rejected("dp_rank");
                tracing::debug!(%worker, %why, "event refused");
                continue;
            }
            let known = fleet.knows(worker);
            if matches!(known, Known::No) && posted && !fleet.may_learn() {
                self.metrics.rejected("unknown_worker");
                tracing::debug!(%worker, "posted event refused: unknown worker");
                continue;
            }
            if matches!(known, Known::Rank) {
                // Known: what it says overrides approximate mode, before it applies.
                learn(&self.fleet, &self.scheduling, &self.index, worker);
                ok += usize::from(apply_one(&self.index, &self.metrics, e));
                continue;
            }
            if !matches!(e.event.data, KvCacheEventData::Stored(_)) {
                // Nothing to remove or clear: it must not register the worker either.
                self.metrics.event(kind_of(e), false);
                continue;
            }
            let applied = apply_one(&self.index, &self.metrics, e);
            if self.index.tree_size(worker) > 0 {
                learn(&self.fleet, &self.scheduling, &self.index, worker);
            }
            ok += usize::from(applied);
        }
        ok
    }

    /// Forgets approximate-mode blocks whose time is up.
    pub fn expire_approximate(&self, now: Instant) {
        let mut approx = self.scheduling.approx();
        for e in approx.expire(now) {
            apply_one(&self.index, &self.metrics, &e);
        }
    }
}

/// One configured rank's way into the router, held by its event subscription: the rank was
/// checked once when it was made, and what a batch writes of the rank's status is the
/// worker's [`Live`] part. A batch of the rank's own events is one [`ShardedIndex::apply_batch`]
/// with no lock of the registry; an event naming another rank (a format that names ranks in
/// its events) takes the general way, [`RouterState::apply`].
///
/// [`ShardedIndex::apply_batch`]: kvroute_core::index::ShardedIndex::apply_batch
#[derive(Debug)]
pub struct Ingest<'a> {
    state: &'a RouterState,
    worker: WorkerWithDpRank,
    live: Arc<Live>,
}

impl Ingest<'_> {
    /// Adds what conversion did with one message of the rank's blocks.
    pub fn converted(&self, stats: &ConvertStats) {
        if *stats == ConvertStats::default() {
            return;
        }
        self.state.metrics.converted(self.worker.worker_id.0, stats);
        if let Some(engine) = self.live.converted(stats) {
            // Its events cannot be read: refused, never routed to (blind).
            let fleet = &self.state.fleet;
            let mut scheduler = self.state.scheduling.scheduler();
            for rank in fleet.refuse_block_size(self.worker.worker_id, engine) {
                scheduler.set_ready(rank, false);
                scheduler.set_refused(rank);
            }
            drop(scheduler);
            fleet.signal();
        }
    }

    /// Batch `seq` was handled (the rank's status shows it as its last sequence number).
    pub fn seen(&self, seq: u64) {
        self.live.seen(self.worker.dp_rank.0 as usize, seq);
    }

    /// Hands a converted batch on: into the event stream (relay) or the index.
    pub async fn batch(&self, seq: Option<u64>, events: Vec<RouterEvent>) {
        let relay = self.state.nats.get().and_then(|n| n.relay.as_ref());
        match relay {
            Some(relay) => {
                let batch = Relayed { worker: self.worker, seq, events };
                if let Err(tokio::sync::mpsc::error::SendError(batch)) = relay.send(batch).await {
                    self.apply(&batch.events);
                }
            }
            None => {
                self.apply(&events);
            }
        }
    }

    /// Applies a batch; returns how many events applied cleanly.
    pub fn apply(&self, events: &[RouterEvent]) -> usize {
        let s = self.state;
        if events.is_empty() {
            return 0;
        }
        if events.iter().any(|e| e.worker() != self.worker) {
            return s.apply_from(events, false);
        }
        if self.live.untrusted.load(Ordering::Acquire) {
            s.metrics.rejected_n("parity", events.len() as u64);
            return 0;
        }
        s.checks.event_seen(self.worker.worker_id);
        let errors = s.index.apply_batch(events);
        if self.live.gone.load(Ordering::SeqCst) {
            // It left while this batch was applied: the removal may have run before it.
            s.index.remove_worker(self.worker.worker_id);
            return 0;
        }
        let mut counts = [[0u64; 2]; 3];
        let mut failed = errors.iter().map(|(i, _)| *i).peekable();
        for (i, e) in events.iter().enumerate() {
            let ok = failed.next_if_eq(&i).is_none();
            counts[kind_of(e) as usize][usize::from(ok)] += 1;
        }
        for (i, err) in &errors {
            tracing::debug!(worker = %self.worker, event = i, %err, "event not applied cleanly");
        }
        s.metrics.event_counts(&counts);
        events.len() - errors.len()
    }
}

/// An event's rank becomes known; a worker routed approximately follows its events from now
/// on (what approximate mode assumed of it is forgotten, under its lock: lock order
/// `scheduling.approx` → the fleet's registry).
fn learn(fleet: &Fleet, scheduling: &Scheduling, index: &ShardedIndex, worker: WorkerWithDpRank) {
    let approximate = fleet.mode(worker.worker_id) == Some(CacheMode::Approximate);
    let learned = match approximate {
        true => {
            let mut approx = scheduling.approx();
            let learned = fleet.learn(worker);
            if learned.left_approximate {
                approx.remove_worker(worker.worker_id);
                index.clear_all_blocks(worker.worker_id);
            }
            learned
        }
        false => fleet.learn(worker),
    };
    if learned.new_rank {
        scheduling.scheduler().add_worker(worker);
    }
}

/// Applies one event to the index, counted.
pub(super) fn apply_one(index: &ShardedIndex, metrics: &Metrics, e: &RouterEvent) -> bool {
    let kind = kind_of(e);
    let result = index.apply_event(e);
    if let Err(err) = &result {
        tracing::debug!(worker = %e.worker(), %err, "event not applied cleanly");
    }
    metrics.event(kind, result.is_ok());
    result.is_ok()
}

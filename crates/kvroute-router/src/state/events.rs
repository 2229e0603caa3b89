//! KV events into the index: from the engines' streams (through the subscriber's pipeline, or
//! the JetStream relay) and posted over HTTP; conversion counts; approximate mode's expiry.

use kvroute_core::{KvCacheEventData, RouterEvent, WorkerId, WorkerWithDpRank};
use kvroute_wire::ConvertStats;
use std::time::Instant;

use super::fleet::Known;
use super::{RouterState, lock};
use crate::links::Relayed;
use crate::metrics::EventKind;

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

    pub(super) fn apply_from(&self, events: &[RouterEvent], posted: bool) -> usize {
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

    pub(super) fn apply_one(&self, e: &RouterEvent) -> bool {
        let kind = kind_of(e);
        let result = self.index.apply_event(e);
        if let Err(err) = &result {
            tracing::debug!(worker = %e.worker(), %err, "event not applied cleanly");
        }
        self.metrics.event(kind, result.is_ok());
        result.is_ok()
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

    /// Forgets approximate-mode blocks whose time is up.
    pub fn expire_approximate(&self, now: Instant) {
        let mut approx = lock(&self.placing.approx);
        for e in approx.expire(now) {
            self.apply_one(&e);
        }
    }
}

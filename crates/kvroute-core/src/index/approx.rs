//! Approximate mode, for engines that publish no events: the router assumes the blocks of each
//! request it routes are cached on the chosen worker for a while (a TTL), and forgets them
//! oldest first when they expire or when the worker's share of memory is full.
//!
//! [`ApproxTracker`] does the bookkeeping and answers with the events that describe what it
//! assumes (a Stored for a routed request, Removed for what it forgets), so the router applies
//! them to the same index as real engines' events: one index, one memory budget, one
//! `find_matches`. [`ApproxIndex`] is the tracker with an index of its own.
//!
//! Recorded blocks are named by their [`SequenceHash`] (unique per path), so recording a prefix
//! again finds the same blocks and refreshes them: with a per-worker capacity (the engine's KV
//! blocks, when it reports them), forgetting the least recently routed first is the engine's
//! own LRU, approximated.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::{IndexConfig, OverlapScores, RadixIndex};
use crate::hash::sequence_hashes;
use crate::protocols::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, SequenceHash, WorkerId, WorkerWithDpRank,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ApproxConfig {
    /// How long a routed request's blocks are assumed cached (Dynamo's default: 120 s).
    #[serde(with = "secs")]
    pub ttl: Duration,
    /// Most blocks remembered per worker whose capacity is unknown.
    pub max_blocks_per_worker: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self { ttl: Duration::from_secs(120), max_blocks_per_worker: 1 << 16 }
    }
}

mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Copy, Debug)]
struct Expiry {
    at: Instant,
    /// Which recording of the block this is; a later one makes it stale.
    stamp: u64,
    block: SequenceHash,
}

/// One worker's assumed blocks, oldest first.
#[derive(Debug, Default)]
struct Assumed {
    queue: VecDeque<Expiry>,
    /// The current stamp of each live block.
    live: FxHashMap<SequenceHash, u64>,
    /// Most live blocks (the engine's capacity when known).
    capacity: Option<usize>,
}

/// The bookkeeping of approximate mode; its answers are events to apply to an index.
#[derive(Debug, Default)]
pub struct ApproxTracker {
    config: ApproxConfig,
    workers: FxHashMap<WorkerWithDpRank, Assumed>,
    stamp: u64,
    forgotten: u64,
}

impl ApproxTracker {
    pub fn new(config: ApproxConfig) -> Self {
        Self { config, ..Self::default() }
    }

    pub fn config(&self) -> &ApproxConfig {
        &self.config
    }

    /// Sets how many blocks `worker`'s engine holds (its reported KV capacity); `None` falls
    /// back to [`ApproxConfig::max_blocks_per_worker`].
    pub fn set_capacity(&mut self, worker: WorkerWithDpRank, blocks: Option<usize>) {
        self.workers.entry(worker).or_default().capacity = blocks;
    }

    /// The request with these block hashes was routed to `worker` at `now`: its blocks are
    /// assumed cached there. Returns the events to apply: what expired by `now`, the Stored
    /// of the request's blocks, and what the worker's capacity pushes out.
    pub fn record_routed(
        &mut self,
        worker: WorkerWithDpRank,
        local: &[LocalBlockHash],
        now: Instant,
    ) -> Vec<RouterEvent> {
        let mut events = self.expire(now);
        if local.is_empty() {
            return events;
        }
        let seq = sequence_hashes(local);
        let blocks = local
            .iter()
            .zip(&seq)
            .map(|(&tokens_hash, s)| KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(s.0),
                tokens_hash,
                mm_extra_info: None,
            })
            .collect();
        events.push(event(
            worker,
            KvCacheEventData::Stored(KvCacheStoreData { parent_hash: None, blocks }),
        ));
        let at = now + self.config.ttl;
        let fallback = self.config.max_blocks_per_worker;
        let assumed = self.workers.entry(worker).or_default();
        // Deepest first, so that forgetting in queue order removes leaves before their parents.
        for &block in seq.iter().rev() {
            self.stamp += 1;
            assumed.live.insert(block, self.stamp);
            assumed.queue.push_back(Expiry { at, stamp: self.stamp, block });
        }
        let capacity = assumed.capacity.unwrap_or(fallback);
        let mut gone = Vec::new();
        while assumed.live.len() > capacity {
            let Some(oldest) = assumed.queue.pop_front() else { break };
            if assumed.live.get(&oldest.block) == Some(&oldest.stamp) {
                assumed.live.remove(&oldest.block);
                gone.push(ExternalBlockHash(oldest.block.0));
            }
        }
        // Stale entries (refreshed blocks) are dropped once they outnumber live ones.
        if assumed.queue.len() > 4 * assumed.live.len().max(1024) {
            let live = &assumed.live;
            assumed.queue.retain(|e| live.get(&e.block) == Some(&e.stamp));
        }
        self.forgotten += gone.len() as u64;
        if !gone.is_empty() {
            events.push(removed(worker, gone));
        }
        events
    }

    /// Forgets every block whose TTL ran out by `now`; the Removed events to apply.
    pub fn expire(&mut self, now: Instant) -> Vec<RouterEvent> {
        let mut events = Vec::new();
        for (&worker, assumed) in &mut self.workers {
            let mut gone = Vec::new();
            while let Some(front) = assumed.queue.front().copied() {
                if front.at > now {
                    break;
                }
                assumed.queue.pop_front();
                if assumed.live.get(&front.block) == Some(&front.stamp) {
                    assumed.live.remove(&front.block);
                    gone.push(ExternalBlockHash(front.block.0));
                }
            }
            if !gone.is_empty() {
                self.forgotten += gone.len() as u64;
                events.push(removed(worker, gone));
            }
        }
        events
    }

    /// Blocks assumed on `worker` now.
    pub fn held(&self, worker: WorkerWithDpRank) -> usize {
        self.workers.get(&worker).map_or(0, |a| a.live.len())
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.retain(|w, _| w.worker_id != worker);
    }

    /// Blocks forgotten so far, by TTL or capacity.
    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }
}

/// The tracker with an index of its own.
#[derive(Debug)]
pub struct ApproxIndex {
    tracker: ApproxTracker,
    index: RadixIndex,
}

impl ApproxIndex {
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            tracker: ApproxTracker::new(config),
            index: RadixIndex::with_config(IndexConfig::default()),
        }
    }

    /// Records that the request with these block hashes was routed to `worker` at `now`.
    pub fn record_routed(
        &mut self,
        worker: WorkerWithDpRank,
        local: &[LocalBlockHash],
        now: Instant,
    ) {
        let events = self.tracker.record_routed(worker, local, now);
        self.apply(&events);
    }

    /// Forgets every block whose TTL ran out by `now`.
    pub fn expire(&mut self, now: Instant) {
        let events = self.tracker.expire(now);
        self.apply(&events);
    }

    pub fn set_capacity(&mut self, worker: WorkerWithDpRank, blocks: Option<usize>) {
        self.tracker.set_capacity(worker, blocks);
    }

    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        self.index.find_matches(query)
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.tracker.remove_worker(worker);
    }

    /// Blocks forgotten so far, by TTL or capacity.
    pub fn expired(&self) -> u64 {
        self.tracker.forgotten()
    }

    pub fn index(&self) -> &RadixIndex {
        &self.index
    }

    fn apply(&mut self, events: &[RouterEvent]) {
        for e in events {
            // The tracker names only blocks it stored: nothing can be refused.
            let _ = self.index.apply_event(e);
        }
    }
}

fn event(worker: WorkerWithDpRank, data: KvCacheEventData) -> RouterEvent {
    RouterEvent { worker_id: worker.worker_id, event: KvCacheEvent::new(0, data, worker.dp_rank) }
}

fn removed(worker: WorkerWithDpRank, block_hashes: Vec<ExternalBlockHash>) -> RouterEvent {
    event(worker, KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(locals: &[u64]) -> Vec<LocalBlockHash> {
        locals.iter().copied().map(LocalBlockHash).collect()
    }

    fn config(ttl: u64, max: usize) -> ApproxConfig {
        ApproxConfig { ttl: Duration::from_secs(ttl), max_blocks_per_worker: max }
    }

    #[test]
    fn routed_blocks_expire_after_ttl_and_refresh_on_reuse() {
        let t0 = Instant::now();
        let secs = |s| t0 + Duration::from_secs(s);
        let mut index = ApproxIndex::new(config(10, 100));
        let w1 = WorkerWithDpRank::new(1u64, 0u32);
        index.record_routed(w1, &blocks(&[1, 2, 3]), t0);
        index.record_routed(w1, &blocks(&[1, 2]), secs(5));
        assert_eq!(index.find_matches(&blocks(&[1, 2, 3])).score(w1), 3);
        index.expire(secs(10));
        assert_eq!(
            index.find_matches(&blocks(&[1, 2, 3])).score(w1),
            2,
            "block 3 expired, 1-2 refreshed"
        );
        index.expire(secs(15));
        assert!(index.find_matches(&blocks(&[1])).scores.is_empty());
        assert_eq!(index.index().stats().blocks, 0, "nothing left behind");
        assert_eq!(index.expired(), 3);
    }

    #[test]
    fn capacity_forgets_the_least_recently_routed_of_that_worker() {
        let t0 = Instant::now();
        let t = |s| t0 + Duration::from_secs(s);
        let mut index = ApproxIndex::new(config(60, 1000));
        let (w1, w2) = (WorkerWithDpRank::new(1u64, 0u32), WorkerWithDpRank::new(2u64, 0u32));
        index.set_capacity(w1, Some(3));
        index.record_routed(w1, &blocks(&[1, 2, 3]), t(0));
        index.record_routed(w2, &blocks(&[7, 8, 9, 10, 11]), t(1));
        // Prefix 1 used again, then a new request: the old tail (3) goes, not the prefix.
        index.record_routed(w1, &blocks(&[1]), t(2));
        index.record_routed(w1, &blocks(&[5, 6]), t(3));
        assert_eq!(index.find_matches(&blocks(&[1, 2, 3])).score(w1), 1, "1 kept, 2-3 gone");
        assert_eq!(index.find_matches(&blocks(&[5, 6])).score(w1), 2);
        assert_eq!(index.find_matches(&blocks(&[7, 8, 9, 10, 11])).score(w2), 5, "w2 untouched");
        assert_eq!(index.index().tree_size(w1), 3);
    }

    #[test]
    fn the_tracker_answers_with_events_another_index_can_apply() {
        let t0 = Instant::now();
        let mut tracker = ApproxTracker::new(config(10, 2));
        let w = WorkerWithDpRank::new(3u64, 1u32);
        let events = tracker.record_routed(w, &blocks(&[1, 2, 3]), t0);
        assert_eq!(events.len(), 2, "a Stored, then a Removed for the cap: {events:?}");
        let mut index = RadixIndex::new();
        for e in &events {
            index.apply_event(e).unwrap();
        }
        assert_eq!(index.tree_size(w), 2);
        assert_eq!(tracker.held(w), 2);
        let later = tracker.expire(t0 + Duration::from_secs(10));
        for e in &later {
            index.apply_event(e).unwrap();
        }
        assert_eq!(index.tree_size(w), 0);
        assert_eq!(tracker.forgotten(), 3);
    }
}

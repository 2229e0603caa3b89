//! Approximate mode, for engines that publish no KV events: the router records the blocks of
//! each request it routes as cached on the chosen worker for a while (a TTL), and forgets them
//! oldest first when they expire or when a size cap is reached.
//!
//! Recorded blocks are named by their [`SequenceHash`] (unique per path), so re-recording a
//! prefix finds the same blocks and only refreshes their expiry.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::{IndexConfig, OverlapScores, RadixIndex};
use crate::hash::sequence_hashes;
use crate::protocols::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, SequenceHash, WorkerId, WorkerWithDpRank,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApproxConfig {
    /// How long a routed request's blocks are assumed cached (Dynamo's default: 120 s).
    pub ttl: Duration,
    /// Most (worker, block) pairs remembered; the oldest go first past it.
    pub max_held_blocks: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self { ttl: Duration::from_secs(120), max_held_blocks: 1 << 20 }
    }
}

#[derive(Clone, Copy, Debug)]
struct Expiry {
    at: Instant,
    worker: WorkerWithDpRank,
    block: SequenceHash,
}

#[derive(Debug)]
pub struct ApproxIndex {
    index: RadixIndex,
    config: ApproxConfig,
    /// Expiries in the order recorded, which is expiry order (one TTL for all). May hold stale
    /// entries for refreshed blocks; `live` has the current expiry of each block.
    queue: VecDeque<Expiry>,
    live: FxHashMap<(WorkerWithDpRank, SequenceHash), Instant>,
    expired: u64,
}

impl ApproxIndex {
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            index: RadixIndex::with_config(IndexConfig::default()),
            config,
            queue: VecDeque::new(),
            live: FxHashMap::default(),
            expired: 0,
        }
    }

    /// Records that the request with these block hashes was routed to `worker` at `now`.
    pub fn record_routed(
        &mut self,
        worker: WorkerWithDpRank,
        local: &[LocalBlockHash],
        now: Instant,
    ) {
        self.expire(now);
        if local.is_empty() {
            return;
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
        let data = KvCacheEventData::Stored(KvCacheStoreData { parent_hash: None, blocks });
        // A Stored with no parent cannot be refused.
        let _ = self.index.apply_event(&event(worker, data));
        let at = now + self.config.ttl;
        // Deepest first, so that expiring in queue order removes leaves before their parents.
        for &block in seq.iter().rev() {
            self.live.insert((worker, block), at);
            self.queue.push_back(Expiry { at, worker, block });
        }
        while self.live.len() > self.config.max_held_blocks {
            let Some(oldest) = self.queue.pop_front() else {
                break;
            };
            self.forget_if_current(oldest);
        }
        if self.queue.len() > 4 * self.live.len().max(1024) {
            let live = &self.live;
            self.queue.retain(|e| live.get(&(e.worker, e.block)) == Some(&e.at));
        }
    }

    /// Forgets every block whose TTL ran out by `now`.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&front) = self.queue.front() {
            if front.at > now {
                break;
            }
            self.queue.pop_front();
            self.forget_if_current(front);
        }
    }

    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        self.index.find_matches(query)
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.live.retain(|(w, _), _| w.worker_id != worker);
        self.queue.retain(|e| e.worker.worker_id != worker);
    }

    /// Blocks forgotten so far, by TTL or cap.
    pub fn expired(&self) -> u64 {
        self.expired
    }

    pub fn index(&self) -> &RadixIndex {
        &self.index
    }

    fn forget_if_current(&mut self, e: Expiry) {
        if self.live.get(&(e.worker, e.block)) != Some(&e.at) {
            return; // refreshed since, or already gone
        }
        self.live.remove(&(e.worker, e.block));
        self.expired += 1;
        let data = KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalBlockHash(e.block.0)],
        });
        let _ = self.index.apply_event(&event(e.worker, data));
    }
}

fn event(worker: WorkerWithDpRank, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker.worker_id,
        event: KvCacheEvent { event_id: 0, data, dp_rank: worker.dp_rank },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(locals: &[u64]) -> Vec<LocalBlockHash> {
        locals.iter().copied().map(LocalBlockHash).collect()
    }

    #[test]
    fn routed_blocks_expire_after_ttl_and_refresh_on_reuse() {
        let t0 = Instant::now();
        let secs = |s| t0 + Duration::from_secs(s);
        let mut index =
            ApproxIndex::new(ApproxConfig { ttl: Duration::from_secs(10), max_held_blocks: 100 });
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
    fn size_cap_forgets_oldest_first() {
        let t0 = Instant::now();
        let mut index =
            ApproxIndex::new(ApproxConfig { ttl: Duration::from_secs(60), max_held_blocks: 4 });
        let (w1, w2) = (WorkerWithDpRank::new(1u64, 0u32), WorkerWithDpRank::new(2u64, 0u32));
        index.record_routed(w1, &blocks(&[1, 2, 3]), t0);
        index.record_routed(w2, &blocks(&[7, 8]), t0 + Duration::from_secs(1));
        assert!(index.index().held_blocks() <= 4);
        assert_eq!(index.find_matches(&blocks(&[1, 2, 3])).score(w1), 2, "oldest leaf went first");
        assert_eq!(index.find_matches(&blocks(&[7, 8])).score(w2), 2);
    }
}

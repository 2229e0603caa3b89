//! The service form: workers spread over shards, each its own [`RadixIndex`] behind a
//! read-write lock, so reads run in parallel and a writer blocks only its own shard.
//!
//! ```text
//!   events of worker w ──▶ shard(w) = fx(w.worker_id) % N ──write──▶ RwLock<RadixIndex>
//!   find_matches(q) ──read──▶ every shard ──▶ scores merged (shards hold disjoint workers)
//! ```
//!
//! Every dp rank of a worker lands on the same shard. Per-worker ordering is the caller's: feed
//! each worker's events from one thread, in order (the event plane has one subscriber per
//! worker). [`ShardedIndex::apply_batch`] takes each shard's lock once per batch.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use rustc_hash::FxHasher;

use super::{IndexConfig, IndexStats, OverlapScores, RadixIndex};
use crate::Error;
use crate::protocols::{LocalBlockHash, RouterEvent, WorkerId, WorkerWithDpRank};

#[derive(Debug)]
pub struct ShardedIndex {
    shards: Vec<RwLock<RadixIndex>>,
}

impl ShardedIndex {
    /// `shards` indexes (at least one), each bounded by `config` on its own.
    pub fn new(shards: usize, config: IndexConfig) -> Self {
        let shards =
            (0..shards.max(1)).map(|_| RwLock::new(RadixIndex::with_config(config))).collect();
        Self { shards }
    }

    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    pub fn apply_event(&self, event: &RouterEvent) -> Result<(), Error> {
        self.write(self.shard_of(event.worker_id)).apply_event(event)
    }

    /// Applies events in order, taking each shard's write lock once; returns the errors
    /// (events refused or partly applied), in order, with their positions in `events`.
    pub fn apply_batch(&self, events: &[RouterEvent]) -> Vec<(usize, Error)> {
        let mut errors = Vec::new();
        if self.shards.len() == 1 {
            let mut shard = self.write(0);
            for (i, e) in events.iter().enumerate() {
                if let Err(err) = shard.apply_event(e) {
                    errors.push((i, err));
                }
            }
            return errors;
        }
        for s in 0..self.shards.len() {
            let mut positions =
                events.iter().enumerate().filter(|(_, e)| self.shard_of(e.worker_id) == s);
            let Some((first, e)) = positions.next() else {
                continue;
            };
            let mut shard = self.write(s);
            for (i, e) in std::iter::once((first, e)).chain(positions) {
                if let Err(err) = shard.apply_event(e) {
                    errors.push((i, err));
                }
            }
        }
        errors.sort_unstable_by_key(|(i, _)| *i);
        errors
    }

    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        let mut shards = self.shards.iter();
        let mut out = shards.next().map(|s| read(s).find_matches(query)).unwrap_or_default();
        for shard in shards {
            let more = read(shard).find_matches(query);
            if !more.scores.is_empty() {
                out.merge(more);
            }
        }
        out
    }

    pub fn remove_worker(&self, worker: WorkerId) {
        self.write(self.shard_of(worker)).remove_worker(worker);
    }

    pub fn clear_all_blocks(&self, worker: WorkerId) {
        self.write(self.shard_of(worker)).clear_all_blocks(worker);
    }

    pub fn register_worker(&self, worker: WorkerWithDpRank) {
        self.write(self.shard_of(worker.worker_id)).register_worker(worker);
    }

    pub fn workers(&self) -> Vec<WorkerWithDpRank> {
        let mut out: Vec<_> = self.shards.iter().flat_map(|s| read(s).workers()).collect();
        out.sort_unstable();
        out
    }

    pub fn tree_size(&self, worker: WorkerWithDpRank) -> usize {
        read(&self.shards[self.shard_of(worker.worker_id)]).tree_size(worker)
    }

    pub fn stats(&self) -> IndexStats {
        self.shards.iter().map(|s| read(s).stats()).fold(IndexStats::default(), |a, b| a + b)
    }

    /// All shards' snapshots, concatenated (event ids renumbered).
    pub fn dump_as_events(&self) -> Vec<RouterEvent> {
        let mut out: Vec<RouterEvent> =
            self.shards.iter().flat_map(|s| read(s).dump_as_events()).collect();
        for (i, e) in out.iter_mut().enumerate() {
            e.event.event_id = i as u64;
        }
        out
    }

    fn shard_of(&self, worker: WorkerId) -> usize {
        let hash = BuildHasherDefault::<FxHasher>::default().hash_one(worker.0);
        (hash % self.shards.len() as u64) as usize
    }

    fn write(&self, shard: usize) -> RwLockWriteGuard<'_, RadixIndex> {
        // A panic inside the index would be a bug; its state is still the last consistent one
        // for readers, so keep serving rather than poisoning every later call.
        self.shards[shard].write().unwrap_or_else(PoisonError::into_inner)
    }
}

fn read(shard: &RwLock<RadixIndex>) -> RwLockReadGuard<'_, RadixIndex> {
    shard.read().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::{
        ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    };

    fn chain(worker: u64, dp: u32, locals: &[u64]) -> RouterEvent {
        let blocks = locals
            .iter()
            .map(|&l| KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(worker * 1000 + l),
                tokens_hash: LocalBlockHash(l),
                mm_extra_info: None,
            })
            .collect();
        let data = KvCacheEventData::Stored(KvCacheStoreData { parent_hash: None, blocks });
        RouterEvent::new(worker, KvCacheEvent { event_id: 0, data, dp_rank: dp.into() })
    }

    #[test]
    fn shards_answer_like_one_index() {
        let sharded = ShardedIndex::new(4, IndexConfig::default());
        let mut single = RadixIndex::new();
        let events: Vec<_> =
            (0..16u64).map(|k| chain(k, (k % 2) as u32, &[1, 2, 3 + k % 3, 9])).collect();
        assert!(sharded.apply_batch(&events).is_empty());
        for e in &events {
            single.apply_event(e).unwrap();
        }
        let query: Vec<_> = [1, 2, 4, 9].map(LocalBlockHash).to_vec();
        assert_eq!(sharded.find_matches(&query), single.find_matches(&query));
        assert_eq!(sharded.workers(), single.workers());
        assert_eq!(sharded.stats().held_blocks, 64);
        sharded.remove_worker(WorkerId(4));
        assert_eq!(sharded.find_matches(&query).score(WorkerWithDpRank::new(4u64, 0u32)), 0);
        let mut replayed = RadixIndex::new();
        for e in sharded.dump_as_events() {
            replayed.apply_event(&e).unwrap();
        }
        assert_eq!(replayed.find_matches(&query), sharded.find_matches(&query));
    }

    #[test]
    fn batch_errors_keep_their_positions() {
        let sharded = ShardedIndex::new(3, IndexConfig::default());
        let mut bad = chain(5, 0, &[1]);
        if let KvCacheEventData::Stored(data) = &mut bad.event.data {
            data.parent_hash = Some(ExternalBlockHash(1));
        }
        let errors = sharded.apply_batch(&[chain(1, 0, &[1]), bad, chain(2, 0, &[1])]);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].0, 1);
    }
}

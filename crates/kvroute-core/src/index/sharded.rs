//! The service form: workers spread over shards, each its own [`RadixIndex`] behind a
//! read-write lock, so reads run in parallel and a writer blocks only its own shard.
//!
//! A shard's lock ([`ShardLock`]) lets a waiting reader in before the next write, and a
//! waiter spins for a few microseconds, then sleeps: a lookup waits for at most the one piece
//! of an event being applied, and never spins out a time slice behind a writer the kernel
//! preempted on its own core. (Parking at once made the busy p99 of `find_matches` 7-9x its
//! idle p99: a sleeping reader wakes tens of microseconds after a one-microsecond hold.)
//!
//! ```text
//!   events of worker w ──▶ shard(w) = fx(w.worker_id) % N ──write──▶ ShardLock<RadixIndex>
//!   find_matches(q) ──read──▶ every shard ──▶ scores merged (shards hold disjoint workers)
//! ```
//!
//! Writers hold a shard's lock for at most [`BLOCKS_PER_LOCK`] blocks: a longer Stored or
//! Removed event is applied in pieces (a Stored piece names the previous piece's last block as
//! its parent), so a reader never waits behind a whole 64-block event. Readers may see an event
//! half applied, as they would see one event of two.
//!
//! The memory budget (`max_held_blocks`) is one for all shards together: a write that takes
//! the total over it evicts the least recently matched leaves of the fullest shard, down to
//! 90% of the budget, so however workers spread over shards the index never holds more than
//! the budget asks.
//!
//! A lookup walks every shard, and a prefix held by workers of several shards is stored, and
//! walked, once in each: the router uses one shard (the readers' lock is then all sharding
//! costs a lookup), and more only help when several threads write events at once.
//!
//! Every dp rank of a worker lands on the same shard. Per-worker ordering is the caller's: feed
//! each worker's events from one thread, in order (the event plane has one subscriber per
//! worker). [`ShardedIndex::apply_batch`] takes each shard's lock once per batch.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rustc_hash::FxHasher;

use super::shard_lock::{ReadGuard, ShardLock, WriteGuard};
use super::{HybridGroups, IndexConfig, IndexStats, LowerTiers, OverlapScores, RadixIndex};
use crate::Error;
use crate::hash::sequence_hashes;
use crate::protocols::{
    KvCacheEventData, LocalBlockHash, RouterEvent, StorageTier, WorkerId, WorkerWithDpRank,
};

/// Most blocks applied under one hold of a shard's write lock.
pub const BLOCKS_PER_LOCK: usize = 8;

#[derive(Debug)]
pub struct ShardedIndex {
    shards: Vec<ShardLock<RadixIndex>>,
    /// (worker, block) pairs each shard held after its last write.
    held: Vec<AtomicUsize>,
    /// `max_held_blocks` of all shards and tiers together.
    budget: Option<usize>,
    /// What workers keep below their devices ([`LowerTiers`]), and how many pairs (read
    /// without the lock: a lookup skips the tiers while they hold nothing).
    lower: ShardLock<LowerTiers>,
    lower_held: AtomicUsize,
    /// Hybrid models' cache groups beyond the first ([`HybridGroups`]); whether any exists.
    groups: ShardLock<HybridGroups>,
    hybrid: AtomicBool,
}

impl ShardedIndex {
    /// `shards` indexes (at least one), bounded together by `config.max_held_blocks`.
    pub fn new(shards: usize, config: IndexConfig) -> Self {
        let n = shards.max(1);
        let unbounded = IndexConfig { max_held_blocks: None };
        Self {
            shards: (0..n).map(|_| ShardLock::new(RadixIndex::with_config(unbounded))).collect(),
            held: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            budget: config.max_held_blocks,
            lower: ShardLock::new(LowerTiers::new()),
            lower_held: AtomicUsize::new(0),
            groups: ShardLock::new(HybridGroups::new()),
            hybrid: AtomicBool::new(false),
        }
    }

    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    pub fn apply_event(&self, event: &RouterEvent) -> Result<(), Error> {
        if event.event.group != 0 {
            return self.apply_group(event);
        }
        if !event.event.storage_tier.is_device() {
            return self.apply_lower(event);
        }
        if matches!(event.event.data, KvCacheEventData::Cleared) && self.is_hybrid() {
            self.groups.write().clear_rank(event.worker());
        }
        let s = self.shard_of(event.worker_id);
        let result = self.apply_to(s, event);
        self.after_write(s);
        result
    }

    fn apply_to(&self, s: usize, event: &RouterEvent) -> Result<(), Error> {
        let shard = &self.shards[s];
        let worker = event.worker();
        // Pieces are slices of the event: a long event costs no copy.
        let result = match &event.event.data {
            KvCacheEventData::Stored(data) if data.blocks.len() > BLOCKS_PER_LOCK => {
                let mut parent_hash = data.parent_hash;
                for blocks in data.blocks.chunks(BLOCKS_PER_LOCK) {
                    shard.write().apply_stored_part(worker, parent_hash, blocks)?;
                    parent_hash = blocks.last().map(|b| b.block_hash);
                }
                Ok(())
            }
            KvCacheEventData::Removed(data) if data.block_hashes.len() > BLOCKS_PER_LOCK => {
                let mut unknown = 0;
                for hashes in data.block_hashes.chunks(BLOCKS_PER_LOCK) {
                    match shard.write().apply_removed_part(worker, hashes) {
                        Err(Error::UnknownBlocks { count, .. }) => unknown += count,
                        other => other?,
                    }
                }
                match unknown {
                    0 => Ok(()),
                    count => Err(Error::UnknownBlocks { worker, count }),
                }
            }
            _ => return shard.write().apply_event(event),
        };
        if result.is_ok() {
            shard.write().count_applied();
        }
        result
    }

    /// Applies events in order; returns the errors (events refused or partly applied), in
    /// order, with their positions in `events`. Each shard's lock is taken once for a run of
    /// small events of up to [`BLOCKS_PER_LOCK`] blocks in all; a longer event, and one that
    /// touches more than the device tree (a clear, a lower tier, a hybrid group), is applied
    /// on its own as [`Self::apply_event`] applies it.
    pub fn apply_batch(&self, events: &[RouterEvent]) -> Vec<(usize, Error)> {
        let mut errors = Vec::new();
        let Some(first) = events.first() else { return errors };
        let one_worker = events.iter().all(|e| e.worker_id == first.worker_id);
        let shards = match one_worker {
            true => self.shard_of(first.worker_id)..self.shard_of(first.worker_id) + 1,
            false => 0..self.shards.len(),
        };
        for s in shards {
            let mut positions = events
                .iter()
                .enumerate()
                .filter(|(_, e)| one_worker || self.shard_of(e.worker_id) == s)
                .peekable();
            if positions.peek().is_none() {
                continue;
            }
            let mut shard: Option<WriteGuard<'_, RadixIndex>> = None;
            let mut held = 0;
            for (i, e) in positions {
                let blocks = e.event.data.blocks();
                let plain = e.event.storage_tier.is_device()
                    && e.event.group == 0
                    && !matches!(e.event.data, KvCacheEventData::Cleared)
                    && blocks <= BLOCKS_PER_LOCK;
                if !plain || held + blocks > BLOCKS_PER_LOCK {
                    shard = None;
                    held = 0;
                }
                let result = match plain {
                    true => {
                        held += blocks;
                        shard.get_or_insert_with(|| self.write(s)).apply_event(e)
                    }
                    false => self.apply_event(e),
                };
                if let Err(err) = result {
                    errors.push((i, err));
                }
            }
            drop(shard);
            self.after_write(s);
        }
        errors.sort_unstable_by_key(|(i, _)| *i);
        errors
    }

    /// Every cache's device prefix of `query`, and, when any worker keeps blocks below its
    /// device, their runs there ([`OverlapScores::tiers`]).
    ///
    /// A hybrid model's workers score their first group's prefix here (what the parity probe
    /// checks); [`Self::find_matches_within`] scores what all their groups can serve.
    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        self.matches(query, None)
    }

    /// [`Self::find_matches`] for a prompt of which at most `max_blocks` blocks of
    /// `block_size` tokens can be served (its last token is always computed): a hybrid
    /// model's workers score what all their cache groups can serve ([`HybridGroups`]).
    pub fn find_matches_within(
        &self,
        query: &[LocalBlockHash],
        max_blocks: usize,
        block_size: usize,
    ) -> OverlapScores {
        self.matches(query, Some((max_blocks, block_size)))
    }

    fn matches(&self, query: &[LocalBlockHash], within: Option<(usize, usize)>) -> OverlapScores {
        let mut shards = self.shards.iter();
        let mut out = shards.next().map(|s| read(s).find_matches(query)).unwrap_or_default();
        for shard in shards {
            let more = read(shard).find_matches(query);
            if !more.scores.is_empty() {
                out.merge(more);
            }
        }
        let lower = self.lower_held.load(Ordering::Relaxed) > 0;
        let hybrid = within.filter(|_| self.is_hybrid());
        if !lower && hybrid.is_none() {
            return out;
        }
        let seqs = sequence_hashes(query);
        if let Some((max_blocks, block_size)) = hybrid {
            let groups = self.groups.read();
            for (w, score) in &mut out.scores {
                if groups.is_hybrid(*w) {
                    *score = groups.hit(*w, *score, (query, &seqs), max_blocks, block_size);
                }
            }
            out.scores.retain(|&(_, s)| s > 0);
            let scored = &out.scores;
            out.tree_sizes.retain(|(w, _)| scored.binary_search_by_key(w, |&(k, _)| k).is_ok());
        }
        if lower {
            let tiers = self.lower.read().find(&seqs, |w| out.score(w));
            if !tiers.runs.is_empty() || !tiers.external.is_empty() {
                out.tiers = Some(Box::new(tiers));
            }
        }
        out
    }

    fn is_hybrid(&self) -> bool {
        self.hybrid.load(Ordering::Relaxed)
    }

    /// An event of a hybrid model's other cache group; its blocks are placed by the worker's
    /// first group where it can.
    fn apply_group(&self, event: &RouterEvent) -> Result<(), Error> {
        let worker = event.worker();
        let shard = &self.shards[self.shard_of(event.worker_id)];
        let device_seq = |h| read(shard).sequence_hash(worker, h);
        let e = &event.event;
        let mut groups = self.groups.write();
        if let (Some(budget), KvCacheEventData::Stored(s)) = (self.budget, &e.data) {
            // No eviction order here: past the bound, new blocks are refused.
            let device: usize = self.held.iter().map(|h| h.load(Ordering::Relaxed)).sum();
            let lower = self.lower_held.load(Ordering::Relaxed);
            if device + lower + groups.held_blocks() + s.blocks.len() > budget {
                groups.refused += 1;
                return Ok(());
            }
        }
        let result = groups.apply(worker, e.group, e.group_kind, &e.data, device_seq);
        self.hybrid.store(!groups.is_empty(), Ordering::Relaxed);
        result
    }

    /// A lower-tier event: its parent is looked up in the tiers, then on the worker's device.
    fn apply_lower(&self, event: &RouterEvent) -> Result<(), Error> {
        let worker = event.worker();
        let shard = &self.shards[self.shard_of(event.worker_id)];
        let device_seq = |h| read(shard).sequence_hash(worker, h);
        let mut lower = self.lower.write();
        let result = lower.apply(worker, event.event.storage_tier, &event.event.data, device_seq);
        self.lower_held.store(lower.held_blocks(), Ordering::Relaxed);
        drop(lower);
        self.after_write(self.shard_of(event.worker_id));
        result
    }

    /// Blocks each cache keeps per lower tier (host, disk, external), sorted by worker.
    pub fn lower_tier_sizes(&self) -> Vec<(WorkerWithDpRank, [usize; 3])> {
        self.lower.read().sizes()
    }

    pub fn remove_worker(&self, worker: WorkerId) {
        let s = self.shard_of(worker);
        self.write(s).remove_worker(worker);
        self.forget_lower(|l| l.remove_worker(worker));
        if self.is_hybrid() {
            let mut groups = self.groups.write();
            groups.remove_worker(worker);
            self.hybrid.store(!groups.is_empty(), Ordering::Relaxed);
        }
        self.after_write(s);
    }

    /// Forgets what `worker` holds on its device and in its host memory (an engine restart
    /// loses both); its disk and the shared store keep theirs.
    pub fn clear_all_blocks(&self, worker: WorkerId) {
        let s = self.shard_of(worker);
        self.write(s).clear_all_blocks(worker);
        self.forget_lower(|l| l.clear_worker(worker, &[StorageTier::HostPinned]));
        self.after_write(s);
    }

    fn forget_lower(&self, f: impl FnOnce(&mut LowerTiers)) {
        if self.lower_held.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut lower = self.lower.write();
        f(&mut lower);
        self.lower_held.store(lower.held_blocks(), Ordering::Relaxed);
    }

    /// Records shard `s`'s size after a write and, past the budget, evicts from the fullest
    /// shard down to 90% of the budget.
    fn after_write(&self, s: usize) {
        self.held[s].store(read(&self.shards[s]).held_blocks(), Ordering::Relaxed);
        let Some(budget) = self.budget else { return };
        let device: usize = self.held.iter().map(|h| h.load(Ordering::Relaxed)).sum();
        let lower = self.lower_held.load(Ordering::Relaxed);
        if device + lower <= budget {
            return;
        }
        let mut excess = device + lower - (budget - budget / 10);
        if lower > 0 {
            // Lower tiers give way first: the device is what serves without a load.
            let mut tiers = self.lower.write();
            let before = tiers.held_blocks();
            tiers.evict_oldest(before.saturating_sub(excess));
            excess -= before - tiers.held_blocks();
            self.lower_held.store(tiers.held_blocks(), Ordering::Relaxed);
            if excess == 0 {
                return;
            }
        }
        let fullest =
            (0..self.held.len()).max_by_key(|&i| self.held[i].load(Ordering::Relaxed)).unwrap_or(s);
        let mut shard = self.write(fullest);
        let target = shard.held_blocks().saturating_sub(excess);
        shard.evict_to(target);
        self.held[fullest].store(shard.held_blocks(), Ordering::Relaxed);
    }

    /// The memory budget of all shards together.
    pub fn budget(&self) -> Option<usize> {
        self.budget
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

    /// Every known cache with the distinct blocks it holds, sorted by worker.
    pub fn tree_sizes(&self) -> Vec<(WorkerWithDpRank, usize)> {
        let mut shards = self.shards.iter();
        let mut out = shards.next().map(|s| read(s).tree_sizes()).unwrap_or_default();
        for shard in shards {
            out.extend(read(shard).tree_sizes());
            out.sort_unstable_by_key(|&(w, _)| w);
        }
        out
    }

    pub fn stats(&self) -> IndexStats {
        let device =
            self.shards.iter().map(|s| read(s).stats()).fold(IndexStats::default(), |a, b| a + b);
        let lower = self.lower.read();
        IndexStats {
            lower_tier_blocks: lower.held_blocks(),
            hybrid_group_blocks: self.groups.read().held_blocks(),
            heap_bytes: device.heap_bytes + lower.heap_bytes(),
            rejected_unknown_parent: device.rejected_unknown_parent + lower.rejected_unknown_parent,
            evicted_blocks: device.evicted_blocks + lower.evicted_blocks,
            ..device
        }
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

    fn write(&self, shard: usize) -> WriteGuard<'_, RadixIndex> {
        self.shards[shard].write()
    }
}

fn read(shard: &ShardLock<RadixIndex>) -> ReadGuard<'_, RadixIndex> {
    shard.read()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::{
        ExternalBlockHash, KvCacheEvent, KvCacheRemoveData, KvCacheStoreData,
        KvCacheStoredBlockData, StorageTier,
    };
    use proptest::prelude::*;

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
        RouterEvent::new(worker, KvCacheEvent::new(0, data, dp))
    }

    #[test]
    fn shards_answer_like_one_index() {
        let sharded = ShardedIndex::new(4, IndexConfig::default());
        let mut single = RadixIndex::new();
        let long: Vec<u64> = (100..140).collect(); // pieces of BLOCKS_PER_LOCK blocks
        let mut events: Vec<_> =
            (0..16u64).map(|k| chain(k, (k % 2) as u32, &[1, 2, 3 + k % 3, 9])).collect();
        events.push(chain(3, 0, &long));
        assert!(sharded.apply_batch(&events).is_empty());
        for e in &events {
            single.apply_event(e).unwrap();
        }
        let query: Vec<_> = [1, 2, 4, 9].map(LocalBlockHash).to_vec();
        assert_eq!(sharded.find_matches(&query), single.find_matches(&query));
        assert_eq!(sharded.workers(), single.workers());
        assert_eq!(sharded.stats().held_blocks, 64 + 40);
        assert_eq!(sharded.stats().events_applied, 17, "pieces count as one event");
        let long_query: Vec<_> = long.iter().copied().map(LocalBlockHash).collect();
        assert_eq!(sharded.find_matches(&long_query), single.find_matches(&long_query));
        sharded.remove_worker(WorkerId(4));
        assert_eq!(sharded.find_matches(&query).score(WorkerWithDpRank::new(4u64, 0u32)), 0);
        let mut replayed = RadixIndex::new();
        for e in sharded.dump_as_events() {
            replayed.apply_event(&e).unwrap();
        }
        assert_eq!(replayed.find_matches(&query), sharded.find_matches(&query));
    }

    #[test]
    fn the_budget_bounds_all_shards_together() {
        let budget = 100;
        let sharded = ShardedIndex::new(4, IndexConfig { max_held_blocks: Some(budget) });
        // 16 workers spread over the 4 shards, 30 blocks each: 480 pairs offered.
        for k in 0..16u64 {
            let locals: Vec<u64> = (0..30).map(|b| k * 100 + b).collect();
            sharded.apply_event(&chain(k, 0, &locals)).unwrap();
            assert!(
                sharded.stats().held_blocks <= budget,
                "after worker {k}: {:?}",
                sharded.stats()
            );
        }
        let stats = sharded.stats();
        assert!(stats.held_blocks >= budget / 2, "evicts down to 90%, not to nothing: {stats:?}");
        assert_eq!(stats.evicted_blocks as usize + stats.held_blocks, 16 * 30);
        // The newest worker's blocks survived: eviction takes the least recently used.
        let last: Vec<_> = (0..30).map(|b| LocalBlockHash(1500 + b)).collect();
        assert_eq!(sharded.find_matches(&last).score(WorkerWithDpRank::new(15u64, 0u32)), 30);
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

    /// One random event: a store of a chain (short, or longer than a lock's piece), a removal
    /// of some of a worker's blocks, a clear; on the device or the host tier.
    fn any_event() -> impl Strategy<Value = RouterEvent> {
        let locals = proptest::collection::vec(0u64..24, 1..20);
        (0u64..5, 0u32..2, 0u8..10, locals, any::<bool>()).prop_map(
            |(worker, dp, kind, locals, host)| {
                let mut e = match kind {
                    0..=5 => chain(worker, dp, &locals),
                    6..=8 => {
                        let block_hashes =
                            locals.iter().map(|&l| ExternalBlockHash(worker * 1000 + l)).collect();
                        let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes });
                        RouterEvent::new(worker, KvCacheEvent::new(0, data, dp))
                    }
                    _ => RouterEvent::new(
                        worker,
                        KvCacheEvent::new(0, KvCacheEventData::Cleared, dp),
                    ),
                };
                if host && kind != 9 {
                    e.event.storage_tier = StorageTier::HostPinned;
                }
                e
            },
        )
    }

    proptest! {
        /// A batch applied at once leaves the index as the same events applied one by one,
        /// and names the same events as not applied cleanly.
        #[test]
        fn a_batch_is_its_events_in_order(
            batches in proptest::collection::vec(proptest::collection::vec(any_event(), 0..12), 1..6),
            shards in 1usize..4,
        ) {
            let batched = ShardedIndex::new(shards, IndexConfig::default());
            let single = ShardedIndex::new(shards, IndexConfig::default());
            for batch in &batches {
                let errors: Vec<usize> = batched.apply_batch(batch).into_iter().map(|(i, _)| i).collect();
                let expected: Vec<usize> = batch
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| single.apply_event(e).is_err())
                    .map(|(i, _)| i)
                    .collect();
                prop_assert_eq!(errors, expected);
            }
            prop_assert_eq!(batched.stats(), single.stats());
            prop_assert_eq!(batched.workers(), single.workers());
            prop_assert_eq!(batched.lower_tier_sizes(), single.lower_tier_sizes());
            for start in 0..24u64 {
                let query: Vec<_> = (start..24).map(LocalBlockHash).collect();
                prop_assert_eq!(batched.find_matches(&query), single.find_matches(&query));
            }
        }
    }
}

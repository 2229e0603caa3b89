//! A paged KV cache with prefix caching, as vLLM keeps it.
//!
//! Full computed blocks (prompt or generated) are named by their sequence hash and shared: a
//! request that starts with the same blocks references them instead of computing them again.
//! A block nobody references stays cached until space is needed, then the least recently
//! released goes first (a request's blocks are released tail first, so a prefix outlives its
//! tails). Blocks a request holds privately (not yet full or computed, or a duplicate of a
//! block another request cached first) count against the capacity too.
//!
//! A hybrid model's cache groups share the one pool, each block cached per group (vLLM's
//! `BlockHashWithGroupId`): the same sequence hash in two groups is two blocks, evicted on
//! their own. Group 0 is full attention; the methods without a group name it.

use std::collections::BTreeSet;

use kvroute_core::SequenceHash;
use rustc_hash::FxHashMap;

#[derive(Clone, Copy, Debug)]
struct Cached {
    refs: u32,
    /// When it was last released (eviction order among unreferenced blocks).
    stamp: u64,
}

/// A cached block: its sequence hash in one cache group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Slot {
    pub(crate) group: u32,
    pub(crate) hash: SequenceHash,
}

#[derive(Debug)]
pub(crate) struct KvCache {
    capacity: usize,
    cached: FxHashMap<Slot, Cached>,
    /// Unreferenced cached blocks, oldest release first.
    evictable: BTreeSet<(u64, Slot)>,
    private: usize,
    stamp: u64,
}

/// What became of a block filled by a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    New,
    Duplicate,
}

/// Not enough blocks, even after evicting every unreferenced one.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct NoSpace;

impl KvCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            cached: FxHashMap::default(),
            evictable: BTreeSet::new(),
            private: 0,
            stamp: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held by running requests (referenced cached ones and private ones).
    pub(crate) fn in_use(&self) -> usize {
        self.cached.len() - self.evictable.len() + self.private
    }

    /// Leading blocks of `seq` the cache holds (in group 0).
    pub(crate) fn cached_prefix(&self, seq: &[SequenceHash]) -> usize {
        seq.iter().take_while(|&&s| self.holds(0, s)).count()
    }

    /// Whether the cache holds block `hash` in `group`.
    pub(crate) fn holds(&self, group: u32, hash: SequenceHash) -> bool {
        self.cached.contains_key(&Slot { group, hash })
    }

    fn free(&self) -> usize {
        self.capacity.saturating_sub(self.cached.len() + self.private)
    }

    /// Evicts until `needed` blocks are free; the evicted go to `removed`.
    fn make_room(&mut self, needed: usize, removed: &mut Vec<Slot>) -> Result<(), NoSpace> {
        if needed > self.free() + self.evictable.len() {
            return Err(NoSpace);
        }
        while self.free() < needed {
            let Some((_, victim)) = self.evictable.pop_first() else { return Err(NoSpace) };
            self.cached.remove(&victim);
            removed.push(victim);
        }
        Ok(())
    }

    /// References these cached blocks of `group` (a request's cache hits).
    pub(crate) fn reference(&mut self, group: u32, blocks: &[SequenceHash]) {
        for &hash in blocks {
            let s = Slot { group, hash };
            if let Some(block) = self.cached.get_mut(&s) {
                if block.refs == 0 {
                    self.evictable.remove(&(block.stamp, s));
                }
                block.refs += 1;
            }
        }
    }

    /// How many of these cached blocks of `group` running requests hold.
    pub(crate) fn referenced(&self, group: u32, blocks: &[SequenceHash]) -> usize {
        let held = |&hash| self.cached.get(&Slot { group, hash }).is_some_and(|b| b.refs > 0);
        blocks.iter().filter(|h| held(h)).count()
    }

    /// More private blocks for a running request (the tokens scheduled for it).
    pub(crate) fn grow(&mut self, n: usize, removed: &mut Vec<Slot>) -> Result<(), NoSpace> {
        self.make_room(n, removed)?;
        self.private += n;
        Ok(())
    }

    /// A private block is now full and computed: it becomes the cached block `s`, referenced
    /// by its request, unless another request cached the same block first; then it stays
    /// private (vLLM keeps both copies until they are freed).
    pub(crate) fn fill(&mut self, group: u32, hash: SequenceHash) -> Stored {
        let s = Slot { group, hash };
        if self.cached.contains_key(&s) {
            return Stored::Duplicate;
        }
        self.private -= 1;
        self.cached.insert(s, Cached { refs: 1, stamp: 0 });
        Stored::New
    }

    /// A request lets go of its cached blocks of `group` (in request order) and `private`
    /// blocks.
    pub(crate) fn release(&mut self, group: u32, seq: &[SequenceHash], private: usize) {
        self.private -= private;
        // Tail first: the tail gets the oldest stamp and is evicted before its prefix.
        for &hash in seq.iter().rev() {
            let s = Slot { group, hash };
            if let Some(block) = self.cached.get_mut(&s) {
                block.refs -= 1;
                if block.refs == 0 {
                    self.stamp += 1;
                    block.stamp = self.stamp;
                    self.evictable.insert((self.stamp, s));
                }
            }
        }
    }

    /// Drops every unreferenced cached block (a reset); returns them.
    pub(crate) fn clear_unreferenced(&mut self) -> Vec<Slot> {
        let gone: Vec<Slot> =
            std::mem::take(&mut self.evictable).into_iter().map(|(_, s)| s).collect();
        for s in &gone {
            self.cached.remove(s);
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(xs: &[u64]) -> Vec<SequenceHash> {
        xs.iter().copied().map(SequenceHash).collect()
    }

    fn slots(group: u32, xs: &[u64]) -> Vec<Slot> {
        xs.iter().map(|&x| Slot { group, hash: SequenceHash(x) }).collect()
    }

    #[test]
    fn lru_evicts_released_tails_first() {
        let mut kv = KvCache::new(4);
        let mut removed = Vec::new();
        let a = seq(&[1, 2, 3]);
        kv.grow(3, &mut removed).unwrap();
        assert!(a.iter().all(|&s| kv.fill(0, s) == Stored::New));
        kv.release(0, &a, 0);
        assert_eq!(kv.in_use(), 0);
        assert_eq!(kv.cached_prefix(&a), 3);
        // Two new blocks: one free, one evicted, the tail (3).
        kv.grow(2, &mut removed).unwrap();
        assert_eq!(removed, slots(0, &[3]));
        assert_eq!(kv.cached_prefix(&a), 2);
        // Referenced blocks are never evicted.
        kv.reference(0, &a[..2]);
        assert_eq!(kv.referenced(0, &a), 2);
        assert_eq!(kv.grow(1, &mut removed), Err(NoSpace));
        assert_eq!(kv.in_use(), 4);
    }

    #[test]
    fn a_block_computed_twice_is_kept_twice() {
        let mut kv = KvCache::new(4);
        let mut removed = Vec::new();
        kv.grow(2, &mut removed).unwrap();
        assert_eq!(kv.fill(0, SequenceHash(1)), Stored::New);
        assert_eq!(kv.fill(0, SequenceHash(1)), Stored::Duplicate, "cached by the first request");
        assert_eq!(kv.in_use(), 2, "both copies use memory");
        kv.release(0, &seq(&[1]), 0);
        kv.release(0, &[], 1);
        assert_eq!(kv.in_use(), 0);
        assert_eq!(kv.clear_unreferenced(), slots(0, &[1]));
    }

    #[test]
    fn groups_cache_the_same_hash_apart() {
        let mut kv = KvCache::new(4);
        let mut removed = Vec::new();
        kv.grow(2, &mut removed).unwrap();
        assert_eq!(kv.fill(0, SequenceHash(1)), Stored::New);
        assert_eq!(kv.fill(1, SequenceHash(1)), Stored::New, "another group's block");
        kv.release(1, &seq(&[1]), 0);
        assert!(kv.holds(0, SequenceHash(1)) && kv.holds(1, SequenceHash(1)));
        // Only the released group's copy can be evicted.
        kv.grow(3, &mut removed).unwrap();
        assert_eq!(removed, slots(1, &[1]));
        assert!(kv.holds(0, SequenceHash(1)) && !kv.holds(1, SequenceHash(1)));
    }
}

//! A paged KV cache with prefix caching, as vLLM keeps it.
//!
//! Full computed blocks (prompt or generated) are named by their sequence hash and shared: a
//! request that starts with the same blocks references them instead of computing them again.
//! A block nobody references stays cached until space is needed, then the least recently
//! released goes first (a request's blocks are released tail first, so a prefix outlives its
//! tails). Blocks a request holds privately (not yet full or computed, or a duplicate of a
//! block another request cached first) count against the capacity too.

use std::collections::BTreeSet;

use kvroute_core::SequenceHash;
use rustc_hash::FxHashMap;

#[derive(Clone, Copy, Debug)]
struct Cached {
    refs: u32,
    /// When it was last released (eviction order among unreferenced blocks).
    stamp: u64,
}

#[derive(Debug)]
pub(crate) struct KvCache {
    capacity: usize,
    cached: FxHashMap<SequenceHash, Cached>,
    /// Unreferenced cached blocks, oldest release first.
    evictable: BTreeSet<(u64, SequenceHash)>,
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

    /// Leading blocks of `seq` the cache holds.
    pub(crate) fn cached_prefix(&self, seq: &[SequenceHash]) -> usize {
        seq.iter().take_while(|s| self.cached.contains_key(s)).count()
    }

    fn free(&self) -> usize {
        self.capacity.saturating_sub(self.cached.len() + self.private)
    }

    /// Evicts until `needed` blocks are free; the evicted go to `removed`.
    fn make_room(&mut self, needed: usize, removed: &mut Vec<SequenceHash>) -> Result<(), NoSpace> {
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

    /// References these cached blocks (a request's cache hits).
    pub(crate) fn reference(&mut self, blocks: &[SequenceHash]) {
        for &s in blocks {
            if let Some(block) = self.cached.get_mut(&s) {
                if block.refs == 0 {
                    self.evictable.remove(&(block.stamp, s));
                }
                block.refs += 1;
            }
        }
    }

    /// How many of these cached blocks running requests hold.
    pub(crate) fn referenced(&self, blocks: &[SequenceHash]) -> usize {
        blocks.iter().filter(|s| self.cached.get(s).is_some_and(|b| b.refs > 0)).count()
    }

    /// More private blocks for a running request (the tokens scheduled for it).
    pub(crate) fn grow(
        &mut self,
        n: usize,
        removed: &mut Vec<SequenceHash>,
    ) -> Result<(), NoSpace> {
        self.make_room(n, removed)?;
        self.private += n;
        Ok(())
    }

    /// A private block is now full and computed: it becomes the cached block `s`, referenced
    /// by its request, unless another request cached the same block first; then it stays
    /// private (vLLM keeps both copies until they are freed).
    pub(crate) fn fill(&mut self, s: SequenceHash) -> Stored {
        if self.cached.contains_key(&s) {
            return Stored::Duplicate;
        }
        self.private -= 1;
        self.cached.insert(s, Cached { refs: 1, stamp: 0 });
        Stored::New
    }

    /// A request lets go of its cached blocks (in request order) and `private` blocks.
    pub(crate) fn release(&mut self, seq: &[SequenceHash], private: usize) {
        self.private -= private;
        // Tail first: the tail gets the oldest stamp and is evicted before its prefix.
        for s in seq.iter().rev() {
            if let Some(block) = self.cached.get_mut(s) {
                block.refs -= 1;
                if block.refs == 0 {
                    self.stamp += 1;
                    block.stamp = self.stamp;
                    self.evictable.insert((self.stamp, *s));
                }
            }
        }
    }

    /// Drops every unreferenced cached block (a reset); returns them.
    pub(crate) fn clear_unreferenced(&mut self) -> Vec<SequenceHash> {
        let gone: Vec<SequenceHash> =
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

    #[test]
    fn lru_evicts_released_tails_first() {
        let mut kv = KvCache::new(4);
        let mut removed = Vec::new();
        let a = seq(&[1, 2, 3]);
        kv.grow(3, &mut removed).unwrap();
        assert!(a.iter().all(|&s| kv.fill(s) == Stored::New));
        kv.release(&a, 0);
        assert_eq!(kv.in_use(), 0);
        assert_eq!(kv.cached_prefix(&a), 3);
        // Two new blocks: one free, one evicted, the tail (3).
        kv.grow(2, &mut removed).unwrap();
        assert_eq!(removed, seq(&[3]));
        assert_eq!(kv.cached_prefix(&a), 2);
        // Referenced blocks are never evicted.
        kv.reference(&a[..2]);
        assert_eq!(kv.referenced(&a), 2);
        assert_eq!(kv.grow(1, &mut removed), Err(NoSpace));
        assert_eq!(kv.in_use(), 4);
    }

    #[test]
    fn a_block_computed_twice_is_kept_twice() {
        let mut kv = KvCache::new(4);
        let mut removed = Vec::new();
        kv.grow(2, &mut removed).unwrap();
        assert_eq!(kv.fill(SequenceHash(1)), Stored::New);
        assert_eq!(kv.fill(SequenceHash(1)), Stored::Duplicate, "cached by the first request");
        assert_eq!(kv.in_use(), 2, "both copies use memory");
        kv.release(&seq(&[1]), 0);
        kv.release(&[], 1);
        assert_eq!(kv.in_use(), 0);
        assert_eq!(kv.clear_unreferenced(), seq(&[1]));
    }
}

//! A worker's map from engine block hash to block id: the one structure that grows with every
//! (worker, block) pair.
//!
//! A hashbrown table whose key is the engine hash split into two `u32`s, so an entry packs into
//! 12 bytes (13 with its control byte) instead of 16 for `(u64, u32)`. A custom open-addressing
//! table with 1.5x growth used ~20% less memory but inserted 2.5x slower (its misses and
//! resizes walked long probe runs), so this one stays; see the index issue note for figures.

use std::hash::{Hash, Hasher};

use rustc_hash::FxHashMap;

use crate::protocols::ExternalBlockHash;

/// Highest block id the index hands out.
pub(crate) const MAX_BLOCK_ID: u32 = u32::MAX - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key([u32; 2]);

impl From<ExternalBlockHash> for Key {
    fn from(h: ExternalBlockHash) -> Self {
        Self([(h.0 >> 32) as u32, h.0 as u32])
    }
}

impl From<Key> for ExternalBlockHash {
    fn from(k: Key) -> Self {
        Self((u64::from(k.0[0]) << 32) | u64::from(k.0[1]))
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(ExternalBlockHash::from(*self).0);
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct ExtMap(FxHashMap<Key, u32>);

impl ExtMap {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        table_bytes::<(Key, u32)>(self.0.capacity())
    }

    pub(crate) fn get(&self, hash: ExternalBlockHash) -> Option<u32> {
        self.0.get(&Key::from(hash)).copied()
    }

    pub(crate) fn contains(&self, hash: ExternalBlockHash) -> bool {
        self.0.contains_key(&Key::from(hash))
    }

    /// Maps `hash` to `id`, replacing any previous id.
    pub(crate) fn insert(&mut self, hash: ExternalBlockHash, id: u32) {
        self.0.insert(Key::from(hash), id);
    }

    pub(crate) fn remove(&mut self, hash: ExternalBlockHash) -> Option<u32> {
        let id = self.0.remove(&Key::from(hash));
        // Give memory back after mass removals (eviction storms, a worker draining).
        if self.0.capacity() > 1024 && self.0.len() * 8 < self.0.capacity() {
            self.0.shrink_to(self.0.len() * 2);
        }
        id
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (ExternalBlockHash, u32)> + '_ {
        self.0.iter().map(|(&k, &id)| (k.into(), id))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.values().copied()
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        self.0.retain(|_, id| keep(*id));
    }
}

/// Heap bytes of a std/hashbrown table of entries `T` that can hold `capacity` items: a
/// power-of-two number of buckets, at most 7/8 full, each an entry and a control byte.
pub(crate) fn table_bytes<T>(capacity: usize) -> usize {
    let buckets = match capacity {
        0 => 0,
        1..8 => (capacity + 1).next_power_of_two(),
        _ => (capacity * 8 / 7).next_power_of_two(),
    };
    buckets * (size_of::<T>() + 1)
}

//! Hybrid models: the KV cache groups beside the first (full attention), and how far each
//! lets a prefix hit, following vLLM's hybrid coordinator (`v1/core/kv_cache_coordinator.py`,
//! `HybridKVCacheCoordinator.find_longest_cache_hit`, and the managers of
//! `single_type_kv_cache_manager.py`):
//!
//! - the full-attention group (the device tree) gives the longest candidate `L`, at most
//!   `(isl - 1) / block_size` blocks (the last token is always computed);
//! - a **sliding-window** group of `w` tokens needs `ceil((w - 1) / bs)` consecutive blocks
//!   ending where the hit ends: scanning from block `L - 1` down, the first run that long
//!   ends the hit there; with none, the run from block 0 is the hit;
//! - a **Mamba** (or linear-attention) group keeps state at checkpoints: the hit ends after
//!   the last block before `L` whose state it holds;
//! - each group can only shorten the candidate, so the hit is the fixed point of applying
//!   them in turn.
//!
//! Groups are kept apart: a group's blocks live in their own maps, so an engine hash that names
//! a block in two groups (vLLM hashes a block once for all groups) cannot collide. A group's
//! block is placed in the sequence by the device tree when the worker holds the same engine
//! hash there (vLLM's shared hashes), else through its parent; a block with neither (a window
//! block announced without its parent) is matched by its content at the query's positions.

use rustc_hash::FxHashMap;

use crate::Error;
use crate::hash::chain;
use crate::protocols::{
    ExternalBlockHash, GroupKind, KvCacheEventData, LocalBlockHash, SequenceHash, WorkerId,
    WorkerWithDpRank,
};

/// Where a group's block sits: in the sequence, or only by its content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Seq(SequenceHash),
    Content(LocalBlockHash),
}

#[derive(Debug, Default)]
struct Group {
    kind: Option<GroupKind>,
    blocks: FxHashMap<ExternalBlockHash, Key>,
    held: FxHashMap<Key, u32>,
}

impl Group {
    fn holds(&self, seq: SequenceHash, local: LocalBlockHash) -> bool {
        self.held.contains_key(&Key::Seq(seq)) || self.held.contains_key(&Key::Content(local))
    }

    fn unhold(&mut self, key: Key) {
        if let Some(n) = self.held.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&key);
            }
        }
    }
}

/// The cache groups beyond the first of every worker rank of a hybrid model.
#[derive(Debug, Default)]
pub struct HybridGroups {
    workers: FxHashMap<WorkerWithDpRank, FxHashMap<u32, Group>>,
    held: usize,
    /// Events refused: a group past [`MAX_GROUPS`], or blocks past the memory bound.
    pub refused: u64,
}

/// Cache groups a worker rank may have beyond the first (hybrid models have a handful).
pub const MAX_GROUPS: usize = 16;

impl HybridGroups {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether any worker has announced a group beyond the first.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// (worker, block) pairs held in all groups beyond the first.
    pub fn held_blocks(&self) -> usize {
        self.held
    }

    /// Applies an event of `worker`'s group `group` (> 0). `device_seq` gives the sequence
    /// hash of a block the worker holds in its first group.
    pub fn apply(
        &mut self,
        worker: WorkerWithDpRank,
        group: u32,
        kind: Option<GroupKind>,
        data: &KvCacheEventData,
        device_seq: impl Fn(ExternalBlockHash) -> Option<SequenceHash>,
    ) -> Result<(), Error> {
        let stored = matches!(data, KvCacheEventData::Stored(_));
        if !stored && !self.workers.get(&worker).is_some_and(|g| g.contains_key(&group)) {
            return Ok(()); // nothing of that group to remove
        }
        let groups = self.workers.entry(worker).or_default();
        if !groups.contains_key(&group) && groups.len() >= MAX_GROUPS {
            self.refused += 1;
            return Ok(());
        }
        let g = groups.entry(group).or_default();
        if kind.is_some() {
            g.kind = kind;
        }
        match data {
            KvCacheEventData::Stored(s) => {
                let mut parent = match s.parent_hash {
                    None => None,
                    Some(p) => match seq_of(g, p).or_else(|| device_seq(p)) {
                        Some(seq) => Some(seq),
                        None => return Err(Error::UnknownParent { worker, parent: p }),
                    },
                };
                for b in &s.blocks {
                    let key = match (device_seq(b.block_hash), parent) {
                        (Some(seq), _) => Key::Seq(seq),
                        (None, Some(p)) => Key::Seq(chain(p, b.tokens_hash)),
                        (None, None) => Key::Content(b.tokens_hash),
                    };
                    parent = match key {
                        Key::Seq(seq) => Some(seq),
                        Key::Content(_) => None,
                    };
                    if let Some(old) = g.blocks.insert(b.block_hash, key) {
                        g.unhold(old);
                        self.held -= 1;
                    }
                    *g.held.entry(key).or_default() += 1;
                    self.held += 1;
                }
            }
            KvCacheEventData::Removed(r) => {
                for h in &r.block_hashes {
                    if let Some(key) = g.blocks.remove(h) {
                        g.unhold(key);
                        self.held -= 1;
                    }
                }
            }
            KvCacheEventData::Cleared => {
                self.held -= g.blocks.len();
                g.blocks.clear();
                g.held.clear();
            }
        }
        Ok(())
    }

    /// Forgets what one rank holds in its groups (its cache was cleared).
    pub fn clear_rank(&mut self, worker: WorkerWithDpRank) {
        if let Some(groups) = self.workers.get_mut(&worker) {
            for g in groups.values_mut() {
                self.held -= g.blocks.len();
                g.blocks.clear();
                g.held.clear();
            }
        }
    }

    /// Forgets every group of `worker`'s ranks.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let held = &mut self.held;
        self.workers.retain(|w, groups| {
            let keep = w.worker_id != worker;
            if !keep {
                *held -= groups.values().map(|g| g.blocks.len()).sum::<usize>();
            }
            keep
        });
    }

    /// Whether `worker` has groups beyond the first.
    pub fn is_hybrid(&self, worker: WorkerWithDpRank) -> bool {
        self.workers.contains_key(&worker)
    }

    /// The blocks of a query (`local`, its sequence hashes `seqs`) that `worker` can serve,
    /// given `device` leading blocks in its first group, at most `max_blocks` (the prompt's
    /// last token is computed), blocks of `block_size` tokens.
    pub fn hit(
        &self,
        worker: WorkerWithDpRank,
        device: u32,
        (local, seqs): (&[LocalBlockHash], &[SequenceHash]),
        max_blocks: usize,
        block_size: usize,
    ) -> u32 {
        let Some(groups) = self.workers.get(&worker) else { return device };
        let mut hit = (device as usize).min(max_blocks).min(local.len()).min(seqs.len());
        loop {
            let before = hit;
            for g in groups.values() {
                let holds = |i: usize| g.holds(seqs[i], local[i]);
                hit = match g.kind {
                    None | Some(GroupKind::FullAttention) => {
                        (0..hit).take_while(|&i| holds(i)).count()
                    }
                    Some(GroupKind::SlidingWindow { window }) => {
                        window_hit(hit, window, block_size, &holds)
                    }
                    Some(GroupKind::Mamba) => {
                        (0..hit).rev().find(|&i| holds(i)).map_or(0, |i| i + 1)
                    }
                };
            }
            if hit >= before {
                return hit as u32;
            }
        }
    }
}

/// vLLM's sliding-window hit within the first `hit` blocks: the first run (from the right) of
/// `ceil((window - 1) / block_size)` held blocks ends it; with none, the run from block 0.
fn window_hit(hit: usize, window: u32, block_size: usize, holds: &impl Fn(usize) -> bool) -> usize {
    let needed = (window as usize).saturating_sub(1).div_ceil(block_size.max(1)).max(1);
    let mut run = 0;
    for i in (0..hit).rev() {
        if holds(i) {
            run += 1;
            if run >= needed {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

fn seq_of(g: &Group, hash: ExternalBlockHash) -> Option<SequenceHash> {
    match g.blocks.get(&hash) {
        Some(Key::Seq(s)) => Some(*s),
        _ => None,
    }
}

#[cfg(test)]
mod tests;

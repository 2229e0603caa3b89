//! Blocks below the device: what each worker keeps in host memory and on disk, and what a
//! store outside the engines (shared by every worker) holds.
//!
//! ```text
//!   request  S0 S1 S2 S3 S4 S5 S6          sequence hashes of its blocks
//!   device   ■  ■                           worker w's device prefix (the radix tree): g = 2
//!   host           ■  ■     ■               w's host blocks, by sequence hash
//!   disk           ■     ■                  w's disk blocks
//!   external                   ■            the shared store's blocks (any worker)
//!   run      dev dev host host disk -  -    from g on, each block from the cheapest tier that
//!                                           holds it; the first block held nowhere ends it
//! ```
//!
//! - Engines load lower-tier blocks only after the device prefix and only while they are
//!   consecutive (vLLM's offloading connector looks blocks up one by one from the end of the
//!   GPU hit, promoting a storage block through host memory), so a worker's run continues from
//!   its device score, block by block, and stops at the first block no tier holds.
//! - Blocks are kept by sequence hash, not in a tree: vLLM announces each offloaded block on
//!   its own, naming its parent, which may sit on the device, in another tier, or nowhere any
//!   more. A worker's engine hashes map to sequence hashes; a store resolves its parent through
//!   that map (which remembers the last [`REMEMBERED`] removed blocks), or through the device
//!   tree's path (`parent_sequence`), or is refused as the device tree refuses it.
//! - Every tier counts toward the index's one memory bound; past it the oldest lower-tier
//!   blocks go first ([`LowerTiers::evict_oldest`]).

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::Error;
use crate::hash::chain;
use crate::protocols::{
    ExternalBlockHash, KvCacheEventData, KvCacheStoredBlockData, SequenceHash, StorageTier,
    WorkerId, WorkerWithDpRank,
};

/// Removed blocks each worker's map keeps, so a later store may still name them as its parent.
pub const REMEMBERED: usize = 4096;

/// Blocks of a request served from each lower tier after the device prefix, in the order
/// of [`StorageTier::LOWER`]: host, disk, external.
pub type TierRun = [u32; 3];

fn tier_index(tier: StorageTier) -> Option<usize> {
    StorageTier::LOWER.iter().position(|&t| t == tier)
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    seq: SequenceHash,
    /// Bit `i`: held in `StorageTier::LOWER[i]`.
    tiers: u8,
}

#[derive(Debug, Default)]
struct WorkerTiers {
    blocks: FxHashMap<ExternalBlockHash, Entry>,
    /// Engine hashes holding each sequence hash, per lower tier (aliases counted).
    by_seq: FxHashMap<SequenceHash, [u16; 3]>,
    /// Removed blocks still in `blocks` (no tier bit), oldest first.
    forgotten: VecDeque<ExternalBlockHash>,
    held: [usize; 3],
}

impl WorkerTiers {
    fn mask(&self, seq: SequenceHash) -> u8 {
        self.by_seq.get(&seq).map_or(0, |c| {
            c.iter().enumerate().fold(0, |m, (i, &n)| if n > 0 { m | 1 << i } else { m })
        })
    }
}

/// Lower-tier residency of every worker rank (single-threaded; the service form keeps it
/// beside its device shards, `super::ShardedIndex`).
#[derive(Debug, Default)]
pub struct LowerTiers {
    workers: FxHashMap<WorkerWithDpRank, WorkerTiers>,
    /// External blocks by sequence hash, with how many (worker, block) entries hold each.
    external: FxHashMap<SequenceHash, u32>,
    /// Stores in arrival order, for eviction past the memory bound (entries already gone are
    /// skipped when met).
    order: VecDeque<(WorkerWithDpRank, ExternalBlockHash, u8)>,
    held: usize,
    /// Stored blocks refused because nothing named their parent.
    pub rejected_unknown_parent: u64,
    /// Pairs dropped to stay within the memory bound.
    pub evicted_blocks: u64,
}

/// What a lookup found in the lower tiers (only present when some tier holds anything).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierScores {
    /// Workers with lower-tier blocks and their runs, sorted by worker.
    pub runs: Vec<(WorkerWithDpRank, TierRun)>,
    /// Which blocks of the query the shared store holds (empty when it holds none of them).
    #[serde(skip)]
    pub external: Vec<bool>,
}

impl TierScores {
    /// The run of `worker`, whose device prefix is `device` blocks long: the worker's own
    /// tiers if it has any, else the shared store alone.
    pub fn run(&self, worker: WorkerWithDpRank, device: u32) -> TierRun {
        if let Ok(i) = self.runs.binary_search_by_key(&worker, |&(w, _)| w) {
            return self.runs[i].1;
        }
        let from = device as usize;
        let n = self.external.iter().skip(from).take_while(|&&b| b).count();
        [0, 0, n as u32]
    }
}

impl LowerTiers {
    pub fn new() -> Self {
        Self::default()
    }

    /// (worker, block) pairs held in all lower tiers.
    pub fn held_blocks(&self) -> usize {
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// Blocks each worker rank holds per lower tier, sorted by worker.
    pub fn sizes(&self) -> Vec<(WorkerWithDpRank, [usize; 3])> {
        let mut out: Vec<_> = self.workers.iter().map(|(&w, t)| (w, t.held)).collect();
        out.sort_unstable_by_key(|&(w, _)| w);
        out
    }

    /// The sequence hash `worker` knows engine hash `hash` by, in a lower tier or among its
    /// recently removed blocks.
    pub fn sequence_of(
        &self,
        worker: WorkerWithDpRank,
        hash: ExternalBlockHash,
    ) -> Option<SequenceHash> {
        self.workers.get(&worker)?.blocks.get(&hash).map(|e| e.seq)
    }

    /// Applies one lower-tier event of `worker`. `device_seq` gives the sequence hash of a
    /// block the worker holds on its device (the parent of an offloaded block, mostly).
    pub fn apply(
        &mut self,
        worker: WorkerWithDpRank,
        tier: StorageTier,
        data: &KvCacheEventData,
        device_seq: impl Fn(ExternalBlockHash) -> Option<SequenceHash>,
    ) -> Result<(), Error> {
        let Some(t) = tier_index(tier) else { return Ok(()) };
        match data {
            KvCacheEventData::Stored(s) => {
                let parent = match s.parent_hash {
                    None => None,
                    Some(p) => match self.sequence_of(worker, p).or_else(|| device_seq(p)) {
                        Some(seq) => Some(seq),
                        None => {
                            self.rejected_unknown_parent += s.blocks.len() as u64;
                            return Err(Error::UnknownParent { worker, parent: p });
                        }
                    },
                };
                self.store(worker, t, parent, &s.blocks);
            }
            KvCacheEventData::Removed(r) => {
                for &h in &r.block_hashes {
                    self.remove(worker, t, h);
                }
            }
            KvCacheEventData::Cleared => self.clear_tier(worker, t),
        }
        Ok(())
    }

    fn store(
        &mut self,
        worker: WorkerWithDpRank,
        t: usize,
        mut parent: Option<SequenceHash>,
        blocks: &[KvCacheStoredBlockData],
    ) {
        let state = self.workers.entry(worker).or_default();
        for b in blocks {
            let seq = match parent {
                None => SequenceHash(b.tokens_hash.0),
                Some(p) => chain(p, b.tokens_hash),
            };
            parent = Some(seq);
            let old = *state.blocks.entry(b.block_hash).or_insert(Entry { seq, tiers: 0 });
            if old.seq != seq {
                // The engine reused its name for other content: the old residency goes.
                for i in (0..3).filter(|i| old.tiers & 1 << i != 0) {
                    unhold(state, &mut self.external, &mut self.held, i, old.seq);
                }
            }
            let tiers = if old.seq == seq { old.tiers } else { 0 };
            if tiers & 1 << t != 0 {
                continue;
            }
            state.blocks.insert(b.block_hash, Entry { seq, tiers: tiers | 1 << t });
            let count = &mut state.by_seq.entry(seq).or_default()[t];
            *count = count.saturating_add(1);
            state.held[t] += 1;
            self.held += 1;
            if t == 2 {
                *self.external.entry(seq).or_default() += 1;
            }
            self.order.push_back((worker, b.block_hash, t as u8));
        }
    }

    fn remove(&mut self, worker: WorkerWithDpRank, t: usize, hash: ExternalBlockHash) {
        let Some(state) = self.workers.get_mut(&worker) else { return };
        let Some(entry) = state.blocks.get_mut(&hash) else { return };
        if entry.tiers & 1 << t == 0 {
            return;
        }
        entry.tiers &= !(1 << t);
        let (seq, left) = (entry.seq, entry.tiers);
        unhold(state, &mut self.external, &mut self.held, t, seq);
        if left == 0 {
            state.forgotten.push_back(hash);
            while state.forgotten.len() > REMEMBERED {
                let old = state.forgotten.pop_front().expect("longer than REMEMBERED");
                if state.blocks.get(&old).is_some_and(|e| e.tiers == 0) {
                    state.blocks.remove(&old);
                }
            }
        }
    }

    fn clear_tier(&mut self, worker: WorkerWithDpRank, t: usize) {
        let Some(state) = self.workers.get(&worker) else { return };
        let held: Vec<ExternalBlockHash> =
            state.blocks.iter().filter(|(_, e)| e.tiers & 1 << t != 0).map(|(&h, _)| h).collect();
        for h in held {
            self.remove(worker, t, h);
        }
    }

    /// Forgets every lower-tier block of `worker`'s ranks in `tiers` (an engine restart loses
    /// its host memory but not its disk or the shared store).
    pub fn clear_worker(&mut self, worker: WorkerId, tiers: &[StorageTier]) {
        let ranks: Vec<WorkerWithDpRank> =
            self.workers.keys().filter(|w| w.worker_id == worker).copied().collect();
        for w in ranks {
            for &tier in tiers {
                if let Some(t) = tier_index(tier) {
                    self.clear_tier(w, t);
                }
            }
        }
    }

    /// Forgets `worker` altogether.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.clear_worker(worker, &StorageTier::LOWER);
        self.workers.retain(|w, _| w.worker_id != worker);
    }

    /// Drops the oldest lower-tier blocks until `target` pairs are left.
    pub fn evict_oldest(&mut self, target: usize) -> u64 {
        let mut evicted = 0;
        while self.held > target {
            let Some((w, h, t)) = self.order.pop_front() else { break };
            let before = self.held;
            self.remove(w, t as usize, h);
            evicted += (before - self.held) as u64;
        }
        self.evicted_blocks += evicted;
        if self.order.len() > 2 * self.held + 1024 {
            self.compact_order();
        }
        evicted
    }

    /// Drops `order` entries whose block is gone (keeps the queue proportional to what is held).
    fn compact_order(&mut self) {
        let workers = &self.workers;
        self.order.retain(|&(w, h, t)| {
            workers.get(&w).and_then(|s| s.blocks.get(&h)).is_some_and(|e| e.tiers & 1 << t != 0)
        });
    }

    /// Heap bytes (an estimate from the maps' sizes).
    pub fn heap_bytes(&self) -> usize {
        let per_worker: usize = self
            .workers
            .values()
            .map(|s| s.blocks.capacity() * 40 + s.by_seq.capacity() * 24 + s.forgotten.len() * 8)
            .sum();
        per_worker + self.external.capacity() * 16 + self.order.capacity() * 24
    }

    /// The lower-tier runs for a query whose sequence hashes are `seqs`, after each worker's
    /// device prefix (`device(worker)`).
    pub fn find(
        &self,
        seqs: &[SequenceHash],
        device: impl Fn(WorkerWithDpRank) -> u32,
    ) -> TierScores {
        let external: Vec<bool> = match self.external.is_empty() {
            true => Vec::new(),
            false => seqs.iter().map(|s| self.external.contains_key(s)).collect(),
        };
        let external = match external.iter().any(|&b| b) {
            true => external,
            false => Vec::new(),
        };
        let mut runs: Vec<(WorkerWithDpRank, TierRun)> = self
            .workers
            .iter()
            .filter(|(_, s)| s.held[0] + s.held[1] > 0)
            .map(|(&w, state)| {
                let mut run = [0u32; 3];
                for (k, &seq) in seqs.iter().enumerate().skip(device(w) as usize) {
                    let own = state.mask(seq) & 0b011;
                    let shared = external.get(k).copied().unwrap_or(false);
                    let tier = match (own, shared) {
                        (m, _) if m & 1 != 0 => 0,
                        (m, _) if m & 2 != 0 => 1,
                        (_, true) => 2,
                        _ => break,
                    };
                    run[tier] += 1;
                }
                (w, run)
            })
            .collect();
        runs.sort_unstable_by_key(|&(w, _)| w);
        TierScores { runs, external }
    }
}

fn unhold(
    state: &mut WorkerTiers,
    external: &mut FxHashMap<SequenceHash, u32>,
    held: &mut usize,
    t: usize,
    seq: SequenceHash,
) {
    if let Some(c) = state.by_seq.get_mut(&seq) {
        c[t] = c[t].saturating_sub(1);
        if c.iter().all(|&n| n == 0) {
            state.by_seq.remove(&seq);
        }
    }
    state.held[t] = state.held[t].saturating_sub(1);
    *held = held.saturating_sub(1);
    if t == 2
        && let Some(n) = external.get_mut(&seq)
    {
        *n -= 1;
        if *n == 0 {
            external.remove(&seq);
        }
    }
}

#[cfg(test)]
mod tests;

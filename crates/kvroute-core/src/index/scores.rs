//! What an index is given and answers: its limits, a prompt's overlap scores, its figures.

use serde::Serialize;

use super::tiers::TierScores;
#[cfg(doc)]
use crate::ExternalBlockHash;
use crate::WorkerWithDpRank;

/// Limits of an index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct IndexConfig {
    /// Most (worker, block) pairs the index keeps; past it, the least recently matched leaves are
    /// evicted down to 90% of this (counted in [`IndexStats::evicted_blocks`]). `None`: no bound.
    pub max_held_blocks: Option<usize>,
}

/// How many leading blocks of a query each cache holds, and how big each of those caches is.
/// Only caches with a score above zero appear; both lists are sorted by worker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OverlapScores {
    pub scores: Vec<(WorkerWithDpRank, u32)>,
    /// Blocks each scored cache holds in all (a tie-breaker: the emptier cache evicts less).
    pub tree_sizes: Vec<(WorkerWithDpRank, usize)>,
    /// What the caches hold of the query below their devices, after their device prefixes;
    /// `None` when no lower tier holds any of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<Box<TierScores>>,
}

impl OverlapScores {
    /// Leading blocks of the query that `worker` holds (0 if none).
    pub fn score(&self, worker: WorkerWithDpRank) -> u32 {
        self.scores.binary_search_by_key(&worker, |&(w, _)| w).map_or(0, |i| self.scores[i].1)
    }

    pub fn tree_size(&self, worker: WorkerWithDpRank) -> Option<usize> {
        self.tree_sizes
            .binary_search_by_key(&worker, |&(w, _)| w)
            .ok()
            .map(|i| self.tree_sizes[i].1)
    }

    /// The best score of any cache.
    pub fn max_score(&self) -> u32 {
        self.scores.iter().map(|&(_, s)| s).max().unwrap_or(0)
    }

    pub(crate) fn merge(&mut self, other: Self) {
        self.scores.extend(other.scores);
        self.scores.sort_unstable_by_key(|&(w, _)| w);
        self.tree_sizes.extend(other.tree_sizes);
        self.tree_sizes.sort_unstable_by_key(|&(w, _)| w);
    }
}

/// Counters and sizes of an index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    /// Distinct blocks in the tree.
    pub blocks: usize,
    /// (worker, block) pairs: what memory and `max_held_blocks` scale with.
    pub held_blocks: usize,
    pub nodes: usize,
    pub workers: usize,
    /// Heap bytes owned by the index, from its containers' capacities (an estimate of the
    /// allocator's figure that ignores allocator overhead).
    pub heap_bytes: usize,
    /// (worker, block) pairs kept below the devices (host, disk, the shared store).
    pub lower_tier_blocks: usize,
    /// (worker, block) pairs of hybrid models' cache groups beyond the first.
    pub hybrid_group_blocks: usize,
    pub events_applied: u64,
    /// Stored events refused because the worker does not hold the named parent.
    pub rejected_unknown_parent: u64,
    /// Removed block hashes the worker did not hold.
    pub removed_unknown: u64,
    /// (worker, block) pairs dropped to stay within `max_held_blocks`.
    pub evicted_blocks: u64,
}

impl std::ops::Add for IndexStats {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            blocks: self.blocks + o.blocks,
            held_blocks: self.held_blocks + o.held_blocks,
            nodes: self.nodes + o.nodes,
            workers: self.workers + o.workers,
            heap_bytes: self.heap_bytes + o.heap_bytes,
            lower_tier_blocks: self.lower_tier_blocks + o.lower_tier_blocks,
            hybrid_group_blocks: self.hybrid_group_blocks + o.hybrid_group_blocks,
            events_applied: self.events_applied + o.events_applied,
            rejected_unknown_parent: self.rejected_unknown_parent + o.rejected_unknown_parent,
            removed_unknown: self.removed_unknown + o.removed_unknown,
            evicted_blocks: self.evicted_blocks + o.evicted_blocks,
        }
    }
}

//! Keeping the index within its budget: the least recently used leaves go first.

use std::sync::atomic::Ordering;

use rustc_hash::FxHashSet;

use crate::index::holders::Slot;

use super::tree::*;

impl RadixIndex {
    /// Evicts the least recently touched leaves until at most `target` (worker, block) pairs
    /// remain (what a caller with its own budget, like [`crate::index::ShardedIndex`], uses).
    pub(crate) fn evict_to(&mut self, target: usize) {
        self.evict(target);
    }

    /// Evicts the least recently touched leaves, whoever holds them, until at most `target`
    /// (worker, block) pairs remain.
    pub(super) fn evict(&mut self, target: usize) {
        while self.held > target {
            let mut leaves: Vec<(u64, u32)> = (1..self.nodes.len() as u32)
                .filter(|&x| {
                    let n = &self.nodes[x as usize];
                    n.parent != FREED && n.num_children == 0 && !n.holders.is_empty()
                })
                .map(|x| (self.nodes[x as usize].touched.load(Ordering::Relaxed), x))
                .collect();
            if leaves.is_empty() {
                return;
            }
            leaves.sort_unstable();
            let mut dead: FxHashSet<u32> = FxHashSet::default();
            let mut affected: FxHashSet<Slot> = FxHashSet::default();
            for (_, x) in leaves {
                if self.held <= target {
                    break;
                }
                let n = &mut self.nodes[x as usize];
                let holders = std::mem::take(&mut n.holders);
                dead.extend(n.ids.iter().copied());
                let mut pairs = 0;
                for (s, c) in holders.iter() {
                    self.held_of[s as usize] -= c as usize;
                    pairs += c as usize;
                    affected.insert(s);
                }
                self.held -= pairs;
                self.stats.evicted_blocks += pairs as u64;
                self.cleanup(x);
            }
            for s in affected {
                if let Some(state) = self.workers[s as usize].as_mut() {
                    state.blocks.retain(|id| !dead.contains(&id));
                    state.aliases.retain(|id, _| !dead.contains(id));
                }
            }
        }
    }
}

//! Scoring a prompt: each worker's leading blocks of it.

use smallvec::SmallVec;

use crate::index::OverlapScores;
use crate::index::holders::Slot;
use crate::protocols::LocalBlockHash;

use super::tree::*;

impl RadixIndex {
    /// How many leading blocks of `query` each cache holds.
    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        self.find_matches_with(query, false)
    }

    /// [`Self::find_matches`]; with `early_exit`, the walk stops at the end of the first node
    /// only one cache still matches (Dynamo's option: that cache's score is then a lower
    /// bound, the others' are exact).
    pub fn find_matches_with(&self, query: &[LocalBlockHash], early_exit: bool) -> OverlapScores {
        let mut tally =
            Tally { rank: &self.rank, dense: Vec::new(), sparse: SmallVec::new(), count: 0 };
        // Caches that hold every block so far, by slot.
        let mut active: SmallVec<[Slot; 16]> = SmallVec::new();
        let mut node = ROOT;
        let mut depth = 0;
        while depth < query.len() {
            let key = ChildKey { parent: node, hash: query[depth].0 };
            let Some(&child) = self.children.get(&key) else {
                break;
            };
            let n = &self.nodes[child as usize];
            n.touch(self.clock + 1);
            let len = n.edge.len();
            let matched = common_prefix(&n.edge, &query[depth..]);
            // Holders of the whole edge go on when the query matched all of it; the others
            // score what they hold of what matched, and active caches missing here stop.
            let through = (matched == len).then_some(len as u32);
            let holders = n.holders.as_slice();
            if node == ROOT {
                // A document most caches hold: scores go straight to their ranks' places.
                if holders.len() > 32 && holders.len() * 8 >= self.ranked.len() {
                    tally.dense = vec![0; self.ranked.len()];
                }
                for &(s, c) in holders {
                    if Some(c) == through {
                        active.push(s);
                    } else {
                        tally.score(s, depth + matched.min(c as usize));
                    }
                }
            } else {
                let (mut j, mut keep) = (0, 0);
                for i in 0..active.len() {
                    let s = active[i];
                    while j < holders.len() && holders[j].0 < s {
                        j += 1;
                    }
                    match holders.get(j) {
                        Some(&(h, c)) if h == s && Some(c) == through => {
                            active[keep] = s;
                            keep += 1;
                        }
                        Some(&(h, c)) if h == s => tally.score(s, depth + matched.min(c as usize)),
                        _ => tally.score(s, depth),
                    }
                }
                active.truncate(keep);
            }
            depth += matched;
            if active.is_empty() || through.is_none() || (early_exit && active.len() == 1) {
                break;
            }
            node = child;
        }
        for &s in &active {
            tally.score(s, depth);
        }
        tally.into_scores(self)
    }
}

/// The scores of one lookup, by the caches' worker-order ranks: packed `(rank, score)` pairs
/// that one integer sort orders, or, when most caches score, a score per rank.
pub(super) struct Tally<'a> {
    pub(super) rank: &'a [u32],
    pub(super) dense: Vec<u32>,
    pub(super) sparse: SmallVec<[u64; 16]>,
    pub(super) count: usize,
}

impl Tally<'_> {
    /// The lookup's scores in worker order, with each scored cache's size.
    #[inline]
    fn into_scores(mut self, index: &RadixIndex) -> OverlapScores {
        // (rank, score) in worker order, then both lists from one exact-size pass each.
        let ordered: Vec<(u32, u32)> = if self.dense.is_empty() {
            self.sparse.sort_unstable();
            self.sparse.iter().map(|&p| ((p >> 32) as u32, p as u32)).collect()
        } else {
            let mut v = Vec::with_capacity(self.count);
            v.extend(
                self.dense.iter().enumerate().filter(|&(_, &d)| d > 0).map(|(r, &d)| (r as u32, d)),
            );
            v
        };
        let ranked = &index.ranked;
        OverlapScores {
            scores: ordered.iter().map(|&(r, d)| (ranked[r as usize].0, d)).collect(),
            tree_sizes: ordered
                .iter()
                .map(|&(r, _)| {
                    let (id, slot) = ranked[r as usize];
                    (id, index.held_of[slot as usize])
                })
                .collect(),
            tiers: None,
        }
    }

    #[inline]
    fn score(&mut self, slot: Slot, depth: usize) {
        if depth == 0 {
            return;
        }
        let r = self.rank[slot as usize];
        self.count += 1;
        match self.dense.get_mut(r as usize) {
            Some(d) => *d = depth as u32,
            None => self.sparse.push((u64::from(r) << 32) | depth as u64),
        }
    }
}

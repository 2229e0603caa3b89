//! A replayable snapshot of the index as events.
//!
//! Per worker, the tree is walked from the root through every node the worker holds and their
//! ancestors, emitting one Stored event per node. An ancestor the worker does not hold (it
//! evicted a prefix but kept blocks below it, which vLLM re-links when the prefix comes back)
//! is stored under a made-up engine hash and removed again at the end, so the replayed tree
//! has the same shape and the same holders. Blocks held under several engine hashes are
//! stored once per extra hash.

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::tree::{ROOT, RadixIndex, WorkerState};
use crate::protocols::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};

/// Where made-up engine hashes for unheld ancestors start (skipping any the worker uses).
const SYNTHETIC_BASE: u64 = 0x6b76_726f_7574_6500;

impl RadixIndex {
    /// Events that, applied in order to an empty index, rebuild one with the same answers:
    /// the same scores and tree sizes for every query, and the same blocks per worker.
    pub fn dump_as_events(&self) -> Vec<RouterEvent> {
        let mut kids: FxHashMap<u32, Vec<(u64, u32)>> = FxHashMap::default();
        for (key, &child) in &self.children {
            kids.entry(key.parent).or_default().push((key.hash, child));
        }
        for list in kids.values_mut() {
            list.sort_unstable();
        }
        let mut dump = Dump { events: Vec::new() };
        for worker in self.workers() {
            let slot = self.worker_slots[&worker];
            let Some(state) = self.workers[slot as usize].as_ref() else {
                continue;
            };
            let (names, needed) = self.names_and_nodes(state);
            let mut synthetic = Vec::new();
            let mut next_synthetic = SYNTHETIC_BASE;
            let mut stack: Vec<(u32, Option<ExternalBlockHash>)> = vec![(ROOT, None)];
            while let Some((x, parent)) = stack.pop() {
                let last = if x == ROOT {
                    None
                } else {
                    let node = &self.nodes[x as usize];
                    // The worker's own names for the blocks it holds (a prefix of the edge),
                    // synthetic ones, removed at the end, for the rest the path runs through.
                    let held = node.holders.count(slot) as usize;
                    let exts: Vec<ExternalBlockHash> = node
                        .ids
                        .iter()
                        .enumerate()
                        .map(|(i, id)| {
                            if i < held {
                                return names[id][0];
                            }
                            while state.blocks.contains(ExternalBlockHash(next_synthetic)) {
                                next_synthetic += 1;
                            }
                            next_synthetic += 1;
                            synthetic.push(ExternalBlockHash(next_synthetic - 1));
                            ExternalBlockHash(next_synthetic - 1)
                        })
                        .collect();
                    dump.stored(
                        worker,
                        parent,
                        node.edge.iter().copied().zip(exts.iter().copied()),
                    );
                    for (i, (id, &hash)) in node.ids.iter().zip(&node.edge).enumerate() {
                        let before = if i == 0 { parent } else { Some(exts[i - 1]) };
                        for &alias in names.get(id).map_or(&[][..], |n| &n[1..]) {
                            dump.stored(worker, before, std::iter::once((hash, alias)));
                        }
                    }
                    exts.last().copied()
                };
                if let Some(list) = kids.get(&x) {
                    stack.extend(
                        list.iter()
                            .rev()
                            .filter(|(_, c)| needed.contains(c))
                            .map(|&(_, c)| (c, last)),
                    );
                }
            }
            if !synthetic.is_empty() {
                let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes: synthetic });
                dump.push(worker, data);
            }
        }
        dump.events
    }

    /// A worker's names for each block it holds (sorted), and the nodes on the paths from the
    /// root to them.
    fn names_and_nodes(&self, state: &WorkerState) -> (Names, FxHashSet<u32>) {
        let mut names: Names = FxHashMap::default();
        for (hash, id) in state.blocks.iter() {
            names.entry(id).or_default().push(hash);
        }
        for list in names.values_mut() {
            list.sort_unstable();
        }
        let mut needed: FxHashSet<u32> = FxHashSet::default();
        for &id in names.keys() {
            let mut x = self.slots[id as usize].node;
            while x != ROOT && needed.insert(x) {
                x = self.nodes[x as usize].parent;
            }
        }
        (names, needed)
    }
}

/// A worker's names for the blocks it holds, by block id.
type Names = FxHashMap<u32, SmallVec<[ExternalBlockHash; 1]>>;

struct Dump {
    events: Vec<RouterEvent>,
}

impl Dump {
    fn push(&mut self, worker: crate::WorkerWithDpRank, data: KvCacheEventData) {
        let event = KvCacheEvent::new(self.events.len() as u64, data, worker.dp_rank);
        self.events.push(RouterEvent { worker_id: worker.worker_id, event });
    }

    fn stored(
        &mut self,
        worker: crate::WorkerWithDpRank,
        parent_hash: Option<ExternalBlockHash>,
        blocks: impl Iterator<Item = (LocalBlockHash, ExternalBlockHash)>,
    ) {
        let blocks = blocks
            .map(|(tokens_hash, block_hash)| KvCacheStoredBlockData {
                block_hash,
                tokens_hash,
                mm_extra_info: None,
            })
            .collect();
        self.push(worker, KvCacheEventData::Stored(KvCacheStoreData { parent_hash, blocks }));
    }
}

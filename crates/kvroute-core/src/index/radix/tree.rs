//! The index's nodes, its workers' slots and its memory; what the other parts share.

use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::FxHashMap;

use crate::hash::chain;
use crate::index::ext_map::{ExtMap, MAX_BLOCK_ID, table_bytes};
use crate::index::holders::{Holders, Slot};
use crate::index::{IndexConfig, IndexStats};
use crate::protocols::{
    ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerId, WorkerWithDpRank,
};

pub(super) const ROOT: u32 = 0;
/// The parent of the root.
pub(super) const NO_PARENT: u32 = u32::MAX;
/// The parent of a node on the free list.
pub(super) const FREED: u32 = u32::MAX - 1;

/// Key of the child map: the parent node and the first block hash of the child's edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct ChildKey {
    pub(super) parent: u32,
    pub(super) hash: u64,
}

#[derive(Debug)]
pub(super) struct Node {
    /// The run of blocks this node stands for, and their block ids (parallel vectors).
    pub(super) edge: Vec<LocalBlockHash>,
    pub(super) ids: Vec<u32>,
    pub(super) holders: Holders,
    /// Block `id` sits at offset `slots[id].pos - base` of the edge (wrapping arithmetic).
    pub(super) base: u32,
    pub(super) parent: u32,
    pub(super) num_children: u32,
    pub(super) child_xor: u32,
    /// Clock of the last `find_matches` or store that touched the node (eviction order).
    pub(super) touched: AtomicU64,
}

impl Node {
    pub(super) fn new(parent: u32, holders: Holders, touched: u64) -> Self {
        Self {
            edge: Vec::new(),
            ids: Vec::new(),
            holders,
            base: 0,
            parent,
            num_children: 0,
            child_xor: 0,
            touched: AtomicU64::new(touched),
        }
    }

    pub(super) fn touch(&self, clock: u64) {
        // Readers share nodes: write only when it changes, to keep cache lines clean.
        if self.touched.load(Ordering::Relaxed) != clock {
            self.touched.store(clock, Ordering::Relaxed);
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.edge.capacity() * size_of::<LocalBlockHash>()
            + self.ids.capacity() * size_of::<u32>()
            + self.holders.heap_bytes()
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct BlockSlot {
    pub(super) node: u32,
    pub(super) pos: u32,
}

#[derive(Debug)]
pub(super) struct WorkerState {
    pub(super) id: WorkerWithDpRank,
    pub(super) blocks: ExtMap,
    /// Blocks held under more than one engine hash: how many extra hashes.
    pub(super) aliases: FxHashMap<u32, u32>,
}

/// Where a store is in the tree: after `end` blocks of `node`'s edge. `run` is the start of
/// blocks of this node that the worker has matched but not yet been added to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cursor {
    pub(super) node: u32,
    pub(super) end: usize,
    pub(super) run: Option<usize>,
}

/// Blocks `lo..hi` of `node`'s edge, being detached from one worker.
#[derive(Clone, Copy, Debug)]
pub(super) struct Run {
    pub(super) node: u32,
    pub(super) lo: usize,
    pub(super) hi: usize,
}

/// A compressed radix tree of which cache holds which block. Not thread-safe on its own; see
/// [`crate::index::ShardedIndex`] for the service form.
///
/// ```
/// use kvroute_core::index::RadixIndex;
/// use kvroute_core::*;
/// let mut index = RadixIndex::new();
/// let stored = KvCacheEventData::Stored(KvCacheStoreData {
///     parent_hash: None,
///     blocks: (1..=2)
///         .map(|h| KvCacheStoredBlockData {
///             block_hash: ExternalBlockHash(h * 100),
///             tokens_hash: LocalBlockHash(h),
///             mm_extra_info: None,
///         })
///         .collect(),
/// });
/// let event = RouterEvent::new(7u64, KvCacheEvent::new(0, stored, DpRank(0)));
/// index.apply_event(&event).unwrap();
/// let scores = index.find_matches(&[LocalBlockHash(1), LocalBlockHash(2), LocalBlockHash(3)]);
/// assert_eq!(scores.score(WorkerWithDpRank::new(7u64, 0u32)), 2);
/// ```
#[derive(Debug)]
pub struct RadixIndex {
    pub(super) config: IndexConfig,
    pub(super) nodes: Vec<Node>,
    pub(super) free_nodes: Vec<u32>,
    pub(super) children: FxHashMap<ChildKey, u32>,
    pub(super) slots: Vec<BlockSlot>,
    pub(super) free_blocks: Vec<u32>,
    pub(super) workers: Vec<Option<WorkerState>>,
    pub(super) worker_slots: FxHashMap<WorkerWithDpRank, Slot>,
    pub(super) free_worker_slots: Vec<Slot>,
    /// Distinct blocks each slot's cache holds (beside, not in, its state: lookups read it
    /// for every cache they score).
    pub(super) held_of: Vec<usize>,
    /// The known caches in worker order with their slots, and each slot's place in it: lookups
    /// sort their scores by that rank, a plain integer sort, and read ids in order.
    pub(super) ranked: Vec<(WorkerWithDpRank, Slot)>,
    pub(super) rank: Vec<u32>,
    pub(super) clock: u64,
    pub(super) held: usize,
    pub(super) stats: IndexStats,
}

impl Default for RadixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl RadixIndex {
    pub fn new() -> Self {
        Self::with_config(IndexConfig::default())
    }

    pub fn with_config(config: IndexConfig) -> Self {
        Self {
            config,
            nodes: vec![Node::new(NO_PARENT, Holders::default(), 0)],
            free_nodes: Vec::new(),
            children: FxHashMap::default(),
            slots: Vec::new(),
            free_blocks: Vec::new(),
            workers: Vec::new(),
            worker_slots: FxHashMap::default(),
            free_worker_slots: Vec::new(),
            held_of: Vec::new(),
            ranked: Vec::new(),
            rank: Vec::new(),
            clock: 0,
            held: 0,
            stats: IndexStats::default(),
        }
    }

    /// Forgets every dp rank of `worker`.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        for (w, slot) in self.slots_of(worker) {
            self.clear_slot(slot);
            self.workers[slot as usize] = None;
            self.worker_slots.remove(&w);
            self.free_worker_slots.push(slot);
        }
        self.reorder();
    }

    /// Drops every block of every dp rank of `worker`, keeping it known (with zero blocks).
    pub fn clear_all_blocks(&mut self, worker: WorkerId) {
        for (_, slot) in self.slots_of(worker) {
            self.clear_slot(slot);
        }
    }

    /// Makes `worker` known with no blocks (so it shows in [`Self::workers`]).
    pub fn register_worker(&mut self, worker: WorkerWithDpRank) {
        self.slot_for(worker);
    }

    /// Every known cache, sorted.
    pub fn workers(&self) -> Vec<WorkerWithDpRank> {
        let mut out: Vec<_> = self.worker_slots.keys().copied().collect();
        out.sort_unstable();
        out
    }

    /// Distinct blocks `worker` holds.
    pub fn tree_size(&self, worker: WorkerWithDpRank) -> usize {
        self.worker_slots.get(&worker).map_or(0, |&s| self.held_of[s as usize])
    }

    /// Every known cache with the distinct blocks it holds, sorted by worker.
    pub fn tree_sizes(&self) -> Vec<(WorkerWithDpRank, usize)> {
        self.ranked.iter().map(|&(w, s)| (w, self.held_of[s as usize])).collect()
    }

    /// (worker, block) pairs held, the figure `max_held_blocks` bounds.
    /// The sequence hash of the block `worker` names `hash`: the local hashes on its path
    /// from the root, chained. `None` if the worker does not hold it.
    pub fn sequence_hash(
        &self,
        worker: WorkerWithDpRank,
        hash: ExternalBlockHash,
    ) -> Option<SequenceHash> {
        let slot = *self.worker_slots.get(&worker)?;
        let id = self.workers[slot as usize].as_ref()?.blocks.get(hash)?;
        let (mut node, offset) = self.locate(id);
        let mut path: Vec<&[LocalBlockHash]> = vec![&self.nodes[node as usize].edge[..=offset]];
        node = self.nodes[node as usize].parent;
        while node != ROOT && node != NO_PARENT {
            path.push(&self.nodes[node as usize].edge);
            node = self.nodes[node as usize].parent;
        }
        let mut seq: Option<SequenceHash> = None;
        for &local in path.iter().rev().flat_map(|edge| edge.iter()) {
            seq = Some(seq.map_or(SequenceHash(local.0), |p| chain(p, local)));
        }
        seq
    }

    pub fn held_blocks(&self) -> usize {
        self.held
    }

    pub fn stats(&self) -> IndexStats {
        let live_nodes = self.nodes.len() - self.free_nodes.len();
        let nodes_heap: usize = self.nodes.iter().map(Node::heap_bytes).sum::<usize>()
            + self.nodes.capacity() * size_of::<Node>();
        let workers_heap: usize = self
            .workers
            .iter()
            .flatten()
            .map(|w| w.blocks.heap_bytes() + table_bytes::<(u32, u32)>(w.aliases.capacity()))
            .sum();
        IndexStats {
            blocks: self.slots.len() - self.free_blocks.len(),
            held_blocks: self.held,
            nodes: live_nodes - 1,
            workers: self.worker_slots.len(),
            heap_bytes: nodes_heap
                + workers_heap
                + table_bytes::<(ChildKey, u32)>(self.children.capacity())
                + self.slots.capacity() * size_of::<BlockSlot>()
                + (self.free_blocks.capacity() + self.free_nodes.capacity()) * size_of::<u32>()
                + self.workers.capacity() * size_of::<Option<WorkerState>>(),
            ..self.stats
        }
    }

    pub(super) fn with_worker<T>(
        &mut self,
        slot: Slot,
        f: impl FnOnce(&mut Self, &mut WorkerState) -> T,
    ) -> T {
        let mut state = self.workers[slot as usize].take().expect("a registered slot has a state");
        let out = f(self, &mut state);
        self.workers[slot as usize] = Some(state);
        out
    }

    pub(super) fn slot_for(&mut self, worker: WorkerWithDpRank) -> Slot {
        if let Some(&slot) = self.worker_slots.get(&worker) {
            return slot;
        }
        let state =
            WorkerState { id: worker, blocks: ExtMap::default(), aliases: FxHashMap::default() };
        let slot = match self.free_worker_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(state);
                slot
            }
            None => {
                self.workers.push(Some(state));
                (self.workers.len() - 1) as Slot
            }
        };
        self.worker_slots.insert(worker, slot);
        self.reorder();
        slot
    }

    /// Recomputes the worker-id order of the slots (when a cache comes or goes).
    pub(super) fn reorder(&mut self) {
        let mut known: Vec<(WorkerWithDpRank, Slot)> =
            self.worker_slots.iter().map(|(&w, &s)| (w, s)).collect();
        known.sort_unstable();
        self.held_of.resize(self.workers.len(), 0);
        self.rank.resize(self.workers.len(), 0);
        for (r, &(_, s)) in known.iter().enumerate() {
            self.rank[s as usize] = r as u32;
        }
        self.ranked = known;
    }

    pub(super) fn slots_of(&self, worker: WorkerId) -> Vec<(WorkerWithDpRank, Slot)> {
        let mut out: Vec<_> = self
            .worker_slots
            .iter()
            .filter(|(w, _)| w.worker_id == worker)
            .map(|(&w, &s)| (w, s))
            .collect();
        out.sort_unstable();
        out
    }

    pub(super) fn add_child(&mut self, parent: u32, first: LocalBlockHash, child: u32) {
        self.children.insert(ChildKey { parent, hash: first.0 }, child);
        let p = &mut self.nodes[parent as usize];
        p.num_children += 1;
        p.child_xor ^= child;
    }

    pub(super) fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_nodes.pop() {
            Some(x) => {
                self.nodes[x as usize] = node;
                x
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    pub(super) fn release_node(&mut self, x: u32) {
        let n = &mut self.nodes[x as usize];
        *n = Node::new(FREED, Holders::default(), 0);
        self.free_nodes.push(x);
    }

    pub(super) fn alloc_block(&mut self, slot: BlockSlot) -> u32 {
        match self.free_blocks.pop() {
            Some(id) => {
                self.slots[id as usize] = slot;
                id
            }
            None => {
                debug_assert!(self.slots.len() <= MAX_BLOCK_ID as usize);
                grow_exact(&mut self.slots, 1024);
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        }
    }
}

/// Makes room for `want` more items; when the vector must grow, it grows by a quarter (or
/// `want`) rather than doubling: these vectors hold most of the index, and doubling would
/// leave a quarter of their memory unused on average.
pub(super) fn grow_exact<T>(v: &mut Vec<T>, want: usize) {
    if v.capacity() - v.len() < want {
        v.reserve_exact(want.max(v.len() / 4));
    }
}

/// Length of the common prefix of two runs of hashes, eight at a time where they agree.
pub(super) fn common_prefix(a: &[LocalBlockHash], b: &[LocalBlockHash]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + 8 <= n && a[i..i + 8] == b[i..i + 8] {
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

//! The single-threaded compressed radix index (see the [module docs](super) for the picture).
//!
//! Invariants, checked by the property tests against a naive model:
//! 1. a node's `holders` say, per worker, how many **leading** blocks of its edge the worker
//!    holds: block `i` of the edge is held by exactly the holders whose count exceeds `i`;
//! 2. a worker holds a block iff at least one of the worker's engine hashes is mapped to it
//!    (more than one: counted in `aliases`);
//! 3. a non-root node has a non-empty edge; a node without children has its last block held
//!    (a tail nobody holds is cut off), a node with children may be held by nobody;
//! 4. `children[(p, edge[0] of c)] == c` for every child `c` of `p`, `num_children` counts
//!    them and `child_xor` is the xor of their ids (so a lone child is known without a scan).
//!
//! Nodes split only where paths diverge, or where a worker's blocks stop being a prefix of an
//! edge (a hole evicted in its middle); workers that hold different lengths of one run share
//! its node. So a document a thousand engines hold to a thousand depths is one node, and a
//! lookup scores them in one pass over its holders.

use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::ext_map::{ExtMap, MAX_BLOCK_ID, table_bytes};
use super::holders::{Holders, Slot};
use super::{IndexConfig, IndexStats, OverlapScores};
use crate::Error;
use crate::hash::chain;
use crate::protocols::{
    ExternalBlockHash, KvCacheEventData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    SequenceHash, WorkerId, WorkerWithDpRank,
};

mod dump;
#[cfg(test)]
mod tests;

const ROOT: u32 = 0;
/// The parent of the root.
const NO_PARENT: u32 = u32::MAX;
/// The parent of a node on the free list.
const FREED: u32 = u32::MAX - 1;

/// Key of the child map: the parent node and the first block hash of the child's edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ChildKey {
    parent: u32,
    hash: u64,
}

#[derive(Debug)]
struct Node {
    /// The run of blocks this node stands for, and their block ids (parallel vectors).
    edge: Vec<LocalBlockHash>,
    ids: Vec<u32>,
    holders: Holders,
    /// Block `id` sits at offset `slots[id].pos - base` of the edge (wrapping arithmetic).
    base: u32,
    parent: u32,
    num_children: u32,
    child_xor: u32,
    /// Clock of the last `find_matches` or store that touched the node (eviction order).
    touched: AtomicU64,
}

impl Node {
    fn new(parent: u32, holders: Holders, touched: u64) -> Self {
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

    fn touch(&self, clock: u64) {
        // Readers share nodes: write only when it changes, to keep cache lines clean.
        if self.touched.load(Ordering::Relaxed) != clock {
            self.touched.store(clock, Ordering::Relaxed);
        }
    }

    fn heap_bytes(&self) -> usize {
        self.edge.capacity() * size_of::<LocalBlockHash>()
            + self.ids.capacity() * size_of::<u32>()
            + self.holders.heap_bytes()
    }
}

#[derive(Clone, Copy, Debug)]
struct BlockSlot {
    node: u32,
    pos: u32,
}

#[derive(Debug)]
struct WorkerState {
    id: WorkerWithDpRank,
    blocks: ExtMap,
    /// Blocks held under more than one engine hash: how many extra hashes.
    aliases: FxHashMap<u32, u32>,
}

/// Where a store is in the tree: after `end` blocks of `node`'s edge. `run` is the start of
/// blocks of this node that the worker has matched but not yet been added to.
#[derive(Clone, Copy, Debug)]
struct Cursor {
    node: u32,
    end: usize,
    run: Option<usize>,
}

/// Blocks `lo..hi` of `node`'s edge, being detached from one worker.
#[derive(Clone, Copy, Debug)]
struct Run {
    node: u32,
    lo: usize,
    hi: usize,
}

/// A compressed radix tree of which cache holds which block. Not thread-safe on its own; see
/// [`super::ShardedIndex`] for the service form.
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
    config: IndexConfig,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    children: FxHashMap<ChildKey, u32>,
    slots: Vec<BlockSlot>,
    free_blocks: Vec<u32>,
    workers: Vec<Option<WorkerState>>,
    worker_slots: FxHashMap<WorkerWithDpRank, Slot>,
    free_worker_slots: Vec<Slot>,
    /// Distinct blocks each slot's cache holds (beside, not in, its state: lookups read it
    /// for every cache they score).
    held_of: Vec<usize>,
    /// The known caches in worker order with their slots, and each slot's place in it: lookups
    /// sort their scores by that rank, a plain integer sort, and read ids in order.
    ranked: Vec<(WorkerWithDpRank, Slot)>,
    rank: Vec<u32>,
    clock: u64,
    held: usize,
    stats: IndexStats,
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

    /// Applies one event. A Stored event whose parent the worker does not hold is refused (and
    /// counted) without changing anything; Removed hashes the worker does not hold are skipped
    /// and counted, the rest applied.
    pub fn apply_event(&mut self, event: &RouterEvent) -> Result<(), Error> {
        let result = self.apply_part(event);
        if result.is_ok() {
            self.count_applied();
        }
        result
    }

    /// Applies an event, or a piece of one, without counting it in `events_applied`.
    /// Events about a tier below the device change nothing here (the service form keeps those
    /// tiers: [`super::ShardedIndex`]).
    pub(crate) fn apply_part(&mut self, event: &RouterEvent) -> Result<(), Error> {
        if !event.event.storage_tier.is_device() {
            return Ok(());
        }
        let worker = event.worker();
        match &event.event.data {
            KvCacheEventData::Stored(data) => {
                self.apply_stored_part(worker, data.parent_hash, &data.blocks)
            }
            KvCacheEventData::Removed(data) => self.apply_removed_part(worker, &data.block_hashes),
            KvCacheEventData::Cleared => {
                self.clock += 2;
                if let Some(&slot) = self.worker_slots.get(&worker) {
                    self.clear_slot(slot);
                }
                Ok(())
            }
        }
    }

    /// Stores `blocks` for `worker` after its block `parent` (a Stored event, or a piece of
    /// one), without counting an event.
    pub(crate) fn apply_stored_part(
        &mut self,
        worker: WorkerWithDpRank,
        parent: Option<ExternalBlockHash>,
        blocks: &[KvCacheStoredBlockData],
    ) -> Result<(), Error> {
        // Writes stamp even ticks and reads the odd tick after, so a read after a write ranks
        // newer than that write and older than the next one.
        self.clock += 2;
        let slot = self.slot_for(worker);
        let result =
            self.with_worker(slot, |index, state| index.apply_stored(slot, state, parent, blocks));
        self.bound_memory();
        result
    }

    /// Removes `hashes` from `worker` (a Removed event, or a piece of one), without counting.
    pub(crate) fn apply_removed_part(
        &mut self,
        worker: WorkerWithDpRank,
        hashes: &[ExternalBlockHash],
    ) -> Result<(), Error> {
        self.clock += 2;
        let Some(&slot) = self.worker_slots.get(&worker) else {
            self.stats.removed_unknown += hashes.len() as u64;
            return Err(Error::UnknownBlocks { worker, count: hashes.len() });
        };
        self.with_worker(slot, |index, state| index.apply_removed(slot, state, hashes))
    }

    fn bound_memory(&mut self) {
        if let Some(max) = self.config.max_held_blocks
            && self.held > max
        {
            self.evict(max - max / 10);
        }
    }

    pub(crate) fn count_applied(&mut self) {
        self.stats.events_applied += 1;
    }

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
        // (rank, score) in worker order, then both lists from one exact-size pass each.
        let ordered: Vec<(u32, u32)> = if tally.dense.is_empty() {
            tally.sparse.sort_unstable();
            tally.sparse.iter().map(|&p| ((p >> 32) as u32, p as u32)).collect()
        } else {
            let mut v = Vec::with_capacity(tally.count);
            v.extend(
                tally
                    .dense
                    .iter()
                    .enumerate()
                    .filter(|&(_, &d)| d > 0)
                    .map(|(r, &d)| (r as u32, d)),
            );
            v
        };
        let ranked = &self.ranked;
        OverlapScores {
            scores: ordered.iter().map(|&(r, d)| (ranked[r as usize].0, d)).collect(),
            tree_sizes: ordered
                .iter()
                .map(|&(r, _)| {
                    let (id, slot) = ranked[r as usize];
                    (id, self.held_of[slot as usize])
                })
                .collect(),
            tiers: None,
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

    // ---- events ---------------------------------------------------------------------------

    fn apply_stored(
        &mut self,
        slot: Slot,
        state: &mut WorkerState,
        parent: Option<ExternalBlockHash>,
        blocks: &[KvCacheStoredBlockData],
    ) -> Result<(), Error> {
        let mut cur = match parent {
            None => Cursor { node: ROOT, end: 0, run: None },
            Some(parent) => match state.blocks.get(parent) {
                Some(id) => self.cursor_after(id),
                None => {
                    self.stats.rejected_unknown_parent += 1;
                    return Err(Error::UnknownParent { worker: state.id, parent });
                }
            },
        };
        // Look every hash up first: the lookups are independent, so their cache misses overlap
        // (a big map misses on nearly every probe), and the inserts below then hit warm lines.
        let known: SmallVec<[Option<u32>; 64]> =
            blocks.iter().map(|b| state.blocks.get(b.block_hash)).collect();
        let mut remaining = blocks.len();
        for (block, known) in blocks.iter().zip(known) {
            remaining -= 1;
            // A block inserted earlier in this event may have the same hash (garbage input).
            if let Some(id) = known.or_else(|| state.blocks.get(block.block_hash)) {
                // Already held under this hash (vLLM re-sends cache hits): a no-op, and the
                // event's later blocks chain from wherever it is.
                self.flush(slot, &mut cur);
                cur = self.cursor_after(id);
                continue;
            }
            let (id, alias) = self.step(slot, &mut cur, block.tokens_hash, remaining);
            state.blocks.insert(block.block_hash, id);
            if alias {
                *state.aliases.entry(id).or_insert(0) += 1;
            } else {
                self.held_of[slot as usize] += 1;
                self.held += 1;
            }
        }
        self.flush(slot, &mut cur);
        Ok(())
    }

    fn apply_removed(
        &mut self,
        slot: Slot,
        state: &mut WorkerState,
        hashes: &[ExternalBlockHash],
    ) -> Result<(), Error> {
        // As in `apply_stored`: independent lookups first, so their misses overlap; then warm
        // the slots of the blocks found, which `detach` reads next.
        let ids: SmallVec<[Option<u32>; 64]> =
            hashes.iter().map(|&h| state.blocks.get(h)).collect();
        let warm = ids.iter().flatten().fold(0, |acc, &id| acc ^ self.slots[id as usize].pos);
        std::hint::black_box(warm);
        let mut unknown = 0;
        // Blocks detach in runs: consecutive blocks of one node (an engine evicts a sequence's
        // blocks together, leaves first) are cut out with at most two splits for the run.
        let mut run: Option<Run> = None;
        for &hash in hashes {
            let Some(id) = state.blocks.remove(hash) else {
                unknown += 1;
                continue;
            };
            if let Some(extra) = state.aliases.get_mut(&id) {
                // Still held under another of the worker's hashes.
                *extra -= 1;
                if *extra == 0 {
                    state.aliases.remove(&id);
                }
                continue;
            }
            self.held_of[slot as usize] -= 1;
            self.held -= 1;
            let (node, offset) = self.locate(id);
            if let Some(r) = run.as_mut() {
                if r.node == node && (offset + 1 == r.lo || offset == r.hi) {
                    r.lo = r.lo.min(offset);
                    r.hi = r.hi.max(offset + 1);
                    continue;
                }
                let done = std::mem::replace(r, Run { node, lo: offset, hi: offset + 1 });
                self.detach(slot, done);
                // Detaching reshapes nodes: find the new run's block again.
                let (node, offset) = self.locate(id);
                *r = Run { node, lo: offset, hi: offset + 1 };
            } else {
                run = Some(Run { node, lo: offset, hi: offset + 1 });
            }
        }
        if let Some(r) = run {
            self.detach(slot, r);
        }
        if unknown == 0 {
            return Ok(());
        }
        self.stats.removed_unknown += unknown as u64;
        Err(Error::UnknownBlocks { worker: state.id, count: unknown })
    }

    fn clear_slot(&mut self, slot: Slot) {
        self.with_worker(slot, |index, state| {
            let mut touched: Vec<u32> =
                state.blocks.values().map(|id| index.slots[id as usize].node).collect();
            touched.sort_unstable();
            touched.dedup();
            for &x in &touched {
                index.nodes[x as usize].holders.set(slot, 0);
            }
            for &x in &touched {
                if index.nodes[x as usize].parent != FREED {
                    index.cleanup(x);
                }
            }
            index.held -= index.held_of[slot as usize];
            index.held_of[slot as usize] = 0;
            state.blocks = ExtMap::default();
            state.aliases = FxHashMap::default();
        });
    }

    // ---- walking and reshaping ------------------------------------------------------------

    fn cursor_after(&self, id: u32) -> Cursor {
        let (node, offset) = self.locate(id);
        Cursor { node, end: offset + 1, run: None }
    }

    fn locate(&self, id: u32) -> (u32, usize) {
        let slot = self.slots[id as usize];
        (slot.node, slot.pos.wrapping_sub(self.nodes[slot.node as usize].base) as usize)
    }

    /// Moves the cursor to the next block, whose content hash is `hash`, creating it if the
    /// tree has none. Returns its id and whether the worker already held it (an alias).
    fn step(
        &mut self,
        slot: Slot,
        cur: &mut Cursor,
        hash: LocalBlockHash,
        remaining: usize,
    ) -> (u32, bool) {
        loop {
            let node = &self.nodes[cur.node as usize];
            if cur.end < node.edge.len() {
                if node.edge[cur.end] == hash {
                    let id = node.ids[cur.end];
                    // Holdings are prefixes of edges: a block below the worker's count is one
                    // it holds already, under another engine hash.
                    let alias = (cur.end as u32) < node.holders.count(slot);
                    if !alias && cur.run.is_none() {
                        cur.run = Some(cur.end);
                    }
                    cur.end += 1;
                    return (id, alias);
                }
                // The path leaves this edge in its middle: cut the edge so a child can hang here.
                self.flush(slot, cur);
                if cur.end < self.nodes[cur.node as usize].edge.len() {
                    debug_assert!(cur.end > 0, "a cursor enters a node by its first block");
                    cur.node = self.split(cur.node, cur.end);
                }
                continue;
            }
            let key = ChildKey { parent: cur.node, hash: hash.0 };
            // A childless node (say the leaf this event is growing) needs no lookup.
            let child = (node.num_children > 0).then(|| self.children.get(&key)).flatten();
            if let Some(&child) = child {
                self.flush(slot, cur);
                *cur = Cursor { node: child, end: 0, run: None };
                continue;
            }
            self.flush(slot, cur);
            return (self.push_new(slot, cur, hash, remaining), false);
        }
    }

    /// Appends a new block after the cursor (which is at the end of its node): onto the node
    /// itself when it is childless and the worker holds all of it (other holders keep their
    /// counts, so they now hold a prefix), else as a new child.
    fn push_new(
        &mut self,
        slot: Slot,
        cur: &mut Cursor,
        hash: LocalBlockHash,
        remaining: usize,
    ) -> u32 {
        let n = &self.nodes[cur.node as usize];
        let len = n.edge.len() as u32;
        let extend = cur.node != ROOT && n.num_children == 0 && n.holders.count(slot) == len;
        if !extend {
            let child = self.alloc_node(Node::new(cur.node, Holders::default(), self.clock));
            self.add_child(cur.node, hash, child);
            *cur = Cursor { node: child, end: 0, run: None };
        }
        let n = &self.nodes[cur.node as usize];
        let pos = n.base.wrapping_add(n.edge.len() as u32);
        let id = self.alloc_block(BlockSlot { node: cur.node, pos });
        let n = &mut self.nodes[cur.node as usize];
        // The event says how many blocks follow: size the edge for them, not by doubling.
        grow_exact(&mut n.edge, remaining + 1);
        grow_exact(&mut n.ids, remaining + 1);
        n.edge.push(hash);
        n.ids.push(id);
        n.holders.set(slot, n.edge.len() as u32);
        n.touch(self.clock);
        cur.end = n.edge.len();
        id
    }

    /// Adds the worker to the blocks it matched in the cursor's node (`run..end`). The worker
    /// holds the blocks before `run` (it reached them through its own parent block), so its
    /// count grows to `end`; were it not so, the node is cut at `run` to keep holdings prefixes.
    fn flush(&mut self, slot: Slot, cur: &mut Cursor) {
        let Some(start) = cur.run.take() else { return };
        let (node, mut end) = (cur.node, cur.end);
        let held = self.nodes[node as usize].holders.count(slot) as usize;
        debug_assert!(held >= start, "a cursor enters a node through blocks its worker holds");
        if held < start {
            self.split(node, start);
            end -= start;
        }
        let n = &mut self.nodes[node as usize];
        n.holders.set(slot, end as u32);
        n.touch(self.clock);
        let (node, shift) = self.merge_with_parent(node);
        *cur = Cursor { node, end: end + shift, run: None };
    }

    /// Cuts node `n` after `k` blocks (0 < k < len). The head moves to a new node, which
    /// takes `n`'s place under its parent; `n` keeps the tail and its children.
    fn split(&mut self, n: u32, k: usize) -> u32 {
        let node = &mut self.nodes[n as usize];
        debug_assert!(k > 0 && k < node.edge.len());
        let edge: Vec<_> = node.edge.drain(..k).collect();
        let ids: Vec<_> = node.ids.drain(..k).collect();
        if node.edge.capacity() > 2 * node.edge.len() + 8 {
            node.edge.shrink_to_fit();
            node.ids.shrink_to_fit();
        }
        let (parent, base, tail_first) = (node.parent, node.base, node.edge[0]);
        node.base = base.wrapping_add(k as u32);
        let (head_holders, tail_holders) = node.holders.split_at(k as u32);
        node.holders = tail_holders;
        let mut head = Node::new(parent, head_holders, node.touched.load(Ordering::Relaxed));
        head.base = base;
        let head_first = edge[0];
        head.edge = edge;
        head.ids = ids;
        head.num_children = 1;
        head.child_xor = n;
        let h = self.alloc_node(head);
        for &id in &self.nodes[h as usize].ids {
            self.slots[id as usize].node = h;
        }
        self.nodes[n as usize].parent = h;
        self.nodes[parent as usize].child_xor ^= n ^ h;
        self.children.insert(ChildKey { parent, hash: head_first.0 }, h);
        self.children.insert(ChildKey { parent: h, hash: tail_first.0 }, n);
        h
    }

    /// If `c` is its parent's only child and every holder of `c` holds all of the parent, the
    /// parent's edge is prepended to `c`'s and the parent freed. `c` keeps its id (and so its
    /// children); returns it and by how many blocks its offsets moved.
    fn merge_with_parent(&mut self, c: u32) -> (u32, usize) {
        let p = self.nodes[c as usize].parent;
        if p == ROOT || self.nodes[p as usize].num_children != 1 {
            return (c, 0);
        }
        let parent = &self.nodes[p as usize];
        let plen = parent.edge.len() as u32;
        if !parent.holders.covers(&self.nodes[c as usize].holders, plen) {
            return (c, 0);
        }
        let holders = parent.holders.joined(&self.nodes[c as usize].holders, plen);
        let parent = &mut self.nodes[p as usize];
        let mut edge = std::mem::take(&mut parent.edge);
        let mut ids = std::mem::take(&mut parent.ids);
        let (grandparent, touched) = (parent.parent, parent.touched.load(Ordering::Relaxed));
        let child = &self.nodes[c as usize];
        let base = child.base.wrapping_sub(edge.len() as u32);
        let (parent_first, child_first) = (edge[0], child.edge[0]);
        for (i, &id) in ids.iter().enumerate() {
            self.slots[id as usize] = BlockSlot { node: c, pos: base.wrapping_add(i as u32) };
        }
        let child = &mut self.nodes[c as usize];
        edge.extend_from_slice(&child.edge);
        ids.extend_from_slice(&child.ids);
        child.edge = edge;
        child.ids = ids;
        child.base = base;
        child.parent = grandparent;
        child.holders = holders;
        if touched > child.touched.load(Ordering::Relaxed) {
            child.touched.store(touched, Ordering::Relaxed);
        }
        self.children.remove(&ChildKey { parent: p, hash: child_first.0 });
        self.children.insert(ChildKey { parent: grandparent, hash: parent_first.0 }, c);
        self.nodes[grandparent as usize].child_xor ^= p ^ c;
        self.release_node(p);
        (c, plen as usize)
    }

    /// Detaches the worker from a run of blocks of one node. The worker's tail run shortens
    /// its count; a run in the middle of what it holds is a hole, and the node is cut after
    /// the run so that what the worker keeps stays prefixes (of the head and of the tail).
    fn detach(&mut self, slot: Slot, run: Run) {
        let Run { node, lo, hi } = run;
        let held = self.nodes[node as usize].holders.count(slot) as usize;
        debug_assert!(hi <= held, "a worker's blocks are a prefix of the node");
        let mut x = node;
        if hi < held {
            x = self.split(node, hi);
        }
        self.nodes[x as usize].holders.set(slot, lo as u32);
        self.cleanup(x);
    }

    /// After holders changed at `x`: frees it (and then its ancestors) while nobody holds it
    /// and it has no children, cuts off a tail nobody holds, and otherwise folds it with a
    /// neighbour whose holders allow.
    fn cleanup(&mut self, mut x: u32) {
        while x != ROOT {
            let n = &mut self.nodes[x as usize];
            if n.num_children == 0 {
                let held = n.holders.max_count() as usize;
                if held == 0 {
                    let (parent, first) = (n.parent, n.edge[0]);
                    self.children.remove(&ChildKey { parent, hash: first.0 });
                    let p = &mut self.nodes[parent as usize];
                    p.num_children -= 1;
                    p.child_xor ^= x;
                    let ids = std::mem::take(&mut self.nodes[x as usize].ids);
                    self.free_blocks.extend_from_slice(&ids);
                    self.release_node(x);
                    x = parent;
                    continue;
                }
                if held < n.edge.len() {
                    n.edge.truncate(held);
                    self.free_blocks.extend(n.ids.drain(held..));
                }
            }
            let (x, _) = self.merge_with_parent(x);
            let n = &self.nodes[x as usize];
            if n.num_children == 1 {
                self.merge_with_parent(n.child_xor);
            }
            return;
        }
    }

    // ---- eviction -------------------------------------------------------------------------

    /// Evicts the least recently touched leaves until at most `target` (worker, block) pairs
    /// remain (what a caller with its own budget, like [`super::ShardedIndex`], uses).
    pub(crate) fn evict_to(&mut self, target: usize) {
        self.evict(target);
    }

    /// Evicts the least recently touched leaves, whoever holds them, until at most `target`
    /// (worker, block) pairs remain.
    fn evict(&mut self, target: usize) {
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

    // ---- bookkeeping ----------------------------------------------------------------------

    fn with_worker<T>(
        &mut self,
        slot: Slot,
        f: impl FnOnce(&mut Self, &mut WorkerState) -> T,
    ) -> T {
        let mut state = self.workers[slot as usize].take().expect("a registered slot has a state");
        let out = f(self, &mut state);
        self.workers[slot as usize] = Some(state);
        out
    }

    fn slot_for(&mut self, worker: WorkerWithDpRank) -> Slot {
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
    fn reorder(&mut self) {
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

    fn slots_of(&self, worker: WorkerId) -> Vec<(WorkerWithDpRank, Slot)> {
        let mut out: Vec<_> = self
            .worker_slots
            .iter()
            .filter(|(w, _)| w.worker_id == worker)
            .map(|(&w, &s)| (w, s))
            .collect();
        out.sort_unstable();
        out
    }

    fn add_child(&mut self, parent: u32, first: LocalBlockHash, child: u32) {
        self.children.insert(ChildKey { parent, hash: first.0 }, child);
        let p = &mut self.nodes[parent as usize];
        p.num_children += 1;
        p.child_xor ^= child;
    }

    fn alloc_node(&mut self, node: Node) -> u32 {
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

    fn release_node(&mut self, x: u32) {
        let n = &mut self.nodes[x as usize];
        *n = Node::new(FREED, Holders::default(), 0);
        self.free_nodes.push(x);
    }

    fn alloc_block(&mut self, slot: BlockSlot) -> u32 {
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
fn grow_exact<T>(v: &mut Vec<T>, want: usize) {
    if v.capacity() - v.len() < want {
        v.reserve_exact(want.max(v.len() / 4));
    }
}

/// The scores of one lookup, by the caches' worker-order ranks: packed `(rank, score)` pairs
/// that one integer sort orders, or, when most caches score, a score per rank.
struct Tally<'a> {
    rank: &'a [u32],
    dense: Vec<u32>,
    sparse: SmallVec<[u64; 16]>,
    count: usize,
}

impl Tally<'_> {
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

/// Length of the common prefix of two runs of hashes, eight at a time where they agree.
fn common_prefix(a: &[LocalBlockHash], b: &[LocalBlockHash]) -> usize {
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

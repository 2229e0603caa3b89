//! Events into the tree: stores, removals, and the splits and merges they make.

use std::sync::atomic::Ordering;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::Error;
use crate::index::ext_map::ExtMap;
use crate::index::holders::{Holders, Slot};
use crate::protocols::{
    ExternalBlockHash, KvCacheEventData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    WorkerWithDpRank,
};

use super::tree::*;

impl RadixIndex {
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
    /// tiers: [`crate::index::ShardedIndex`]).
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

    pub(super) fn bound_memory(&mut self) {
        if let Some(max) = self.config.max_held_blocks
            && self.held > max
        {
            self.evict(max - max / 10);
        }
    }

    pub(crate) fn count_applied(&mut self) {
        self.stats.events_applied += 1;
    }

    pub(super) fn apply_stored(
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

    pub(super) fn apply_removed(
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

    pub(super) fn clear_slot(&mut self, slot: Slot) {
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

    pub(super) fn cursor_after(&self, id: u32) -> Cursor {
        let (node, offset) = self.locate(id);
        Cursor { node, end: offset + 1, run: None }
    }

    pub(super) fn locate(&self, id: u32) -> (u32, usize) {
        let slot = self.slots[id as usize];
        (slot.node, slot.pos.wrapping_sub(self.nodes[slot.node as usize].base) as usize)
    }

    /// Moves the cursor to the next block, whose content hash is `hash`, creating it if the
    /// tree has none. Returns its id and whether the worker already held it (an alias).
    pub(super) fn step(
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
    pub(super) fn push_new(
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
    pub(super) fn flush(&mut self, slot: Slot, cur: &mut Cursor) {
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
    pub(super) fn split(&mut self, n: u32, k: usize) -> u32 {
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
    pub(super) fn merge_with_parent(&mut self, c: u32) -> (u32, usize) {
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
    pub(super) fn detach(&mut self, slot: Slot, run: Run) {
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
    pub(super) fn cleanup(&mut self, mut x: u32) {
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
}

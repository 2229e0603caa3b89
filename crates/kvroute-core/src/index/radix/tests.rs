use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::tree::*;
use crate::Error;
use crate::hash::BlockHasher;
use crate::index::IndexConfig;
use crate::index::holders::Slot;
use crate::protocols::{
    BlockExtraInfo, BlockMmObjectInfo, BlockSize, DpRank, KvCacheEvent, KvCacheRemoveData,
    KvCacheStoreData,
};
use crate::protocols::{
    ExternalBlockHash, KvCacheEventData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    WorkerId, WorkerWithDpRank,
};
use rustc_hash::FxHashMap;

fn w(id: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(id, 0u32)
}

fn event(worker: WorkerWithDpRank, data: KvCacheEventData) -> RouterEvent {
    RouterEvent { worker_id: worker.worker_id, event: KvCacheEvent::new(0, data, worker.dp_rank) }
}

/// Stored of `locals` named `ext` (engine hashes), under `parent`.
fn stored(
    worker: WorkerWithDpRank,
    parent: Option<u64>,
    blocks: &[(u64, u64)], // (engine hash, local hash)
) -> RouterEvent {
    let blocks = blocks
        .iter()
        .map(|&(e, l)| KvCacheStoredBlockData {
            block_hash: ExternalBlockHash(e),
            tokens_hash: LocalBlockHash(l),
            mm_extra_info: None,
        })
        .collect();
    event(
        worker,
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ExternalBlockHash),
            blocks,
        }),
    )
}

fn removed(worker: WorkerWithDpRank, hashes: &[u64]) -> RouterEvent {
    let block_hashes = hashes.iter().copied().map(ExternalBlockHash).collect();
    event(worker, KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }))
}

fn q(locals: &[u64]) -> Vec<LocalBlockHash> {
    locals.iter().copied().map(LocalBlockHash).collect()
}

/// Stores `locals` for `worker` as one chain, engine hashes `salt + i`.
fn store_chain(index: &mut RadixIndex, worker: WorkerWithDpRank, salt: u64, locals: &[u64]) {
    let blocks: Vec<_> = locals.iter().enumerate().map(|(i, &l)| (salt + i as u64, l)).collect();
    index.apply_event(&stored(worker, None, &blocks)).unwrap();
    check_invariants(index);
}

/// The structural invariants listed at the top of `radix.rs`.
fn check_invariants(index: &RadixIndex) {
    let mut per_parent: FxHashMap<u32, (u32, u32)> = FxHashMap::default();
    let mut live_blocks = 0;
    for (x, node) in index.nodes.iter().enumerate().skip(1) {
        let x = x as u32;
        if node.parent == FREED {
            continue;
        }
        assert!(!node.edge.is_empty(), "node {x} has an empty edge");
        assert_eq!(node.edge.len(), node.ids.len());
        assert_eq!(index.children[&ChildKey { parent: node.parent, hash: node.edge[0].0 }], x);
        let held = node.holders.max_count() as usize;
        assert!(held <= node.edge.len(), "node {x} is held past its edge");
        assert!(held == node.edge.len() || node.num_children > 0, "node {x} has a dead tail");
        assert!(node.holders.iter().all(|(_, c)| c > 0), "node {x} has an empty holder");
        for (i, &id) in node.ids.iter().enumerate() {
            assert_eq!(index.locate(id), (x, i), "slot of block {id}");
        }
        live_blocks += node.ids.len();
        let entry = per_parent.entry(node.parent).or_default();
        entry.0 += 1;
        entry.1 ^= x;
    }
    assert_eq!(index.children.len(), per_parent.values().map(|c| c.0 as usize).sum::<usize>());
    for (x, node) in index.nodes.iter().enumerate() {
        if node.parent != FREED {
            let (count, xor) = per_parent.get(&(x as u32)).copied().unwrap_or_default();
            assert_eq!((node.num_children, node.child_xor), (count, xor), "children of {x}");
        }
    }
    assert_eq!(index.slots.len() - index.free_blocks.len(), live_blocks, "leaked block ids");
    let mut total = 0;
    for (slot, state) in index.workers.iter().enumerate() {
        let Some(state) = state else { continue };
        let held: BTreeSet<u32> = state.blocks.values().collect();
        assert_eq!(index.held_of[slot], held.len());
        assert_eq!(state.blocks.len() - held.len(), state.aliases.values().sum::<u32>() as usize);
        total += held.len();
        for (x, node) in index.nodes.iter().enumerate().skip(1) {
            if node.parent == FREED {
                continue;
            }
            let count = node.holders.count(slot as Slot) as usize;
            for (i, id) in node.ids.iter().enumerate() {
                assert_eq!(held.contains(id), i < count, "holders of node {x} for slot {slot}");
            }
        }
    }
    assert_eq!(index.held, total);
}

#[test]
fn parent_child_chain_scores_two() {
    let mut index = RadixIndex::new();
    index.apply_event(&stored(w(1), None, &[(100, 1)])).unwrap();
    index.apply_event(&stored(w(1), Some(100), &[(101, 2)])).unwrap();
    check_invariants(&index);
    let scores = index.find_matches(&q(&[1, 2, 3]));
    assert_eq!(scores.scores, vec![(w(1), 2)]);
    assert_eq!(scores.tree_sizes, vec![(w(1), 2)]);
    assert_eq!(index.stats().nodes, 1, "a chain of one worker is one compressed node");
}

#[test]
fn score_counts_leading_blocks_only() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3]);
    index.apply_event(&removed(w(1), &[101])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2, 3])).score(w(1)), 1);
    assert_eq!(index.tree_size(w(1)), 2);
    // Re-storing the prefix re-links the block the engine kept (vLLM does this).
    index.apply_event(&stored(w(1), Some(100), &[(101, 2)])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2, 3])).score(w(1)), 3);
}

#[test]
fn early_exit_stops_once_one_worker_is_left() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2]);
    store_chain(&mut index, w(2), 200, &[1, 2, 3, 4]);
    index.apply_event(&stored(w(2), Some(203), &[(204, 5)])).unwrap(); // its own child node
    let query = q(&[1, 2, 3, 4, 5]);
    assert_eq!(index.find_matches(&query).scores, vec![(w(1), 2), (w(2), 5)]);
    let early = index.find_matches_with(&query, true);
    assert_eq!(early.score(w(1)), 2);
    assert!(early.score(w(2)) >= 4 && early.score(w(2)) <= 5);
}

#[test]
fn first_block_miss_and_partial_match() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3, 4]);
    assert!(index.find_matches(&q(&[9, 1, 2])).scores.is_empty());
    assert_eq!(index.find_matches(&q(&[1, 2, 9, 4])).score(w(1)), 2);
    assert_eq!(index.find_matches(&q(&[1, 2])).score(w(1)), 2);
    assert!(index.find_matches(&[]).scores.is_empty());
}

#[test]
fn shared_prefix_splits_and_scores_per_worker() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3, 4]);
    store_chain(&mut index, w(2), 200, &[1, 2, 7]);
    store_chain(&mut index, w(3), 300, &[1, 2, 3, 4, 5]);
    let scores = index.find_matches(&q(&[1, 2, 3, 4, 5]));
    assert_eq!(scores.scores, vec![(w(1), 4), (w(2), 2), (w(3), 5)]);
    assert_eq!(index.find_matches(&q(&[1, 2, 7])).scores, vec![(w(1), 2), (w(2), 3), (w(3), 2)]);
    assert_eq!(index.stats().blocks, 6);
    assert_eq!(index.held_blocks(), 12);
}

#[test]
fn restore_is_idempotent_whatever_parent_is_named() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3]);
    let before = index.stats();
    // Re-sent with parent None (a vLLM cache hit), and again under its true parent.
    index.apply_event(&stored(w(1), None, &[(101, 2), (102, 3)])).unwrap();
    index.apply_event(&stored(w(1), Some(100), &[(101, 2)])).unwrap();
    check_invariants(&index);
    assert_eq!(index.stats().blocks, before.blocks);
    assert_eq!(index.tree_size(w(1)), 3);
    // Later blocks chain from the re-sent one.
    index.apply_event(&stored(w(1), None, &[(102, 3), (103, 4)])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2, 3, 4])).score(w(1)), 4);
}

#[test]
fn unknown_parent_is_refused_and_counted() {
    let mut index = RadixIndex::new();
    let err = index.apply_event(&stored(w(1), Some(42), &[(1, 1)])).unwrap_err();
    assert_eq!(err, Error::UnknownParent { worker: w(1), parent: ExternalBlockHash(42) });
    assert_eq!(index.stats().rejected_unknown_parent, 1);
    assert_eq!(index.stats().blocks, 0);
    let err = index.apply_event(&removed(w(1), &[5, 6])).unwrap_err();
    assert_eq!(err, Error::UnknownBlocks { worker: w(1), count: 2 });
    assert_eq!(index.stats().removed_unknown, 2);
}

#[test]
fn same_content_different_engine_hashes_per_worker() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2]);
    store_chain(&mut index, w(2), 900, &[1, 2]);
    // Worker 1's hash 101 means nothing to worker 2, and vice versa.
    assert!(index.apply_event(&removed(w(2), &[101])).is_err());
    index.apply_event(&removed(w(2), &[901])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2])).scores, vec![(w(1), 2), (w(2), 1)]);
    index.apply_event(&removed(w(1), &[101, 100])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2])).scores, vec![(w(2), 1)]);
}

#[test]
fn removal_frees_everything() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3, 4]);
    store_chain(&mut index, w(2), 200, &[1, 2, 5]);
    // Head first for one worker, tail first for the other.
    index.apply_event(&removed(w(1), &[100, 101, 102, 103])).unwrap();
    check_invariants(&index);
    index.apply_event(&removed(w(2), &[202, 201, 200])).unwrap();
    check_invariants(&index);
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.nodes, stats.held_blocks), (0, 0, 0));
    assert!(index.children.is_empty());
}

#[test]
fn removing_runs_of_a_shared_edge() {
    let mut index = RadixIndex::new();
    let chain: Vec<u64> = (1..=8).collect();
    for k in 1..=3 {
        store_chain(&mut index, w(k), 100 * k, &chain);
    }
    // A middle run, descending, from worker 2; an ascending tail run from worker 3.
    index.apply_event(&removed(w(2), &[205, 204, 203])).unwrap();
    check_invariants(&index);
    index.apply_event(&removed(w(3), &[306, 307, 300])).unwrap();
    check_invariants(&index);
    let scores = index.find_matches(&q(&chain));
    assert_eq!(scores.scores, vec![(w(1), 8), (w(2), 3)], "2 lost blocks 3-5, 3 lost block 0");
    assert_eq!(index.find_matches(&q(&[1, 2, 3])).scores, vec![(w(1), 3), (w(2), 3)]);
    assert_eq!((index.tree_size(w(2)), index.tree_size(w(3))), (5, 5));
    index.apply_event(&removed(w(1), &(100..108).rev().collect::<Vec<_>>())).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&chain)).scores, vec![(w(2), 3)]);
}

#[test]
fn remove_worker_and_clear_all_blocks_isolate_workers() {
    let mut index = RadixIndex::new();
    for (id, dp) in [(1, 0), (1, 1), (2, 0)] {
        let worker = WorkerWithDpRank::new(id, dp as u32);
        store_chain(&mut index, worker, 100 * id + 10 * dp, &[1, 2, 3]);
    }
    index.clear_all_blocks(WorkerId(1));
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2, 3])).scores, vec![(w(2), 3)]);
    assert_eq!(index.workers().len(), 3, "cleared workers stay known");
    store_chain(&mut index, w(1), 500, &[1, 2]);
    index.remove_worker(WorkerId(2));
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2, 3])).scores, vec![(w(1), 2)]);
    assert_eq!(index.workers(), vec![w(1), WorkerWithDpRank::new(1u64, 1u32)]);
    let cleared = event(w(1), KvCacheEventData::Cleared);
    index.apply_event(&cleared).unwrap();
    check_invariants(&index);
    assert_eq!(index.stats().blocks, 0);
}

#[test]
fn same_tokens_different_images_are_different_blocks() {
    let hasher = BlockHasher::new(BlockSize::new(4).unwrap());
    let tokens: Vec<u32> = (0..12).collect();
    let image = |h| {
        Some(BlockExtraInfo {
            mm_objects: vec![BlockMmObjectInfo { mm_hash: h, offsets: vec![(0, 4)] }],
        })
    };
    let with_a = hasher.local_hashes(&tokens, Some(&[None, image(0xA), None]));
    let with_b = hasher.local_hashes(&tokens, Some(&[None, image(0xB), None]));
    let mut index = RadixIndex::new();
    let blocks: Vec<_> = with_a.iter().enumerate().map(|(i, l)| (i as u64, l.0)).collect();
    index.apply_event(&stored(w(1), None, &blocks)).unwrap();
    assert_eq!(index.find_matches(&with_a).score(w(1)), 3);
    assert_eq!(index.find_matches(&with_b).score(w(1)), 1, "only the text block before the image");
    // Worker 2 caches image B: each worker matches only its own image.
    let blocks: Vec<_> = with_b.iter().enumerate().map(|(i, l)| (50 + i as u64, l.0)).collect();
    index.apply_event(&stored(w(2), None, &blocks)).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&with_b).scores, vec![(w(1), 1), (w(2), 3)]);
    assert_eq!(index.find_matches(&with_a).scores, vec![(w(1), 3), (w(2), 1)]);
}

#[test]
fn end_to_end_over_2_3_and_5_workers() {
    let hasher = BlockHasher::new(BlockSize::new(16).unwrap());
    for workers in [2u64, 3, 5] {
        let mut index = RadixIndex::new();
        let prompt = |k: u64| -> Vec<u32> {
            (0..64 + 16 * k as u32).map(|t| t % 97 + k as u32 * (t / 48)).collect()
        };
        for k in 0..workers {
            let local = hasher.local_hashes(&prompt(k), None);
            let blocks: Vec<_> =
                local.iter().enumerate().map(|(i, l)| (k * 1000 + i as u64, l.0)).collect();
            index.apply_event(&stored(w(k), None, &blocks)).unwrap();
        }
        check_invariants(&index);
        for k in 0..workers {
            let scores = index.find_matches(&hasher.local_hashes(&prompt(k), None));
            let best = scores.scores.iter().max_by_key(|&&(_, s)| s).unwrap();
            assert_eq!(*best, (w(k), 4 + k as u32), "{workers} workers: prompt {k}");
            assert_eq!(scores.scores.len() as u64, workers, "all share the first three blocks");
        }
    }
}

#[test]
fn aliases_keep_a_block_until_its_last_hash_goes() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2]);
    index.apply_event(&stored(w(1), Some(100), &[(777, 2)])).unwrap();
    check_invariants(&index);
    assert_eq!(index.tree_size(w(1)), 2);
    index.apply_event(&removed(w(1), &[101])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2])).score(w(1)), 2);
    index.apply_event(&removed(w(1), &[777])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&[1, 2])).score(w(1)), 1);
}

#[test]
fn memory_bound_evicts_least_recently_matched_leaves() {
    let mut index = RadixIndex::with_config(IndexConfig { max_held_blocks: Some(100) });
    store_chain(&mut index, w(1), 0, &(0..40).collect::<Vec<_>>());
    store_chain(&mut index, w(2), 1000, &(1000..1040).collect::<Vec<_>>());
    index.find_matches(&q(&[0, 1, 2]));
    store_chain(&mut index, w(1), 2000, &(2000..2040).collect::<Vec<_>>());
    check_invariants(&index);
    assert!(index.held_blocks() <= 100);
    assert_eq!(index.stats().evicted_blocks, 40, "one 40-block leaf is enough to get under 90");
    assert_eq!(index.find_matches(&q(&[0, 1])).score(w(1)), 2, "recently matched survives");
    assert!(index.find_matches(&q(&[1000])).scores.is_empty(), "coldest leaf went");
    assert_eq!(index.tree_size(w(2)), 0);
    // The evicted worker's hashes are forgotten: removing one is an unknown block now.
    assert!(index.apply_event(&removed(w(2), &[1000])).is_err());
}

#[test]
fn dump_replays_to_the_same_answers() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3, 4]);
    store_chain(&mut index, w(2), 200, &[1, 2, 5]);
    index.apply_event(&removed(w(1), &[100])).unwrap(); // an unheld ancestor
    index.apply_event(&stored(w(2), Some(201), &[(777, 5)])).unwrap(); // an alias
    let replayed = replay(&index);
    for query in [q(&[1, 2, 3, 4]), q(&[1, 2, 5]), q(&[5])] {
        assert_eq!(index.find_matches(&query), replayed.find_matches(&query));
    }
    assert_eq!(index.tree_size(w(1)), replayed.tree_size(w(1)));
    let json = serde_json::to_string(&index.dump_as_events()).unwrap();
    assert!(json.contains(r#""data":{"stored":{"parent_hash":null"#));
}

fn replay(index: &RadixIndex) -> RadixIndex {
    let mut fresh = RadixIndex::new();
    for e in index.dump_as_events() {
        fresh.apply_event(&e).unwrap();
    }
    check_invariants(&fresh);
    fresh
}

// ---- property test against a naive model ------------------------------------------------------

/// Per worker: engine hash -> the full path of content hashes from the root.
#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerWithDpRank, BTreeMap<u64, Vec<u64>>>,
}

impl Model {
    fn apply(&mut self, e: &RouterEvent) {
        let worker = e.worker();
        match &e.event.data {
            KvCacheEventData::Stored(data) => {
                let map = self.workers.entry(worker).or_default();
                let mut path = match data.parent_hash {
                    None => Vec::new(),
                    Some(p) => match map.get(&p.0) {
                        Some(path) => path.clone(),
                        None => return,
                    },
                };
                for b in &data.blocks {
                    if let Some(existing) = map.get(&b.block_hash.0) {
                        path = existing.clone();
                    } else {
                        path.push(b.tokens_hash.0);
                        map.insert(b.block_hash.0, path.clone());
                    }
                }
            }
            KvCacheEventData::Removed(data) => {
                if let Some(map) = self.workers.get_mut(&worker) {
                    for h in &data.block_hashes {
                        map.remove(&h.0);
                    }
                }
            }
            KvCacheEventData::Cleared => {
                if let Some(map) = self.workers.get_mut(&worker) {
                    map.clear();
                }
            }
        }
    }

    fn scores(&self, query: &[u64]) -> Vec<(WorkerWithDpRank, u32)> {
        let mut out = Vec::new();
        for (&worker, map) in &self.workers {
            let held: BTreeSet<&Vec<u64>> = map.values().collect();
            let score =
                (1..=query.len()).take_while(|&k| held.contains(&query[..k].to_vec())).count();
            if score > 0 {
                out.push((worker, score as u32));
            }
        }
        out
    }

    fn tree_size(&self, worker: WorkerWithDpRank) -> usize {
        self.workers.get(&worker).map_or(0, |m| m.values().collect::<BTreeSet<_>>().len())
    }
}

#[derive(Clone, Debug)]
enum Op {
    Event(RouterEvent),
    RemoveWorker(u64),
    ClearAll(u64),
}

fn arb_worker() -> impl Strategy<Value = WorkerWithDpRank> {
    (0u64..3, 0u32..2)
        .prop_map(|(id, dp)| WorkerWithDpRank { worker_id: WorkerId(id), dp_rank: DpRank(dp) })
}

fn arb_op() -> impl Strategy<Value = Op> {
    let block = (0u64..20, 0u64..3);
    let stored =
        (arb_worker(), prop::option::weighted(0.6, 0u64..20), prop::collection::vec(block, 1..6))
            .prop_map(|(wk, parent, blocks)| Op::Event(stored(wk, parent, &blocks)));
    let removed = (arb_worker(), prop::collection::vec(0u64..20, 1..5))
        .prop_map(|(wk, hashes)| Op::Event(removed(wk, &hashes)));
    prop_oneof![
        6 => stored,
        3 => removed,
        1 => arb_worker().prop_map(|wk| Op::Event(event(wk, KvCacheEventData::Cleared))),
        1 => (0u64..3).prop_map(Op::RemoveWorker),
        1 => (0u64..3).prop_map(Op::ClearAll),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn index_matches_naive_model(ops in prop::collection::vec(arb_op(), 1..60), extra in 0u64..3) {
        let mut index = RadixIndex::new();
        let mut model = Model::default();
        for op in &ops {
            match op {
                Op::Event(e) => {
                    let _ = index.apply_event(e);
                    model.apply(e);
                }
                Op::RemoveWorker(id) => {
                    index.remove_worker(WorkerId(*id));
                    model.workers.retain(|w, _| w.worker_id.0 != *id);
                }
                Op::ClearAll(id) => {
                    index.clear_all_blocks(WorkerId(*id));
                    for (_, map) in model.workers.iter_mut().filter(|(w, _)| w.worker_id.0 == *id) {
                        map.clear();
                    }
                }
            }
            check_invariants(&index);
        }
        let mut queries: BTreeSet<Vec<u64>> = model.workers.values().flat_map(|m| m.values().cloned()).collect();
        queries.extend(queries.clone().into_iter().map(|mut p| { p.push(extra); p }));
        queries.insert(vec![extra, extra, extra]);
        let replayed = replay(&index);
        for query in &queries {
            let expected = model.scores(query);
            let got = index.find_matches(&q(query));
            prop_assert_eq!(&got.scores, &expected, "query {:?}", query);
            for &(worker, _) in &expected {
                prop_assert_eq!(got.tree_size(worker), Some(model.tree_size(worker)));
            }
            prop_assert_eq!(&replayed.find_matches(&q(query)), &got, "replayed, query {:?}", query);
        }
        for (&worker, blocks) in &model.workers {
            prop_assert_eq!(index.tree_size(worker), model.tree_size(worker));
            prop_assert_eq!(replayed.tree_size(worker), model.tree_size(worker));
            for (&ext, path) in blocks {
                let want = crate::hash::sequence_hashes(&q(path)).last().copied();
                prop_assert_eq!(index.sequence_hash(worker, ExternalBlockHash(ext)), want);
            }
        }
    }
}

#[test]
fn prefixes_of_one_document_share_its_node() {
    // A document of 64 blocks, held to a different depth by each of 40 workers (tail eviction
    // leaves prefixes): one node, and each worker scores what it holds.
    let mut index = RadixIndex::new();
    let doc: Vec<u64> = (1..=64).collect();
    for k in 0..40u64 {
        let len = 64 - (k as usize * 37) % 60;
        store_chain(&mut index, w(k), 1000 * (k + 1), &doc[..len]);
    }
    assert_eq!(index.stats().nodes, 1, "{:?}", index.stats());
    let scores = index.find_matches(&q(&doc));
    assert_eq!(scores.scores.len(), 40);
    for k in 0..40u64 {
        assert_eq!(scores.score(w(k)), (64 - (k as usize * 37) % 60) as u32, "worker {k}");
    }
    // A query that leaves the document after 10 blocks caps everyone at 10.
    let mut early = doc[..10].to_vec();
    early.push(999);
    let capped = index.find_matches(&q(&early));
    for k in 0..40u64 {
        assert_eq!(capped.score(w(k)), (64 - (k as usize * 37) % 60).min(10) as u32);
    }
    // A hole in the middle of what worker 0 holds cuts the node there, and only there.
    index.apply_event(&removed(w(0), &[1000 + 20])).unwrap();
    check_invariants(&index);
    assert_eq!(index.find_matches(&q(&doc)).score(w(0)), 20);
    assert_eq!(index.stats().nodes, 2);
    // Evicting every worker's tail, leaves first, frees the tree.
    for k in 0..40u64 {
        let len = 64 - (k as usize * 37) % 60;
        let hashes: Vec<u64> = (0..len as u64).rev().map(|i| 1000 * (k + 1) + i).collect();
        let _ = index.apply_event(&removed(w(k), &hashes));
        check_invariants(&index);
    }
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.nodes, stats.held_blocks), (0, 0, 0));
}

#[test]
fn a_worker_that_extends_a_shared_leaf_leaves_the_others_a_prefix() {
    let mut index = RadixIndex::new();
    store_chain(&mut index, w(1), 100, &[1, 2, 3]);
    store_chain(&mut index, w(2), 200, &[1, 2, 3]);
    // Worker 1 grows the leaf both hold; worker 2 then diverges from it at the same place.
    index.apply_event(&stored(w(1), Some(102), &[(103, 4), (104, 5)])).unwrap();
    check_invariants(&index);
    assert_eq!(index.stats().nodes, 1);
    index.apply_event(&stored(w(2), Some(202), &[(203, 9)])).unwrap();
    check_invariants(&index);
    let scores = index.find_matches(&q(&[1, 2, 3, 4, 5]));
    assert_eq!(scores.scores, vec![(w(1), 5), (w(2), 3)]);
    assert_eq!(index.find_matches(&q(&[1, 2, 3, 9])).scores, vec![(w(1), 3), (w(2), 4)]);
}

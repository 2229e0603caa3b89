use super::*;
use crate::protocols::{KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData};

fn w(k: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(k, 0u32)
}

/// Block `i` of the query has content `i + 100`; engine hashes are `i + base`.
fn query(n: u64) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
    let local: Vec<LocalBlockHash> = (0..n).map(|i| LocalBlockHash(i + 100)).collect();
    let seqs = crate::hash::sequence_hashes(&local);
    (local, seqs)
}

fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalBlockHash),
        blocks: blocks
            .iter()
            .map(|&(ext, i)| KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(ext),
                tokens_hash: LocalBlockHash(i + 100),
                mm_extra_info: None,
            })
            .collect(),
    })
}

fn none(_: ExternalBlockHash) -> Option<SequenceHash> {
    None
}

const WINDOW_8: Option<GroupKind> = Some(GroupKind::SlidingWindow { window: 8 });

#[test]
fn a_window_group_needs_the_blocks_before_the_hits_end() {
    let (local, seqs) = query(6);
    let mut g = HybridGroups::new();
    // Window 8 tokens, blocks of 4: two blocks must end the hit. The group holds 2 and 3
    // (announced without a parent: placed by content).
    g.apply(w(1), 1, WINDOW_8, &stored(None, &[(502, 2), (503, 3)]), none).unwrap();
    let hit = |g: &HybridGroups, device, max| g.hit(w(1), device, (&local, &seqs), max, 4);
    assert_eq!(hit(&g, 6, 6), 4, "blocks 2 and 3 end a hit of 4");
    assert_eq!(
        hit(&g, 6, 3),
        0,
        "capped at 3 blocks, only block 2 is there: no window, no run from 0"
    );
    assert_eq!(hit(&g, 2, 6), 0, "a device prefix of 2 leaves no window inside it");
    // A worker that is not hybrid keeps its device prefix.
    assert_eq!(g.hit(w(2), 5, (&local, &seqs), 6, 4), 5);
    assert!(g.is_hybrid(w(1)) && !g.is_hybrid(w(2)));
    // The run from block 0, shorter than the window, is a hit too.
    g.apply(w(1), 1, None, &stored(None, &[(500, 0)]), none).unwrap();
    assert_eq!(hit(&g, 6, 2), 1);
    g.apply(
        w(1),
        1,
        None,
        &KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalBlockHash(503)],
        }),
        none,
    )
    .unwrap();
    assert_eq!(hit(&g, 6, 6), 1, "3 gone: only the run from 0 is left");
    assert_eq!(g.held_blocks(), 2);
}

#[test]
fn a_mamba_group_ends_the_hit_at_its_last_checkpoint() {
    let (local, seqs) = query(8);
    let mut g = HybridGroups::new();
    // Its blocks share the first group's engine hashes (as vLLM's do): placed by the device.
    let device = |h: ExternalBlockHash| (h.0 < 8).then(|| seqs[h.0 as usize]);
    g.apply(w(1), 1, Some(GroupKind::Mamba), &stored(Some(2), &[(3, 3)]), device).unwrap();
    g.apply(w(1), 1, None, &stored(Some(6), &[(7, 7)]), device).unwrap();
    let hit = |device, max| g.hit(w(1), device, (&local, &seqs), max, 4);
    assert_eq!(hit(8, 8), 8);
    assert_eq!(hit(8, 7), 4, "block 7 out of reach: the checkpoint at block 3");
    assert_eq!(hit(3, 8), 0);
    // Another prefix with the same content at block 3 is not this one.
    let other: Vec<LocalBlockHash> = (0..8).map(|i| LocalBlockHash(i + 900)).collect();
    let mut mixed = other;
    mixed[3] = local[3];
    let mixed_seqs = crate::hash::sequence_hashes(&mixed);
    assert_eq!(g.hit(w(1), 8, (&mixed, &mixed_seqs), 7, 4), 0);
}

#[test]
fn groups_keep_their_engine_hashes_apart_and_leave_with_their_worker() {
    let (local, seqs) = query(4);
    let mut g = HybridGroups::new();
    g.apply(w(1), 1, WINDOW_8, &stored(None, &[(7, 2), (8, 3)]), none).unwrap();
    g.apply(w(1), 2, Some(GroupKind::Mamba), &stored(None, &[(7, 3)]), none).unwrap();
    // Removing hash 7 from group 2 leaves group 1's block 7.
    let gone =
        KvCacheEventData::Removed(KvCacheRemoveData { block_hashes: vec![ExternalBlockHash(7)] });
    g.apply(w(1), 2, None, &gone, none).unwrap();
    assert_eq!(g.held_blocks(), 2);
    // With the Mamba group empty, nothing can be served.
    assert_eq!(g.hit(w(1), 4, (&local, &seqs), 4, 4), 0);
    let unknown = g.apply(w(1), 1, None, &stored(Some(99), &[(9, 1)]), none);
    assert!(unknown.is_err());
    g.remove_worker(WorkerId(1));
    assert!(g.is_empty());
    assert_eq!(g.held_blocks(), 0);
}

#[test]
fn hostile_group_numbers_are_bounded() {
    let mut g = HybridGroups::new();
    // Removals for groups nobody stored create nothing.
    for k in 1..1000 {
        let gone = KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: vec![ExternalBlockHash(k)],
        });
        g.apply(w(1), k as u32, None, &gone, none).unwrap();
    }
    assert!(g.is_empty());
    // Stores past MAX_GROUPS groups are refused and counted.
    for k in 1..100u32 {
        g.apply(w(1), k, WINDOW_8, &stored(None, &[(u64::from(k), 0)]), none).unwrap();
    }
    assert_eq!(g.held_blocks(), MAX_GROUPS);
    assert_eq!(g.refused, 99 - MAX_GROUPS as u64);
}

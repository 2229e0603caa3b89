use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::protocols::{KvCacheRemoveData, KvCacheStoreData, LocalBlockHash};

fn w(k: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(k, 0u32)
}

/// Blocks named `ext` (engine hashes) with content hashes `ext + 1000`.
fn stored(parent: Option<u64>, ext: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalBlockHash),
        blocks: ext
            .iter()
            .map(|&h| KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(h),
                tokens_hash: LocalBlockHash(h + 1000),
                mm_extra_info: None,
            })
            .collect(),
    })
}

fn removed(ext: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: ext.iter().copied().map(ExternalBlockHash).collect(),
    })
}

/// The sequence hashes of blocks `ext[0..]` chained from the root.
fn seqs(ext: &[u64]) -> Vec<SequenceHash> {
    let local: Vec<LocalBlockHash> = ext.iter().map(|&h| LocalBlockHash(h + 1000)).collect();
    crate::hash::sequence_hashes(&local)
}

fn none(_: ExternalBlockHash) -> Option<SequenceHash> {
    None
}

const HOST: StorageTier = StorageTier::HostPinned;
const DISK: StorageTier = StorageTier::Disk;
const EXT: StorageTier = StorageTier::External;

#[test]
fn a_run_continues_from_the_device_prefix_through_the_cheapest_tier() {
    let mut t = LowerTiers::new();
    let q = seqs(&[1, 2, 3, 4, 5, 6]);
    t.apply(w(1), HOST, &stored(None, &[1, 2, 3]), none).unwrap();
    t.apply(w(1), DISK, &stored(None, &[1, 2, 3, 4]), none).unwrap();
    // From the root: 3 from host, then 1 from disk, then nothing holds block 5.
    assert_eq!(t.find(&q, |_| 0).run(w(1), 0), [3, 1, 0]);
    // After a 2-block device prefix: 1 from host, 1 from disk.
    assert_eq!(t.find(&q, |_| 2).run(w(1), 2), [1, 1, 0]);
    // Another worker has nothing below its device.
    assert_eq!(t.find(&q, |_| 0).run(w(2), 0), [0, 0, 0]);
}

#[test]
fn an_offloaded_block_resolves_its_parent_on_the_device_or_among_removed_blocks() {
    let mut t = LowerTiers::new();
    let q = seqs(&[1, 2, 3, 4]);
    // Block 2's parent 1 is on the device only.
    let device = |h: ExternalBlockHash| (h == ExternalBlockHash(1)).then(|| q[0]);
    t.apply(w(1), HOST, &stored(Some(1), &[2]), device).unwrap();
    assert_eq!(t.find(&q, |_| 1).run(w(1), 1), [1, 0, 0]);
    // Removed from the host, block 2 is still known as a parent.
    t.apply(w(1), HOST, &removed(&[2]), none).unwrap();
    t.apply(w(1), DISK, &stored(Some(2), &[3]), none).unwrap();
    assert_eq!(t.sequence_of(w(1), ExternalBlockHash(3)), Some(q[2]));
    // A gap at block 2 ends the run: block 3 on disk is not reachable.
    assert_eq!(t.find(&q, |_| 1).run(w(1), 1), [0, 0, 0]);
    // A parent nobody knows is refused and counted.
    let err = t.apply(w(1), HOST, &stored(Some(99), &[5]), none);
    assert!(err.is_err());
    assert_eq!(t.rejected_unknown_parent, 1);
}

#[test]
fn the_shared_store_serves_every_worker_after_its_own_prefix() {
    let mut t = LowerTiers::new();
    let q = seqs(&[1, 2, 3]);
    t.apply(w(9), EXT, &stored(None, &[1, 2, 3]), none).unwrap();
    let found = t.find(&q, |_| 0);
    assert_eq!(found.run(w(1), 0), [0, 0, 3]);
    assert_eq!(found.run(w(2), 2), [0, 0, 1]);
    // A worker with a host tier of its own takes its own blocks first.
    t.apply(w(1), HOST, &stored(None, &[1]), none).unwrap();
    assert_eq!(t.find(&q, |_| 0).run(w(1), 0), [1, 0, 2]);
    t.apply(w(9), EXT, &removed(&[1, 2, 3]), none).unwrap();
    assert_eq!(t.find(&q, |_| 0).run(w(2), 0), [0, 0, 0]);
    assert_eq!(t.held_blocks(), 1);
}

#[test]
fn eviction_drops_the_oldest_blocks_and_restarts_forget_host_memory() {
    let mut t = LowerTiers::new();
    t.apply(w(1), HOST, &stored(None, &[1, 2, 3]), none).unwrap();
    t.apply(w(1), DISK, &stored(None, &[1, 2, 3]), none).unwrap();
    assert_eq!(t.held_blocks(), 6);
    assert_eq!(t.evict_oldest(4), 2);
    let q = seqs(&[1, 2, 3]);
    // Host blocks 1 and 2 went first: they come from disk, block 3 still from the host.
    assert_eq!(t.find(&q, |_| 0).run(w(1), 0), [1, 2, 0]);
    t.clear_worker(WorkerId(1), &[HOST]);
    assert_eq!(t.find(&q, |_| 0).run(w(1), 0), [0, 3, 0]);
    assert_eq!(t.sizes(), vec![(w(1), [0, 3, 0])]);
    t.remove_worker(WorkerId(1));
    assert!(t.is_empty());
    assert!(t.sizes().is_empty());
}

/// One operation of the property test: a worker (0..3) stores a chain of blocks (content
/// `id + 1000`, engine hash `id`) from the root, or removes some, in a tier.
#[derive(Clone, Debug)]
enum Op {
    Store { worker: u64, tier: usize, len: u64 },
    Remove { worker: u64, tier: usize, ids: Vec<u64> },
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        (0..3u64, 0..3usize, 1..8u64).prop_map(|(worker, tier, len)| Op::Store {
            worker,
            tier,
            len
        }),
        (0..3u64, 0..3usize, prop::collection::vec(1..9u64, 1..4))
            .prop_map(|(worker, tier, ids)| Op::Remove { worker, tier, ids }),
    ];
    prop::collection::vec(op, 1..40)
}

type Model = BTreeMap<(u64, usize), BTreeSet<u64>>;

fn apply_both(t: &mut LowerTiers, model: &mut Model, op: &Op) {
    match op {
        Op::Store { worker, tier, len } => {
            let ids: Vec<u64> = (1..=*len).collect();
            let tier_of = StorageTier::LOWER[*tier];
            t.apply(w(*worker), tier_of, &stored(None, &ids), none).unwrap();
            model.entry((*worker, *tier)).or_default().extend(ids);
        }
        Op::Remove { worker, tier, ids } => {
            t.apply(w(*worker), StorageTier::LOWER[*tier], &removed(ids), none).unwrap();
            let set = model.entry((*worker, *tier)).or_default();
            for id in ids {
                set.remove(id);
            }
        }
    }
}

/// The naive run: from block `device + 1` on, each block from the worker's host, else its
/// disk, else anyone's external copy; the first block held nowhere ends it.
fn naive_run(model: &Model, worker: u64, device: u32) -> TierRun {
    let has =
        |who: u64, tier: usize, id: u64| model.get(&(who, tier)).is_some_and(|s| s.contains(&id));
    let mut want = [0u32; 3];
    for id in (u64::from(device) + 1)..=8 {
        let tier = match () {
            () if has(worker, 0, id) => 0,
            () if has(worker, 1, id) => 1,
            () if (0..3).any(|o| has(o, 2, id)) => 2,
            () => break,
        };
        want[tier] += 1;
    }
    want
}

proptest! {
    /// Against a naive model (per worker and tier, the set of block ids held): every run and
    /// the held count.
    #[test]
    fn runs_match_a_naive_model(ops in ops(), device in 0..4u32) {
        let mut t = LowerTiers::new();
        let mut model = Model::new();
        for op in &ops {
            apply_both(&mut t, &mut model, op);
        }
        let held: usize = model.values().map(BTreeSet::len).sum();
        prop_assert_eq!(t.held_blocks(), held);
        let q = seqs(&(1..=8).collect::<Vec<_>>());
        let found = t.find(&q, |_| device);
        for worker in 0..4u64 {
            prop_assert_eq!(found.run(w(worker), device), naive_run(&model, worker, device));
        }
    }
}

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn bs(n: u32) -> BlockSize {
    BlockSize::new(n).unwrap()
}

fn request(objects: &[(u64, &[(usize, usize)])]) -> RequestExtraInfo {
    RequestExtraInfo {
        mm_objects: objects
            .iter()
            .map(|&(mm_hash, offsets)| RequestMmObjectInfo { mm_hash, offsets: offsets.to_vec() })
            .collect(),
    }
}

fn objects(block: &Option<BlockExtraInfo>) -> Vec<(u64, Vec<(usize, usize)>)> {
    block.iter().flat_map(|b| b.mm_objects.iter().map(|o| (o.mm_hash, o.offsets.clone()))).collect()
}

#[test]
fn block_size_zero_is_refused() {
    assert_eq!(BlockSize::new(0), Err(Error::ZeroBlockSize));
    assert!(serde_json::from_str::<BlockSize>("0").is_err());
    assert_eq!(serde_json::from_str::<BlockSize>("16").unwrap(), BlockSize::default());
}

#[test]
fn image_spanning_blocks_is_cut_at_boundaries() {
    let blocks = request(&[(5, &[(3, 13)])]).to_block_level(bs(4), 14);
    assert_eq!(blocks.len(), 4, "three full blocks and a partial one");
    assert_eq!(objects(&blocks[0]), vec![(5, vec![(3, 4)])]);
    assert_eq!(objects(&blocks[1]), vec![(5, vec![(0, 4)])]);
    assert_eq!(objects(&blocks[2]), vec![(5, vec![(0, 4)])]);
    assert_eq!(objects(&blocks[3]), vec![(5, vec![(0, 1)])]);
}

#[test]
fn two_images_in_one_block_and_same_image_twice_merges() {
    let blocks = request(&[(1, &[(0, 2), (6, 7)]), (2, &[(2, 4)])]).to_block_level(bs(4), 8);
    assert_eq!(objects(&blocks[0]), vec![(1, vec![(0, 2)]), (2, vec![(2, 4)])]);
    assert_eq!(objects(&blocks[1]), vec![(1, vec![(2, 3)])]);
    let merged = request(&[(1, &[(0, 1), (2, 3)])]).to_block_level(bs(4), 4);
    assert_eq!(objects(&merged[0]), vec![(1, vec![(0, 1), (2, 3)])]);
}

#[test]
fn degenerate_inputs_do_not_panic() {
    assert!(request(&[(1, &[(0, 4)])]).to_block_level(bs(4), 0).is_empty());
    let empty_and_reversed = request(&[(1, &[(2, 2), (3, 1)])]).to_block_level(bs(4), 8);
    assert_eq!(empty_and_reversed, vec![None, None]);
    let past_end = request(&[(1, &[(6, 100)]), (2, &[(50, 60)])]).to_block_level(bs(4), 8);
    assert_eq!(objects(&past_end[1]), vec![(1, vec![(2, 4)])]);
    assert!(past_end[0].is_none());
    let huge = request(&[(1, &[(usize::MAX - 1, usize::MAX)])]).to_block_level(bs(4), 8);
    assert_eq!(huge, vec![None, None]);
}

#[test]
fn events_round_trip_in_dynamos_json_shape() {
    let stored = r#"{"event_id":1,"data":{"stored":{"parent_hash":null,"blocks":[{"block_hash":2,"tokens_hash":3,"mm_extra_info":null}]}},"dp_rank":0}"#;
    let event: KvCacheEvent = serde_json::from_str(stored).unwrap();
    assert_eq!(
        event.data,
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: None,
            blocks: vec![KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(2),
                tokens_hash: LocalBlockHash(3),
                mm_extra_info: None,
            }],
        })
    );
    assert_eq!(serde_json::to_string(&event).unwrap(), stored);

    let removed =
        r#"{"event_id":2,"data":{"removed":{"block_hashes":[18446744073709551615]}},"dp_rank":3}"#;
    let event: KvCacheEvent = serde_json::from_str(removed).unwrap();
    assert_eq!(event.dp_rank, DpRank(3));
    assert_eq!(serde_json::to_string(&event).unwrap(), removed);

    let cleared = r#"{"worker_id":7,"event":{"event_id":3,"data":"cleared"}}"#;
    let event: RouterEvent = serde_json::from_str(cleared).unwrap();
    assert_eq!(event.worker(), WorkerWithDpRank::new(7u64, 0u32));
    assert_eq!(
        serde_json::to_string(&event).unwrap(),
        r#"{"worker_id":7,"event":{"event_id":3,"data":"cleared","dp_rank":0}}"#
    );

    // A tier below the device: in the event (kvroute's shape) or beside it (Dynamo's).
    let ours = r#"{"worker_id":7,"event":{"event_id":4,"data":"cleared","dp_rank":0,"storage_tier":"host_pinned"}}"#;
    let event: RouterEvent = serde_json::from_str(ours).unwrap();
    assert_eq!(event.event.storage_tier, StorageTier::HostPinned);
    assert_eq!(serde_json::to_string(&event).unwrap(), ours);
    let dynamos =
        r#"{"worker_id":7,"storage_tier":"disk","event":{"event_id":4,"data":"cleared"}}"#;
    let event: RouterEvent = serde_json::from_str(dynamos).unwrap();
    assert_eq!(event.event.storage_tier, StorageTier::Disk);
    assert_eq!(StorageTier::from_medium(Some("NVME"), None), Some(StorageTier::Disk));
    assert_eq!(StorageTier::from_medium(Some("GPU"), Some("REMOTE")), Some(StorageTier::External));
    assert_eq!(StorageTier::from_medium(None, None), Some(StorageTier::Device));
    assert_eq!(StorageTier::from_medium(Some("XPU"), None), None);
}

#[test]
fn stored_block_with_image_and_unknown_keys() {
    let json = r#"{"parent_hash":9,"lora_id":null,"blocks":[{"block_hash":1,"tokens_hash":2,
        "mm_extra_info":{"mm_objects":[{"mm_hash":3735928559,"offsets":[[0,32]]}]}}]}"#;
    let data: KvCacheStoreData = serde_json::from_str(json).unwrap();
    let info = data.blocks[0].mm_extra_info.as_ref().unwrap();
    assert_eq!(info.mm_objects[0].mm_hash, 0xdead_beef);
    assert_eq!(info.mm_objects[0].offsets, vec![(0, 32)]);
    assert!(serde_json::from_str::<KvCacheStoreData>(r#"{"parent_hash":-1,"blocks":[]}"#).is_err());
}

fn arb_request() -> impl Strategy<Value = (RequestExtraInfo, usize, u32)> {
    let object = (0u64..6, prop::collection::vec((0usize..140, 0usize..140), 0..4));
    (prop::collection::vec(object, 0..5), 0usize..130, 1u32..20).prop_map(|(objs, total, bs)| {
        let info = RequestExtraInfo {
            mm_objects: objs
                .into_iter()
                .map(|(mm_hash, offsets)| RequestMmObjectInfo { mm_hash, offsets })
                .collect(),
        };
        (info, total, bs)
    })
}

proptest! {
    /// Against a token-by-token model: block `b` holds exactly the images whose clipped ranges
    /// cover some token of `b`, and every covered token is covered by a block-local range.
    #[test]
    fn to_block_level_matches_token_model((info, total, bs_tokens) in arb_request()) {
        let size = bs(bs_tokens);
        let bs_tokens = bs_tokens as usize;
        let blocks = info.to_block_level(size, total);
        prop_assert_eq!(blocks.len(), total.div_ceil(bs_tokens));

        for (b, block) in blocks.iter().enumerate() {
            let block_start = b * bs_tokens;
            let block_end = (block_start + bs_tokens).min(total);
            let mut expected: BTreeSet<(u64, usize)> = BTreeSet::new();
            for object in &info.mm_objects {
                for &(s, e) in &object.offsets {
                    for t in s.max(block_start)..e.min(block_end) {
                        expected.insert((object.mm_hash, t));
                    }
                }
            }
            let mut got: BTreeSet<(u64, usize)> = BTreeSet::new();
            let mut hashes = Vec::new();
            for object in block.iter().flat_map(|b| &b.mm_objects) {
                hashes.push(object.mm_hash);
                prop_assert!(!object.offsets.is_empty());
                for &(s, e) in &object.offsets {
                    prop_assert!(s < e && e <= bs_tokens, "offsets {:?} outside block", (s, e));
                    got.extend((s..e).map(|t| (object.mm_hash, block_start + t)));
                }
            }
            prop_assert_eq!(&got, &expected, "tokens covered in block {}", b);
            let distinct: BTreeSet<u64> = hashes.iter().copied().collect();
            prop_assert_eq!(distinct.len(), hashes.len(), "one object per mm_hash per block");
            let expected_hashes: BTreeSet<u64> = expected.iter().map(|&(h, _)| h).collect();
            prop_assert_eq!(distinct, expected_hashes);
            prop_assert_eq!(block.is_none(), expected.is_empty());
        }
    }
}

//! Golden tests against bytes captured from the engines' own publishers
//! (shared/vectors/wire, copied to tests/fixtures; see its README).

#![allow(clippy::unwrap_used)]

use kvroute_core::hash::mm_hash_from_identifier;
use kvroute_core::index::{IndexConfig, ShardedIndex};
use kvroute_core::{
    BlockHasher, BlockSize, ExternalBlockHash, KvCacheEvent, KvCacheEventData, LocalBlockHash,
    RequestExtraInfo, RequestMmObjectInfo,
};
use kvroute_core::{RouterEvent, StorageTier, WorkerWithDpRank};
use kvroute_wire::vllm::{decode_batch, encode_batch, split_frames};
use kvroute_wire::{ConvertConfig, Converter, EngineEvent, EventFormat, Pipeline, trtllm};
use serde_json::Value;

fn fixture(name: &str) -> Vec<Vec<Vec<u8>>> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let messages: Vec<Vec<String>> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    messages.iter().map(|frames| frames.iter().map(|hex| unhex(hex)).collect()).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn expected() -> Value {
    let path = format!("{}/tests/fixtures/expected_decoded.json", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn captured_fixtures_decode_to_the_expected_events() {
    let expected = expected();
    let files = expected.as_object().unwrap();
    assert_eq!(files.len(), 3);
    for (name, batches) in files {
        let messages = fixture(name);
        let batches = batches.as_array().unwrap();
        assert_eq!(messages.len(), batches.len(), "{name}");
        for (frames, want) in messages.iter().zip(batches) {
            let (topic, seq, payload) = split_frames(frames).unwrap();
            let batch = decode_batch(payload).unwrap();
            assert_eq!(String::from_utf8_lossy(topic), want["topic"].as_str().unwrap(), "{name}");
            assert_eq!(seq, want["seq"].as_u64().unwrap(), "{name}");
            assert_eq!(batch.ts, want["ts"].as_f64().unwrap(), "{name}");
            assert_eq!(u64::from(batch.dp_rank.unwrap()), want["dp_rank"].as_u64().unwrap());
            let got = serde_json::to_value(&batch.events).unwrap();
            assert_eq!(&got, &want["events"], "{name} seq {seq}");
        }
    }
}

#[test]
fn map_form_reencodes_byte_for_byte() {
    for frames in fixture("fixture_vllm033.json") {
        let payload = &frames[2];
        assert_eq!(&encode_batch(&decode_batch(payload).unwrap()), payload);
    }
}

fn vllm_converter(block_size: u32) -> Converter {
    Converter::new(ConvertConfig::new(BlockSize::new(block_size).unwrap()))
}

#[test]
fn vllm_image_blocks_hash_with_the_image() {
    let frames = &fixture("fixture_vllm033.json")[0];
    let batch = decode_batch(&frames[2]).unwrap();
    let mut converter = vllm_converter(4);
    let events = converter.vllm_batch(&batch, 0);
    assert_eq!(events.len(), 4);
    let hasher = BlockHasher::new(BlockSize::new(4).unwrap());
    let KvCacheEventData::Stored(first) = &events[0].data else { panic!("stored") };
    assert_eq!(first.parent_hash, None);
    assert_eq!(first.blocks[0].block_hash, ExternalBlockHash(0x1234_5678_90AB_CDEF));
    assert_eq!(first.blocks[1].tokens_hash, hasher.hash_block(&[5, 6, 7, 8], None));
    let KvCacheEventData::Stored(image) = &events[1].data else { panic!("stored") };
    assert_eq!(image.parent_hash, Some(ExternalBlockHash(0xFEDC_BA09_8765_4321)));
    let info = image.blocks[0].mm_extra_info.as_ref().unwrap();
    assert_eq!(info.mm_objects[0].mm_hash, mm_hash_from_identifier("abc123mmhash"));
    assert_eq!(image.blocks[0].tokens_hash, hasher.hash_block(&[9, 10, 11, 12], Some(info)));
    assert_ne!(image.blocks[0].tokens_hash, hasher.hash_block(&[9, 10, 11, 12], None));
    assert!(matches!(events[2].data, KvCacheEventData::Removed(_)));
    assert!(matches!(events[3].data, KvCacheEventData::Cleared));
    // The older array form says the same things.
    let old = decode_batch(&fixture("fixture_vllm023.json")[0][2]).unwrap();
    let events = vllm_converter(4).vllm_batch(&old, 7);
    assert_eq!(events.len(), 4);
    assert!(events.iter().all(|e| e.event_id == 7));
}

#[test]
fn sglang_signed_hashes_and_cache_salt() {
    let batch = decode_batch(&fixture("fixture_sglang0523.json")[0][2]).unwrap();
    let events = vllm_converter(4).vllm_batch(&batch, 0);
    let KvCacheEventData::Stored(salted) = &events[1].data else { panic!("stored") };
    assert_eq!(salted.parent_hash, Some(ExternalBlockHash(-5_210_000_000_000_000_000i64 as u64)));
    let plain = BlockHasher::new(BlockSize::new(4).unwrap());
    assert_eq!(
        salted.blocks[0].tokens_hash,
        plain.with_namespace(Some("salt1")).hash_block(&[5, 6, 7, 8], None)
    );
    assert_ne!(salted.blocks[0].tokens_hash, plain.hash_block(&[5, 6, 7, 8], None));
}

#[test]
fn wrong_block_size_medium_and_group_are_counted_and_skipped() {
    let batch = decode_batch(&fixture("fixture_vllm033.json")[0][2]).unwrap();
    let mut c = vllm_converter(16);
    let events = c.vllm_batch(&batch, 0);
    assert_eq!(events.len(), 2, "only the removal and the clear remain");
    assert_eq!(c.stats().wrong_block_size, 3);
    let mut cpu = batch.clone();
    for e in &mut cpu.events {
        if let EngineEvent::BlockStored(s) = e {
            s.medium = Some("XPU".into()); // a medium no engine defines
        }
        if let EngineEvent::BlockRemoved(r) = e {
            // A hybrid group's blocks below the device are not modelled.
            r.group_idx = Some(1);
            r.medium = Some("CPU".into());
        }
    }
    let mut c = vllm_converter(4);
    assert_eq!(c.vllm_batch(&cpu, 0).len(), 1);
    assert_eq!((c.stats().skipped_medium, c.stats().skipped_group), (3, 1));
}

/// vLLM 0.33's own publisher, with tiers (see the fixtures' README): after each batch, what
/// the router says worker 1 can serve of the prompt of tokens 100..115 (four blocks of 4).
#[test]
fn vllm_tiers_fixture_gives_what_the_engine_can_reuse() {
    let index = ShardedIndex::new(1, IndexConfig::default());
    let worker = WorkerWithDpRank::new(1u64, 0u32);
    let mut c = vllm_converter(4);
    let hasher = BlockHasher::new(BlockSize::new(4).unwrap());
    let prompt: Vec<u32> = (100..116).collect();
    let query = hasher.local_hashes(&prompt, None);
    // (device blocks, [host, disk, external]) after each of the six batches.
    let want = [(4, [0, 0, 0]), (0, [2, 0, 0]), (0, [2, 0, 0]), (0, [2, 0, 0]), (0, [2, 0, 0])];
    let messages = fixture("fixture_vllm033_tiers.json");
    assert_eq!(messages.len(), 6);
    // What the hybrid model's groups let a prompt of these tokens reuse (vLLM's coordinator),
    // checked after the batch that announces its group: (batch, tokens, tokens served).
    let hybrid: [(usize, std::ops::Range<u32>, u32); 4] =
        [(2, 200..220, 16), (2, 200..216, 0), (3, 300..320, 16), (3, 300..316, 0)];
    for (i, frames) in messages.iter().enumerate() {
        let (_, seq, payload) = split_frames(frames).unwrap();
        let events = c.vllm_batch(&decode_batch(payload).unwrap(), seq);
        for e in events {
            index.apply_event(&RouterEvent::new(1u64, e)).unwrap();
        }
        for (_, tokens, served) in hybrid.iter().filter(|(b, ..)| *b == i) {
            let prompt: Vec<u32> = tokens.clone().collect();
            let q = hasher.local_hashes(&prompt, None);
            let max = (prompt.len() - 1) / 4;
            let got = index.find_matches_within(&q, max, 4).score(worker) * 4;
            assert_eq!(got, *served, "after batch {i}, prompt {tokens:?}");
            // Its first group alone holds every block.
            assert_eq!(index.find_matches(&q).score(worker), 4, "{tokens:?}");
        }
        let found = index.find_matches(&query);
        let device = found.score(worker);
        let run = found.tiers.as_ref().map_or([0; 3], |t| t.run(worker, device));
        let (want_device, want_run) = *want.get(i).unwrap_or(&(0, [1, 0, 0]));
        assert_eq!((device, run), (want_device, want_run), "after batch {i}");
    }
    // Batch 6 left 1001 on the host (and disk) and 1003-1004 in the remote store: a gap at
    // 1002 ends the run after one host block, as vLLM's lookup stops there.
    let sizes = index.lower_tier_sizes();
    assert_eq!(sizes, vec![(worker, [1, 1, 2])]);
    // The hybrid model's other groups are kept (none skipped).
    assert_eq!(c.stats().skipped_group, 0);
    assert_eq!(c.stats().lower_tier, 2 + 1 + 1 + 2);
    assert!(StorageTier::from_medium(Some("CPU_PINNED"), None) == Some(StorageTier::HostPinned));
}

/// Qwen2-VL: vocabulary 151936, image pad 151655; TensorRT-LLM writes 151937 at image tokens.
const IMAGE_PAD: u32 = 151_655;

#[test]
fn trtllm_image_blocks_hash_like_the_front_door() {
    let path =
        format!("{}/tests/fixtures/fixture_trtllm_constructed.json", env!("CARGO_MANIFEST_DIR"));
    let events = trtllm::decode_json(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(events.len(), 5);
    let config = ConvertConfig {
        block_size: BlockSize::new(4).unwrap(),
        image_token_id: Some(IMAGE_PAD),
        vocab_size: Some(151_936),
    };
    let mut c = Converter::new(config);
    let converted: Vec<Vec<KvCacheEvent>> = events
        .iter()
        .map(|e| {
            let mut out = Vec::new();
            c.trtllm_event(e, &mut out);
            out
        })
        .collect();
    assert!(converted[0].is_empty(), "created touches nothing");
    assert_eq!(c.stats().other_events, 1);

    // What the front door computes for the same sequence: image 5f5f.. over tokens 4..10.
    let tokens: Vec<u32> = [1, 2, 3, 4].into_iter().chain([IMAGE_PAD; 6]).chain([7, 8]).collect();
    let image = mm_hash_from_identifier(&"5f".repeat(32));
    let request = RequestExtraInfo {
        mm_objects: vec![RequestMmObjectInfo { mm_hash: image, offsets: vec![(4, 10)] }],
    };
    let hasher = BlockHasher::new(config.block_size);
    let front_door: Vec<LocalBlockHash> = hasher
        .local_hashes(&tokens, Some(&request.to_block_level(config.block_size, tokens.len())));

    let stored = |i: usize| match &converted[i][0].data {
        KvCacheEventData::Stored(s) => s.clone(),
        other => panic!("{other:?}"),
    };
    let (a, b) = (stored(1), stored(2));
    assert_eq!(b.parent_hash, Some(ExternalBlockHash(9002)));
    let engine: Vec<LocalBlockHash> =
        a.blocks.iter().chain(&b.blocks).map(|x| x.tokens_hash).collect();
    assert_eq!(engine, front_door);
    let info = b.blocks[0].mm_extra_info.as_ref().unwrap();
    assert_eq!(
        (info.mm_objects[0].mm_hash, info.mm_objects[0].offsets.clone()),
        (image, vec![(0, 2)])
    );

    // Offloaded to host memory (level 0 to 1): out of the device, into host memory under the
    // same content hash and parent.
    let moved = &converted[3];
    assert_eq!(moved.len(), 2);
    assert_eq!(moved[0].storage_tier, StorageTier::Device);
    assert!(
        matches!(&moved[0].data, KvCacheEventData::Removed(r) if r.block_hashes == vec![ExternalBlockHash(9001)])
    );
    assert_eq!(moved[1].storage_tier, StorageTier::HostPinned);
    match &moved[1].data {
        KvCacheEventData::Stored(s) => {
            assert_eq!(s.parent_hash, None);
            assert_eq!(s.blocks.len(), 1);
            assert_eq!(s.blocks[0].block_hash, ExternalBlockHash(9001));
            assert_eq!(s.blocks[0].tokens_hash, a.blocks[0].tokens_hash);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().moved, 1);
    assert!(
        matches!(&converted[4][0].data, KvCacheEventData::Removed(r) if r.block_hashes == vec![ExternalBlockHash(9003)])
    );
}

/// TensorRT-LLM moves a block between device and host memory under its hash (`offloadBlock`,
/// `onboardBlock`: an `updated` with the new `cache_level`), and removes it wherever it is.
/// Bytes as its `KVCacheEventSerializer` writes them, through a stream's pipeline into the
/// index: after each message, what worker 1 can serve of the prompt 1..13 (three blocks).
#[test]
fn trtllm_moves_between_levels_follow_the_block() {
    let tokens = |from: u64| {
        let ids: Vec<String> = (from..from + 4)
            .map(|t| format!(r#"{{"type":"unique_token","token_id":{t},"token_extra_id":0}}"#))
            .collect();
        format!("[{}]", ids.join(","))
    };
    let block = |hash: u64, from: u64| {
        format!(
            r#"{{"type":"stored_block","block_hash":{hash},"tokens":{},"cache_level":0,"priority":35}}"#,
            tokens(from)
        )
    };
    let moved = |hash: u64, old: u32, new: u32| {
        format!(
            r#"{{"event_id":0,"data":{{"type":"updated","block_hash":{hash},"cache_level":{{"type":"event_diff","new_value":{new},"old_value":{old}}},"priority":null}},"window_size":32}}"#
        )
    };
    let stored = format!(
        r#"[{{"event_id":1,"data":{{"type":"stored","parent_hash":null,"blocks":[{},{},{}]}},"window_size":32}}]"#,
        block(71, 1),
        block(72, 5),
        block(73, 9)
    );
    let removed = |hash: u64| {
        format!(r#"{{"event_id":9,"data":{{"type":"removed","block_hashes":[{hash}]}}}}"#)
    };
    // (message, device blocks, host run) after it.
    let steps: Vec<(String, u32, u32)> = vec![
        (stored, 3, 0),
        // The leaf goes to host memory, then its parent: a device prefix of 1, then 2 on the host.
        (moved(73, 0, 1), 2, 1),
        (format!("[{}]", moved(72, 0, 1)), 1, 2),
        // Onboarded back in prefix order.
        (format!("[{},{}]", moved(72, 1, 0), moved(73, 1, 0)), 3, 0),
        // Offloaded again, then evicted from host memory: the removal is the host's.
        (moved(73, 0, 1), 2, 1),
        (removed(73), 2, 0),
        // A priority change alone moves nothing; a block never stored is skipped.
        (
            r#"{"event_id":10,"data":{"type":"updated","block_hash":72,"cache_level":null,"priority":{"type":"event_diff","new_value":50,"old_value":35}}}"#.into(),
            2,
            0,
        ),
        (moved(99, 0, 1), 2, 0),
    ];
    let worker = WorkerWithDpRank::new(1u64, 0u32);
    let bs = BlockSize::new(4).unwrap();
    let mut pipeline = Pipeline::new(worker, EventFormat::TrtllmJson, ConvertConfig::new(bs));
    let index = ShardedIndex::new(1, IndexConfig::default());
    let prompt: Vec<u32> = (1..13).collect();
    let query = BlockHasher::new(bs).local_hashes(&prompt, None);
    let mut moves = 0;
    let mut unknown = 0;
    for (i, (message, device, host)) in steps.iter().enumerate() {
        let decoded = pipeline.decode(pipeline.frame(&[message.clone().into_bytes()]).unwrap());
        let decoded = decoded.unwrap();
        (moves, unknown) = (moves + decoded.stats.moved, unknown + decoded.stats.moved_unknown);
        for e in &decoded.events {
            index.apply_event(e).unwrap();
        }
        let found = index.find_matches(&query);
        let on_device = found.score(worker);
        let run = found.tiers.as_ref().map_or([0; 3], |t| t.run(worker, on_device));
        assert_eq!((on_device, run), (*device, [*host, 0, 0]), "after message {i}: {message}");
    }
    assert_eq!((moves, unknown), (5, 1));
    assert_eq!(index.lower_tier_sizes(), vec![(worker, [0, 0, 0])]);
}

#[test]
fn sglang_pad_values_name_their_image() {
    // Two blocks of 4; an image's pad value (above u32) over tokens 2..6.
    let pad = 0xABCD_0000_0000_0001u64;
    let stored = kvroute_wire::BlockStored {
        block_hashes: vec![1, 2],
        token_ids: vec![10, 11, pad, pad, pad, pad, 12, 13],
        block_size: 4,
        ..Default::default()
    };
    let batch = kvroute_wire::KvEventBatch {
        ts: 0.0,
        events: vec![EngineEvent::BlockStored(stored)],
        dp_rank: Some(0),
    };
    let config = ConvertConfig {
        image_token_id: Some(IMAGE_PAD),
        ..ConvertConfig::new(BlockSize::new(4).unwrap())
    };
    let events = Converter::new(config).vllm_batch(&batch, 0);
    let KvCacheEventData::Stored(s) = &events[0].data else { panic!("stored") };
    let request = RequestExtraInfo {
        mm_objects: vec![RequestMmObjectInfo { mm_hash: pad, offsets: vec![(2, 6)] }],
    };
    let tokens = [10, 11, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 12, 13];
    let hasher = BlockHasher::new(BlockSize::new(4).unwrap());
    let expected =
        hasher.local_hashes(&tokens, Some(&request.to_block_level(BlockSize::new(4).unwrap(), 8)));
    assert_eq!(s.blocks.iter().map(|b| b.tokens_hash).collect::<Vec<_>>(), expected);
}

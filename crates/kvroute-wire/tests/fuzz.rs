//! Every decoder of untrusted bytes, fed garbage and mutated real payloads: errors, never
//! panics; and whatever decodes also converts without panicking. (Runs in CI; a coverage-guided
//! `cargo fuzz` target can reuse the same entry points.)

#![allow(clippy::unwrap_used)]

use kvroute_core::BlockSize;
use kvroute_wire::vllm::{decode_batch, split_frames};
use kvroute_wire::{ConvertConfig, Converter, decode_router_events, trtllm};
use proptest::prelude::*;

fn payloads() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for name in ["fixture_vllm033.json", "fixture_vllm023.json", "fixture_sglang0523.json"] {
        let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        let messages: Vec<Vec<String>> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        for frames in messages {
            let hex = &frames[2];
            out.push(
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect(),
            );
        }
    }
    out
}

fn convert_all(bytes: &[u8]) {
    let config = ConvertConfig {
        block_size: BlockSize::new(4).unwrap(),
        image_token_id: Some(151_655),
        vocab_size: Some(151_936),
    };
    let mut c = Converter::new(config);
    if let Ok(batch) = decode_batch(bytes) {
        c.vllm_batch(&batch, 0);
    }
    for events in [trtllm::decode_json(bytes), trtllm::decode_msgpack(bytes)].into_iter().flatten()
    {
        let mut out = Vec::new();
        for e in &events {
            c.trtllm_event(e, &mut out);
        }
    }
    let _ = decode_router_events(bytes);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        convert_all(&bytes);
        let _ = split_frames(&[bytes.clone(), bytes.clone(), bytes]);
    }

    #[test]
    fn mutated_payloads_never_panic(
        which in 0usize..4,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = payloads()[which].clone();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        convert_all(&bytes);
        let keep = cut.index(bytes.len() + 1);
        convert_all(&bytes[..keep]);
    }

    #[test]
    fn json_shaped_garbage_never_panics(s in "[\\[\\]{}\":,0-9a-z_ -]{0,200}") {
        convert_all(s.as_bytes());
    }
}

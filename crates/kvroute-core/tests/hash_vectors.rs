//! Golden vectors from Dynamo's own `compute_block_hash_for_seq` (shared/vectors/hash_vectors.json,
//! copied to tests/fixtures): every case must reproduce bit for bit.

use kvroute_core::{
    BlockExtraInfo, LocalBlockHash, SequenceHash, compute_block_hash_for_seq, sequence_hashes,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    tokens: Vec<u32>,
    kv_block_size: u32,
    block_mm_infos: Option<Vec<Option<BlockExtraInfo>>>,
    lora_name: Option<String>,
    local_hashes: Vec<u64>,
    sequence_hashes: Vec<u64>,
}

#[test]
fn every_golden_vector_reproduces() {
    let vectors: Vectors =
        serde_json::from_str(include_str!("fixtures/hash_vectors.json")).expect("fixture parses");
    assert!(vectors.cases.len() >= 9, "fixture lost cases");
    let mut kinds = (false, false);
    for case in &vectors.cases {
        kinds.0 |= case.block_mm_infos.iter().flatten().any(Option::is_some);
        kinds.1 |= case.lora_name.is_some();
        let local = compute_block_hash_for_seq(
            &case.tokens,
            case.kv_block_size,
            case.block_mm_infos.as_deref(),
            case.lora_name.as_deref(),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let expected_local: Vec<LocalBlockHash> =
            case.local_hashes.iter().copied().map(LocalBlockHash).collect();
        assert_eq!(local, expected_local, "{}: local hashes", case.name);
        let expected_seq: Vec<SequenceHash> =
            case.sequence_hashes.iter().copied().map(SequenceHash).collect();
        assert_eq!(sequence_hashes(&local), expected_seq, "{}: sequence hashes", case.name);
    }
    assert_eq!(kinds, (true, true), "fixture must hold multimodal and LoRA cases");
}

//! Hashing 8,192 tokens at block size 16 (512 blocks): text only, and with one image whose
//! placeholder run spans 1,024 tokens (64 blocks). Target: text ≤ 8 µs median on one core.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::{
    BlockHasher, BlockSize, RequestExtraInfo, RequestMmObjectInfo, sequence_hashes,
};

const TOKENS: usize = 8192;

fn tokens() -> Vec<u32> {
    // A seeded LCG: realistic-looking ids below a 152k vocabulary, the same every run.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..TOKENS)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((state >> 33) % 151_643) as u32
        })
        .collect()
}

fn bench_hash(c: &mut Criterion) {
    let tokens = tokens();
    let hasher = BlockHasher::new(BlockSize::default());
    let image = RequestExtraInfo {
        mm_objects: vec![RequestMmObjectInfo {
            mm_hash: 0x5f5f_1234_abcd_0001,
            offsets: vec![(1000, 2024)],
        }],
    };
    let block_infos = image.to_block_level(hasher.block_size(), tokens.len());

    let mut group = c.benchmark_group("hash_8192_tokens_bs16");
    group.throughput(Throughput::Elements(TOKENS as u64));
    group.bench_function("text_local", |b| {
        b.iter(|| hasher.local_hashes(black_box(&tokens), None));
    });
    group.bench_function("text_local_and_sequence", |b| {
        b.iter(|| sequence_hashes(&hasher.local_hashes(black_box(&tokens), None)));
    });
    group.bench_function("image_1024_tokens_local", |b| {
        b.iter(|| hasher.local_hashes(black_box(&tokens), Some(black_box(&block_infos))));
    });
    group.bench_function("image_1024_tokens_to_block_level_and_local", |b| {
        b.iter(|| {
            let infos = black_box(&image).to_block_level(hasher.block_size(), tokens.len());
            hasher.local_hashes(black_box(&tokens), Some(&infos))
        });
    });
    group.finish();
}

criterion_group!(benches, bench_hash);
criterion_main!(benches);

//! Index benches over the seeded workload of `support/workload.rs` (512-block sequences, first
//! 128 blocks shared in groups of 4), trees of 100k and 1M (worker, block) pairs over 8 and 64
//! workers. Targets (one core): 512-block full hit <= 3 us at 64 workers and 1M pairs,
//! first-block miss <= 50 ns, ingest >= 36M blocks/s from 64-block events and >= 7M events/s
//! from 1-block events. Memory per pair: `cargo bench --bench index_memory`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use kvroute_core::RadixIndex;

#[path = "support/workload.rs"]
mod workload;
use workload::{SEQ_BLOCKS, Workload};

const SHAPES: [(u64, usize); 4] = [(8, 100_000), (64, 100_000), (8, 1_000_000), (64, 1_000_000)];

fn build(workload: &Workload, chunk: usize) -> RadixIndex {
    let mut index = RadixIndex::new();
    for e in workload.stored_events(chunk) {
        index.apply_event(&e).expect("workload events are valid");
    }
    index
}

fn find_matches(c: &mut Criterion) {
    let mut group = c.benchmark_group("find_matches");
    for (workers, pairs) in SHAPES {
        let workload = Workload::new(pairs, workers, 7);
        let index = build(&workload, 64);
        for len in [64, SEQ_BLOCKS] {
            for (name, hit) in [("full", len), ("half", len / 2), ("miss", 0)] {
                let queries: Vec<_> = (0..64).map(|s| workload.query(s * 13, len, hit)).collect();
                let id = BenchmarkId::new(format!("{len}_{name}"), format!("{workers}w_{pairs}"));
                let mut i = 0;
                group.bench_function(id, |b| {
                    b.iter(|| {
                        i = (i + 1) % queries.len();
                        index.find_matches(black_box(&queries[i]))
                    });
                });
            }
        }
    }
    group.finish();
}

fn ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("ingest");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    for (workers, pairs) in SHAPES {
        let workload = Workload::new(pairs, workers, 7);
        for chunk in [64, 1] {
            let events = workload.stored_events(chunk);
            // blocks/s for 64-block events; for 1-block events blocks = events.
            group.throughput(Throughput::Elements(workload.pairs as u64));
            let id = BenchmarkId::new(
                format!("stored_{chunk}_block_events"),
                format!("{workers}w_{pairs}"),
            );
            group.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let mut index = RadixIndex::new();
                        let start = Instant::now();
                        for e in &events {
                            let _ = index.apply_event(black_box(e));
                        }
                        total += start.elapsed();
                        drop(black_box(index));
                    }
                    total
                });
            });
        }
        // Steady state, as in a router whose engines' caches are full: each sequence is evicted
        // and stored again, so tables and vectors keep their size (no growth in the timing).
        // Elements: blocks stored (each also removed once).
        let cycle = workload.evict_and_store_cycle(64);
        let id = BenchmarkId::new(
            "steady_evict_and_store_64_block_events",
            format!("{workers}w_{pairs}"),
        );
        group.bench_function(id, |b| {
            let mut index = build(&workload, 64);
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    for e in &cycle {
                        let _ = index.apply_event(black_box(e));
                    }
                }
                start.elapsed()
            });
        });
        let removed = workload.removed_events(64);
        let id = BenchmarkId::new("removed_64_block_events", format!("{workers}w_{pairs}"));
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut index = build(&workload, 64);
                    let start = Instant::now();
                    for e in &removed {
                        let _ = index.apply_event(black_box(e));
                    }
                    total += start.elapsed();
                    assert_eq!(index.stats().blocks, 0);
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, find_matches, ingest);
criterion_main!(benches);

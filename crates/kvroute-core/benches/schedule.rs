//! One routing decision among 8, 64, 256 and 1,000 workers for a 512-block request, excluding the KV
//! index's `find_matches` (its scores are given): candidates (in-flight prefixes, loads, busy
//! guard) and the policy's choice. Target: <= 2 us median at 64 workers. Also the in-flight
//! bookkeeping a tracked request adds (route with an id, then free).

use std::hint::black_box;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_core::index::OverlapScores;
use kvroute_core::schedule::{
    PolicyKind, RouteRequest, Scheduler, SchedulerConfig, UnknownTreeSizes, WorkerLoad,
};
use kvroute_core::{BlockHasher, BlockSize, WorkerWithDpRank, sequence_hashes};

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|t| t.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) % 151_000).collect()
}

fn bench_decision(c: &mut Criterion) {
    let hasher = BlockHasher::new(BlockSize::default());
    let mut group = c.benchmark_group("route_512_blocks");
    for workers in [8u64, 64, 256, 1000] {
        for policy in [PolicyKind::Kv, PolicyKind::Dynamo] {
            let mut s = Scheduler::new(SchedulerConfig { policy, ..SchedulerConfig::default() });
            for k in 0..workers {
                let w = WorkerWithDpRank::new(k, 0u32);
                s.add_worker(w);
                let load = WorkerLoad {
                    kv_cache_usage: Some(0.5),
                    kv_total_blocks: Some(16_384),
                    ..WorkerLoad::default()
                };
                s.update_load(w, load);
            }
            let query = tokens(1, 512 * 16);
            let local = hasher.local_hashes(&query, None);
            let seq = sequence_hashes(&local);
            // In flight: two requests per worker, half of them sharing the query's first
            // 128 blocks.
            let now = Instant::now();
            for r in 0..2 * workers as u32 {
                let mut t = tokens(100 + r, 512 * 16);
                if r % 2 == 0 {
                    t[..128 * 16].copy_from_slice(&query[..128 * 16]);
                }
                let l = hasher.local_hashes(&t, None);
                let sq = sequence_hashes(&l);
                let id = format!("r{r}");
                let req = RouteRequest {
                    id: Some(&id),
                    isl_tokens: t.len(),
                    local_hashes: &l,
                    sequence_hashes: &sq,
                    overlap_weight: None,
                    temperature: None,
                    exclude: &[],
                    adapter: None,
                    session: None,
                    output_tokens: 0,
                };
                s.route(&req, &OverlapScores::default(), &UnknownTreeSizes, now);
            }
            // A quarter of the workers hold some of the query.
            let scores = OverlapScores {
                scores: (0..workers / 4)
                    .map(|k| (WorkerWithDpRank::new(k, 0u32), (k * 8 % 512) as u32 + 1))
                    .collect(),
                tree_sizes: (0..workers / 4)
                    .map(|k| (WorkerWithDpRank::new(k, 0u32), 8_000))
                    .collect(),
                tiers: None,
            };
            let req = RouteRequest {
                id: None,
                isl_tokens: query.len(),
                local_hashes: &local,
                sequence_hashes: &seq,
                overlap_weight: None,
                temperature: None,
                exclude: &[],
                adapter: None,
                session: None,
                output_tokens: 0,
            };
            group.bench_function(BenchmarkId::new(policy.name(), workers), |b| {
                b.iter(|| s.route(black_box(&req), black_box(&scores), &UnknownTreeSizes, now));
            });
            if workers == 64 {
                let tracked = RouteRequest { id: Some("tracked"), ..req.clone() };
                group.bench_function(
                    BenchmarkId::new(format!("{}_tracked_then_freed", policy.name()), workers),
                    |b| {
                        b.iter(|| {
                            s.route(black_box(&tracked), &scores, &UnknownTreeSizes, now);
                            s.free("tracked")
                        });
                    },
                );
            }
        }
    }
    group.finish();
}

criterion_group!(benches, bench_decision);
criterion_main!(benches);

//! `find_matches` latency while events stream in: the p99 of 512-block full-hit queries on a
//! [`ShardedIndex`] of 1M (worker, block) pairs over 64 workers, idle and while another thread
//! ingests 1M stored blocks/s (each sequence evicted and stored again, 64-block events, paced).
//! Target: busy p99 within 2x of idle p99. Prints a markdown table.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::index::{IndexConfig, ShardedIndex};
use kvroute_core::{KvCacheEventData, LocalBlockHash, RouterEvent};

#[path = "support/workload.rs"]
mod workload;
use workload::Workload;

const RATE_BLOCKS_PER_S: f64 = 1_000_000.0;

fn latencies(index: &ShardedIndex, queries: &[Vec<LocalBlockHash>], n: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let q = &queries[i % queries.len()];
        let start = Instant::now();
        black_box(index.find_matches(black_box(q)));
        out.push(start.elapsed().as_nanos() as u64);
    }
    out.sort_unstable();
    out
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn stored_blocks(e: &RouterEvent) -> usize {
    match &e.event.data {
        KvCacheEventData::Stored(d) => d.blocks.len(),
        _ => 0,
    }
}

#[allow(clippy::print_stdout)]
fn main() {
    // `cargo test --benches` runs bench binaries with no `--bench`: keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (pairs, workers, n) = if quick { (20_000, 8, 2_000) } else { (1_000_000, 64, 300_000) };
    let workload = Workload::new(pairs, workers, 7);
    let index = Arc::new(ShardedIndex::new(8, IndexConfig::default()));
    for e in workload.stored_events(64) {
        index.apply_event(&e).expect("workload events are valid");
    }
    let queries: Vec<_> = (0..256).map(|s| workload.query(s * 7, 512, 512)).collect();
    latencies(&index, &queries, n / 10); // warm up
    let idle = latencies(&index, &queries, n);

    let cycle = workload.evict_and_store_cycle(64);
    let stop = Arc::new(AtomicBool::new(false));
    let ingest = {
        let (index, stop) = (Arc::clone(&index), Arc::clone(&stop));
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut blocks = 0usize;
            let mut holds = Vec::new();
            // Bounded: stops when told, or after 60 s whatever happens.
            'outer: while start.elapsed() < Duration::from_secs(60) {
                for e in &cycle {
                    if stop.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    let t = Instant::now();
                    let _ = index.apply_event(e);
                    holds.push(t.elapsed().as_nanos() as u64);
                    blocks += stored_blocks(e);
                    // Pace by sleeping (this machine's two cores may be hyperthreads of one:
                    // a spinning pacer would slow the reader down by itself).
                    let due = Duration::from_secs_f64(blocks as f64 / RATE_BLOCKS_PER_S);
                    if let Some(ahead) = due.checked_sub(start.elapsed()) {
                        std::thread::sleep(ahead);
                    }
                }
            }
            holds.sort_unstable();
            (blocks as f64 / start.elapsed().as_secs_f64(), holds)
        })
    };
    let busy = latencies(&index, &queries, n);
    stop.store(true, Ordering::Relaxed);
    let (rate, holds) = ingest.join().expect("ingest thread");

    println!(
        "| find_matches 512-block full hit, {} pairs, {workers} workers, 8 shards | p50 ns | p90 ns | p99 ns | p99.9 ns |",
        pairs
    );
    println!("|---|---|---|---|---|");
    for (name, l) in [("idle", &idle), ("ingesting (see rate below)", &busy)] {
        println!(
            "| {name} | {} | {} | {} | {} |",
            pct(l, 0.5),
            pct(l, 0.9),
            pct(l, 0.99),
            pct(l, 0.999)
        );
    }
    println!(
        "| one event applied (write lock held) | {} | {} | {} | {} |",
        pct(&holds, 0.5),
        pct(&holds, 0.9),
        pct(&holds, 0.99),
        pct(&holds, 0.999)
    );
    println!();
    println!(
        "ingest rate achieved: {:.2}M stored blocks/s; busy/idle p99 = {:.2}",
        rate / 1e6,
        pct(&busy, 0.99) as f64 / pct(&idle, 0.99) as f64
    );
}

//! `index-peers INDEX key=value...`: builds one index from the seeded workload in this fresh
//! process, measures it, and prints one JSON line. `scripts/index-peers` runs every index in
//! turn and writes the report.
//!
//! Keys: `workers` (256), `pairs` (1000000), `seed` (7), `hot` (workers holding a prefix of
//! the hot document, 0), `queries` (20000), `busy_secs` (3), `exts` (`content` or `engine`).
//!
//! Indexes: `kvroute-radix`, `kvroute-sharded` (`shards`, 1 by default as in the router),
//! `dynamo-radix`, `dynamo-crtc` (the backend's own `find_matches`; writes through a
//! one-thread `ThreadPoolIndexer`, its only writer), `dynamo-tp-crtc` (`ThreadPoolIndexer`
//! with 4 threads, Dynamo's default `router_event_threads`, read through its async API),
//! `dynamo-positional`, `dynamo-tp-positional`.

mod peers;
mod workload;

use std::alloc::System;
use std::cell::RefCell;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

use peers::{DyPool, DyRadix, KvRadix, KvSharded, Peer};
use workload::{Ev, Shape, Workload, removed, splitmix, stored};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn live_bytes() -> i64 {
    let s = GLOBAL.stats();
    // Reallocations are already in both (stats_alloc books a growth as allocated bytes).
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

struct Args {
    index: String,
    shape: Shape,
    queries: usize,
    busy: Duration,
    shards: usize,
}

fn args() -> Args {
    let mut it = std::env::args().skip(1);
    let index = it.next().unwrap_or_else(|| "kvroute-radix".into());
    let mut shape = Shape {
        pairs: 1_000_000,
        workers: 256,
        seq_blocks: 512,
        shared: 128,
        group: 4,
        hot_holders: 0,
        seed: 7,
        content_exts: true,
    };
    let (mut queries, mut busy, mut shards) = (20_000, 3.0, 1);
    for kv in it {
        let (k, v) = kv.split_once('=').expect("key=value");
        if k == "exts" {
            shape.content_exts = v == "content";
            continue;
        }
        let n: f64 = v.parse().expect("a number");
        match k {
            "workers" => shape.workers = n as u64,
            "pairs" => shape.pairs = n as usize,
            "seed" => shape.seed = n as u64,
            "hot" => shape.hot_holders = n as u64,
            "queries" => queries = n as usize,
            "busy_secs" => busy = n,
            "shards" => shards = n as usize,
            _ => panic!("unknown key {k}"),
        }
    }
    Args { index, shape, queries, busy: Duration::from_secs_f64(busy), shards }
}

#[derive(Default)]
struct Report {
    fields: Vec<(String, String)>,
}

impl Report {
    fn num(&mut self, k: &str, v: f64) {
        self.fields.push((k.into(), format!("{v:.4}")));
    }
    fn text(&mut self, k: &str, v: &str) {
        self.fields.push((k.into(), format!("\"{v}\"")));
    }
    fn json(&self) -> String {
        let body: Vec<String> = self.fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        format!("{{{}}}", body.join(","))
    }
}

/// Per-call latencies (ns): mean over one timed batch, and p50/p99/p999 of per-call samples.
fn latency<P: Peer>(p: &P, queries: &[P::Q], n: usize, out: &mut Report, name: &str) {
    let warm = Instant::now();
    let w = n.min(2000);
    for q in queries.iter().cycle().take(w) {
        black_box(p.find(q)); // warm
    }
    // At most about a second per pass for a slow index.
    let per_call = warm.elapsed().as_secs_f64() / w as f64;
    let n = n.min((1.0 / per_call.max(1e-9)) as usize).max(200);
    out.num(&format!("{name}_calls"), n as f64);
    let start = Instant::now();
    for q in queries.iter().cycle().take(n) {
        black_box(p.find(black_box(q)));
    }
    let mean = start.elapsed().as_nanos() as f64 / n as f64;
    // The best of ten batch means: what the code costs with the machine's noise taken out.
    let batch = (n / 10).max(1);
    let best = (0..10)
        .map(|_| {
            let start = Instant::now();
            for q in queries.iter().cycle().take(batch) {
                black_box(p.find(black_box(q)));
            }
            start.elapsed().as_nanos() as f64 / batch as f64
        })
        .fold(f64::INFINITY, f64::min);
    out.num(&format!("{name}_best_ns"), best);
    let mut samples: Vec<u64> = queries
        .iter()
        .cycle()
        .take(n)
        .map(|q| {
            let t = Instant::now();
            black_box(p.find(black_box(q)));
            t.elapsed().as_nanos() as u64
        })
        .collect();
    samples.sort_unstable();
    let pct = |x: f64| samples[((samples.len() as f64 * x) as usize).min(samples.len() - 1)] as f64;
    out.num(&format!("{name}_mean_ns"), mean);
    out.num(&format!("{name}_p50_ns"), pct(0.5));
    out.num(&format!("{name}_p99_ns"), pct(0.99));
    out.num(&format!("{name}_p999_ns"), pct(0.999));
}

/// Blocks/s of `events`, built in the index's own type before the clock starts (each index
/// drops its events inside the timing, as it would in service).
fn timed<P: Peer>(p: &P, events: impl Iterator<Item = Ev>, blocks: usize) -> f64 {
    let events: Vec<P::E> = events.map(|e| p.event(e)).collect();
    let start = Instant::now();
    for e in events {
        p.apply_event(e);
    }
    p.settle();
    blocks as f64 / start.elapsed().as_secs_f64()
}

fn ingest<P: Peer>(p: &P, w: &Workload, chunk: usize) -> f64 {
    timed(p, w.seqs.iter().flat_map(|s| stored(s, chunk)), w.pairs)
}

fn queries(w: &Workload, seed: u64, hit: bool) -> Vec<Vec<u64>> {
    let seqs = w.group_seqs();
    (0..4096u64)
        .map(|k| {
            let s = &seqs[(splitmix(seed ^ k) % seqs.len() as u64) as usize];
            if hit {
                s.locals.clone()
            } else {
                (0..512).map(|i| splitmix(!seed ^ i ^ k << 20)).collect()
            }
        })
        .collect()
}

/// Everything but reads during ingest, on the index `make` builds (called once per build).
fn measure<P: Peer>(make: impl Fn() -> P, w: &Workload, a: &Args, out: &mut Report) -> P {
    // Ingest of 1-block events, on its own fresh index.
    {
        let p = make();
        out.num("ingest_1_blocks_per_s", ingest(&p, w, 1));
    }
    let before = live_bytes();
    let p = make();
    out.num("ingest_32_blocks_per_s", ingest(&p, w, 32));
    let bytes = (live_bytes() - before) as f64;
    out.num("heap_bytes", bytes);
    out.num("bytes_per_pair", bytes / w.pairs as f64);
    out.num("rss_mib", rss_kib() as f64 / 1024.0);
    if let Some(n) = p.nodes() {
        out.num("nodes", n as f64);
    }
    if let Some(n) = p.heap_estimate() {
        out.num("heap_estimate_bytes", n as f64);
    }
    let hits: Vec<P::Q> = queries(w, a.shape.seed, true).iter().map(|q| p.query(q)).collect();
    let (scored, best) = p.find(&hits[0]);
    out.num("hit_workers_scored", scored as f64);
    out.num("hit_best_score", f64::from(best));
    latency(&p, &hits, a.queries, out, "hit512");
    if !w.hot.is_empty() {
        let hot = vec![p.query(&w.hot)];
        let (scored, best) = p.find(&hot[0]);
        out.num("hot_workers_scored", scored as f64);
        out.num("hot_best_score", f64::from(best));
        latency(&p, &hot, a.queries, out, "hot512");
    }
    let misses: Vec<P::Q> = queries(w, a.shape.seed, false).iter().map(|q| p.query(q)).collect();
    latency(&p, &misses, a.queries * 10, out, "miss");
    // Engine eviction and re-store on the full index: every sequence removed leaves first and
    // stored again, 32 blocks per event (the index keeps its size).
    let cycle = w.seqs.iter().flat_map(|s| removed(s, 32).chain(stored(s, 32)));
    out.num("evict_and_store_blocks_per_s", timed(&p, cycle, 2 * w.pairs));
    p
}

fn removal<P: Peer>(p: &P, w: &Workload, out: &mut Report) {
    let events = w.seqs.iter().flat_map(|s| removed(s, 32));
    out.num("remove_32_blocks_per_s", timed(p, events, w.pairs));
}

/// Reads on this thread while `write` applies the evict-and-store cycle on another, for
/// `a.busy`: read latency percentiles and the writer's blocks/s.
fn busy<Q: Sync>(
    read: impl Fn(&Q) -> (usize, u32),
    hits: &[Q],
    write: impl Fn(Ev) + Sync,
    settle: impl Fn() + Sync,
    w: &Workload,
    a: &Args,
    out: &mut Report,
) {
    let stop = AtomicBool::new(false);
    let written = AtomicU64::new(0);
    let mut samples = Vec::with_capacity(1 << 20);
    let elapsed = std::thread::scope(|scope| {
        let start = Instant::now();
        scope.spawn(|| {
            'outer: loop {
                for s in &w.seqs {
                    for e in removed(s, 32).chain(stored(s, 32)) {
                        write(e);
                    }
                    written.fetch_add(2 * s.locals.len() as u64, Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                }
            }
            settle();
        });
        for q in hits.iter().cycle() {
            let t = Instant::now();
            black_box(read(black_box(q)));
            samples.push(t.elapsed().as_nanos() as u64);
            if samples.len() % 256 == 0 && start.elapsed() > a.busy {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        start.elapsed()
    });
    samples.sort_unstable();
    let pct = |x: f64| samples[((samples.len() as f64 * x) as usize).min(samples.len() - 1)] as f64;
    out.num("busy_hit512_p50_ns", pct(0.5));
    out.num("busy_hit512_p99_ns", pct(0.99));
    out.num("busy_hit512_p999_ns", pct(0.999));
    out.num("busy_reads_per_s", samples.len() as f64 / elapsed.as_secs_f64());
    out.num(
        "busy_write_blocks_per_s",
        written.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
    );
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let a = args();
    let w = Workload::new(a.shape);
    let mut out = Report::default();
    out.text("index", &a.index);
    out.num("workers", a.shape.workers as f64);
    out.num("pairs", w.pairs as f64);
    out.num("hot_holders", a.shape.hot_holders as f64);
    out.num("seed", a.shape.seed as f64);
    out.text("exts", if a.shape.content_exts { "content" } else { "engine" });
    match a.index.as_str() {
        "kvroute-radix" => {
            let p = measure(
                || KvRadix(RefCell::new(kvroute_core::RadixIndex::new())),
                &w,
                &a,
                &mut out,
            );
            removal(&p, &w, &mut out);
        }
        "kvroute-sharded" => {
            let make =
                || KvSharded(kvroute_core::index::ShardedIndex::new(a.shards, Default::default()));
            out.num("shards", a.shards as f64);
            let p = measure(make, &w, &a, &mut out);
            let hits: Vec<_> = queries(&w, a.shape.seed, true).iter().map(|q| p.query(q)).collect();
            busy(|q| p.find(q), &hits, |e| p.apply(e), || {}, &w, &a, &mut out);
            removal(&p, &w, &mut out);
        }
        "dynamo-radix" => {
            let make = || DyRadix(RefCell::new(dynamo_kv_router::radix_tree::RadixTree::new()));
            let p = measure(make, &w, &a, &mut out);
            removal(&p, &w, &mut out);
        }
        "dynamo-crtc" | "dynamo-tp-crtc" => {
            let (threads, service) = if a.index == "dynamo-crtc" { (1, false) } else { (4, true) };
            let p = measure(|| DyPool::new(peers::crtc(), threads, service), &w, &a, &mut out);
            pool_busy(&p, &w, &a, &mut out);
            removal(&p, &w, &mut out);
        }
        "dynamo-positional" | "dynamo-tp-positional" => {
            let (threads, service) =
                if a.index == "dynamo-positional" { (1, false) } else { (4, true) };
            let p =
                measure(|| DyPool::new(peers::positional(), threads, service), &w, &a, &mut out);
            pool_busy(&p, &w, &a, &mut out);
            removal(&p, &w, &mut out);
        }
        other => panic!("unknown index {other}"),
    }
    #[allow(clippy::print_stdout)]
    {
        println!("{}", out.json());
    }
}

fn pool_busy<T: dynamo_kv_router::indexer::SyncIndexer>(
    p: &DyPool<T>,
    w: &Workload,
    a: &Args,
    out: &mut Report,
) {
    let hits: Vec<_> = queries(w, a.shape.seed, true).iter().map(|q| p.query(q)).collect();
    let pool = &p.pool;
    let service = p.service;
    let read = |q: &Vec<dynamo_kv_router::protocols::LocalBlockHash>| {
        let s = if service {
            peers::ready(dynamo_kv_router::indexer::KvIndexerInterface::find_matches(
                pool,
                q.clone(),
            ))
            .expect("find")
        } else {
            dynamo_kv_router::indexer::SyncIndexer::find_matches(pool.backend(), q, false)
        };
        (s.scores.len(), 0)
    };
    let pending = AtomicU64::new(0);
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("rt");
    let settle = || rt.block_on(pool.flush_and_wait()).expect("flush");
    let write = |e: Ev| {
        pool.enqueue_event(peers::dy_event(e)).expect("online");
        if pending.fetch_add(1, Ordering::Relaxed) % 4096 == 4095 {
            settle();
        }
    };
    busy(read, &hits, write, settle, w, a, out);
}

//! A `kvroute router` process at fleet scale: simulated vLLM publishers (real ZMQ PUB sockets
//! and real msgpack batches, no engines behind them) fill and churn its index while a client
//! asks `POST /find_best_worker` for 512-block requests. Reports events/s and decisions/s
//! sustained, decision latency inside the router (its `kvroute_router_decision_seconds`
//! histogram: from the request parsed to the decision made) beside the HTTP round trip, the
//! router's RSS and each process's CPU.
//!
//! ```text
//! taskset -c 1 cargo run --release -p kvroute-router --example fleet -- \
//!     --router-bin target/release/kvroute --workers 1000 --blocks-per-worker 10000
//! ```
//!
//! This process (publishers and client) runs where it is started; the router is started under
//! `taskset -c --router-core` (0 by default). Each publisher's workload: sequences of 512
//! blocks whose first 128 are shared by groups of 4 workers' sequences, stored in chained
//! `BlockStored` events of 1 to 16 blocks (uniform, seeded), `--events-per-batch` events to a
//! ZMQ message (vLLM batches a step's events the same way). In the steady phase each
//! publisher evicts its oldest sequence (`BlockRemoved`, 1 to 16 hashes an event) and stores
//! a new one, so the index keeps its size. `--binary` asks in `/find_best_worker`'s binary
//! form (the hashes as little-endian u64s) instead of JSON. Options: `--help`.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

use std::collections::VecDeque;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_core::{BlockHasher, BlockSize};
use kvroute_http::HttpClient;
use kvroute_http::router_api::{self, BestWorker, FindBestWorker};
use kvroute_wire::vllm::encode_batch;
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent, KvEventBatch};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BS: usize = 16;
const SEQ_BLOCKS: usize = 512;
const SHARED: usize = 128;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

struct Args {
    router_bin: String,
    workers: usize,
    blocks_per_worker: usize,
    events_per_s: f64,
    fill_events_per_s: f64,
    events_per_batch: usize,
    decisions_per_s: f64,
    clients: usize,
    secs: f64,
    router_core: String,
    /// Ask in the binary form (hashes as little-endian u64s) rather than JSON.
    binary: bool,
}

fn args() -> Args {
    let mut a = Args {
        router_bin: "target/release/kvroute".into(),
        workers: 1000,
        blocks_per_worker: 10_000,
        events_per_s: 200_000.0,
        fill_events_per_s: 200_000.0,
        events_per_batch: 4,
        decisions_per_s: 5_000.0,
        clients: 8,
        secs: 20.0,
        router_core: "0".into(),
        binary: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--binary" {
            a.binary = true;
            continue;
        }
        if flag == "--help" {
            println!(
                "fleet [--router-bin P] [--workers N] [--blocks-per-worker N] [--events-per-s R] \
                 [--fill-events-per-s R] [--events-per-batch N] [--decisions-per-s R] [--clients N] [--secs S] \
                 [--router-core CPUS] [--binary]"
            );
            std::process::exit(0);
        }
        let v = it.next().unwrap_or_else(|| panic!("{flag} takes a value"));
        match flag.as_str() {
            "--router-bin" => a.router_bin = v,
            "--workers" => a.workers = v.parse().unwrap(),
            "--blocks-per-worker" => a.blocks_per_worker = v.parse().unwrap(),
            "--events-per-s" => a.events_per_s = v.parse().unwrap(),
            "--fill-events-per-s" => a.fill_events_per_s = v.parse().unwrap(),
            "--events-per-batch" => a.events_per_batch = v.parse().unwrap(),
            "--decisions-per-s" => a.decisions_per_s = v.parse().unwrap(),
            "--clients" => a.clients = v.parse().unwrap(),
            "--secs" => a.secs = v.parse().unwrap(),
            "--router-core" => a.router_core = v,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// Sequence `s`'s tokens: its first 128 blocks shared with the 3 others of its group.
fn tokens(s: u64) -> Vec<u64> {
    (0..(SEQ_BLOCKS * BS) as u64)
        .map(|i| {
            let owner = if i < (SHARED * BS) as u64 { s / 4 } else { 1 << 40 | s };
            splitmix(owner.wrapping_mul(1_000_003) + i) % 150_000
        })
        .collect()
}

/// Engine block hash of block `i` of sequence `s` on its worker.
fn block_hash(s: u64, i: usize) -> u64 {
    splitmix(s << 20 | i as u64) >> 1
}

/// One publisher: its socket, sequence number, the sequences it holds (oldest first) and the
/// events it still has to send.
struct Publisher {
    socket: PubSocket,
    seq: u64,
    held: VecDeque<u64>,
    pending: VecDeque<EngineEvent>,
}

/// `s` stored as chained events of 1 to 16 blocks.
fn store_events(s: u64, rng: &mut u64) -> Vec<EngineEvent> {
    let t = tokens(s);
    let mut out = Vec::new();
    let mut at = 0;
    while at < SEQ_BLOCKS {
        *rng = splitmix(*rng);
        let n = (1 + (*rng % 16) as usize).min(SEQ_BLOCKS - at);
        out.push(EngineEvent::BlockStored(BlockStored {
            block_hashes: (at..at + n).map(|i| block_hash(s, i)).collect(),
            parent_block_hash: at.checked_sub(1).map(|p| block_hash(s, p)),
            token_ids: t[at * BS..(at + n) * BS].to_vec(),
            block_size: BS as u32,
            medium: Some("GPU".into()),
            ..Default::default()
        }));
        at += n;
    }
    out
}

/// `s` evicted leaves first, 1 to 16 hashes an event.
fn remove_events(s: u64, rng: &mut u64) -> Vec<EngineEvent> {
    let mut out = Vec::new();
    let mut end = SEQ_BLOCKS;
    while end > 0 {
        *rng = splitmix(*rng);
        let n = (1 + (*rng % 16) as usize).min(end);
        out.push(EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: (end - n..end).rev().map(|i| block_hash(s, i)).collect(),
            medium: Some("GPU".into()),
            group_idx: None,
            locality: None,
        }));
        end -= n;
    }
    out
}

impl Publisher {
    async fn send(&mut self, events: Vec<EngineEvent>) -> usize {
        let n = events.len();
        let batch = KvEventBatch { ts: 0.0, events, dp_rank: Some(0) };
        self.send_encoded(&bytes::Bytes::from(encode_batch(&batch))).await;
        n
    }

    /// Sends one pre-encoded payload (a batch of events) under the next sequence number.
    async fn send_encoded(&mut self, payload: &bytes::Bytes) {
        let mut m = ZmqMessage::from(b"kv-events".to_vec());
        m.push_back(self.seq.to_be_bytes().to_vec().into());
        m.push_back(payload.clone());
        self.seq += 1;
        let _ = self.socket.send(m).await;
    }
}

/// A worker's churn, encoded before the clock starts (encoding as it goes took the generator's
/// whole core): store `a`; then over and over, evict `a` and store `b`, evict `b` and store
/// `a`. The index keeps its size; the router's work per event is what fresh content costs.
struct Churn {
    phases: [Vec<(bytes::Bytes, usize)>; 3],
    phase: usize,
    at: usize,
}

impl Churn {
    fn new(a: u64, b: u64, per_batch: usize, rng: &mut u64) -> Self {
        let encode = |events: Vec<EngineEvent>| -> Vec<(bytes::Bytes, usize)> {
            events
                .chunks(per_batch)
                .map(|c| {
                    let batch = KvEventBatch { ts: 0.0, events: c.to_vec(), dp_rank: Some(0) };
                    (bytes::Bytes::from(encode_batch(&batch)), c.len())
                })
                .collect()
        };
        let mut ab = remove_events(a, rng);
        ab.extend(store_events(b, rng));
        let mut ba = remove_events(b, rng);
        ba.extend(store_events(a, rng));
        Self { phases: [encode(store_events(a, rng)), encode(ab), encode(ba)], phase: 0, at: 0 }
    }

    /// The next payload and how many events it carries.
    fn next(&mut self) -> (bytes::Bytes, usize) {
        if self.at == self.phases[self.phase].len() {
            self.phase = if self.phase == 1 { 2 } else { 1 };
            self.at = 0;
        }
        self.at += 1;
        self.phases[self.phase][self.at - 1].clone()
    }
}

struct Metrics {
    text: String,
}

impl Metrics {
    fn sum(&self, name: &str, label: Option<&str>) -> f64 {
        self.text
            .lines()
            .filter(|l| l.starts_with(name) && label.is_none_or(|x| l.contains(x)))
            .filter(|l| l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Series of a family with a value above zero.
    fn count_positive(&self, name: &str) -> usize {
        let prefix = format!("{name}{{");
        self.text
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .filter(|&v| v > 0.0)
            .count()
    }

    /// (upper bound, cumulative count) of a histogram's buckets.
    fn buckets(&self, name: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{le=\"");
        self.text
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(&prefix)?;
                let (le, tail) = rest.split_once('"')?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, tail.rsplit(' ').next()?.parse().ok()?))
            })
            .collect()
    }
}

async fn metrics(client: &HttpClient, base: &str) -> Metrics {
    let (_, body) = client.get(&format!("{base}/metrics")).await.unwrap();
    Metrics { text: String::from_utf8_lossy(&body).into_owned() }
}

/// Quantile `q` of the decisions between two snapshots, interpolated inside its bucket.
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let counts: Vec<(f64, f64)> =
        after.iter().zip(before).map(|(&(le, a), &(_, b))| (le, a - b)).collect();
    let total = counts.last().map_or(0.0, |c| c.1);
    let want = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in &counts {
        if c >= want {
            if le.is_infinite() {
                return prev.0;
            }
            let span = (c - prev.1).max(1.0);
            return prev.0 + (le - prev.0) * (want - prev.1) / span;
        }
        prev = (le, c);
    }
    prev.0
}

/// (utime + stime) seconds of process `pid`.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 =
        fields.get(11..13).map_or(0.0, |f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum());
    ticks / 100.0
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn start_router(a: &Args, endpoints: &[String], port: u16, dir: &std::path::Path) -> Child {
    let mut cfg = format!("block_size = {BS}\nready_timeout = 1\n");
    for (i, e) in endpoints.iter().enumerate() {
        cfg += &format!("[[workers]]\nid = {}\nevents = \"{e}\"\n", i + 1);
    }
    let path = dir.join("fleet.toml");
    std::fs::write(&path, cfg).unwrap();
    let log = std::fs::File::create(dir.join("router.log")).unwrap();
    Command::new("taskset")
        .args(["-c", &a.router_core, &a.router_bin, "router", "--port", &port.to_string()])
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("taskset and the router binary")
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    let dir = std::env::temp_dir().join(format!("kvroute-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut pubs = Vec::with_capacity(a.workers);
    let mut endpoints = Vec::with_capacity(a.workers);
    for _ in 0..a.workers {
        let mut socket = PubSocket::new();
        endpoints.push(socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string());
        pubs.push(Publisher { socket, seq: 0, held: VecDeque::new(), pending: VecDeque::new() });
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut router = start_router(&a, &endpoints, port, &dir);
    let pid = router.id();
    let base = format!("http://127.0.0.1:{port}");
    let client = HttpClient::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.get(&format!("{base}/health")).await.is_err() {
        assert!(Instant::now() < deadline, "the router never answered; see {}", dir.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Subscriptions: every publisher sends its first sequence's first event until the router
    // holds a block of every worker (a PUB socket drops what it sends before the SUB joins).
    let mut rng = 7u64;
    let stride = a.workers as u64;
    let mut next: Vec<u64> = (0..stride).collect();
    let first: Vec<EngineEvent> =
        (0..a.workers).map(|w| store_events(w as u64, &mut 1).remove(0)).collect();
    loop {
        for (p, e) in pubs.iter_mut().zip(&first) {
            p.send(vec![e.clone()]).await;
        }
        let m = metrics(&client, &base).await;
        if m.count_positive("kvroute_router_worker_blocks") >= a.workers {
            break;
        }
        assert!(Instant::now() < deadline, "subscriptions never all came up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("{} subscriptions up; filling to {} blocks a worker", a.workers, a.blocks_per_worker);
    // Fill: whole sequences until each worker holds blocks_per_worker, paced at the event rate.
    let per_worker = a.blocks_per_worker.div_ceil(SEQ_BLOCKS);
    let fill_start = Instant::now();
    let mut sent = 0usize;
    for _ in 0..per_worker {
        for (w, p) in pubs.iter_mut().enumerate() {
            p.pending.clear();
            p.pending.extend(store_events(next[w], &mut rng));
            p.held.push_back(next[w]);
            next[w] += stride;
            while !p.pending.is_empty() {
                let take = a.events_per_batch.min(p.pending.len());
                let events: Vec<EngineEvent> = p.pending.drain(..take).collect();
                sent += p.send(events).await;
            }
            pace(fill_start, sent, a.fill_events_per_s).await;
        }
    }
    let sent_secs = fill_start.elapsed().as_secs_f64();
    // The router may be behind: wait until it has applied what was sent.
    let applied = |m: &Metrics| m.sum("kvroute_router_events_total", None) as usize;
    let caught_up = Instant::now() + Duration::from_secs(120);
    let mut m = metrics(&client, &base).await;
    while applied(&m) < sent && Instant::now() < caught_up {
        tokio::time::sleep(Duration::from_millis(200)).await;
        m = metrics(&client, &base).await;
    }
    eprintln!(
        "filled: {sent} events sent in {sent_secs:.1} s, applied after {:.1} s; {} held blocks",
        fill_start.elapsed().as_secs_f64(),
        m.sum("kvroute_router_index_held_blocks", None)
    );
    steady(&a, &mut pubs, &mut next, &mut rng, &client, &base, pid).await;
    let _ = router.kill();
    let _ = router.wait();
}

async fn pace(start: Instant, sent: usize, rate: f64) {
    let due = Duration::from_secs_f64(sent as f64 / rate);
    if let Some(wait) = due.checked_sub(start.elapsed()) {
        tokio::time::sleep(wait).await;
    }
}

/// The measured window: churn at the event rate and decisions at theirs, side by side.
async fn steady(
    a: &Args,
    pubs: &mut [Publisher],
    next: &mut [u64],
    rng: &mut u64,
    client: &HttpClient,
    base: &str,
    pid: u32,
) {
    let hasher = BlockHasher::new(BlockSize::new(BS as u32).unwrap());
    // Queries: stored sequences (hits on 4 workers' shared prefix and one worker's whole).
    let bodies: Vec<FindBestWorker> = (0..256u64)
        .map(|k| {
            let s = splitmix(k) % (a.workers as u64 * 2);
            let t: Vec<u32> = tokens(s).iter().map(|&x| x as u32).collect();
            let hashes = hasher.local_hashes(&t, None).iter().map(|l| l.0).collect();
            FindBestWorker::query(hashes, (SEQ_BLOCKS * BS) as i64)
        })
        .collect();
    let stride = a.workers as u64;
    let mut churn: Vec<Churn> = (0..a.workers)
        .map(|w| Churn::new(next[w], next[w] + stride, a.events_per_batch, rng))
        .collect();
    let before = metrics(client, base).await;
    let (router_cpu0, self_cpu0) = (cpu_secs(pid), cpu_secs(std::process::id()));
    let start = Instant::now();
    let window = Duration::from_secs_f64(a.secs);
    let url = format!("{base}{}", router_api::FIND_BEST_WORKER);
    let queries = async {
        let tasks = (0..a.clients).map(|c| {
            let (url, bodies) = (&url, &bodies);
            async move {
                let mut rtts = Vec::new();
                if a.decisions_per_s <= 0.0 {
                    return rtts; // events alone
                }
                let rate = a.decisions_per_s / a.clients as f64;
                let mut i = 0usize;
                while start.elapsed() < window {
                    pace(start, i, rate).await;
                    let t = Instant::now();
                    let b = &bodies[(i * a.clients + c) % bodies.len()];
                    let answer: Result<BestWorker, _> = match a.binary {
                        true => client.find_best_worker(base, b).await,
                        false => client.post_json(url, b).await,
                    };
                    if answer.is_ok() {
                        rtts.push(t.elapsed().as_nanos() as u64);
                    }
                    i += 1;
                }
                rtts
            }
        });
        futures_util::future::join_all(tasks).await.concat()
    };
    let events = async {
        let mut sent = 0usize;
        let mut w = 0;
        if a.events_per_s <= 0.0 {
            tokio::time::sleep(window).await; // decisions alone
            return sent;
        }
        while start.elapsed() < window {
            let (payload, n) = churn[w].next();
            pubs[w].send_encoded(&payload).await;
            sent += n;
            w = (w + 1) % pubs.len();
            if w % 16 == 0 {
                pace(start, sent, a.events_per_s).await;
                tokio::task::yield_now().await; // the query client shares this thread
            }
        }
        sent
    };
    let (mut rtts, sent) = tokio::join!(queries, events);
    let secs = start.elapsed().as_secs_f64();
    let after = metrics(client, base).await;
    let (router_cpu, self_cpu) =
        (cpu_secs(pid) - router_cpu0, cpu_secs(std::process::id()) - self_cpu0);
    report(a, &before, &after, &mut rtts, sent, secs, (router_cpu, self_cpu), rss_mib(pid));
}

#[allow(clippy::too_many_arguments)]
fn report(
    a: &Args,
    before: &Metrics,
    after: &Metrics,
    rtts: &mut [u64],
    sent: usize,
    secs: f64,
    (router_cpu, self_cpu): (f64, f64),
    rss: f64,
) {
    let ok = |m: &Metrics| m.sum("kvroute_router_events_total", Some("status=\"ok\""));
    let all = |m: &Metrics| m.sum("kvroute_router_events_total", None);
    let decided = after.sum("kvroute_router_decisions_total", None)
        - before.sum("kvroute_router_decisions_total", None);
    let (hb, ha) = (
        before.buckets("kvroute_router_decision_seconds"),
        after.buckets("kvroute_router_decision_seconds"),
    );
    let q = |p| quantile(&hb, &ha, p) * 1e6;
    rtts.sort_unstable();
    let rtt = |p: f64| {
        rtts.get(((rtts.len() as f64 * p) as usize).min(rtts.len().saturating_sub(1)))
            .map_or(0.0, |&n| n as f64 / 1e3)
    };
    println!(
        "| fleet: {} workers, {} blocks each, {} events a batch, {:.0} s | value |",
        a.workers, a.blocks_per_worker, a.events_per_batch, secs
    );
    println!("|---|---|");
    println!("| events sent / s (1-16 blocks each) | {:.0} |", sent as f64 / secs);
    println!("| events applied / s | {:.0} |", (all(after) - all(before)) / secs);
    println!(
        "| of them refused or failed | {:.0} |",
        (all(after) - all(before)) - (ok(after) - ok(before))
    );
    println!("| decisions / s | {:.0} |", decided / secs);
    println!(
        "| decision inside the router p50 / p99 / p999 (µs, from its histogram) | {:.1} / {:.1} / {:.1} |",
        q(0.5),
        q(0.99),
        q(0.999)
    );
    println!(
        "| POST /find_best_worker round trip p50 / p99 / p999 (µs) | {:.0} / {:.0} / {:.0} |",
        rtt(0.5),
        rtt(0.99),
        rtt(0.999)
    );
    println!(
        "| held (worker, block) pairs at the end | {:.0} |",
        after.sum("kvroute_router_index_held_blocks", None)
    );
    println!("| router RSS (MiB) | {rss:.0} |");
    println!("| router CPU (cores, pinned to {}) | {:.2} |", a.router_core, router_cpu / secs);
    let applied = all(after) - all(before);
    // With one load alone (`--decisions-per-s 0` or `--events-per-s 0`) these are its cost.
    println!(
        "| router CPU per event applied / per decision, all of it (µs) | {:.2} / {:.1} |",
        router_cpu * 1e6 / applied.max(1.0),
        router_cpu * 1e6 / decided.max(1.0)
    );
    println!("| request form | {} |", if a.binary { "binary" } else { "JSON" });
    println!("| publishers + client CPU (cores) | {:.2} |", self_cpu / secs);
}

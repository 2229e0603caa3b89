//! End-to-end ingest over ZMQ on loopback, and routing while events stream in.
//!
//! 1. A PUB socket (the vLLM wire format, 64-block BlockStored batches for 8 workers' worth of
//!    sequences) floods one router subscription; reported: blocks applied per second.
//!    Target >= 1M blocks/s.
//! 2. The same publisher paced at 100k blocks/s while 512-block requests are routed at
//!    1,000/s: decision latency inside the router (`RouterState::place`, HTTP excluded) and
//!    through `POST /find_best_worker` on a kept-alive loopback connection. Targets: p99
//!    <= 100 us inside, <= 1 ms through HTTP.
//!
//! `cargo bench -p kvroute-router --bench zmq_ingest`; without `--bench` (as `cargo test
//! --benches` runs it) it does a small quick pass.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{BlockHasher, BlockSize, LocalBlockHash};
use kvroute_http::HttpClient;
use kvroute_http::router_api::{self, BestWorker, FindBestWorker};
use kvroute_router::metrics::EventKind;
use kvroute_router::{PlaceRequest, RouterConfig, RouterState, WorkerSpec};
use kvroute_wire::vllm::encode_batch;
use kvroute_wire::{BlockStored, EngineEvent, KvEventBatch};
use tokio::net::TcpListener;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BS: usize = 16;
const CHUNK: usize = 64;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Sequence `s`'s tokens: 512 blocks, the first 128 shared by groups of 4.
fn tokens(s: u64) -> Vec<u32> {
    (0..512 * BS as u64)
        .map(|i| {
            let owner = if i < 128 * BS as u64 { s / 4 } else { 1_000_000 + s };
            (splitmix(owner * 1_000_003 + i) % 150_000) as u32
        })
        .collect()
}

/// Sequence `s` as 8 chained BlockStored batches of 64 blocks, sequence numbers from `seq`.
fn batches(s: u64, seq: &mut u64) -> Vec<ZmqMessage> {
    let t = tokens(s);
    let mut parent = None;
    (0..512 / CHUNK)
        .map(|c| {
            let hashes: Vec<u64> =
                (0..CHUNK).map(|i| splitmix(s << 20 | (c * CHUNK + i) as u64)).collect();
            let stored = BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: parent,
                token_ids: t[c * CHUNK * BS..(c + 1) * CHUNK * BS]
                    .iter()
                    .map(|&x| u64::from(x))
                    .collect(),
                block_size: BS as u32,
                medium: Some("GPU".into()),
                ..Default::default()
            };
            parent = hashes.last().copied();
            let batch = KvEventBatch {
                ts: 0.0,
                events: vec![EngineEvent::BlockStored(stored)],
                dp_rank: Some(0),
            };
            let mut m = ZmqMessage::from(b"kv-events".to_vec());
            m.push_back(seq.to_be_bytes().to_vec().into());
            m.push_back(encode_batch(&batch).into());
            *seq += 1;
            m
        })
        .collect()
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

async fn start_router(
    publisher: &mut PubSocket,
) -> (Arc<RouterState>, kvroute_router::Tasks, std::net::SocketAddr) {
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut spec = WorkerSpec::new(1);
    spec.events = Some(endpoint);
    let config =
        RouterConfig { workers: vec![spec], index: Default::default(), ..RouterConfig::default() };
    let state = Arc::new(RouterState::new(config));
    let tasks = kvroute_router::spawn_background(&state).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(kvroute_router::serve(listener, Arc::clone(&state), std::future::pending()));
    // Wait for the subscription: send probes (sequence numbers 0..) until one lands.
    let mut seq = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.view().index_stats().blocks == 0 && Instant::now() < deadline {
        for m in batches(9_999_999, &mut seq).into_iter().take(1) {
            publisher.send(m).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(state.view().index_stats().blocks > 0, "the subscription never came up");
    state.forget_blocks(kvroute_core::WorkerId(1));
    (state, tasks, addr)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let sequences: u64 = if quick { 16 } else { 1_024 };
    let mut publisher = PubSocket::new();
    let (state, _tasks, addr) = start_router(&mut publisher).await;
    let probes = (state.view().events(EventKind::Stored, true)
        + state.view().events(EventKind::Stored, false)) as usize;

    // 1. Flood.
    let mut seq = 1_000;
    let all: Vec<ZmqMessage> = (0..sequences).flat_map(|s| batches(s, &mut seq)).collect();
    let sent_blocks = all.len() * CHUNK;
    // Flow-controlled: at most WINDOW batches ahead of what the router has applied, so the PUB
    // socket's high-water mark never drops any and the figure is the subscriber's own pace.
    const WINDOW: usize = 128;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(120);
    let processed = || {
        let m = state.view();
        (m.events(EventKind::Stored, true) + m.events(EventKind::Stored, false)) as usize - probes
    };
    let batches_total = all.len();
    for (i, m) in all.into_iter().enumerate() {
        while i.saturating_sub(WINDOW) > processed() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        publisher.send(m).await.unwrap();
    }
    let mut stalled = Instant::now();
    let mut seen = processed();
    while processed() < batches_total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_micros(100)).await;
        if processed() != seen {
            (seen, stalled) = (processed(), Instant::now());
        } else if stalled.elapsed() > Duration::from_secs(1) {
            break; // the rest was dropped
        }
    }
    let applied = state.view().index_stats().held_blocks;
    let secs = start.elapsed().as_secs_f64();
    println!("| ZMQ ingest (64-block batches, one subscription) | value |");
    println!("|---|---|");
    println!("| blocks sent | {sent_blocks} |");
    println!("| batches processed | {} of {batches_total} |", processed());
    println!("| distinct blocks in the index (groups of 4 share 128 blocks) | {applied} |");
    println!("| ingested blocks/s | {:.2}M |", (processed() * CHUNK) as f64 / secs / 1e6);

    // 2. Routing at 1,000/s while 100k blocks/s stream in.
    state.forget_blocks(kvroute_core::WorkerId(1));
    let rate_blocks = 100_000.0;
    let decisions = if quick { 200 } else { 10_000 };
    let mut seq2 = seq;
    let paced: Vec<ZmqMessage> =
        (0..(decisions as u64 / 10 + 16).min(2_048)).flat_map(|s| batches(s, &mut seq2)).collect();
    let publisher_task = tokio::spawn(async move {
        let start = Instant::now();
        for (i, m) in paced.into_iter().enumerate() {
            let due = Duration::from_secs_f64((i * CHUNK) as f64 / rate_blocks);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            if publisher.send(m).await.is_err() {
                break;
            }
        }
    });
    let hasher = BlockHasher::new(BlockSize::new(BS as u32).unwrap());
    let queries: Vec<Arc<[LocalBlockHash]>> =
        (0..64).map(|s| hasher.local_hashes(&tokens(s * 3), None).into()).collect();
    let bodies: Vec<FindBestWorker> = queries
        .iter()
        .map(|q| FindBestWorker::query(q.iter().map(|l| l.0).collect(), (512 * BS) as i64))
        .collect();
    let client = HttpClient::new();
    let url = format!("http://{addr}{}", router_api::FIND_BEST_WORKER);
    let (mut inside, mut http) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for i in 0..decisions {
        let due = Duration::from_secs_f64(i as f64 / 1_000.0);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let q = &queries[i % queries.len()];
        let t = Instant::now();
        let placement = PlaceRequest {
            local_hashes: Arc::clone(q),
            num_tokens: 512 * BS,
            ..PlaceRequest::default()
        };
        std::hint::black_box(state.decide_now(&placement));
        inside.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        let answer: BestWorker = client.post_json(&url, &bodies[i % bodies.len()]).await.unwrap();
        http.push(t.elapsed().as_nanos() as u64);
        std::hint::black_box(answer);
    }
    publisher_task.abort();
    println!();
    println!(
        "| 512-block decisions at 1,000/s while ~100k blocks/s are ingested | p50 us | p99 us |"
    );
    println!("|---|---|---|");
    let us = |v: &mut Vec<u64>, p| pct(v, p) as f64 / 1e3;
    println!(
        "| inside the router (find_matches + policy) | {:.1} | {:.1} |",
        us(&mut inside, 0.5),
        us(&mut inside, 0.99)
    );
    println!(
        "| POST /find_best_worker on loopback | {:.1} | {:.1} |",
        us(&mut http, 0.5),
        us(&mut http, 0.99)
    );
    println!("\nindex blocks while routing: {}", state.view().index_stats().blocks);
}

//! The front door's added latency: the same ~100-token chat request (1 output token) sent
//! straight to a simulated worker and through the front door (preprocess, hash, route, proxy),
//! alternating, in one run. The worker runs at a very high speedup so its own time is tiny.
//! Target: the front door adds <= 0.2 ms at p50.
//!
//! `cargo bench -p kvroute-frontend --bench overhead` (without `--bench`: a quick pass).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::BlockSize;
use kvroute_frontend::FrontendState;
use kvroute_mocker::{EngineConfig, MockerConfig, Timing};
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::{FetchConfig, Fetcher};
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn once(addr: SocketAddr, body: &str) -> Duration {
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let elapsed = start.elapsed();
    assert!(response.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&response));
    elapsed
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort_unstable();
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)].as_secs_f64() * 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let n = if quick { 50 } else { 3_000 };
    let engine = EngineConfig {
        block_size: BlockSize::new(16).unwrap(),
        timing: Timing { speedup: 100_000.0 },
        ..EngineConfig::default()
    };
    let spawned = kvroute_mocker::spawn(
        MockerConfig { engine, ..MockerConfig::default() },
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .unwrap();
    let worker: SocketAddr = spawned.url.trim_start_matches("http://").parse().unwrap();
    let mut spec = WorkerSpec::new(0);
    (spec.url, spec.events, spec.replay, spec.metrics) =
        (Some(spawned.url), spawned.events, spawned.replay, spawned.metrics);
    let router =
        Arc::new(RouterState::new(RouterConfig { workers: vec![spec], ..RouterConfig::default() }));
    let _tasks = kvroute_router::spawn_background(&router).unwrap();
    let preprocessor = Arc::new(Preprocessor::load(&Preprocessor::default_model_dir()).unwrap());
    let state = Arc::new(FrontendState::new(
        preprocessor,
        Fetcher::new(FetchConfig::default()).unwrap(),
        router,
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, kvroute_frontend::app(state)).into_future());

    // ~100 prompt tokens once templated.
    let text = "The router sends each request to the worker that already holds the longest part of its prompt, unless that worker is too busy. A block is a fixed number of tokens, and every full block is hashed with the blocks before it.";
    let bodies: Vec<String> = (0..16)
        .map(|k| serde_json::json!({"messages": [{"role": "user", "content": format!("{text} Question {k}.")}], "max_tokens": 1}).to_string())
        .collect();
    for b in &bodies {
        once(front, b).await; // warm up both paths and the caches
        once(worker, b).await;
    }
    let (mut direct, mut through) = (Vec::new(), Vec::new());
    for i in 0..n {
        let b = &bodies[i % bodies.len()];
        direct.push(once(worker, b).await);
        through.push(once(front, b).await);
    }
    let (d50, d99) = (pct(&mut direct, 0.5), pct(&mut direct, 0.99));
    let (f50, f99) = (pct(&mut through, 0.5), pct(&mut through, 0.99));
    println!("| ~100-token chat, 1 output token, new connection each | p50 us | p99 us |");
    println!("|---|---|---|");
    println!("| straight to the worker | {d50:.0} | {d99:.0} |");
    println!("| through the front door | {f50:.0} | {f99:.0} |");
    println!("| added by the front door | {:.0} | {:.0} |", f50 - d50, f99 - d99);
}

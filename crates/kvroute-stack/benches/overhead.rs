//! The front door's added latency: the same ~100-token chat request (1 output token) sent
//! straight to a simulated worker's chat API and through the front door (preprocess, hash,
//! route, proxy), alternating, in one run, once per dialect (the client's body to the chat
//! API; the front door's token ids to vLLM's generate API, the answer turned back into
//! OpenAI's). The worker runs at a very high speedup so its own time is tiny. Beside them, a
//! bare HTTP round trip on the same client (`GET /health` of the worker): the floor of any
//! hop the front door adds.
//! Target (issue #29): the front door adds <= 100 µs at p50.
//!
//! `cargo bench -p kvroute-stack --bench overhead` (without `--bench`: a quick pass). With
//! `KVROUTE_BENCH_OTLP=http://127.0.0.1:4317` the spans are exported there (as `serve
//! --otlp-endpoint` does; `KVROUTE_BENCH_TRACE_RATIO`, default 1), to state their cost; without
//! it the spans are off, as in a process started without an endpoint.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::Dialect;
use kvroute_stack::{Simulated, Stack, StackConfig};

async fn once(client: &HttpClient, url: &str, body: &serde_json::Value) -> Duration {
    let start = Instant::now();
    let response = client.call(hyper::Method::POST, url, Some(body)).await.unwrap();
    let status = response.status();
    let bytes = kvroute_http::client::read_body(response.into_body(), 1 << 20).await.unwrap();
    let elapsed = start.elapsed();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
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
    let telemetry = std::env::var("KVROUTE_BENCH_OTLP").ok().map(|endpoint| {
        let ratio = std::env::var("KVROUTE_BENCH_TRACE_RATIO").map_or(1.0, |r| r.parse().unwrap());
        println!("spans exported to {endpoint}, ratio {ratio}\n");
        let tracing = kvroute_stack::settings::Tracing {
            otlp_endpoint: Some(endpoint),
            trace_ratio: Some(ratio),
            ..Default::default()
        };
        kvroute_stack::telemetry::init(Some(&tracing), "bench").unwrap()
    });
    println!("| ~100-token chat, 1 output token, kept-alive connections | p50 us | p99 us |");
    println!("|---|---|---|");
    for dialect in [Dialect::OpenaiChat, Dialect::VllmGenerate] {
        measure(dialect, n).await;
    }
    if let Some(telemetry) = telemetry {
        telemetry.flush().await;
    }
}

/// `n` requests each way over a fleet of one worker spoken to in `dialect`.
async fn measure(dialect: Dialect, n: usize) {
    let config = StackConfig {
        simulated: Simulated {
            count: 1,
            engine: EngineConfig {
                timing: Timing { speedup: 100_000.0 },
                ..EngineConfig::default()
            },
            dialect,
            ..Simulated::default()
        },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
    let worker = format!("{}/v1/chat/completions", stack.workers[0].url.as_deref().unwrap());
    let front =
        format!("{}/v1/chat/completions", stack.serve_frontend_on_loopback().await.unwrap());

    // ~100 prompt tokens once templated.
    let text = "The router sends each request to the worker that already holds the longest part of its prompt, unless that worker is too busy. A block is a fixed number of tokens, and every full block is hashed with the blocks before it.";
    let bodies: Vec<serde_json::Value> = (0..16)
        .map(|k| serde_json::json!({"messages": [{"role": "user", "content": format!("{text} Question {k}.")}], "max_tokens": 1}))
        .collect();
    // The worker's own token goes to it (as the front door's client sends it).
    let client = kvroute_router::workers_client(&stack.workers);
    for b in &bodies {
        once(&client, &front, b).await; // warm up both paths, the connections and the caches
        once(&client, &worker, b).await;
    }
    let (mut direct, mut through) = (Vec::new(), Vec::new());
    for i in 0..n {
        let b = &bodies[i % bodies.len()];
        direct.push(once(&client, &worker, b).await);
        through.push(once(&client, &front, b).await);
    }
    // A bare round trip: what one more HTTP hop costs on this machine.
    let health = format!("{}/health", stack.workers[0].url.as_deref().unwrap());
    let mut hops = Vec::new();
    for _ in 0..n {
        let start = Instant::now();
        let r = client.call(hyper::Method::GET, &health, None::<&serde_json::Value>).await.unwrap();
        let _ = kvroute_http::client::read_body(r.into_body(), 1 << 20).await.unwrap();
        hops.push(start.elapsed());
    }
    println!(
        "| {dialect}: a bare HTTP round trip (GET /health) | {:.0} | {:.0} |",
        pct(&mut hops, 0.5),
        pct(&mut hops, 0.99)
    );
    let (d50, d99) = (pct(&mut direct, 0.5), pct(&mut direct, 0.99));
    let (f50, f99) = (pct(&mut through, 0.5), pct(&mut through, 0.99));
    println!("| {dialect}: straight to the worker's chat API | {d50:.0} | {d99:.0} |");
    println!("| {dialect}: through the front door | {f50:.0} | {f99:.0} |");
    println!("| {dialect}: added by the front door | {:.0} | {:.0} |", f50 - d50, f99 - d99);
}

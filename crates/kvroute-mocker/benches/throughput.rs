//! One simulated engine's request rate: 1,000-token prompts (token ids on /v1/completions),
//! 16-token outputs, `--speedup 100`, the engine and its HTTP server on one runtime thread,
//! 64 concurrent clients (the workspace's kept-alive HTTP client) on another. Target: >= 500 requests/s.
//!
//! `cargo bench -p kvroute-mocker --bench throughput` (without `--bench`: a quick pass).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::BlockSize;
use kvroute_http::HttpClient;
use kvroute_http::openai::Completion;
use kvroute_mocker::{EngineConfig, MockerConfig, Timing, http};
use tokio::net::TcpListener;

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let total: usize = if quick { 200 } else { 6_000 };
    let connections = 64;

    // The engine and its server: one thread.
    let server =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (addr, state) = server.block_on(async {
        let engine = EngineConfig {
            block_size: BlockSize::new(16).unwrap(),
            timing: Timing { speedup: 100.0 },
            ..EngineConfig::default()
        };
        let state = kvroute_mocker::start(MockerConfig { engine, ..MockerConfig::default() })
            .await
            .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(kvroute_http::serve(
            listener,
            http::app(Arc::clone(&state)),
            std::future::pending(),
        ));
        (addr, state)
    });

    // The clients: another thread.
    let clients =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (elapsed, latencies) = clients.block_on(async move {
        let start = Instant::now();
        let per = total / connections;
        let client = HttpClient::new();
        let url = format!("http://{addr}/v1/completions");
        let tasks: Vec<_> = (0..connections)
            .map(|c| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move {
                    let mut latencies = Vec::with_capacity(per);
                    for r in 0..per {
                        // Distinct prompts (no cache hits): the engine does all the work.
                        let seed = (c * per + r) as u32;
                        let tokens: Vec<u32> = (0..1000u32)
                            .map(|t| {
                                (t.wrapping_mul(2_654_435_761)
                                    ^ seed.wrapping_mul(40_503).rotate_left(7))
                                    % 150_000
                            })
                            .collect();
                        let body = serde_json::json!({"prompt": tokens, "max_tokens": 16});
                        let t = Instant::now();
                        let answer: Completion = client.post_json(&url, &body).await.unwrap();
                        assert_eq!(answer.usage.unwrap().completion_tokens, 16);
                        latencies.push(t.elapsed());
                    }
                    latencies
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        (start.elapsed(), all)
    });
    let mut latencies = latencies;
    latencies.sort_unstable();
    let n = latencies.len();
    let pct = |p: f64| latencies[((n as f64 * p) as usize).min(n - 1)];
    println!("| requests | connections | seconds | requests/s | p50 latency | p99 latency |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {n} | {connections} | {:.2} | {:.0} | {:.1} ms | {:.1} ms |",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        pct(0.5).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3
    );
    let s = state.engine.snapshot();
    println!(
        "\nengine: {} finished, {:.2} simulated s (x100 = {:.2} s of modelled GPU time), {} prompt tokens, {} cached",
        s.stats.requests_finished,
        s.simulated_seconds,
        s.simulated_seconds * 100.0,
        s.stats.prompt_tokens,
        s.stats.cached_tokens
    );
    drop(server);
}

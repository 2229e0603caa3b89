//! One simulated engine's request rate: 1,000-token prompts (token ids on /v1/completions),
//! 16-token outputs, `--speedup 100`, the engine and its HTTP server on one runtime thread,
//! 64 kept-alive client connections on another. Target: >= 500 requests/s.
//!
//! `cargo bench -p kvroute-mocker --bench throughput` (without `--bench`: a quick pass).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::BlockSize;
use kvroute_mocker::{EngineConfig, MockerConfig, Timing, http};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

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
        tokio::spawn(axum::serve(listener, http::app(Arc::clone(&state))).into_future());
        (addr, state)
    });

    // The clients: another thread.
    let clients =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (elapsed, latencies) = clients.block_on(async move {
        let start = Instant::now();
        let per = total / connections;
        let tasks: Vec<_> = (0..connections)
            .map(|c| {
                tokio::spawn(async move {
                    let stream = TcpStream::connect(addr).await.unwrap();
                    stream.set_nodelay(true).unwrap();
                    let mut reader = BufReader::new(stream);
                    let mut latencies = Vec::with_capacity(per);
                    for r in 0..per {
                        // Distinct prompts (no cache hits): the engine does all the work.
                        let seed = (c * per + r) as u32;
                        let tokens: Vec<u32> = (0..1000u32)
                            .map(|t| (t.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503).rotate_left(7)) % 150_000)
                            .collect();
                        let body = serde_json::json!({"prompt": tokens, "max_tokens": 16}).to_string();
                        let req = format!(
                            "POST /v1/completions HTTP/1.1\r\nhost: m\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        let t = Instant::now();
                        reader.get_mut().write_all(req.as_bytes()).await.unwrap();
                        let mut len = 0;
                        loop {
                            let mut line = String::new();
                            reader.read_line(&mut line).await.unwrap();
                            if line == "\r\n" {
                                break;
                            }
                            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                                len = v.trim().parse().unwrap();
                            }
                        }
                        let mut buf = vec![0; len];
                        reader.read_exact(&mut buf).await.unwrap();
                        assert!(buf.starts_with(b"{\"choices\""), "{}", String::from_utf8_lossy(&buf));
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

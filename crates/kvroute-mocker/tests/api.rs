//! The simulated engine over real sockets on 127.0.0.1: its OpenAI API, its KV events on ZMQ
//! (and their replay), its load reports, and what a client that leaves leaves behind.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::BlockSize;
use kvroute_mocker::{Endpoints, EngineConfig, MockerConfig, Timing, http};
use kvroute_wire::EngineEvent;
use kvroute_wire::vllm::decode_batch;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use zeromq::{Socket, SocketRecv, SubSocket};

struct Mocker {
    addr: SocketAddr,
    state: Arc<http::AppState>,
}

async fn start(num_blocks: usize, endpoints: Endpoints) -> Mocker {
    let engine = EngineConfig {
        num_blocks,
        block_size: BlockSize::new(16).unwrap(),
        timing: Timing { speedup: 100.0 },
        ..EngineConfig::default()
    };
    let state =
        kvroute_mocker::start(MockerConfig { engine, endpoints, ..MockerConfig::default() })
            .await
            .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, http::app(Arc::clone(&state))).into_future());
    Mocker { addr, state }
}

async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: m\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response[9..12].parse().unwrap();
    let (_, body) = response.split_once("\r\n\r\n").unwrap();
    (status, body.to_owned())
}

async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, body) = request(addr, "POST", path, Some(&body.to_string())).await;
    (status, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

fn chat(text: &str, max_tokens: usize) -> Value {
    json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

const LONG: &str = "Please summarize the following text in three bullet points. The router sends each request to the worker that already holds the longest part of its prompt, unless that worker is too busy. A block is a fixed number of tokens.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompts_report_their_cached_tokens() {
    let m = start(1000, Endpoints::default()).await;
    let (status, first) = post_json(m.addr, "/v1/chat/completions", &chat(LONG, 5)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let words = first["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(words.split(' ').count(), 5, "readable words: {words}");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let (_, second) = post_json(m.addr, "/v1/chat/completions", &chat(LONG, 5)).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        prompt_tokens / 16 * 16
    );
    assert_eq!(
        second["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"],
        "deterministic"
    );
    // Token ids directly, on /v1/completions.
    let (status, c) = post_json(
        m.addr,
        "/v1/completions",
        &json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 2}),
    )
    .await;
    assert_eq!((status, c["object"].as_str()), (200, Some("text_completion")), "{c}");
    let (_, stats) = request(m.addr, "GET", "/stats", None).await;
    let stats: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["requests_finished"], 3);
    let (status, models) = request(m.addr, "GET", "/v1/models", None).await;
    assert!(status == 200 && models.contains("kvroute-tiny"));
    let (_, metrics) = request(m.addr, "GET", "/metrics", None).await;
    assert!(metrics.contains("kvroute_mocker_cached_prompt_tokens_total"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_as_openai_does() {
    let m = start(1000, Endpoints::default()).await;
    let mut body = chat("Tell me a joke.", 3);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) =
        request(m.addr, "POST", "/v1/chat/completions", Some(&body.to_string())).await;
    assert_eq!(status, 200);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(*data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let content: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content.split(' ').count(), 3);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 3);
}

fn png(shade: u8) -> Vec<u8> {
    let img =
        image::ImageBuffer::from_fn(84, 84, |x, y| image::Rgba([shade, x as u8, y as u8, 255]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_by_data_url_and_loopback_http_cache_per_image() {
    use base64::Engine as _;
    // A loopback image server, fetched only because the engine is told private URLs are fine.
    let images = axum::Router::new()
        .route("/a.png", axum::routing::get(|| async { png(1) }))
        .route("/b.png", axum::routing::get(|| async { png(2) }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let image_host = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, images).into_future());
    let engine = EngineConfig {
        block_size: BlockSize::new(16).unwrap(),
        timing: Timing { speedup: 100.0 },
        ..EngineConfig::default()
    };
    let fetch = kvroute_mocker::FetchConfig { allow_private: true, ..Default::default() };
    let state = kvroute_mocker::start(MockerConfig { engine, fetch, ..MockerConfig::default() })
        .await
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, http::app(state)).into_future());

    let ask = |url: String| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": LONG},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in this picture?"}]}], "max_tokens": 1})
    };
    let data_a = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png(1))
    );
    let (status, first) = post_json(addr, "/v1/chat/completions", &ask(data_a)).await;
    assert_eq!(status, 200, "{first}");
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // The same picture over http: same identifier, so every full block is cached.
    let (_, again) =
        post_json(addr, "/v1/chat/completions", &ask(format!("http://{image_host}/a.png"))).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        prompt / 16 * 16
    );
    // Another picture: only the blocks before the image are cached.
    let (_, other) =
        post_json(addr, "/v1/chat/completions", &ask(format!("http://{image_host}/b.png"))).await;
    let cached = other["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt / 16 * 16, "{cached} of {prompt}");
    let (status, missing) =
        post_json(addr, "/v1/chat/completions", &ask(format!("http://{image_host}/c.png"))).await;
    assert_eq!(status, 400, "{missing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let m = start(8, Endpoints::default()).await;
    let png = "data:image/png;base64,not-base64!";
    let cases = [
        ("{not json".to_owned(), 400),
        (json!({"messages": []}).to_string(), 400),
        (json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).to_string(), 404),
        (chat(&"word ".repeat(400), 1).to_string(), 413),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}).to_string(), 400),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}]}).to_string(), 400),
    ];
    for (body, want) in cases {
        let (status, text) = request(m.addr, "POST", "/v1/chat/completions", Some(&body)).await;
        assert_eq!(status, want, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|s| !s.is_empty()), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_frees_its_request() {
    let m = start(1000, Endpoints::default()).await;
    let mut body = chat(LONG, 100_000);
    body["stream"] = json!(true);
    let body = body.to_string();
    let mut stream = TcpStream::connect(m.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: m\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 4096];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.state.engine.snapshot().num_running_reqs == 0 {
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.state.engine.snapshot().num_running_reqs > 0 {
        assert!(Instant::now() < deadline, "the request kept running after its client left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = m.state.engine.snapshot();
    assert_eq!(
        (after.kv_cache_usage, after.stats.requests_finished),
        (0.0, 0),
        "cancelled, not finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_and_load_reports_are_published() {
    let endpoints = Endpoints {
        events: Some("tcp://127.0.0.1:0".into()),
        replay: Some("tcp://127.0.0.1:0".into()),
        metrics: Some("tcp://127.0.0.1:0".into()),
    };
    let m = start(1000, endpoints).await;
    let bound = m.state.engine.bound.clone();
    let mut load = SubSocket::new();
    load.connect(bound.metrics.as_deref().unwrap()).await.unwrap();
    load.subscribe("").await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(5), load.recv()).await.unwrap().unwrap();
    let report: Value = serde_json::from_slice(&report.into_vec().pop().unwrap()).unwrap();
    assert_eq!(report["kv_total_blocks"], 1000);

    let (status, _) = post_json(m.addr, "/v1/chat/completions", &chat(LONG, 1)).await;
    assert_eq!(status, 200);
    // What was published (before any subscriber) comes back through replay.
    let batches = kvroute_router::subscriber::replay(bound.replay.as_deref().unwrap(), 0, u64::MAX)
        .await
        .unwrap();
    assert!(!batches.is_empty());
    let stored: usize = batches
        .iter()
        .flat_map(|(_, payload)| decode_batch(payload).unwrap().events)
        .map(|e| match e {
            EngineEvent::BlockStored(s) => s.block_hashes.len(),
            _ => 0,
        })
        .sum();
    let prompt_blocks = m.state.engine.snapshot().stats.prompt_tokens as usize / 16;
    assert_eq!(stored, prompt_blocks, "every full prompt block announced once");
}

//! The front door over real sockets on 127.0.0.1, in front of a router and simulated workers:
//! routing to the worker that caches a prompt, streaming, images, errors, retries, and no
//! in-flight load left behind by a client that leaves.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::BlockSize;
use kvroute_frontend::FrontendState;
use kvroute_mocker::{EngineConfig, MockerConfig, Timing};
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::{FetchConfig, Fetcher};
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Fleet {
    addr: SocketAddr,
    router: Arc<RouterState>,
    _tasks: kvroute_router::Tasks,
}

/// `engines` simulated workers, plus `dead` workers whose URL refuses connections.
async fn fleet(engines: u64, dead: u64) -> Fleet {
    let mut workers = Vec::new();
    for k in 0..engines {
        let config = MockerConfig {
            engine: EngineConfig {
                block_size: BlockSize::new(16).unwrap(),
                timing: Timing { speedup: 100.0 },
                ..EngineConfig::default()
            },
            seed: k,
            ..MockerConfig::default()
        };
        let spawned =
            kvroute_mocker::spawn(config, TcpListener::bind("127.0.0.1:0").await.unwrap())
                .await
                .unwrap();
        let mut spec = WorkerSpec::new(k);
        (spec.url, spec.events, spec.replay, spec.metrics) =
            (Some(spawned.url), spawned.events, spawned.replay, spawned.metrics);
        workers.push(spec);
    }
    for k in 0..dead {
        // A port nobody listens on: bound, then closed.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let mut spec = WorkerSpec::new(100 + k);
        spec.url = Some(format!("http://{closed}"));
        workers.push(spec);
    }
    let router = Arc::new(RouterState::new(RouterConfig { workers, ..RouterConfig::default() }));
    let tasks = kvroute_router::spawn_background(&router).unwrap();
    let preprocessor = Arc::new(Preprocessor::load(&Preprocessor::default_model_dir()).unwrap());
    let fetcher =
        Fetcher::new(FetchConfig { allow_private: true, ..FetchConfig::default() }).unwrap();
    let state = Arc::new(FrontendState::new(preprocessor, fetcher, Arc::clone(&router)));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, kvroute_frontend::app(state)).into_future());
    Fleet { addr, router, _tasks: tasks }
}

/// (status, worker header, body)
async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, Option<String>, String) {
    let (head, body) = post_raw(addr, path, body).await;
    (head[9..12].parse().unwrap(), header(&head, "x-kvroute-worker"), body)
}

fn header(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")).map(str::to_owned)
}

/// (response head, body)
async fn post_raw(addr: SocketAddr, path: &str, body: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: f\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

/// The body of a chunked HTTP/1.1 response, de-chunked.
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

fn chat(text: &str) -> String {
    json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3}).to_string()
}

const PROMPT: &str = "Please summarize the following text in three bullet points. The router sends each request to the worker that already holds the longest part of its prompt.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_returns_to_its_worker_with_cached_tokens() {
    let f = fleet(3, 0).await;
    let (status, first_worker, body) = post(f.addr, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!(status, 200, "{body}");
    let first: Value = serde_json::from_str(&dechunk(&body)).unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // The worker's KV events reach the router asynchronously: ask again until they have.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (head, body) = post_raw(f.addr, "/v1/chat/completions", &chat(PROMPT)).await;
        let v: Value = serde_json::from_str(&dechunk(&body)).unwrap();
        assert_eq!(header(&head, "x-kvroute-worker"), first_worker, "where its blocks are");
        // The router's expectation: what the worker's events announced, never more than
        // what the worker then reports as cached.
        let predicted: u64 = header(&head, "x-kvroute-overlap-tokens").unwrap().parse().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert!(predicted <= cached, "predicted {predicted} > cached {cached}");
        if predicted == prompt_tokens / 16 * 16 {
            assert_eq!(cached, predicted);
            break;
        }
        assert!(Instant::now() < deadline, "never fully cached: {v}");
    }
    assert_eq!(f.router.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_completions_pass_through() {
    let f = fleet(2, 0).await;
    let body = json!({"messages": [{"role": "user", "content": "Tell me a joke."}], "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}}).to_string();
    let (status, worker, text) = post(f.addr, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    assert!(worker.is_some());
    let text = dechunk(&text);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(*data.last().unwrap(), "[DONE]");
    assert!(data.iter().any(|d| d.contains("\"usage\"")));
    let (status, _, c) = post(
        f.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{c}");
    assert!(dechunk(&c).contains("text_completion"));
    assert_eq!(f.router.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped() {
    let f = fleet(1, 0).await;
    for (body, want) in [
        ("{not json".to_owned(), 400),
        (json!({"model": "kvroute-tiny"}).to_string(), 400),
        (json!({"messages": []}).to_string(), 400),
        (json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).to_string(), 404),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).to_string(), 400),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/none.png"}}]}]}).to_string(), 400),
    ] {
        let (status, _, text) = post(f.addr, "/v1/chat/completions", &body).await;
        assert_eq!(status, want, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
    }
    let none = fleet(0, 0).await;
    let (status, _, text) = post(none.addr, "/v1/chat/completions", &chat("hi")).await;
    assert_eq!(status, 503, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_is_skipped_for_another() {
    let f = fleet(1, 2).await;
    for k in 0..6 {
        let (status, worker, text) =
            post(f.addr, "/v1/chat/completions", &chat(&format!("question number {k}"))).await;
        assert_eq!((status, worker.as_deref()), (200, Some("0")), "{text}");
    }
    assert_eq!(f.router.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_leaves_no_load() {
    let f = fleet(1, 0).await;
    let body = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1_000_000, "stream": true}).to_string();
    let mut stream = TcpStream::connect(f.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: f\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 2048];
    let n = stream.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    assert_eq!(f.router.in_flight(), 1);
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.router.in_flight() > 0 {
        assert!(Instant::now() < deadline, "in-flight load left behind");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn png(shade: u8) -> String {
    use base64::Engine as _;
    let img =
        image::ImageBuffer::from_fn(112, 112, |x, y| image::Rgba([shade, x as u8, y as u8, 255]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(out.into_inner())
    )
}

fn image_chat(images: &[&str]) -> String {
    let mut parts = vec![json!({"type": "text", "text": PROMPT})];
    for url in images {
        parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
        parts.push(json!({"type": "text", "text": "and"}));
    }
    json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 1}).to_string()
}

/// Sends `body` until the answer's cached tokens stop changing (events reach the router and
/// the worker's cache asynchronously); returns (worker, prompt tokens, cached tokens).
async fn settled(addr: SocketAddr, body: &str) -> (Option<String>, u64, u64) {
    let (status, worker, text) = post(addr, "/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&dechunk(&text)).unwrap();
    let usage = &v["usage"];
    (
        worker,
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_decide_what_is_reused() {
    let f = fleet(1, 0).await;
    let (a, b) = (png(1), png(2));
    let (_, prompt, cold) = settled(f.addr, &image_chat(&[&a, &b])).await;
    assert_eq!(cold, 0);
    let (_, _, warm) = settled(f.addr, &image_chat(&[&a, &b])).await;
    assert_eq!(warm, prompt / 16 * 16, "the same text and images: every full block");
    // The two images swapped: the cached prefix stops at the first image.
    let (_, _, swapped) = settled(f.addr, &image_chat(&[&b, &a])).await;
    assert!(swapped > 0 && swapped < warm, "{swapped} of {warm}: only the text before the images");
    // Another first image (never seen): the same text-only prefix, not one block more.
    let c = png(3);
    let (_, _, other) = settled(f.addr, &image_chat(&[&c, &a])).await;
    assert_eq!(other, swapped, "a different image is not reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_image_is_413() {
    let f = fleet(1, 0).await;
    let huge = format!("data:image/png;base64,{}", "A".repeat(28 << 20));
    let (status, _, text) = post(f.addr, "/v1/chat/completions", &image_chat(&[&huge])).await;
    assert_eq!(status, 413, "{}", &text[..text.len().min(200)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_router_by_url() {
    // A worker, a `kvroute router` service over HTTP, and a front door that asks it.
    let config = MockerConfig {
        engine: EngineConfig {
            block_size: BlockSize::new(16).unwrap(),
            timing: Timing { speedup: 100.0 },
            ..EngineConfig::default()
        },
        ..MockerConfig::default()
    };
    let spawned = kvroute_mocker::spawn(config, TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    let mut spec = WorkerSpec::new(7);
    (spec.url, spec.events, spec.replay, spec.metrics) =
        (Some(spawned.url), spawned.events, spawned.replay, spawned.metrics);
    let router = Arc::new(RouterState::new(RouterConfig {
        workers: vec![spec.clone()],
        ..RouterConfig::default()
    }));
    let _tasks = kvroute_router::spawn_background(&router).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(kvroute_router::serve(listener, Arc::clone(&router), std::future::pending()));

    let preprocessor = Arc::new(Preprocessor::load(&Preprocessor::default_model_dir()).unwrap());
    let fetcher = Fetcher::new(FetchConfig::default()).unwrap();
    let state = Arc::new(FrontendState::remote(
        preprocessor,
        fetcher,
        &router_url,
        &[spec],
        BlockSize::new(16).unwrap(),
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, kvroute_frontend::app(state)).into_future());

    let (status, worker, text) = post(addr, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!((status, worker.as_deref()), (200, Some("7")), "{text}");
    // The lifecycle calls reach the router in the background: in flight drops back to 0.
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.in_flight() > 0 {
        assert!(Instant::now() < deadline, "the remote router still counts the request in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(router.render_metrics().contains("kvroute_router_decisions_total 1"));
}

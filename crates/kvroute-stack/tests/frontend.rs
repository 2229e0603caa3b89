//! The front door over real sockets on 127.0.0.1, in front of a router and simulated workers
//! started by the stack builder (as `kvroute serve` starts them): routing to the worker that
//! caches a prompt, streaming, images, retries, approximate mode, readiness, a text-only
//! model, a remote router, and no in-flight load left behind by a client that leaves.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use kvroute_core::{BlockHasher, BlockSize, WorkerWithDpRank};
use kvroute_http::HttpClient;
use kvroute_http::openai::{ChatMessage, stream_chunks};
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::FetchConfig;
use kvroute_router::check_status::SILENT_AFTER;
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde_json::{Value, json};
use tokio::net::TcpListener;

struct Fleet {
    base: String,
    stack: Stack,
}

impl Fleet {
    fn router(&self) -> &Arc<RouterState> {
        self.stack.router.as_ref().unwrap()
    }

    /// The simulated workers' ids.
    fn simulated(&self) -> Vec<u64> {
        self.stack.workers.iter().filter(|w| w.events.is_some()).map(|w| w.id.0).collect()
    }
}

fn config(engines: usize, external: Vec<WorkerSpec>) -> StackConfig {
    StackConfig {
        simulated: Simulated {
            count: engines,
            engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
            ..Simulated::default()
        },
        router: RouterConfig { workers: external, ..RouterConfig::default() },
        fetch: FetchConfig { allow_private: true, ..FetchConfig::default() },
        front_door: FrontDoorOptions { expose_overlap: true, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    }
}

/// Starts `config`'s stack, waits until it is ready and serves its front door.
async fn fleet_of(config: StackConfig) -> Fleet {
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    Fleet { base, stack }
}

/// `engines` simulated workers, plus `dead` workers whose URL refuses connections.
async fn fleet(engines: usize, dead: u64) -> Fleet {
    let mut external = Vec::new();
    for k in 0..dead {
        // A port nobody listens on: bound, then closed.
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let mut spec = WorkerSpec::new(100 + k);
        spec.url = Some(format!("http://{closed}"));
        external.push(spec);
    }
    fleet_of(config(engines, external)).await
}

/// An answer: status, `x-kvroute-worker`, `x-kvroute-overlap-tokens`, body (JSON, or the
/// SSE text as a JSON string).
struct Answer {
    status: u16,
    worker: Option<u64>,
    predicted: Option<u64>,
    body: Value,
}

async fn post(base: &str, path: &str, body: &Value) -> Answer {
    let client = HttpClient::new();
    let response =
        client.call(hyper::Method::POST, &format!("{base}{path}"), Some(body)).await.unwrap();
    let header = |name: &str| {
        response.headers().get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
    };
    let (worker, predicted) = (header("x-kvroute-worker"), header("x-kvroute-overlap-tokens"));
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Answer { status, worker, predicted, body }
}

fn chat(text: &str) -> Value {
    json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3})
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

const PROMPT: &str = "Please summarize the following text in three bullet points. The router sends each request to the worker that already holds the longest part of its prompt.";

/// The blocks the front door hashes for a one-message chat.
fn blocks_of(text: &str) -> Vec<kvroute_core::LocalBlockHash> {
    let pre = Preprocessor::builtin();
    let prepared = pre.prepare_chat(&[ChatMessage::text("user", text)], true, Vec::new()).unwrap();
    BlockHasher::new(BlockSize::default()).local_hashes(&prepared.tokens, None)
}

/// Waits until the router's index holds every block of `text` on `worker`.
async fn stored(router: &RouterState, worker: u64, text: &str) {
    let blocks = blocks_of(text);
    let w = WorkerWithDpRank::new(worker, 0u32);
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.view().find_matches(&blocks).score(w) < blocks.len() as u32 {
        assert!(Instant::now() < deadline, "the worker's Stored events never reached the router");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_returns_to_its_worker_with_cached_tokens() {
    let f = fleet(3, 0).await;
    let first = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(cached(&first.body), 0);
    let prompt_tokens = first.body["usage"]["prompt_tokens"].as_u64().unwrap();
    // Only once the worker's events have reached the router is the repeat's place certain.
    stored(f.router(), first.worker.unwrap(), PROMPT).await;
    let again = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!(again.worker, first.worker, "where its blocks are");
    let full = prompt_tokens / 16 * 16;
    assert_eq!((again.predicted, cached(&again.body)), (Some(full), full));
    assert_eq!(f.router().view().in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_completions_pass_through() {
    let f = fleet(2, 0).await;
    let body = json!({"messages": [{"role": "user", "content": "Tell me a joke."}], "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}});
    let a = post(&f.base, "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200);
    assert!(a.worker.is_some());
    let (chunks, done) = stream_chunks(a.body.as_str().unwrap().as_bytes()).unwrap();
    assert!(done, "[DONE] at the end");
    // Three words, cut at the length.
    assert_eq!(chunks.iter().filter(|c| c.has_text()).count(), 3);
    let finish = chunks.iter().find_map(|c| c.choices.first()?.finish_reason.clone());
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(chunks.last().unwrap().usage.unwrap().completion_tokens, 3);
    let c =
        post(&f.base, "/v1/completions", &json!({"prompt": "Once upon a time", "max_tokens": 2}))
            .await;
    assert_eq!((c.status, c.body["object"].as_str()), (200, Some("text_completion")), "{}", c.body);
    assert_eq!(f.router().view().in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_is_skipped_for_another() {
    let f = fleet(1, 2).await;
    let live = f.simulated();
    for k in 0..6 {
        let a = post(&f.base, "/v1/chat/completions", &chat(&format!("question number {k}"))).await;
        assert_eq!((a.status, a.worker), (200, Some(live[0])), "{}", a.body);
    }
    assert_eq!(f.router().view().in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_leaves_no_load() {
    let f = fleet(1, 0).await;
    let body = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30_000,
        "ignore_eos": true, "stream": true});
    let client = HttpClient::new();
    let url = format!("{}/v1/chat/completions", f.base);
    let response = client.call(hyper::Method::POST, &url, Some(&body)).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.into_body();
    assert!(stream.frame().await.unwrap().unwrap().data_ref().is_some(), "a first chunk");
    assert_eq!(f.router().view().in_flight(), 1);
    drop(stream);
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.router().view().in_flight() > 0 {
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

fn image_chat(images: &[&str]) -> Value {
    let mut parts = vec![json!({"type": "text", "text": PROMPT})];
    for url in images {
        parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
        parts.push(json!({"type": "text", "text": "and"}));
    }
    json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
}

/// (prompt tokens, cached tokens) of an answer.
async fn usage(base: &str, body: &Value) -> (u64, u64) {
    let a = post(base, "/v1/chat/completions", body).await;
    assert_eq!(a.status, 200, "{}", a.body);
    (a.body["usage"]["prompt_tokens"].as_u64().unwrap(), cached(&a.body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_decide_what_is_reused() {
    // vLLM's generate API takes each image as its hash over its placeholders; SGLang's
    // /generate as its URL beside one image token, with the router's hash in `mm_hashes`.
    for dialect in [kvroute_router::Dialect::VllmGenerate, kvroute_router::Dialect::SglangGenerate]
    {
        images_reused_through(dialect).await;
    }
}

async fn images_reused_through(dialect: kvroute_router::Dialect) {
    let mut c = config(1, Vec::new());
    c.simulated.dialect = dialect;
    let f = fleet_of(c).await;
    let (a, b) = (png(1), png(2));
    let (prompt, cold) = usage(&f.base, &image_chat(&[&a, &b])).await;
    assert_eq!(cold, 0);
    let (_, warm) = usage(&f.base, &image_chat(&[&a, &b])).await;
    assert_eq!(warm, prompt / 16 * 16, "the same text and images: every full block");
    // The two images swapped: the cached prefix stops at the first image.
    let (_, swapped) = usage(&f.base, &image_chat(&[&b, &a])).await;
    assert!(swapped > 0 && swapped < warm, "{swapped} of {warm}: only the text before the images");
    // Another first image (never seen): the same text-only prefix, not one block more.
    let c = png(3);
    let (_, other) = usage(&f.base, &image_chat(&[&c, &a])).await;
    assert_eq!(other, swapped, "a different image is not reused");
    // Each went to the simulated worker as tokens, the images keyed by the router's hash, so
    // the engine caches an image's blocks under the hash the router predicts with (and the
    // repeat's cached tokens above are the prediction).
    let metrics: String = {
        let client = HttpClient::new();
        let response = client
            .call(hyper::Method::GET, &format!("{}/metrics", f.base), None::<&Value>)
            .await
            .unwrap();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let sample = |name: &str| kvroute_http::metrics::sample(&metrics, name);
    assert_eq!(sample("kvroute_frontend_sent_as_tokens_total"), Some(4.0), "{metrics}");
    assert_eq!(sample("kvroute_frontend_dialect_fallbacks_total"), Some(0.0));
}

/// Workers started without KV events: the router predicts their caches from where it sent
/// each prompt, and a repeat still lands where its blocks are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_without_events_are_routed_approximately() {
    let mut c = config(3, Vec::new());
    c.simulated.events = false;
    let f = fleet_of(c).await;
    let first = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let again = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    let full = first.body["usage"]["prompt_tokens"].as_u64().unwrap() / 16 * 16;
    assert_eq!(again.worker, first.worker, "its predicted blocks are there");
    assert_eq!((again.predicted, cached(&again.body)), (Some(full), full));
    let workers = f.router().view().workers();
    assert!(workers.iter().all(|w| w.mode == kvroute_router::CacheMode::Approximate));
    let chosen = workers.iter().find(|w| Some(w.id.0) == first.worker).unwrap();
    assert_eq!(chosen.tree_size[0] as u64, full / 16);
}

/// A worker whose event stream never comes up is not ready: `ready()` names it after its
/// timeout, `/workers` shows it, and it gets requests only when no other worker is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_not_ready_is_routed_last() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let mut silent = WorkerSpec::new(50);
    silent.url = Some(format!("http://{closed}"));
    silent.events = Some(format!("tcp://{closed}"));
    let stack = Stack::start(config(1, vec![silent])).await.unwrap();
    // Long enough for the other worker's parity probe on a loaded machine.
    let waiting = stack.ready(Duration::from_secs(3)).await;
    assert_eq!(waiting, [WorkerWithDpRank::new(50u64, 0u32)]);
    let router = stack.router.as_ref().unwrap();
    let status = router.view().workers().into_iter().find(|w| w.id.0 == 50).unwrap();
    assert_eq!((status.ready[0], status.connected[0]), (false, false));
    let app = stack.frontend_app().unwrap();
    for k in 0..4 {
        let (code, v) = kvroute_http::testing::call(
            &app,
            hyper::Method::POST,
            "/v1/chat/completions",
            Some(&chat(&format!("question {k}"))),
        )
        .await;
        assert_eq!(code, 200, "{v}");
    }
    let metrics = router.view().render_metrics();
    assert!(
        !metrics.contains("kvroute_router_worker_decisions_total{worker_id=\"50\""),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_only_model_serves_text_and_refuses_images() {
    let mut c = config(1, Vec::new());
    c.model_path = Some(Preprocessor::repository_model_dir().join("../tiny-text"));
    let f = fleet_of(c).await;
    let body = json!({"model": "tiny-text", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2});
    let a = post(&f.base, "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body["usage"]["prompt_tokens"].as_u64().unwrap() > 10);
    let mut with_image = image_chat(&[&png(1)]);
    with_image["model"] = json!("tiny-text");
    let a = post(&f.base, "/v1/chat/completions", &with_image).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body["error"]["message"].as_str().unwrap().contains("takes text only"), "{}", a.body);
    let a = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!(a.status, 404, "another model's name: {}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_router_by_url() {
    // A worker and a `kvroute router` service over HTTP (a stack without a front door)...
    let mut c = config(1, Vec::new());
    c.frontend = false;
    let routed = Stack::start(c).await.unwrap();
    assert!(routed.ready(Duration::from_secs(10)).await.is_empty());
    let router_url = kvroute_stack::serve_on_loopback(routed.router_app().unwrap()).await.unwrap();
    // ...and a front door that asks it.
    let front = StackConfig {
        router: RouterConfig { workers: routed.workers.clone(), ..RouterConfig::default() },
        router_url: Some(router_url),
        ..StackConfig::default()
    };
    let f = fleet_of(front).await;
    assert!(f.stack.router.is_none(), "no embedded router");
    let a = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!((a.status, a.worker), (200, Some(routed.workers[0].id.0)), "{}", a.body);
    // The lifecycle calls reach the router in the background: in flight drops back to 0.
    let router = routed.router.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.view().in_flight() > 0 {
        assert!(Instant::now() < deadline, "the remote router still counts the request in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(router.view().render_metrics().contains("kvroute_router_decisions_total 1"));
    // So does the answer's outcome, for the router's checks of itself (`POST /answers`).
    let worker = routed.workers[0].id;
    let answered = || router.view().workers().into_iter().find(|w| w.id == worker).unwrap().checks;
    while answered().answered == 0 {
        assert!(Instant::now() < deadline, "the remote router never heard of the answer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let checks = answered();
    assert_eq!((checks.answered, checks.exact), (1, 1), "a cold prompt: 0 predicted, 0 served");
    let prompt_tokens = a.body["usage"]["prompt_tokens"].as_u64().unwrap();
    let line = format!(
        "kvroute_router_answered_prompt_tokens_total{{worker_id=\"{}\"}} {prompt_tokens}",
        worker.0
    );
    assert!(router.view().render_metrics().contains(&line), "{line}");
}

/// A worker whose load the router reads from its Prometheus `/metrics` (vLLM's names, here the
/// simulated engine's): ready once read, with its capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_read_from_an_engines_prometheus_metrics() {
    let engine = kvroute_mocker::MockerConfig {
        engine: EngineConfig { num_blocks: 777, ..EngineConfig::default() },
        endpoints: kvroute_mocker::Endpoints::ephemeral(),
        ..kvroute_mocker::MockerConfig::default()
    };
    let spawned = kvroute_mocker::spawn(engine, TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    let mut spec = WorkerSpec::new(5);
    spec.metrics = Some(format!("{}/metrics", spawned.url));
    (spec.url, spec.events, spec.replay) = (Some(spawned.url), spawned.events, spawned.replay);
    let f = fleet_of(config(0, vec![spec])).await;
    let load = f.router().view().workers()[0].load[0].unwrap();
    assert_eq!((load.kv_total_blocks, load.num_running_reqs), (Some(777), Some(0)));
    let a = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
    assert_eq!((a.status, a.worker), (200, Some(5)), "{}", a.body);
}

/// `method base+path` with an optional bearer key: status and body.
async fn call_with_key(
    method: hyper::Method,
    url: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value) {
    let client = match key {
        Some(k) => HttpClient::new().with_bearer(k),
        None => HttpClient::new(),
    };
    let response = client.call(method, url, body).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned())),
    )
}

/// API keys guard the OpenAI routes, the admin token `/metrics` and `/workers` (and every
/// route of a remote router, whose token the front door sends); `/health` stays open; the
/// overlap header is not sent unless asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_guard_the_front_door_and_the_remote_router() {
    use kvroute_http::Credentials;
    use kvroute_stack::Access;
    let admin = Credentials::new(["admin-token-1"], "test").unwrap();
    // A router service with an admin token, and a front door that asks it with that token.
    let mut c = config(1, Vec::new());
    c.frontend = false;
    let routed = Stack::start(c).await.unwrap();
    assert!(routed.ready(Duration::from_secs(10)).await.is_empty());
    let router_app =
        kvroute_router::http::app(Arc::clone(routed.router.as_ref().unwrap()), admin.clone());
    let router_url = kvroute_stack::serve_on_loopback(router_app).await.unwrap();
    let access = Access {
        api_keys: Credentials::new(["sk-client-1", "sk-client-2"], "test").unwrap(),
        admin: admin.clone(),
        router_token: Some("admin-token-1".to_owned()),
    };
    let front = StackConfig {
        router: RouterConfig { workers: routed.workers.clone(), ..RouterConfig::default() },
        router_url: Some(router_url.clone()),
        access,
        ..StackConfig::default()
    };
    let f = fleet_of(front).await;
    let url = format!("{}/v1/chat/completions", f.base);
    let post = hyper::Method::POST;

    let (status, v) = call_with_key(post.clone(), &url, None, Some(&chat(PROMPT))).await;
    assert_eq!((status, v["error"]["type"].as_str()), (401, Some("invalid_request_error")), "{v}");
    let (status, v) =
        call_with_key(post.clone(), &url, Some("sk-client-3"), Some(&chat(PROMPT))).await;
    assert_eq!((status, v["error"]["code"].as_str()), (401, Some("invalid_api_key")), "{v}");
    for key in ["sk-client-1", "sk-client-2"] {
        let client = HttpClient::new().with_bearer(key);
        let response = client.call(post.clone(), &url, Some(&chat(PROMPT))).await.unwrap();
        assert_eq!(response.status(), 200, "through the guarded remote router");
        assert!(response.headers().get("x-kvroute-overlap-tokens").is_none(), "not asked for");
        assert!(response.headers().get("x-kvroute-worker").is_some());
    }
    let get = hyper::Method::GET;
    for path in ["/metrics", "/workers"] {
        let at = format!("{}{path}", f.base);
        assert_eq!(
            call_with_key(get.clone(), &at, Some("sk-client-1"), None).await.0,
            401,
            "{path}"
        );
        assert_eq!(
            call_with_key(get.clone(), &at, Some("admin-token-1"), None).await.0,
            200,
            "{path}"
        );
    }
    assert_eq!(call_with_key(get.clone(), &format!("{}/health", f.base), None, None).await.0, 200);
    // The remote router refuses callers without its token.
    let (status, _) = call_with_key(get, &format!("{router_url}/workers"), None, None).await;
    assert_eq!(status, 401);
}

/// With a cache namespace per API key, a client reuses only its own cached prefixes: another
/// key's identical prompt is computed afresh (0 cached tokens, and the router predicts 0), so
/// `cached_tokens` tells nothing of what others sent. Without it, keys share as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_its_own_cache_namespace() {
    use kvroute_http::Credentials;
    use kvroute_stack::Access;
    let keys = Credentials::new(["sk-tenant-a", "sk-tenant-b"], "test").unwrap();
    for per_key in [true, false] {
        let mut c = config(1, Vec::new());
        c.access = Access { api_keys: keys.clone(), ..Access::default() };
        c.front_door.namespace_per_key = per_key;
        let f = fleet_of(c).await;
        let url = format!("{}/v1/chat/completions", f.base);
        let ask = |key: &'static str| {
            let url = url.clone();
            async move {
                let client = HttpClient::new().with_bearer(key);
                let response =
                    client.call(hyper::Method::POST, &url, Some(&chat(PROMPT))).await.unwrap();
                let predicted: u64 = response.headers()["x-kvroute-overlap-tokens"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                let bytes = response.into_body().collect().await.unwrap().to_bytes();
                (predicted, cached(&serde_json::from_slice(&bytes).unwrap()))
            }
        };
        let worker = f.simulated()[0];
        assert_eq!(ask("sk-tenant-a").await, (0, 0));
        stored_within(f.router(), worker, PROMPT, per_key).await;
        let (predicted, cached_b) = ask("sk-tenant-b").await;
        assert_eq!(predicted, cached_b, "the router predicts what the engine serves");
        match per_key {
            true => assert_eq!(cached_b, 0, "another key's prompt is not served from cache"),
            false => assert!(cached_b > 0, "one namespace for all"),
        }
        let (predicted, cached_a) = ask("sk-tenant-a").await;
        assert!(cached_a > 0 && predicted == cached_a, "{predicted} {cached_a}");
    }
}

/// Waits until the router holds `text`'s blocks on `worker`, hashed in some key's namespace
/// (`namespaced`) or none.
async fn stored_within(router: &RouterState, worker: u64, text: &str, namespaced: bool) {
    if !namespaced {
        return stored(router, worker, text).await;
    }
    let w = WorkerWithDpRank::new(worker, 0u32);
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.view().tree_size(w) < blocks_of(text).len() {
        assert!(Instant::now() < deadline, "the worker's Stored events never reached the router");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One worker's Removed events are lost on the way to the router (its replay buffer keeps
/// them) while it evicts: the router goes on predicting blocks the engine no longer holds.
/// The over-predictions mark it drifted within 50 requests routed to it; it is resynchronised
/// from its replay; once the link is whole again its predictions agree with what it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_index_drifts_is_found_and_resynchronised() {
    let mut c = config(2, Vec::new());
    c.simulated.engine.num_blocks = 48;
    let f = fleet_of(c).await;
    let lossy = f.simulated()[0];
    f.stack.simulated[0].engine.lose_removed_events(true);
    let text = |k: usize| format!("Topic {k}. {}", "alpha beta gamma delta epsilon ".repeat(24));
    let checks = |f: &Fleet| {
        let w = f.router().view().workers().into_iter().find(|w| w.id.0 == lossy).unwrap();
        w.checks
    };
    let mut to_lossy = 0;
    let mut detected = None;
    'rounds: for round in 0..20 {
        for k in 0..12 {
            let a = post(&f.base, "/v1/chat/completions", &chat(&text(k))).await;
            assert_eq!(a.status, 200, "{}", a.body);
            if a.worker == Some(lossy) {
                to_lossy += 1;
            }
            if checks(&f).drifts > 0 {
                detected = Some((round, to_lossy));
                break 'rounds;
            }
        }
    }
    let Some((_, routed)) = detected else {
        panic!("never found drifted ({to_lossy} requests routed to it): {:?}", checks(&f))
    };
    assert!(routed <= 50, "found after {routed} requests routed to the drifting worker");
    // The link is whole again: after the resynchronisation, predictions agree.
    f.stack.simulated[0].engine.lose_removed_events(false);
    // A drifted worker's overlap counts half, so the cost may send it few requests: go on
    // (bounded) until it has answered enough of them to be judged again.
    let mut last = Vec::new();
    for round in 0..40 {
        if round >= 10 && last.len() >= 8 && !checks(&f).drifted {
            break;
        }
        for k in 0..12 {
            let a = post(&f.base, "/v1/chat/completions", &chat(&text(k + round % 3))).await;
            if a.worker == Some(lossy) {
                last.push((a.predicted.unwrap(), cached(&a.body)));
            }
        }
    }
    let status = checks(&f);
    assert!(!status.drifted, "{status:?}");
    let tail = &last[last.len().saturating_sub(8)..];
    let over = tail.iter().filter(|(p, c)| p > c).count();
    assert!(over <= 1, "predictions still over what it serves: {tail:?}");
    assert!(!tail.is_empty());
    let metrics = f.router().view().render_metrics();
    let drifts = format!("kvroute_router_worker_drifts_total{{worker_id=\"{lossy}\"}} 1");
    assert!(metrics.contains(&drifts), "{metrics}");
}

/// An engine started without KV events behind a worker whose `events` endpoint is connected
/// but silent (here another engine's publisher that serves nobody): after 20 answered
/// requests that stored new blocks without one event it is flagged, in `/workers` and
/// `/metrics`; answers served from cache do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_serves_without_events_is_flagged_silent() {
    let engine = |endpoints| kvroute_mocker::MockerConfig {
        engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
        endpoints,
        model_path: None,
        chat_template: None,
        seed: 0,
        max_model_len: None,
        dp_rank: 0,
        fetch: FetchConfig::default(),
        api_keys: kvroute_http::Credentials::default(),
        ..Default::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let quiet = kvroute_mocker::spawn(engine(kvroute_mocker::Endpoints::ephemeral()), listener)
        .await
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let serving =
        kvroute_mocker::spawn(engine(kvroute_mocker::Endpoints::without_events()), listener)
            .await
            .unwrap();
    let mut spec = WorkerSpec::new(1);
    spec.url = Some(serving.url.clone());
    spec.events = quiet.events.clone();
    // The parity probe would find it at join (see the next test); without it, serving shows.
    let mut c = config(0, vec![spec]);
    c.front_door.parity_probe = false;
    let f = fleet_of(c).await;
    // One prompt asked again and again is served from the engine's cache: nothing new to
    // announce, so only its first answer counts (a quiet worker is not a silent one).
    for _ in 0..SILENT_AFTER {
        let a = post(&f.base, "/v1/chat/completions", &chat(PROMPT)).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert!(
        !f.router().view().workers()[0].checks.silent,
        "answers served from cache are no evidence"
    );
    for k in 1..SILENT_AFTER {
        let silent = f.router().view().workers()[0].checks.silent;
        assert!(!silent, "flagged after {k} requests that stored blocks");
        let a = post(&f.base, "/v1/chat/completions", &chat(&format!("{k} {PROMPT}"))).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert!(f.router().view().workers()[0].checks.silent);
    assert!(
        f.router()
            .view()
            .render_metrics()
            .contains("kvroute_router_worker_silent{worker_id=\"1\"} 1")
    );
}

/// The parity probe at join: a worker whose engine uses another block size, one started
/// without KV events, one with another tokenizer and chat template and one that announces
/// no image keys are each flagged with their cause and routed approximately (their events
/// ignored); a proper one passes both the text and the image probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parity_probe_names_what_differs_at_join() {
    let engine = |endpoints, block_size: u32, model: Option<std::path::PathBuf>| {
        kvroute_mocker::MockerConfig {
            engine: EngineConfig {
                timing: Timing { speedup: 100.0 },
                block_size: BlockSize::new(block_size).unwrap(),
                ..EngineConfig::default()
            },
            endpoints,
            model_path: model,
            chat_template: None,
            seed: 0,
            max_model_len: None,
            dp_rank: 0,
            fetch: FetchConfig::default(),
            api_keys: kvroute_http::Credentials::default(),
            ..Default::default()
        }
    };
    let spawn = |config| async move {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        kvroute_mocker::spawn(config, listener).await.unwrap()
    };
    let ephemeral = kvroute_mocker::Endpoints::ephemeral;
    let big_blocks = spawn(engine(ephemeral(), 32, None)).await;
    let quiet = spawn(engine(ephemeral(), 16, None)).await;
    let no_events = spawn(engine(kvroute_mocker::Endpoints::without_events(), 16, None)).await;
    let text_model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-text");
    let other_model = spawn(engine(ephemeral(), 16, Some(text_model))).await;
    let no_image_keys = spawn(engine(ephemeral(), 16, None)).await;
    no_image_keys.state.engine.drop_image_keys(true);
    let spec = |id: u64, s: &kvroute_mocker::Spawned, events: &Option<String>| {
        let mut spec = WorkerSpec::new(id);
        spec.url = Some(s.url.clone());
        spec.events.clone_from(events);
        spec.replay = if events == &s.events { s.replay.clone() } else { None };
        spec
    };
    let workers = vec![
        spec(1, &big_blocks, &big_blocks.events),
        spec(2, &no_events, &quiet.events),
        spec(3, &other_model, &other_model.events),
        spec(4, &no_image_keys, &no_image_keys.events),
    ];
    let stack = Stack::start(config(1, workers)).await.unwrap();
    // Four probes fail, each after waiting 5 s for blocks that never come (on a loaded
    // machine a probe may be tried twice). The engine of another block size is also refused
    // once its events show the size (never ready, never routed to): the others are ready.
    let router = Arc::clone(stack.router.as_ref().unwrap());
    let settled = || {
        let w = router.view().workers();
        router.view().not_ready().iter().all(|r| r.worker_id.0 == 1)
            && w.iter().any(|w| w.id.0 == 1 && w.refused.is_some())
            && w.iter().all(|w| !matches!(w.parity, kvroute_router::Parity::Unchecked))
    };
    let waited = common::eventually(Duration::from_secs(30), settled).await;
    assert!(waited, "not settled: {:?}", router.view().not_ready());
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let f = Fleet { base, stack };
    let parity: std::collections::BTreeMap<u64, kvroute_router::Parity> =
        f.router().view().workers().into_iter().map(|w| (w.id.0, w.parity)).collect();
    let cause = |id: u64| match &parity[&id] {
        kvroute_router::Parity::Failed(cause) => cause.clone(),
        other => panic!("worker {id}: {other:?}"),
    };
    assert!(
        cause(1).starts_with("block size: the engine's KV events carry blocks of 32 tokens"),
        "{}",
        cause(1)
    );
    assert!(cause(2).starts_with("no KV events"), "{}", cause(2));
    assert!(cause(3).starts_with("token ids"), "{}", cause(3));
    assert!(cause(4).starts_with("image keys"), "{}", cause(4));
    let good = f.stack.workers.last().unwrap().id.0; // the simulated one, after the others
    assert_eq!(parity[&good], kvroute_router::Parity::Ok);
    let modes: Vec<(u64, kvroute_router::CacheMode)> =
        f.router().view().workers().into_iter().map(|w| (w.id.0, w.mode)).collect();
    for (id, mode) in modes {
        let want = if id == good {
            kvroute_router::CacheMode::Events
        } else {
            kvroute_router::CacheMode::Approximate
        };
        assert_eq!(mode, want, "worker {id}");
    }
}

/// A probe that cannot be made costs nothing and says so: a worker that answers but whose
/// event stream never connects is not probed until it does, each try after a backoff that
/// doubles, and `/workers` names the cause; readiness waits no longer than its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_cannot_be_made_backs_off_and_names_its_cause() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = kvroute_mocker::spawn(
        kvroute_mocker::MockerConfig {
            endpoints: kvroute_mocker::Endpoints::without_events(),
            ..kvroute_mocker::MockerConfig::default()
        },
        listener,
    )
    .await
    .unwrap();
    // Its `events` name a port bound and closed again: the subscription never connects.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut spec = WorkerSpec::new(7);
    spec.url = Some(engine.url.clone());
    spec.events = Some(format!("tcp://{dead}"));
    let stack = Stack::start(config(0, vec![spec])).await.unwrap();
    let start = std::time::Instant::now();
    let waiting = stack.ready(Duration::from_millis(2500)).await;
    assert!(start.elapsed() < Duration::from_secs(4), "ready waited {:?}", start.elapsed());
    assert_eq!(waiting.len(), 1);
    let said = stack.waiting_for(&waiting);
    assert!(said.contains("its event stream") && said.contains("its parity probe"), "{said}");
    let parity = stack.router.as_ref().unwrap().view().workers()[0].parity.clone();
    let kvroute_router::Parity::Retrying(cause) = parity else { panic!("{parity:?}") };
    assert!(cause.contains("not connected and caught up"), "{cause}");
    // 1 s, then 2 s: two or three tries in 2.5 s, not one a second.
    let next: u64 =
        cause.rsplit("next try in ").next().unwrap().trim_end_matches(" s").parse().unwrap();
    assert!(next >= 2, "{cause}");
}

//! Adapters and sessions through the front door, over real sockets on 127.0.0.1: vLLM 0.33's
//! own adapter event found only by requests for that adapter, an adapter's blocks kept apart
//! per API key, requests routed only to workers that serve their adapter, sessions kept on
//! their worker, and bad models and session keys refused with nothing left in flight.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use kvroute_core::{BlockSize, WorkerWithDpRank};
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::{RouterConfig, RouterState};
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use kvroute_wire::{ConvertConfig, EventFormat, Pipeline};
use serde_json::{Value, json};

fn config(engines: usize, block_size: u32, adapters: &[&str]) -> StackConfig {
    let bs = BlockSize::new(block_size).unwrap();
    StackConfig {
        simulated: Simulated {
            count: engines,
            engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
            lora_modules: adapters.iter().map(|a| ((*a).to_owned(), None)).collect(),
            ..Simulated::default()
        },
        router: RouterConfig { block_size: bs, ..RouterConfig::default() },
        front_door: FrontDoorOptions { expose_overlap: true, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    }
}

async fn started(config: StackConfig) -> (Stack, String) {
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    (stack, base)
}

/// Status, `x-kvroute-worker`, `x-kvroute-overlap-tokens`, body.
async fn post_with(
    client: &HttpClient,
    url: &str,
    body: &Value,
) -> (u16, Option<u64>, Option<u64>, Value) {
    let response = client.call(hyper::Method::POST, url, Some(body)).await.unwrap();
    let header = |name: &str| {
        response.headers().get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
    };
    let (worker, predicted) = (header("x-kvroute-worker"), header("x-kvroute-overlap-tokens"));
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, worker, predicted, body)
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// vLLM 0.33's own bytes (`fixture_vllm033_tiers.json`, the adapter batch: `lora_name`
/// "sql-adapter", tokens 400..407, block size 4), through the subscriber's pipeline into the
/// router: a completion for that adapter over those tokens finds both blocks; the base model
/// and another adapter find nothing; an unknown model is a 404 `model_not_found`, and nothing
/// stays in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_033s_adapter_event_is_found_by_that_adapter_only() {
    let (stack, base) = started(config(1, 4, &["sql-adapter", "chat"])).await;
    let router: &RouterState = stack.router.as_ref().unwrap();
    let worker = WorkerWithDpRank::new(stack.workers[0].id, 0u32);
    let fixture: Vec<Vec<String>> = serde_json::from_str(include_str!(
        "../../kvroute-wire/tests/fixtures/fixture_vllm033_tiers.json"
    ))
    .unwrap();
    let frames: Vec<Vec<u8>> = fixture[4].iter().map(|h| hex(h)).collect();
    let mut pipeline =
        Pipeline::new(worker, EventFormat::Vllm, ConvertConfig::new(BlockSize::new(4).unwrap()));
    let decoded = pipeline.decode(pipeline.frame(&frames).unwrap()).unwrap();
    assert_eq!(router.apply(&decoded.events), 1, "one BlockStored of two blocks");

    let client = HttpClient::new();
    let url = format!("{base}/v1/completions");
    let ask = |model: &str| json!({"model": model, "prompt": (400..412).collect::<Vec<u32>>(), "max_tokens": 1});
    let (status, _, predicted, body) = post_with(&client, &url, &ask("sql-adapter")).await;
    assert_eq!((status, predicted), (200, Some(8)), "both blocks of the adapter: {body}");
    assert_eq!(body["model"], "sql-adapter", "the answer names the adapter, as vLLM's does");
    for other in ["kvroute-tiny", "chat"] {
        let (status, _, predicted, body) = post_with(&client, &url, &ask(other)).await;
        assert_eq!((status, predicted), (200, Some(0)), "{other} finds nothing: {body}");
    }
    let (status, _, _, body) = post_with(&client, &url, &ask("sql")).await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("model_not_found")), "{body}");
    let (_, models) = client.get(&format!("{base}/v1/models")).await.unwrap();
    let models: Value = serde_json::from_slice(&models).unwrap();
    let ids: Vec<&str> =
        models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["kvroute-tiny", "chat", "sql-adapter"], "{models}");
    assert_eq!(models["data"][2]["parent"], "kvroute-tiny");
    assert_eq!(router.view().in_flight(), 0);
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

const PROMPT: &str = "Translate the following question into SQL over the orders table: which customers ordered more than three times last month, and what did they spend in all?";

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2})
}

/// With a cache namespace per API key, the adapter and the key's namespace both salt the
/// hashes: one key's adapter blocks never hit another key's, nor the same key's base model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_adapter_blocks_never_hit_anothers() {
    use kvroute_http::Credentials;
    use kvroute_stack::Access;
    let mut c = config(1, 16, &["sql"]);
    let keys = Credentials::new(["sk-tenant-a", "sk-tenant-b"], "test").unwrap();
    c.access = Access { api_keys: keys, ..Access::default() };
    c.front_door.namespace_per_key = true;
    let (stack, base) = started(c).await;
    let router = stack.router.as_ref().unwrap();
    let url = format!("{base}/v1/chat/completions");
    let a = HttpClient::new().with_bearer("sk-tenant-a");
    let b = HttpClient::new().with_bearer("sk-tenant-b");
    let w = WorkerWithDpRank::new(stack.workers[0].id, 0u32);
    // The parity probe's blocks are in before the first request (the probe passes on them).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !router.view().workers().iter().all(|s| s.parity == kvroute_router::Parity::Ok) {
        assert!(Instant::now() < deadline, "the parity probe never passed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = router.view().tree_size(w);
    let (status, _, predicted, first) = post_with(&a, &url, &chat("sql")).await;
    assert_eq!((status, predicted, cached(&first)), (200, Some(0), 0), "{first}");
    let full_blocks = first["usage"]["prompt_tokens"].as_u64().unwrap() as usize / 16;
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.view().tree_size(w) < before + full_blocks {
        assert!(Instant::now() < deadline, "the worker's Stored events never reached the router");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (_, _, predicted, other_key) = post_with(&b, &url, &chat("sql")).await;
    assert_eq!((predicted, cached(&other_key)), (Some(0), 0), "another key: {other_key}");
    let (_, _, predicted, base_model) = post_with(&a, &url, &chat("kvroute-tiny")).await;
    assert_eq!((predicted, cached(&base_model)), (Some(0), 0), "the base model: {base_model}");
    let (_, _, predicted, again) = post_with(&a, &url, &chat("sql")).await;
    assert!(cached(&again) > 0 && predicted == Some(cached(&again)), "{predicted:?} {again}");
}

/// A worker that does not list an adapter (here it was unloaded through vLLM's dynamic API)
/// gets none of its requests once the front door has read the lists again; the base model
/// still goes anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_goes_only_to_workers_that_serve_it() {
    let (stack, base) = started(config(2, 16, &["sql"])).await;
    let frontend = stack.frontend.as_ref().unwrap();
    assert!(stack.simulated[1].catalog.remove("sql"));
    frontend.discover_models().await;
    let serving = stack.workers[0].id.0;
    let client = HttpClient::new();
    let url = format!("{base}/v1/chat/completions");
    for k in 0..6 {
        let mut body = chat("sql");
        body["messages"][0]["content"] = json!(format!("{k} {PROMPT}"));
        let (status, worker, _, answer) = post_with(&client, &url, &body).await;
        assert_eq!((status, worker), (200, Some(serving)), "{answer}");
    }
    let router = stack.router.as_ref().unwrap();
    let considered: Vec<usize> =
        router.view().recent_decisions().iter().map(|d| d.considered).collect();
    assert_eq!(considered, [1; 6], "one candidate for the adapter");
    let mut body = chat("kvroute-tiny");
    body["messages"][0]["content"] = json!("base");
    assert_eq!(post_with(&client, &url, &body).await.0, 200);
    let last = router.view().recent_decisions().pop().unwrap();
    assert_eq!(last.considered, 2, "the base model may go to both");
}

/// A session (`prompt_cache_key`, else `x-session-id`) stays on its worker while its cost
/// there is within the margin, counted on `/metrics`; a key past 256 bytes is a 400 naming
/// its field, and nothing stays in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stay_on_their_worker_and_long_keys_are_refused() {
    let (stack, base) = started(config(3, 16, &[])).await;
    let router = stack.router.as_ref().unwrap();
    let client = HttpClient::new();
    let url = format!("{base}/v1/chat/completions");
    let mut first = chat("kvroute-tiny");
    first["prompt_cache_key"] = json!("conversation-1");
    let (status, worker, _, body) = post_with(&client, &url, &first).await;
    assert_eq!(status, 200, "{body}");
    for k in 0..4 {
        // Prompts that share nothing: only the session keeps them together.
        let mut next = json!({"model": "kvroute-tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("{k} unrelated {}", "words ".repeat(k))}]});
        next["prompt_cache_key"] = json!("conversation-1");
        assert_eq!(post_with(&client, &url, &next).await.1, worker, "turn {k}");
    }
    let (counts, sessions) = router.view().affinity();
    assert_eq!((counts.new, counts.kept, counts.moved, sessions), (1, 4, 0, 1));
    let (_, metrics) = client.get(&format!("{base}/metrics")).await.unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics.contains("kvroute_router_session_requests_total{affinity=\"kept\"} 4"),
        "{metrics}"
    );

    let mut long = chat("kvroute-tiny");
    long["prompt_cache_key"] = json!("k".repeat(257));
    let (status, _, _, body) = post_with(&client, &url, &long).await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("prompt_cache_key")),
        "{body}"
    );
    let request = hyper::Request::post(&url)
        .header("content-type", "application/json")
        .header("x-session-id", "h".repeat(300))
        .body(http_body_util::Full::new(hyper::body::Bytes::from(chat("kvroute-tiny").to_string())))
        .unwrap();
    let response = client.send(request).await.unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["error"]["param"], "x-session-id", "{body}");
    assert_eq!(router.view().in_flight(), 0);
    assert_eq!(router.view().affinity().1, 1, "refused keys are not remembered");
}

/// With `load_adapters`, a worker that does not list the request's adapter loads it through
/// vLLM's dynamic API (with the path the settings give) before the request goes there;
/// without it, an adapter no worker lists has nowhere to go (503) and nothing stays in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_is_loaded_on_demand_only_when_asked() {
    for load in [true, false] {
        let mut c = config(2, 16, &[]);
        c.simulated.lora_updating = true;
        c.adapters = vec!["sql=/loras/sql".to_owned()];
        c.front_door.load_adapters = load;
        let (stack, base) = started(c).await;
        stack.frontend.as_ref().unwrap().discover_models().await;
        let url = format!("{base}/v1/chat/completions");
        let (status, worker, _, body) = post_with(&HttpClient::new(), &url, &chat("sql")).await;
        match load {
            true => {
                assert_eq!(status, 200, "{body}");
                let k = stack.workers.iter().position(|w| Some(w.id.0) == worker).unwrap();
                let listed = stack.simulated[k].catalog.list();
                assert_eq!(listed.data[1].root.as_deref(), Some("/loras/sql"), "{listed:?}");
            }
            false => assert_eq!(status, 503, "{body}"),
        }
        assert_eq!(stack.router.as_ref().unwrap().view().in_flight(), 0);
    }
}

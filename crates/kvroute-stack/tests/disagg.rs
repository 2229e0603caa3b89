//! A disaggregated fleet end to end over real sockets on 127.0.0.1: the front door places a
//! request in a pair, sends vLLM's prefill leg and then the decode leg with the prefill's
//! `kv_transfer_params`, and leaves nothing held or in flight; a prefill or decode worker
//! that is gone is routed around and the client still gets its answer.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::eventually;

use http_body_util::BodyExt;
use kvroute_core::BlockSize;
use kvroute_core::schedule::{PairConfig, Role, SchedulerConfig};
use kvroute_http::HttpClient;
use kvroute_mocker::{DisaggConfig, EngineConfig, Timing};
use kvroute_router::{RouterConfig, WorkerSpec};
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde_json::{Value, json};

/// `prefill` + `decode` simulated engines, always split (in place never), short leases.
fn config(prefill: usize, decode: usize, external: Vec<WorkerSpec>) -> StackConfig {
    let pairs = PairConfig { in_place: 0.0, ..PairConfig::default() };
    let disagg =
        DisaggConfig { hold_timeout: Duration::from_millis(500), ..DisaggConfig::default() };
    StackConfig {
        simulated: Simulated {
            prefill,
            decode,
            engine: EngineConfig {
                num_blocks: 400,
                timing: Timing { speedup: 50.0 },
                disagg,
                ..EngineConfig::default()
            },
            ..Simulated::default()
        },
        router: RouterConfig {
            block_size: BlockSize::new(16).unwrap(),
            workers: external,
            scheduler: SchedulerConfig { pairs, ..SchedulerConfig::default() },
            ..RouterConfig::default()
        },
        // No parity probe: the prefill worker's requests are the test's alone.
        front_door: FrontDoorOptions { parity_probe: false, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    }
}

/// A worker of `role` at a loopback port nobody listens on.
async fn gone(id: u64, role: Role) -> WorkerSpec {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let mut spec = WorkerSpec::new(id);
    spec.url = Some(format!("http://127.0.0.1:{port}"));
    spec.role = role;
    spec
}

/// Status, `x-kvroute-worker`, the answer.
async fn ask(url: &str, stream: bool) -> (u16, u64, Value, String) {
    let prompt: Vec<u32> = (0..300).map(|t| 3 + (t * 11) % 900).collect();
    let mut body = json!({"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 6});
    if stream {
        body["stream"] = json!(true);
    }
    let response = HttpClient::new().call(hyper::Method::POST, url, Some(&body)).await.unwrap();
    let worker = response.headers().get("x-kvroute-worker").and_then(|v| v.to_str().ok());
    let worker = worker.and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let answer = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, worker, answer, text)
}

fn held(stack: &Stack) -> u64 {
    stack.simulated.iter().map(|e| e.engine.snapshot().stats.held_blocks).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_prefills_on_one_worker_and_decodes_on_the_other() {
    let stack = Stack::start(config(1, 1, Vec::new())).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let url = format!("{base}/v1/completions");
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    let prefill = stack.simulated.iter().find(|e| e.engine.config.disagg.role == Role::Prefill);
    let prefill = &prefill.unwrap().engine;
    let before = prefill.snapshot().stats.requests_finished;

    let (status, worker, answer, _) = ask(&url, false).await;
    assert_eq!((status, worker), (200, decode), "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 6);
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached, Some(299 / 16 * 16), "the decode worker pulled the prompt's KV");
    let (status, worker, _, text) = ask(&url, true).await;
    assert_eq!((status, worker), (200, decode));
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    let router = stack.router.as_ref().unwrap();
    assert_eq!(router.pair_counts().split, 2);
    assert!(eventually(Duration::from_secs(10), || held(&stack) == 0).await, "every hold pulled");
    assert_eq!(router.in_flight(), 0, "neither leg left in flight");
    let stats = prefill.snapshot().stats;
    assert_eq!(stats.requests_finished - before, 2, "both prefilled on the prefill worker");
}

/// A prefill worker that answers its health check but fails every request (HTTP 500).
async fn failing(id: u64) -> WorkerSpec {
    use axum::routing::{get, post};
    let app = axum::Router::new().route("/health", get(|| async { "ok" })).route(
        "/v1/completions",
        post(|| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "engine dead") }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut spec = WorkerSpec::new(id);
    spec.url = Some(format!("http://{}", listener.local_addr().unwrap()));
    spec.role = Role::Prefill;
    tokio::spawn(async move { axum::serve(listener, app).await });
    spec
}

/// The only prefill worker fails: the prefill leg is counted, the worker left out, and the
/// request prefilled where it decodes; the client gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_fails_is_routed_around() {
    let stack = Stack::start(config(0, 1, vec![failing(50).await])).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    let (status, worker, answer, _) = ask(&format!("{base}/v1/completions"), false).await;
    assert_eq!((status, worker), (200, decode), "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 6);
    let router = stack.router.as_ref().unwrap();
    assert_eq!(router.in_flight(), 0);
    assert_eq!(router.pair_counts().in_place, 1, "placed again, in place");
    let (_, metrics) = HttpClient::new().get(&format!("{base}/metrics")).await.unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvroute_frontend_pd_prefill_failures_total 1"), "{metrics}");
}

/// A decode worker that is gone: its prefill's hold ends with its lease, the request goes to
/// the decode worker that is there, and nothing stays held or in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_that_is_gone_leaves_nothing_held() {
    let dead = vec![gone(60, Role::Decode).await, gone(61, Role::Decode).await];
    let stack = Stack::start(config(1, 1, dead)).await.unwrap();
    stack.ready(Duration::from_secs(10)).await;
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let live = stack.workers.iter().find(|w| w.role == Role::Decode && w.events.is_some());
    let (status, worker, answer, _) = ask(&format!("{base}/v1/completions"), false).await;
    assert_eq!((status, worker), (200, live.unwrap().id.0), "{answer}");
    assert!(eventually(Duration::from_secs(10), || held(&stack) == 0).await, "holds freed");
    assert_eq!(stack.router.as_ref().unwrap().in_flight(), 0);
}

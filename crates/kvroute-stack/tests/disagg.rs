//! A disaggregated fleet end to end over real sockets on 127.0.0.1: the front door places a
//! request in a pair, sends vLLM's prefill leg and then the decode leg with the prefill's
//! `kv_transfer_params` (or SGLang's two legs at once with a bootstrap room), and leaves
//! nothing held or in flight; a prefill or decode worker that is gone, a prefill engine that
//! dies before the pull, and a decode engine that says its handoff failed are routed around
//! and the client still gets its answer.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::response::IntoResponse as _;
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

/// A whole and a streamed request, each answered by `decode` with the prompt's KV pulled.
async fn answered_by_pulls(base: &str, decode: u64) {
    for stream in [false, true] {
        let (status, worker, answer, text) = ask(&format!("{base}/v1/completions"), stream).await;
        assert_eq!((status, worker), (200, decode), "{text}");
        if !stream {
            assert_eq!(answer["usage"]["completion_tokens"], 6);
            let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
            assert_eq!(cached, Some(299 / 16 * 16), "the decode worker pulled the KV: {answer}");
        } else {
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        }
    }
}

fn held(stack: &Stack) -> u64 {
    stack.simulated.iter().map(|e| e.engine.snapshot().stats.held_blocks).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_prefills_on_one_worker_and_decodes_on_the_other() {
    let stack = Stack::start(config(1, 1, Vec::new())).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    let prefill = stack.simulated.iter().find(|e| e.engine.config.disagg.role == Role::Prefill);
    let prefill = &prefill.unwrap().engine;
    let before = prefill.snapshot().stats.requests_finished;

    answered_by_pulls(&base, decode).await;

    let router = stack.router.as_ref().unwrap();
    assert_eq!(router.view().pair_counts().split, 2);
    assert!(eventually(Duration::from_secs(10), || held(&stack) == 0).await, "every hold pulled");
    assert_eq!(router.view().in_flight(), 0, "neither leg left in flight");
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
    assert_eq!(router.view().in_flight(), 0);
    assert_eq!(router.view().pair_counts().in_place, 1, "placed again, in place");
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
    assert_eq!(stack.router.as_ref().unwrap().view().in_flight(), 0);
}

/// A worker of `role` answering `/v1/completions` with `answer` (the body it got in, the
/// answer out) and its health check with "ok".
async fn fake(id: u64, role: Role, answer: fn(&Value) -> axum::response::Response) -> WorkerSpec {
    use axum::routing::{get, post};
    let app = axum::Router::new().route("/health", get(|| async { "ok" })).route(
        "/v1/completions",
        post(move |axum::Json(body): axum::Json<Value>| async move { answer(&body) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut spec = WorkerSpec::new(id);
    spec.url = Some(format!("http://{}", listener.local_addr().unwrap()));
    spec.role = role;
    tokio::spawn(async move { axum::serve(listener, app).await });
    spec
}

/// A prefill engine that answered its leg and died before the pull: its `kv_transfer_params`
/// name a side channel nobody listens on.
fn prefilled_then_died(_: &Value) -> axum::response::Response {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "gone", "remote_request_id": "r-gone", "remote_block_ids": [[0, 1]],
        "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1});
    axum::Json(json!({"id": "x", "object": "text_completion", "kv_transfer_params": params,
        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301}}))
    .into_response()
}

/// The fault "a prefill engine dies before the pull", as vLLM 0.33 meets it by default: the
/// decode engine's pull fails and it answers 500 (`kv_load_failure_policy = "fail"`). The
/// front door blames the prefill worker, not the decode worker that said so: the request is
/// placed again without it (here in place), the client gets its answer, nobody is ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_that_dies_before_the_pull_is_placed_again() {
    let stack =
        Stack::start(config(0, 1, vec![fake(70, Role::Prefill, prefilled_then_died).await]));
    let stack = stack.await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    for stream in [false, true] {
        let (status, worker, answer, text) = ask(&format!("{base}/v1/completions"), stream).await;
        assert_eq!((status, worker), (200, decode), "{text}");
        if !stream {
            assert_eq!(answer["usage"]["completion_tokens"], 6);
        }
    }
    let failures = stack.simulated.iter().map(|e| e.holds.counts.pull_failures.load(Relaxed));
    assert_eq!(failures.sum::<u64>(), 2, "the decode engine tried each pull and failed it");
    let router = stack.router.as_ref().unwrap();
    assert_eq!((router.view().pair_counts().split, router.view().pair_counts().in_place), (2, 2));
    assert_eq!(router.view().in_flight(), 0);
    let (_, metrics) = HttpClient::new().get(&format!("{base}/metrics")).await.unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvroute_frontend_pd_handoff_failures_total 2"), "{metrics}");
    assert!(
        metrics.contains("kvroute_frontend_worker_ejections_total 0"),
        "none ejected: {metrics}"
    );
}

/// A decode engine that streams its failed handoff as an error event in a 200 answer (as
/// vLLM's streaming API does) and serves a request it prefills itself.
fn streams_a_failed_handoff(body: &Value) -> axum::response::Response {
    let event = match body.pointer("/kv_transfer_params/do_remote_prefill") {
        Some(Value::Bool(true)) => json!({"error": {"message": "Internal server error",
            "type": "InternalServerError", "param": null, "code": 500}}),
        _ => json!({"id": "x", "object": "text_completion",
            "choices": [{"index": 0, "text": "fine", "finish_reason": "length"}]}),
    };
    let sse = format!("data: {event}\n\ndata: [DONE]\n\n");
    ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], sse).into_response()
}

/// A streamed decode leg whose first event is an error is not passed to the client: the
/// request is placed again without its prefill worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_opening_with_a_failed_handoff_is_placed_again() {
    let decode = fake(80, Role::Decode, streams_a_failed_handoff).await;
    let stack = Stack::start(config(1, 0, vec![decode])).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let (status, worker, _, text) = ask(&format!("{base}/v1/completions"), true).await;
    assert_eq!((status, worker), (200, 80), "{text}");
    assert!(text.contains("fine") && !text.contains("InternalServerError"), "{text}");
    let router = stack.router.as_ref().unwrap();
    assert_eq!((router.view().pair_counts().split, router.view().pair_counts().in_place), (1, 1));
    assert!(eventually(Duration::from_secs(10), || router.view().in_flight() == 0).await);
}

/// A simulated SGLang prefill engine outside the stack, declared as SGLang's prefill workers
/// are: the `sglang-generate` dialect and its bootstrap port.
async fn sglang_prefill(id: u64) -> (WorkerSpec, kvroute_mocker::Spawned) {
    let disagg = DisaggConfig { role: Role::Prefill, ..DisaggConfig::default() };
    let engine = EngineConfig {
        num_blocks: 400,
        timing: Timing { speedup: 50.0 },
        disagg,
        ..EngineConfig::default()
    };
    let config = kvroute_mocker::MockerConfig {
        engine,
        endpoints: kvroute_mocker::Endpoints::ephemeral(),
        ..kvroute_mocker::MockerConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let spawned = kvroute_mocker::spawn(config, listener).await.unwrap();
    let mut spec = WorkerSpec::new(id);
    spec.url = Some(spawned.url.clone());
    spec.events = spawned.events.clone();
    spec.role = Role::Prefill;
    spec.dialect = kvroute_router::Dialect::SglangGenerate;
    spec.bootstrap_port = spawned.state.side_channel.map(|a| a.port());
    (spec, spawned)
}

/// SGLang's protocol through the front door: both legs at once with one bootstrap room; the
/// decode worker pulls the prefill's KV and answers; nothing stays held or in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_pair_shares_a_bootstrap_room() {
    let (spec, prefill) = sglang_prefill(90).await;
    let stack = Stack::start(config(0, 1, vec![spec])).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    answered_by_pulls(&base, decode).await;
    let router = stack.router.as_ref().unwrap();
    assert_eq!(router.view().pair_counts().split, 2);
    let pulled = || prefill.state.holds.counts.pulled.load(Relaxed) == 2;
    assert!(eventually(Duration::from_secs(10), pulled).await, "both rooms pulled");
    let freed = || prefill.state.engine.snapshot().stats.held_blocks == 0;
    assert!(eventually(Duration::from_secs(10), freed).await, "nothing held");
    assert!(eventually(Duration::from_secs(10), || router.view().in_flight() == 0).await);
}

/// An SGLang prefill worker that fails (HTTP 500) while its decode leg waits on a bootstrap
/// server that never hands the room over: the decode leg is dropped at once rather than
/// after its wait (30 s here), the prefill worker left out, and the request placed again in
/// place. Its decode engine's pull never fails: it was never left to wait it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_sglang_prefill_drops_its_waiting_decode_leg() {
    use axum::routing::{get, post};
    let app = axum::Router::new().route("/health", get(|| async { "ok" })).route(
        "/generate",
        post(|| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "engine dead") }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut spec = WorkerSpec::new(95);
    spec.url = Some(format!("http://{}", listener.local_addr().unwrap()));
    spec.role = Role::Prefill;
    spec.dialect = kvroute_router::Dialect::SglangGenerate;
    tokio::spawn(async move { axum::serve(listener, app).await });
    // A bootstrap server that takes connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    spec.bootstrap_port = Some(silent.local_addr().unwrap().port());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let mut config = config(0, 1, vec![spec]);
    config.simulated.engine.disagg.hold_timeout = Duration::from_secs(30);
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    let url = format!("{base}/v1/completions");
    let asked = ask(&url, false);
    let answered = tokio::time::timeout(Duration::from_secs(20), asked).await;
    let (status, worker, answer, _) = answered.expect("the decode leg waited for its prefill");
    assert_eq!((status, worker), (200, decode), "{answer}");
    let router = stack.router.as_ref().unwrap();
    assert_eq!((router.view().pair_counts().split, router.view().pair_counts().in_place), (1, 1));
    let failures = stack.simulated.iter().map(|e| e.holds.counts.pull_failures.load(Relaxed));
    assert_eq!(failures.sum::<u64>(), 0, "the waiting decode leg was dropped, not failed");
    let (_, metrics) = HttpClient::new().get(&format!("{base}/metrics")).await.unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvroute_frontend_pd_prefill_failures_total 1"), "{metrics}");
    assert!(eventually(Duration::from_secs(10), || router.view().in_flight() == 0).await);
}

/// A front door in front of a remote `kvroute router` whose fleet is disaggregated: the
/// router's `/find_best_worker` answers the pair, the front door sends both legs, and both
/// legs' in-flight entries end at the router (the prefill leg's id, `{id}/prefill`, is one
/// path segment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_router_places_pairs() {
    let mut routed = config(1, 1, Vec::new());
    routed.frontend = false;
    let routed = Stack::start(routed).await.unwrap();
    assert!(routed.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let router_url = kvroute_stack::serve_on_loopback(routed.router_app().unwrap()).await.unwrap();
    let front = StackConfig {
        router: RouterConfig {
            block_size: BlockSize::new(16).unwrap(),
            workers: routed.workers.clone(),
            ..RouterConfig::default()
        },
        router_url: Some(router_url.clone()),
        front_door: FrontDoorOptions { parity_probe: false, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    };
    let front = Stack::start(front).await.unwrap();
    assert!(front.router.is_none(), "no embedded router");
    let base = front.serve_frontend_on_loopback().await.unwrap();
    let decode = routed.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    answered_by_pulls(&base, decode).await;
    let router = routed.router.as_ref().unwrap();
    assert_eq!(router.view().pair_counts().split, 2, "the remote router placed both in pairs");
    let ended = || router.view().in_flight() == 0;
    assert!(eventually(Duration::from_secs(10), ended).await, "both legs ended at the router");
    assert!(eventually(Duration::from_secs(10), || held(&routed) == 0).await, "all pulled");
    // The answer names the pair.
    let prompt: Vec<u64> = (0..20).collect();
    let query = json!({"local_hashes": prompt, "num_tokens": 320});
    let best: Value = HttpClient::new()
        .post_json(&format!("{router_url}/find_best_worker"), &query)
        .await
        .unwrap();
    assert_eq!(best["worker_id"], decode, "{best}");
    let prefill = routed.workers.iter().find(|w| w.role == Role::Prefill).unwrap().id.0;
    assert_eq!(best["prefill"]["worker_id"], prefill, "{best}");
    assert_eq!(best["prefill"]["transfer_blocks"], 19, "{best}");
    // A tracked pair: the prefill leg ends on its own (its id escaped into one segment).
    let tracked = json!({"local_hashes": prompt, "num_tokens": 320, "request_id": "q"});
    let url = format!("{router_url}/find_best_worker");
    let _: Value = HttpClient::new().post_json(&url, &tracked).await.unwrap();
    assert_eq!(router.view().in_flight(), 2, "both legs in flight");
    let leg = format!("{router_url}{}", kvroute_http::router_api::request_path("q/prefill"));
    let response = HttpClient::new().call(hyper::Method::DELETE, &leg, None::<&()>).await;
    assert_eq!(response.unwrap().status(), 204);
    assert_eq!(router.view().in_flight(), 1, "the decode leg is still in flight");
}

/// #51 finding 1 at the front door: a client's transfer fields are refused with a 400 naming
/// the field, on chat and completions (the chat fallback included), so no engine is steered
/// by them: nothing is held, nothing calls the address they name. With a trusted upstream
/// configured they pass, and the front door's own pairing still writes its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_transfer_fields_are_refused_at_the_front_door() {
    let stack = Stack::start(config(1, 1, Vec::new())).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = trap.local_addr().unwrap().port();
    let values = json!({
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.1",
            "remote_port": port, "remote_request_id": "x", "remote_engine_id": "e"},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 999,
        "bootstrap_pair_key": "k", "disagg_prefill_dp_rank": 0,
        "disaggregated_params": {"request_type": "generation_only"},
        "encoder_urls": ["http://127.0.0.1:1"], "need_wait_for_mm_inputs": true,
        "num_items_assigned": {"image": [1]},
        "ec_transfer_params": {"do_remote_decode": true}, "decode_tp_size": 1,
        "kv_hints": {"version": 1},
    });
    for field in kvroute_frontend::TRANSFER_FIELDS {
        for (path, mut body) in [
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            ),
            ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})),
        ] {
            body[*field] = values[*field].clone();
            let (status, _, answer, text) = send(&format!("{base}{path}"), &body).await;
            assert_eq!(status, 400, "{field} on {path}: {text}");
            assert_eq!(answer["error"]["param"], *field, "{text}");
        }
        // Even a null names the field: a client does not get to say "none" for the door.
        let body = json!({"prompt": "hi", "max_tokens": 2, *field: null});
        assert_eq!(send(&format!("{base}/v1/completions"), &body).await.0, 400, "{field}");
    }
    // #64 finding 5: vLLM merges vllm_xargs into the request's extra_args, where its
    // connector reads kv_transfer_params.
    let xargs = json!({"prompt": "hi", "max_tokens": 2,
        "vllm_xargs": {"kv_transfer_params": values["kv_transfer_params"]}});
    let (status, _, answer, text) = send(&format!("{base}/v1/completions"), &xargs).await;
    assert_eq!((status, &answer["error"]["param"]), (400, &json!("vllm_xargs")), "{text}");
    let called = tokio::time::timeout(Duration::from_millis(300), trap.accept()).await;
    assert!(called.is_err(), "an engine called the address a client named");
    assert_eq!(held(&stack), 0);

    let mut trusting = config(1, 1, Vec::new());
    trusting.front_door.trust_transfer_fields = true;
    let stack = Stack::start(trusting).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let body = json!({"prompt": "hi there", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": false}});
    let (status, _, _, text) = send(&format!("{base}/v1/completions"), &body).await;
    assert_eq!(status, 200, "a trusted upstream's fields pass: {text}");
}

/// #51 finding 7: a prefill worker that accepts the leg and never answers does not hold a
/// client that does not stream for the whole answer's bound: the leg is given up on at the
/// first-byte timeout, the worker left out, and the request placed again (here in place).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_prefill_leg_is_given_up_on_at_the_first_byte_timeout() {
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/completions", post(std::future::pending::<&'static str>));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut spec = WorkerSpec::new(80);
    spec.url = Some(format!("http://{}", listener.local_addr().unwrap()));
    spec.role = Role::Prefill;
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut stalled = config(0, 1, vec![spec]);
    stalled.front_door.first_byte_timeout = Duration::from_millis(800);
    let stack = Stack::start(stalled).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let decode = stack.workers.iter().find(|w| w.role == Role::Decode).unwrap().id.0;
    let started = std::time::Instant::now();
    let url = format!("{base}/v1/completions");
    let asked = ask(&url, false);
    let (status, worker, answer, text) =
        tokio::time::timeout(Duration::from_secs(20), asked).await.expect("an answer in 20 s");
    assert_eq!((status, worker), (200, decode), "{text}");
    assert_eq!(answer["usage"]["completion_tokens"], 6);
    assert!(started.elapsed() < Duration::from_secs(10), "answered in {:?}", started.elapsed());
}

/// Status, `x-kvroute-worker`, the answer as JSON and as text.
async fn send(url: &str, body: &Value) -> (u16, u64, Value, String) {
    let response = HttpClient::new().call(hyper::Method::POST, url, Some(body)).await.unwrap();
    let worker = response.headers().get("x-kvroute-worker").and_then(|v| v.to_str().ok());
    let worker = worker.and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    (status, worker, serde_json::from_slice(&bytes).unwrap_or(Value::Null), text)
}

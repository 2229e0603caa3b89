//! W3C trace context through the front door into the engines, over real sockets: a client's
//! `traceparent` and `tracestate` reach the simulated engine (which records what it was
//! called in, as vLLM continues a `traceparent`) as the child of a span of kvroute's own, on
//! an aggregated request and on both legs of a prefill/decode pair; hostile trace headers are
//! bounded and ignored.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderValue, Request};
use http_body_util::{BodyExt, Full};
use kvroute_core::schedule::{PairConfig, SchedulerConfig};
use kvroute_http::HttpClient;
use kvroute_mocker::{DisaggConfig, EngineConfig, Timing};
use kvroute_router::RouterConfig;
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde_json::{Value, json};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

async fn stack(prefill: usize, decode: usize, count: usize) -> (Stack, String) {
    let pairs = PairConfig { in_place: 0.0, ..PairConfig::default() };
    let config = StackConfig {
        simulated: Simulated {
            count,
            prefill,
            decode,
            engine: EngineConfig {
                timing: Timing { speedup: 50.0 },
                disagg: DisaggConfig {
                    hold_timeout: Duration::from_millis(500),
                    ..DisaggConfig::default()
                },
                ..EngineConfig::default()
            },
            ..Simulated::default()
        },
        router: RouterConfig {
            scheduler: SchedulerConfig { pairs, ..SchedulerConfig::default() },
            ..RouterConfig::default()
        },
        // No parity probe: the engines' requests are the test's alone.
        front_door: FrontDoorOptions { parity_probe: false, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    (stack, base)
}

/// Sends a completion with these trace headers; its status.
async fn ask(base: &str, headers: &[(&str, &str)]) -> u16 {
    let prompt: Vec<u32> = (0..300).map(|t| 3 + (t * 11) % 900).collect();
    let body = json!({"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 4});
    let mut request = Request::post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_string())))
        .unwrap();
    for (k, v) in headers {
        let name = axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap();
        request.headers_mut().append(name, HeaderValue::from_str(v).unwrap());
    }
    let response = HttpClient::new().send(request).await.unwrap();
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await.unwrap();
    status
}

/// What each engine was called in (`/stats`'s `trace`).
async fn traces(stack: &Stack) -> Vec<Value> {
    let mut out = Vec::new();
    for w in &stack.workers {
        let client = match &w.api_key {
            Some(key) => HttpClient::new().with_bearer(&key.0),
            None => HttpClient::new(),
        };
        let stats: Value =
            client.get_json(&format!("{}/stats", w.url.as_ref().unwrap())).await.unwrap();
        out.push(stats["trace"].clone());
    }
    out
}

fn continued(t: &Value) -> bool {
    let parent = t["traceparent"].as_str().unwrap_or("");
    let fields: Vec<&str> = parent.split('-').collect();
    // The client's trace, sampled as it was, as the child of kvroute's span (not the
    // client's).
    fields.len() == 4
        && fields[1] == TRACE_ID
        && fields[2] != "00f067aa0ba902b7"
        && fields[3] == "01"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_trace_reaches_the_engine_as_the_child_of_kvroutes_span() {
    let (stack, base) = stack(0, 0, 1).await;
    assert_eq!(
        ask(&base, &[("traceparent", PARENT), ("tracestate", "congo=t61rcWkgMzE")]).await,
        200
    );
    let t = &traces(&stack).await[0];
    assert_eq!(t["requests"], 1, "{t}");
    assert!(continued(t), "{t}");
    assert_eq!(t["tracestate"], "congo=t61rcWkgMzE");
    // Without a trace, none is made up.
    assert_eq!(ask(&base, &[]).await, 200);
    assert_eq!(traces(&stack).await[0]["requests"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_of_a_pair_carry_the_trace() {
    let (stack, base) = stack(1, 1, 0).await;
    assert_eq!(ask(&base, &[("traceparent", PARENT)]).await, 200);
    let all = traces(&stack).await;
    assert_eq!(all.len(), 2);
    for t in &all {
        assert_eq!(t["requests"], 1, "{all:?}");
        assert!(continued(t), "{t}");
    }
    // Each leg is a span of its own.
    assert_ne!(all[0]["traceparent"], all[1]["traceparent"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_trace_headers_are_bounded_and_ignored() {
    let (stack, base) = stack(0, 0, 1).await;
    // Malformed or oversized traceparents: the request is served, no trace goes on.
    let long = format!("{PARENT}{}", "-ab".repeat(3000));
    for bad in [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "garbage",
        long.as_str(),
    ] {
        assert_eq!(ask(&base, &[("traceparent", bad)]).await, 200, "{}", &bad[..bad.len().min(40)]);
    }
    assert_eq!(traces(&stack).await[0]["requests"], 0);
    // 1,000 tracestate members, or an oversized one: the traceparent goes on alone.
    let thousand: String = (0..1000).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join(",");
    let oversized = format!("k={}", "v".repeat(4000));
    for (n, state) in [thousand, oversized].iter().enumerate() {
        assert_eq!(ask(&base, &[("traceparent", PARENT), ("tracestate", state)]).await, 200);
        let t = &traces(&stack).await[0];
        assert_eq!(t["requests"], n as u64 + 1);
        assert!(continued(t), "{t}");
        assert_eq!(t["tracestate"], Value::Null, "{t}");
    }
}

/// Through a gateway whose Endpoint Picker is kvroute: the picker's header mutation gives the
/// engine the client's trace as the child of the picker's span, and drops a tracestate past
/// its bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_passes_the_trace_through_its_header_mutation() {
    let config = StackConfig {
        simulated: Simulated {
            count: 1,
            engine: EngineConfig { timing: Timing { speedup: 50.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        front_door: FrontDoorOptions { parity_probe: false, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
    let picker = stack.picker(kvroute_epp::EppOptions::default(), None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (ready, never) = (async {}, std::future::pending());
        kvroute_epp::serve_tls(listener, picker, None, None, ready, never).await.unwrap();
    });
    let gateway =
        kvroute_test_gateway::Gateway::new(kvroute_test_gateway::GatewayConfig::ext_proc(&grpc))
            .unwrap();
    let base = kvroute_stack::serve_on_loopback(gateway.app()).await.unwrap();
    assert_eq!(ask(&base, &[("traceparent", PARENT), ("tracestate", "rojo=1")]).await, 200);
    let t = &traces(&stack).await[0];
    assert_eq!(t["requests"], 1, "{t}");
    assert!(continued(t), "{t}");
    assert_eq!(t["tracestate"], "rojo=1");
    let thousand: String = (0..1000).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join(",");
    assert_eq!(ask(&base, &[("traceparent", PARENT), ("tracestate", &thousand)]).await, 200);
    let t = &traces(&stack).await[0];
    assert_eq!(t["requests"], 2, "{t}");
    assert_eq!(t["tracestate"], Value::Null, "{t}");
}

/// Two simulated workers, fast, with `router` and `front_door`.
fn two_workers(router: RouterConfig, front_door: FrontDoorOptions) -> StackConfig {
    let engine = EngineConfig { timing: Timing { speedup: 50.0 }, ..EngineConfig::default() };
    StackConfig {
        simulated: Simulated { count: 2, engine, ..Simulated::default() },
        router,
        front_door,
        ..StackConfig::default()
    }
}

/// A front door without its parity probe: the engines' requests are the test's alone.
fn quiet() -> FrontDoorOptions {
    FrontDoorOptions { parity_probe: false, ..FrontDoorOptions::default() }
}

/// A request that asks for its decision gets it: the chosen worker first with its cost by the
/// `kv` cost's terms against the runner-up's; only when the front door explains decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_is_explained_on_request() {
    for explains in [true, false] {
        let front_door = FrontDoorOptions { explain_decisions: explains, ..quiet() };
        let mut config = two_workers(RouterConfig::default(), front_door);
        config.access.admin = kvroute_http::Credentials::new(["explain-admin"], "test").unwrap();
        let stack = Stack::start(config).await.unwrap();
        assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
        let base = stack.serve_frontend_on_loopback().await.unwrap();
        assert_eq!(ask(&base, &[]).await, 200);
        let router = Arc::clone(stack.router.as_ref().unwrap());
        // Its blocks in the index before the same prompt comes again.
        let held = || router.view().workers().iter().any(|w| w.tree_size[0] > 0);
        assert!(common::eventually(Duration::from_secs(10), held).await);
        let prompt: Vec<u32> = (0..300).map(|t| 3 + (t * 11) % 900).collect();
        let body = json!({"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 4});
        let asked = |token: Option<&str>| {
            let mut request = Request::post(format!("{base}/v1/completions"))
                .header("content-type", "application/json")
                .header("x-kvroute-explain", "true");
            if let Some(token) = token {
                request = request.header("x-kvroute-admin-token", token);
            }
            request.body(Full::new(bytes::Bytes::from(body.to_string()))).unwrap()
        };
        // Without the admin token, or with a wrong one, no client learns the decision (#77).
        for token in [None, Some("not-the-admin-token")] {
            let response = HttpClient::new().send(asked(token)).await.unwrap();
            assert!(response.headers().get("x-kvroute-decision").is_none(), "{token:?}");
            let _ = response.into_body().collect().await.unwrap();
        }
        let response = HttpClient::new().send(asked(Some("explain-admin"))).await.unwrap();
        let headers = response.headers().clone();
        let _ = response.into_body().collect().await.unwrap();
        let decision = headers.get("x-kvroute-decision");
        if !explains {
            assert!(decision.is_none(), "explained without the front door's consent");
            continue;
        }
        let decision: Value = serde_json::from_slice(decision.unwrap().as_bytes()).unwrap();
        let worker: u64 = headers["x-kvroute-worker"].to_str().unwrap().parse().unwrap();
        let candidates = decision["candidates"].as_array().unwrap();
        assert_eq!((decision["considered"].as_u64(), candidates.len()), (Some(2), 2), "{decision}");
        let (chosen, runner_up) = (&candidates[0], &candidates[1]);
        assert_eq!(chosen["worker"]["worker_id"], worker);
        assert_eq!(decision["cost_unit"], "s");
        for c in candidates {
            let t = &c["terms"];
            let sum: f64 = ["ttft_ms", "running_ms", "evict_ms", "wait_ms", "lora_ms"]
                .iter()
                .map(|k| t[k].as_f64().unwrap())
                .sum();
            assert!((sum / 1e3 - c["cost"].as_f64().unwrap()).abs() < 1e-9, "{c}");
        }
        // The holder of the prompt answers sooner, and nothing it held was recomputed.
        assert!(chosen["overlap_blocks"].as_u64() > runner_up["overlap_blocks"].as_u64());
        assert!(chosen["terms"]["ttft_ms"].as_f64() < runner_up["terms"]["ttft_ms"].as_f64());
        let metrics = router.view().render_metrics();
        assert!(
            metrics.contains("kvroute_router_avoidable_prefill_tokens_total 0"),
            "{}",
            metrics.lines().filter(|l| l.contains("avoidable")).collect::<Vec<_>>().join("\n")
        );
    }
}

/// The decision log: with a ratio of 1 every decision is a JSON line of the file (its blocks,
/// its candidates with their cost terms, the choice), and the front door's `/decisions/{id}`
/// shows it; with a ratio of 0 nothing is written, and `/decisions/{id}` still shows a recent
/// decision's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_decisions_are_logged_as_json_lines_and_found_by_request_id() {
    let dir = std::env::temp_dir().join(format!("kvroute-decision-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for ratio in [1.0, 0.0] {
        let path = dir.join(format!("decisions-{ratio}.jsonl"));
        let _ = std::fs::remove_file(&path);
        let log = kvroute_router::config::DecisionLogConfig {
            path: path.clone(),
            ratio,
            max_bytes: kvroute_router::config::DEFAULT_DECISION_LOG_MAX_BYTES,
            files: kvroute_router::config::DEFAULT_DECISION_LOG_FILES,
        };
        let router = RouterConfig { decision_log: Some(log), ..RouterConfig::default() };
        let config = two_workers(router, quiet());
        let stack = Stack::start(config).await.unwrap();
        assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
        let base = stack.serve_frontend_on_loopback().await.unwrap();
        let prompt: Vec<u32> = (0..300).map(|t| 3 + (t * 11) % 900).collect();
        let body = json!({"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 4});
        let client = HttpClient::new();
        let mut ids = Vec::new();
        for _ in 0..2 {
            let answer: Value =
                client.post_json(&format!("{base}/v1/completions"), &body).await.unwrap();
            ids.push(answer["id"].as_str().unwrap().trim_start_matches("cmpl-").to_owned());
        }
        let router = Arc::clone(stack.router.as_ref().unwrap());
        let written = || {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).collect::<Vec<_>>()
        };
        for id in &ids {
            let shown: Value = client.get_json(&format!("{base}/decisions/{id}")).await.unwrap();
            assert_eq!(shown["request"], id.as_str(), "{shown}");
            let candidates = shown["candidates"].as_array().unwrap();
            assert_eq!(candidates.len(), 2, "{shown}");
            assert!(candidates.iter().all(|c| c["terms"]["ttft_ms"].as_f64().is_some()), "{shown}");
            if ratio == 1.0 {
                assert_eq!(shown["blocks"], 300 / 16, "{shown}");
                assert_eq!(shown["chosen"], candidates[0]["worker"], "{shown}");
            }
        }
        match ratio == 1.0 {
            true => {
                let logged = || written().len() == 2;
                assert!(
                    common::eventually(Duration::from_secs(10), logged).await,
                    "{:?}",
                    written()
                );
                let lines = written();
                let logged: Vec<&str> =
                    lines.iter().map(|l| l["request"].as_str().unwrap()).collect();
                assert_eq!(logged, ids);
            }
            false => {
                // Nothing is written (the file was created when the log opened).
                assert!(router.view().decision_log().is_some_and(|l| l.dropped() == 0));
                assert!(written().is_empty());
            }
        }
        let missing = client.get(&format!("{base}/decisions/no-such-request")).await.unwrap();
        assert_eq!(missing.0, 404);
    }
}

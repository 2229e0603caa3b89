//! Flow control over real sockets on 127.0.0.1 (docs/routing.md, "Overload"): a saturated
//! fleet holds requests at the router, lets them go highest priority first, refuses a
//! sheddable one at once and a late one at its deadline (429 / 503, with `Retry-After`), and a
//! thousand clients that leave while they wait leave nothing behind.
//!
//! One simulated worker; `max_engine_wait_ms` so small that the worker has room only while
//! nothing runs there, so a long answer streamed to a "blocker" saturates the fleet until the
//! blocker hangs up.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::eventually;
use http_body_util::BodyExt;
use kvroute_core::schedule::flow::FlowConfig;
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::{RouterConfig, RouterState};
use kvroute_stack::{Simulated, Stack, StackConfig};
use serde_json::{Value, json};

struct Fleet {
    base: String,
    stack: Stack,
}

impl Fleet {
    fn router(&self) -> &Arc<RouterState> {
        self.stack.router.as_ref().unwrap()
    }

    fn waiting(&self) -> usize {
        self.router().view().flow().waiting().0
    }
}

async fn fleet(max_wait_ms: u64) -> Fleet {
    let mut router = RouterConfig::default();
    router.scheduler.flow = FlowConfig {
        enabled: true,
        max_engine_wait_ms: 0.001,
        max_wait_ms,
        ..FlowConfig::default()
    };
    let config = StackConfig {
        simulated: Simulated {
            count: 1,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            ..Simulated::default()
        },
        router,
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    Fleet { base, stack }
}

fn chat(text: &str, max_tokens: u32) -> Value {
    json!({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "ignore_eos": true, "stream": true})
}

/// Streams a long answer and holds it (the fleet stays saturated) until dropped.
async fn blocker(f: &Fleet) -> (HttpClient, hyper::body::Incoming) {
    let client = HttpClient::new();
    let url = format!("{}/v1/chat/completions", f.base);
    let response = client
        .call(hyper::Method::POST, &url, Some(&chat("hold the worker", 30_000)))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.into_body();
    assert!(stream.frame().await.unwrap().unwrap().data_ref().is_some(), "a first chunk");
    (client, stream)
}

/// Status, `Retry-After`, body of a request with `headers`.
async fn ask(base: &str, headers: &[(&str, &str)], text: &str) -> (u16, Option<u64>, Value) {
    let mut request = hyper::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = serde_json::to_vec(&chat(text, 2)).unwrap();
    let request = request.body(http_body_util::Full::new(hyper::body::Bytes::from(body))).unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let status = response.status().as_u16();
    let retry = response.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, retry, body)
}

fn metric(router: &RouterState, line_start: &str) -> f64 {
    router
        .view()
        .render_metrics()
        .lines()
        .filter(|l| l.starts_with(line_start))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_fleet_holds_requests_and_lets_the_highest_priority_go_first() {
    let f = fleet(30_000).await;
    let (client, stream) = blocker(&f).await;
    // Sheddable: refused at once, 429 in OpenAI's shape, with Retry-After.
    let (status, retry, body) = ask(&f.base, &[("x-kvroute-priority", "-1")], "shed me").await;
    assert_eq!(status, 429, "{body}");
    assert!(retry.is_some_and(|s| s >= 1), "Retry-After");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    // A low and then a high priority request wait; the high one goes first once the
    // blocker leaves.
    let base = f.base.clone();
    let low = tokio::spawn(async move {
        let a = ask(&base, &[("x-kvroute-priority", "1"), ("x-kvroute-tenant", "a")], "low").await;
        (a, Instant::now())
    });
    assert!(eventually(Duration::from_secs(5), || f.waiting() == 1).await);
    let base = f.base.clone();
    let high = tokio::spawn(async move {
        let a = ask(&base, &[("x-kvroute-priority", "7"), ("x-kvroute-tenant", "b")], "high").await;
        (a, Instant::now())
    });
    assert!(eventually(Duration::from_secs(5), || f.waiting() == 2).await);
    assert_eq!(f.router().view().flow().bands(), vec![(7, 1), (1, 1)]);
    assert_eq!(metric(f.router(), "kvroute_router_flow_waiting_requests{"), 2.0);
    drop(stream);
    drop(client);
    let ((low, low_done), (high, high_done)) = (low.await.unwrap(), high.await.unwrap());
    assert_eq!((low.0, high.0), (200, 200), "{} {}", low.2, high.2);
    assert!(high_done < low_done, "the higher priority answered first");
    assert_eq!(f.waiting(), 0);
    let released =
        "kvroute_router_flow_requests_total{priority=\"7\",tenant=\"b\",outcome=\"released\"}";
    assert_eq!(metric(f.router(), released), 1.0);
    assert!(eventually(Duration::from_secs(5), || f.router().view().in_flight() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_still_waiting_at_its_deadline_is_refused_with_retry_after() {
    let f = fleet(300).await;
    let (_client, _stream) = blocker(&f).await;
    let start = Instant::now();
    let (status, retry, body) = ask(&f.base, &[], "too late").await;
    let waited = start.elapsed();
    assert_eq!(status, 503, "{body}");
    assert!(retry.is_some_and(|s| s >= 1), "Retry-After");
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(1_300),
        "{waited:?}"
    );
    // An objective shorter than the wait: refused once it has passed.
    let start = Instant::now();
    let (status, retry, _) = ask(&f.base, &[("x-kvroute-ttft-slo-ms", "100")], "objective").await;
    assert_eq!(status, 503);
    assert!(retry.is_some_and(|s| s >= 1), "Retry-After");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_millis(1_100),
        "{waited:?}"
    );
    // A class the front door cannot read is the client's error.
    let (status, _, body) = ask(&f.base, &[("x-kvroute-priority", "high")], "bad").await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("x-kvroute-priority")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_that_leave_while_waiting_leave_nothing_behind() {
    const CLIENTS: usize = 1_000;
    let f = fleet(60_000).await;
    let (client, stream) = blocker(&f).await;
    let mut waiting = Vec::new();
    for k in 0..CLIENTS {
        let base = f.base.clone();
        let tenant = format!("t{}", k % 40);
        waiting.push(tokio::spawn(async move {
            ask(&base, &[("x-kvroute-tenant", &tenant)], &format!("request {k}")).await
        }));
    }
    assert!(
        eventually(Duration::from_secs(30), || f.waiting() == CLIENTS).await,
        "{} of {CLIENTS} waiting",
        f.waiting()
    );
    assert!(f.router().view().flow().waiting().1 > 0, "their bytes counted");
    for task in &waiting {
        task.abort();
    }
    assert!(
        eventually(Duration::from_secs(10), || f.waiting() == 0).await,
        "{} still waiting after their clients left",
        f.waiting()
    );
    assert_eq!(f.router().view().flow().waiting(), (0, 0), "no bytes held");
    assert!(f.router().view().flow().tenants().is_empty());
    let abandoned = metric(f.router(), "kvroute_router_flow_requests_total{") - {
        let r = f.router().view().render_metrics();
        r.lines()
            .filter(|l| {
                l.starts_with("kvroute_router_flow_requests_total{") && !l.contains("abandoned")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(abandoned, CLIENTS as f64);
    assert_eq!(metric(f.router(), "kvroute_router_flow_waiting_requests{"), 0.0);
    // Only the blocker is in flight; once it leaves, nothing is.
    assert_eq!(f.router().view().in_flight(), 1);
    drop(stream);
    drop(client);
    assert!(eventually(Duration::from_secs(5), || f.router().view().in_flight() == 0).await);
}

/// With engine priorities on, a tenant over its share is placed as any other but sent with
/// a lower engine priority than its class's (vLLM's `priority`, lower first: 1 for class 0),
/// so that its work runs after the others' of its class at the engine; a tenant within its
/// share keeps its class's (0: no field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_share_is_sent_at_a_lower_engine_priority() {
    let mut router = RouterConfig::default();
    router.scheduler.flow = FlowConfig { enabled: true, ..FlowConfig::default() };
    let engine = EngineConfig {
        timing: Timing { speedup: 50.0 },
        scheduling: kvroute_mocker::SchedulingPolicy::Priority,
        ..EngineConfig::default()
    };
    let config = StackConfig {
        simulated: Simulated { count: 1, engine, ..Simulated::default() },
        router,
        front_door: kvroute_frontend::FrontDoorOptions {
            engine_priority: true,
            ..kvroute_frontend::FrontDoorOptions::default()
        },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let f = Fleet { base, stack };
    let light = ask(&f.base, &[("x-kvroute-tenant", "light")], "a light tenant's question").await;
    assert_eq!(light.0, 200, "{light:?}");
    for k in 0..12 {
        let text = format!("the heavy tenant's question {k}, longer than the light one's");
        let heavy = ask(&f.base, &[("x-kvroute-tenant", "heavy")], &text).await;
        assert_eq!(heavy.0, 200, "{heavy:?}");
    }
    let w = &f.stack.workers[0];
    let client = match &w.api_key {
        Some(key) => HttpClient::new().with_bearer(&key.0),
        None => HttpClient::new(),
    };
    let stats: Value =
        client.get_json(&format!("{}/stats", w.url.as_ref().unwrap())).await.unwrap();
    let at = |p: &str| stats["priorities"][p].as_u64().unwrap_or(0);
    // The light tenant's and the heavy one's first (one tenant alone is nobody's over):
    // class 0; the heavy tenant's others, once it was over its share: one step lower.
    // (The stack's own probes of the engine come at 0 too.)
    assert!((8..=11).contains(&at("1")), "{stats}");
    assert!(at("0") >= 2, "{stats}");
    let response = HttpClient::new()
        .call(hyper::Method::GET, &format!("{}/metrics", f.base), None::<&Value>)
        .await
        .unwrap();
    let text = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    let lowered = text
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_frontend_engine_priority_lowered_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert_eq!(lowered, Some(at("1") as f64), "{text}");
}

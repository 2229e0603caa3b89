//! A fleet that changes while kvroute runs, over real sockets on 127.0.0.1: simulated engines
//! join through the front door's API, drain and leave, and the router, the front door and
//! its metrics follow (docs/membership.md).

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, MockerConfig, Timing};
use kvroute_router::RouterState;
use kvroute_stack::{Simulated, Stack, StackConfig};
use serde_json::{Value, json};

use common::eventually;

fn engine() -> EngineConfig {
    EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() }
}

/// The admin token of the tests' front doors: membership changes need it, always.
const ADMIN: &str = "membership-test-admin-token";

async fn stack(count: usize) -> (Stack, String) {
    stack_with(count, kvroute_router::RouterConfig::default()).await
}

async fn stack_with(count: usize, router: kvroute_router::RouterConfig) -> (Stack, String) {
    let admin = kvroute_http::Credentials::new([ADMIN], "test").unwrap();
    let config = StackConfig {
        simulated: Simulated { count, engine: engine(), tokenless: true, ..Simulated::default() },
        access: kvroute_stack::Access { admin, ..Default::default() },
        router,
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    (stack, base)
}

/// A simulated engine outside the stack, on loopback; its description as `POST /workers`
/// takes it (no id: the router makes one from its URL).
async fn outside_engine() -> (Value, kvroute_mocker::Spawned) {
    let config = MockerConfig {
        engine: engine(),
        endpoints: kvroute_mocker::Endpoints::ephemeral(),
        ..MockerConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let spawned = kvroute_mocker::spawn(config, listener).await.unwrap();
    let spec = json!({"url": spawned.url, "events": spawned.events, "replay": spawned.replay,
        "metrics": spawned.metrics});
    (spec, spawned)
}

/// A call with the admin token (it goes to the front door's routes that want it).
async fn call(method: hyper::Method, url: &str, body: Option<&Value>) -> (u16, Value, Option<u64>) {
    call_as(Some(ADMIN), method, url, body).await
}

async fn call_as(
    token: Option<&str>,
    method: hyper::Method,
    url: &str,
    body: Option<&Value>,
) -> (u16, Value, Option<u64>) {
    let origin = url.splitn(4, '/').take(3).collect::<Vec<_>>().join("/");
    let client = match token {
        Some(token) => HttpClient::new().with_bearer_for(&origin, token),
        None => HttpClient::new(),
    };
    let response = client.call(method, url, body).await.unwrap();
    let worker = response
        .headers()
        .get("x-kvroute-worker")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body, worker)
}

async fn chat(base: &str, k: usize) -> Option<u64> {
    // Its first block its own: no worker holds any of it.
    let text = format!("{k} {} a prompt of its own, long enough to fill a block or two.", k * 7919);
    let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2});
    let (status, answer, worker) =
        call(hyper::Method::POST, &format!("{base}/v1/chat/completions"), Some(&body)).await;
    assert_eq!(status, 200, "{answer}");
    worker
}

fn ready(router: &RouterState, id: u64) -> bool {
    router.view().workers().iter().any(|w| w.id.0 == id && w.ready.iter().all(|r| *r))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joins_through_the_api_drains_and_leaves_with_nothing_left_behind() {
    let (stack, base) = stack(2).await;
    let router = Arc::clone(stack.router.as_ref().unwrap());
    let (spec, _engine) = outside_engine().await;
    let (status, joined, _) =
        call(hyper::Method::POST, &format!("{base}/workers"), Some(&spec)).await;
    assert_eq!(status, 201, "{joined}");
    let new = joined["worker_id"].as_u64().unwrap();
    // A second time: the id is a member already.
    let (status, _, _) = call(hyper::Method::POST, &format!("{base}/workers"), Some(&spec)).await;
    assert_eq!(status, 409);
    // Readiness includes its parity probe, made as it joins.
    assert!(
        eventually(Duration::from_secs(10), || ready(&router, new)).await,
        "{:?}",
        router.view().workers()
    );
    assert!(matches!(
        router.view().workers().iter().find(|w| w.id.0 == new).unwrap().parity,
        kvroute_router::Parity::Ok
    ));
    // A prompt only the newcomer holds (sent to it directly) goes to it, once its events are in.
    let text = "A prompt the newcomer alone has seen, long enough to fill several blocks of tokens for the index.";
    let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2});
    let url = spec["url"].as_str().unwrap();
    let (status, _, _) =
        call(hyper::Method::POST, &format!("{url}/v1/chat/completions"), Some(&body)).await;
    assert_eq!(status, 200);
    let held = |router: &RouterState| {
        router.view().workers().iter().any(|w| w.id.0 == new && w.tree_size[0] > 4)
    };
    assert!(eventually(Duration::from_secs(5), || held(&router)).await);
    let (_, _, worker) =
        call(hyper::Method::POST, &format!("{base}/v1/chat/completions"), Some(&body)).await;
    assert_eq!(worker, Some(new), "the newcomer gets the decision its cache earns");
    let mut seen = std::collections::BTreeSet::new();
    for k in 0..10 {
        seen.extend(chat(&base, k).await);
    }

    // Drain one of the first two: no new decision goes to it, then it is gone.
    // The one the chats prefer (it holds the chat template's first block), else the first.
    let old = seen.iter().copied().find(|&w| w != new).unwrap_or(stack.workers[0].id.0);
    let (status, _, _) =
        call(hyper::Method::POST, &format!("{base}/workers/{old}/drain"), None).await;
    assert_eq!(status, 202);
    for k in 30..50 {
        assert_ne!(chat(&base, k).await, Some(old), "a draining worker gets no decision");
    }
    assert!(
        eventually(Duration::from_secs(5), || !router
            .view()
            .knows_worker(kvroute_core::WorkerId(old)))
        .await
    );
    assert!(
        router.view().indexed().iter().all(|w| w.worker_id.0 != old),
        "its blocks left the index"
    );
    let (_, workers, _) = call(hyper::Method::GET, &format!("{base}/workers"), None).await;
    let ids: Vec<u64> =
        workers["workers"].as_array().unwrap().iter().map(|w| w["id"].as_u64().unwrap()).collect();
    assert!(!ids.contains(&old) && ids.contains(&new), "{ids:?}");
    let metrics_url = format!("{base}/metrics");
    let metrics =
        HttpClient::new().with_bearer_for(&base, ADMIN).get(&metrics_url).await.unwrap().1;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(!metrics.contains(&format!("worker_id=\"{old}\"")), "its label sets are dropped");
    assert!(metrics.contains(&format!("worker_id=\"{new}\"")));
    assert!(
        metrics.contains(
            "kvroute_router_membership_changes_total{source=\"api\",change=\"joined\"} 1"
        ),
        "{metrics}"
    );
    assert_eq!(router.view().in_flight(), 0);

    // Errors: an unknown worker, a body that is no worker.
    let (status, _, _) = call(hyper::Method::DELETE, &format!("{base}/workers/{old}"), None).await;
    assert_eq!(status, 404);
    let (status, err, _) =
        call(hyper::Method::POST, &format!("{base}/workers"), Some(&json!({"color": 1}))).await;
    assert_eq!(status, 400, "{err}");
    let (status, err, _) = call(
        hyper::Method::POST,
        &format!("{base}/workers"),
        Some(&json!({"url": "http://127.0.0.1:1", "events": "ipc://x"})),
    )
    .await;
    assert_eq!(status, 400, "{err}");
    // Removed at once: the newcomer leaves, and the rest still answer.
    let (status, _, _) = call(hyper::Method::DELETE, &format!("{base}/workers/{new}"), None).await;
    assert_eq!(status, 200);
    for k in 50..55 {
        let w = chat(&base, k).await.unwrap();
        assert!(w != new && w != old);
    }
}

/// Membership changes need the admin token on every port that serves them, loopback
/// included (#77): without it (or with a wrong one) `POST /workers`, drain and delete are
/// 401, naming the admin token; a front door without an admin token at all refuses them (403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_changes_need_the_admin_token_even_on_loopback() {
    let (stack, base) = stack(1).await;
    let router = Arc::clone(stack.router.as_ref().unwrap());
    let one = stack.workers[0].id.0;
    let mine = json!({"url": "http://127.0.0.1:19001"});
    for token in [None, Some("not-the-admin-token")] {
        let (status, err, _) =
            call_as(token, hyper::Method::POST, &format!("{base}/workers"), Some(&mine)).await;
        assert_eq!(status, 401, "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains("admin token"), "{err}");
        let drain = format!("{base}/workers/{one}/drain");
        assert_eq!(call_as(token, hyper::Method::POST, &drain, None).await.0, 401);
        let delete = format!("{base}/workers/{one}");
        assert_eq!(call_as(token, hyper::Method::DELETE, &delete, None).await.0, 401);
    }
    assert_eq!(router.view().workers().len(), 1, "nothing joined or left");
    assert!(!router.view().member(kvroute_core::WorkerId(one)).unwrap().draining);
    // The router's own API, as `kvroute router` serves it, with the same token.
    let admin = kvroute_http::Credentials::new([ADMIN], "test").unwrap();
    let app = kvroute_router::http::app(Arc::clone(&router), admin);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (status, _, _) =
        call_as(None, hyper::Method::POST, &format!("{router_url}/workers"), Some(&mine)).await;
    assert_eq!(status, 401);
    let (status, _, _) =
        call_as(None, hyper::Method::DELETE, &format!("{router_url}/workers/{one}"), None).await;
    assert_eq!(status, 401);
    assert_eq!(router.view().workers().len(), 1);

    // A front door with no admin token set: the changes are closed to everyone.
    let config = StackConfig {
        simulated: Simulated {
            count: 1,
            engine: engine(),
            tokenless: true,
            ..Simulated::default()
        },
        ..StackConfig::default()
    };
    let open = Stack::start(config).await.unwrap();
    let open_base = open.serve_frontend_on_loopback().await.unwrap();
    let (status, err, _) =
        call_as(None, hyper::Method::POST, &format!("{open_base}/workers"), Some(&mine)).await;
    assert_eq!(status, 403, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("--admin-token-file"), "{err}");
    let id = open.workers[0].id.0;
    let (status, _, _) =
        call_as(None, hyper::Method::DELETE, &format!("{open_base}/workers/{id}"), None).await;
    assert_eq!(status, 403);
    // Reading the fleet stays open there, as before.
    assert_eq!(
        call_as(None, hyper::Method::GET, &format!("{open_base}/workers"), None).await.0,
        200
    );
}

/// The members' bound holds for the admin API too (#77): the 1,025th worker is refused (409)
/// and the members stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_is_refused_past_the_members_bound() {
    let bound = kvroute_router::config::DEFAULT_MAX_WORKERS;
    let (stack, base) = stack_with(1, kvroute_router::RouterConfig::default()).await;
    let router = Arc::clone(stack.router.as_ref().unwrap());
    // Workers without events or load reports: nothing is subscribed to; each its own URL.
    for k in 1..bound {
        let spec = json!({"url": format!("http://127.8.{}.{}:9", k / 250, k % 250 + 1)});
        let (status, body, _) =
            call(hyper::Method::POST, &format!("{base}/workers"), Some(&spec)).await;
        assert_eq!(status, 201, "{body}");
    }
    let spec = json!({"url": "http://127.9.200.200:9"});
    let (status, err, _) = call(hyper::Method::POST, &format!("{base}/workers"), Some(&spec)).await;
    assert_eq!(status, 409, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("--max-workers"), "{err}");
    assert_eq!(router.view().workers().len(), bound);
    // One removed: room for one again.
    let gone = stack.workers[0].id.0;
    assert_eq!(call(hyper::Method::DELETE, &format!("{base}/workers/{gone}"), None).await.0, 200);
    assert_eq!(call(hyper::Method::POST, &format!("{base}/workers"), Some(&spec)).await.0, 201);
}

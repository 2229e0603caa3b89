//! The router's HTTP API through `app(state).oneshot(..)`: the seed's standalone-router flows,
//! the request lifecycle and the error cases.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use kvroute_core::{
    BlockExtraInfo, BlockHasher, BlockSize, LocalBlockHash, RequestExtraInfo, RequestMmObjectInfo,
    sequence_hashes,
};
use kvroute_http::{Credentials, testing};
use kvroute_router::{RouterConfig, RouterState, WorkerSpec, http::app};
use serde_json::{Value, json};

fn state(workers: &[u64]) -> Arc<RouterState> {
    let config = RouterConfig {
        workers: workers.iter().map(|&id| WorkerSpec::new(id)).collect(),
        ..RouterConfig::default()
    };
    Arc::new(RouterState::new(config))
}

async fn call(
    state: &Arc<RouterState>,
    method: Method,
    uri: &str,
    body: Option<String>,
) -> (StatusCode, Value) {
    let body: Option<Value> = body.map(|b| serde_json::from_str(&b).unwrap_or(Value::String(b)));
    match body {
        // Bodies that are not JSON go as they are.
        Some(Value::String(raw)) => {
            let req = Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/json")
                .body(Body::from(raw))
                .unwrap();
            testing::call_raw(&app(Arc::clone(state), Credentials::default()), req).await
        }
        body => {
            let app = app(Arc::clone(state), Credentials::default());
            testing::call(&app, method, uri, body.as_ref()).await
        }
    }
}

const IMAGE_PAD: u32 = 151_655;

/// A chat-like prompt: `text` tokens, then an image of 64 pad tokens named `image`, then more text.
fn prompt(text: u32, image: Option<u64>, tail: u32) -> (Vec<u32>, Option<RequestExtraInfo>) {
    let mut tokens: Vec<u32> = (0..64).map(|t| t + text * 1000).collect();
    let info = image.map(|mm_hash| {
        tokens.extend([IMAGE_PAD; 64]);
        RequestExtraInfo {
            mm_objects: vec![RequestMmObjectInfo { mm_hash, offsets: vec![(64, 128)] }],
        }
    });
    tokens.extend((0..tail).map(|t| t + 500_000));
    (tokens, info)
}

fn hashes(tokens: &[u32], info: Option<&RequestExtraInfo>) -> Vec<LocalBlockHash> {
    let bs = BlockSize::new(16).unwrap();
    let blocks: Option<Vec<Option<BlockExtraInfo>>> =
        info.map(|i| i.to_block_level(bs, tokens.len()));
    BlockHasher::new(bs).local_hashes(tokens, blocks.as_deref())
}

/// Worker `worker` reports storing these blocks (engine hashes = sequence hashes, as vLLM's are).
async fn store(state: &Arc<RouterState>, worker: u64, local: &[LocalBlockHash]) {
    let seq = sequence_hashes(local);
    let blocks: Vec<Value> = local
        .iter()
        .zip(&seq)
        .map(|(l, s)| json!({"block_hash": s.0, "tokens_hash": l.0, "mm_extra_info": null}))
        .collect();
    let events = json!([{"worker_id": worker, "event": {"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": blocks}}}}]);
    let (status, body) = call(state, Method::POST, "/events", Some(events.to_string())).await;
    assert_eq!((status, body["applied"].as_u64()), (StatusCode::OK, Some(1)));
}

async fn best(state: &Arc<RouterState>, local: &[LocalBlockHash], tokens: usize) -> Value {
    let body = json!({"local_hashes": local.iter().map(|l| l.0).collect::<Vec<_>>(), "num_tokens": tokens});
    let (status, value) =
        call(state, Method::POST, "/find_best_worker", Some(body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{value}");
    value
}

#[tokio::test]
async fn standalone_router_flows() {
    let state = state(&[1, 2]);
    let (tokens, _) = prompt(1, None, 64);
    let local = hashes(&tokens, None);
    store(&state, 2, &local).await;

    // Same prompt again: a full match, on the worker that holds it.
    let r = best(&state, &local, tokens.len()).await;
    assert_eq!((r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()), (Some(2), Some(8)));
    assert_eq!(r["overlap"].as_f64(), Some(1.0));

    // A longer prompt with the same start: a partial match.
    let (longer, _) = prompt(1, None, 128);
    let r = best(&state, &hashes(&longer, None), longer.len()).await;
    assert_eq!((r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()), (Some(2), Some(8)));
    assert!(r["overlap"].as_f64().unwrap() < 1.0);

    // Unrelated: no match.
    let (other, _) = prompt(9, None, 64);
    assert_eq!(
        best(&state, &hashes(&other, None), other.len()).await["overlap_blocks"].as_u64(),
        Some(0)
    );

    // Same text, different image: nothing past the text before the image.
    let (with_a, info_a) = prompt(3, Some(0xAAAA), 32);
    store(&state, 1, &hashes(&with_a, info_a.as_ref())).await;
    let (with_b, info_b) = prompt(3, Some(0xBBBB), 32);
    let r = best(&state, &hashes(&with_b, info_b.as_ref()), with_b.len()).await;
    assert_eq!(r["overlap_blocks"].as_u64(), Some(4), "the 64 text tokens only: {r}");
    let r = best(&state, &hashes(&with_a, info_a.as_ref()), with_a.len()).await;
    assert_eq!((r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()), (Some(1), Some(10)));

    let (status, info) = call(&state, Method::GET, "/debug/tree_info", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info["num_blocks"].as_u64(), Some(8 + 10));
    assert!(!info["events"].as_array().unwrap().is_empty());
}

#[tokio::test]
async fn inject_event_and_request_lifecycle() {
    let state = state(&[]);
    for (hash, parent) in [(11u64, None), (12, Some(11u64))] {
        let body = json!({"worker_id": 5, "tokens_hash": hash, "parent_hash": parent});
        let (status, _) =
            call(&state, Method::POST, "/debug/inject_event", Some(body.to_string())).await;
        assert_eq!(status, StatusCode::OK);
    }
    let body = json!({"local_hashes": [11, 12, 13], "num_tokens": 48, "request_id": "r1"});
    let (status, r) = call(&state, Method::POST, "/find_best_worker", Some(body.to_string())).await;
    assert_eq!(
        (status, r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
        (StatusCode::OK, Some(5), Some(2))
    );
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    assert_eq!(workers["in_flight"].as_u64(), Some(1));
    assert_eq!(
        call(&state, Method::POST, "/requests/r1/prefill_done", None).await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(call(&state, Method::DELETE, "/requests/r1", None).await.0, StatusCode::NO_CONTENT);
    assert_eq!(call(&state, Method::DELETE, "/requests/r1", None).await.0, StatusCode::NOT_FOUND);
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    assert_eq!(workers["in_flight"].as_u64(), Some(0));
    assert_eq!(workers["workers"][0]["tree_size"][0].as_u64(), Some(2));

    let (status, text) = call(&state, Method::GET, "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    let text = text.as_str().unwrap();
    assert!(
        text.contains("kvroute_router_events_total{kind=\"stored\",status=\"ok\"} 2"),
        "{text}"
    );
    assert!(text.contains("kvroute_router_decision_seconds_count 1"));
    assert!(
        text.contains("kvroute_router_worker_decisions_total{worker_id=\"5\",dp_rank=\"0\"} 1")
    );
    // r1's first token was timed: its prediction met it once, on worker 5.
    let ttft = "kvroute_router_ttft_prediction_error_ratio_count{worker_id=\"5\",dp_rank=\"0\"}";
    assert_eq!(kvroute_http::metrics::sample(text, ttft), Some(1.0), "{text}");
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    assert_eq!(workers["ttft_predictions"][0]["observed"].as_u64(), Some(1), "{workers}");

    // An answer sent whole: its first bytes say nothing of its first token.
    let body = json!({"local_hashes": [11, 12, 13], "num_tokens": 48, "request_id": "r2"});
    assert_eq!(
        call(&state, Method::POST, "/find_best_worker", Some(body.to_string())).await.0,
        StatusCode::OK
    );
    let path = kvroute_http::router_api::prefill_done_untimed_path("r2");
    assert_eq!(call(&state, Method::POST, &path, None).await.0, StatusCode::NO_CONTENT);
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    assert_eq!(workers["in_flight"].as_u64(), Some(1), "r2 runs on");
    assert_eq!(workers["ttft_predictions"][0]["observed"].as_u64(), Some(1), "not learned from");
}

#[tokio::test]
async fn bad_requests_get_openai_shaped_errors() {
    let state = state(&[1]);
    let cases = [
        (Method::POST, "/find_best_worker", Some("{not json".to_owned()), StatusCode::BAD_REQUEST),
        (
            Method::POST,
            "/find_best_worker",
            Some(r#"{"local_hashes":[1],"num_tokens":0}"#.to_owned()),
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/find_best_worker",
            Some(r#"{"local_hashes":[1],"num_tokens":-5}"#.to_owned()),
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/find_best_worker",
            Some(r#"{"local_hashes":"x","num_tokens":5}"#.to_owned()),
            StatusCode::BAD_REQUEST,
        ),
        (Method::POST, "/events", Some(r#"[{"worker_id":1}]"#.to_owned()), StatusCode::BAD_REQUEST),
        (
            Method::POST,
            "/debug/inject_event",
            Some(r#"{"worker_id":1,"tokens_hash":1,"parent_hash":99}"#.to_owned()),
            StatusCode::BAD_REQUEST,
        ),
        (Method::GET, "/nope", None, StatusCode::NOT_FOUND),
    ];
    for (method, uri, body, want) in cases {
        let (status, value) = call(&state, method, uri, body.clone()).await;
        assert_eq!(status, want, "{uri} {body:?}: {value}");
        assert!(value["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{value}");
        assert_eq!(value["error"]["code"].as_u64(), Some(u64::from(want.as_u16())));
    }
    let empty = self::state(&[]);
    let (status, value) = call(
        &empty,
        Method::POST,
        "/find_best_worker",
        Some(r#"{"local_hashes":[1],"num_tokens":5}"#.into()),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{value}");
}

/// A data-parallel rank from the wire sizes per-worker tables: one request naming rank 2^31
/// once aborted the process on a 34 GB allocation. Now it is a 400, and nothing registers.
#[tokio::test]
async fn an_out_of_range_dp_rank_is_refused_not_allocated() {
    let state = state(&[]);
    for rank in [2_147_483_648u64, 5_000_000, 256] {
        let body = json!({"worker_id": 57, "tokens_hash": 1, "dp_rank": rank});
        let (status, value) =
            call(&state, Method::POST, "/debug/inject_event", Some(body.to_string())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "rank {rank}: {value}");
        assert_eq!(value["error"]["param"], "dp_rank");
    }
    let events = json!([{"worker_id": 58, "event": {"event_id": 1, "dp_rank": 2_147_483_648u64,
        "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 1, "tokens_hash": 1}]}}}}]);
    let (status, value) = call(&state, Method::POST, "/events", Some(events.to_string())).await;
    assert_eq!((status, value["applied"].as_u64()), (StatusCode::OK, Some(0)), "{value}");
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 0, "nothing registered: {workers}");
    let (_, text) = call(&state, Method::GET, "/metrics", None).await;
    assert!(
        text.as_str()
            .unwrap()
            .contains("kvroute_router_events_rejected_total{reason=\"dp_rank\"} 1"),
        "{text}"
    );
    // The highest allowed rank still works.
    let body = json!({"worker_id": 57, "tokens_hash": 1, "dp_rank": 255});
    let (status, _) =
        call(&state, Method::POST, "/debug/inject_event", Some(body.to_string())).await;
    assert_eq!(status, StatusCode::OK);
}

/// Posted events cannot invent workers: with configured workers, events naming another one
/// are refused (counted); without, a worker is learned only from a Stored event that stores
/// something (a Removed that applies nothing, or a refused inject, registers nothing), and
/// at most `max_learned_workers` of them.
#[tokio::test]
async fn posted_events_cannot_invent_workers() {
    let stored = |worker: u64, hash: u64| {
        json!([{"worker_id": worker, "event": {"event_id": 1, "dp_rank": 0,
            "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": hash, "tokens_hash": hash}]}}}}])
        .to_string()
    };
    let configured = state(&[1]);
    let (status, v) = call(&configured, Method::POST, "/events", Some(stored(4242, 7))).await;
    assert_eq!((status, v["applied"].as_u64()), (StatusCode::OK, Some(0)), "{v}");
    let inject = json!({"worker_id": 4242, "tokens_hash": 7}).to_string();
    let (status, v) = call(&configured, Method::POST, "/debug/inject_event", Some(inject)).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("worker_id"))
    );
    let (_, v) = call(&configured, Method::POST, "/events", Some(stored(1, 7))).await;
    assert_eq!(v["applied"].as_u64(), Some(1), "a configured worker's events apply");
    let (_, workers) = call(&configured, Method::GET, "/workers", None).await;
    let ids: Vec<u64> =
        workers["workers"].as_array().unwrap().iter().map(|w| w["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [1], "{workers}");
    let best = best(&configured, &[LocalBlockHash(7)], 16).await;
    assert_eq!(best["worker_id"].as_u64(), Some(1));
    let (_, text) = call(&configured, Method::GET, "/metrics", None).await;
    assert!(
        text.as_str()
            .unwrap()
            .contains("kvroute_router_events_rejected_total{reason=\"unknown_worker\"} 2"),
        "{text}"
    );

    let open = Arc::new(RouterState::new(RouterConfig {
        max_learned_workers: 2,
        ..RouterConfig::default()
    }));
    let removed = json!([{"worker_id": 31337, "event": {"event_id": 1, "dp_rank": 0,
        "data": {"removed": {"block_hashes": [1]}}}}]);
    let (_, v) = call(&open, Method::POST, "/events", Some(removed.to_string())).await;
    assert_eq!(v["applied"].as_u64(), Some(0));
    let orphan = json!({"worker_id": 3, "tokens_hash": 1, "parent_hash": 99}).to_string();
    assert_eq!(
        call(&open, Method::POST, "/debug/inject_event", Some(orphan)).await.0,
        StatusCode::BAD_REQUEST
    );
    let (_, workers) = call(&open, Method::GET, "/workers", None).await;
    assert_eq!(workers["workers"].as_array().unwrap().len(), 0, "nothing registered: {workers}");
    for worker in [10, 11, 12] {
        call(&open, Method::POST, "/events", Some(stored(worker, worker))).await;
    }
    let (_, workers) = call(&open, Method::GET, "/workers", None).await;
    let ids: Vec<u64> =
        workers["workers"].as_array().unwrap().iter().map(|w| w["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [10, 11], "at most max_learned_workers: {workers}");
}

/// With an admin token, everything but `/health` needs it.
#[tokio::test]
async fn an_admin_token_guards_everything_but_health() {
    let state = state(&[1]);
    let admin = Credentials::new(["admin-token-1"], "test").unwrap();
    let app = app(Arc::clone(&state), admin);
    let request = |method: &str, uri: &str, token: Option<&str>| {
        let mut r =
            Request::builder().method(method).uri(uri).header("content-type", "application/json");
        if let Some(t) = token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        let body = match method {
            "POST" if uri == "/find_best_worker" => r#"{"local_hashes":[1],"num_tokens":16}"#,
            "POST" => "[]",
            _ => "",
        };
        r.body(Body::from(body)).unwrap()
    };
    let routes = [
        ("POST", "/find_best_worker"),
        ("POST", "/events"),
        ("POST", "/requests/x/prefill_done"),
        ("DELETE", "/requests/x"),
        ("GET", "/debug/tree_info"),
        ("GET", "/workers"),
        ("GET", "/metrics"),
    ];
    for (method, uri) in routes {
        let (status, v) = testing::call_raw(&app, request(method, uri, None)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri}: {v}");
        let (status, _) =
            testing::call_raw(&app, request(method, uri, Some("admin-token-2"))).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri} with a wrong token");
        let (status, v) =
            testing::call_raw(&app, request(method, uri, Some("admin-token-1"))).await;
        assert_ne!(status, StatusCode::UNAUTHORIZED, "{method} {uri}: {v}");
    }
    assert_eq!(testing::call_raw(&app, request("GET", "/health", None)).await.0, StatusCode::OK);
    // The status page is served to anyone: it holds no data, and reads the guarded routes.
    let (status, page) = testing::call_raw(&app, request("GET", "/ui", None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.as_str().is_some_and(|p| p.contains("fetch(\"workers\"")), "{page}");
}

/// Workers without an `events` endpoint are routed in approximate mode: the router assumes
/// what it sent there is cached (with a TTL and the engine's capacity as a cap) and shows
/// those blocks in `/workers`; once events arrive for such a worker they take over.
#[tokio::test]
async fn workers_without_events_are_predicted_from_routing() {
    let state = state(&[1, 2]);
    let (tokens, _) = prompt(4, None, 64);
    let local = hashes(&tokens, None);
    let first = best(&state, &local, tokens.len()).await;
    assert_eq!(first["overlap_blocks"].as_u64(), Some(0));
    let chosen = first["worker_id"].as_u64().unwrap();
    let again = best(&state, &local, tokens.len()).await;
    assert_eq!(
        (again["worker_id"].as_u64(), again["overlap_blocks"].as_u64()),
        (Some(chosen), Some(8)),
        "the router remembers where it sent the prompt"
    );
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    let w = workers["workers"].as_array().unwrap().iter().find(|w| w["id"] == chosen).unwrap();
    assert_eq!((w["mode"].as_str(), w["tree_size"][0].as_u64()), (Some("approximate"), Some(8)));
    assert_eq!(w["ready"][0], true, "nothing to wait for");
    // The TTL runs out: forgotten.
    state.expire_approximate(std::time::Instant::now() + std::time::Duration::from_secs(121));
    assert_eq!(best(&state, &local, tokens.len()).await["overlap_blocks"].as_u64(), Some(0));
    // Events for worker 2 arrive: it follows them from now on.
    let (other, _) = prompt(5, None, 32);
    store(&state, 2, &hashes(&other, None)).await;
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    let modes: Vec<&str> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["approximate", "events"]);
    let (_, text) = call(&state, Method::GET, "/metrics", None).await;
    let text = text.as_str().unwrap();
    assert!(
        text.contains(
            "kvroute_router_worker_blocks{worker_id=\"2\",dp_rank=\"0\",mode=\"events\"} 6"
        ),
        "{text}"
    );
}

/// `POST /answers`: a front door's report of an answered request feeds the router's checks
/// (and the fleet's hit rate); reports naming an unknown worker or impossible counts are
/// refused, and the decisions it made show in `/workers` with their scores.
#[tokio::test]
async fn answers_feed_the_checks_and_decisions_show_their_scores() {
    let state = state(&[1, 2]);
    let local = hashes(&prompt(64, None, 0).0, None);
    store(&state, 1, &local).await;
    let body = json!({"local_hashes": local.iter().map(|l| l.0).collect::<Vec<_>>(),
        "num_tokens": 64, "request_id": "r1"});
    let (status, r) = call(&state, Method::POST, "/find_best_worker", Some(body.to_string())).await;
    assert_eq!((status, r["worker_id"].as_u64()), (StatusCode::OK, Some(1)));
    let answer = |worker: u64, prompt: u64, predicted: u64, cached: u64| {
        Some(
            json!({"worker_id": worker, "dp_rank": 0, "prompt_tokens": prompt,
            "predicted_cached_tokens": predicted, "cached_tokens": cached})
            .to_string(),
        )
    };
    let post = |body| call(&state, Method::POST, "/answers", body);
    assert_eq!(post(answer(1, 64, 48, 48)).await.0, StatusCode::NO_CONTENT);
    assert_eq!(post(answer(1, 64, 48, 16)).await.0, StatusCode::NO_CONTENT);
    for (bad, param) in [
        (answer(9, 64, 0, 0), "worker_id"),
        (answer(1, 64, 65, 0), "predicted_cached_tokens"),
        (answer(1, 64, 0, 65), "cached_tokens"),
        (answer(1, 1 << 40, 0, 0), "prompt_tokens"),
    ] {
        let (status, e) = post(bad).await;
        assert_eq!((status, e["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some(param)));
    }
    let (status, _) = post(Some(json!({"worker_id": 1}).to_string())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "fields are required");
    // One validation of ranks with /events: worker 1 has one rank, and 2^31 is no rank at all.
    for rank in [1u64, 200, 2_147_483_648] {
        let body = json!({"worker_id": 1, "dp_rank": rank, "prompt_tokens": 64,
            "predicted_cached_tokens": 0, "cached_tokens": 0});
        let (status, e) = post(Some(body.to_string())).await;
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (StatusCode::BAD_REQUEST, Some("dp_rank")),
            "{e}"
        );
    }
    let (_, workers) = call(&state, Method::GET, "/workers", None).await;
    let checks = &workers["workers"][0]["checks"];
    assert_eq!(
        (checks["answered"].as_u64(), checks["exact"].as_u64(), checks["over"].as_u64()),
        (Some(2), Some(1), Some(1))
    );
    let decisions = workers["recent_decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 1);
    let chosen = &decisions[0]["candidates"][0];
    assert_eq!(
        (chosen["worker"]["worker_id"].as_u64(), chosen["overlap_blocks"].as_u64()),
        (Some(1), Some(4))
    );
    assert!(
        chosen["cost"].as_f64().unwrap() < decisions[0]["candidates"][1]["cost"].as_f64().unwrap()
    );
    let (_, text) = call(&state, Method::GET, "/metrics", None).await;
    let text = text.as_str().unwrap();
    assert!(
        text.contains("kvroute_router_answered_prompt_tokens_total{worker_id=\"1\"} 128"),
        "{text}"
    );
    assert!(text.contains("kvroute_router_answered_cached_tokens_total{worker_id=\"1\"} 64"));
}

async fn binary(state: &Arc<RouterState>, query: &str, body: Vec<u8>) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("/find_best_worker?{query}"))
        .header("content-type", kvroute_http::router_api::BINARY_HASHES)
        .body(Body::from(body))
        .unwrap();
    testing::call_raw(&app(Arc::clone(state), Credentials::default()), req).await
}

#[tokio::test]
async fn the_binary_form_answers_as_json_does() {
    let state = state(&[1, 2, 3]);
    let (tokens, _) = prompt(3, None, 80);
    let local = hashes(&tokens, None);
    store(&state, 3, &local[..5]).await;
    store(&state, 2, &local[..2]).await;
    let json = best(&state, &local, tokens.len()).await;
    let le: Vec<u8> = local.iter().flat_map(|l| l.0.to_le_bytes()).collect();
    let (status, bin) = binary(&state, &format!("num_tokens={}", tokens.len()), le.clone()).await;
    assert_eq!(status, StatusCode::OK, "{bin}");
    assert_eq!(bin, json);
    assert_eq!((bin["worker_id"].as_u64(), bin["overlap_blocks"].as_u64()), (Some(3), Some(5)));

    // The query's fields act as JSON's do: a tracked request is in flight until it ends.
    let (status, _) =
        binary(&state, &format!("num_tokens={}&request_id=b%201", tokens.len()), le.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(state.view().in_flight(), 1);
    assert_eq!(
        call(&state, Method::DELETE, "/requests/b%201", None).await.0,
        StatusCode::NO_CONTENT
    );

    // Refused as JSON's errors are, with the field named.
    let cases = [
        ("num_tokens=64", le[..12].to_vec(), "local_hashes"),
        ("num_tokens=0", le.clone(), "num_tokens"),
        ("num_tokens=64&temperature=-1", le.clone(), "temperature"),
    ];
    for (query, body, param) in cases {
        let (status, e) = binary(&state, query, body).await;
        assert_eq!(
            (status, e["error"]["param"].as_str()),
            (StatusCode::BAD_REQUEST, Some(param)),
            "{query}: {e}"
        );
    }
    for query in ["", "num_tokens=x", "num_tokens=64&exclude=1", "num_tokens=64&local_hashes=1"] {
        let (status, e) = binary(&state, query, le.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query:?}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("query"), "{e}");
    }
}

/// #64 finding 5: class fields and weights are checked whether flow control is on or not
/// (it is off here): out of range, NaN or too long is a 400 naming the field.
#[tokio::test]
async fn class_fields_and_weights_are_checked_with_flow_control_off() {
    let state = state(&[1]);
    assert!(!state.config.scheduler.flow.enabled);
    let base = json!({"local_hashes": [1, 2], "num_tokens": 32});
    let tenant = "t".repeat(1000);
    let cases = [
        ("priority", json!(1000)),
        ("ttft_slo_ms", json!(0)),
        ("tenant", json!(tenant)),
        ("overlap_score_weight", json!(-1e308)),
        ("overlap_score_weight", json!(1e9)),
    ];
    for (field, value) in cases {
        let mut body = base.clone();
        body[field] = value.clone();
        let (status, r) =
            call(&state, Method::POST, "/find_best_worker", Some(body.to_string())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{field}={value}: {r}");
        assert_eq!(r["error"]["param"], field, "{r}");
    }
    // NaN is no JSON number: a client's "NaN" is refused as what it is.
    let nan = r#"{"local_hashes": [1], "num_tokens": 16, "overlap_score_weight": NaN}"#;
    let (status, _) = call(&state, Method::POST, "/find_best_worker", Some(nan.to_owned())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let mut fine = base.clone();
    fine["priority"] = json!(5);
    fine["overlap_score_weight"] = json!(2.0);
    let (status, r) = call(&state, Method::POST, "/find_best_worker", Some(fine.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{r}");
}

//! Prefill and decode engines over real sockets on 127.0.0.1: vLLM's `kv_transfer_params`
//! and SGLang's bootstrap rooms, the side channel between them, holds freed by a pull or by
//! their lease, and a decode engine whose prefill engine is gone.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvroute_core::BlockSize;
use kvroute_http::HttpClient;
use kvroute_mocker::{
    DisaggConfig, EngineConfig, LoadFailurePolicy, MockerConfig, Peers, Role, Spawned, Timing,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// The fleet's shared secret in these tests.
const TOKEN: &str = "fleet-token-for-tests-0123456789";

/// An engine in `role`; a decode engine may pull from the side channels of `prefill`.
async fn engine(role: Role, hold_timeout: Duration, prefill: &[&Spawned]) -> Spawned {
    engine_on(DisaggConfig { role, hold_timeout, ..DisaggConfig::default() }, prefill).await
}

fn side_channels(prefill: &[&Spawned]) -> Vec<std::net::SocketAddr> {
    prefill.iter().filter_map(|p| p.state.side_channel).collect()
}

async fn engine_on(disagg: DisaggConfig, prefill: &[&Spawned]) -> Spawned {
    let peers = Peers { token: Some(TOKEN.into()), prefill: side_channels(prefill) };
    engine_with(disagg, peers).await
}

async fn engine_with(disagg: DisaggConfig, peers: Peers) -> Spawned {
    let config = MockerConfig {
        engine: EngineConfig {
            num_blocks: 400,
            block_size: BlockSize::new(16).unwrap(),
            timing: Timing { speedup: 50.0 },
            disagg,
            ..EngineConfig::default()
        },
        endpoints: kvroute_mocker::Endpoints::without_events(),
        peers,
        ..MockerConfig::default()
    };
    kvroute_mocker::spawn(config, TcpListener::bind("127.0.0.1:0").await.unwrap()).await.unwrap()
}

const LONG: Duration = Duration::from_secs(30);

fn prompt(seed: u32) -> String {
    (0..160).map(|i| format!("w{} ", (i * 7 + seed) % 50)).collect()
}

/// `POST url` with `body`: the status and the whole answer, whatever the status.
async fn posted(url: &str, body: &Value) -> (u16, Vec<u8>) {
    let client = HttpClient::new();
    let response = client.call(axum::http::Method::POST, url, Some(body)).await.unwrap();
    let status = response.status().as_u16();
    let bytes = kvroute_http::client::read_body(response.into_body(), 1 << 20).await.unwrap();
    (status, bytes.to_vec())
}

async fn post(url: &str, body: &Value) -> Value {
    HttpClient::new().post_json(url, body).await.unwrap()
}

/// The engine's `/stats`, until `done` holds of them (at most 10 s).
async fn eventually(e: &Spawned, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats: Value = HttpClient::new().get_json(&format!("{}/stats", e.url)).await.unwrap();
        if done(&stats) || Instant::now() > deadline {
            return stats;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn cached(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// vLLM's protocol: the prefill answer names its blocks and side channel; the decode engine
/// pulls them (its cached tokens are the prompt less its last block), the hold is released;
/// a second decode of the same prompt on the same engine pulls nothing it already holds.
#[tokio::test]
async fn a_vllm_prefill_is_pulled_by_its_decode_engine_and_released() {
    let p = engine(Role::Prefill, LONG, &[]).await;
    let d = engine(Role::Decode, LONG, &[&p]).await;
    let ask = |params: Value, max: u64| json!({"prompt": prompt(1), "max_tokens": max, "kv_transfer_params": params});
    let producer = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let first = post(&format!("{}/v1/completions", p.url), &ask(producer.clone(), 1)).await;
    let params = first["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{first}");
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.state.side_channel.unwrap().port());
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = params["remote_block_ids"][0].as_array().unwrap().len() as u64;
    assert_eq!(blocks, prompt_tokens.div_ceil(16));
    let held = eventually(&p, |s| s["held_blocks"].as_u64() > Some(0)).await;
    assert_eq!(held["held_requests"], 1);

    let answer = post(&format!("{}/v1/completions", d.url), &ask(params, 8)).await;
    assert_eq!(answer["usage"]["completion_tokens"], 8);
    let pullable = (prompt_tokens - 1) / 16 * 16;
    assert_eq!(cached(&answer), pullable, "the prompt's KV came from the prefill engine");
    let freed = eventually(&p, |s| s["held_blocks"] == 0).await;
    assert_eq!(
        (freed["held_requests"].as_u64(), freed["handoff"]["pulled"].as_u64()),
        (Some(0), Some(1))
    );
    let stats = eventually(&d, |_| true).await;
    assert_eq!(stats["handoff"]["received"], 1);
    let bytes = stats["handoff"]["received_bytes"].as_u64().unwrap();
    assert_eq!(bytes, pullable * 131_072, "every block was missing: all were pulled");

    // The next turn's prefill on the same engines: the decode engine holds the prompt now.
    let again = post(&format!("{}/v1/completions", p.url), &ask(producer, 1)).await;
    let answer =
        post(&format!("{}/v1/completions", d.url), &ask(again["kv_transfer_params"].clone(), 4))
            .await;
    assert_eq!(cached(&answer), pullable);
    let stats = eventually(&d, |s| s["handoff"]["received"] == 2).await;
    assert_eq!(stats["handoff"]["received_bytes"].as_u64(), Some(bytes), "nothing more moved");
}

/// Nodes: a decode engine of the prefill engine's node pulls over the link within it, one of
/// another node over the link across (counted apart), both with the same bytes.
#[tokio::test]
async fn a_pull_from_another_node_is_counted_across() {
    let on = |role, node: &str| DisaggConfig {
        role,
        node: kvroute_core::schedule::pairs::node_id(Some(node)),
        kv_transfer_bandwidth_across_nodes_gbps: Some(5.0),
        hold_timeout: LONG,
        ..DisaggConfig::default()
    };
    let p = engine_on(on(Role::Prefill, "a"), &[]).await;
    let near = engine_on(on(Role::Decode, "a"), &[&p]).await;
    let far = engine_on(on(Role::Decode, "b"), &[&p]).await;
    let producer = json!({"do_remote_decode": true});
    for (d, seed) in [(&near, 2), (&far, 3)] {
        let ask = |params: Value, max: u64| json!({"prompt": prompt(seed), "max_tokens": max, "kv_transfer_params": params});
        let first = post(&format!("{}/v1/completions", p.url), &ask(producer.clone(), 1)).await;
        let params = first["kv_transfer_params"].clone();
        let answer = post(&format!("{}/v1/completions", d.url), &ask(params, 2)).await;
        assert!(cached(&answer) > 0, "{answer}");
    }
    let near = eventually(&near, |s| s["handoff"]["received"] == 1).await;
    let far = eventually(&far, |s| s["handoff"]["received"] == 1).await;
    assert_eq!(near["handoff"]["received_across_nodes"], 0, "{near}");
    assert_eq!(far["handoff"]["received_across_nodes"], 1, "{far}");
    assert_eq!(near["handoff"]["received_bytes"], far["handoff"]["received_bytes"]);
}

/// A prefill nobody pulls (its decode engine died) is freed when its lease ends.
#[tokio::test]
async fn an_unpulled_prefill_is_freed_by_its_lease() {
    let p = engine(Role::Prefill, Duration::from_millis(300), &[]).await;
    let body = json!({"prompt": prompt(2), "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true}});
    let answer = post(&format!("{}/v1/completions", p.url), &body).await;
    assert!(answer["kv_transfer_params"]["remote_request_id"].is_string());
    let held = eventually(&p, |s| s["held_blocks"].as_u64() > Some(0)).await;
    assert!(held["held_blocks"].as_u64().unwrap() > 0);
    let metrics = HttpClient::new().get(&format!("{}/metrics", p.url)).await.unwrap().1;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    assert!(!metrics.contains("kvroute_mocker_kv_held_blocks 0\n"), "{metrics}");
    let freed = eventually(&p, |s| s["held_blocks"] == 0).await;
    assert_eq!(freed["handoff"]["expired"], 1);
    let metrics = HttpClient::new().get(&format!("{}/metrics", p.url)).await.unwrap().1;
    assert!(String::from_utf8_lossy(&metrics).contains("kvroute_mocker_kv_held_blocks 0\n"));
}

/// A decode engine whose prefill engine is gone fails the request with a 500, as vLLM 0.33
/// does by default and SGLang always does; with vLLM's `recompute` policy it prefills the
/// prompt itself and answers.
#[tokio::test]
async fn a_decode_engine_whose_prefill_engine_is_gone_fails_or_recomputes() {
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = gone.local_addr().unwrap().port();
    drop(gone);
    let body = json!({"prompt": prompt(3), "max_tokens": 4, "kv_transfer_params": {
        "do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port,
        "remote_request_id": "r", "remote_engine_id": "e", "remote_block_ids": [[0, 1]]}});
    let client = HttpClient::new();
    let gone_peer: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let peers = Peers { token: Some(TOKEN.into()), prefill: vec![gone_peer] };
    let failing = engine_with(
        DisaggConfig { role: Role::Decode, hold_timeout: LONG, ..DisaggConfig::default() },
        peers.clone(),
    )
    .await;
    let url = format!("{}/v1/completions", failing.url);
    let (status, answer) = posted(&url, &body).await;
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&answer));
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(answer["error"]["type"], "InternalServerError", "{answer}");
    let stats = eventually(&failing, |s| s["handoff"]["pull_failures"] == 1).await;
    assert_eq!(stats["handoff"]["received"], 0, "{stats}");
    let snapshot = failing.state.engine.snapshot();
    assert_eq!((snapshot.num_running_reqs, snapshot.num_waiting_reqs), (0, 0), "nothing admitted");
    let sglang = json!({"text": prompt(3), "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 9});

    let recomputing = engine_with(
        DisaggConfig {
            role: Role::Decode,
            hold_timeout: LONG,
            load_failure: LoadFailurePolicy::Recompute,
            ..DisaggConfig::default()
        },
        peers,
    )
    .await;
    let answer = post(&format!("{}/v1/completions", recomputing.url), &body).await;
    assert_eq!((answer["usage"]["completion_tokens"].as_u64(), cached(&answer)), (Some(4), 0));
    let stats = eventually(&recomputing, |s| s["handoff"]["pull_failures"] == 1).await;
    assert_eq!(stats["handoff"]["received"], 0, "{stats}");
    // SGLang's decode engine has no recompute policy: its failed handshake is a 500.
    let (status, _) = posted(&format!("{}/generate", recomputing.url), &sglang).await;
    assert_eq!(status, 500);
    // A side channel named by a host name is refused: it would be resolved from the request.
    let mut named = body.clone();
    named["kv_transfer_params"]["remote_host"] = json!("prefill.example");
    let refused = client.post_json::<Value>(&url, &named).await;
    assert!(refused.unwrap_err().to_string().contains("400"));
}

/// SGLang's protocol: both engines get the same request with a bootstrap room, at once; the
/// decode engine waits on the prefill engine's bootstrap port for the room, then pulls.
#[tokio::test]
async fn an_sglang_room_joins_prefill_and_decode() {
    let p = engine(Role::Prefill, LONG, &[]).await;
    let d = engine(Role::Decode, LONG, &[&p]).await;
    let port = p.state.side_channel.unwrap().port();
    let body = json!({"text": prompt(4), "sampling_params": {"max_new_tokens": 6},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 12345});
    let (pu, du) = (format!("{}/generate", p.url), format!("{}/generate", d.url));
    // The decode request first: it waits for the room.
    let decode = tokio::spawn({
        let body = body.clone();
        async move { post(&du, &body).await }
    });
    let prefill = post(&pu, &body).await;
    let decode = decode.await.unwrap();
    assert!(prefill["meta_info"]["prompt_tokens"].as_u64().unwrap() > 100, "{prefill}");
    assert_eq!(decode["meta_info"]["completion_tokens"], 6, "{decode}");
    let prompt_tokens = decode["meta_info"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(decode["meta_info"]["cached_tokens"].as_u64(), Some((prompt_tokens - 1) / 16 * 16));
    let freed = eventually(&p, |s| s["held_blocks"] == 0).await;
    assert_eq!(freed["handoff"]["pulled"], 1);
}

/// Whether anything connects to `listener` within a short bound (it should not).
async fn called(listener: &TcpListener) -> bool {
    tokio::time::timeout(Duration::from_millis(300), listener.accept()).await.is_ok()
}

/// #51 finding 1: a decode leg naming a side channel that is not one of the engine's prefill
/// peers fails as a failed pull does (500), before anything is sent, with the same answer
/// whatever listens there; an aggregated engine ignores the transfer fields and calls nobody.
#[tokio::test]
async fn a_decode_engine_calls_only_its_prefill_peers() {
    let p = engine(Role::Prefill, LONG, &[]).await;
    let d = engine(Role::Decode, LONG, &[&p]).await;
    let both = engine(Role::Both, LONG, &[]).await;
    let trap = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = trap.local_addr().unwrap().port();
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let pull = |port: u16| {
        json!({"prompt": prompt(5), "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port,
        "remote_request_id": "victim", "remote_engine_id": "e", "remote_block_ids": [[0]]}})
    };
    let (status, open) = posted(&format!("{}/v1/completions", d.url), &pull(port)).await;
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&open));
    let (_, shut) = posted(&format!("{}/v1/completions", d.url), &pull(closed)).await;
    assert_eq!(open, shut, "a listening and a closed port get the same answer");
    let room = json!({"text": prompt(5), "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5});
    assert_eq!(posted(&format!("{}/generate", d.url), &room).await.0, 500);
    assert!(!called(&trap).await, "the decode engine called an address a request named");
    let stats = eventually(&d, |s| s["handoff"]["refused_peers"] == 3).await;
    assert_eq!(stats["handoff"]["refused_peers"], 3, "{stats}");

    // The aggregated engine answers as if the fields were absent, and holds nothing.
    let answer = post(&format!("{}/v1/completions", both.url), &pull(port)).await;
    assert_eq!(cached(&answer), 0, "no KV taken from the request's address: {answer}");
    let hold = json!({"prompt": prompt(6), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let answer = post(&format!("{}/v1/completions", both.url), &hold).await;
    assert!(answer.get("kv_transfer_params").is_none_or(Value::is_null), "{answer}");
    assert_eq!(posted(&format!("{}/generate", both.url), &room).await.0, 200);
    assert!(!called(&trap).await, "the aggregated engine called out");
    let stats = eventually(&both, |s| s["held_blocks"] == 0).await;
    assert_eq!(
        (stats["held_blocks"].as_u64(), stats["handoff"]["held"].as_u64()),
        (Some(0), Some(0))
    );
}

/// #51 findings 2 and 6: a bootstrap room is held once. A second prefill naming a room in
/// use (under way or held) is refused with 409 and holds nothing, so every hold is freed by
/// its pull or its lease; a leg starts only while the blocks held and its own fit in half the
/// engine's cache (it waits for room, then is refused).
#[tokio::test]
async fn a_reused_room_is_refused_and_every_hold_is_freed() {
    let p = engine(Role::Prefill, Duration::from_millis(500), &[]).await;
    let url = format!("{}/generate", p.url);
    let room = |seed: u32, room: u64| {
        json!({"text": prompt(seed), "sampling_params": {"max_new_tokens": 1},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": room})
    };
    assert_eq!(posted(&url, &room(1, 777)).await.0, 200);
    let mut refused = 0;
    for seed in 2..12 {
        let (status, body) = posted(&url, &room(seed, 777)).await;
        assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
        refused += 1;
    }
    assert_eq!(refused, 10);
    let held = eventually(&p, |s| s["held_requests"] == 1).await;
    assert_eq!(held["held_requests"], 1, "{held}");
    // Forty rooms one after another, never pulled: a leg starts only while the blocks held
    // and its own fit in half the cache (200), waiting for room (a lease's end here), so the
    // blocks held never pass it, and every leg is answered.
    let mut most = 0;
    for r in 0..40u32 {
        let (status, body) = posted(&url, &room(20 + r, 1_000 + u64::from(r))).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let stats = eventually(&p, |_| true).await;
        most = most.max(stats["held_blocks"].as_u64().unwrap());
    }
    assert!(most > 100 && most <= 200, "held at most half the cache: {most}");
    let freed = eventually(&p, |s| s["held_blocks"] == 0 && s["held_requests"] == 0).await;
    assert_eq!(
        (freed["held_blocks"].as_u64(), freed["held_requests"].as_u64()),
        (Some(0), Some(0)),
        "{freed}"
    );
    // The room is free again once its hold ended.
    assert_eq!(posted(&url, &room(1, 777)).await.0, 200);
}

/// #51 finding 4: the side channel answers only the fleet's token, and a vLLM hold's key is
/// random: a guessed id pulls nothing, a stranger cannot release another request's hold.
#[tokio::test]
async fn the_side_channel_needs_the_token_and_keys_are_unguessable() {
    let p = engine(Role::Prefill, LONG, &[]).await;
    let side = format!("http://{}", p.state.side_channel.unwrap());
    let body = json!({"prompt": prompt(7), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let a = post(&format!("{}/v1/completions", p.url), &body).await;
    let b = post(&format!("{}/v1/completions", p.url), &body).await;
    let key = |v: &Value| v["kv_transfer_params"]["remote_request_id"].as_str().unwrap().to_owned();
    let (ka, kb) = (key(&a), key(&b));
    assert!(ka.starts_with("kv-") && ka.len() == 35 && ka != kb, "{ka} {kb}");
    assert_ne!(ka, a["id"].as_str().unwrap(), "the key is not the request's id");
    for stranger in [HttpClient::new(), HttpClient::new().with_bearer("wrong-token-0123456789")] {
        let r = stranger
            .call(
                axum::http::Method::POST,
                &format!("{side}/kv/release"),
                Some(&json!({"key": ka})),
            )
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
        let r = stranger
            .call(axum::http::Method::POST, &format!("{side}/kv/wait"), Some(&json!({"key": ka})))
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
    }
    let peer = HttpClient::new().with_bearer(TOKEN);
    let guessed =
        peer.post_json::<Value>(&format!("{side}/kv/release"), &json!({"key": "cmpl-1"})).await;
    assert!(guessed.unwrap_err().to_string().contains("404"));
    let released: Value =
        peer.post_json(&format!("{side}/kv/release"), &json!({"key": ka})).await.unwrap();
    assert!(released["tokens"].as_u64().unwrap() > 100);
    let long = "k".repeat(100_000);
    let r = peer
        .call(axum::http::Method::POST, &format!("{side}/kv/wait"), Some(&json!({"key": long})))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

/// #51 finding 8: a caller's request id names one request at a time. A second request with a
/// running request's SGLang `rid` (or vLLM's `request_id`) is refused with 409, and the first
/// runs to its end.
#[tokio::test]
async fn a_duplicate_request_id_is_refused_without_cancelling_the_first() {
    let e = engine(Role::Both, LONG, &[]).await;
    for (path, body) in [
        (
            "/generate",
            json!({"text": prompt(8), "rid": "victim", "stream": true,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": true}}),
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": (1..200).collect::<Vec<u32>>(),
            "request_id": "victim2", "stream": true,
            "sampling_params": {"max_tokens": 300, "ignore_eos": true}}),
        ),
    ] {
        let url = format!("{}{path}", e.url);
        let client = HttpClient::new();
        let first = client.call(axum::http::Method::POST, &url, Some(&body)).await.unwrap();
        assert_eq!(first.status().as_u16(), 200);
        let mut first = first.into_body();
        // Its first event: the request is under way.
        let chunk = http_body_util::BodyExt::frame(&mut first).await.unwrap().unwrap();
        assert!(chunk.data_ref().is_some_and(|d| !d.is_empty()));
        let mut second = body.clone();
        second["stream"] = json!(false);
        let (status, answer) = posted(&url, &second).await;
        assert_eq!(status, 409, "{path}: {}", String::from_utf8_lossy(&answer));
        let rest = http_body_util::BodyExt::collect(first).await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&rest);
        assert!(text.contains("[DONE]") || text.contains("\"finish_reason\""), "{path}: {text}");
        assert!(!text.contains("error"), "{path}: the first was not cancelled: {text}");
        // Once it ended, the id is free again.
        assert_eq!(posted(&url, &second).await.0, 200, "{path}");
    }
}

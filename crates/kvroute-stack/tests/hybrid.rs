//! A hybrid model end to end over real sockets on 127.0.0.1: simulated engines started from
//! `models/kvroute-tiny-swa` (a Gemma-style config.json with a 512-token sliding window) keep
//! a full-attention and a sliding-window cache group, announce both with vLLM's group fields,
//! and the router predicts what they serve when the window group has lost blocks the full
//! group still holds.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::eventually;

use http_body_util::BodyExt;
use kvroute_http::HttpClient;
use kvroute_router::RouterState;
use kvroute_stack::Stack;
use kvroute_stack::settings::{Engine, Model, Settings};
use serde_json::{Value, json};

const MODEL: &str = "kvroute-tiny-swa";

/// Status, `x-kvroute-worker`, `x-kvroute-overlap-tokens`, cached tokens of the answer.
async fn complete(client: &HttpClient, url: &str, prompt: &[u32], out: u32) -> [u64; 4] {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": out});
    let response = client.call(hyper::Method::POST, url, Some(&body)).await.unwrap();
    let header = |name: &str| {
        let v = response.headers().get(name).and_then(|v| v.to_str().ok());
        v.and_then(|v| v.parse().ok()).unwrap_or(u64::MAX)
    };
    let (worker, predicted) = (header("x-kvroute-worker"), header("x-kvroute-overlap-tokens"));
    let status = u64::from(response.status().as_u16());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    [status, worker, predicted, cached]
}

fn tokens(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|t| 3 + (t * 7 + salt) % 900).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_the_window_group_lost_is_predicted_as_the_engine_serves_it() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(MODEL);
    let settings = Settings {
        model: Model { model_path: Some(model), ..Model::default() },
        engine: Engine { num_blocks: Some(160), speedup: Some(100.0), ..Engine::default() },
        ..Settings::default()
    };
    let mut config = settings.stack_config(2, true).unwrap();
    assert_eq!(config.simulated.engine.sliding_window, Some(512), "read from config.json");
    config.front_door.expose_overlap = true;
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let router: &RouterState = stack.router.as_ref().unwrap();
    let client = HttpClient::new();
    let url = format!("{base}/v1/completions");

    let direct = |spec: &kvroute_router::WorkerSpec| {
        let engine = spec.url.clone().unwrap();
        (engine, HttpClient::new().with_bearer(&spec.api_key.as_ref().unwrap().0))
    };
    // Two 75-block prompts on each engine (150 blocks each, both groups, of the 160): what
    // the readiness probes left is gone, and each engine holds the same 160 blocks.
    for spec in &stack.workers {
        let (engine, client) = direct(spec);
        let engine = format!("{engine}/v1/completions");
        for salt in [200, 300] {
            assert_eq!(complete(&client, &engine, &tokens(1200, salt), 1).await[0], 200);
        }
    }
    // A 60-block prompt and 4 tokens: 120 blocks while its prompt is computed, then as it
    // decodes it gives back the 28 window blocks behind its 512-token window.
    let a = tokens(960, 0);
    let [status, owner, _, cached] = complete(&client, &url, &a, 4).await;
    assert_eq!((status, cached), (200, 0));
    let spec = stack.workers.iter().find(|w| w.id.0 == owner).unwrap();
    let (engine, owner_client) = direct(spec);
    // A 30-block prompt on the same engine needs 60 blocks: the 2 free and 58 evicted, the
    // flushes' last first, then the window blocks a gave back (the nearest its window first),
    // so the window group keeps a's blocks 0..7 and 28..59, the full group all 60.
    let completions = format!("{engine}/v1/completions");
    let b = complete(&owner_client, &completions, &tokens(480, 500), 1).await;
    assert_eq!(b[0], 200);
    let stats = format!("{engine}/stats");
    let response = owner_client.call(hyper::Method::GET, &stats, None::<&Value>).await.unwrap();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let stats: Value = serde_json::from_slice(&bytes).unwrap();
    let evicted = stats["evicted_blocks"].as_u64().unwrap();
    let seen = || {
        let w = router.view().workers().into_iter().find(|w| w.id.0 == owner);
        w.is_some_and(|w| w.conversion.blocks_removed >= evicted)
    };
    assert!(eventually(Duration::from_secs(10), seen).await, "the router sees the evictions");

    // 40 blocks of a, then its own: the full group holds all 40, the window group no run of
    // 32 inside them but the 8 from block 0, so 8 blocks are served (not 40), as predicted.
    let mut c = a[..640].to_vec();
    c.extend(tokens(160, 900));
    let [status, worker, predicted, cached] = complete(&client, &url, &c, 1).await;
    assert_eq!(status, 200);
    assert_eq!(worker, owner, "the only worker with any of it");
    assert_eq!(cached, 8 * 16, "the window group's run from block 0");
    assert_eq!(predicted, cached, "predicted as served");
    // a is placed once the router holds c's blocks in both groups (what the engine serves
    // of a now), so the prediction compares the router's view, not the speed of the events.
    let bs = kvroute_core::BlockSize::new(16).unwrap();
    let a_blocks = kvroute_core::BlockHasher::new(bs).local_hashes(&a, None);
    let rank = kvroute_core::WorkerWithDpRank::new(owner, 0u32);
    let held = || {
        let scores = router.view().find_matches_within(&a_blocks, (a.len() - 1) / 16, 16);
        scores.score(rank) >= 40
    };
    assert!(eventually(Duration::from_secs(10), held).await, "the router sees c's blocks");
    // a again: c's blocks (its first 40) are in both groups now, and a's last 20 were evicted
    // for them; the window group's run ends the hit at block 40, as predicted.
    let [_, worker, predicted, cached] = complete(&client, &url, &a, 1).await;
    assert_eq!((worker, cached, predicted), (owner, 40 * 16, 40 * 16));
}

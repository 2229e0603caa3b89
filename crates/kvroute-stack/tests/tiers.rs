//! Host memory below the GPU, end to end over real sockets on 127.0.0.1: simulated engines
//! with host memory announce their offloaded blocks with medium CPU (vLLM's bytes, through the
//! router's subscriber), the router keeps them as a tier below the device, and a prompt the
//! GPU has evicted goes back to the worker whose host memory still holds it, predicted as the
//! engine serves it.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::eventually;

use http_body_util::BodyExt;
use kvroute_core::BlockSize;
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, HostConfig, Timing};
use kvroute_router::check_status::{TierCheck, TierChecks};
use kvroute_router::{RouterConfig, RouterState};
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde_json::{Value, json};

/// Two engines of 48 GPU blocks and 512 host blocks each, blocks of 16 tokens.
fn config() -> StackConfig {
    let host = HostConfig { num_blocks: 512, ..HostConfig::default() };
    StackConfig {
        simulated: Simulated {
            count: 2,
            engine: EngineConfig {
                num_blocks: 48,
                timing: Timing { speedup: 100.0 },
                host,
                ..EngineConfig::default()
            },
            ..Simulated::default()
        },
        router: RouterConfig { block_size: BlockSize::new(16).unwrap(), ..RouterConfig::default() },
        front_door: FrontDoorOptions { expose_overlap: true, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    }
}

/// The stack started and ready, and its front door's completions URL.
async fn started(config: StackConfig) -> (Stack, String) {
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    (stack, format!("{base}/v1/completions"))
}

/// Status, `x-kvroute-worker`, `x-kvroute-overlap-tokens`, cached tokens of the answer.
async fn complete(client: &HttpClient, url: &str, prompt: &[u32]) -> (u16, u64, u64, u64) {
    let body = json!({"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 1});
    let response = client.call(hyper::Method::POST, url, Some(&body)).await.unwrap();
    let header = |name: &str| {
        let v = response.headers().get(name).and_then(|v| v.to_str().ok());
        v.and_then(|v| v.parse().ok()).unwrap_or(u64::MAX)
    };
    let (worker, predicted) = (header("x-kvroute-worker"), header("x-kvroute-overlap-tokens"));
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    (status, worker, predicted, cached)
}

/// A 20-block prompt sent through the front door lands somewhere, uncached (ids within the
/// model's 967); three 30-block prompts sent to that engine directly then push it out of its
/// GPU cache. The prompt and the engine that computed it.
async fn computed_then_evicted(stack: &Stack, client: &HttpClient, url: &str) -> (Vec<u32>, u64) {
    let a: Vec<u32> = (0..320).map(|t| 3 + (t * 7) % 900).collect();
    let (status, owner, _, cached) = complete(client, url, &a).await;
    assert_eq!((status, cached), (200, 0));
    let spec = stack.workers.iter().find(|w| w.id.0 == owner).unwrap();
    let engine = format!("{}/v1/completions", spec.url.as_deref().unwrap());
    let direct = HttpClient::new().with_bearer(&spec.api_key.as_ref().unwrap().0);
    for k in 0..3u32 {
        let other: Vec<u32> = (0..480).map(|t| 3 + (t * 13 + k * 101 + 500) % 900).collect();
        assert_eq!(complete(&direct, &engine, &other).await.0, 200);
    }
    (a, owner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_evicted_from_the_gpu_goes_where_host_memory_still_holds_it() {
    let (stack, url) = started(config()).await;
    let router: &RouterState = stack.router.as_ref().unwrap();
    let client = HttpClient::new();

    // Host memory keeps every block of `a` and of the prompts that pushed it out, and says so.
    let (a, owner) = computed_then_evicted(&stack, &client, &url).await;
    // The other engine's GPU is as full (an empty one would store `a` for free: cheaper,
    // by the model, than loading it beside a full cache).
    for spec in stack.workers.iter().filter(|w| w.id.0 != owner) {
        let engine = format!("{}/v1/completions", spec.url.as_deref().unwrap());
        let direct = HttpClient::new().with_bearer(&spec.api_key.as_ref().unwrap().0);
        for k in 0..3u32 {
            let other: Vec<u32> = (0..480).map(|t| 3 + (t * 11 + k * 89 + 300) % 900).collect();
            assert_eq!(complete(&direct, &engine, &other).await.0, 200);
        }
    }
    let held = || {
        router
            .view()
            .workers()
            .iter()
            .find(|w| w.id.0 == owner)
            .map(|w| (w.tree_size[0], w.lower_tier_blocks[0][0]))
    };
    let offloaded = eventually(Duration::from_secs(10), || {
        held().is_some_and(|(device, host)| device <= 48 && host >= 20 + 3 * 30)
    })
    .await;
    assert!(offloaded, "the router sees the host blocks: {:?}", held());
    let metrics = router.view().render_metrics();
    assert!(metrics.contains("kvroute_router_worker_tier_blocks{"), "{metrics}");

    // The same prompt again: the owner's host memory serves all but its last block, and the
    // router predicted exactly that.
    let (status, worker, predicted, cached) = complete(&client, &url, &a).await;
    assert_eq!(status, 200);
    assert_eq!(worker, owner, "routed to the host memory that holds it");
    assert_eq!(cached, 19 * 16, "19 of 20 blocks served, the last recomputed");
    assert_eq!(predicted, cached, "predicted as served");
    // The self-checks count it as an answer predicted from host memory, exact.
    let host = TierCheck { answered: 1, exact: 1, predicted_tokens: 19 * 16 };
    assert!(eventually(Duration::from_secs(5), || tiers_of(router, owner).host == host).await);
    assert_eq!(router.view().in_flight(), 0, "nothing left in flight");
    let metrics = router.view().render_metrics();
    let line = format!(
        "kvroute_router_predicted_tier_tokens_total{{worker_id=\"{owner}\",tier=\"host\"}} 304"
    );
    assert!(metrics.contains(&line), "{metrics}");
}

fn tiers_of(router: &RouterState, worker: u64) -> TierChecks {
    let w = router.view().workers().into_iter().find(|w| w.id.0 == worker);
    w.map(|w| w.checks.tiers).unwrap_or_default()
}

/// Storage below host memory (vLLM's tiering): a prompt pushed out of the GPU and out of host
/// memory is still in its owner's storage (announced with medium STORAGE); it goes back
/// there, promoted as the engine serves it, predicted exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_evicted_from_host_memory_goes_where_storage_still_holds_it() {
    let mut config = config();
    // Storage that loads a block faster than the engine computes it (at 10 GB/s, a block of
    // 2 MiB takes 0.27 ms to load and 0.24 ms to compute: no reason to go back for it).
    config.simulated.engine.host = HostConfig {
        num_blocks: 64,
        storage_blocks: 1024,
        storage_gbps: 32.0,
        ..HostConfig::default()
    };
    config.router.scheduler.kv.disk_bandwidth_gbps = 32.0;
    let (stack, url) = started(config).await;
    let router: &RouterState = stack.router.as_ref().unwrap();
    let client = HttpClient::new();

    let a: Vec<u32> = (0..320).map(|t| 3 + (t * 7) % 900).collect();
    let (status, owner, _, cached) = complete(&client, &url, &a).await;
    assert_eq!((status, cached), (200, 0));
    // 90 blocks of other prompts on each engine: more than the GPU's 48 and the host's 64,
    // so both caches are full (storing a prompt evicts as much on either).
    for (i, spec) in stack.workers.iter().enumerate() {
        let engine = format!("{}/v1/completions", spec.url.as_deref().unwrap());
        let direct = HttpClient::new().with_bearer(&spec.api_key.as_ref().unwrap().0);
        for k in 0..3u32 {
            let salt = k * 101 + i as u32 * 37 + 500;
            let other: Vec<u32> = (0..480).map(|t| 3 + (t * 13 + salt) % 900).collect();
            assert_eq!(complete(&direct, &engine, &other).await.0, 200);
        }
    }
    let held = || {
        let w = router.view().workers().into_iter().find(|w| w.id.0 == owner)?;
        Some((w.tree_size[0], w.lower_tier_blocks[0][0], w.lower_tier_blocks[0][1]))
    };
    let in_storage = eventually(Duration::from_secs(10), || {
        held().is_some_and(|(_, host, storage)| host <= 64 && storage >= 20 + 3 * 30)
    })
    .await;
    assert!(in_storage, "the router sees the storage blocks: {:?}", held());
    let (status, worker, predicted, cached) = complete(&client, &url, &a).await;
    assert_eq!(status, 200);
    assert_eq!(worker, owner, "routed to the storage that holds it");
    assert_eq!(cached, 19 * 16, "19 of 20 blocks served, the last recomputed");
    assert_eq!(predicted, cached, "predicted as served");
    let stats = stack.simulated.iter().map(|e| e.engine.snapshot().stats.storage_hit_tokens);
    let promoted = stats.sum::<u64>();
    assert!(promoted > 0, "some of them promoted from storage");
    // The self-checks count the storage (disk) tokens predicted, as many as were promoted.
    let disk = || tiers_of(router, owner).disk;
    assert!(eventually(Duration::from_secs(5), || disk().answered == 1).await, "{:?}", disk());
    assert_eq!(disk(), TierCheck { answered: 1, exact: 1, predicted_tokens: promoted });
}

/// A store both engines share (docs/mocker.md, "Shared store"): a prompt one engine computed
/// is written to the store and announced with locality REMOTE; once that engine's GPU has
/// evicted it, the router sends it to the other engine (whose GPU has room), which loads it
/// from the store, predicted exactly and counted as the external tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_one_engine_computed_is_served_by_another_from_the_shared_store() {
    let mut config = config();
    config.simulated.engine.host = HostConfig::default();
    config.simulated.store = Some(kvroute_stack::SharedStore::Start(1024));
    let (stack, url) = started(config).await;
    let router: &RouterState = stack.router.as_ref().unwrap();
    let client = HttpClient::new();

    // The store keeps every block of `a` and of the prompts that pushed it out.
    let (a, owner) = computed_then_evicted(&stack, &client, &url).await;
    let held = || {
        let w = router.view().workers().into_iter().find(|w| w.id.0 == owner)?;
        Some((w.tree_size[0], w.lower_tier_blocks[0][2]))
    };
    let in_store = eventually(Duration::from_secs(10), || {
        held().is_some_and(|(device, external)| device <= 48 && external >= 20 + 3 * 30)
    })
    .await;
    assert!(in_store, "the router sees the store's blocks: {:?}", held());

    // (The readiness probes send both engines one prompt: the second may load it from the
    // store; only what this request loads is counted.)
    let loaded = || -> u64 {
        stack.simulated.iter().map(|e| e.engine.snapshot().stats.store_hit_tokens).sum()
    };
    let before = loaded();
    let (status, worker, predicted, cached) = complete(&client, &url, &a).await;
    assert_eq!(status, 200);
    assert_ne!(worker, owner, "the other engine's GPU has room, and the store serves both");
    assert_eq!(cached, 19 * 16, "19 of 20 blocks loaded from the store, the last computed");
    assert_eq!(predicted, cached, "predicted as served");
    assert_eq!(loaded() - before, 19 * 16);
    let external = || tiers_of(router, worker).external;
    let want = TierCheck { answered: 1, exact: 1, predicted_tokens: 19 * 16 };
    assert!(eventually(Duration::from_secs(5), || external() == want).await, "{:?}", external());
    assert_eq!(router.view().in_flight(), 0, "nothing left in flight");
}

//! Other streams over real ZMQ sockets on 127.0.0.1 (a Rust PUB here): load reports, and
//! TensorRT-LLM and kvroute-JSON event formats.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::WorkerWithDpRank;
use kvroute_router::{EventFormat, RouterConfig, RouterState, WorkerSpec};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

async fn bound_pub() -> (PubSocket, String) {
    let mut socket = PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    (socket, endpoint)
}

/// Sends `payload` until `done` holds (a PUB drops what it sends before the subscription is
/// up), at most 10 s.
async fn send_until(socket: &mut PubSocket, payload: &[u8], done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "the router never took {}",
            String::from_utf8_lossy(payload)
        );
        socket.send(ZmqMessage::from(payload.to_vec())).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_trtllm_and_kvroute_json_streams() {
    let (mut metrics, metrics_endpoint) = bound_pub().await;
    let (mut trt, trt_endpoint) = bound_pub().await;
    let (mut native, native_endpoint) = bound_pub().await;
    let mut w1 = WorkerSpec::new(1);
    w1.metrics = Some(metrics_endpoint);
    w1.events = Some(trt_endpoint);
    w1.format = EventFormat::TrtllmJson;
    w1.block_size = Some(4);
    let mut w2 = WorkerSpec::new(2);
    w2.events = Some(native_endpoint);
    w2.format = EventFormat::Kvroute;
    let state = Arc::new(RouterState::new(RouterConfig {
        workers: vec![w1, w2],
        ..RouterConfig::default()
    }));
    let _tasks = kvroute_router::spawn_background(&state).unwrap();

    let report = br#"{"num_waiting_reqs": 3, "kv_cache_usage": 0.5, "num_running_reqs": 7, "kv_total_blocks": 1000, "dp_rank": 0, "extra": 1}"#;
    send_until(&mut metrics, report, || state.view().workers()[0].load[0].is_some()).await;
    let load = state.view().workers()[0].load[0].unwrap();
    assert_eq!(
        (load.kv_cache_usage, load.num_running_reqs, load.kv_total_blocks),
        (Some(0.5), Some(7), Some(1000))
    );

    let stored = br#"[{"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [
        {"type": "stored_block", "block_hash": 9001, "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0},
         {"type": "unique_token", "token_id": 2, "token_extra_id": 0}, {"type": "unique_token", "token_id": 3, "token_extra_id": 0},
         {"type": "unique_token", "token_id": 4, "token_extra_id": 0}], "cache_level": 0, "priority": 35, "mm_keys": []}]}, "window_size": 64}]"#;
    let w = WorkerWithDpRank::new(1u64, 0u32);
    send_until(&mut trt, stored, || state.view().tree_size(w) == 1).await;

    let native_event = br#"{"worker_id": 2, "event": {"event_id": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 5, "tokens_hash": 77}]}}}}"#;
    let w = WorkerWithDpRank::new(2u64, 0u32);
    send_until(&mut native, native_event, || state.view().tree_size(w) == 1).await;
    send_until(&mut native, b"not json", || {
        !state.view().render_metrics().contains("undecodable_messages_total 0")
    })
    .await;
}

/// Worker 9 (one rank, blocks of 4) following a vLLM-format publisher here, and its router.
async fn worker_9_on_a_publisher()
-> (kvroute_wire::publisher::EventPublisher, Arc<RouterState>, kvroute_router::Tasks) {
    let publisher =
        kvroute_wire::publisher::EventPublisher::bind("tcp://127.0.0.1:0", None, "", 16)
            .await
            .unwrap();
    let mut spec = WorkerSpec::new(9);
    spec.events = Some(publisher.endpoint.clone());
    spec.block_size = Some(4);
    let state =
        Arc::new(RouterState::new(RouterConfig { workers: vec![spec], ..RouterConfig::default() }));
    let tasks = kvroute_router::spawn_background(&state).unwrap();
    (publisher, state, tasks)
}

/// One stored block of tokens `[1, 2, 3, hash]` under engine hash `hash`.
fn stored(hash: u64) -> Vec<kvroute_wire::EngineEvent> {
    vec![kvroute_wire::EngineEvent::BlockStored(kvroute_wire::BlockStored {
        block_hashes: vec![hash],
        parent_block_hash: None,
        token_ids: vec![1, 2, 3, hash],
        block_size: 4,
        ..kvroute_wire::BlockStored::default()
    })]
}

/// Waits (at most 10 s) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A publisher that goes away (an engine killed) makes its rank not ready at once, so nothing
/// is placed on blocks the router cannot see; a publisher back on the same port (the engine
/// restarted) is followed again, and the rank is ready once it is caught up. Before, the
/// socket reconnected by itself, silently and up to 30 s apart, and the rank stayed ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_publisher_leaves_its_rank_not_ready_until_it_is_back() {
    let (publisher, state, _tasks) = worker_9_on_a_publisher().await;
    let w = WorkerWithDpRank::new(9u64, 0u32);
    assert_eq!(state.view().wait_ready(Duration::from_secs(10)).await, Vec::new());
    until("the first batch", || {
        publisher.send(stored(1), 0);
        state.view().tree_size(w) == 1
    })
    .await;
    let endpoint = publisher.endpoint.clone();
    drop(publisher);
    until("the rank not ready", || state.view().not_ready() == vec![w]).await;

    let deadline = Instant::now() + Duration::from_secs(10);
    let publisher = loop {
        match kvroute_wire::publisher::EventPublisher::bind(&endpoint, None, "", 16).await {
            Ok(p) => break p,
            Err(e) => assert!(Instant::now() < deadline, "the port stays taken: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(state.view().wait_ready(Duration::from_secs(10)).await, Vec::new());
    until("a batch of the restarted publisher", || {
        publisher.send(stored(2), 0);
        state.view().tree_size(w) == 1
    })
    .await;
}

/// The event plane: a vLLM-format batch whose `dp_rank` is 2^31 (real msgpack bytes on a real
/// PUB socket) is refused and counted; the worker's later batches still apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_an_out_of_range_dp_rank_is_refused() {
    let (publisher, state, _tasks) = worker_9_on_a_publisher().await;
    let rejected = || {
        state
            .view()
            .render_metrics()
            .contains("kvroute_router_events_rejected_total{reason=\"dp_rank\"} 0")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while rejected() {
        assert!(Instant::now() < deadline, "the bad batch never arrived");
        publisher.send(stored(1), 1 << 31);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state.view().workers()[0].dp_size, 1, "no rank was added");
    let w = WorkerWithDpRank::new(9u64, 0u32);
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.view().tree_size(w) == 0 {
        assert!(Instant::now() < deadline, "a good batch after it was not applied");
        publisher.send(stored(2), 0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Ranks come from configuration, not from event bytes: batches naming ranks 3, 200 and 255
/// (all below `max_dp_size`) for a worker configured with one rank are refused and counted,
/// the worker keeps its one rank, and no placement names a rank it does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_naming_ranks_the_worker_does_not_have_change_nothing() {
    use kvroute_core::LocalBlockHash;
    use kvroute_router::PlaceRequest;
    let (publisher, state, _tasks) = worker_9_on_a_publisher().await;
    let refused = || {
        let text = state.view().render_metrics();
        text.lines()
            .find(|l| l.starts_with("kvroute_router_events_rejected_total{reason=\"dp_rank\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    for (k, rank) in [3u32, 200, 255].into_iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while refused() <= k as u64 {
            assert!(Instant::now() < deadline, "the batch for rank {rank} never arrived");
            publisher.send(stored(10 + u64::from(rank)), rank);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let worker = &state.view().workers()[0];
    assert_eq!((worker.dp_size, worker.tree_size.len()), (1, 1), "no rank was added");
    assert_eq!(state.view().tree_size(WorkerWithDpRank::new(9u64, 0u32)), 0);
    let hashes = [LocalBlockHash(1), LocalBlockHash(2)];
    for _ in 0..50 {
        let placement =
            PlaceRequest { local_hashes: hashes.into(), num_tokens: 8, ..PlaceRequest::default() };
        let decision = state.decide_now(&placement).unwrap();
        assert_eq!(decision.decode.worker, WorkerWithDpRank::new(9u64, 0u32));
    }
}

/// A worker publishing blocks of another size than the router's: its blocks are counted on
/// `/metrics` and `/workers` (with the size it uses), not silently dropped, and the worker is
/// refused (never routed to blind) with a message naming both sizes and the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_of_another_size_are_counted_and_shown() {
    use kvroute_wire::publisher::EventPublisher;
    use kvroute_wire::{BlockStored, EngineEvent};
    let publisher = EventPublisher::bind("tcp://127.0.0.1:0", None, "", 16).await.unwrap();
    let mut spec = WorkerSpec::new(4);
    spec.events = Some(publisher.endpoint.clone());
    let state =
        Arc::new(RouterState::new(RouterConfig { workers: vec![spec], ..RouterConfig::default() }));
    let _tasks = kvroute_router::spawn_background(&state).unwrap();
    let thirty_two = vec![EngineEvent::BlockStored(BlockStored {
        block_hashes: vec![7],
        token_ids: (0..32).collect(),
        block_size: 32,
        ..BlockStored::default()
    })];
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.view().workers()[0].conversion.wrong_block_size == 0 {
        assert!(Instant::now() < deadline, "the batch never arrived");
        publisher.send(thirty_two.clone(), 0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = &state.view().workers()[0];
    assert_eq!(status.conversion.seen_block_size, Some(32));
    assert_eq!(status.tree_size[0], 0, "nothing indexed");
    let why = status.refused.as_deref().expect("refused");
    assert!(why.contains("32") && why.contains("16") && why.contains("--block-size 32"), "{why}");
    assert_eq!(status.ready, vec![false]);
    let placement = kvroute_router::PlaceRequest {
        local_hashes: [kvroute_core::LocalBlockHash(1)].into(),
        num_tokens: 8,
        ..kvroute_router::PlaceRequest::default()
    };
    assert!(state.decide_now(&placement).is_none(), "a refused worker is never chosen");
    assert!(state.view().not_ready()[0].worker_id == kvroute_core::WorkerId(4));
    let metrics = state.view().render_metrics();
    assert!(
        metrics.contains(
            "kvroute_router_converted_blocks_total{worker_id=\"4\",outcome=\"wrong_block_size\"}"
        ),
        "{metrics}"
    );
}

/// Serves `text` as an engine's Prometheus endpoint on loopback; its URL.
async fn serve_metrics(text: String) -> String {
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(move || std::future::ready(text.clone())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(kvroute_http::serve(listener, app, std::future::pending()));
    format!("http://{addr}/metrics")
}

/// `metrics=http://...`: the router polls an engine's Prometheus endpoint for vLLM's gauges
/// (here a real HTTP server answering what vLLM 0.11 serves); the worker is ready once they
/// arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_is_polled_from_a_prometheus_endpoint() {
    const VLLM: &str = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\nvllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"4096\"} 1.0\n";
    let mut spec = WorkerSpec::new(3);
    spec.metrics = Some(serve_metrics(VLLM.to_owned()).await);
    let state =
        Arc::new(RouterState::new(RouterConfig { workers: vec![spec], ..RouterConfig::default() }));
    assert_eq!(state.view().not_ready().len(), 1, "no load report yet");
    let _tasks = kvroute_router::spawn_background(&state).unwrap();
    let waiting = state.view().wait_ready(Duration::from_secs(10)).await;
    assert!(waiting.is_empty(), "{waiting:?}");
    let load = state.view().workers()[0].load[0].unwrap();
    assert_eq!(
        (load.num_running_reqs, load.num_waiting_reqs, load.kv_cache_usage, load.kv_total_blocks),
        (Some(2), Some(1), Some(0.5), Some(4096))
    );
    assert_eq!(load.block_size, Some(16));
    // Without --block-size, the size the engines report is taken.
    let workers = state.config.workers.clone();
    let size = kvroute_router::load::engines_block_size(&workers, Duration::from_secs(5)).await;
    assert_eq!(size, Ok(Some(16)));
}

/// An engine whose metrics report another block size than the router's is refused before
/// its first event: never ready, the cause in its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reporting_another_block_size_is_refused() {
    const VLLM: &str = "vllm:num_requests_running{engine=\"0\"} 0.0\nvllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"128\"} 1.0\n";
    let mut spec = WorkerSpec::new(3);
    spec.metrics = Some(serve_metrics(VLLM.to_owned()).await);
    let mut same = spec.clone();
    same.block_size = Some(32);
    same.id = kvroute_core::WorkerId(5);
    let config = RouterConfig { workers: vec![spec, same], ..RouterConfig::default() };
    let state = Arc::new(RouterState::new(config));
    let _tasks = kvroute_router::spawn_background(&state).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.view().workers().iter().any(|w| w.load[0].is_none()) {
        assert!(Instant::now() < deadline, "no load report");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let workers = state.view().workers();
    let why = workers[0].refused.as_deref().expect("refused");
    assert!(why.contains("32 tokens") && why.contains("as 16"), "{why}");
    assert!(!workers[0].ready[0]);
    assert!(workers[0].waiting_for(0).iter().any(|w| w.contains("refused")));
    assert_eq!(workers[1].refused, None, "its own block_size=32 matches its engine");
    assert!(workers[1].ready[0]);
}

/// Engines that disagree on their block size: no size is taken, and the error names each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_disagree_on_their_block_size_are_named() {
    let mut workers = Vec::new();
    for (id, size) in [(1u64, 16), (2, 32)] {
        let text = format!("vllm:cache_config_info{{block_size=\"{size}\",engine=\"0\"}} 1.0\n");
        let mut spec = WorkerSpec::new(id);
        spec.metrics = Some(serve_metrics(text).await);
        workers.push(spec);
    }
    let err = kvroute_router::load::engines_block_size(&workers, Duration::from_secs(5))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("1: 16") && err.contains("2: 32") && err.contains("--block-size"),
        "{err}"
    );
    // An engine that never answers reports nothing.
    let mut silent = WorkerSpec::new(3);
    silent.metrics = Some("http://127.0.0.1:9/metrics".into());
    let none =
        kvroute_router::load::engines_block_size(&[silent], Duration::from_millis(600)).await;
    assert_eq!(none, Ok(None));
}

//! What a front door tells the router of its workers, with the router embedded and with a
//! remote `kvroute router` (the front door's `--router-url`), each test run both ways: a
//! parity probe's outcome, the adapters each worker lists, and a dead engine's blocks
//! forgotten after it refuses a connection. Real sockets on 127.0.0.1.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{BlockSize, WorkerWithDpRank};
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::{Parity, RouterConfig, RouterState, WorkerSpec};
use kvroute_stack::{Simulated, Stack, StackConfig};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const WAIT: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Embedded,
    Remote,
}

/// A router over `config`'s workers and a front door in front of it: in one stack, or the
/// router in one (no front door) and the front door in another that asks it over HTTP.
struct Split {
    /// The stack holding the router (and, embedded, the front door).
    routed: Stack,
    /// A remote router's front door.
    front: Option<Stack>,
    base: String,
}

impl Split {
    async fn start(mode: Mode, mut config: StackConfig) -> Self {
        config.frontend = mode == Mode::Embedded;
        let routed = Stack::start(config.clone()).await.unwrap();
        // Every worker ready, but an engine of another block size, which the router refuses
        // once its events show the size (#68): never ready, never routed to. (Waiting for all
        // to be ready passed only when the refusal lost a race.)
        let router = Arc::clone(routed.router.as_ref().unwrap());
        eventually("every worker ready or refused", || {
            let workers = router.view().workers();
            let refused = |id| workers.iter().any(|w| w.id == id && w.refused.is_some());
            router.view().not_ready().iter().all(|r| refused(r.worker_id))
        })
        .await;
        if mode == Mode::Embedded {
            let base = routed.serve_frontend_on_loopback().await.unwrap();
            return Self { routed, front: None, base };
        }
        let url = kvroute_stack::serve_on_loopback(routed.router_app().unwrap()).await.unwrap();
        let front = StackConfig {
            router: RouterConfig { workers: routed.workers.clone(), ..config.router },
            router_url: Some(url),
            front_door: config.front_door,
            ..StackConfig::default()
        };
        let front = Stack::start(front).await.unwrap();
        assert!(front.router.is_none(), "no embedded router");
        let base = front.serve_frontend_on_loopback().await.unwrap();
        Self { routed, front: Some(front), base }
    }

    fn router(&self) -> &Arc<RouterState> {
        self.routed.router.as_ref().unwrap()
    }

    fn front_door(&self) -> &Stack {
        self.front.as_ref().unwrap_or(&self.routed)
    }

    async fn chat(&self, model: &str, text: &str) -> (u16, Option<u64>, Value) {
        let body = json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2});
        let url = format!("{}/v1/chat/completions", self.base);
        let response =
            HttpClient::new().call(hyper::Method::POST, &url, Some(&body)).await.unwrap();
        let worker =
            response.headers().get("x-kvroute-worker").and_then(|v| v.to_str().ok()?.parse().ok());
        let status = response.status().as_u16();
        let bytes =
            http_body_util::BodyExt::collect(response.into_body()).await.unwrap().to_bytes();
        (status, worker, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }
}

fn simulated(count: usize, adapters: &[&str]) -> StackConfig {
    StackConfig {
        simulated: Simulated {
            count,
            engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
            lora_modules: adapters.iter().map(|a| ((*a).to_owned(), None)).collect(),
            ..Simulated::default()
        },
        ..StackConfig::default()
    }
}

/// Polls `done` until it holds or [`WAIT`] passes.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An engine of `block_size` on its own listener, its KV events on free ports.
async fn engine(block_size: u32) -> kvroute_mocker::Spawned {
    let config = kvroute_mocker::MockerConfig {
        engine: EngineConfig {
            timing: Timing { speedup: 100.0 },
            block_size: BlockSize::new(block_size).unwrap(),
            ..EngineConfig::default()
        },
        endpoints: kvroute_mocker::Endpoints::ephemeral(),
        ..Default::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    kvroute_mocker::spawn(config, listener).await.unwrap()
}

fn spec(id: u64, e: &kvroute_mocker::Spawned) -> WorkerSpec {
    let mut spec = WorkerSpec::new(id);
    spec.url = Some(e.url.clone());
    spec.events.clone_from(&e.events);
    spec.replay.clone_from(&e.replay);
    spec
}

async fn the_parity_probe_reaches_the_router(mode: Mode) {
    let big_blocks = engine(32).await;
    let mut config = simulated(1, &[]);
    config.router.workers = vec![spec(1, &big_blocks)];
    let split = Split::start(mode, config).await;
    let good = split.routed.workers.last().unwrap().id;
    let parity =
        |id| split.router().view().workers().into_iter().find(|w| w.id == id).unwrap().parity;
    let failed = |p: Parity| matches!(p, Parity::Failed(_));
    eventually("both probed", || {
        failed(parity(kvroute_core::WorkerId(1))) && parity(good) == Parity::Ok
    })
    .await;
    let Parity::Failed(cause) = parity(kvroute_core::WorkerId(1)) else { unreachable!() };
    assert!(
        cause.starts_with("block size: the engine's KV events carry blocks of 32"),
        "{mode:?}: {cause}"
    );
    // The front door's /workers shows the router's view either way.
    let url = format!("{}/workers", split.base);
    let view: Value = HttpClient::new().get_json(&url).await.unwrap();
    let states: Vec<&str> = view["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["parity"]["state"].as_str().unwrap())
        .collect();
    assert!(states.contains(&"failed") && states.contains(&"ok"), "{mode:?}: {view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parity_probe_reaches_an_embedded_router() {
    the_parity_probe_reaches_the_router(Mode::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parity_probe_reaches_a_remote_router() {
    the_parity_probe_reaches_the_router(Mode::Remote).await;
}

/// A worker that stopped listing an adapter gets none of its requests once the front door has
/// read the lists (here at its start); the base model still goes to both.
async fn an_adapter_goes_only_where_it_is_listed(mode: Mode) {
    let split = Split::start(mode, simulated(2, &["sql"])).await;
    // The second engine unloads the adapter; the front door reads the lists again.
    assert!(split.routed.simulated[1].catalog.remove("sql"));
    split.front_door().frontend.as_ref().unwrap().discover_models().await;
    let serving = split.routed.workers[0].id.0;
    let router = Arc::clone(split.router());
    // A remote router hears of it in the background.
    let mut k = 0;
    loop {
        let (status, worker, body) =
            split.chat("sql", &format!("{k} a question for the sql adapter")).await;
        assert_eq!(status, 200, "{mode:?}: {body}");
        k += 1;
        if router.view().recent_decisions().last().is_some_and(|d| d.considered == 1) {
            assert_eq!(worker, Some(serving), "{mode:?}");
            break;
        }
        assert!(k < 200, "{mode:?}: the router never heard which workers list sql");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for k in 0..4 {
        let (status, worker, _) = split.chat("sql", &format!("again {k}")).await;
        assert_eq!((status, worker), (200, Some(serving)), "{mode:?}");
    }
    assert_eq!(split.chat("kvroute-tiny", "base").await.0, 200);
    assert_eq!(
        router.view().recent_decisions().last().unwrap().considered,
        2,
        "{mode:?}: the base model may go to both"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_goes_only_where_listed_embedded() {
    an_adapter_goes_only_where_it_is_listed(Mode::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_goes_only_where_listed_remote() {
    an_adapter_goes_only_where_it_is_listed(Mode::Remote).await;
}

/// An engine that unloaded an adapter before anyone read its list answers its requests with
/// a 404: the front door takes that as "not here" and places the request on another worker
/// that serves it, so no client sees the 404 (a remote router hears of an unloaded adapter in
/// the background: such requests come in that window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_an_adapter_an_engine_unloaded_goes_to_another() {
    let split = Split::start(Mode::Embedded, simulated(2, &["sql"])).await;
    // Not read again: the router still takes both for serving it.
    assert!(split.routed.simulated[1].catalog.remove("sql"));
    let serving = split.routed.workers[0].id.0;
    for k in 0..12 {
        let (status, worker, body) = split.chat("sql", &format!("{k} question for sql")).await;
        assert_eq!((status, worker), (200, Some(serving)), "{body}");
    }
    // Nobody serves it any more: the engines' 404 reaches the client.
    assert!(split.routed.simulated[0].catalog.remove("sql"));
    let (status, _, body) = split.chat("sql", "nobody has it").await;
    assert_eq!(status, 404, "{body}");
}

/// An engine whose HTTP port starts refusing connections has its blocks forgotten by the
/// router (its health check finds it before any client does).
async fn a_dead_engines_blocks_are_forgotten(mode: Mode) {
    let config = kvroute_mocker::MockerConfig {
        engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
        endpoints: kvroute_mocker::Endpoints::ephemeral(),
        ..Default::default()
    };
    let state = kvroute_mocker::start(config).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = kvroute_mocker::http::app(Arc::clone(&state));
    let server = tokio::spawn(kvroute_http::serve(listener, app, async {
        let _ = stopped.await;
    }));
    let bound = state.engine.bound.clone();
    let mut spec = WorkerSpec::new(9);
    spec.url = Some(url);
    spec.events = bound.events;
    spec.replay = bound.replay;
    let mut config = simulated(0, &[]);
    config.router.workers = vec![spec];
    let split = Split::start(mode, config).await;
    let rank = WorkerWithDpRank::new(kvroute_core::WorkerId(9), 0);
    let (status, worker, body) = split
        .chat("kvroute-tiny", "a prompt long enough to fill a block or two of sixteen tokens each")
        .await;
    assert_eq!((status, worker), (200, Some(9)), "{mode:?}: {body}");
    let router = Arc::clone(split.router());
    eventually("its blocks indexed", || router.view().tree_size(rank) > 0).await;
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    eventually("its blocks forgotten", || router.view().tree_size(rank) == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engines_blocks_are_forgotten_embedded() {
    a_dead_engines_blocks_are_forgotten(Mode::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engines_blocks_are_forgotten_remote() {
    a_dead_engines_blocks_are_forgotten(Mode::Remote).await;
}

//! The engine in real time: one OS thread owns the [`Engine`], takes requests and
//! cancellations from a channel, runs steps paced to the simulated clock (divided by the
//! speedup already), streams each request's outputs to its own channel at the end of the step
//! that produced them, publishes KV events (vLLM's format, with replay) and load reports (JSON
//! on a ZMQ PUB, every 100 ms and on change).
//!
//! ```text
//!  HTTP handlers ──Command::Submit/Cancel──▶ engine thread ──Output──▶ per-request channels
//!                                               │ events              │ snapshot
//!                                               ▼                     ▼
//!                                        EventPublisher         load task ──▶ ZMQ PUB (JSON)
//! ```
//!
//! A thread of its own, sleeping with the OS's precision (tens of microseconds), keeps each
//! step's tokens at the step's time even when a step lasts less than a millisecond (a decode
//! step at `--speedup 10` is ~0.6 ms; the runtime's timers would round it to 1 ms and bunch
//! tokens). The thread ends once the engine is idle and every handle on it is gone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvroute_wire::EngineEvent;
use kvroute_wire::publisher::EventPublisher;
use kvroute_wire::transport::{SocketRole, ZmqLimits};
use rustc_hash::FxHashMap;
use serde::Serialize;
use tokio::sync::mpsc;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::engine::{Engine, EngineConfig, EngineRequest, EngineStats, LoraStats, Output};
use crate::store::{Acked, Put, StoreLink};

/// Where the engine publishes (`None`: not at all).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoints {
    /// KV events (ZMQ PUB), e.g. `tcp://127.0.0.1:5557` (port 0: any).
    pub events: Option<String>,
    /// Replay (ZMQ ROUTER) of the last KV event batches.
    pub replay: Option<String>,
    /// Load reports (ZMQ PUB, JSON).
    pub metrics: Option<String>,
}

impl Endpoints {
    /// Events, replay and load reports, each on a free loopback port.
    pub fn ephemeral() -> Self {
        let any = || Some("tcp://127.0.0.1:0".to_owned());
        Self { events: any(), replay: any(), metrics: any() }
    }

    /// Load reports only: an engine started without KV events (routed approximately).
    pub fn without_events() -> Self {
        Self { events: None, replay: None, ..Self::ephemeral() }
    }
}

/// What the engine reports about itself (`/stats`, `/metrics`, load reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Snapshot {
    pub num_waiting_reqs: usize,
    pub num_running_reqs: usize,
    pub kv_cache_usage: f64,
    pub kv_total_blocks: usize,
    /// Blocks of host memory below the GPU cache (0: none), and of storage below it.
    pub host_total_blocks: usize,
    pub storage_total_blocks: usize,
    /// It writes to and loads from a shared store (`--store-url`).
    pub shared_store: bool,
    pub simulated_seconds: f64,
    /// Messages its ZMQ sockets refused for exceeding their size limit.
    pub zmq_refused: u64,
    /// Ground truth: requests, prompt and cached tokens, evictions, preemptions.
    #[serde(flatten)]
    pub stats: EngineStats,
}

/// The engine's adapters as vLLM reports them (`vllm:lora_requests_info`, and kvroute's load
/// reports).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AdapterSnapshot {
    /// Distinct adapters a batch may use (vLLM's `max_lora` label).
    pub max_lora: usize,
    /// Adapters of running requests, with how many run (vLLM's `running_lora_adapters`).
    pub running: Vec<(String, usize)>,
    /// Adapters of waiting requests (vLLM's `waiting_lora_adapters`).
    pub waiting: Vec<(String, usize)>,
    /// Adapters in the GPU slots, least recently used first.
    pub resident: Vec<String>,
    pub stats: LoraStats,
}

impl AdapterSnapshot {
    /// Adapter names comma-joined, as vLLM's `vllm:lora_requests_info` labels carry them.
    pub fn joined(list: &[(String, usize)]) -> String {
        list.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(",")
    }
}

#[derive(Debug)]
enum Command {
    /// A request, its outputs' channel and its ticket (which submission this is).
    Submit(EngineRequest, mpsc::UnboundedSender<Output>, u64),
    /// Cancels a request, only if it is still the submission of this ticket: a second
    /// request refused for reusing a running request's id cannot cancel that one.
    Cancel(String, u64),
    Unload(String),
    /// A decode engine pulled a held prefill's blocks, or its lease ended.
    Release(String),
    /// How many leading prompt blocks of a request the cache holds.
    Probe(EngineRequest, tokio::sync::oneshot::Sender<usize>),
    /// Write computed blocks to the shared store through this channel.
    AttachStore(mpsc::UnboundedSender<Put>),
    /// The store answered a put or a poll.
    StoreAck(Acked),
}

/// A handle on the running engine task.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    snapshot: Arc<Mutex<Snapshot>>,
    adapters: Arc<Mutex<AdapterSnapshot>>,
    /// The endpoints actually bound (ports 0 resolved).
    pub bound: Endpoints,
    pub dp_rank: u32,
    pub config: EngineConfig,
    faults: Arc<Faults>,
    /// Messages its ZMQ sockets refused for their size.
    zmq_refused: Arc<AtomicU64>,
}

/// Cancels its request when dropped before being disarmed: a client that goes away frees
/// the request's blocks.
pub struct CancelOnDrop {
    tx: mpsc::UnboundedSender<Command>,
    id: Option<String>,
    ticket: u64,
    /// Anything to release with the request (the HTTP layer's claim on its id).
    pub(crate) lease: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for CancelOnDrop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelOnDrop").field("id", &self.id).field("ticket", &self.ticket).finish()
    }
}

impl CancelOnDrop {
    pub fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.tx.send(Command::Cancel(id, self.ticket));
        }
    }
}

impl EngineHandle {
    /// Starts the engine task (and publishers) on the current runtime.
    pub async fn start(
        config: EngineConfig,
        endpoints: &Endpoints,
        dp_rank: u32,
    ) -> Result<Self, crate::MockerError> {
        // Its sockets hear only subscriptions and replay requests; whatever is bigger is
        // refused before it is allocated, and counted.
        let zmq_refused = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&zmq_refused);
        let limits = ZmqLimits::default().counting(move |_| {
            counter.fetch_add(1, Ordering::Relaxed);
        });
        let publisher = match &endpoints.events {
            Some(events) => {
                let replay = endpoints.replay.as_deref();
                Some(EventPublisher::bind_with(events, replay, "", 10_000, &limits).await?)
            }
            None => None,
        };
        let mut bound = Endpoints {
            events: publisher.as_ref().map(|p| p.endpoint.clone()),
            replay: publisher.as_ref().and_then(|p| p.replay_endpoint.clone()),
            metrics: None,
        };
        let snapshot = Arc::new(Mutex::new(Snapshot {
            kv_total_blocks: config.num_blocks,
            host_total_blocks: config.host.num_blocks,
            storage_total_blocks: config.host.storage_tier_blocks(),
            ..Snapshot::default()
        }));
        let adapters = Arc::new(Mutex::new(AdapterSnapshot {
            max_lora: config.lora.max_loras,
            ..AdapterSnapshot::default()
        }));
        if let Some(metrics) = &endpoints.metrics {
            let mut socket = PubSocket::with_options(limits.options(SocketRole::Publisher));
            bound.metrics = Some(socket.bind(metrics).await?.to_string());
            let shared = (Arc::clone(&snapshot), Arc::clone(&adapters));
            tokio::spawn(publish_load(socket, shared, dp_rank));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = (Arc::clone(&snapshot), Arc::clone(&adapters));
        let faults = Arc::new(Faults::default());
        let lossy = Arc::clone(&faults);
        std::thread::Builder::new().name(format!("kvroute-engine-{dp_rank}")).spawn(move || {
            run(Engine::new(config), rx, publisher.as_ref(), &shared, dp_rank, &lossy);
        })?;
        Ok(Self { tx, snapshot, adapters, bound, dp_rank, config, faults, zmq_refused })
    }

    /// Queues a request; its outputs arrive on the returned channel. The guard cancels the
    /// request if dropped before [`CancelOnDrop::disarm`].
    pub fn submit(&self, req: EngineRequest) -> (mpsc::UnboundedReceiver<Output>, CancelOnDrop) {
        static TICKETS: AtomicU64 = AtomicU64::new(0);
        let ticket = TICKETS.fetch_add(1, Ordering::Relaxed);
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let id = Some(req.id.clone());
        let guard = CancelOnDrop { tx: self.tx.clone(), id, ticket, lease: None };
        let _ = self.tx.send(Command::Submit(req, out_tx, ticket));
        (out_rx, guard)
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = *self.snapshot.lock().unwrap_or_else(PoisonError::into_inner);
        s.zmq_refused = self.zmq_refused.load(Ordering::Relaxed);
        s
    }

    /// The engine's adapters now.
    pub fn adapters(&self) -> AdapterSnapshot {
        self.adapters.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Frees a held prefill's blocks.
    pub fn release_held(&self, id: &str) {
        let _ = self.tx.send(Command::Release(id.to_owned()));
    }

    /// The leading full blocks of `req`'s prompt the cache holds now (0 if the engine is
    /// gone).
    pub async fn cached_prompt_blocks(&self, req: EngineRequest) -> usize {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = self.tx.send(Command::Probe(req, tx));
        rx.await.unwrap_or(0)
    }

    /// Writes every block the engine computes from now on to the shared store at `link`
    /// under `owner`, and announces what the store answers (locality `REMOTE`), on the
    /// current runtime.
    pub fn attach_store(&self, link: StoreLink, owner: String) {
        let (puts_tx, puts_rx) = mpsc::unbounded_channel();
        // The writer must not keep the engine thread alive: it holds a weak sender.
        let engine = self.tx.downgrade();
        let acked = move |a: Acked| {
            engine.upgrade().is_some_and(|tx| tx.send(Command::StoreAck(a)).is_ok())
        };
        tokio::spawn(link.writer(owner, puts_rx, acked));
        let _ = self.tx.send(Command::AttachStore(puts_tx));
    }

    /// Forgets an adapter's slot and host copy (vLLM's `/v1/unload_lora_adapter`).
    pub fn unload_adapter(&self, name: &str) {
        let _ = self.tx.send(Command::Unload(name.to_owned()));
    }

    /// Fault injection for tests: while on, `BlockRemoved` events are left out of the live
    /// stream (kept for replay, with no gap in sequence numbers), as a lossy link would lose
    /// them; a router then believes the engine holds blocks it evicted.
    pub fn lose_removed_events(&self, on: bool) {
        self.faults.lose_removed.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Fault injection for tests: while on, `BlockStored` events leave out their image keys
    /// (`extra_keys`), as an engine that does not announce them would: blocks covering two
    /// different pictures then look alike to a router.
    pub fn drop_image_keys(&self, on: bool) {
        self.faults.no_image_keys.store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Faults a test can switch on.
#[derive(Debug, Default)]
struct Faults {
    lose_removed: std::sync::atomic::AtomicBool,
    no_image_keys: std::sync::atomic::AtomicBool,
}

fn run(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Command>,
    publisher: Option<&EventPublisher>,
    snapshot: &Shared,
    dp_rank: u32,
    faults: &Faults,
) {
    let mut streams = Streams::default();
    let mut store: Option<mpsc::UnboundedSender<Put>> = None;
    let send = |events: Vec<EngineEvent>| publish_events(publisher, events, dp_rank, faults);
    // Real time paces simulated time: a step may end early, never the clock as a whole.
    let start = Instant::now();
    let mut offset = Duration::ZERO; // simulated time spent idle does not count
    loop {
        while let Ok(cmd) = rx.try_recv() {
            send(run_command(cmd, &mut engine, &mut streams, &mut store));
        }
        let Some(step) = engine.step() else {
            publish_snapshot(&engine, snapshot);
            let idle_from = Instant::now();
            match rx.blocking_recv() {
                Some(cmd) => send(run_command(cmd, &mut engine, &mut streams, &mut store)),
                None => return,
            }
            offset += idle_from.elapsed();
            continue;
        };
        let due = start + offset + engine.now();
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        } else {
            // Behind (a slow machine): do not try to catch up on the past.
            offset += now - due;
        }
        send(step.events);
        for put in engine.take_store_puts() {
            if let Some(store) = &store {
                let _ = store.send(put);
            }
        }
        // The step's state is published before its answers go out: a client that has its
        // answer and then reads `/stats` or `/metrics` sees the request finished.
        publish_snapshot(&engine, snapshot);
        for output in step.outputs {
            let (id, done) = match &output {
                Output::FirstToken { id, .. } | Output::Token { id, .. } => (id.clone(), false),
                Output::Finished { id, .. } => (id.clone(), true),
            };
            if let Some((_, stream)) = streams.get(&id)
                && stream.send(output).is_err()
            {
                // The receiver is gone without cancelling (a dropped handler): free the request.
                engine.cancel(&id);
                streams.remove(&id);
                continue;
            }
            if done {
                streams.remove(&id);
            }
        }
    }
}

/// Each running request's ticket and outputs' channel, by id.
type Streams = FxHashMap<String, (u64, mpsc::UnboundedSender<Output>)>;

/// Publishes a batch of KV events (with the faults a test switched on).
fn publish_events(
    publisher: Option<&EventPublisher>,
    mut events: Vec<EngineEvent>,
    dp_rank: u32,
    faults: &Faults,
) {
    let Some(p) = publisher.filter(|_| !events.is_empty()) else { return };
    if faults.no_image_keys.load(Ordering::Relaxed) {
        for e in &mut events {
            if let EngineEvent::BlockStored(s) = e {
                s.extra_keys = None;
            }
        }
    }
    if faults.lose_removed.load(Ordering::Relaxed) {
        p.send_lossy(events, dp_rank, |e| matches!(e, EngineEvent::BlockRemoved(_)));
    } else {
        p.send(events, dp_rank);
    }
}

/// Applies a command; the KV events it makes known (the shared store's answers).
fn run_command(
    cmd: Command,
    engine: &mut Engine,
    streams: &mut Streams,
    store: &mut Option<mpsc::UnboundedSender<Put>>,
) -> Vec<EngineEvent> {
    match cmd {
        Command::Submit(req, out, ticket) => {
            let id = req.id.clone();
            match engine.submit(req) {
                Ok(()) => {
                    streams.insert(id, (ticket, out));
                }
                Err(err) => {
                    // An id is the caller's: logged cut, whatever its length.
                    let (id, err) =
                        (crate::disagg::shown(&id), crate::disagg::shown(&err.to_string()));
                    tracing::warn!(%id, %err, "request refused by the engine");
                }
            }
        }
        Command::Cancel(id, ticket) => {
            if streams.get(&id).is_some_and(|(t, _)| *t == ticket) {
                engine.cancel(&id);
                streams.remove(&id);
            }
        }
        Command::Unload(name) => engine.unload_adapter(&name),
        Command::Release(id) => {
            engine.release_held(&id);
        }
        Command::Probe(req, reply) => {
            let _ = reply.send(engine.cached_prompt_blocks(&req));
        }
        Command::AttachStore(puts) => {
            engine.attach_store();
            *store = Some(puts);
        }
        Command::StoreAck(acked) => return engine.store_acked(acked),
    }
    Vec::new()
}

/// What the engine thread shares with the handles and the load task.
type Shared = (Arc<Mutex<Snapshot>>, Arc<Mutex<AdapterSnapshot>>);

fn publish_snapshot(engine: &Engine, (snapshot, adapters): &Shared) {
    let (running, waiting) = engine.adapter_requests();
    let resident = engine.resident_adapters();
    {
        let mut a = adapters.lock().unwrap_or_else(PoisonError::into_inner);
        if a.running != running || a.waiting != waiting || a.resident != resident {
            a.running = running;
            a.waiting = waiting;
            a.resident = resident.to_vec();
        }
        a.stats = engine.lora_stats();
    }
    *snapshot.lock().unwrap_or_else(PoisonError::into_inner) = Snapshot {
        num_waiting_reqs: engine.waiting(),
        num_running_reqs: engine.running(),
        kv_cache_usage: engine.kv_usage(),
        kv_total_blocks: engine.config().num_blocks,
        host_total_blocks: engine.config().host.num_blocks,
        storage_total_blocks: engine.config().host.storage_tier_blocks(),
        shared_store: engine.has_store(),
        simulated_seconds: engine.now().as_secs_f64(),
        zmq_refused: 0,
        stats: engine.stats(),
    };
}

/// Load reports (docs/mocker.md): every 100 ms, and within 10 ms of a change.
async fn publish_load(mut socket: PubSocket, (snapshot, adapters): Shared, dp_rank: u32) {
    let mut last: Option<(usize, usize, u64)> = None;
    let mut last_sent = Instant::now() - Duration::from_secs(1);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        tick.tick().await;
        let s = *snapshot.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (s.num_waiting_reqs, s.num_running_reqs, (s.kv_cache_usage * 1e6) as u64);
        if last == Some(key) && last_sent.elapsed() < Duration::from_millis(100) {
            continue;
        }
        let mut report = serde_json::json!({
            "num_waiting_reqs": s.num_waiting_reqs,
            "kv_cache_usage": s.kv_cache_usage,
            "num_running_reqs": s.num_running_reqs,
            "kv_total_blocks": s.kv_total_blocks,
            "dp_rank": dp_rank,
        });
        // Adapters, named as vLLM's `vllm:lora_requests_info` labels them (comma-joined).
        let a = adapters.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if !a.resident.is_empty() || !a.waiting.is_empty() {
            let names = AdapterSnapshot::joined;
            report["max_lora"] = a.max_lora.into();
            report["running_lora_adapters"] = names(&a.running).into();
            report["waiting_lora_adapters"] = names(&a.waiting).into();
            report["resident_lora_adapters"] = a.resident.join(",").into();
        }
        if socket.send(ZmqMessage::from(report.to_string().into_bytes())).await.is_err() {
            return;
        }
        (last, last_sent) = (Some(key), Instant::now());
    }
}

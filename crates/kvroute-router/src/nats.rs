//! Router replicas over NATS (SPEC section 12). Every replica routes alone from its own index;
//! NATS carries what one replica cannot see by itself:
//!
//! ```text
//!  place/prefill_done/finish ─▶ outbox ─[SyncBatch JSON]─▶ {prefix}.decisions ─▶ every other replica:
//!                                                                 agreement check, then its in-flight accounting
//!  relay role:  engines' ZMQ ─▶ subscriber ─▶ relay ─[RouterEvent JSON, Nats-Msg-Id]─▶ JetStream {prefix}.events.{worker}.{rank}
//!  stream role: JetStream ─ordered consumer─▶ index (from the latest snapshot's sequence on)
//!                                         └─ every N events: index as events ─▶ object store {prefix}_snapshots/index
//! ```
//!
//! NATS down is degraded, never down: decisions are not sent (peers expire ours), the index
//! keeps what it has and routing goes on; `/health`, `/workers` and `/metrics` say so. When NATS
//! returns, the consumer resumes from its last sequence and the relay from each engine's
//! replay, so nothing of the outage is missing.
//!
//! A replica's in-flight entries live in its peers only while it is heard from: each sends a
//! heartbeat every [`HEARTBEAT`], and a peer silent for [`PEER_TIMEOUT`] has its entries freed
//! (counted). Each peer holds at most [`MAX_PEER_IN_FLIGHT`] entries, at most [`MAX_PEERS`]
//! peers are followed.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::{Client, ConnectOptions, Event};
use futures_util::StreamExt;
use kvroute_core::{LocalBlockHash, WorkerWithDpRank};
use kvroute_wire::replica::{SyncBatch, SyncMessage, decode_sync, encode_sync};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::state::RouterState;
use crate::stream;

/// How often a replica says it is alive when it routes nothing.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A peer not heard from for this long has its in-flight entries freed.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(5);
pub const MAX_PEERS: usize = 256;
pub const MAX_PEER_IN_FLIGHT: usize = 100_000;
/// Decisions waiting to be sent; beyond it they are dropped (counted).
const OUTBOX: usize = 65_536;
/// Most decisions in one message.
const BATCH: usize = 256;

/// Where the KV events of a replica's workers come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventsVia {
    /// Each worker's ZMQ stream, directly (NATS carries decisions only).
    #[default]
    Zmq,
    /// The JetStream stream (another process relays the engines' events into it).
    Stream,
    /// This process subscribes to the engines' ZMQ streams and relays them into JetStream,
    /// and routes from the stream like every other replica (and writes the snapshots).
    Relay,
}

impl std::str::FromStr for EventsVia {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "zmq" => Ok(Self::Zmq),
            "stream" => Ok(Self::Stream),
            "relay" => Ok(Self::Relay),
            other => Err(format!("unknown events source {other:?} (zmq, stream or relay)")),
        }
    }
}

impl EventsVia {
    pub fn from_stream(self) -> bool {
        matches!(self, Self::Stream | Self::Relay)
    }
}

/// Secrets of the NATS connection (never serialized, never logged).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NatsAuth {
    pub token: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuth")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// How a replica uses NATS.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NatsConfig {
    /// `nats://host:port` (or `tls://`), comma-separated for a cluster.
    pub url: String,
    /// Names the fleet: subjects `{prefix}.decisions`, `{prefix}.events.>`, the stream
    /// `{PREFIX}_EVENTS` and the bucket `{prefix}_snapshots`.
    pub prefix: String,
    /// This replica's name on the decisions subject (unique per process).
    pub replica: String,
    /// Share routing decisions with the other replicas.
    pub sync: bool,
    pub events: EventsVia,
    /// Write a snapshot every this many stream messages applied (0: never).
    pub snapshot_every: u64,
    /// The event stream's retention: at most this many bytes ...
    pub stream_max_bytes: i64,
    /// ... and this old.
    pub stream_max_age: Duration,
    #[serde(skip)]
    pub auth: NatsAuth,
    /// CA certificate(s) to trust for a TLS server (PEM).
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key (PEM) for servers that verify clients.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

pub const DEFAULT_PREFIX: &str = "kvroute";
pub const DEFAULT_SNAPSHOT_EVERY: u64 = 10_000;
pub const DEFAULT_STREAM_MAX_BYTES: i64 = 1 << 30;
pub const DEFAULT_STREAM_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

impl NatsConfig {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: DEFAULT_PREFIX.into(),
            replica: default_replica_name(),
            sync: true,
            events: EventsVia::Zmq,
            snapshot_every: 0,
            stream_max_bytes: DEFAULT_STREAM_MAX_BYTES,
            stream_max_age: DEFAULT_STREAM_MAX_AGE,
            auth: NatsAuth::default(),
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
        }
    }

    pub fn decisions_subject(&self) -> String {
        format!("{}.decisions", self.prefix)
    }

    pub fn events_subject(&self, worker: WorkerWithDpRank) -> String {
        format!("{}.events.{}.{}", self.prefix, worker.worker_id.0, worker.dp_rank.0)
    }

    pub fn events_filter(&self) -> String {
        format!("{}.events.>", self.prefix)
    }

    pub fn stream_name(&self) -> String {
        format!("{}_EVENTS", self.prefix.to_ascii_uppercase().replace(['.', '-'], "_"))
    }

    pub fn snapshot_bucket(&self) -> String {
        format!("{}_snapshots", self.prefix.replace('.', "_"))
    }

    /// Checks what the server would refuse later, with a clearer message now.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |s: &str| {
            !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if !ok(&self.prefix) {
            return Err(format!(
                "nats prefix {:?}: letters, digits, '_' and '-' only (it names subjects and buckets)",
                self.prefix
            ));
        }
        if self.replica.is_empty() || self.replica.len() > kvroute_wire::replica::MAX_SYNC_ID_BYTES
        {
            return Err("replica name must be 1 to 256 bytes".into());
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err("--nats-tls-cert and --nats-tls-key go together".into());
        }
        if self.auth.user.is_some() != self.auth.password.is_some() {
            return Err("a NATS user needs its password (and a password its user)".into());
        }
        Ok(())
    }

    fn options(&self, status: Arc<NatsStatus>) -> ConnectOptions {
        let mut o = ConnectOptions::new()
            .name(format!("kvroute {}", self.replica))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            // Back within a second of the server's return (the default waits up to 4 s).
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts as u64 * 100).min(1000))
            })
            .event_callback(move |event| {
                let status = Arc::clone(&status);
                async move { status.on_event(&event) }
            });
        if let Some(token) = &self.auth.token {
            o = o.token(token.clone());
        }
        if let (Some(user), Some(password)) = (&self.auth.user, &self.auth.password) {
            o = o.user_and_password(user.clone(), password.clone());
        }
        if let Some(ca) = &self.tls_ca {
            o = o.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
        if self.url.starts_with("tls://") {
            o = o.require_tls(true);
        }
        o
    }
}

fn default_replica_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{}-{:08x}",
        if host.is_empty() { "kvroute" } else { &host },
        std::process::id(),
        nanos
    )
}

/// What `/health`, `/workers` and `/metrics` show of NATS.
#[derive(Debug, Default)]
pub struct NatsStatus {
    connected: AtomicBool,
    /// Stream sequence applied last (stream modes).
    pub applied_seq: AtomicU64,
    /// The stream consumer has seen everything the stream held when it (re)started.
    pub caught_up: AtomicBool,
    pub peers: AtomicU64,
}

impl NatsStatus {
    fn on_event(&self, event: &Event) {
        match event {
            Event::Connected => {
                self.connected.store(true, Ordering::Relaxed);
                tracing::info!("NATS connected");
            }
            Event::Disconnected => {
                self.connected.store(false, Ordering::Relaxed);
                tracing::warn!("NATS disconnected: routing on local state (degraded)");
            }
            other => tracing::debug!(event = %other, "NATS event"),
        }
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }
}

/// The running replica's links into NATS, kept by [`RouterState`].
#[derive(Debug)]
pub struct NatsLinks {
    pub config: NatsConfig,
    pub status: Arc<NatsStatus>,
    outbox: Option<mpsc::Sender<SyncMessage>>,
    pub(crate) relay: Option<mpsc::Sender<stream::Relayed>>,
}

impl NatsLinks {
    /// Queues one of this replica's decisions for its peers; dropped (counted) when the outbox
    /// is full or NATS is away (the peers expire what they miss).
    pub(crate) fn send(&self, state: &RouterState, message: SyncMessage) {
        let Some(outbox) = &self.outbox else { return };
        if !self.status.connected() || outbox.try_send(message).is_err() {
            state.metrics.replica_message("unsent");
        }
    }

    /// The JSON `/health` and `/workers` show.
    pub fn summary(&self) -> serde_json::Value {
        let connected = self.status.connected();
        serde_json::json!({
            "url": self.config.url,
            "replica": self.config.replica,
            "connected": connected,
            "degraded": !connected,
            "sync": self.config.sync,
            "events": self.config.events,
            "peers": self.status.peers.load(Ordering::Relaxed),
            "stream_seq": self.status.applied_seq.load(Ordering::Relaxed),
            "caught_up": self.status.caught_up.load(Ordering::Relaxed),
        })
    }
}

/// Connects (in the background: an unreachable server at start is retried, never fatal) and
/// starts what `config` asks for. The links are set on `state` before this returns.
pub(crate) fn spawn(state: &Arc<RouterState>, config: NatsConfig) -> Vec<JoinHandle<()>> {
    let status = Arc::new(NatsStatus::default());
    let (outbox_tx, outbox_rx) = match config.sync {
        true => {
            let (tx, rx) = mpsc::channel(OUTBOX);
            (Some(tx), Some(rx))
        }
        false => (None, None),
    };
    let (relay_tx, relay_rx) = match config.events {
        EventsVia::Relay => {
            let (tx, rx) = mpsc::channel(stream::RELAY_QUEUE);
            (Some(tx), Some(rx))
        }
        _ => (None, None),
    };
    let links = NatsLinks {
        config: config.clone(),
        status: Arc::clone(&status),
        outbox: outbox_tx,
        relay: relay_tx,
    };
    state.set_nats(links);
    let state = Arc::clone(state);
    vec![tokio::spawn(async move {
        let client = match config.options(Arc::clone(&status)).connect(config.url.as_str()).await {
            Ok(client) => client,
            Err(err) => {
                // Only a malformed address or unreadable TLS files get here.
                tracing::error!(url = %config.url, %err, "NATS: cannot connect; replica features off");
                return;
            }
        };
        let mut tasks = Vec::new();
        if let Some(rx) = outbox_rx {
            tasks.push(tokio::spawn(send_decisions(client.clone(), config.clone(), rx)));
            tasks.push(tokio::spawn(receive_decisions(
                Arc::clone(&state),
                client.clone(),
                config.clone(),
                Arc::clone(&status),
            )));
        }
        if config.events.from_stream() {
            tasks.push(tokio::spawn(stream::consume(
                Arc::clone(&state),
                client.clone(),
                config.clone(),
                Arc::clone(&status),
            )));
        }
        if let Some(rx) = relay_rx {
            tasks.push(tokio::spawn(stream::relay(
                Arc::clone(&state),
                client.clone(),
                config.clone(),
                rx,
            )));
        }
        let _guard = AbortOnDrop(tasks);
        std::future::pending::<()>().await;
    })]
}

struct AbortOnDrop(Vec<JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Sends this replica's decisions in batches, and a heartbeat when there were none.
async fn send_decisions(client: Client, config: NatsConfig, mut rx: mpsc::Receiver<SyncMessage>) {
    let subject = config.decisions_subject();
    let mut buf = Vec::with_capacity(BATCH);
    loop {
        buf.clear();
        match tokio::time::timeout(HEARTBEAT, rx.recv_many(&mut buf, BATCH)).await {
            Ok(0) => return, // the router is gone
            Ok(_) => {}
            Err(_) => buf.push(SyncMessage::Heartbeat),
        }
        let batch =
            SyncBatch { replica: config.replica.clone(), messages: std::mem::take(&mut buf) };
        if let Err(err) = client.publish(subject.clone(), encode_sync(&batch).into()).await {
            tracing::debug!(%err, "NATS: decisions not sent");
        }
        buf = batch.messages;
    }
}

/// A peer replica as this one follows it.
struct Peer {
    heard: Instant,
    /// Its requests tracked here (their ids as it names them).
    in_flight: HashSet<String>,
}

/// Applies the other replicas' decisions to this one's in-flight accounting, and frees the
/// entries of peers that went silent.
async fn receive_decisions(
    state: Arc<RouterState>,
    client: Client,
    config: NatsConfig,
    status: Arc<NatsStatus>,
) {
    let mut peers = Peers::default();
    let mut sweep = tokio::time::interval(HEARTBEAT);
    loop {
        let mut sub = match client.subscribe(config.decisions_subject()).await {
            Ok(sub) => sub,
            Err(err) => {
                tracing::debug!(%err, "NATS: cannot subscribe to decisions yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                message = sub.next() => {
                    let Some(message) = message else { break };
                    match decode_sync(&message.payload) {
                        Ok(batch) if batch.replica == config.replica => {}
                        Ok(batch) => peers.apply(&state, batch),
                        Err(err) => {
                            state.metrics.replica_message("garbage");
                            tracing::debug!(%err, "undecodable decisions message");
                        }
                    }
                }
                _ = sweep.tick() => peers.expire(&state, Instant::now()),
            }
            status.peers.store(peers.0.len() as u64, Ordering::Relaxed);
        }
    }
}

fn peer_request_id(replica: &str, id: &str) -> String {
    format!("{replica}\u{1f}{id}")
}

/// The peer replicas this one follows, with their requests it tracks.
#[derive(Default)]
pub struct Peers(HashMap<String, Peer>);

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.0.iter().map(|(k, p)| (k, p.in_flight.len()))).finish()
    }
}

impl Peers {
    /// Applies a peer's batch (decoded from the wire) to `state`'s in-flight accounting.
    pub fn apply(&mut self, state: &RouterState, batch: SyncBatch) {
        let now = Instant::now();
        if !self.0.contains_key(&batch.replica) {
            if self.0.len() >= MAX_PEERS {
                state.metrics.replica_message("too_many_peers");
                return;
            }
            tracing::info!(peer = %batch.replica, "a replica joined");
        }
        let peer = self
            .0
            .entry(batch.replica.clone())
            .or_insert_with(|| Peer { heard: now, in_flight: HashSet::new() });
        peer.heard = now;
        for message in batch.messages {
            state.metrics.replica_message("received");
            match message {
                SyncMessage::Routed {
                    id,
                    worker_id,
                    dp_rank,
                    isl_tokens,
                    prefill_tokens,
                    local_hashes,
                } => {
                    if peer.in_flight.len() >= MAX_PEER_IN_FLIGHT && !peer.in_flight.contains(&id) {
                        state.metrics.replica_message("peer_full");
                        continue;
                    }
                    let local: Vec<LocalBlockHash> =
                        local_hashes.into_iter().map(LocalBlockHash).collect();
                    let worker = WorkerWithDpRank::new(worker_id, dp_rank);
                    let key = peer_request_id(&batch.replica, &id);
                    if state.track_peer(&key, worker, isl_tokens, prefill_tokens, &local) {
                        peer.in_flight.insert(id);
                    } else {
                        state.metrics.replica_message("unknown_worker");
                    }
                }
                SyncMessage::PrefillDone { id } => {
                    state.peer_prefill_done(&peer_request_id(&batch.replica, &id));
                }
                SyncMessage::Freed { id } => {
                    if peer.in_flight.remove(&id) {
                        state.free_peer(&peer_request_id(&batch.replica, &id));
                    }
                }
                SyncMessage::Heartbeat => {}
            }
        }
    }

    /// Frees the entries of peers not heard from for [`PEER_TIMEOUT`].
    pub fn expire(&mut self, state: &RouterState, now: Instant) {
        self.0.retain(|name, peer| {
            if now.saturating_duration_since(peer.heard) < PEER_TIMEOUT {
                return true;
            }
            let n = peer.in_flight.len();
            for id in &peer.in_flight {
                state.free_peer(&peer_request_id(name, id));
            }
            state.metrics.replica_expired.inc_by(n as u64);
            tracing::warn!(peer = %name, freed = n, "a replica went silent: its in-flight requests expire");
            false
        });
    }
}

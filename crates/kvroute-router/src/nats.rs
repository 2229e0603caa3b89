//! Router replicas over NATS (docs/replicas.md). Every replica routes alone from its own index;
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
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::{Client, ConnectOptions};
use futures_util::StreamExt;
use kvroute_core::{LocalBlockHash, WorkerWithDpRank};
use kvroute_wire::replica::{SyncBatch, SyncMessage, decode_sync, encode_sync};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::plane::EventPlane;
use crate::state::{PeerRouted, RouterState};
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

pub use crate::config::replicas::{
    DEFAULT_PREFIX, DEFAULT_SNAPSHOT_EVERY, DEFAULT_STREAM_MAX_AGE, DEFAULT_STREAM_MAX_BYTES,
    EventsVia, NatsAuth, NatsConfig,
};

/// The connection's options: name, reconnection, credentials, TLS.
pub(crate) fn connect_options(config: &NatsConfig, status: Arc<NatsStatus>) -> ConnectOptions {
    let mut o = ConnectOptions::new()
        .name(format!("kvroute {}", config.replica))
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
    if let Some(token) = &config.auth.token {
        o = o.token(token.clone());
    }
    if let (Some(user), Some(password)) = (&config.auth.user, &config.auth.password) {
        o = o.user_and_password(user.clone(), password.clone());
    }
    if let Some(ca) = &config.tls_ca {
        o = o.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
        o = o.add_client_certificate(cert.clone(), key.clone());
    }
    if config.url.starts_with("tls://") {
        o = o.require_tls(true);
    }
    o
}

pub use crate::links::{NatsLinks, NatsStatus};

/// Connects (in the background: an unreachable server at start is retried, never fatal) and
/// starts what `config` asks for. The links are set on `state` before this returns. A relay
/// runs its workers' subscriptions on the event `plane`.
pub(crate) fn spawn(
    state: &Arc<RouterState>,
    config: NatsConfig,
    plane: Option<EventPlane>,
) -> Vec<JoinHandle<()>> {
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
    let links = NatsLinks::new(config.clone(), Arc::clone(&status), outbox_tx, relay_tx);
    if state.nats.set(links).is_err() {
        tracing::warn!("NATS links set twice; keeping the first");
    }
    let state = Arc::clone(state);
    vec![tokio::spawn(async move {
        let client = match connect_options(&config, Arc::clone(&status))
            .connect(config.url.as_str())
            .await
        {
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
                plane,
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
        // Queue reports go alone: a replica older than them refuses their batch whole.
        let (queues, decisions): (Vec<_>, Vec<_>) =
            buf.drain(..).partition(|m| matches!(m, SyncMessage::Queues { .. }));
        for messages in [decisions, queues].into_iter().filter(|m| !m.is_empty()) {
            let batch = SyncBatch { replica: config.replica.clone(), messages };
            if let Err(err) = client.publish(subject.clone(), encode_sync(&batch).into()).await {
                tracing::debug!(%err, "NATS: decisions not sent");
            }
        }
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
                        Ok(batch) => peers.apply_sync(&state, batch),
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
    /// Applies a peer's batch (decoded from the wire) to `state`'s in-flight accounting (a
    /// decision made in a trace is recorded there as heard, when spans are exported).
    pub fn apply_sync(&mut self, state: &RouterState, batch: SyncBatch) {
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
                    output_tokens,
                    traceparent,
                } => {
                    heard_in(traceparent.as_deref(), &batch.replica, &id, (worker_id, dp_rank));
                    if peer.in_flight.len() >= MAX_PEER_IN_FLIGHT && !peer.in_flight.contains(&id) {
                        state.metrics.replica_message("peer_full");
                        continue;
                    }
                    let local: Vec<LocalBlockHash> =
                        local_hashes.into_iter().map(LocalBlockHash).collect();
                    let worker = WorkerWithDpRank::new(worker_id, dp_rank);
                    let key = peer_request_id(&batch.replica, &id);
                    let routed = PeerRouted {
                        worker,
                        isl_tokens,
                        prefill_tokens,
                        local: &local,
                        block_size: state.config.block_size.tokens(),
                        output_tokens,
                    };
                    let scheduling = &state.scheduling;
                    if scheduling.track_peer(&state.index, &state.metrics, &key, routed) {
                        peer.in_flight.insert(id);
                    } else {
                        state.metrics.replica_message("unknown_worker");
                    }
                }
                SyncMessage::PrefillDone { id } => {
                    state.scheduling.peer_prefill_done(&peer_request_id(&batch.replica, &id));
                }
                SyncMessage::Freed { id } => {
                    if peer.in_flight.remove(&id) {
                        state.scheduling.free_peer(&peer_request_id(&batch.replica, &id));
                    }
                }
                SyncMessage::Heartbeat => {}
                SyncMessage::Queues { bands } => state.flow.peer_report(&batch.replica, bands),
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
                state.scheduling.free_peer(&peer_request_id(name, id));
            }
            state.metrics.replica_expired.inc_by(n as u64);
            tracing::warn!(peer = %name, freed = n, "a replica went silent: its in-flight requests expire");
            false
        });
    }
}

/// A peer's decision heard in its trace: a span of this replica's under the decision's
/// (`traceparent`, untrusted bytes: one that does not parse is ignored).
fn heard_in(traceparent: Option<&str>, replica: &str, id: &str, (worker, rank): (u64, u32)) {
    let Some(traceparent) = traceparent.filter(|_| kvroute_http::otel::on()) else { return };
    let Some(trace) = kvroute_http::trace::TraceContext::from_traceparent(traceparent) else {
        return;
    };
    if !kvroute_http::otel::sample(Some(&trace)) {
        return;
    }
    // A root of this replica's own, under the peer's span (`span!` makes spans only inside
    // an enabled one).
    let span = tracing::info_span!(
        target: kvroute_http::otel::TARGET,
        "kvroute.replica.routed",
        kvroute.replica = replica,
        kvroute.request_id = id,
        kvroute.worker = format!("{worker}/{rank}"),
    );
    kvroute_http::otel::continue_trace(&span, Some(&trace));
}

//! What the router's core holds of replication: the running NATS links (set once NATS
//! starts) and the batches bound for the event stream. Plain data, so the core depends on
//! nothing of NATS's tasks ([`crate::nats`], [`crate::stream`]), which depend on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_nats::Event;
use kvroute_core::{RouterEvent, WorkerWithDpRank};
use kvroute_wire::replica::SyncMessage;
use tokio::sync::mpsc;

use crate::config::replicas::NatsConfig;
use crate::metrics::Metrics;

/// One engine batch on its way into the stream.
#[derive(Debug)]
pub(crate) struct Relayed {
    pub worker: WorkerWithDpRank,
    /// The engine's sequence number (vLLM / SGLang); `None` for formats without one.
    pub seq: Option<u64>,
    pub events: Vec<RouterEvent>,
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
    pub(crate) fn on_event(&self, event: &Event) {
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

/// The running replica's links into NATS, kept by [`crate::RouterState`].
#[derive(Debug)]
pub struct NatsLinks {
    pub config: NatsConfig,
    pub status: Arc<NatsStatus>,
    outbox: Option<mpsc::Sender<SyncMessage>>,
    pub(crate) relay: Option<mpsc::Sender<Relayed>>,
}

impl NatsLinks {
    pub(crate) fn new(
        config: NatsConfig,
        status: Arc<NatsStatus>,
        outbox: Option<mpsc::Sender<SyncMessage>>,
        relay: Option<mpsc::Sender<Relayed>>,
    ) -> Self {
        Self { config, status, outbox, relay }
    }

    /// Queues one of this replica's decisions for its peers; dropped (counted) when the outbox
    /// is full or NATS is away (the peers expire what they miss).
    pub(crate) fn send(&self, metrics: &Metrics, message: SyncMessage) {
        let Some(outbox) = &self.outbox else { return };
        if !self.status.connected() || outbox.try_send(message).is_err() {
            metrics.replica_message("unsent");
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

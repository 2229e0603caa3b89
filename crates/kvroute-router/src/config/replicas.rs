//! How a replica uses NATS: the settings (the running links are [`crate::nats`]'s).

use std::path::PathBuf;
use std::time::Duration;

use kvroute_core::WorkerWithDpRank;
use serde::Serialize;

/// What a NATS setting cannot be.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NatsConfigError {
    #[error("unknown events source {0:?} (zmq, stream or relay)")]
    EventsVia(String),
    #[error("nats prefix {0:?}: letters, digits, '_' and '-' only (it names subjects and buckets)")]
    Prefix(String),
    #[error("replica name must be 1 to 256 bytes")]
    ReplicaName,
    #[error("--nats-tls-cert and --nats-tls-key go together")]
    TlsPair,
    #[error("a NATS user needs its password (and a password its user)")]
    UserPassword,
}

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
    type Err = NatsConfigError;
    fn from_str(s: &str) -> Result<Self, NatsConfigError> {
        match s {
            "zmq" => Ok(Self::Zmq),
            "stream" => Ok(Self::Stream),
            "relay" => Ok(Self::Relay),
            other => Err(NatsConfigError::EventsVia(other.to_owned())),
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
    pub fn validate(&self) -> Result<(), NatsConfigError> {
        let ok = |s: &str| {
            !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if !ok(&self.prefix) {
            return Err(NatsConfigError::Prefix(self.prefix.clone()));
        }
        if self.replica.is_empty() || self.replica.len() > kvroute_wire::replica::MAX_SYNC_ID_BYTES
        {
            return Err(NatsConfigError::ReplicaName);
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(NatsConfigError::TlsPair);
        }
        if self.auth.user.is_some() != self.auth.password.is_some() {
            return Err(NatsConfigError::UserPassword);
        }
        Ok(())
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

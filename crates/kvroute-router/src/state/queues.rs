//! Flow control's state at the router ([`Flow`]): the queues of requests waiting for a worker
//! (`kvroute_core::schedule::flow`), and what the replicas last said of theirs. Admitting and
//! releasing, which place requests, are verbs of the router (`decide.rs`; docs/routing.md,
//! "Overload").
//!
//! Lock order: the queues' lock comes before the scheduler's (a request leaving the queue is
//! placed under it, so two releases never place against the same free capacity), and is never
//! taken under any other of the router's locks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_core::schedule::flow::{FlowConfig, FlowQueues, Gate, Outlook};
use tokio::sync::oneshot;

use super::lock::lock;
use super::request::{Decision, PlaceRequest};
use crate::metrics::Metrics;

/// Peers' queue reports older than this are not counted.
pub(super) const PEER_REPORT_TTL: Duration = Duration::from_secs(1);

/// What a waiting client hears: where its request goes (`None`: no worker at all), or why
/// it was turned away.
pub(super) type Outcome = Result<Option<Decision>, Refusal>;

/// A request flow control turned away, with when to try again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 429 (sheddable, or over a bound) or 503 (waited past its deadline).
    pub status: u16,
    pub retry_after_s: u64,
    pub message: String,
}

/// Each replica's last report of its waiting requests per priority, and when it came.
type PeerQueues = HashMap<String, (Instant, Vec<(i32, u32)>)>;

/// A waiting request: what to place, and where to send the outcome.
#[derive(Debug)]
pub(super) struct Waiter {
    pub(super) request: PlaceRequest,
    pub(super) tx: oneshot::Sender<Outcome>,
    /// Its admission's span: its decision, made when it is let go, is placed under it.
    pub(super) span: tracing::Span,
}

/// The queues, and what the replicas last said of theirs.
#[derive(Debug)]
pub struct Flow {
    queues: Mutex<FlowQueues<Waiter>>,
    next: AtomicU64,
    /// Each replica's waiting requests per priority, with when it said so.
    peers: Mutex<PeerQueues>,
}

impl Flow {
    pub(super) fn new(config: FlowConfig) -> Self {
        Self {
            queues: Mutex::new(FlowQueues::new(config)),
            next: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn queues(&self) -> MutexGuard<'_, FlowQueues<Waiter>> {
        lock(&self.queues)
    }

    /// A new waiting request's number.
    pub(super) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The queue gauges, per priority and tenant.
    pub(super) fn gauges(&self, metrics: &Metrics) {
        metrics.flow_metrics.waiting(&self.tenants());
    }

    /// Requests waiting here, and their bytes.
    pub fn waiting(&self) -> (usize, usize) {
        let q = lock(&self.queues);
        (q.len(), q.bytes())
    }

    /// Requests waiting here per priority, highest first (what replicas are told).
    pub fn bands(&self) -> Vec<(i32, usize)> {
        lock(&self.queues).bands()
    }

    /// Whether `tenant` sent more than its share of the prompt tokens lately
    /// ([`FlowConfig::over_share`]).
    pub fn over_share(&self, tenant: &str) -> bool {
        lock(&self.queues).over_share(tenant, Instant::now())
    }

    /// Requests waiting here per priority and tenant.
    pub fn tenants(&self) -> Vec<(i32, std::sync::Arc<str>, usize)> {
        lock(&self.queues).tenants()
    }

    /// A replica's report of its waiting requests per priority.
    pub(crate) fn peer_report(&self, replica: &str, bands: Vec<(i32, u32)>) {
        lock(&self.peers).insert(replica.to_owned(), (Instant::now(), bands));
    }

    /// Requests the replicas (by their reports of the last second) have waiting above
    /// `priority`.
    pub fn peers_waiting_above(&self, priority: i32, now: Instant) -> usize {
        let mut peers = lock(&self.peers);
        peers.retain(|_, (at, _)| now.saturating_duration_since(*at) < PEER_REPORT_TTL);
        peers
            .values()
            .flat_map(|(_, bands)| bands.iter())
            .filter(|(p, _)| *p > priority)
            .map(|(_, n)| *n as usize)
            .sum()
    }
}

impl Refusal {
    /// The OpenAI-shaped answer: 429 or 503, with `Retry-After`.
    pub fn into_api_error(self) -> kvroute_http::ApiError {
        let status = axum::http::StatusCode::from_u16(self.status)
            .unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
        kvroute_http::ApiError::new(status, self.message).retry_after(self.retry_after_s)
    }
}

pub(super) fn refusal(status: u16, retry_after_s: u64, message: impl Into<String>) -> Refusal {
    Refusal { status, retry_after_s: retry_after_s.max(1), message: message.into() }
}

/// Seconds until the fleet may take a request it cannot now, by the best it offers: the
/// predicted wait past the limit, at least 1.
pub(super) fn retry_after(outlook: Option<Outlook>, gate: &Gate) -> u64 {
    let over = outlook.map_or(0.0, |o| (o.wait_ms - gate.max_wait_ms).max(0.0));
    (over / 1e3).ceil().clamp(1.0, 60.0) as u64
}

/// What this replica last told its peers of its queues, and when.
#[derive(Debug)]
pub(crate) struct Reported {
    pub(super) bands: Vec<(i32, u32)>,
    pub(super) at: Instant,
}

impl Default for Reported {
    fn default() -> Self {
        Self { bands: Vec::new(), at: Instant::now() }
    }
}

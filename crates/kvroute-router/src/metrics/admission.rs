//! Flow control's metrics: requests by outcome, waiting requests and their wait, per priority
//! and tenant. Tenants are a client's words (a header, an API key's name), so past
//! [`MAX_TENANT_LABELS`] distinct ones the rest count as `other`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::schedule::flow::RequestClass;
use kvroute_http::metrics::{Counter, EncodeLabelSet, Family, Gauge, Histogram, Registry};

pub const FLOW_REQUESTS: &str = "kvroute_router_flow_requests";
pub const FLOW_WAITING: &str = "kvroute_router_flow_waiting_requests";
pub const FLOW_WAIT_SECONDS: &str = "kvroute_router_flow_wait_seconds";

/// Distinct tenants named in labels; the others are `other`.
pub(super) const MAX_TENANT_LABELS: usize = 32;

const WAIT_BUCKETS: [f64; 12] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// What flow control did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlowOutcome {
    /// Placed at once.
    Admitted,
    /// Put in the queue.
    Queued,
    /// Left the queue for a worker.
    Released,
    /// Refused at once (429): sheddable, and no worker could take it.
    Shed,
    /// Refused (429): the queue, or its tenant's share of it, was full.
    Full,
    /// Refused (503, 429 if sheddable): still waiting at its deadline.
    Expired,
    /// Its client went away while it waited.
    Abandoned,
}

impl FlowOutcome {
    pub fn label(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Queued => "queued",
            Self::Released => "released",
            Self::Shed => "shed",
            Self::Full => "full",
            Self::Expired => "expired",
            Self::Abandoned => "abandoned",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct ClassLabels {
    priority: i32,
    tenant: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct OutcomeClassLabels {
    priority: i32,
    tenant: String,
    outcome: &'static str,
}

#[derive(Debug)]
pub struct FlowMetrics {
    requests: Family<OutcomeClassLabels, Counter>,
    waiting: Family<ClassLabels, Gauge>,
    wait: Family<ClassLabels, Histogram>,
    named: Mutex<BTreeSet<Arc<str>>>,
}

impl Default for FlowMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl FlowMetrics {
    pub fn new() -> Self {
        Self {
            requests: Family::default(),
            waiting: Family::default(),
            wait: Family::new_with_constructor(|| Histogram::new(WAIT_BUCKETS)),
            named: Mutex::default(),
        }
    }

    pub fn register(&self, r: &mut Registry) {
        r.register(
            FLOW_REQUESTS,
            "Requests by what flow control did with them (admitted at once, queued, released from the queue, shed, refused for a full queue, expired, abandoned), per priority and tenant",
            self.requests.clone(),
        );
        r.register(
            FLOW_WAITING,
            "Requests waiting in the router's queues, per priority and tenant",
            self.waiting.clone(),
        );
        r.register(
            FLOW_WAIT_SECONDS,
            "Time requests waited in the router's queues (released, expired or abandoned), per priority and tenant",
            self.wait.clone(),
        );
    }

    /// The tenant as a label: itself while fewer than [`MAX_TENANT_LABELS`] are named.
    fn tenant(&self, tenant: &Arc<str>) -> String {
        let mut named = self.named.lock().unwrap_or_else(PoisonError::into_inner);
        if named.contains(tenant) {
            return tenant.to_string();
        }
        if named.len() < MAX_TENANT_LABELS {
            named.insert(tenant.clone());
            return tenant.to_string();
        }
        "other".to_owned()
    }

    pub fn record(&self, class: &RequestClass, outcome: FlowOutcome, waited: Option<Duration>) {
        let tenant = self.tenant(&class.tenant);
        let labels =
            OutcomeClassLabels { priority: class.priority, tenant, outcome: outcome.label() };
        self.requests.get_or_create(&labels).inc();
        if let Some(waited) = waited {
            let labels = ClassLabels { priority: class.priority, tenant: labels.tenant };
            self.wait.get_or_create(&labels).observe(waited.as_secs_f64());
        }
    }

    /// The waiting requests now, per priority and tenant (the others read 0).
    pub fn waiting(&self, now: &[(i32, Arc<str>, usize)]) {
        self.waiting.clear();
        for (priority, tenant, n) in now {
            let labels = ClassLabels { priority: *priority, tenant: self.tenant(tenant) };
            self.waiting.get_or_create(&labels).inc_by(*n as i64);
        }
    }
}

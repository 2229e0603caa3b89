//! The front door's own counters and gauges.

use kvroute_http::metrics::{Counter, EncodeLabelSet, Family, Gauge, Registry};

use crate::names::*;

#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) registry: Registry,
    pub(crate) proxied: Counter,
    pub(crate) retried: Counter,
    pub(crate) in_flight: Gauge,
    pub(crate) ejections: Counter,
    pub(crate) ejected: Gauge,
    pub(crate) broken: Counter,
    pub(crate) as_tokens: Counter,
    pub(crate) fallbacks: Counter,
    pub(crate) pd_split: Counter,
    pub(crate) pd_in_place: Counter,
    pub(crate) pd_prefill_failed: Counter,
    pub(crate) pd_handoff_failed: Counter,
    pub(crate) priority_clamped: Counter,
    pub(crate) lowered_priority: Counter,
    migrations: Family<Reason, Counter>,
}

/// Why a stream moved to another worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let m = Self::default();
        let mut r = Registry::default();
        r.register(PROXIED, "Requests proxied to a worker", m.proxied.clone());
        r.register(
            RETRIES,
            "Workers skipped because they refused the connection or did not answer in time",
            m.retried.clone(),
        );
        r.register(IN_FLIGHT, "Requests between routing and their end", m.in_flight.clone());
        r.register(EJECTIONS, "Workers taken out of rotation after a failure", m.ejections.clone());
        r.register(EJECTED, "Workers out of rotation now", m.ejected.clone());
        r.register(BROKEN_STREAMS, "Answers a worker broke off mid-way", m.broken.clone());
        r.register(
            AS_TOKENS,
            "Requests sent as the front door's token ids (a worker's tokens dialect)",
            m.as_tokens.clone(),
        );
        r.register(
            DIALECT_FALLBACKS,
            "Requests sent as chat to a tokens-dialect worker: they asked for what its API does not carry",
            m.fallbacks.clone(),
        );
        r.register(
            "kvroute_frontend_pd_split_requests",
            "Requests prefilled on a prefill worker and decoded on another",
            m.pd_split.clone(),
        );
        r.register(
            "kvroute_frontend_pd_in_place_requests",
            "Requests of a disaggregated fleet prefilled where they decode (cheaper than any pair)",
            m.pd_in_place.clone(),
        );
        r.register(
            "kvroute_frontend_pd_prefill_failures",
            "Prefill legs whose worker did not answer (the request placed again)",
            m.pd_prefill_failed.clone(),
        );
        r.register(
            "kvroute_frontend_pd_handoff_failures",
            "Split requests whose decode worker could not take the prefill's KV (placed again \
             without that prefill worker)",
            m.pd_handoff_failed.clone(),
        );
        r.register(
            "kvroute_frontend_priority_clamped",
            "Requests that named a priority above their API key's ceiling (lowered to it)",
            m.priority_clamped.clone(),
        );
        r.register(
            "kvroute_frontend_engine_priority_lowered",
            "Requests of a tenant over its share sent with a lower engine priority than their class's",
            m.lowered_priority.clone(),
        );
        r.register(
            "kvroute_frontend_migrations",
            "Streams a worker broke off after their first bytes that went on on another worker, by \
             reason (broken: the connection or the stream broke)",
            m.migrations.clone(),
        );
        // Shown at 0 before the first move (a status page and alerts read it).
        drop(m.migrations.get_or_create(&Reason { reason: "broken" }));
        Self { registry: r, ..m }
    }

    /// A stream moved to another worker (`reason`: `broken`).
    pub(crate) fn migrated(&self, reason: &'static str) {
        self.migrations.get_or_create(&Reason { reason }).inc();
    }
}

//! Prometheus metrics through `prometheus-client`: each service registers its metrics (names as
//! constants beside them) in a [`Registry`] once, keeps the handles, and answers `GET /metrics`
//! with [`response`], which encodes one or more registries as one OpenMetrics exposition (a
//! front door with an embedded router shows both).
//!
//! Counters are named without `_total`; the encoder appends it.

use axum::http::header;
use axum::response::{IntoResponse, Response};
pub use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::metrics::family::Family;
pub use prometheus_client::metrics::gauge::Gauge;
pub use prometheus_client::metrics::histogram::Histogram;
pub use prometheus_client::registry::Registry;

use crate::ApiError;

/// A gauge of floating-point values.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// A counter that mirrors a total counted elsewhere (an engine's or an index's own count):
/// [`CounterOf::sync`] adds what the total grew by since the last call.
#[derive(Clone, Debug, Default)]
pub struct CounterOf {
    pub counter: Counter,
    seen: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl CounterOf {
    pub fn sync(&self, total: u64) {
        let seen = self.seen.swap(total, std::sync::atomic::Ordering::Relaxed);
        if total > seen {
            self.counter.inc_by(total - seen);
        }
    }
}

/// The exposition's content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One exposition of every metric of `registries`.
pub fn encode(registries: &[&Registry]) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    for registry in registries {
        prometheus_client::encoding::text::encode_registry(&mut out, registry)?;
    }
    prometheus_client::encoding::text::encode_eof(&mut out)?;
    Ok(out)
}

/// `GET /metrics`.
pub fn response(registries: &[&Registry]) -> Response {
    match encode(registries) {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => ApiError::internal(e).into_response(),
    }
}

/// The value of the sample `name` (with its labels as written, e.g. `a_total{k="v"}`) in an
/// exposition, for tests and probes.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        rest.strip_prefix(' ')?.split_whitespace().next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Kind {
        kind: &'static str,
    }

    #[test]
    fn registries_encode_as_one_exposition() {
        let mut a = Registry::default();
        let events = Family::<Kind, Counter>::default();
        a.register("kvroute_test_events", "Events seen", events.clone());
        let mut b = Registry::default();
        let usage = FloatGauge::default();
        b.register("vllm:kv_cache_usage_perc", "KV usage", usage.clone());
        events.get_or_create(&Kind { kind: "stored" }).inc_by(3);
        usage.set(0.25);
        let text = encode(&[&a, &b]).unwrap();
        assert_eq!(
            sample(&text, "kvroute_test_events_total{kind=\"stored\"}"),
            Some(3.0),
            "{text}"
        );
        assert_eq!(sample(&text, "vllm:kv_cache_usage_perc"), Some(0.25), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1);
    }

    #[test]
    fn mirrored_counters_follow_their_total() {
        let c = CounterOf::default();
        c.sync(5);
        c.sync(5);
        c.sync(7);
        assert_eq!(c.counter.get(), 7);
    }
}

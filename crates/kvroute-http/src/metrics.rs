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

/// Quantiles of the histogram `name` summed over its label sets, read from an exposition:
/// its observations' count and each of `quantiles` (0..1), interpolated linearly inside the
/// bucket it falls in (the last finite bound for the `+Inf` bucket). `None` when it has no
/// observations.
pub fn histogram_quantiles(text: &str, name: &str, quantiles: &[f64]) -> Option<(u64, Vec<f64>)> {
    let prefix = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(&prefix) else { continue };
        let Some(le) = rest.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else {
            continue;
        };
        let bound = match le {
            "+Inf" => f64::INFINITY,
            b => match b.parse() {
                Ok(b) => b,
                Err(_) => continue,
            },
        };
        let Some(count) = line.rsplit(' ').next().and_then(|c| c.parse::<f64>().ok()) else {
            continue;
        };
        match buckets.iter_mut().find(|(b, _)| *b == bound) {
            Some((_, c)) => *c += count,
            None => buckets.push((bound, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let at = |q: f64| {
        let want = q * total;
        let (mut lo, mut below) = (0.0, 0.0);
        for &(bound, cumulative) in &buckets {
            if cumulative >= want {
                if bound.is_infinite() {
                    return lo;
                }
                let inside = cumulative - below;
                let frac = if inside > 0.0 { (want - below) / inside } else { 1.0 };
                return lo + (bound - lo) * frac;
            }
            (lo, below) = (bound, cumulative);
        }
        lo
    };
    Some((total as u64, quantiles.iter().map(|&q| at(q)).collect()))
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

    /// Quantiles of a labelled histogram, summed over its labels, as a scrape reads them
    /// (against the sorted observations: each lands within its bucket).
    #[test]
    fn histogram_quantiles_sum_the_labels_and_interpolate() {
        let mut r = Registry::default();
        let h = Family::<Kind, Histogram>::new_with_constructor(|| {
            Histogram::new([0.1, 0.2, 0.5, 1.0])
        });
        r.register("kvroute_test_error", "Errors", h.clone());
        let values = [0.05, 0.15, 0.15, 0.3, 0.3, 0.3, 0.4, 0.7, 0.9, 3.0];
        for (i, v) in values.iter().enumerate() {
            let kind = if i % 2 == 0 { "a" } else { "b" };
            h.get_or_create(&Kind { kind }).observe(*v);
        }
        let text = encode(&[&r]).unwrap();
        let (n, q) = histogram_quantiles(&text, "kvroute_test_error", &[0.5, 0.9, 1.0]).unwrap();
        assert_eq!(n, 10);
        // The 5th of 10 is in (0.2, 0.5], the 3rd of that bucket's 4: 0.2 + 0.3 * 2/4.
        assert!((q[0] - 0.35).abs() < 1e-9, "{q:?}");
        // The 9th is in (0.5, 1.0], the 2nd of its 2.
        assert!((q[1] - 1.0).abs() < 1e-9, "{q:?}");
        // Past the last finite bound: that bound.
        assert!((q[2] - 1.0).abs() < 1e-9, "{q:?}");
        assert_eq!(histogram_quantiles(&text, "kvroute_nothing", &[0.5]), None);
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

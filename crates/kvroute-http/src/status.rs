//! The live status page (`GET /ui`) and the history its chart draws (`GET /ui/history`).
//!
//! The page is one HTML file (script and style inline, no asset fetched from anywhere) that
//! reads `/workers`, `/metrics` and `/ui/history` with the admin token it is given as
//! `?token=`; served to anyone, it shows nothing of the fleet without the token. The history
//! is the server's own: a task samples the counters the chart shows every `--status-sample-ms`
//! (1 s) and keeps the last [`HISTORY_POINTS`], so a page opened now draws the last 5 minutes,
//! not only what it saw itself.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

/// The page.
pub const STATUS_PAGE: &str = include_str!("ui.html");

/// `GET /ui`.
pub async fn status_page() -> axum::response::Html<&'static str> {
    axum::response::Html(STATUS_PAGE)
}

/// Samples kept: 5 minutes at one a second.
pub const HISTORY_POINTS: usize = 300;
/// The default sampling period.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// The counters a point is computed from, summed over their labels, as `/metrics` shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    pub decisions: f64,
    pub prompt_tokens: f64,
    pub cached_tokens: f64,
    pub answered: f64,
    pub exact: f64,
    pub error_sum: f64,
    pub error_count: f64,
}

impl Counters {
    /// Read from the registries' exposition (a server without a router's registry reads 0s).
    pub fn read(registries: &[&Registry]) -> Self {
        let text = crate::metrics::encode(registries).unwrap_or_default();
        Self::parse(&text)
    }

    /// Read from an exposition's text.
    pub fn parse(text: &str) -> Self {
        let mut c = Self::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            let (metric, labels) = name.split_once('{').unwrap_or((name, ""));
            let slot = match metric {
                "kvroute_router_decisions_total" => &mut c.decisions,
                "kvroute_router_answered_prompt_tokens_total" => &mut c.prompt_tokens,
                "kvroute_router_answered_cached_tokens_total" => &mut c.cached_tokens,
                "kvroute_router_prediction_error_tokens_sum" => &mut c.error_sum,
                "kvroute_router_prediction_error_tokens_count" => &mut c.error_count,
                "kvroute_router_predictions_total" => {
                    if labels.contains("outcome=\"exact\"") {
                        c.exact += value;
                    }
                    &mut c.answered
                }
                _ => continue,
            };
            *slot += value;
        }
        c
    }
}

/// One point of the chart: the interval that ended at `t`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Milliseconds since the Unix epoch.
    pub t: u64,
    /// Routing decisions per second.
    pub rate: f64,
    /// Cached / prompt tokens of the interval's answers, % (none: no answer).
    pub hit: Option<f64>,
    /// Exact predictions among the interval's answers, %.
    pub exact: Option<f64>,
    /// Mean prediction error of the interval's answers, tokens.
    pub error: Option<f64>,
}

/// The last [`HISTORY_POINTS`] points, and the counters of the last sample.
#[derive(Debug, Default)]
pub struct History {
    inner: Mutex<Samples>,
}

#[derive(Debug, Default)]
struct Samples {
    points: VecDeque<Point>,
    /// When the last sample was taken (ms since the epoch), and its counters.
    last: Option<(u64, Counters)>,
}

fn share(part: f64, whole: f64) -> Option<f64> {
    (whole > 0.0).then(|| 100.0 * part / whole)
}

impl History {
    /// Adds the point of the interval since the last sample (the first sample only starts one).
    pub fn record(&self, t: u64, now: Counters) {
        let mut guard = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Samples { points, last } = &mut *guard;
        if let Some((t0, before)) = last.replace((t, now)) {
            let secs = t.saturating_sub(t0) as f64 / 1000.0;
            let d = |f: fn(&Counters) -> f64| (f(&now) - f(&before)).max(0.0);
            let errors = d(|c| c.error_count);
            points.push_back(Point {
                t,
                rate: if secs > 0.0 { d(|c| c.decisions) / secs } else { 0.0 },
                hit: share(d(|c| c.cached_tokens), d(|c| c.prompt_tokens)),
                exact: share(d(|c| c.exact), d(|c| c.answered)),
                error: (errors > 0.0).then(|| d(|c| c.error_sum) / errors),
            });
            if points.len() > HISTORY_POINTS {
                points.pop_front();
            }
        }
    }

    /// The points after `after` (ms since the epoch), oldest first.
    pub fn since(&self, after: u64) -> Vec<Point> {
        let guard = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.points.iter().filter(|p| p.t > after).copied().collect()
    }

    /// Samples `read` every `every` until it returns `None` (its owner is gone) or the task is
    /// aborted.
    pub fn spawn(
        self: &Arc<Self>,
        every: Duration,
        read: impl Fn() -> Option<Counters> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let history = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let (Some(history), Some(counters)) = (history.upgrade(), read()) else { return };
                history.record(now_ms(), counters);
            }
        })
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `GET /ui/history?after=MS`'s query.
#[derive(Debug, Default, Deserialize)]
pub struct After {
    #[serde(default)]
    pub after: u64,
}

/// `GET /ui/history`: `{"points": [...], "every_ms": N}`, the points after `?after=`.
pub fn history_response(history: &History, every: Duration, after: u64) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "points": history.since(after),
        "every_ms": every.as_millis() as u64,
        "capacity": HISTORY_POINTS,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\n\
        kvroute_router_decisions_total 10\n\
        kvroute_router_answered_prompt_tokens_total{worker=\"1\"} 300\n\
        kvroute_router_answered_prompt_tokens_total{worker=\"2\"} 100\n\
        kvroute_router_answered_cached_tokens_total{worker=\"1\"} 200\n\
        kvroute_router_predictions_total{worker=\"1\",outcome=\"exact\"} 3\n\
        kvroute_router_predictions_total{worker=\"1\",outcome=\"over\"} 1\n\
        kvroute_router_prediction_error_tokens_sum 8\n\
        kvroute_router_prediction_error_tokens_count 4\n\
        kvroute_router_decisions_totally_else 99\n";

    #[test]
    fn counters_sum_over_labels() {
        let c = Counters::parse(TEXT);
        assert_eq!(c.decisions, 10.0);
        assert_eq!((c.prompt_tokens, c.cached_tokens), (400.0, 200.0));
        assert_eq!((c.answered, c.exact), (4.0, 3.0));
        assert_eq!((c.error_sum, c.error_count), (8.0, 4.0));
    }

    #[test]
    fn a_point_is_its_interval_and_the_history_keeps_the_last_300() {
        let h = History::default();
        let c = Counters::parse(TEXT);
        h.record(1_000, c);
        assert!(h.since(0).is_empty(), "the first sample starts the first interval");
        let later = Counters { decisions: 30.0, prompt_tokens: 500.0, cached_tokens: 300.0, ..c };
        h.record(3_000, later);
        let p = h.since(0);
        assert_eq!(p, [Point { t: 3_000, rate: 10.0, hit: Some(100.0), exact: None, error: None }]);
        for t in 0..400u64 {
            h.record(4_000 + t * 1_000, later);
        }
        let all = h.since(0);
        assert_eq!(all.len(), HISTORY_POINTS);
        assert_eq!(all.last().unwrap().t, 403_000);
        assert_eq!(h.since(402_000).len(), 1, "after= returns only newer points");
        assert_eq!(all.last().unwrap().rate, 0.0);
    }

    #[tokio::test]
    async fn the_sampler_stops_with_its_owner() {
        let h = Arc::new(History::default());
        let owner = Arc::new(());
        let weak = Arc::downgrade(&owner);
        let task =
            h.spawn(Duration::from_millis(1), move || weak.upgrade().map(|_| Counters::default()));
        while h.since(0).len() < 3 {
            tokio::task::yield_now().await;
        }
        drop(owner);
        task.await.unwrap();
    }
}

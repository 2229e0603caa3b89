//! The router's Prometheus metrics: names as constants, counters as atomics, rendered as text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_core::index::IndexStats;

pub const EVENTS: &str = "kvroute_router_events_total";
pub const GAPS: &str = "kvroute_router_event_gaps_total";
pub const REPLAYS: &str = "kvroute_router_replays_total";
pub const REPLAYED_BATCHES: &str = "kvroute_router_replayed_batches_total";
pub const GARBAGE: &str = "kvroute_router_undecodable_messages_total";
pub const REJECTED: &str = "kvroute_router_events_rejected_total";
pub const RESTARTS: &str = "kvroute_router_publisher_restarts_total";
pub const INDEX_BLOCKS: &str = "kvroute_router_index_blocks";
pub const INDEX_HELD_BLOCKS: &str = "kvroute_router_index_held_blocks";
pub const INDEX_EVICTED: &str = "kvroute_router_index_evicted_blocks_total";
pub const DECISIONS: &str = "kvroute_router_decisions_total";
pub const DECISION_SECONDS: &str = "kvroute_router_decision_seconds";
pub const WORKER_DECISIONS: &str = "kvroute_router_worker_decisions_total";

/// Event kinds and outcomes, the labels of [`EVENTS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Stored = 0,
    Removed = 1,
    Cleared = 2,
}

const KINDS: [&str; 3] = ["stored", "removed", "cleared"];

/// Upper bounds (seconds) of the decision-latency histogram.
const BUCKETS: [f64; 12] = [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2, 1e-1];

#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BUCKETS.iter().position(|&b| secs <= b).unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str) {
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound:e}\"}} {cumulative}");
        }
        cumulative += self.counts[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    /// [kind][ok = 0, error = 1]
    events: [[AtomicU64; 2]; 3],
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub garbage: AtomicU64,
    pub restarts: AtomicU64,
    /// Events refused for a data-parallel rank at or above `max_dp_size`.
    pub rejected_dp_rank: AtomicU64,
    pub decisions: AtomicU64,
    pub decision_latency: Histogram,
}

impl Metrics {
    pub fn event(&self, kind: EventKind, ok: bool) {
        self.events[kind as usize][usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn events(&self, kind: EventKind, ok: bool) -> u64 {
        self.events[kind as usize][usize::from(!ok)].load(Ordering::Relaxed)
    }

    /// Prometheus text exposition of everything, with the index's sizes and the decisions per
    /// worker passed in.
    pub fn render(&self, index: &IndexStats, per_worker: &[(u64, u32, u64)]) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# TYPE {EVENTS} counter");
        for (k, kind) in KINDS.iter().enumerate() {
            for (s, status) in ["ok", "error"].iter().enumerate() {
                let n = self.events[k][s].load(Ordering::Relaxed);
                let _ = writeln!(out, "{EVENTS}{{kind=\"{kind}\",status=\"{status}\"}} {n}");
            }
        }
        let _ = writeln!(
            out,
            "# TYPE {REJECTED} counter\n{REJECTED}{{reason=\"dp_rank\"}} {}",
            self.rejected_dp_rank.load(Ordering::Relaxed)
        );
        for (name, counter) in [
            (GAPS, &self.gaps),
            (REPLAYS, &self.replays),
            (REPLAYED_BATCHES, &self.replayed_batches),
            (GARBAGE, &self.garbage),
            (RESTARTS, &self.restarts),
            (DECISIONS, &self.decisions),
        ] {
            let _ =
                writeln!(out, "# TYPE {name} counter\n{name} {}", counter.load(Ordering::Relaxed));
        }
        let _ = writeln!(out, "# TYPE {INDEX_BLOCKS} gauge\n{INDEX_BLOCKS} {}", index.blocks);
        let _ = writeln!(
            out,
            "# TYPE {INDEX_HELD_BLOCKS} gauge\n{INDEX_HELD_BLOCKS} {}",
            index.held_blocks
        );
        let _ = writeln!(
            out,
            "# TYPE {INDEX_EVICTED} counter\n{INDEX_EVICTED} {}",
            index.evicted_blocks
        );
        let _ = writeln!(out, "# TYPE {WORKER_DECISIONS} counter");
        for (worker, rank, n) in per_worker {
            let _ = writeln!(
                out,
                "{WORKER_DECISIONS}{{worker_id=\"{worker}\",dp_rank=\"{rank}\"}} {n}"
            );
        }
        self.decision_latency.render(&mut out, DECISION_SECONDS);
        out
    }
}

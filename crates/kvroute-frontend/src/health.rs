//! Passive health of the workers, as the front door sees them when it proxies: a worker that
//! refuses or resets the connection, or does not answer in time, is **ejected** (not offered
//! to the router) for a backoff that doubles with each failure in a row (1 s up to 30 s).
//! When it runs out, the worker is **probed** (`GET /health`): an answer restores it, no
//! answer ejects it again for longer. A request that succeeds restores it at once. Every
//! worker is checked every second, ejected or not, so a dead engine (a refused connection) is
//! found before a client is sent to it, and its blocks forgotten even while it is out.
//!
//! ```text
//!  healthy ──failure──▶ ejected (1 s, 2 s, 4 s .. 30 s) ──backoff over──▶ probe ──ok──▶ healthy
//!     ▲                                                                   └──fail──▶ ejected
//!     └──────────────────────── a proxied request succeeds ◀───────────────────────────┘
//! ```
//!
//! If every worker is ejected, none is excluded: better a try than a certain 503.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvroute_core::WorkerId;
use serde::Serialize;

pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Why a worker failed a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// Refused or reset before anything was sent: the process is gone (its cache with it).
    Connect,
    /// No answer within the first-byte timeout.
    Timeout,
    /// The connection broke mid-answer.
    Broken,
    /// Its `/health` did not answer.
    Probe,
}

impl Failure {
    /// Its name, as a span's `error.type` says it.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Broken => "broken",
            Failure::Probe => "probe",
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkerHealth {
    /// Failures in a row.
    pub failures: u32,
    pub ejected: bool,
    /// Seconds until the next probe while ejected.
    pub probe_in_secs: Option<f64>,
    pub last_failure: Option<Failure>,
    #[serde(skip)]
    until: Option<Instant>,
}

/// The workers' health; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct Health {
    workers: Mutex<BTreeMap<WorkerId, WorkerHealth>>,
}

impl Health {
    pub fn new(workers: impl IntoIterator<Item = WorkerId>) -> Self {
        let map = workers.into_iter().map(|w| (w, WorkerHealth::default())).collect();
        Self { workers: Mutex::new(map) }
    }

    /// A worker joined: in rotation.
    pub fn add(&self, worker: WorkerId) {
        self.lock().entry(worker).or_default();
    }

    /// A worker left.
    pub fn remove(&self, worker: WorkerId) {
        self.lock().remove(&worker);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<WorkerId, WorkerHealth>> {
        self.workers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a failure: ejects the worker for a backoff that doubles each time in a row.
    /// Returns the backoff.
    pub fn failed(&self, worker: WorkerId, why: Failure, now: Instant) -> Duration {
        let mut workers = self.lock();
        let h = workers.entry(worker).or_default();
        h.last_failure = Some(why);
        // Failures within a backoff (the streams a crash broke all at once, checks of a
        // worker already out) are one failure, not a longer sentence each.
        if let Some(until) = h.until.filter(|&u| h.ejected && now < u) {
            return until - now;
        }
        h.failures = h.failures.saturating_add(1);
        let backoff = MIN_BACKOFF.saturating_mul(1u32 << (h.failures - 1).min(5)).min(MAX_BACKOFF);
        h.ejected = true;
        h.until = Some(now + backoff);
        backoff
    }

    /// A request or a probe succeeded: the worker is healthy again. Returns whether it was
    /// ejected.
    pub fn succeeded(&self, worker: WorkerId) -> bool {
        let mut workers = self.lock();
        let Some(h) = workers.get_mut(&worker) else { return false };
        let was = h.ejected;
        h.failures = 0;
        h.ejected = false;
        h.until = None;
        was
    }

    /// Ejected workers whose backoff is over: time to probe them.
    pub fn due_for_probe(&self, now: Instant) -> Vec<WorkerId> {
        let workers = self.lock();
        workers
            .iter()
            .filter(|(_, h)| h.ejected && h.until.is_some_and(|u| now >= u))
            .map(|(w, _)| *w)
            .collect()
    }

    pub fn is_ejected(&self, worker: WorkerId) -> bool {
        self.lock().get(&worker).is_some_and(|h| h.ejected)
    }

    /// Each worker's health, as `/workers` shows it.
    pub fn snapshot(&self, now: Instant) -> BTreeMap<WorkerId, WorkerHealth> {
        let mut out = self.lock().clone();
        for h in out.values_mut() {
            h.probe_in_secs = h.until.map(|u| u.saturating_duration_since(now).as_secs_f64());
        }
        out
    }

    /// Ejected workers now.
    pub fn ejected_count(&self) -> usize {
        self.lock().values().filter(|h| h.ejected).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap_and_success_restores() {
        let h = Health::new([WorkerId(1), WorkerId(2)]);
        let t = Instant::now();
        let mut now = t;
        let mut backoffs = Vec::new();
        for _ in 0..8 {
            let b = h.failed(WorkerId(1), Failure::Connect, now);
            assert_eq!(h.failed(WorkerId(1), Failure::Broken, now), b, "at once: one failure");
            backoffs.push(b.as_secs());
            now += b;
        }
        assert_eq!(backoffs, [1, 2, 4, 8, 16, 30, 30, 30]);
        let t = now - Duration::from_secs(30);
        assert!(h.due_for_probe(t).is_empty());
        assert_eq!(h.due_for_probe(t + Duration::from_secs(30)), [WorkerId(1)]);
        assert!(h.is_ejected(WorkerId(1)), "out until a probe succeeds, its backoff over");
        assert!(h.succeeded(WorkerId(1)));
        assert!(!h.is_ejected(WorkerId(1)));
        assert_eq!(h.failed(WorkerId(1), Failure::Timeout, t).as_secs(), 1, "starts over");
    }
}

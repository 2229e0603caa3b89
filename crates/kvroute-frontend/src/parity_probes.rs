//! The parity probes' bookkeeping ([`ParityProbes`]): which workers are still to be probed,
//! and when a probe that could not be made is tried again. The probes themselves are
//! [`crate::parity`]'s, made on the health tick ([`crate::probes`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvroute_core::WorkerId;

use crate::{HEALTH_INTERVAL, PROBE_BACKOFF_MAX};

/// The parity probes' bookkeeping, an owner of its own: the workers still to be probed (all
/// at start, a restarted one again), when a probe that could not be made is tried next, and a
/// wake-up for whoever waits on them. Its two locks are leaves, never held together.
#[derive(Debug)]
pub(crate) struct ParityProbes {
    left: Mutex<BTreeSet<WorkerId>>,
    /// Probes that could not be made: when each is tried next, and its backoff.
    retries: Mutex<BTreeMap<WorkerId, (Instant, Duration)>>,
    woken: tokio::sync::Notify,
}

impl ParityProbes {
    pub(crate) fn new(workers: impl IntoIterator<Item = WorkerId>) -> Self {
        Self {
            left: Mutex::new(workers.into_iter().collect()),
            retries: Mutex::default(),
            woken: tokio::sync::Notify::new(),
        }
    }

    /// The workers still to be probed.
    pub(crate) fn left(&self) -> Vec<WorkerId> {
        self.left.lock().map(|s| s.iter().copied().collect()).unwrap_or_default()
    }

    /// Resolves when a probe is next made (take it before looking at [`Self::left`]).
    pub(crate) fn made_next(&self) -> tokio::sync::futures::Notified<'_> {
        self.woken.notified()
    }

    /// `worker` is to be probed (again).
    pub(crate) fn again(&self, worker: WorkerId) {
        self.left.lock().map(|mut p| p.insert(worker)).ok();
    }

    /// `worker` left the fleet: nothing of it is kept.
    pub(crate) fn forget(&self, worker: WorkerId) {
        self.left.lock().map(|mut p| p.remove(&worker)).ok();
        self.retries.lock().map(|mut r| r.remove(&worker)).ok();
    }

    /// Whether `worker`'s probe may be tried at `now` (not backing off). Probes run on the
    /// health tick, and a backoff is counted from the end of the last round of probes: a
    /// deadline less than half a tick away counts as reached, or a 1 s backoff would wait for
    /// the tick after next (2 s; serve's readiness waited that long on a startup race).
    pub(crate) fn due(&self, worker: WorkerId, now: Instant) -> bool {
        let now = now + HEALTH_INTERVAL / 2;
        self.retries.lock().map_or(true, |r| r.get(&worker).is_none_or(|(at, _)| now >= *at))
    }

    /// `worker`'s probe was made: done, and whoever waits is woken.
    pub(crate) fn made(&self, worker: WorkerId) {
        self.forget(worker);
        self.woken.notify_waiters();
    }

    /// A probe could not be made: tried again after a backoff that doubles from 1 s to
    /// [`PROBE_BACKOFF_MAX`], logged when it first happens; the cause with its next try.
    pub(crate) fn later(&self, worker: WorkerId, why: &impl std::fmt::Display) -> Option<String> {
        let mut retries = self.retries.lock().ok()?;
        let backoff = match retries.get(&worker) {
            Some((_, b)) => (*b * 2).min(PROBE_BACKOFF_MAX),
            None => {
                tracing::info!(%worker, cause = %why, "parity probe not made yet; trying again with a backoff");
                Duration::from_secs(1)
            }
        };
        retries.insert(worker, (Instant::now() + backoff, backoff));
        tracing::debug!(%worker, cause = %why, backoff_secs = backoff.as_secs(), "parity probe deferred");
        Some(format!("{why}; next try in {} s", backoff.as_secs()))
    }
}

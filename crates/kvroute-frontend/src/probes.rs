//! The health tick: each worker's `/health` checked every [`HEALTH_INTERVAL`] (ejection and
//! return), and the parity probe of workers that joined, with its backoff.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::WorkerId;

use crate::health::Failure;
use crate::{FrontendState, HEALTH_INTERVAL, PROBE_TIMEOUT, parity};

/// How long a joining worker's parity probe waits for its event subscription.
const JOIN_PROBE_WAIT: Duration = Duration::from_secs(5);
const JOIN_PROBE_POLL: Duration = Duration::from_millis(50);

impl FrontendState {
    /// Waits until every reachable worker had its parity probe, or `timeout`; the workers
    /// left (an unreachable one is probed when it answers; the health checks report it).
    pub async fn parity_done(&self, timeout: Duration) -> Vec<WorkerId> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.parity.made_next();
            let mut left = self.parity_left();
            left.retain(|w| !self.health.is_ejected(*w));
            if left.is_empty() || tokio::time::Instant::now() >= deadline {
                return left;
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// The workers still to be parity-probed (none when the probes are off).
    pub(crate) fn parity_left(&self) -> Vec<WorkerId> {
        match self.options.parity_probe {
            true => self.parity.left(),
            false => Vec::new(),
        }
    }

    /// Checks every worker's `GET /health` each [`HEALTH_INTERVAL`] until the front door is
    /// dropped: a refused connection means its engine died (ejected, its blocks forgotten,
    /// before a client finds out); an ejected worker that answers once its backoff is over is
    /// back in rotation.
    pub fn spawn_probes(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEALTH_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for round in 0u64.. {
                tick.tick().await;
                let Some(state) = weak.upgrade() else { return };
                if round % crate::models::MODELS_EVERY == 0 {
                    let state = Arc::clone(&state);
                    tokio::spawn(async move { state.discover_models().await });
                }
                let workers = state.workers();
                let checks = workers.urls.iter().map(|(&worker, base)| {
                    let state = Arc::clone(&state);
                    let url = format!("{base}{}", kvroute_http::paths::HEALTH);
                    async move { (worker, state.probe(&url).await) }
                });
                let results = futures_util::future::join_all(checks).await;
                let due = state.health.due_for_probe(Instant::now());
                for (worker, result) in results {
                    match result {
                        Ok(()) if due.contains(&worker) => {
                            state.health.succeeded(worker);
                            tracing::info!(%worker, "worker answers again: back in rotation");
                        }
                        Ok(()) => {}
                        Err(why) => state.worker_failed(worker, why),
                    }
                }
                let now = Instant::now();
                let probes = state
                    .parity_left()
                    .into_iter()
                    .filter(|w| !state.health.is_ejected(*w) && state.parity.due(*w, now))
                    .map(|worker| {
                        let state = Arc::clone(&state);
                        async move { (worker, parity::probe(&state, worker).await) }
                    });
                for (worker, outcome) in futures_util::future::join_all(probes).await {
                    state.probe_made(worker, outcome);
                }
            }
        })
    }

    fn probe_made(
        &self,
        worker: WorkerId,
        outcome: Result<Option<kvroute_router::Parity>, parity::Retry>,
    ) {
        match outcome {
            Ok(Some(_)) => self.parity.made(worker),
            Ok(None) => {}
            Err(why) => {
                // A failed worker stays failed until a probe is made (the router keeps that
                // rule): the cause stands unless it failed one before.
                if let Some(cause) = self.parity.later(worker, &why) {
                    self.decider.set_parity(worker, kvroute_router::Parity::Retrying(cause));
                }
            }
        }
    }

    /// Probes a worker that just joined as soon as its events are connected (within
    /// [`JOIN_PROBE_WAIT`]; the health tick tries again after that).
    pub(crate) async fn probe_joined(self: &Arc<Self>, worker: WorkerId) {
        let deadline = tokio::time::Instant::now() + JOIN_PROBE_WAIT;
        loop {
            match parity::probe(self, worker).await {
                Err(parity::Retry::NotSubscribed) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(JOIN_PROBE_POLL).await;
                }
                outcome => return self.probe_made(worker, outcome),
            }
        }
    }

    /// One health check: `Err(Connect)` when the connection is refused, `Err(Probe)` for no
    /// or a bad answer in time.
    async fn probe(&self, url: &str) -> Result<(), Failure> {
        match tokio::time::timeout(PROBE_TIMEOUT, self.workers().client.get(url)).await {
            Ok(Ok((status, _))) if status.is_success() => Ok(()),
            Ok(Err(e)) if e.is_connect() => Err(Failure::Connect),
            _ => Err(Failure::Probe),
        }
    }
}

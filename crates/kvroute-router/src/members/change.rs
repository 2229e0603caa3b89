//! The one path of a membership change: join, drain, remove (see [`crate::members`]).

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::WorkerId;

use crate::config::{WorkerError, WorkerSpec};
use crate::load;
use crate::nats::EventsVia;
use crate::state::{MemberChange, RouterState};
use crate::subscriber;

/// How long a draining worker's requests may run before it is removed all the same.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// How often a draining worker's in-flight requests are counted.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Why a worker could not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("worker {0} is a member already")]
    Known(WorkerId),
    #[error("worker {worker}: {why}")]
    Invalid { worker: WorkerId, why: WorkerError },
    #[error(
        "worker {worker}: its events come from the JetStream stream (--events-via {via}); a worker joins while the router runs only with --events-via zmq"
    )]
    EventsVia { worker: WorkerId, via: &'static str },
    #[error("the event plane cannot start: {0}")]
    Plane(#[from] std::io::Error),
    #[error("the fleet holds its most workers ({0}, --max-workers): drain or remove one first")]
    Full(usize),
}

/// A worker joins the fleet while the router runs (see [`crate::members`]). With a front door
/// that probes parity, it is a candidate only once its probe was made.
pub fn join(state: &Arc<RouterState>, spec: &WorkerSpec, source: &str) -> Result<(), JoinError> {
    check(state, spec)?;
    let gate_on_parity = state.roster.probed();
    if !state.change_member(MemberChange::Join { spec, source, gate_on_parity }) {
        return Err(JoinError::Known(spec.id));
    }
    if let Err(err) = start_tasks(state, spec) {
        state.change_member(MemberChange::Remove(spec.id));
        return Err(err.into());
    }
    Ok(())
}

/// Whether `spec` may join this router.
fn check(state: &RouterState, spec: &WorkerSpec) -> Result<(), JoinError> {
    let invalid = |why| JoinError::Invalid { worker: spec.id, why };
    spec.validate(state.config.max_dp_size).map_err(invalid)?;
    for endpoint in [&spec.events, &spec.replay].into_iter().flatten() {
        for rank in 0..spec.dp_size {
            WorkerSpec::endpoint_for_rank(endpoint, rank)
                .map_err(|_| invalid(WorkerError::Endpoint(endpoint.clone())))?;
        }
    }
    let via = state.config.nats.as_ref().map(|n| n.events).unwrap_or_default();
    if via != EventsVia::Zmq && spec.events.is_some() {
        let via = if via == EventsVia::Stream { "stream" } else { "relay" };
        return Err(JoinError::EventsVia { worker: spec.id, via });
    }
    if state.roster.get(spec.id).is_some() {
        return Err(JoinError::Known(spec.id));
    }
    if state.roster.len() >= state.config.max_workers {
        return Err(JoinError::Full(state.config.max_workers));
    }
    Ok(())
}

/// Starts what follows a member: its ranks' event subscriptions (on the event plane) and its
/// load reader, kept with it in the roster (stopped when it leaves).
pub(crate) fn start_tasks(state: &Arc<RouterState>, spec: &WorkerSpec) -> std::io::Result<()> {
    let mut tasks = Vec::new();
    let subscriptions = subscriber::subscriptions_of(spec, &state.config);
    if !subscriptions.is_empty() {
        let plane = state.roster.plane()?;
        for mut sub in subscriptions {
            // Where a saved state left its stream ([`crate::saved`]); none for a newcomer.
            sub.resume_after = state.fleet.last_seq(sub.worker);
            tasks.push(plane.spawn(subscriber::run(Arc::clone(state), sub)).abort_handle());
        }
    }
    if let Some(metrics) = &spec.metrics {
        let reader = tokio::spawn(load::run(Arc::clone(state), spec.id, metrics.clone()));
        tasks.push(reader.abort_handle());
    }
    state.roster.attach(spec.id, tasks);
    Ok(())
}

/// A worker drains: no new decision from now on; it is removed once its in-flight requests
/// end, or after `timeout`. `false` when it is not a member.
pub fn drain(state: &Arc<RouterState>, worker: WorkerId, timeout: Duration) -> bool {
    if !state.change_member(MemberChange::Drain(worker)) {
        return false;
    }
    let state = Arc::clone(state);
    tokio::spawn(async move {
        let ranks = state.fleet.ranks(worker).unwrap_or(0);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = state.scheduling.in_flight_on(worker, ranks);
            if left == 0 {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(%worker, requests = left, timeout_secs = timeout.as_secs(), "a draining worker still runs requests: removed all the same");
                break;
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
        remove(&state, worker);
    });
    true
}

/// A worker leaves at once (its in-flight requests are no longer accounted). `false` when it
/// is not a member.
pub fn remove(state: &RouterState, worker: WorkerId) -> bool {
    state.change_member(MemberChange::Remove(worker))
}

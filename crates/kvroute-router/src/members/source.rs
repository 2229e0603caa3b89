//! A source of members behind one trait ([`Source`]): it follows where its fleet is written
//! (DNS, a NATS bucket, a file, Kubernetes) and offers its whole set to its [`Sink`] on each
//! change; the sink joins what is new and drains what is gone, for that source's members only.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::WorkerId;

use super::change::{JoinError, drain, join};
use crate::config::WorkerSpec;
use crate::state::RouterState;

/// Most members one source may bring: from a larger set (a DNS answer of ten thousand
/// addresses, a flood of registrations) the members already held are kept and the newcomers
/// with the lowest ids fill what is left, the same cut on every replica that holds the same
/// members; each worker cut or refused is counted once.
pub const MAX_MEMBERS_PER_SOURCE: usize = 1024;

/// Most workers remembered as refused or cut (each counted once); past it, no more are counted.
const MAX_COUNTED: usize = 64 * 1024;

/// A source of the fleet's members.
pub trait Source: Send + 'static {
    /// Its name: the `source` of the members it brings (`dns`, `nats`, ...).
    fn name(&self) -> String;
    /// Follows the source until the router stops, offering its whole set to `sink` whenever it
    /// may have changed.
    fn run(self: Box<Self>, sink: Sink) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Where a source's sets go (see the module docs).
#[derive(Debug)]
pub struct Sink {
    state: Arc<RouterState>,
    source: String,
    drain_timeout: Duration,
    /// Workers refused or cut, each counted (and, up to the members' bound, logged) once.
    counted: Mutex<BTreeSet<WorkerId>>,
    cut_logged: AtomicBool,
}

/// What one offer changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offered {
    pub joined: Vec<WorkerId>,
    pub drained: Vec<WorkerId>,
    /// Workers refused (invalid, or an id another source holds), and workers past the bound.
    pub refused: usize,
    pub cut: usize,
}

impl Sink {
    pub fn new(state: Arc<RouterState>, source: &str, drain_timeout: Duration) -> Self {
        Self {
            state,
            source: source.to_owned(),
            drain_timeout,
            counted: Mutex::default(),
            cut_logged: AtomicBool::new(false),
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The source's whole set now: what is new joins, what it no longer lists drains. A member
    /// still draining is left to finish (it joins again at a later offer once removed).
    pub fn offer(&self, mut desired: Vec<WorkerSpec>) -> Offered {
        let mut out = Offered::default();
        desired.sort_by_key(|w| w.id);
        desired.dedup_by_key(|w| w.id);
        let mut newly = 0;
        if desired.len() > MAX_MEMBERS_PER_SOURCE {
            // The members held first (a flood cannot push one out), then newcomers by id.
            let held: BTreeSet<WorkerId> = self
                .state
                .roster
                .of_source(&self.source)
                .iter()
                .filter(|m| !m.draining)
                .map(|m| m.spec.id)
                .collect();
            desired.sort_by_key(|w| (!held.contains(&w.id), w.id));
            let cut = desired.split_off(MAX_MEMBERS_PER_SOURCE);
            out.cut = cut.len();
            newly += cut.iter().filter(|w| self.first_time(w.id)).count();
            desired.sort_by_key(|w| w.id);
            if !self.cut_logged.swap(true, Ordering::Relaxed) {
                tracing::warn!(source = %self.source, cut = out.cut, bound = MAX_MEMBERS_PER_SOURCE, "a source lists more workers than the bound: the members held are kept, newcomers wait");
            }
        }
        let wanted: BTreeSet<WorkerId> = desired.iter().map(|w| w.id).collect();
        for member in self.state.roster.of_source(&self.source) {
            let id = member.spec.id;
            if !wanted.contains(&id)
                && !member.draining
                && drain(&self.state, id, self.drain_timeout)
            {
                out.drained.push(id);
            }
        }
        for spec in desired {
            if self.state.roster.get(spec.id).is_some() {
                continue;
            }
            match join(&self.state, &spec, &self.source) {
                Ok(()) => out.joined.push(spec.id),
                Err(err) => {
                    out.refused += 1;
                    newly += usize::from(self.refused(spec.id, &err));
                }
            }
        }
        let m = &self.state.metrics;
        m.membership(&self.source, "joined", out.joined.len());
        m.membership(&self.source, "drained", out.drained.len());
        m.membership(&self.source, "refused", newly);
        out
    }

    /// Counts `n` refusals the source made itself (a registration it could not verify).
    pub fn count_refused(&self, n: usize) {
        self.state.metrics.membership(&self.source, "refused", n);
    }

    /// Whether `worker` is refused or cut for the first time (then it is counted).
    fn first_time(&self, worker: WorkerId) -> bool {
        let mut counted = self.counted.lock().unwrap_or_else(PoisonError::into_inner);
        counted.len() < MAX_COUNTED && counted.insert(worker)
    }

    /// A refusal: whether it is the first for `worker` (then it is counted and logged).
    fn refused(&self, worker: WorkerId, err: &JoinError) -> bool {
        let first = self.first_time(worker);
        let logged = self.counted.lock().unwrap_or_else(PoisonError::into_inner).len();
        if first && logged <= MAX_MEMBERS_PER_SOURCE {
            tracing::warn!(source = %self.source, %worker, %err, "a worker the source lists cannot join");
        }
        first
    }
}

/// Runs `source` on the current runtime, its members joining and leaving `state`.
pub fn spawn_source(
    state: &Arc<RouterState>,
    source: Box<dyn Source>,
    drain_timeout: Duration,
) -> tokio::task::JoinHandle<()> {
    let sink = Sink::new(Arc::clone(state), &source.name(), drain_timeout);
    tokio::spawn(source.run(sink))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterConfig;

    fn worker(k: u32) -> WorkerSpec {
        let mut spec = WorkerSpec::new(u64::from(k) + 1);
        spec.url = Some(format!("http://127.3.{}.{}:9", k / 250, k % 250 + 1));
        spec
    }

    #[test]
    fn a_set_of_ten_thousand_is_cut_to_the_bound_the_same_way_each_time() {
        let state = Arc::new(RouterState::new(RouterConfig::default()));
        let sink = Sink::new(Arc::clone(&state), "dns", Duration::from_secs(1));
        let many: Vec<WorkerSpec> = (0..10_000).rev().map(worker).collect();
        let first = sink.offer(many.clone());
        assert_eq!(
            (first.joined.len(), first.cut),
            (MAX_MEMBERS_PER_SOURCE, 10_000 - MAX_MEMBERS_PER_SOURCE)
        );
        assert_eq!(
            first.joined.iter().max().map(|w| w.0),
            Some(MAX_MEMBERS_PER_SOURCE as u64),
            "the lowest ids"
        );
        let again = sink.offer(many);
        assert_eq!(
            (again.joined.len(), again.drained.len()),
            (0, 0),
            "the same cut: nothing changes"
        );
        assert_eq!(state.view().workers().len(), MAX_MEMBERS_PER_SOURCE);
        assert!(
            state.view().render_metrics().contains(
                "kvroute_router_membership_changes_total{source=\"dns\",change=\"refused\"} 8976"
            ),
            "each worker cut is counted once, not at every look"
        );
    }

    #[test]
    fn at_the_bound_the_members_held_stay_and_lower_ids_wait() {
        let state = Arc::new(RouterState::new(RouterConfig::default()));
        let sink = Sink::new(Arc::clone(&state), "nats", Duration::from_secs(1));
        // Ten real workers, with the highest ids.
        let real: Vec<WorkerSpec> = (5000..5010).map(worker).collect();
        assert_eq!(sink.offer(real.clone()).joined.len(), 10);
        // A flood of 2,000 newcomers whose ids are all lower.
        let mut flood: Vec<WorkerSpec> = (0..2000).map(worker).collect();
        flood.extend(real.iter().cloned());
        let offered = sink.offer(flood.clone());
        assert!(offered.drained.is_empty(), "nobody held is pushed out: {:?}", offered.drained);
        assert_eq!(offered.joined.len(), MAX_MEMBERS_PER_SOURCE - 10);
        for w in &real {
            assert!(!state.roster.get(w.id).unwrap().draining);
        }
        assert_eq!(sink.offer(flood).joined.len(), 0, "the same cut again");
    }

    #[tokio::test]
    async fn a_member_of_another_source_is_neither_joined_twice_nor_drained() {
        let state = Arc::new(RouterState::new(RouterConfig::default()));
        join(&state, &worker(1), "api").unwrap();
        let sink = Sink::new(Arc::clone(&state), "dns", Duration::from_secs(1));
        let offered = sink.offer(vec![worker(1), worker(2)]);
        assert_eq!(offered.joined, [worker(2).id]);
        let offered = sink.offer(Vec::new());
        assert_eq!(offered.drained, [worker(2).id], "only its own member drains");
        assert_eq!(state.roster.get(worker(1).id).unwrap().source, "api");
        assert!(!state.roster.get(worker(1).id).unwrap().draining);
    }
}

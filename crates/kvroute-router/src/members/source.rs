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

/// Most members one source may bring: a larger set (a DNS answer of ten thousand addresses)
/// is cut to the lowest ids, the same cut on every replica, counted and logged once.
pub const MAX_MEMBERS_PER_SOURCE: usize = 1024;

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
    /// Workers whose refusal was logged (each once); bounded by the members' bound.
    logged: Mutex<BTreeSet<WorkerId>>,
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
            logged: Mutex::default(),
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
        if desired.len() > MAX_MEMBERS_PER_SOURCE {
            out.cut = desired.len() - MAX_MEMBERS_PER_SOURCE;
            desired.truncate(MAX_MEMBERS_PER_SOURCE);
            if !self.cut_logged.swap(true, Ordering::Relaxed) {
                tracing::warn!(source = %self.source, cut = out.cut, bound = MAX_MEMBERS_PER_SOURCE, "a source lists more workers than the bound: the lowest ids are kept");
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
                    self.refused(spec.id, &err);
                }
            }
        }
        let m = &self.state.metrics;
        m.membership(&self.source, "joined", out.joined.len());
        m.membership(&self.source, "drained", out.drained.len());
        m.membership(&self.source, "refused", out.refused + out.cut);
        out
    }

    fn refused(&self, worker: WorkerId, err: &JoinError) {
        let mut logged = self.logged.lock().unwrap_or_else(PoisonError::into_inner);
        if logged.len() < MAX_MEMBERS_PER_SOURCE && logged.insert(worker) {
            tracing::warn!(source = %self.source, %worker, %err, "a worker the source lists cannot join");
        }
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
        assert_eq!(state.workers().len(), MAX_MEMBERS_PER_SOURCE);
        assert!(state.render_metrics().contains(
            "kvroute_router_membership_changes_total{source=\"dns\",change=\"refused\"} 17952"
        ));
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

//! A request's attempts at a worker: the one placement loop every entry point runs (the front
//! door's hop, its two legs in a disaggregated fleet, the picker behind a gateway).
//!
//! [`Attempts`] is made once per request: flow control admits it at the first placement and
//! never again, and who is out of rotation is decided once, by [`out_of_rotation`]. Each
//! [`Attempts::next`] places the request (a pair of legs in a disaggregated fleet, one worker
//! otherwise) and puts it in flight; a worker that fails it ([`Attempts::failed`]) or cannot
//! take it ([`Attempts::skip`]) is left out of the attempts that follow.

use std::collections::BTreeSet;
use std::sync::Arc;

use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::ApiError;
use kvroute_router::PlaceRequest;

use crate::FrontendState;
use crate::decider::Legs;
use crate::hop::HopFailure;
use crate::observer::InFlight;
use crate::outbound::Outbound;
use crate::roster::Workers;

/// Workers out of rotation now: those draining, those outside `subset` (a gateway's hint),
/// and those ejected after a failure (until a health check passes once their backoff is over:
/// the backoff paces the checks, and a worker comes back by answering one, not by failing a
/// client's request). Better a worker that failed than none: when every other is out, the
/// ejected ones are tried all the same.
pub(crate) fn out_of_rotation(
    state: &FrontendState,
    workers: &Workers,
    subset: Option<&BTreeSet<WorkerId>>,
) -> BTreeSet<WorkerId> {
    let set_aside =
        |w: WorkerId| workers.draining.contains(&w) || subset.is_some_and(|s| !s.contains(&w));
    rotation(workers.urls.keys().copied(), set_aside, |w| state.health.is_ejected(w))
}

/// [`out_of_rotation`]'s rule: of `workers`, those `set_aside`, and those `ejected` unless
/// that would leave none.
fn rotation(
    workers: impl Iterator<Item = WorkerId>,
    set_aside: impl Fn(WorkerId) -> bool,
    ejected: impl Fn(WorkerId) -> bool,
) -> BTreeSet<WorkerId> {
    let (mut out, mut failed, mut count) = (BTreeSet::new(), Vec::new(), 0);
    for w in workers {
        count += 1;
        if set_aside(w) {
            out.insert(w);
        } else if ejected(w) {
            failed.push(w);
        }
    }
    if out.len() + failed.len() < count {
        out.extend(failed);
    }
    out
}

/// One placement: its legs (no prefill leg outside a disaggregated fleet, or when it is
/// prefilled where it decodes) and the request in flight, in its engine span.
pub(crate) struct Attempt {
    pub(crate) legs: Legs,
    pub(crate) guard: InFlight,
}

/// The attempts of one request: see the module.
pub(crate) struct Attempts<'a> {
    state: &'a Arc<FrontendState>,
    out: &'a Outbound,
    subset: Option<&'a BTreeSet<WorkerId>>,
    /// Its class until the first placement (flow control's), none after.
    request: PlaceRequest,
    excluded: Vec<WorkerWithDpRank>,
    paired: bool,
    lowered: bool,
}

impl<'a> Attempts<'a> {
    pub(crate) fn new(
        state: &'a Arc<FrontendState>,
        out: &'a Outbound,
        subset: Option<&'a BTreeSet<WorkerId>>,
    ) -> Self {
        let workers = state.workers();
        let out_of = out_of_rotation(state, &workers, subset);
        Self {
            state,
            out,
            subset,
            request: out.place.clone(),
            excluded: out_of.into_iter().flat_map(|w| workers.all_ranks(w)).collect(),
            paired: state.decider.disaggregated(workers.prefill_workers),
            lowered: false,
        }
    }

    /// Whether the fleet places pairs (prefill and decode workers).
    pub(crate) fn paired(&self) -> bool {
        self.paired
    }

    /// Whether its tenant was over its share when it was admitted, and engine priorities are
    /// lowered for that (`--engine-priority`): sent one engine priority below its class (#78).
    pub(crate) fn lowered(&self) -> bool {
        self.lowered
    }

    /// The next placement, in flight from now; a 503 when no worker is left.
    pub(crate) async fn next(&mut self) -> Result<Attempt, ApiError> {
        let state = self.state;
        let id = state.request_id();
        let to = (id.as_str(), self.out.trace.as_ref());
        let legs = match self.paired {
            true => state.decider.decide_pair(&self.request, to, &self.excluded).await?,
            false => {
                let placed = state
                    .decider
                    .decide(&self.request, state.block_size, to, &self.excluded)
                    .await?;
                placed.map(|decode| Legs { prefill: None, decode })
            }
        };
        if let Some(class) = self.request.class.take() {
            self.lowered = state.options.engine_priority && state.decider.over_share(&class);
        }
        let Some(legs) = legs.filter(|l| !self.excluded.contains(&l.decode.worker)) else {
            return Err(match self.subset {
                Some(_) => ApiError::unavailable("no endpoint of the subset can take the request"),
                None => ApiError::unavailable("no worker is available"),
            });
        };
        log_placement(&id, self.out, &legs);
        let mut guard = InFlight::new(state, id);
        let leg = if legs.prefill.is_some() { "decode" } else { "aggregated" };
        guard.span = crate::hop::engine_span(legs.decode.worker, leg, &guard.id);
        Ok(Attempt { legs, guard })
    }

    /// `worker` failed the request before its answer began: ejected for a while, and left out
    /// of the attempts that follow.
    pub(crate) fn failed(&mut self, worker: WorkerId, (why, error): HopFailure) {
        let error = kvroute_http::error::chain(&error);
        tracing::warn!(%worker, %error, "worker failed; trying another");
        self.state.worker_failed(worker, why);
        self.state.metrics.retried.inc();
        self.skip(worker);
    }

    /// `worker` cannot take the request (it is not to blame): left out of the attempts that
    /// follow.
    pub(crate) fn skip(&mut self, worker: WorkerId) {
        self.excluded.extend(self.state.workers().all_ranks(worker));
    }

    /// The workers in rotation other than `worker`, in order after it: where a gateway falls
    /// back when it cannot reach `worker`.
    pub(crate) fn rest(&self, worker: WorkerId) -> Vec<WorkerId> {
        let state = self.state;
        let workers = state.workers();
        let others: Vec<WorkerId> = workers
            .urls
            .keys()
            .copied()
            .filter(|&w| w != worker && workers.all_ranks(w).all(|r| !self.excluded.contains(&r)))
            .collect();
        let split = others.partition_point(|&w| w < worker);
        others[split..].iter().chain(&others[..split]).copied().collect()
    }
}

/// Where a request went and what each engine was predicted to hold, at debug level
/// (`kvroute::placement`): records to join with a load generator's when a tail needs
/// explaining.
fn log_placement(id: &str, out: &Outbound, legs: &Legs) {
    tracing::debug!(
        target: "kvroute::placement",
        request = %id,
        prompt_tokens = out.place.num_tokens,
        prefill = ?legs.prefill.map(|p| (p.worker, p.predicted_cached_tokens)),
        decode = %legs.decode.worker,
        decode_cached_tokens = legs.decode.predicted_cached_tokens,
        "placed"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(ids: &[u64], aside: &[u64], ejected: &[u64]) -> Vec<u64> {
        let w = ids.iter().map(|&i| WorkerId(i));
        let set = rotation(w, |w| aside.contains(&w.0), |w| ejected.contains(&w.0));
        set.into_iter().map(|w| w.0).collect()
    }

    /// Draining and outside the subset are always out; the ejected are out unless no other
    /// worker is left, then tried all the same.
    #[test]
    fn the_ejected_come_back_only_when_every_other_is_out() {
        assert_eq!(out(&[1, 2, 3], &[], &[1]), [1]);
        assert_eq!(out(&[1, 2, 3], &[3], &[1]), [1, 3]);
        assert_eq!(out(&[1, 2], &[], &[1, 2]), Vec::<u64>::new(), "all ejected: all tried");
        assert_eq!(out(&[1, 2, 3], &[3], &[1, 2]), [3], "the rest ejected: the rest tried");
        assert_eq!(out(&[1, 2], &[1, 2], &[]), [1, 2], "set aside stays out");
        assert_eq!(out(&[], &[], &[]), Vec::<u64>::new());
    }
}

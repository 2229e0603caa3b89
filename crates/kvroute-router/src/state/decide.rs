//! The verbs of a request's life at the router: decided ([`RouterState::decide`]), its first
//! token, its end, and what frees capacity for those waiting ([`RouterState::release`]).
//!
//! Flow control (docs/routing.md, "Overload"): a tracked request with a class is placed at
//! once when a worker can take it and nothing of its priority or above waits before it (here
//! or, by their last report, at a replica); otherwise it waits in the queues, holding no
//! engine slot, until capacity frees (a release runs when a first token arrives, a request
//! ends, a load report comes, and every 50 ms), or it is refused: 429 with `Retry-After` for
//! a sheddable request the fleet cannot take and for a full queue or a tenant over its share,
//! 503 with `Retry-After` when it waited past its deadline. A client that goes away leaves the
//! queue at once ([`Ticket`]'s drop).
//!
//! Every caller (the front door, the picker, the HTTP API) places through `decide`; whether a
//! request is placed as a prefill and decode pair is the fleet's (it has prefill workers).

use std::time::{Duration, Instant};

use kvroute_core::index::{OverlapScores, ShardedIndex};
use kvroute_core::schedule::flow::{Full, Gate, Outlook, RequestClass};
use kvroute_core::schedule::pairs::prefill_leg_id;
use kvroute_core::schedule::{PairDecision, RouteDecision, WorkerLoad};
use kvroute_core::{RouterEvent, SequenceHash, WorkerWithDpRank, sequence_hashes};
use kvroute_wire::replica::SyncMessage;
use tokio::sync::oneshot;

use super::composite::RouterState;
use super::ingest::apply_one;
use super::queues::{Outcome, Reported, Waiter, refusal, retry_after};
use super::request::{Decision, PlaceRequest};
use super::self_checks::SelfChecks;
use super::status::CacheMode;
use crate::metrics::FlowOutcome;

impl RouterState {
    /// Where `request` goes: one worker, or a prefill and decode pair in a disaggregated fleet
    /// (`Ok(None)` when there is no worker to choose). A tracked request with a class goes
    /// through flow control when it is on, and may wait or be refused; any other is placed at
    /// once. A placed tracked request is in flight until [`RouterState::finish`].
    pub async fn decide(&self, request: &PlaceRequest) -> Outcome {
        match &request.class {
            Some(class) if request.id.is_some() && self.config.scheduler.flow.enabled => {
                let admit = kvroute_http::span!(
                    "kvroute.admit",
                    kvroute.priority = i64::from(class.priority),
                    kvroute.tenant = &*class.tenant,
                    kvroute.outcome = tracing::field::Empty,
                    kvroute.queue_wait_ms = tracing::field::Empty,
                );
                let start = Instant::now();
                let outcome = match admit.in_scope(|| self.admit_now(class, request)) {
                    Now::Done(outcome) => outcome,
                    Now::Waiting(ticket) => {
                        tracing::Instrument::instrument(ticket.wait(), admit.clone()).await
                    }
                };
                if !admit.is_disabled() {
                    let said = match &outcome {
                        Ok(Some(_)) => "placed",
                        Ok(None) => "no worker",
                        Err(r) if r.status == 429 => "refused",
                        Err(_) => "expired",
                    };
                    admit.record("kvroute.outcome", said);
                    admit.record("kvroute.queue_wait_ms", start.elapsed().as_secs_f64() * 1e3);
                }
                outcome
            }
            _ => Ok(self.decide_now(request)),
        }
    }

    /// Places `request` at once, past flow control (a question, or a request admitted
    /// already). A drifted worker's overlap counts half until its predictions agree again (not
    /// nothing: it must still be routed the prefixes only it holds, or its predictions could
    /// never be seen to agree).
    pub fn decide_now(&self, request: &PlaceRequest) -> Option<Decision> {
        self.place_gated(request, None).unwrap_or(None)
    }

    /// Places `p` if `gate` (when given) lets a worker take it: only a worker that can take
    /// it now ([`kvroute_core::schedule::Scheduler::route_gated`]), or in a disaggregated
    /// fleet the fleet's best offer (then the pair is chosen as always); the best offer when
    /// none can. The index is read once.
    fn place_gated(
        &self,
        p: &PlaceRequest,
        gate: Option<&Gate>,
    ) -> Result<Option<Decision>, Outlook> {
        let start = Instant::now();
        let span = kvroute_http::span!(
            "kvroute.decide",
            kvroute.request_id = p.id.as_deref(),
            kvroute.worker = tracing::field::Empty,
            kvroute.prefill_worker = tracing::field::Empty,
            kvroute.overlap_blocks = tracing::field::Empty,
            kvroute.predicted_cached_tokens = tracing::field::Empty,
        );
        let _in = span.enter();
        let scores = scores_for(&self.index, &self.checks, self.config.block_size.tokens(), p);
        // Only a tracked request keeps its chained hashes (for the in-flight accounting).
        let sequence: Vec<SequenceHash> = match p.id {
            Some(_) => sequence_hashes(&p.local_hashes),
            None => Vec::new(),
        };
        let request = p.route(&sequence);
        let mut scheduler = self.scheduling.scheduler();
        let decision = match scheduler.disaggregated() {
            true => {
                if let Some(gate) = gate {
                    let outlook = scheduler.outlook(&request, &scores, &self.index, start);
                    if let Some(o) = outlook.filter(|o| !gate.admits(o.wait_ms, o.ttft_ms)) {
                        return Err(o);
                    }
                }
                scheduler.route_pair(&request, &scores, &self.index, start)
            }
            false => scheduler
                .route_gated(&request, &scores, &self.index, start, gate)?
                .map(|decode| PairDecision { prefill: None, decode, transfer_blocks: 0 }),
        };
        // The scheduler's lock is released before `placed` (which may take approximate mode's).
        drop(scheduler);
        let Some(decision) = decision else { return Ok(None) };
        if let Some(prefill) = &decision.prefill {
            let id = p.id.as_deref().map(prefill_leg_id);
            self.placed(id.as_deref(), prefill, p, start);
        }
        self.placed(p.id.as_deref(), &decision.decode, p, start);
        let log = self.decision_log.as_ref();
        logged_and_explained(log, &self.scheduling, &span, (p, &decision));
        Ok(Some(decision))
    }

    /// A decision made: the replicas hear of it, an approximate worker assumes its blocks, the
    /// metrics count it.
    fn placed(&self, id: Option<&str>, d: &RouteDecision, p: &PlaceRequest, start: Instant) {
        if let (Some(id), Some(nats)) = (id, self.nats.get()) {
            nats.send(
                &self.metrics,
                SyncMessage::Routed {
                    id: id.to_owned(),
                    worker_id: d.worker.worker_id.0,
                    dp_rank: d.worker.dp_rank.0,
                    isl_tokens: p.num_tokens,
                    prefill_tokens: d.predicted_prefill_tokens,
                    local_hashes: p.local_hashes.iter().map(|h| h.0).collect(),
                    output_tokens: p.output_tokens,
                    // The decision's span when spans are exported, else the caller's trace.
                    traceparent: kvroute_http::otel::outbound(
                        &tracing::Span::current(),
                        p.trace.as_ref(),
                    )
                    .map(|t| t.traceparent()),
                },
            );
        }
        if self.fleet.mode(d.worker.worker_id) == Some(CacheMode::Approximate) {
            let mut approx = self.scheduling.approx();
            let assumed: Vec<RouterEvent> = approx.record_routed(d.worker, &p.local_hashes, start);
            for e in &assumed {
                apply_one(&self.index, &self.metrics, e);
            }
        }
        self.metrics.decision(d.worker, start.elapsed());
    }

    /// The request's first token arrived. `timed`: when it did is when its first token was
    /// (a streamed answer), so it teaches the predictions; an answer sent whole is not.
    pub fn prefill_done(&self, request_id: &str, timed: bool) {
        let mut scheduler = self.scheduling.scheduler();
        let seen = match timed {
            true => scheduler.mark_prefill_done(request_id),
            false => {
                scheduler.mark_prefill_done_untimed(request_id);
                None
            }
        };
        drop(scheduler);
        if let Some(seen) = seen {
            self.metrics.first_token(&seen);
        }
        if let Some(nats) = self.nats.get() {
            nats.send(&self.metrics, SyncMessage::PrefillDone { id: request_id.to_owned() });
        }
        self.release();
    }

    /// The request ended; returns whether it was in flight.
    pub fn finish(&self, request_id: &str) -> bool {
        let tracked = self.scheduling.scheduler().free(request_id);
        if let (true, Some(nats)) = (tracked, self.nats.get()) {
            nats.send(&self.metrics, SyncMessage::Freed { id: request_id.to_owned() });
        }
        self.release();
        tracked
    }

    /// A rank's load report: the scheduler's load, approximate mode's capacity, readiness; and
    /// the engine's word on its requests against what kvroute holds there (placements it never
    /// saw are freed, [`kvroute_core::schedule::Scheduler::reconcile`]).
    pub fn update_load(&self, worker: WorkerWithDpRank, load: WorkerLoad) {
        let freed = {
            let mut scheduler = self.scheduling.scheduler();
            scheduler.update_load(worker, load);
            match (load.num_running_reqs, load.num_waiting_reqs) {
                (Some(running), Some(waiting)) => {
                    let engine =
                        usize::try_from(running.saturating_add(waiting)).unwrap_or(usize::MAX);
                    scheduler.reconcile(worker, engine, Instant::now())
                }
                _ => Vec::new(),
            }
        };
        if !freed.is_empty() {
            self.metrics.reconciled.inc_by(freed.len() as u64);
            tracing::info!(%worker, freed = freed.len(), oldest = %freed[0], "placements the engine never saw are freed");
        }
        if self.fleet.mode(worker.worker_id) == Some(CacheMode::Approximate) {
            let capacity = load.kv_total_blocks.map(|b| b as usize);
            self.scheduling.approx().set_capacity(worker, capacity);
        }
        if let Some(ready) = self.fleet.set_load(worker, load) {
            self.scheduling.scheduler().set_ready(worker, ready);
        }
        if load.block_size.is_some() && self.fleet.refused(worker.worker_id) {
            self.scheduling.scheduler().set_refused(worker);
        }
        self.fleet.signal();
        self.release();
    }

    /// [`RouterState::decide`] through flow control, up to the wait, under the queues' lock.
    fn admit_now(&self, class: &RequestClass, request: &PlaceRequest) -> Now<'_> {
        let config = self.config.scheduler.flow;
        let now = Instant::now();
        let mut queues = self.flow.queues();
        // A tenant within its share waits behind no request of a tenant over it at its
        // priority; one over it takes a worker only within its part of the wait.
        let over = queues.over_share(&class.tenant, now);
        let gate = Gate::for_class(&config, class, Duration::ZERO).over_share(&config, over);
        let waiting = match over {
            true => queues.waiting_from(class.priority),
            false => queues.within_share_ahead(class.priority, now),
        };
        let ahead = waiting + self.flow.peers_waiting_above(class.priority, now);
        let mut outlook = None;
        if ahead == 0 {
            match self.place_gated(request, Some(&gate)) {
                Ok(placed) => {
                    queues.sent(&class.tenant, request.num_tokens as f64, now);
                    drop(queues);
                    self.metrics.flow_metrics.record(class, FlowOutcome::Admitted, None);
                    return Now::Done(Ok(placed));
                }
                Err(best) => outlook = Some(best),
            }
        }
        if class.sheddable() && config.shed_at_once {
            drop(queues);
            self.metrics.flow_metrics.record(class, FlowOutcome::Shed, None);
            let message = "the fleet is saturated and this request is sheddable (priority below 0)";
            return Now::Done(Err(refusal(429, retry_after(outlook, &gate), message)));
        }
        let id = self.flow.next_id();
        let (tx, rx) = oneshot::channel();
        let (bytes, cost) = (request.bytes(), request.num_tokens as f64);
        let deadline = config.deadline(class, now);
        let request_id = request.id.clone().unwrap_or_default();
        let waiter = Waiter { request: request.clone(), tx, span: tracing::Span::current() };
        let pushed = queues.push(id, class.clone(), cost, bytes, now, deadline, waiter);
        drop(queues);
        if let Err((full, _)) = pushed {
            self.metrics.flow_metrics.record(class, FlowOutcome::Full, None);
            let message = match full {
                Full::Tenant => "this tenant has too many requests waiting at this priority",
                _ => "the router's queue is full",
            };
            return Now::Done(Err(refusal(429, retry_after(outlook, &gate), message)));
        }
        self.metrics.flow_metrics.record(class, FlowOutcome::Queued, None);
        self.flow.gauges(&self.metrics);
        Now::Waiting(Ticket { state: self, id, request_id, rx, done: false })
    }

    /// Lets waiting requests go while workers can take them, highest priority first and the
    /// tenants of a priority in turn (a tenant over its share passed over while its part of
    /// the wait is used up); refuses those past their deadline.
    pub fn release(&self) {
        let config = self.config.scheduler.flow;
        if !config.enabled {
            return;
        }
        let mut queues = self.flow.queues();
        if queues.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut orphans = Vec::new();
        for q in queues.expired(now) {
            let waited = Some(now - q.enqueued);
            self.metrics.flow_metrics.record(&q.class, FlowOutcome::Expired, waited);
            let status = if q.class.sheddable() { 429 } else { 503 };
            let message = "the request waited past its deadline for a worker to take it";
            q.item.tx.send(Err(refusal(status, 1, message))).ok();
        }
        let mut passed_over = Vec::new();
        while let Some(head) = queues.peek_except(&passed_over) {
            let id = head.id;
            if head.item.tx.is_closed() {
                if let Some(q) = queues.remove(id) {
                    let waited = Some(now - q.enqueued);
                    self.metrics.flow_metrics.record(&q.class, FlowOutcome::Abandoned, waited);
                }
                continue;
            }
            if self.flow.peers_waiting_above(head.class.priority, now) > 0 {
                break;
            }
            let over = queues.over_share(&head.class.tenant, now);
            let gate = Gate::for_class(&config, &head.class, now - head.enqueued)
                .over_share(&config, over);
            let placing = || self.place_gated(&head.item.request, Some(&gate));
            match head.item.span.in_scope(placing) {
                Ok(placed) => {
                    let Some(q) = queues.serve(id) else { break };
                    queues.sent(&q.class.tenant, q.item.request.num_tokens as f64, now);
                    let waited = Some(now - q.enqueued);
                    self.metrics.flow_metrics.record(&q.class, FlowOutcome::Released, waited);
                    orphans.extend(send(q.item, Ok(placed)));
                }
                Err(_) if over => passed_over.push(head.class.tenant.clone()),
                Err(_) => break,
            }
        }
        drop(queues);
        for id in orphans {
            self.finish(&id);
        }
        self.flow.gauges(&self.metrics);
    }

    /// Tells the replicas this one's waiting requests per priority: when they change, and
    /// every 300 ms while any wait (a peer forgets a report after a second).
    pub(crate) fn report_queues(&self, last: &mut Reported) {
        let Some(nats) = self.nats.get() else { return };
        let bands: Vec<(i32, u32)> = self
            .flow
            .bands()
            .into_iter()
            .map(|(p, n)| (p, u32::try_from(n).unwrap_or(u32::MAX)))
            .collect();
        let stale = !bands.is_empty() && last.at.elapsed() >= Duration::from_millis(300);
        if bands != last.bands || stale {
            nats.send(&self.metrics, SyncMessage::Queues { bands: bands.clone() });
            *last = Reported { bands, at: Instant::now() };
        }
    }
}

/// A decision written where it is asked for: to the decision log when it samples the request,
/// and on the decision's span when spans are exported (the scheduler's record read once, and
/// only then).
fn logged_and_explained(
    log: Option<&super::DecisionLog>,
    scheduling: &super::Scheduling,
    span: &tracing::Span,
    (p, decision): (&PlaceRequest, &PairDecision),
) {
    let logged = match (log, p.id.as_deref()) {
        (Some(log), Some(id)) if log.sampled(id) => Some((log, id)),
        _ => None,
    };
    // Only a span whose trace is sampled is explained (one that is not is never exported).
    let explained = kvroute_http::otel::sampled(span);
    if logged.is_none() && !explained {
        return;
    }
    let record = p.id.as_deref().and_then(|id| scheduling.decision_of(id));
    if let Some((log, id)) = logged {
        let chosen = (decision.decode.worker, decision.prefill.map(|d| d.worker));
        log.log(id, p.local_hashes.len(), record.as_ref(), chosen);
    }
    if explained {
        explain_span(span, record, p, decision);
    }
}

/// A decision on its span: where it went, the cached tokens predicted there, and (a tracked
/// request's `record`, as the scheduler keeps it) its candidates with their cost terms.
fn explain_span(
    span: &tracing::Span,
    record: Option<kvroute_core::schedule::DecisionRecord>,
    p: &PlaceRequest,
    decision: &PairDecision,
) {
    let d = &decision.decode;
    span.record("kvroute.worker", tracing::field::display(d.worker));
    if let Some(prefill) = &decision.prefill {
        span.record("kvroute.prefill_worker", tracing::field::display(prefill.worker));
    }
    span.record("kvroute.overlap_blocks", i64::from(d.overlap_blocks));
    let first = decision.prefill.as_ref().unwrap_or(d);
    let cached = p.num_tokens.saturating_sub(first.predicted_prefill_tokens);
    span.record("kvroute.predicted_cached_tokens", cached as i64);
    if let Some(record) = record {
        kvroute_http::otel::decision_attributes(span, &record);
    }
}

/// The index's scores of a request, a drifted worker's halved.
fn scores_for(
    index: &ShardedIndex,
    checks: &SelfChecks,
    bs: usize,
    p: &PlaceRequest,
) -> OverlapScores {
    let max_blocks = p.num_tokens.saturating_sub(1) / bs;
    let mut scores = index.find_matches_within(&p.local_hashes, max_blocks, bs);
    checks.halve_drifted(&mut scores);
    scores
}

/// What admission decided at once: placed, refused, or waiting on a ticket.
enum Now<'a> {
    Done(Outcome),
    Waiting(Ticket<'a>),
}

/// Sends a placement to its waiting client; the request's id when the client just left, for
/// the caller to free once it holds no lock of flow control (freeing lets requests go, which
/// takes the queues' lock).
#[must_use]
fn send(waiter: Waiter, outcome: Outcome) -> Option<String> {
    let id = waiter.request.id.clone();
    match waiter.tx.send(outcome) {
        Err(Ok(_)) => id,
        _ => None,
    }
}

/// A queued request's hold on its place: dropped before its outcome came (the client went
/// away), it leaves the queue, or gives back the placement that was on its way.
struct Ticket<'a> {
    state: &'a RouterState,
    id: u64,
    /// The request's id at the router (what a placement is tracked as).
    request_id: String,
    rx: oneshot::Receiver<Outcome>,
    done: bool,
}

impl Ticket<'_> {
    async fn wait(mut self) -> Outcome {
        let outcome = (&mut self.rx).await;
        self.done = true;
        outcome.unwrap_or_else(|_| Err(refusal(503, 1, "the router is shutting down")))
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let left = self.state.flow.queues().remove(self.id);
        if let Some(q) = left {
            let waited = Some(q.enqueued.elapsed());
            self.state.metrics.flow_metrics.record(&q.class, FlowOutcome::Abandoned, waited);
            self.state.flow.gauges(&self.state.metrics);
            return;
        }
        // Placed (or refused) as it went: a placement no one will use is freed.
        if let Ok(Ok(_)) = self.rx.try_recv() {
            self.state.finish(&self.request_id);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use kvroute_core::LocalBlockHash;
    use kvroute_core::schedule::flow::FlowConfig;

    use super::*;
    use crate::config::{RouterConfig, WorkerSpec};
    use crate::state::queues::PEER_REPORT_TTL;

    fn state(flow: FlowConfig) -> RouterState {
        let mut config = RouterConfig { workers: vec![WorkerSpec::new(1)], ..Default::default() };
        config.scheduler.flow = flow;
        RouterState::new(config)
    }

    fn ask(id: &str, class: RequestClass) -> PlaceRequest {
        PlaceRequest {
            id: Some(id.to_owned()),
            local_hashes: Arc::from([LocalBlockHash(7), LocalBlockHash(8)]),
            num_tokens: 40,
            class: Some(class),
            ..PlaceRequest::default()
        }
    }

    fn class(priority: i32) -> RequestClass {
        RequestClass { priority, ..RequestClass::default() }
    }

    const PENDING: Duration = Duration::from_millis(30);

    #[tokio::test]
    async fn a_replica_waiting_at_a_higher_priority_holds_lower_ones_back() {
        let state = state(FlowConfig { enabled: true, ..FlowConfig::default() });
        // Room, and nobody waiting anywhere: placed at once.
        let placed = state.decide(&ask("a", class(0))).await.unwrap();
        assert!(placed.is_some());
        // A peer holds requests of priority 5: a priority-0 request waits, a 5 does not
        // (replicas serve their own queue within a priority), nor a 6.
        state.flow.peer_report("peer", vec![(5, 2)]);
        let low_request = ask("b", class(0));
        let mut low = Box::pin(state.decide(&low_request));
        assert!(tokio::time::timeout(PENDING, &mut low).await.is_err(), "held back");
        assert_eq!(state.flow.bands(), vec![(0, 1)]);
        for (p, id) in [(5, "c"), (6, "d")] {
            let placed = state.decide(&ask(id, class(p))).await.unwrap();
            assert!(placed.is_some(), "priority {p}");
        }
        // The peer's queue empties: the next release lets it go.
        state.flow.peer_report("peer", Vec::new());
        state.release();
        let placed = tokio::time::timeout(PENDING, &mut low).await.unwrap().unwrap();
        assert!(placed.is_some());
        assert_eq!(state.flow.waiting(), (0, 0));
    }

    #[tokio::test]
    async fn a_tenant_within_its_share_goes_past_one_over_it() {
        // Over its share, a request takes the worker only when nothing is queued there.
        let flow = FlowConfig {
            enabled: true,
            max_engine_wait_ms: 60_000.0,
            over_share_wait: 0.0,
            ..FlowConfig::default()
        };
        let state = state(flow);
        let of = |tenant: &str| RequestClass { tenant: tenant.into(), ..class(0) };
        let placed = state.decide(&ask("l1", of("light"))).await.unwrap();
        assert!(placed.is_some());
        state.finish("l1");
        // Heavy's first prompt is 25 times light's: its next is over its share.
        let big = |id: &str, c| PlaceRequest { num_tokens: 1_000, ..ask(id, c) };
        let placed = state.decide(&big("h1", of("heavy"))).await.unwrap();
        assert!(placed.is_some());
        let h4_request = big("h4", of("heavy"));
        let mut h4 = Box::pin(state.decide(&h4_request));
        assert!(tokio::time::timeout(PENDING, &mut h4).await.is_err(), "over its share: waits");
        // The light tenant's request is not queued behind it, and a release passes it over.
        let placed = state.decide(&ask("l2", of("light"))).await.unwrap();
        assert!(placed.is_some());
        let l3_request = ask("l3", of("light"));
        let mut l3 = Box::pin(state.decide(&l3_request));
        let placed = tokio::time::timeout(PENDING, &mut l3).await.unwrap().unwrap();
        assert!(placed.is_some());
        state.release();
        assert!(tokio::time::timeout(PENDING, &mut h4).await.is_err());
        // The worker idle again: its turn.
        for id in ["h1", "l2", "l3"] {
            state.finish(id);
        }
        state.release();
        let placed = tokio::time::timeout(PENDING, &mut h4).await.unwrap().unwrap();
        assert!(placed.is_some());
    }

    #[tokio::test]
    async fn a_peer_report_counts_for_a_second_only() {
        let state = state(FlowConfig { enabled: true, ..FlowConfig::default() });
        state.flow.peer_report("peer", vec![(3, 1)]);
        let now = Instant::now();
        assert_eq!(state.flow.peers_waiting_above(0, now), 1);
        assert_eq!(state.flow.peers_waiting_above(3, now), 0);
        assert_eq!(state.flow.peers_waiting_above(0, now + PEER_REPORT_TTL), 0);
    }

    #[tokio::test]
    async fn with_flow_control_off_every_request_is_placed_at_once() {
        let state = state(FlowConfig { enabled: false, ..FlowConfig::default() });
        state.flow.peer_report("peer", vec![(100, 9)]);
        let placed = state.decide(&ask("a", class(-5))).await.unwrap();
        assert!(placed.is_some());
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_queue_and_a_placement_on_its_way_is_freed() {
        let state = state(FlowConfig { enabled: true, ..FlowConfig::default() });
        state.flow.peer_report("peer", vec![(9, 1)]);
        let waiting_request = ask("gone", class(0));
        let mut waiting = Box::pin(state.decide(&waiting_request));
        assert!(tokio::time::timeout(PENDING, &mut waiting).await.is_err());
        drop(waiting);
        assert_eq!(state.flow.waiting(), (0, 0));
        // Placed by a release, then dropped before it was read: freed, not left in flight.
        let waiting_request = ask("late", class(0));
        let mut waiting = Box::pin(state.decide(&waiting_request));
        assert!(tokio::time::timeout(PENDING, &mut waiting).await.is_err());
        state.flow.peer_report("peer", Vec::new());
        state.release();
        assert_eq!(state.scheduling.in_flight(), 1);
        drop(waiting);
        assert_eq!(state.scheduling.in_flight(), 0);
    }
}

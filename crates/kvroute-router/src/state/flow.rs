//! Flow control at the router (`kvroute_core::schedule::flow`; docs/routing.md, "Overload"):
//! a request is placed at once when a worker can take it and nothing of its priority or above
//! waits before it (here or, by their last report, at a replica); otherwise it waits in
//! [`Flow`]'s queues, holding no engine slot, until capacity frees ([`release`], called when
//! a first token arrives, a request ends, a load report comes, and every 50 ms), or it is
//! refused: 429 with `Retry-After` for a sheddable request the fleet cannot take and for a
//! full queue or a tenant over its share, 503 with `Retry-After` when it waited past its
//! deadline. A client that goes away leaves the queue at once ([`Ticket`]'s drop).
//!
//! Lock order: the queues' lock comes before the scheduler's (a request leaving the queue is
//! placed under it, so two releases never place against the same free capacity), and is never
//! taken under any other of the router's locks.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::schedule::flow::{FlowQueues, Gate, Outlook, RequestClass};
use kvroute_core::schedule::{PairDecision, RouteDecision};
use kvroute_core::{LocalBlockHash, WorkerWithDpRank};
use tokio::sync::oneshot;

use super::{PlaceRequest, RouterState, lock};
use crate::metrics::FlowOutcome;

/// Peers' queue reports older than this are not counted.
const PEER_REPORT_TTL: Duration = Duration::from_secs(1);

/// What the router needs of a request to place it later: owned, since it waits.
#[derive(Clone, Debug, Default)]
pub struct Ask {
    pub id: String,
    pub local_hashes: Vec<LocalBlockHash>,
    pub num_tokens: usize,
    pub exclude: Vec<WorkerWithDpRank>,
    pub adapter: Option<String>,
    pub session: Option<String>,
    pub output_tokens: usize,
    /// Placed as a prefill and decode pair (a disaggregated fleet).
    pub pair: bool,
}

impl Ask {
    /// The owned form of `p`, tracked as `id` (a placement request names its id already when
    /// tracked; flow control needs one); `pair`: placed as a prefill and decode pair.
    pub fn of(p: &PlaceRequest<'_>, id: &str, pair: bool) -> Self {
        Self {
            id: id.to_owned(),
            local_hashes: p.local_hashes.to_vec(),
            num_tokens: p.num_tokens,
            exclude: p.exclude.to_vec(),
            adapter: p.adapter.map(str::to_owned),
            session: p.session.map(str::to_owned),
            output_tokens: p.output_tokens,
            pair,
        }
    }

    fn request(&self) -> PlaceRequest<'_> {
        PlaceRequest {
            local_hashes: &self.local_hashes,
            num_tokens: self.num_tokens,
            request_id: Some(&self.id),
            overlap_weight: None,
            temperature: None,
            exclude: &self.exclude,
            adapter: self.adapter.as_deref(),
            session: self.session.as_deref(),
            output_tokens: self.output_tokens,
        }
    }

    /// Bytes it holds while waiting.
    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.id.len()
            + self.local_hashes.len() * std::mem::size_of::<LocalBlockHash>()
            + self.exclude.len() * std::mem::size_of::<WorkerWithDpRank>()
            + self.adapter.as_ref().map_or(0, String::len)
            + self.session.as_ref().map_or(0, String::len)
    }
}

/// Where an admitted request goes: `None` inside when there is no worker at all.
#[derive(Clone, Debug, PartialEq)]
pub enum Placed {
    One(Option<RouteDecision>),
    Pair(Option<PairDecision>),
}

/// A request flow control turned away, with when to try again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 429 (sheddable, or over a bound) or 503 (waited past its deadline).
    pub status: u16,
    pub retry_after_s: u64,
    pub message: String,
}

/// Each replica's last report of its waiting requests per priority, and when it came.
type PeerQueues = HashMap<String, (Instant, Vec<(i32, u32)>)>;

/// A waiting request: what to place, and where to send the outcome.
#[derive(Debug)]
pub struct Waiter {
    ask: Ask,
    tx: oneshot::Sender<Result<Placed, Refusal>>,
}

/// The queues, and what the replicas last said of theirs.
#[derive(Debug)]
pub struct Flow {
    queues: Mutex<FlowQueues<Waiter>>,
    next: AtomicU64,
    /// Each replica's waiting requests per priority, with when it said so.
    peers: Mutex<PeerQueues>,
}

impl Flow {
    pub(super) fn new(config: kvroute_core::schedule::flow::FlowConfig) -> Self {
        Self {
            queues: Mutex::new(FlowQueues::new(config)),
            next: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// Requests waiting here, and their bytes.
    pub fn waiting(&self) -> (usize, usize) {
        let q = lock(&self.queues);
        (q.len(), q.bytes())
    }

    /// Requests waiting here per priority, highest first (what replicas are told).
    pub fn bands(&self) -> Vec<(i32, usize)> {
        lock(&self.queues).bands()
    }

    /// Requests waiting here per priority and tenant.
    pub fn tenants(&self) -> Vec<(i32, std::sync::Arc<str>, usize)> {
        lock(&self.queues).tenants()
    }

    /// A replica's report of its waiting requests per priority.
    pub fn peer_report(&self, replica: &str, bands: Vec<(i32, u32)>) {
        lock(&self.peers).insert(replica.to_owned(), (Instant::now(), bands));
    }

    /// Requests the replicas (by their reports of the last second) have waiting above
    /// `priority`.
    pub fn peers_waiting_above(&self, priority: i32, now: Instant) -> usize {
        let mut peers = lock(&self.peers);
        peers.retain(|_, (at, _)| now.saturating_duration_since(*at) < PEER_REPORT_TTL);
        peers
            .values()
            .flat_map(|(_, bands)| bands.iter())
            .filter(|(p, _)| *p > priority)
            .map(|(_, n)| *n as usize)
            .sum()
    }
}

/// A queued request's hold on its place: dropped before its outcome came (the client went
/// away), it leaves the queue, or gives back the placement that was on its way.
struct Ticket<'a> {
    state: &'a RouterState,
    id: u64,
    /// The request's id at the router (what a placement is tracked as).
    request_id: String,
    rx: oneshot::Receiver<Result<Placed, Refusal>>,
    done: bool,
}

impl Ticket<'_> {
    async fn wait(mut self) -> Result<Placed, Refusal> {
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
        let flow = &self.state.flow;
        let left = lock(&flow.queues).remove(self.id);
        if let Some(q) = left {
            self.state.metrics.flow_metrics.record(
                &q.class,
                FlowOutcome::Abandoned,
                Some(q.enqueued.elapsed()),
            );
            gauges(self.state);
            return;
        }
        // Placed (or refused) as it went: a placement no one will use is freed.
        if let Ok(Ok(_)) = self.rx.try_recv() {
            self.state.finish(&self.request_id);
        }
    }
}

impl Refusal {
    /// The OpenAI-shaped answer: 429 or 503, with `Retry-After`.
    pub fn into_api_error(self) -> kvroute_http::ApiError {
        let status = axum::http::StatusCode::from_u16(self.status)
            .unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
        kvroute_http::ApiError::new(status, self.message).retry_after(self.retry_after_s)
    }
}

fn refusal(status: u16, retry_after_s: u64, message: impl Into<String>) -> Refusal {
    Refusal { status, retry_after_s: retry_after_s.max(1), message: message.into() }
}

/// Seconds until the fleet may take a request it cannot now, by the best it offers: the
/// predicted wait past the limit, at least 1.
fn retry_after(outlook: Option<Outlook>, gate: &Gate) -> u64 {
    let over = outlook.map_or(0.0, |o| (o.wait_ms - gate.max_wait_ms).max(0.0));
    (over / 1e3).ceil().clamp(1.0, 60.0) as u64
}

/// Places `ask` if `gate` lets a worker take it; the fleet's best offer when none can.
fn place_gated(state: &RouterState, ask: &Ask, gate: Option<&Gate>) -> Result<Placed, Outlook> {
    let request = ask.request();
    match ask.pair {
        true => super::placing::place_pair_gated(state, &request, gate).map(Placed::Pair),
        false => super::placing::place_gated(state, &request, gate)
            .map(|placed| Placed::One(placed.map(|(d, _)| d))),
    }
}

/// Sends a placement to its waiting client; the request's id when the client just left, for
/// the caller to free once it holds no lock of flow control (freeing lets requests go, which
/// takes the queues' lock).
#[must_use]
fn send(waiter: Waiter, outcome: Result<Placed, Refusal>) -> Option<String> {
    let id = waiter.ask.id.clone();
    match waiter.tx.send(outcome) {
        Err(Ok(_)) => Some(id),
        _ => None,
    }
}

/// What admission decided at once: placed, refused, or waiting on a ticket.
enum Now<'a> {
    Done(Result<Placed, Refusal>),
    Waiting(Ticket<'a>),
}

impl RouterState {
    /// Admits a request of `class` (see the module docs): placed now, placed once capacity
    /// frees, or refused. With flow control off, placed at once.
    pub async fn admit(&self, class: RequestClass, ask: Ask) -> Result<Placed, Refusal> {
        match admit_now(self, &class, ask) {
            Now::Done(outcome) => outcome,
            Now::Waiting(ticket) => ticket.wait().await,
        }
    }
}

/// [`RouterState::admit`] up to the wait, under the queues' lock.
fn admit_now<'a>(state: &'a RouterState, class: &RequestClass, ask: Ask) -> Now<'a> {
    let config = state.config.scheduler.flow;
    let now = Instant::now();
    if !config.enabled {
        // No gate: placed as without flow control, no prediction made to admit it.
        return Now::Done(Ok(place_gated(state, &ask, None).unwrap_or(Placed::One(None))));
    }
    let mut queues = lock(&state.flow.queues);
    // A tenant within its share waits behind no request of a tenant over it at its priority;
    // one over it takes a worker only within its part of the wait.
    let over = queues.over_share(&class.tenant, now);
    let gate = Gate::for_class(&config, class, Duration::ZERO).over_share(&config, over);
    let waiting = match over {
        true => queues.waiting_from(class.priority),
        false => queues.within_share_ahead(class.priority, now),
    };
    let ahead = waiting + state.flow.peers_waiting_above(class.priority, now);
    let mut outlook = None;
    if ahead == 0 {
        match place_gated(state, &ask, Some(&gate)) {
            Ok(placed) => {
                queues.sent(&class.tenant, ask.num_tokens as f64, now);
                drop(queues);
                state.metrics.flow_metrics.record(class, FlowOutcome::Admitted, None);
                return Now::Done(Ok(placed));
            }
            Err(best) => outlook = Some(best),
        }
    }
    if class.sheddable() && config.shed_at_once {
        drop(queues);
        state.metrics.flow_metrics.record(class, FlowOutcome::Shed, None);
        let message = "the fleet is saturated and this request is sheddable (priority below 0)";
        return Now::Done(Err(refusal(429, retry_after(outlook, &gate), message)));
    }
    let id = state.flow.next.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    let (bytes, cost) = (ask.bytes(), ask.num_tokens as f64);
    let deadline = config.deadline(class, now);
    let request_id = ask.id.clone();
    let waiter = Waiter { ask, tx };
    let pushed = queues.push(id, class.clone(), cost, bytes, now, deadline, waiter);
    drop(queues);
    if let Err((full, _)) = pushed {
        state.metrics.flow_metrics.record(class, FlowOutcome::Full, None);
        let message = match full {
            kvroute_core::schedule::flow::Full::Tenant => {
                "this tenant has too many requests waiting at this priority"
            }
            _ => "the router's queue is full",
        };
        return Now::Done(Err(refusal(429, retry_after(outlook, &gate), message)));
    }
    state.metrics.flow_metrics.record(class, FlowOutcome::Queued, None);
    gauges(state);
    Now::Waiting(Ticket { state, id, request_id, rx, done: false })
}

/// Lets waiting requests go while workers can take them, highest priority first and the
/// tenants of a priority in turn (a tenant over its share passed over while its part of the
/// wait is used up); refuses those past their deadline.
pub(crate) fn release(state: &RouterState) {
    let config = state.config.scheduler.flow;
    if !config.enabled {
        return;
    }
    let mut queues = lock(&state.flow.queues);
    if queues.is_empty() {
        return;
    }
    let now = Instant::now();
    let mut orphans = Vec::new();
    for q in queues.expired(now) {
        state.metrics.flow_metrics.record(&q.class, FlowOutcome::Expired, Some(now - q.enqueued));
        let status = if q.class.sheddable() { 429 } else { 503 };
        let message = "the request waited past its deadline for a worker to take it";
        q.item.tx.send(Err(refusal(status, 1, message))).ok();
    }
    let mut passed_over = Vec::new();
    while let Some(head) = queues.peek_except(&passed_over) {
        let id = head.id;
        if head.item.tx.is_closed() {
            if let Some(q) = queues.remove(id) {
                state.metrics.flow_metrics.record(
                    &q.class,
                    FlowOutcome::Abandoned,
                    Some(now - q.enqueued),
                );
            }
            continue;
        }
        if state.flow.peers_waiting_above(head.class.priority, now) > 0 {
            break;
        }
        let over = queues.over_share(&head.class.tenant, now);
        let gate =
            Gate::for_class(&config, &head.class, now - head.enqueued).over_share(&config, over);
        match place_gated(state, &head.item.ask, Some(&gate)) {
            Ok(placed) => {
                let Some(q) = queues.serve(id) else { break };
                queues.sent(&q.class.tenant, q.item.ask.num_tokens as f64, now);
                state.metrics.flow_metrics.record(
                    &q.class,
                    FlowOutcome::Released,
                    Some(now - q.enqueued),
                );
                orphans.extend(send(q.item, Ok(placed)));
            }
            Err(_) if over => passed_over.push(head.class.tenant.clone()),
            Err(_) => break,
        }
    }
    drop(queues);
    for id in orphans {
        state.finish(&id);
    }
    gauges(state);
}

/// What this replica last told its peers of its queues, and when.
#[derive(Debug)]
pub(crate) struct Reported {
    bands: Vec<(i32, u32)>,
    at: Instant,
}

impl Default for Reported {
    fn default() -> Self {
        Self { bands: Vec::new(), at: Instant::now() }
    }
}

/// Tells the replicas this one's waiting requests per priority: when they change, and every
/// 300 ms while any wait (a peer forgets a report after [`PEER_REPORT_TTL`]).
pub(crate) fn report(state: &RouterState, last: &mut Reported) {
    let Some(nats) = state.nats() else { return };
    let bands: Vec<(i32, u32)> = state
        .flow
        .bands()
        .into_iter()
        .map(|(p, n)| (p, u32::try_from(n).unwrap_or(u32::MAX)))
        .collect();
    let stale = !bands.is_empty() && last.at.elapsed() >= Duration::from_millis(300);
    if bands != last.bands || stale {
        nats.send(
            &state.metrics,
            kvroute_wire::replica::SyncMessage::Queues { bands: bands.clone() },
        );
        *last = Reported { bands, at: Instant::now() };
    }
}

/// The queue gauges, per priority and tenant.
fn gauges(state: &RouterState) {
    state.metrics.flow_metrics.waiting(&state.flow.tenants());
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvroute_core::schedule::flow::FlowConfig;

    use super::*;
    use crate::config::{RouterConfig, WorkerSpec};

    fn state(flow: FlowConfig) -> RouterState {
        let mut config = RouterConfig { workers: vec![WorkerSpec::new(1)], ..Default::default() };
        config.scheduler.flow = flow;
        RouterState::new(config)
    }

    fn ask(id: &str) -> Ask {
        Ask {
            id: id.to_owned(),
            local_hashes: vec![LocalBlockHash(7), LocalBlockHash(8)],
            num_tokens: 40,
            ..Ask::default()
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
        let placed = state.admit(class(0), ask("a")).await.unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
        // A peer holds requests of priority 5: a priority-0 request waits, a 5 does not
        // (replicas serve their own queue within a priority), nor a 6.
        state.flow().peer_report("peer", vec![(5, 2)]);
        let mut low = Box::pin(state.admit(class(0), ask("b")));
        assert!(tokio::time::timeout(PENDING, &mut low).await.is_err(), "held back");
        assert_eq!(state.flow().bands(), vec![(0, 1)]);
        for (p, id) in [(5, "c"), (6, "d")] {
            let placed = state.admit(class(p), ask(id)).await.unwrap();
            assert!(matches!(placed, Placed::One(Some(_))), "priority {p}");
        }
        // The peer's queue empties: the next release lets it go.
        state.flow().peer_report("peer", Vec::new());
        release(&state);
        let placed = tokio::time::timeout(PENDING, &mut low).await.unwrap().unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
        assert_eq!(state.flow().waiting(), (0, 0));
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
        let placed = state.admit(of("light"), ask("l1")).await.unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
        state.finish("l1");
        // Heavy's first prompt is 25 times light's: its next is over its share.
        let big = |id: &str| Ask { num_tokens: 1_000, ..ask(id) };
        let placed = state.admit(of("heavy"), big("h1")).await.unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
        let mut h4 = Box::pin(state.admit(of("heavy"), big("h4")));
        assert!(tokio::time::timeout(PENDING, &mut h4).await.is_err(), "over its share: waits");
        // The light tenant's request is not queued behind it, and a release passes it over.
        let placed = state.admit(of("light"), ask("l2")).await.unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
        let mut l3 = Box::pin(state.admit(of("light"), ask("l3")));
        let placed = tokio::time::timeout(PENDING, &mut l3).await.unwrap().unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
        release(&state);
        assert!(tokio::time::timeout(PENDING, &mut h4).await.is_err());
        // The worker idle again: its turn.
        for id in ["h1", "l2", "l3"] {
            state.finish(id);
        }
        release(&state);
        let placed = tokio::time::timeout(PENDING, &mut h4).await.unwrap().unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
    }

    #[tokio::test]
    async fn a_peer_report_counts_for_a_second_only() {
        let state = state(FlowConfig { enabled: true, ..FlowConfig::default() });
        state.flow().peer_report("peer", vec![(3, 1)]);
        let now = Instant::now();
        assert_eq!(state.flow().peers_waiting_above(0, now), 1);
        assert_eq!(state.flow().peers_waiting_above(3, now), 0);
        assert_eq!(state.flow().peers_waiting_above(0, now + PEER_REPORT_TTL), 0);
    }

    #[tokio::test]
    async fn with_flow_control_off_every_request_is_placed_at_once() {
        let state = state(FlowConfig { enabled: false, ..FlowConfig::default() });
        state.flow().peer_report("peer", vec![(100, 9)]);
        let placed = state.admit(class(-5), ask("a")).await.unwrap();
        assert!(matches!(placed, Placed::One(Some(_))));
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_queue_and_a_placement_on_its_way_is_freed() {
        let state = state(FlowConfig { enabled: true, ..FlowConfig::default() });
        state.flow().peer_report("peer", vec![(9, 1)]);
        let mut waiting = Box::pin(state.admit(class(0), ask("gone")));
        assert!(tokio::time::timeout(PENDING, &mut waiting).await.is_err());
        drop(waiting);
        assert_eq!(state.flow().waiting(), (0, 0));
        // Placed by a release, then dropped before it was read: freed, not left in flight.
        let mut waiting = Box::pin(state.admit(class(0), ask("late")));
        assert!(tokio::time::timeout(PENDING, &mut waiting).await.is_err());
        state.flow().peer_report("peer", Vec::new());
        release(&state);
        assert_eq!(state.placing().in_flight(), 1);
        drop(waiting);
        assert_eq!(state.placing().in_flight(), 0);
    }
}

//! Flow control: which request goes to an engine now, which waits at the router, which is
//! refused (docs/routing.md, "Overload").
//!
//! A request has a class ([`RequestClass`]): a priority (higher goes first; below 0 it is
//! *sheddable*, refused rather than kept waiting when the fleet is saturated), a tenant, and
//! an optional time-to-first-token objective. The router admits a request when some worker
//! can take it ([`Gate`]: the engine model predicts its wait there, before its own prefill
//! starts, within [`FlowConfig::max_engine_wait_ms`], or its whole first token within what is
//! left of its objective) and nothing of its priority or above waits before it. Otherwise it
//! waits here ([`FlowQueues`]): one band per priority, highest first; inside a band the
//! tenants take turns by start-time fair queueing over their prompt tokens, so a tenant that
//! sends ten times its share waits behind its own requests, not in front of the others'.
//! The queues are bounded in requests, per tenant, in bytes and in time.
//!
//! A tenant over its share ([`shares`]: it sent more than [`FlowConfig::over_share`] times
//! the mean of the tenants lately) takes a worker only while the predicted wait there is
//! within [`FlowConfig::over_share_wait`] of the limit: the headroom above is the others', so
//! a tenant within its share is neither queued behind it here nor far behind it in an engine.

pub mod shares;

use std::cmp::Reverse;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// The highest and lowest priority a request may name.
pub const MAX_PRIORITY: i32 = 100;
pub const MIN_PRIORITY: i32 = -100;

/// Who a request is and what it asks of its first token.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestClass {
    /// Higher goes first; below 0 the request may be refused when the fleet is saturated.
    pub priority: i32,
    /// Whose request it is (fairness is between tenants within a priority).
    pub tenant: Arc<str>,
    /// Time to first token it should meet, ms, counted from its arrival.
    pub ttft_slo_ms: Option<u32>,
}

impl Default for RequestClass {
    fn default() -> Self {
        Self { priority: 0, tenant: Arc::from("default"), ttft_slo_ms: None }
    }
}

impl RequestClass {
    /// Refused rather than queued when the fleet is saturated.
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// Flow control's settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowConfig {
    /// Whether the router holds requests when the fleet is saturated. Off, every request is
    /// placed at once. Off by default: on, the default bench's multi-turn schedule held 3% of
    /// its requests in its bursts, which changes its results.
    pub enabled: bool,
    /// A worker has room for a request without an objective while the engine model predicts
    /// its wait there (the prompts queued ahead, a step under way, memory to free) within this
    /// many milliseconds.
    pub max_engine_wait_ms: f64,
    /// Requests waiting at most, per priority.
    pub max_queued: usize,
    /// Requests one tenant may have waiting, per priority (past it: 429, over its share).
    pub max_queued_per_tenant: usize,
    /// Bytes the waiting requests may hold in all (their block hashes and keys).
    pub max_queued_bytes: usize,
    /// Longest a request waits before it is refused (503; 429 for a sheddable one), ms; a
    /// request with an objective waits at most until the objective has passed.
    pub max_wait_ms: u64,
    /// A sheddable request (priority below 0) is refused at once when no worker has room,
    /// instead of waiting.
    pub shed_at_once: bool,
    /// A tenant is over its share when its prompt tokens sent lately (half-life 10 s) are
    /// more than this many times the mean of the tenants sending; 0: no tenant ever is.
    pub over_share: f64,
    /// The share of `max_engine_wait_ms` within which a request of a tenant over its share
    /// may take a worker (the rest is kept for the tenants within theirs).
    pub over_share_wait: f64,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_engine_wait_ms: 100.0,
            max_queued: 4_096,
            max_queued_per_tenant: 1_024,
            max_queued_bytes: 64 << 20,
            max_wait_ms: 30_000,
            shed_at_once: true,
            over_share: 1.5,
            over_share_wait: 0.25,
        }
    }
}

impl FlowConfig {
    /// When a request of `class` that arrived at `arrived` is refused if still waiting.
    pub fn deadline(&self, class: &RequestClass, arrived: Instant) -> Instant {
        let max = Duration::from_millis(self.max_wait_ms);
        let slo = class.ttft_slo_ms.map_or(max, |ms| Duration::from_millis(u64::from(ms)));
        arrived + slo.min(max)
    }
}

/// What a worker must offer a request for it to be sent there now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gate {
    /// The predicted wait before its prefill starts, at most, ms.
    pub max_wait_ms: f64,
    /// Its predicted first token, at most, ms from now (what is left of its objective).
    pub max_ttft_ms: Option<f64>,
}

impl Gate {
    /// The gate for a request of `class` that has waited `waited` so far.
    pub fn for_class(config: &FlowConfig, class: &RequestClass, waited: Duration) -> Self {
        let left = class.ttft_slo_ms.map(|slo| f64::from(slo) - waited.as_secs_f64() * 1e3);
        Self { max_wait_ms: config.max_engine_wait_ms, max_ttft_ms: left }
    }

    /// This gate for a request of a tenant over its share when `over`: its wait within
    /// [`FlowConfig::over_share_wait`] of the limit.
    pub fn over_share(self, config: &FlowConfig, over: bool) -> Self {
        match over {
            true => Self { max_wait_ms: self.max_wait_ms * config.over_share_wait, ..self },
            false => self,
        }
    }

    /// Whether a worker whose predictions for the request are `wait_ms` before its prefill
    /// and `ttft_ms` to its first token may take it: its wait within the limit and, with an
    /// objective, its first token within what is left of it. The objective only narrows: a
    /// worker predicted just under it is as likely just over, so requests with objectives
    /// also wait at the router (highest priority first, tenants in turn) rather than in
    /// engines. An objective that the request's own prefill alone would miss cannot be met
    /// anywhere; the wait alone decides.
    pub fn admits(&self, wait_ms: f64, ttft_ms: f64) -> bool {
        let within = match self.max_ttft_ms {
            Some(left) if ttft_ms - wait_ms <= left => ttft_ms <= left,
            _ => true,
        };
        within && wait_ms <= self.max_wait_ms
    }
}

/// The best a fleet offers a request: the least predicted wait and first token over its
/// candidates, ms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outlook {
    pub wait_ms: f64,
    pub ttft_ms: f64,
}

/// Why a request could not join the queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// Its priority's queue holds [`FlowConfig::max_queued`].
    Queue,
    /// Its tenant has [`FlowConfig::max_queued_per_tenant`] waiting at its priority.
    Tenant,
    /// The queues hold [`FlowConfig::max_queued_bytes`].
    Bytes,
}

impl Full {
    pub fn reason(self) -> &'static str {
        match self {
            Self::Queue => "queue_full",
            Self::Tenant => "tenant_over_share",
            Self::Bytes => "queue_bytes_full",
        }
    }
}

/// A waiting request.
#[derive(Debug)]
pub struct Queued<T> {
    pub id: u64,
    pub class: RequestClass,
    pub enqueued: Instant,
    /// When it is refused if still waiting.
    pub deadline: Instant,
    pub bytes: usize,
    /// Its start tag in its band's fair queueing (virtual time).
    start: f64,
    pub item: T,
}

#[derive(Debug)]
struct TenantQueue<T> {
    waiting: VecDeque<Queued<T>>,
    /// The finish tag of its last request (virtual time).
    finish: f64,
}

#[derive(Debug)]
struct Band<T> {
    tenants: FxHashMap<Arc<str>, TenantQueue<T>>,
    /// The start tag of the last request to leave (virtual time).
    clock: f64,
    len: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Self { tenants: FxHashMap::default(), clock: 0.0, len: 0 }
    }
}

impl<T> Band<T> {
    /// The tenant whose first request has the least start tag (ties: the one waiting longest).
    fn next_tenant(&self) -> Option<&Arc<str>> {
        self.tenants
            .iter()
            .filter_map(|(t, q)| q.waiting.front().map(|f| (t, f.start, f.id)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)))
            .map(|(t, _, _)| t)
    }

    /// Forgets tenants with nothing waiting whose finish tag the clock passed (their next
    /// request starts at the clock anyway), so the map holds only tenants that matter.
    /// An empty band forgets its history (an idle link restarts its virtual time).
    fn tidy(&mut self, tenant: &Arc<str>) {
        if self.len == 0 {
            self.tenants.clear();
            self.clock = 0.0;
            return;
        }
        if let Some(q) = self.tenants.get(tenant)
            && q.waiting.is_empty()
            && q.finish <= self.clock
        {
            self.tenants.remove(tenant);
        }
        if self.tenants.len() > 2 * self.len + 16 {
            let clock = self.clock;
            self.tenants.retain(|_, q| !q.waiting.is_empty() || q.finish > clock);
        }
    }
}

/// The waiting requests: a band per priority, tenants fair inside each.
#[derive(Debug)]
pub struct FlowQueues<T> {
    config: FlowConfig,
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    /// Where each waiting request is: its priority and tenant.
    index: FxHashMap<u64, (i32, Arc<str>)>,
    bytes: usize,
    /// What each tenant sent to the engines lately.
    shares: shares::Shares,
}

impl<T> FlowQueues<T> {
    pub fn new(config: FlowConfig) -> Self {
        Self {
            config,
            bands: BTreeMap::new(),
            index: FxHashMap::default(),
            bytes: 0,
            shares: shares::Shares::default(),
        }
    }

    /// `tokens` of `tenant`'s prompts went to the engines (placed at once or released).
    pub fn sent(&mut self, tenant: &Arc<str>, tokens: f64, now: Instant) {
        self.shares.record(tenant, tokens, now);
    }

    /// Whether `tenant` is over its share ([`shares`]).
    pub fn over_share(&self, tenant: &str, now: Instant) -> bool {
        self.shares.over(tenant, self.config.over_share, now)
    }

    /// Requests a request of a tenant within its share at `priority` waits behind: every one
    /// above its priority, and those of tenants within their share at it.
    pub fn within_share_ahead(&self, priority: i32, now: Instant) -> usize {
        let above = self.waiting_from(priority.saturating_add(1));
        // The share's limit once, not once per tenant waiting (tenants are clients' names).
        let limit = self.shares.limit(self.config.over_share, now);
        let over = |t: &str| limit.is_some_and(|l| self.shares.used(t, now) > l);
        let level = self.bands.get(&Reverse(priority)).map_or(0, |b| {
            let within = b.tenants.iter().filter(|(t, _)| !over(t));
            within.map(|(_, q)| q.waiting.len()).sum()
        });
        above + level
    }

    pub fn config(&self) -> &FlowConfig {
        &self.config
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Requests waiting at priority `priority` or above.
    pub fn waiting_from(&self, priority: i32) -> usize {
        self.bands.range(..=Reverse(priority)).map(|(_, b)| b.len).sum()
    }

    /// Requests waiting per priority, highest first.
    pub fn bands(&self) -> Vec<(i32, usize)> {
        self.bands.iter().filter(|(_, b)| b.len > 0).map(|(p, b)| (p.0, b.len)).collect()
    }

    /// Requests waiting per priority and tenant.
    pub fn tenants(&self) -> Vec<(i32, Arc<str>, usize)> {
        let mut all = Vec::new();
        for (p, band) in &self.bands {
            for (t, q) in &band.tenants {
                if !q.waiting.is_empty() {
                    all.push((p.0, t.clone(), q.waiting.len()));
                }
            }
        }
        all
    }

    /// Queues a request costing `cost` (its prompt tokens) of fair share; refused when a
    /// bound would be passed.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        id: u64,
        class: RequestClass,
        cost: f64,
        bytes: usize,
        now: Instant,
        deadline: Instant,
        item: T,
    ) -> Result<(), (Full, T)> {
        if self.bytes + bytes > self.config.max_queued_bytes {
            return Err((Full::Bytes, item));
        }
        let band = self.bands.entry(Reverse(class.priority)).or_default();
        if band.len >= self.config.max_queued {
            return Err((Full::Queue, item));
        }
        let clock = band.clock;
        let tenant = band
            .tenants
            .entry(class.tenant.clone())
            .or_insert_with(|| TenantQueue { waiting: VecDeque::new(), finish: clock });
        if tenant.waiting.len() >= self.config.max_queued_per_tenant {
            return Err((Full::Tenant, item));
        }
        let start = tenant.finish.max(clock);
        tenant.finish = start + cost.max(1.0);
        self.index.insert(id, (class.priority, class.tenant.clone()));
        tenant.waiting.push_back(Queued { id, class, enqueued: now, deadline, bytes, start, item });
        band.len += 1;
        self.bytes += bytes;
        Ok(())
    }

    /// The request that leaves next: the highest priority's, the fair tenant's first.
    pub fn peek(&self) -> Option<&Queued<T>> {
        let band = self.bands.values().find(|b| b.len > 0)?;
        band.tenants.get(band.next_tenant()?)?.waiting.front()
    }

    /// The request that leaves next when the tenants in `skip` are passed over (their heads
    /// cannot go now): the fair tenant's first among the others of the highest priority
    /// waiting (none when they are all passed over: a lower priority does not go first).
    pub fn peek_except(&self, skip: &[Arc<str>]) -> Option<&Queued<T>> {
        let band = self.bands.values().find(|b| b.len > 0)?;
        band.tenants
            .iter()
            .filter(|(t, _)| !skip.contains(t))
            .filter_map(|(_, q)| q.waiting.front())
            .min_by(|a, b| a.start.total_cmp(&b.start).then(a.id.cmp(&b.id)))
    }

    /// Takes the request [`Self::peek`] shows.
    pub fn pop(&mut self) -> Option<Queued<T>> {
        let id = self.peek()?.id;
        self.take(id, true)
    }

    /// Takes out the request `id` as it leaves to be served, its turn taken (one that
    /// [`Self::peek_except`] showed).
    pub fn serve(&mut self, id: u64) -> Option<Queued<T>> {
        self.take(id, true)
    }

    /// Takes a waiting request out (its client went away).
    pub fn remove(&mut self, id: u64) -> Option<Queued<T>> {
        self.take(id, false)
    }

    /// Takes the request `id` out; `served`: its band's virtual time moves to its start.
    fn take(&mut self, id: u64, served: bool) -> Option<Queued<T>> {
        let (priority, tenant) = self.index.remove(&id)?;
        let band = self.bands.get_mut(&Reverse(priority))?;
        let waiting = &mut band.tenants.get_mut(&tenant)?.waiting;
        let at = waiting.iter().position(|q| q.id == id)?;
        let q = waiting.remove(at)?;
        if served {
            band.clock = band.clock.max(q.start);
        }
        band.len -= 1;
        band.tidy(&tenant);
        self.bytes -= q.bytes;
        self.bands.retain(|_, b| b.len > 0);
        Some(q)
    }

    /// Takes out every request whose deadline is `now` or past.
    pub fn expired(&mut self, now: Instant) -> Vec<Queued<T>> {
        let due: Vec<u64> = self
            .bands
            .values()
            .flat_map(|b| b.tenants.values())
            .flat_map(|t| t.waiting.iter())
            .filter(|q| q.deadline <= now)
            .map(|q| q.id)
            .collect();
        due.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Tenants remembered in all (waiting, or owed their turn): bounded by what waits.
    pub fn tenants_remembered(&self) -> usize {
        self.bands.values().map(|b| b.tenants.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(priority: i32, tenant: &str) -> RequestClass {
        RequestClass { priority, tenant: Arc::from(tenant), ttft_slo_ms: None }
    }

    fn push(q: &mut FlowQueues<()>, id: u64, priority: i32, tenant: &str, cost: f64) {
        let now = Instant::now();
        q.push(id, class(priority, tenant), cost, 10, now, now + Duration::from_secs(1), ())
            .unwrap();
    }

    fn drain(q: &mut FlowQueues<()>) -> Vec<u64> {
        std::iter::from_fn(|| q.pop().map(|r| r.id)).collect()
    }

    #[test]
    fn higher_priorities_leave_first_and_each_band_in_order() {
        let mut q = FlowQueues::new(FlowConfig::default());
        push(&mut q, 1, 0, "a", 10.0);
        push(&mut q, 2, -1, "a", 10.0);
        push(&mut q, 3, 10, "a", 10.0);
        push(&mut q, 4, 0, "a", 10.0);
        assert_eq!(q.waiting_from(0), 3);
        assert_eq!(q.waiting_from(11), 0);
        assert_eq!(q.bands(), vec![(10, 1), (0, 2), (-1, 1)]);
        assert_eq!(drain(&mut q), vec![3, 1, 4, 2]);
        assert!(q.is_empty() && q.bytes() == 0 && q.tenants_remembered() == 0);
    }

    #[test]
    fn a_tenant_sending_ten_times_its_share_waits_behind_its_own() {
        let mut q = FlowQueues::new(FlowConfig::default());
        let mut id = 0;
        for _ in 0..20 {
            id += 1;
            push(&mut q, id, 0, "heavy", 100.0);
        }
        for t in ["b", "c"] {
            for _ in 0..2 {
                id += 1;
                push(&mut q, id, 0, t, 100.0);
            }
        }
        let order = drain(&mut q);
        // b's and c's four requests leave within the first six, not after heavy's twenty.
        let light: Vec<usize> =
            order.iter().enumerate().filter(|(_, id)| **id > 20).map(|(i, _)| i).collect();
        assert_eq!(light.len(), 4);
        assert!(light.iter().all(|&i| i < 6), "{order:?}");
    }

    #[test]
    fn a_tenant_over_its_share_is_passed_over_and_not_counted_ahead() {
        let mut q = FlowQueues::new(FlowConfig::default());
        let now = Instant::now();
        q.sent(&Arc::from("heavy"), 10_000.0, now);
        for t in ["a", "b", "c"] {
            q.sent(&Arc::from(t), 1_000.0, now);
        }
        assert!(q.over_share("heavy", now) && !q.over_share("a", now));
        push(&mut q, 1, 0, "heavy", 100.0);
        push(&mut q, 2, 0, "a", 100.0);
        push(&mut q, 3, 0, "heavy", 100.0);
        push(&mut q, 4, -1, "b", 100.0);
        assert_eq!(q.waiting_from(0), 3);
        // Of its priority, a request within its share waits behind a's alone; one above
        // waits behind nobody, one below behind all three.
        assert_eq!(q.within_share_ahead(0, now), 1);
        assert_eq!(q.within_share_ahead(1, now), 0);
        assert_eq!(q.within_share_ahead(-1, now), 4);
        // Heavy passed over: a's request, though after heavy's first.
        let skip = [Arc::<str>::from("heavy")];
        assert_eq!(q.peek_except(&skip).map(|r| r.id), Some(2));
        assert_eq!(q.serve(2).map(|r| r.id), Some(2));
        // Only heavy's left at priority 0: b's lower one does not go first.
        assert!(q.peek_except(&skip).is_none());
        assert_eq!(q.peek_except(&[]).map(|r| r.id), Some(1));
        assert_eq!(drain(&mut q), vec![1, 3, 4]);
    }

    #[test]
    fn fairness_is_by_tokens_not_requests() {
        let mut q = FlowQueues::new(FlowConfig::default());
        // "long" asks for 1,000 tokens a request, "short" for 100: short gets ~10 turns each.
        for i in 0..5 {
            push(&mut q, i, 0, "long", 1_000.0);
        }
        for i in 100..130 {
            push(&mut q, i, 0, "short", 100.0);
        }
        let order = drain(&mut q);
        let second_long = order.iter().position(|&id| id == 1).unwrap();
        let shorts_before = order[..second_long].iter().filter(|&&id| id >= 100).count();
        assert!((9..=11).contains(&shorts_before), "{order:?}");
    }

    #[test]
    fn bounds_refuse_and_removal_frees() {
        let config = FlowConfig { max_queued: 3, max_queued_per_tenant: 2, ..Default::default() };
        let mut q = FlowQueues::new(config);
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        push(&mut q, 1, 0, "a", 1.0);
        push(&mut q, 2, 0, "a", 1.0);
        let refused = q.push(3, class(0, "a"), 1.0, 10, now, later, ());
        assert_eq!(refused.unwrap_err().0, Full::Tenant);
        push(&mut q, 3, 0, "b", 1.0);
        let refused = q.push(4, class(0, "c"), 1.0, 10, now, later, ());
        assert_eq!(refused.unwrap_err().0, Full::Queue);
        // Another priority has a queue of its own.
        push(&mut q, 4, 1, "c", 1.0);
        let big = q.push(5, class(2, "d"), 1.0, 64 << 20, now, later, ());
        assert_eq!(big.unwrap_err().0, Full::Bytes);
        assert_eq!(q.remove(2).map(|r| r.id), Some(2));
        assert_eq!(q.remove(2).map(|r| r.id), None);
        assert_eq!(drain(&mut q), vec![4, 1, 3]);
        assert_eq!(q.bytes(), 0);
    }

    #[test]
    fn deadlines_take_requests_out() {
        let mut q = FlowQueues::new(FlowConfig::default());
        let now = Instant::now();
        let soon = now + Duration::from_millis(10);
        q.push(1, class(0, "a"), 1.0, 1, now, soon, ()).unwrap();
        q.push(2, class(0, "a"), 1.0, 1, now, now + Duration::from_secs(9), ()).unwrap();
        assert!(q.expired(now).is_empty());
        let gone: Vec<u64> = q.expired(soon).into_iter().map(|r| r.id).collect();
        assert_eq!(gone, vec![1]);
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn the_gate_takes_the_objective_when_it_can_be_met() {
        let config = FlowConfig { max_engine_wait_ms: 100.0, ..Default::default() };
        let slo = RequestClass { ttft_slo_ms: Some(250), ..Default::default() };
        let gate = Gate::for_class(&config, &slo, Duration::from_millis(50));
        assert_eq!(gate.max_ttft_ms, Some(200.0));
        // Within the wait limit and what is left of the objective.
        assert!(gate.admits(90.0, 120.0));
        // Within what is left, but past the wait limit; within the limit, but past what is
        // left.
        assert!(!gate.admits(150.0, 180.0));
        assert!(!gate.admits(95.0, 210.0));
        // Its own prefill alone misses: the wait limit decides.
        assert!(gate.admits(50.0, 350.0));
        assert!(!gate.admits(120.0, 420.0));
        let plain = Gate::for_class(&config, &RequestClass::default(), Duration::ZERO);
        assert!(plain.admits(100.0, 5_000.0) && !plain.admits(101.0, 120.0));
    }
}

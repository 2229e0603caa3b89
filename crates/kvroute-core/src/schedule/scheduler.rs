//! [`Scheduler`]: the candidates with their loads, the policy, the requests in flight and
//! what is learned of each worker; a request routed, tracked, freed.

use super::reuse;
use crate::schedule::config::SchedulerConfig;
use crate::schedule::policy::Policy;
use crate::schedule::policy::pick_near;
use crate::schedule::registry::PolicyKind;
use crate::schedule::types::AffinityCounts;
use crate::schedule::types::Candidate;
use crate::schedule::types::DecisionRecord;
use crate::schedule::types::RECENT_DECISIONS;
use crate::schedule::types::RECORDED_CANDIDATES;
use crate::schedule::types::RequestInfo;
use crate::schedule::types::Rng;
use crate::schedule::types::RouteDecision;
use crate::schedule::types::RouteRequest;
use crate::schedule::types::TreeSizes;
use crate::schedule::types::WorkerLoad;
use crate::schedule::types::reusable_tokens;
use std::time::Instant;

use super::active::{ActiveSequences, Predicted, RequestBlocks};
use super::adapters::{AdapterFit, AdapterTable};
use super::pairs::Role;
use super::sessions::Sessions;
use super::types::ScoredCandidate;
use super::{flow, kv, pairs, predict};

use crate::index::OverlapScores;
use crate::protocols::{LocalBlockHash, WorkerWithDpRank};

#[derive(Debug)]
pub struct Scheduler {
    pub(super) config: SchedulerConfig,
    pub(super) policy: Box<dyn Policy>,
    /// Candidates, sorted by worker, with what they report and what was learned of them.
    pub(super) workers: Vec<WorkerEntry>,
    pub(super) ids: Vec<WorkerWithDpRank>,
    pub(super) active: ActiveSequences,
    pub(super) rng: Rng,
    pub(super) recent: std::collections::VecDeque<DecisionRecord>,
    pub(super) adapters: AdapterTable,
    pub(super) sessions: Sessions,
    pub(super) affinity: AffinityCounts,
    /// Prompt tokens prefilled on the chosen worker that another candidate held, summed over
    /// the decisions of tracked requests ([`Self::avoidable_prefill_tokens`]).
    avoidable_tokens: u64,
    /// The candidates' buffer, kept between decisions (a thousand candidates are ~140 KB:
    /// allocated per decision, that was a fresh mapping and its page faults each time).
    pub(super) scratch: Vec<Candidate>,
    /// The decode pool's own instance of a baseline policy (a round-robin's turn is per
    /// pool), and what the pair choice did.
    pub(super) decode_policy: Box<dyn Policy>,
    pub(super) pair_counts: pairs::PairCounts,
    /// Predicts each tracked request's first token, whatever the policy, and learns from it.
    pub(super) predictor: kv::Predictor,
    pub(super) corrections: predict::Corrections,
    pub(super) reuse: reuse::Reuse,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct WorkerEntry {
    pub(super) worker: WorkerWithDpRank,
    pub(super) load: WorkerLoad,
    /// Not ready (e.g. its event stream is down): chosen only when no ready worker is left.
    pub(super) ready: bool,
    pub(super) role: Role,
    pub(super) node: u32,
    /// Leaving the fleet, or refused (its engine cannot be read): never a candidate, whatever
    /// else is (its requests finish).
    pub(super) draining: bool,
}

/// Looks workers up, in increasing order, in a list sorted by worker: one pass for all of them
/// instead of a search each.
pub(super) fn cursor<T: Copy>(
    list: &[(WorkerWithDpRank, T)],
) -> impl FnMut(WorkerWithDpRank) -> Option<T> + '_ {
    let mut i = 0;
    move |w| {
        while i < list.len() && list[i].0 < w {
            i += 1;
        }
        (i < list.len() && list[i].0 == w).then(|| list[i].1)
    }
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            policy: config.policy.build(config.kv, config.predictor.engine),
            config,
            workers: Vec::new(),
            ids: Vec::new(),
            active: ActiveSequences::new(),
            rng: Rng::new(config.seed),
            recent: std::collections::VecDeque::with_capacity(RECENT_DECISIONS),
            adapters: AdapterTable::default(),
            sessions: Sessions::new(config.sessions),
            affinity: AffinityCounts::default(),
            avoidable_tokens: 0,
            scratch: Vec::new(),
            decode_policy: config.policy.build(config.kv, config.predictor.engine),
            pair_counts: pairs::PairCounts::default(),
            predictor: kv::Predictor::new(config.kv, config.predictor.engine),
            corrections: predict::Corrections::new(
                config.predictor.correction,
                config.predictor.shape,
            ),
            reuse: reuse::Reuse::new(reuse::ReuseConfig::of(&config.kv)),
        }
    }

    /// Which adapters each worker serves and holds.
    pub fn adapters(&self) -> &AdapterTable {
        &self.adapters
    }

    pub fn adapters_mut(&mut self) -> &mut AdapterTable {
        &mut self.adapters
    }

    /// Prompt tokens prefilled so far on a chosen worker that another candidate held in its
    /// cache (a choice for load or eviction's sake, or a worse one): what the cost traded.
    pub fn avoidable_prefill_tokens(&self) -> u64 {
        self.avoidable_tokens
    }

    /// What session affinity did so far, and how many sessions are remembered.
    pub fn affinity(&self) -> (AffinityCounts, usize) {
        (self.affinity, self.sessions.len())
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Makes a cache a candidate.
    pub fn add_worker(&mut self, worker: WorkerWithDpRank) {
        if let Err(at) = self.ids.binary_search(&worker) {
            self.ids.insert(at, worker);
            let entry = WorkerEntry {
                worker,
                load: WorkerLoad::default(),
                ready: true,
                role: Role::Both,
                node: 0,
                draining: false,
            };
            self.workers.insert(at, entry);
        }
    }

    pub fn remove_worker(&mut self, worker: WorkerWithDpRank) {
        if let Ok(at) = self.ids.binary_search(&worker) {
            self.ids.remove(at);
            self.workers.remove(at);
        }
        self.active.remove_worker(worker);
        self.corrections.forget(worker);
        self.reuse.forget(worker);
        self.adapters.remove_worker(worker);
        self.sessions.remove_worker(worker);
    }

    pub fn workers(&self) -> &[WorkerWithDpRank] {
        &self.ids
    }

    pub(super) fn entry(&mut self, worker: WorkerWithDpRank) -> Option<&mut WorkerEntry> {
        self.ids.binary_search(&worker).ok().map(|at| &mut self.workers[at])
    }

    /// Records a worker's load report (ignored for a worker that is not a candidate).
    pub fn update_load(&mut self, worker: WorkerWithDpRank, load: WorkerLoad) {
        if let Some(entry) = self.entry(worker) {
            entry.load = load;
        }
    }

    /// Sets a worker's role and node (workers are aggregated, on node 0, when added).
    pub fn set_role(&mut self, worker: WorkerWithDpRank, role: Role, node: u32) {
        if let Some(entry) = self.entry(worker) {
            (entry.role, entry.node) = (role, node);
        }
    }

    /// Whether some worker prefills for others (the fleet is disaggregated).
    pub fn disaggregated(&self) -> bool {
        self.workers.iter().any(|e| e.role == Role::Prefill)
    }

    /// Marks a cache ready or not; a cache that is not ready is chosen only when no ready one
    /// is left (workers are ready when added).
    pub fn set_ready(&mut self, worker: WorkerWithDpRank, ready: bool) {
        if let Some(entry) = self.entry(worker) {
            entry.ready = ready;
        }
    }

    /// Marks a cache as leaving the fleet: no decision chooses it again (not even when no
    /// other is ready); what it runs is still tracked until it ends.
    pub fn set_draining(&mut self, worker: WorkerWithDpRank) {
        if let Some(entry) = self.entry(worker) {
            entry.draining = true;
        }
    }

    /// Marks a cache as refused (its engine's blocks are not the router's size): no decision
    /// chooses it, as if it were leaving.
    pub fn set_refused(&mut self, worker: WorkerWithDpRank) {
        self.set_draining(worker);
    }

    pub fn active(&self) -> &ActiveSequences {
        &self.active
    }

    /// Chooses a worker for `request` given the KV index's `scores` and cache sizes; `None`
    /// when there are no workers. With an id, the request is tracked as in flight from now on.
    pub fn route(
        &mut self,
        request: &RouteRequest<'_>,
        scores: &OverlapScores,
        sizes: &dyn TreeSizes,
        now: Instant,
    ) -> Option<RouteDecision> {
        self.route_gated(request, scores, sizes, now, None).unwrap_or(None)
    }

    /// [`Self::route`] through flow control's `gate` ([`flow`]): only workers that can take
    /// the request now are candidates; when none can, nothing is placed and the error is the
    /// best the fleet offers it (the least predicted wait and first token).
    pub fn route_gated(
        &mut self,
        request: &RouteRequest<'_>,
        scores: &OverlapScores,
        sizes: &dyn TreeSizes,
        now: Instant,
        gate: Option<&flow::Gate>,
    ) -> Result<Option<RouteDecision>, flow::Outlook> {
        let mut candidates = std::mem::take(&mut self.scratch);
        self.fill_candidates(&mut candidates, request.local_hashes, scores, sizes);
        // An aggregated request goes to a prefill engine only when nothing else is left.
        if candidates.iter().any(|c| c.role != Role::Prefill) {
            candidates.retain(|c| c.role != Role::Prefill);
        }
        if self.config.refuse_when_busy && candidates.iter().all(|c| self.is_busy(c, true)) {
            candidates.clear();
        }
        let decision = self.route_among(request, &mut candidates, now, gate);
        self.scratch = candidates;
        decision
    }

    /// The best the fleet offers `request` now: the least predicted wait before its prefill
    /// and first token over its candidates (of any role), ms; `None` without candidates.
    pub fn outlook(
        &mut self,
        request: &RouteRequest<'_>,
        scores: &OverlapScores,
        sizes: &dyn TreeSizes,
        now: Instant,
    ) -> Option<flow::Outlook> {
        let mut candidates = std::mem::take(&mut self.scratch);
        self.fill_candidates(&mut candidates, request.local_hashes, scores, sizes);
        self.prepare(request, &mut candidates, now, true);
        let info = self.info(request);
        let best = candidates.iter().map(|c| self.predictor.wait_and_ttft_ms(&info, c)).fold(
            None,
            |best: Option<flow::Outlook>, (wait_ms, ttft_ms)| {
                Some(best.map_or(flow::Outlook { wait_ms, ttft_ms }, |b| flow::Outlook {
                    wait_ms: b.wait_ms.min(wait_ms),
                    ttft_ms: b.ttft_ms.min(ttft_ms),
                }))
            },
        );
        self.scratch = candidates;
        best
    }

    /// Drops the candidates `request` excludes or whose adapter they do not serve, and fills
    /// in what running its adapter takes and (`learned`) what each worker's first tokens
    /// taught.
    pub(super) fn prepare(
        &self,
        request: &RouteRequest<'_>,
        candidates: &mut Vec<Candidate>,
        now: Instant,
        learned: bool,
    ) {
        let adapters = &self.adapters;
        if !request.exclude.is_empty() || request.adapter.is_some() {
            candidates.retain(|c| {
                !request.exclude.contains(&c.worker) && adapters.serves(c.worker, request.adapter)
            });
        }
        if request.adapter.is_some() {
            for c in candidates.iter_mut() {
                c.adapter = adapters.fit(c.worker, request.adapter);
            }
        }
        if learned {
            let corrected = !self.corrections.is_empty();
            let info = self.info(request);
            for c in candidates.iter_mut() {
                if corrected {
                    let x = || self.predictor.features(&info, c);
                    c.ttft_factor = self.corrections.factor_at(c.worker, x, now);
                    c.unproven = self.corrections.unproven(c.worker);
                }
                c.reuse = self.reuse.factor(c.worker);
            }
        }
    }

    /// [`Self::route_gated`] over its candidates.
    pub(super) fn route_among(
        &mut self,
        request: &RouteRequest<'_>,
        candidates: &mut Vec<Candidate>,
        now: Instant,
        gate: Option<&flow::Gate>,
    ) -> Result<Option<RouteDecision>, flow::Outlook> {
        self.prepare(request, candidates, now, self.policy.learns_ttft() || gate.is_some());
        if let Some(gate) = gate
            && !candidates.is_empty()
        {
            let info = self.info(request);
            let mut best = flow::Outlook { wait_ms: f64::INFINITY, ttft_ms: f64::INFINITY };
            candidates.retain(|c| {
                let (wait_ms, ttft_ms) = self.predictor.wait_and_ttft_ms(&info, c);
                best.wait_ms = best.wait_ms.min(wait_ms);
                best.ttft_ms = best.ttft_ms.min(ttft_ms);
                gate.admits(wait_ms, ttft_ms)
            });
            if candidates.is_empty() {
                return Err(best);
            }
        }
        Ok(self.route_chosen(request, candidates, now))
    }

    /// [`Self::route_among`] once the candidates are known.
    pub(super) fn route_chosen(
        &mut self,
        request: &RouteRequest<'_>,
        candidates: &[Candidate],
        now: Instant,
    ) -> Option<RouteDecision> {
        let (mut chosen, costs) = self.select(request, candidates)?;
        if let Some(session) = request.session {
            chosen = self.affine(session, candidates, chosen, costs.as_deref(), now);
        }
        let c = candidates[chosen];
        let bs = self.config.block_size.tokens();
        let lower: u32 = c.tier_blocks.iter().sum();
        let served = (c.overlap_blocks + lower).max(c.inflight_prefix_blocks);
        let cached = reusable_tokens(served, request.isl_tokens, bs);
        let decision = RouteDecision {
            worker: c.worker,
            overlap_blocks: c.overlap_blocks,
            tier_blocks: c.tier_blocks,
            predicted_prefill_tokens: request.isl_tokens - cached,
        };
        if let Some(id) = request.id {
            let blocks =
                RequestBlocks { local: request.local_hashes, sequence: request.sequence_hashes };
            self.active.add(id, c.worker, decision.predicted_prefill_tokens, blocks, now);
            self.active.hold_private(id, request.isl_tokens, request.output_tokens, bs);
            self.predict(id, request, &c, now);
            let stored = decision.predicted_prefill_tokens + request.output_tokens;
            self.reuse.routed(c.worker, cached, stored, now);
            let info = self.info(request);
            self.remember(id, &info, candidates, chosen, costs.as_deref());
            self.avoidable_tokens += avoidable(candidates, chosen, request.isl_tokens, bs);
            if let Some(adapter) = request.adapter {
                self.adapters.routed(id, c.worker, adapter);
            }
            if let Some(session) = request.session {
                self.sessions.record(session, c.worker, now);
            }
        }
        Some(decision)
    }

    /// Records what the engine model predicts of tracked request `id`'s first token on `c`.
    pub(super) fn predict(
        &mut self,
        id: &str,
        request: &RouteRequest<'_>,
        c: &Candidate,
        now: Instant,
    ) {
        let features = self.predictor.features(&self.info(request), c);
        let (corrected_ms, predicted_ms) = self.corrections.predict(c.worker, &features, now);
        let model_ms = features.model_ms();
        self.active
            .set_prediction(id, Predicted { model_ms, corrected_ms, predicted_ms, features });
    }

    /// Each worker's first-token predictions as they turned out.
    pub fn prediction_stats(&self, now: Instant) -> Vec<predict::PredictionStats> {
        self.corrections.stats(now)
    }

    /// A session's request stays on the session's worker (a candidate still) unless the
    /// policy's choice is cheaper by the margin (never, for `sticky`); counted.
    pub(super) fn affine(
        &mut self,
        session: &str,
        candidates: &[Candidate],
        chosen: usize,
        costs: Option<&[f64]>,
        now: Instant,
    ) -> usize {
        let last = self.sessions.worker(session, now);
        let Some(at) = last.and_then(|w| candidates.iter().position(|c| c.worker == w)) else {
            self.affinity.new += 1;
            return chosen;
        };
        let margin = match self.config.policy {
            PolicyKind::Sticky => f64::INFINITY,
            _ => self.config.sessions.margin_s,
        };
        match costs {
            Some(c) if c[chosen] + margin < c[at] => {
                self.affinity.moved += 1;
                chosen
            }
            _ => {
                self.affinity.kept += 1;
                at
            }
        }
    }

    /// Keeps the decision among the last [`RECENT_DECISIONS`]: the chosen candidate and the
    /// cheapest others, up to [`RECORDED_CANDIDATES`] in all (linear in the candidates).
    pub(super) fn remember(
        &mut self,
        request: &str,
        info: &RequestInfo,
        candidates: &[Candidate],
        chosen: usize,
        costs: Option<&[f64]>,
    ) {
        let cost = |i: usize| costs.map(|c| c[i]);
        let mut order: Vec<usize> = (0..candidates.len()).filter(|&i| i != chosen).collect();
        let key =
            |i: &usize| (cost(*i).unwrap_or(0.0), std::cmp::Reverse(candidates[*i].overlap_blocks));
        let keep = RECORDED_CANDIDATES - 1;
        if order.len() > keep {
            order.select_nth_unstable_by(keep, |a, b| {
                key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal)
            });
            order.truncate(keep);
        }
        order.sort_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal));
        let recorded: Vec<usize> = std::iter::once(chosen).chain(order.iter().copied()).collect();
        let terms = self.policy.cost_terms(info, candidates, &recorded);
        let terms_of = |k: usize| terms.as_ref().and_then(|t| t.get(k).copied());
        let scored = |(k, i): (usize, usize)| {
            let c = &candidates[i];
            ScoredCandidate {
                worker: c.worker,
                overlap_blocks: c.overlap_blocks,
                inflight_prefix_blocks: c.inflight_prefix_blocks,
                running: c.active.requests,
                cost: cost(i),
                terms: terms_of(k),
            }
        };
        let record = DecisionRecord {
            request: request.to_owned(),
            at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            isl_tokens: info.isl_tokens,
            considered: candidates.len(),
            candidates: recorded.iter().copied().enumerate().map(scored).collect(),
            cost_unit: costs.and(self.policy.cost_unit()),
        };
        if self.recent.len() == RECENT_DECISIONS {
            self.recent.pop_front();
        }
        self.recent.push_back(record);
    }

    /// The recent decision of request `id`, if it is still among the last
    /// [`RECENT_DECISIONS`].
    pub fn decision_of(&self, id: &str) -> Option<DecisionRecord> {
        self.recent.iter().rev().find(|r| r.request == id).cloned()
    }

    /// The last [`RECENT_DECISIONS`] decisions of tracked requests, oldest first.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        self.recent.iter().cloned().collect()
    }

    /// The candidates for a request: ready ones (all, if none is), of which busy ones are
    /// dropped (unless all are busy, or the policy is blind to load).
    pub fn candidates(
        &self,
        local: &[LocalBlockHash],
        scores: &OverlapScores,
        sizes: &dyn TreeSizes,
    ) -> Vec<Candidate> {
        let mut all = Vec::new();
        self.fill_candidates(&mut all, local, scores, sizes);
        all
    }

    /// [`Self::candidates`] into a buffer (cleared first).
    pub(super) fn fill_candidates(
        &self,
        all: &mut Vec<Candidate>,
        local: &[LocalBlockHash],
        scores: &OverlapScores,
        sizes: &dyn TreeSizes,
    ) {
        let inflight = match self.active.is_empty() {
            true => OverlapScores::default(),
            false => self.active.inflight_prefix(local),
        };
        let (mut overlap, mut inflight_prefix) = (cursor(&scores.scores), cursor(&inflight.scores));
        let mut tree_size = cursor(&scores.tree_sizes);
        let listed = sizes.all_sorted();
        let mut listed_size = cursor(listed.as_deref().unwrap_or_default());
        let any_ready = self.workers.iter().any(|e| e.ready && !e.draining);
        all.clear();
        let tiers = scores.tiers.as_deref();
        let candidate = |e: &&WorkerEntry| !e.draining && (e.ready || !any_ready);
        all.extend(self.workers.iter().filter(candidate).map(|e| {
            let overlap_blocks = overlap(e.worker).unwrap_or(0);
            Candidate {
                worker: e.worker,
                overlap_blocks,
                tier_blocks: tiers.map_or([0; 3], |t| t.run(e.worker, overlap_blocks)),
                inflight_prefix_blocks: inflight_prefix(e.worker).unwrap_or(0),
                tree_size: tree_size(e.worker).unwrap_or_else(|| match &listed {
                    Some(_) => listed_size(e.worker).unwrap_or(0),
                    None => sizes.tree_size(e.worker),
                }),
                active: self.active.load(e.worker),
                load: e.load,
                adapter: AdapterFit::Resident,
                role: e.role,
                node: e.node,
                ttft_factor: 0.0,
                reuse: 0.0,
                unproven: 0.0,
            }
        }));
        let memory = self.policy.weighs_memory();
        let busy = |c: &Candidate| self.is_busy(c, !memory);
        if !self.policy.blind() && all.iter().any(busy) && !all.iter().all(busy) {
            all.retain(|c| !busy(c));
        }
    }

    /// Over a busy threshold: queued prefill tokens, or (`by_kv`) the KV usage the worker
    /// reports.
    pub(super) fn is_busy(&self, c: &Candidate, by_kv: bool) -> bool {
        let kv_busy = by_kv
            && matches!((self.config.busy_kv_usage, c.load.kv_cache_usage), (Some(max), Some(u)) if u > max);
        let prefill_busy =
            self.config.busy_prefill_tokens.is_some_and(|max| c.active.prefill_tokens > max);
        kv_busy || prefill_busy
    }

    /// Runs the policy over prepared candidates; the index of the chosen one, with every
    /// candidate's cost when the policy prices them.
    pub fn select(
        &mut self,
        request: &RouteRequest<'_>,
        candidates: &[Candidate],
    ) -> Option<(usize, Option<Vec<f64>>)> {
        if candidates.is_empty() {
            return None;
        }
        let info = self.info(request);
        let (chosen, costs) = match self.policy.costs(&info, candidates) {
            Some(costs) => {
                let known = candidates.iter().map(|c| c.unproven).fold(1.0, f64::min);
                let cheapest = (0..costs.len()).min_by(|&a, &b| costs[a].total_cmp(&costs[b]));
                let held = cheapest.map_or(0, |i| {
                    candidates[i].overlap_blocks.max(candidates[i].inflight_prefix_blocks)
                });
                let near = self.near_tie(known, held);
                let chosen = pick_near(&costs, candidates, info.temperature, &near, &mut self.rng);
                (chosen, Some(costs))
            }
            None => (self.policy.select(&info, candidates, &mut self.rng), None),
        };
        Some((chosen.min(candidates.len() - 1), costs))
    }

    /// How close a candidate's cost may be to the lowest and count as equal, a share of the
    /// lowest: for a cost in predicted milliseconds, the prediction's own error there. For a
    /// candidate holding as much of the prompt as the cheapest (`held`), the fleet's recent
    /// error (at most the `near_tie` weight): a near-tie spreads load, never a cached prefix.
    /// For a worker whose price is still more the fleet's than the best known candidate's
    /// (`least_unproven`), that excess share of the most a worker may differ from the fleet
    /// (`max_spread`: a newcomer's first tokens may well show it twice as fast or slow as the
    /// workers the router knows, and it is tried even at a prefix's copy; a fleet that starts
    /// knows none of its workers better than another). 0 (exact ties only) for the others.
    fn near_tie(&self, least_unproven: f64, held: u32) -> impl Fn(&Candidate) -> f64 + use<> {
        let learns = self.policy.learns_ttft();
        let fleet = self.corrections.relative_error().min(self.config.kv.near_tie);
        let spread = (self.config.predictor.correction.max_spread - 1.0).max(0.0);
        move |c: &Candidate| {
            if !learns {
                return 0.0;
            }
            let doubt = (c.unproven - least_unproven).max(0.0) * spread;
            match c.overlap_blocks.max(c.inflight_prefix_blocks) >= held {
                true => fleet.max(doubt),
                false => doubt,
            }
        }
    }

    /// The request as policies see it.
    pub(super) fn info(&self, request: &RouteRequest<'_>) -> RequestInfo {
        RequestInfo {
            isl_tokens: request.isl_tokens,
            num_blocks: request.local_hashes.len(),
            block_size: self.config.block_size.tokens(),
            overlap_weight: request.overlap_weight.unwrap_or(self.config.overlap_weight),
            temperature: request.temperature.unwrap_or(self.config.temperature),
            output_tokens: request.output_tokens,
        }
    }

    /// The request's first token arrived: its prefill no longer queues.
    pub fn mark_prefill_done(&mut self, id: &str) -> Option<predict::Observation> {
        self.mark_prefill_done_at(id, Instant::now())
    }

    /// [`Self::mark_prefill_done`] at `now`: a prediction made when it was routed is compared
    /// with the time it took and corrects its worker's later ones. Returns the comparison.
    pub fn mark_prefill_done_at(&mut self, id: &str, now: Instant) -> Option<predict::Observation> {
        let first = self.active.mark_prefill_done(id)?;
        let p = first.predicted?;
        let observed_ms = now.saturating_duration_since(first.routed).as_secs_f64() * 1e3;
        Some(self.corrections.observe(first.worker, &p, observed_ms, now))
    }

    /// Tracks a request another router routed (a replica's decision) as in flight on
    /// `worker`, without choosing anything; ignored for a worker that is not a candidate.
    /// Returns whether it is tracked.
    pub fn track(
        &mut self,
        id: &str,
        worker: WorkerWithDpRank,
        prefill_tokens: usize,
        blocks: RequestBlocks<'_>,
        now: Instant,
    ) -> bool {
        if self.entry(worker).is_none() {
            return false;
        }
        self.active.add(id, worker, prefill_tokens, blocks, now);
        true
    }

    /// A tracked request of `isl_tokens` holds the blocks of an answer of up to
    /// `output_tokens` on its worker ([`ActiveSequences::hold_private`]).
    pub fn hold_private(&mut self, id: &str, isl_tokens: usize, output_tokens: usize) {
        let bs = self.config.block_size.tokens();
        self.active.hold_private(id, isl_tokens, output_tokens, bs);
    }

    /// A request's first token arrived at a time that teaches nothing here: another router's
    /// request (measured elsewhere), or an answer not streamed (its first bytes are the whole
    /// answer). Its prefill no longer queues.
    pub fn mark_prefill_done_untimed(&mut self, id: &str) {
        self.active.mark_prefill_done(id);
    }

    /// The request ended: completed, failed or abandoned by its client.
    pub fn free(&mut self, id: &str) -> bool {
        self.adapters.freed(id);
        if self.disaggregated() {
            self.active.free(&pairs::prefill_leg_id(id));
        }
        self.active.free(id)
    }

    /// A worker's load report, against what is tracked on it: placements its engine never saw
    /// are freed ([`ActiveSequences::reconcile`], over `reconcile_after`). Returns the ids
    /// freed.
    pub fn reconcile(
        &mut self,
        worker: WorkerWithDpRank,
        engine: usize,
        now: Instant,
    ) -> Vec<String> {
        let window = self.config.reconcile_after;
        let freed = self.active.reconcile(worker, engine, now, window);
        for id in &freed {
            self.adapters.freed(id);
        }
        freed
    }

    /// Frees requests older than the configured timeout; returns how many.
    pub fn reclaim_stale(&mut self, now: Instant) -> usize {
        let reclaimed = self.active.reclaim_stale(now, self.config.stale_after);
        if reclaimed > 0 {
            let active = &self.active;
            self.adapters.retain_requests(|id| active.contains(id));
        }
        reclaimed
    }
}

/// Prompt tokens the chosen candidate prefills that the candidate holding most of the prompt
/// (in its cache or in flight) would not: 0 when the chosen holds as much.
fn avoidable(candidates: &[Candidate], chosen: usize, isl_tokens: usize, bs: usize) -> u64 {
    let held = |c: &Candidate| c.overlap_blocks.max(c.inflight_prefix_blocks);
    let Some(mine) = candidates.get(chosen).map(held) else { return 0 };
    let best = candidates.iter().map(held).max().unwrap_or(0);
    let tokens = |blocks| reusable_tokens(blocks, isl_tokens, bs);
    (tokens(best) - tokens(mine)) as u64
}

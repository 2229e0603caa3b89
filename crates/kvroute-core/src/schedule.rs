//! Choosing a worker for a request.
//!
//! ```text
//!  request (isl tokens, block hashes) ──┐
//!  OverlapScores from the KV index ─────┼─▶ Scheduler::route ─▶ one Candidate per cache ─▶ Policy
//!  in-flight requests (ActiveSequences) ┤      (busy caches dropped unless all are busy)    │
//!  load metrics from workers ───────────┘                                                   ▼
//!                                                      RouteDecision { worker, overlap, .. }
//! ```
//!
//! Policies (one file each, behind [`Policy`]):
//! - `kv` (default, [`predicted`]): lowest predicted time to first token in milliseconds of the
//!   engine model ([`predict`]), plus what the choice costs the requests running there and the
//!   hits it evicts;
//! - `kv-tokens` ([`kv`]): the earlier cost, in tokens of prefill work with weights, with a
//!   price on duplicating a prefix away from the worker that holds it;
//! - `dynamo` ([`dynamo`]): Dynamo's cost, `weight * prefill_blocks + decode_blocks`, exactly;
//! - `round-robin`, `random`, `least-loaded` (power of two choices on in-flight tokens):
//!   baselines for benchmarks.
//!
//! In-flight accounting starts when a request is routed ([`Scheduler::route`] with an id),
//! prefill ends at its first token ([`Scheduler::mark_prefill_done`], which also corrects the
//! predictions for its worker and measures their error) and everything is released at its end
//! ([`Scheduler::free`]); requests whose end never comes are reclaimed after a timeout.

mod active;
pub mod adapters;
pub mod dynamo;
pub mod flow;
pub mod kv;
mod least_loaded;
pub mod pairs;
pub mod predict;
pub mod predicted;
mod random;
pub mod reuse;
mod round_robin;
pub mod sessions;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use active::{ActiveLoad, ActiveSequences, FirstToken, Predicted, RequestBlocks};
pub use adapters::{AdapterFit, AdapterTable};
pub use least_loaded::LeastLoaded;
pub use pairs::{PairConfig, PairDecision, Role};
pub use random::RandomPolicy;
pub use round_robin::RoundRobin;
pub use sessions::{SessionConfig, Sessions};

use crate::index::{OverlapScores, RadixIndex, ShardedIndex};
use crate::protocols::{BlockSize, LocalBlockHash, SequenceHash, WorkerWithDpRank};

/// Load a worker reports about itself (docs/mocker.md); absent fields are unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    #[serde(default)]
    pub kv_cache_usage: Option<f64>,
    #[serde(default)]
    pub num_waiting_reqs: Option<u64>,
    #[serde(default)]
    pub num_running_reqs: Option<u64>,
    #[serde(default)]
    pub kv_total_blocks: Option<u64>,
}

/// A policy by name, as on the command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[default]
    Kv,
    /// The cost before predicted milliseconds, in tokens of prefill work (a baseline).
    KvTokens,
    Dynamo,
    RoundRobin,
    Random,
    LeastLoaded,
    /// `kv`, and a session's later requests always on its worker (a baseline).
    Sticky,
    /// `kv` blind to adapter residency (a baseline).
    KvAdapterBlind,
    /// Adapter residency alone, scored as llm-d's LoRA affinity scores it (a baseline).
    LoraAffinity,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 9] = [
        Self::Kv,
        Self::KvTokens,
        Self::Dynamo,
        Self::RoundRobin,
        Self::Random,
        Self::LeastLoaded,
        Self::Sticky,
        Self::KvAdapterBlind,
        Self::LoraAffinity,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::KvTokens => "kv-tokens",
            Self::Dynamo => "dynamo",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::LeastLoaded => "least-loaded",
            Self::Sticky => "sticky",
            Self::KvAdapterBlind => "kv-adapter-blind",
            Self::LoraAffinity => "lora-affinity",
        }
    }

    pub fn build(self, config: &SchedulerConfig) -> Box<dyn Policy> {
        match self {
            Self::Kv => {
                Box::new(predicted::PredictedPolicy::new(config.kv, config.predictor.engine))
            }
            Self::KvTokens => Box::new(kv::KvPolicy::new(config.kv)),
            Self::Sticky => Box::new(kv::KvPolicy::new(config.kv).named("sticky")),
            Self::KvAdapterBlind => Box::new(kv::KvPolicy::new(config.kv).adapter_blind()),
            Self::LoraAffinity => Box::new(adapters::LoraAffinity),
            Self::Dynamo => Box::new(dynamo::DynamoPolicy),
            Self::RoundRobin => Box::new(RoundRobin::default()),
            Self::Random => Box::new(RandomPolicy),
            Self::LeastLoaded => Box::new(LeastLoaded),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| crate::Error::UnknownPolicy(s.to_owned()))
    }
}

/// Scheduler settings; `Default` gives kvroute's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    pub policy: PolicyKind,
    pub block_size: BlockSize,
    /// Dynamo's `overlap_score_weight`: weight of prefill blocks against decode blocks.
    pub overlap_weight: f64,
    /// Softmax temperature; 0 picks the lowest cost.
    pub temperature: f64,
    /// A worker reporting more KV usage than this (0..1) is busy.
    pub busy_kv_usage: Option<f64>,
    /// A worker with more queued prefill tokens than this is busy.
    pub busy_prefill_tokens: Option<usize>,
    /// Refuse a request (no worker) when every worker is busy, as Dynamo's frontend does
    /// with its busy thresholds (503); off, the busy ones are chosen from as usual.
    pub refuse_when_busy: bool,
    /// Requests whose end is never reported are freed after this long.
    pub stale_after: Duration,
    pub seed: u64,
    pub kv: kv::KvConfig,
    /// Conversation affinity ([`sessions`]).
    pub sessions: SessionConfig,
    /// The pair cost of a disaggregated fleet ([`pairs`]).
    pub pairs: PairConfig,
    /// The engine model and its online correction ([`predict`]).
    pub predictor: PredictorConfig,
    /// Flow control: admission, queues and shedding ([`flow`]).
    pub flow: flow::FlowConfig,
}

/// The engine model the `kv` cost predicts with, and how its predictions are corrected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PredictorConfig {
    pub engine: predict::EngineModel,
    pub correction: predict::CorrectionConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::Kv,
            block_size: BlockSize::default(),
            overlap_weight: 1.0,
            temperature: 0.0,
            busy_kv_usage: Some(0.97),
            busy_prefill_tokens: None,
            refuse_when_busy: false,
            stale_after: Duration::from_secs(600),
            seed: 0x006b_7672_6f75_7465,
            kv: kv::KvConfig::default(),
            sessions: SessionConfig::default(),
            pairs: PairConfig::default(),
            predictor: PredictorConfig::default(),
            flow: flow::FlowConfig::default(),
        }
    }
}

/// A request to place.
#[derive(Clone, Debug)]
pub struct RouteRequest<'a> {
    /// With an id, the request is tracked as in flight on the chosen worker until freed.
    pub id: Option<&'a str>,
    pub isl_tokens: usize,
    pub local_hashes: &'a [LocalBlockHash],
    pub sequence_hashes: &'a [SequenceHash],
    /// Per-request overrides of the configured weight and temperature.
    pub overlap_weight: Option<f64>,
    pub temperature: Option<f64>,
    /// Caches not to choose (e.g. one that just refused a connection).
    pub exclude: &'a [WorkerWithDpRank],
    /// The LoRA adapter it runs with: only workers that serve it are candidates, and what
    /// loading it costs is priced ([`adapters`]).
    pub adapter: Option<&'a str>,
    /// Its conversation: it stays on the session's worker unless another is cheaper by a
    /// margin ([`sessions`]).
    pub session: Option<&'a str>,
    /// Tokens its answer may run to (its `max_tokens`; 0 when unknown). While it runs, the
    /// blocks its answer grows into are held on its worker like its prompt's.
    pub output_tokens: usize,
}

/// Everything a policy knows about one candidate cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Candidate {
    pub worker: WorkerWithDpRank,
    /// Leading blocks of the request the worker holds, by its KV events.
    pub overlap_blocks: u32,
    /// Leading blocks of the request in flight on the worker (routed, not yet reported).
    pub inflight_prefix_blocks: u32,
    /// Blocks right after its device prefix that it keeps in host memory, on disk and in the
    /// shared store (each block from the cheapest tier that holds it).
    pub tier_blocks: crate::index::TierRun,
    /// Blocks the worker holds in all.
    pub tree_size: usize,
    pub active: ActiveLoad,
    pub load: WorkerLoad,
    /// What running the request's adapter there takes.
    pub adapter: AdapterFit,
    /// Its part in a disaggregated fleet, and its node (workers on one node share a fast
    /// link; 0 when unknown).
    pub role: Role,
    pub node: u32,
    /// What its first tokens taught: its model predictions are multiplied by this (0: not
    /// filled in, taken as 1; filled in for a policy that [`Policy::learns_ttft`]).
    pub ttft_factor: f64,
    /// Recomputes a token evicted from its cache is priced at ([`reuse`]; 0: not filled in,
    /// taken as 1; filled in with [`Candidate::ttft_factor`]).
    pub reuse: f64,
}

/// The request as policies see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestInfo {
    pub isl_tokens: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub overlap_weight: f64,
    pub temperature: f64,
    /// Tokens its answer may run to (0: unknown).
    pub output_tokens: usize,
}

/// Deterministic randomness for tie-breaks and sampling (xorshift64*; seeded, no OS entropy).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// How many blocks each cache holds in all (its KV index's view): how full a cache is decides
/// what storing more there evicts.
pub trait TreeSizes {
    fn tree_size(&self, worker: WorkerWithDpRank) -> usize;

    /// Every known cache's size, sorted by worker, when the source can list them in one go
    /// (a decision over a thousand workers then reads one list instead of asking each).
    fn all_sorted(&self) -> Option<Vec<(WorkerWithDpRank, usize)>> {
        None
    }
}

/// For callers without an index at hand: every cache looks empty.
#[derive(Clone, Copy, Debug, Default)]
pub struct UnknownTreeSizes;

impl TreeSizes for UnknownTreeSizes {
    fn tree_size(&self, _: WorkerWithDpRank) -> usize {
        0
    }
}

impl TreeSizes for crate::index::RadixIndex {
    fn tree_size(&self, worker: WorkerWithDpRank) -> usize {
        RadixIndex::tree_size(self, worker)
    }

    fn all_sorted(&self) -> Option<Vec<(WorkerWithDpRank, usize)>> {
        Some(self.tree_sizes())
    }
}

impl TreeSizes for crate::index::ShardedIndex {
    fn tree_size(&self, worker: WorkerWithDpRank) -> usize {
        ShardedIndex::tree_size(self, worker)
    }

    fn all_sorted(&self) -> Option<Vec<(WorkerWithDpRank, usize)>> {
        Some(self.tree_sizes())
    }
}

/// Picks one of the candidates (never given an empty slice): by cost ([`Policy::costs`], the
/// lowest or a softmax sample, see [`pick_by_cost`]) or by a rule of its own
/// ([`Policy::select`], the baselines).
pub trait Policy: Send + Sync + fmt::Debug {
    fn name(&self) -> &'static str;
    /// A baseline blind to load (round-robin, random): busy workers stay candidates, so it
    /// spreads requests exactly as its name says. Load-aware policies see only idle ones.
    fn blind(&self) -> bool {
        false
    }
    /// Each candidate's cost, in order (lower is better), for a policy that prices them; the
    /// scheduler picks by [`pick_by_cost`] and shows the costs with its recent decisions.
    fn costs(&self, _request: &RequestInfo, _candidates: &[Candidate]) -> Option<Vec<f64>> {
        None
    }
    /// What [`Policy::costs`] counts in, for people reading them (`None`: no costs).
    fn cost_unit(&self) -> Option<&'static str> {
        None
    }
    /// Whether its costs read each candidate's learned [`Candidate::ttft_factor`].
    fn learns_ttft(&self) -> bool {
        false
    }
    /// Whether its costs price a worker's memory (the wait of a request that does not fit,
    /// what it evicts): a worker over `busy_kv_usage` then stays a candidate, priced, rather
    /// than being dropped (dropping its prefix's holder copies the prefix elsewhere, which
    /// filled the other workers in turn and spread every prefix over every worker: #65).
    fn weighs_memory(&self) -> bool {
        false
    }
    /// The choice of a policy without costs (a priced one picks by its costs).
    fn select(&mut self, request: &RequestInfo, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let costs = self.costs(request, candidates).unwrap_or_else(|| vec![0.0; candidates.len()]);
        pick_by_cost(&costs, candidates, request.temperature, rng)
    }
}

/// Picks the lowest of `costs`, or samples with a softmax at temperature `t > 0`:
/// `p_i ∝ exp(-(c_i - min) / ((max - min) * t))`, uniform when all costs are equal. Ties at
/// temperature 0 go to the smaller tree, then to a seeded coin.
pub fn pick_by_cost(
    costs: &[f64],
    candidates: &[Candidate],
    temperature: f64,
    rng: &mut Rng,
) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if temperature > 0.0 && costs.len() > 1 {
        let weights: Vec<f64> = if max > min {
            costs.iter().map(|c| (-(c - min) / ((max - min) * temperature)).exp()).collect()
        } else {
            vec![1.0; costs.len()]
        };
        let total: f64 = weights.iter().sum();
        let mut x = rng.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        return costs.len() - 1;
    }
    let mut best: Vec<usize> = Vec::new();
    let mut best_tree = usize::MAX;
    for (i, &c) in costs.iter().enumerate() {
        if c != min {
            continue;
        }
        let tree = candidates[i].tree_size;
        if tree < best_tree {
            best.clear();
            best_tree = tree;
        }
        if tree == best_tree {
            best.push(i);
        }
    }
    match best.len() {
        0 => 0, // only NaN costs: any
        1 => best[0],
        n => best[rng.below(n)],
    }
}

/// Prompt tokens an engine serves from `overlap_blocks` cached leading blocks of an
/// `isl_tokens` prompt: vLLM (and SGLang) always compute a prompt's last token for its
/// logits, so a fully cached prompt recomputes its last block.
pub fn reusable_tokens(overlap_blocks: u32, isl_tokens: usize, block_size: usize) -> usize {
    let max_blocks = isl_tokens.saturating_sub(1) / block_size.max(1);
    (overlap_blocks as usize).min(max_blocks) * block_size
}

/// [`reusable_tokens`] of a run of `device` leading blocks and `tiers` blocks after them
/// from host memory, disk and the shared store, by where they come from: the device's
/// tokens, then each lower tier's. A fully cached prompt's recomputed last block is taken
/// off the last tier in that order (the run's order by position is not kept).
pub fn reusable_by_tier(
    device: u32,
    tiers: crate::index::TierRun,
    isl_tokens: usize,
    block_size: usize,
) -> (usize, [usize; 3]) {
    let mut left = isl_tokens.saturating_sub(1) / block_size.max(1);
    let mut take = |blocks: u32| {
        let n = (blocks as usize).min(left);
        left -= n;
        n * block_size
    };
    let on_device = take(device);
    (on_device, tiers.map(take))
}

/// Where a request went and what the router expected of it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RouteDecision {
    pub worker: WorkerWithDpRank,
    /// Leading blocks the worker holds by its KV events.
    pub overlap_blocks: u32,
    /// Blocks after those it is expected to load from host memory, disk and the shared store.
    pub tier_blocks: crate::index::TierRun,
    /// Prompt tokens the router expects the worker to compute (not served from its cache).
    pub predicted_prefill_tokens: usize,
}

/// Decisions the scheduler keeps for the status page.
pub const RECENT_DECISIONS: usize = 20;
/// Candidates kept of each: the chosen one and the cheapest others.
pub const RECORDED_CANDIDATES: usize = 4;

/// One routing decision as the status page shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecisionRecord {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub isl_tokens: usize,
    /// Candidates considered in all.
    pub considered: usize,
    /// The chosen candidate first, then the cheapest others.
    pub candidates: Vec<ScoredCandidate>,
    /// What the candidates' costs count in: `s` for `kv`, `blocks` for `dynamo`, `score`
    /// for `lora-affinity`; none for the baselines without costs.
    pub cost_unit: Option<&'static str>,
}

/// A candidate of a [`DecisionRecord`], with what its policy priced it at.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ScoredCandidate {
    pub worker: WorkerWithDpRank,
    pub overlap_blocks: u32,
    pub inflight_prefix_blocks: u32,
    /// Requests in flight on it.
    pub running: usize,
    /// The policy's cost (seconds for `kv`, blocks for `dynamo`); none for the baselines.
    pub cost: Option<f64>,
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    policy: Box<dyn Policy>,
    /// Candidates, sorted by worker, with what they report and what was learned of them.
    workers: Vec<WorkerEntry>,
    ids: Vec<WorkerWithDpRank>,
    active: ActiveSequences,
    rng: Rng,
    recent: std::collections::VecDeque<DecisionRecord>,
    adapters: AdapterTable,
    sessions: Sessions,
    affinity: AffinityCounts,
    /// The candidates' buffer, kept between decisions (a thousand candidates are ~140 KB:
    /// allocated per decision, that was a fresh mapping and its page faults each time).
    scratch: Vec<Candidate>,
    /// The decode pool's own instance of a baseline policy (a round-robin's turn is per
    /// pool), and what the pair choice did.
    decode_policy: Box<dyn Policy>,
    pair_counts: pairs::PairCounts,
    /// Predicts each tracked request's first token, whatever the policy, and learns from it.
    predictor: predicted::PredictedPolicy,
    corrections: predict::Corrections,
    reuse: reuse::Reuse,
}

/// What session affinity did, since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AffinityCounts {
    /// Requests of a session seen for the first time (or whose worker was forgotten).
    pub new: u64,
    /// Requests kept on their session's worker.
    pub kept: u64,
    /// Requests moved off it, another worker being cheaper by the margin.
    pub moved: u64,
}

#[derive(Clone, Copy, Debug)]
struct WorkerEntry {
    worker: WorkerWithDpRank,
    load: WorkerLoad,
    /// Not ready (e.g. its event stream is down): chosen only when no ready worker is left.
    ready: bool,
    role: Role,
    node: u32,
}

/// Looks workers up, in increasing order, in a list sorted by worker: one pass for all of them
/// instead of a search each.
fn cursor<T: Copy>(
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
            policy: config.policy.build(&config),
            config,
            workers: Vec::new(),
            ids: Vec::new(),
            active: ActiveSequences::new(),
            rng: Rng::new(config.seed),
            recent: std::collections::VecDeque::with_capacity(RECENT_DECISIONS),
            adapters: AdapterTable::default(),
            sessions: Sessions::new(config.sessions),
            affinity: AffinityCounts::default(),
            scratch: Vec::new(),
            decode_policy: config.policy.build(&config),
            pair_counts: pairs::PairCounts::default(),
            predictor: predicted::PredictedPolicy::new(config.kv, config.predictor.engine),
            corrections: predict::Corrections::new(config.predictor.correction),
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

    fn entry(&mut self, worker: WorkerWithDpRank) -> Option<&mut WorkerEntry> {
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
    fn prepare(
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
            for c in candidates.iter_mut() {
                if corrected {
                    c.ttft_factor = self.corrections.factor(c.worker, now);
                }
                c.reuse = self.reuse.factor(c.worker);
            }
        }
    }

    /// [`Self::route_gated`] over its candidates.
    fn route_among(
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
    fn route_chosen(
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
            self.remember(request.isl_tokens, candidates, chosen, costs.as_deref());
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
    fn predict(&mut self, id: &str, request: &RouteRequest<'_>, c: &Candidate, now: Instant) {
        let model_ms = self.predictor.model_ttft_ms(&self.info(request), c);
        let predicted_ms = model_ms * self.corrections.factor(c.worker, now);
        self.active.set_prediction(id, Predicted { model_ms, predicted_ms });
    }

    /// Each worker's first-token predictions as they turned out.
    pub fn prediction_stats(&self, now: Instant) -> Vec<predict::PredictionStats> {
        self.corrections.stats(now)
    }

    /// A session's request stays on the session's worker (a candidate still) unless the
    /// policy's choice is cheaper by the margin (never, for `sticky`); counted.
    fn affine(
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
    fn remember(
        &mut self,
        isl_tokens: usize,
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
        let scored = |i: usize| {
            let c = &candidates[i];
            ScoredCandidate {
                worker: c.worker,
                overlap_blocks: c.overlap_blocks,
                inflight_prefix_blocks: c.inflight_prefix_blocks,
                running: c.active.requests,
                cost: cost(i),
            }
        };
        let record = DecisionRecord {
            at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            isl_tokens,
            considered: candidates.len(),
            candidates: std::iter::once(chosen).chain(order).map(scored).collect(),
            cost_unit: costs.and(self.policy.cost_unit()),
        };
        if self.recent.len() == RECENT_DECISIONS {
            self.recent.pop_front();
        }
        self.recent.push_back(record);
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
    fn fill_candidates(
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
        let any_ready = self.workers.iter().any(|e| e.ready);
        all.clear();
        let tiers = scores.tiers.as_deref();
        all.extend(self.workers.iter().filter(|e| e.ready || !any_ready).map(|e| {
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
    fn is_busy(&self, c: &Candidate, by_kv: bool) -> bool {
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
                (pick_by_cost(&costs, candidates, info.temperature, &mut self.rng), Some(costs))
            }
            None => (self.policy.select(&info, candidates, &mut self.rng), None),
        };
        Some((chosen.min(candidates.len() - 1), costs))
    }

    /// The request as policies see it.
    fn info(&self, request: &RouteRequest<'_>) -> RequestInfo {
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
        Some(self.corrections.observe(first.worker, p.model_ms, p.predicted_ms, observed_ms, now))
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

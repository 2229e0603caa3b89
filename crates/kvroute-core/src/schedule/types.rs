//! What the scheduler is asked and answers: a request, a candidate worker and its load,
//! a decision and its record; the index's sizes as the scheduler reads them.

use serde::{Deserialize, Serialize};
use std::str::FromStr;

use super::active::ActiveLoad;

use crate::index::{RadixIndex, ShardedIndex};
use crate::protocols::{LocalBlockHash, SequenceHash, WorkerWithDpRank};

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
    /// Tokens per KV block the engine runs with (vLLM's `cache_config_info`): a worker whose
    /// size is not the router's is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
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
    /// loading it costs is priced ([`super::adapters`]).
    pub adapter: Option<&'a str>,
    /// Its conversation: it stays on the session's worker unless another is cheaper by a
    /// margin ([`super::sessions`]).
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
    /// filled in, taken as 1; filled in for a policy that [`super::Policy::learns_ttft`]).
    pub ttft_factor: f64,
    /// Recomputes a token evicted from its cache is priced at ([`super::reuse`]; 0: not filled in,
    /// taken as 1; filled in with [`Candidate::ttft_factor`]).
    pub reuse: f64,
    /// How much of its price is still the fleet's, not its own (1 for a worker never heard
    /// from, towards 0 as its first tokens come; 0: not filled in): a newcomer's prediction is
    /// less sure than an old worker's, and near-ties are judged with that error
    /// ([`super::pick_near`]).
    pub unproven: f64,
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
    /// The request's id (the front door's, or the client's `x-request-id` to the router).
    pub request: String,
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
    /// The `kv` cost by its terms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub terms: Option<CostTerms>,
}

/// The `kv` cost of one candidate by its terms, ms (`schedule/kv.rs`'s formula): its predicted
/// first token, what it adds to the requests running there, what storing it evicts, its wait
/// for memory beyond the model's, and its adapter's loading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CostTerms {
    pub ttft_ms: f64,
    pub running_ms: f64,
    pub evict_ms: f64,
    pub wait_ms: f64,
    pub lora_ms: f64,
}

impl CostTerms {
    /// The cost, seconds.
    pub fn total_s(&self) -> f64 {
        (self.ttft_ms + self.running_ms + self.evict_ms + self.wait_ms + self.lora_ms) / 1e3
    }
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

/// What running a request's adapter on a worker takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterFit {
    /// The base model, or an adapter in a slot.
    #[default]
    Resident,
    /// A load into a free slot.
    Load,
    /// A load that evicts another adapter (every slot holds one).
    LoadEvicting,
    /// Every slot holds an adapter of a running request: it waits for one to end.
    Wait,
}

/// What a worker does in a disaggregated fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill and decode (an aggregated engine).
    #[default]
    Both,
    /// Prefills for decode engines.
    Prefill,
    /// Decodes prompts prefilled elsewhere (or, when cheaper, prefilled in place).
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl FromStr for Role {
    type Err = crate::UnknownChoice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" => Ok(Self::Both),
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            _ => Err(crate::UnknownChoice::new("role", s, "prefill, decode or both")),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

//! kvroute's default policy: the lowest predicted time to first token, counting the price of
//! copying a prefix away from the worker that holds it.
//!
//! For each candidate `i`, in tokens of prefill work (divided by `prefill_tokens_per_s` to get
//! seconds):
//!
//! ```text
//! cached_i = max(kv overlap_i, in-flight prefix_i) * bs        tokens it has or is computing
//! ttft_i   = queue_weight * queued_prefill_i + (isl - cached_i) work ahead of the first token
//! evict_i  = eviction_weight * (isl - cached_i) * fullness_i   what storing the rest evicts
//! decode_i = decode_full_cache_tokens * active_blocks_i / kv_total_blocks_i
//! wait_i   = memory_wait_tokens if active_blocks_i + the request's blocks not in flight there
//!            exceed kv_total_blocks_i, else 0
//! lora_i   = 0 with the request's adapter in a slot there (or none), adapter_load_tokens
//!            x (1 + requests there waiting for their first token) to load it,
//!            + adapter_evict_tokens when that evicts another, or adapter_wait_tokens when
//!            every slot runs another adapter's requests
//! cost_i   = (ttft_i + evict_i + decode_i + wait_i + lora_i) / prefill_tokens_per_s
//! ```
//!
//! - The in-flight prefix counts as cached: a request routed behind an identical one reuses
//!   its blocks as they are computed, so a burst of cold duplicates stays together.
//! - `queue_weight` < 1: in a chunked-prefill engine queued prompts share steps with this one;
//!   at full weight a queue moved prefixes off their owner and a fleet near saturation spread
//!   every prefix group over every worker.
//! - `evict_i` prices the future: what a request adds to a full cache evicts something a later
//!   request computes again, so a prefix moves only when waiting costs more than computing it
//!   twice, and new prefixes go where there is room.
//! - `decode_i`: a step decodes every running request and grows with the KV it reads, so a
//!   first token comes later on a worker full of running requests; it spreads requests that
//!   share nothing.
//! - `wait_i`: a worker that cannot hold the request next to its running ones admits it only
//!   when some finish, far longer than recomputing a prefix elsewhere.
//! - `lora_i`: an adapter not in a slot holds up the step that loads it, for every request
//!   there still waiting for its first token, so a request goes where its adapter is unless
//!   the queue there costs more than a load: a hot adapter spreads as its queue grows, a cold
//!   one stays where it is, and a load goes to an engine with little waiting on it. (Priced
//!   for this request alone, kv lost to llm-d's residency score at high rates on the
//!   short-prompt multi-lora run: docs/bench/adapters.md.)
//! - Every worker is priced at one prefill speed (a speed learned from first-token times
//!   starved workers and was removed).
//!
//! Why each weight has its value, with the runs that chose them, and the variants tried and
//! dropped: `docs/bench/kv-cost.md` and `docs/routing.md`. Dynamo's cost is
//! [`super::dynamo`].

use serde::{Deserialize, Serialize};

use super::{AdapterFit, Candidate, Policy, RequestInfo};

/// The `kv` cost's weights; each one is a setting by its field name (`--kv-cost NAME=VALUE`,
/// the config file's `[kv_cost]` table).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvConfig {
    /// The workers' prefill speed (tokens per second): the unit of the cost, in seconds.
    pub prefill_tokens_per_s: f64,
    /// Price of each token a request adds to a full cache (what it evicts), in prefill tokens.
    pub eviction_weight: f64,
    /// What running requests filling a worker's whole cache add to its time to first token,
    /// in prefill tokens (scaled by the share of the cache they fill).
    pub decode_full_cache_tokens: f64,
    /// Price of each in-flight token, in prefill tokens, when the worker's capacity is unknown.
    pub decode_weight: f64,
    /// Price of waiting for memory on a worker whose cache cannot hold the request next to its
    /// running ones, in prefill tokens.
    pub memory_wait_tokens: f64,
    /// Weight of the prompt tokens already queued at a worker (see the module notes).
    pub queue_weight: f64,
    /// Loading a LoRA adapter not in a slot, in prefill tokens (100 ms at 20k tokens/s, the
    /// simulated engine's default load).
    pub adapter_load_tokens: f64,
    /// What evicting another adapter costs besides (its likely reload), in prefill tokens.
    pub adapter_evict_tokens: f64,
    /// Waiting for a slot when every slot runs another adapter's requests, in prefill tokens.
    pub adapter_wait_tokens: f64,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 20_000.0,
            eviction_weight: 1.0,
            decode_full_cache_tokens: 2_500.0,
            decode_weight: 0.02,
            memory_wait_tokens: 20_000.0,
            queue_weight: 0.5,
            adapter_load_tokens: 2_000.0,
            adapter_evict_tokens: 1_000.0,
            adapter_wait_tokens: 20_000.0,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct KvPolicy {
    config: KvConfig,
    /// Prices adapter loads (off: the adapter-blind baseline).
    adapters: bool,
    /// The policy's name (`kv`, or a baseline built on it).
    name: &'static str,
}

impl KvPolicy {
    pub fn new(config: KvConfig) -> Self {
        Self { config, adapters: true, name: "kv" }
    }

    /// The same cost under another policy's name (a baseline that differs elsewhere).
    #[must_use]
    pub fn named(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// The same cost with no price on adapter loads: a baseline.
    #[must_use]
    pub fn adapter_blind(mut self) -> Self {
        self.adapters = false;
        self.name = "kv-adapter-blind";
        self
    }

    /// What running the request's adapter on a candidate adds, in prefill tokens. A load
    /// holds up the engine's step: every request there still waiting for its first token
    /// waits for it too, so it counts once for this request and once for each of them.
    fn adapter_tokens(&self, c: &Candidate) -> f64 {
        let w = &self.config;
        let held = 1.0 + c.active.prefilling as f64;
        match (self.adapters, c.adapter) {
            (false, _) | (true, AdapterFit::Resident) => 0.0,
            (true, AdapterFit::Load) => w.adapter_load_tokens * held,
            (true, AdapterFit::LoadEvicting) => {
                w.adapter_load_tokens * held + w.adapter_evict_tokens
            }
            (true, AdapterFit::Wait) => w.adapter_wait_tokens,
        }
    }

    /// Predicted cost (seconds) of each candidate, in order.
    pub fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Vec<f64> {
        let bs = request.block_size;
        let cached = |c: &Candidate| {
            (c.overlap_blocks.max(c.inflight_prefix_blocks) as usize * bs).min(request.isl_tokens)
        };
        candidates
            .iter()
            .map(|c| {
                let have = cached(c);
                let total = c.load.kv_total_blocks.filter(|&t| t > 0).map(|t| t as f64);
                let fullness = total.map_or(1.0, |t| (c.tree_size as f64 / t).min(1.0));
                let uncached = (request.isl_tokens - have) as f64;
                let ttft = self.config.queue_weight * c.active.prefill_tokens as f64 + uncached;
                let evict = self.config.eviction_weight * uncached * fullness;
                let decode = match total {
                    Some(t) => {
                        self.config.decode_full_cache_tokens * (c.active.blocks as f64 / t).min(1.0)
                    }
                    None => self.config.decode_weight * (c.active.blocks * bs) as f64,
                };
                // Every block of the request is referenced while it runs (cached ones too),
                // except those already in flight there; one more for its first output token.
                let needs =
                    request.num_blocks.saturating_sub(c.inflight_prefix_blocks as usize) + 1;
                let wait = match total {
                    Some(t) if (c.active.blocks + needs) as f64 > t => {
                        self.config.memory_wait_tokens
                    }
                    _ => 0.0,
                };
                let adapter = self.adapter_tokens(c);
                (ttft + evict + decode + wait + adapter) / self.config.prefill_tokens_per_s.max(1.0)
            })
            .collect()
    }
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Option<Vec<f64>> {
        Some(KvPolicy::costs(self, request, candidates))
    }
}

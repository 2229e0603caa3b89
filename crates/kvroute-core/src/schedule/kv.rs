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
//! cost_i   = (ttft_i + evict_i + decode_i + wait_i) / prefill_tokens_per_s
//! ```
//!
//! - The in-flight prefix counts as cached: a request routed behind an identical one reuses
//!   its blocks as they are computed, so a burst of cold duplicates stays together.
//! - `queue_weight` (0.5): the prompt tokens queued at a worker count half. In a chunked-prefill
//!   engine they share steps with this request's (up to the step's token budget) rather than
//!   all running before it, and moving a prefix away from its owner because of a queue makes
//!   the other worker compute it too, which queues the next request there. At full weight that
//!   feedback loop undid a fleet near saturation: `kvroute serve` at speedup 1 under the shared
//!   load generator's shared-prefix at 24 req/s (`../shared/peers/sidebyside.sh`) spread every
//!   prompt group over all 4 workers within 5 s and fell to a 0.41 hit rate and a 4.7 s median
//!   TTFT (13.5 req/s done), where Dynamo's stack held 0.935; at 0.5 it holds 0.966 with a 75 ms
//!   median (0.25 alike; 0 too, but then no queue ever moves a prefix). Below saturation
//!   (`kvroute bench` at speedup 2) the weight changes nothing measurable.
//! - `evict_i` prices the future: every block the request adds to a cache evicts another there
//!   once the cache is full (`fullness_i = tree_size / kv_total_blocks`, 1 when unknown), and
//!   some later request pays to prefill that one again. Away from a prefix's owner that is the
//!   whole prefix, so a prefix moves only when the owner's queue makes the wait longer than
//!   computing the prefix elsewhere twice over (once now, once for what it evicts); and a new
//!   prefix goes where the cache has room, which spreads prefix groups evenly.
//! - `decode_i` is what the worker's running requests add to the wait: every engine step
//!   decodes them all, and a decode step grows with the KV it reads (vLLM's and the mocker's
//!   alike: 5.7 ms empty, ~34 ms at a full cache in Dynamo's fitted model), so the request's
//!   first token, computed within such steps, comes later on a worker whose cache is full of
//!   running requests. `decode_full_cache_tokens` is that delay at a full cache, in prefill
//!   tokens: in that model a cache's worth of running requests adds ~28 ms to a step near half
//!   full, a first token waits ~1.5 steps, and prefill runs at ~66k tokens/s, so ~2,800; we
//!   use 2,500 (on `kvroute bench`'s multi-turn workload 4,000 moved conversations off their
//!   worker for small load differences: hit rate 0.81 against 0.86 at 2,500). It is what
//!   spreads requests that share nothing. With the capacity unknown, `decode_weight` per
//!   in-flight token stands in.
//! - `wait_i`: a worker whose cache cannot hold the request next to its running ones admits it
//!   only once some of them finish (vLLM and the mocker queue it, or preempt): hundreds of
//!   milliseconds, far more than recomputing a prefix elsewhere. On `kvroute bench`'s
//!   multi-turn workload conversations that outgrew their worker waited up to 250 ms there.
//! - Every worker is priced at one prefill speed. A speed learned per worker from first-token
//!   times was tried and removed: a first-token time also holds the step's fixed cost and the
//!   queue ahead, so a worker that once answered slowly looked slow for everything, got fewer
//!   requests and so no new evidence (`kvroute bench`'s random workload starved one worker that
//!   way: 7 of 160 requests). A speed that can be learned needs the engine's own prefill
//!   timings (vLLM's `vllm:request_prefill_time_seconds`), not the router's view of them.
//!
//! Dynamo's cost ([`super::dynamo`]) adds every in-flight block of a worker to its cost, which
//! pushes requests off the worker that holds their prefix as soon as it is busy decoding; the
//! prefix is then copied to 3-4 workers and evicts others (SPEC section 7).

use serde::{Deserialize, Serialize};

use super::{Candidate, Policy, RequestInfo};

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
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct KvPolicy {
    config: KvConfig,
}

impl KvPolicy {
    pub fn new(config: KvConfig) -> Self {
        Self { config }
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
                (ttft + evict + decode + wait) / self.config.prefill_tokens_per_s.max(1.0)
            })
            .collect()
    }
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Option<Vec<f64>> {
        Some(KvPolicy::costs(self, request, candidates))
    }
}

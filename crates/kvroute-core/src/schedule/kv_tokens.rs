//! The `kv-tokens` policy (kvroute's default before the cost in predicted milliseconds,
//! [`super::kv`], kept for comparison): the lowest predicted time to first token in
//! tokens of prefill work, counting the price of copying a prefix away from the worker that
//! holds it. Its terms also price the pairs of a disaggregated fleet ([`super::pairs`]).
//!
//! For each candidate `i`, in tokens of prefill work (divided by `prefill_tokens_per_s` to get
//! seconds):
//!
//! ```text
//! cached_i = max(kv overlap_i, in-flight prefix_i) * bs        tokens it has or is computing
//! loaded_i = sum over lower-tier blocks t past cached_i of credit_t * bs    (see below)
//! ttft_i   = queue_weight * queued_prefill_i + (isl - cached_i - loaded_i)
//!                                                             work ahead of the first token
//! evict_i  = eviction_weight * (isl - cached_i) * fullness_i   what storing the rest evicts
//! decode_i = decode_full_cache_tokens * active_blocks_i / kv_total_blocks_i
//! wait_i   = memory_wait_tokens if active_blocks_i + the request's blocks not in flight there
//!            exceed kv_total_blocks_i, else 0 (active_blocks_i: what the running requests
//!            hold, their answers' blocks included: `ActiveSequences::hold_private`)
//! lora_i   = 0 with the request's adapter in a slot there (or none), adapter_load_tokens
//!            x (1 + requests there waiting for their first token) to load it,
//!            + adapter_evict_tokens when that evicts another, or adapter_wait_tokens when
//!            every slot runs another adapter's requests
//! cost_i   = (ttft_i + evict_i + decode_i + wait_i + lora_i) / prefill_tokens_per_s
//! ```
//!
//! - `loaded_i`: blocks the worker keeps below its device (host memory, disk, a shared store)
//!   right after its device prefix are loaded instead of computed. One counts
//!   `credit_t = max(0, 1 - load_t / recompute)`: `load_t` = a block's bytes
//!   (`kv_bytes_per_token * bs`) over the tier's bandwidth, `recompute` = `bs` over
//!   `prefill_tokens_per_s`. With `fixed_tier_weights` = 1, Dynamo's fixed credits instead
//!   (`host_weight`, `disk_weight`, `external_weight`). Their blocks still take room on the
//!   device, so `evict_i` counts them as uncached.
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

use super::cost::{Fill, KvConfig, loaded_blocks};
use super::{Candidate, Policy, RequestInfo};

#[derive(Clone, Copy, Debug)]
pub struct KvTokensPolicy {
    config: KvConfig,
    /// Prices adapter loads (off: the adapter-blind baseline).
    adapters: bool,
    /// The policy's name (`kv`, or a baseline built on it).
    name: &'static str,
}

impl KvTokensPolicy {
    pub fn new(config: KvConfig) -> Self {
        Self { config, adapters: true, name: "kv-tokens" }
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

    /// Predicted cost (seconds) of each candidate, in order.
    pub fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Vec<f64> {
        let w = &self.config;
        let bs = request.block_size;
        let cached = |c: &Candidate| {
            (c.overlap_blocks.max(c.inflight_prefix_blocks) as usize * bs).min(request.isl_tokens)
        };
        let credits = self.config.tier_credits(bs);
        candidates
            .iter()
            .map(|c| {
                let have = cached(c);
                let fill = Fill::of(c);
                let uncached = (request.isl_tokens - have) as f64;
                let have_blocks = c.overlap_blocks.max(c.inflight_prefix_blocks);
                let loaded = match c.tier_blocks == [0; 3] {
                    true => 0.0,
                    false => (loaded_blocks(c, have_blocks, credits) * bs as f64).min(uncached),
                };
                let ttft = w.queue_weight * c.active.prefill_tokens as f64 + uncached - loaded;
                let evict = w.evict_tokens(uncached, fill);
                let decode = w.decode_tokens(c, fill, bs);
                let wait = w.wait_tokens(c, fill, request.num_blocks);
                let adapter = w.adapter_tokens(c, self.adapters);
                w.seconds(ttft + evict + decode + wait + adapter)
            })
            .collect()
    }
}

impl Policy for KvTokensPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Option<Vec<f64>> {
        Some(KvTokensPolicy::costs(self, request, candidates))
    }

    fn cost_unit(&self) -> Option<&'static str> {
        Some("s")
    }
}

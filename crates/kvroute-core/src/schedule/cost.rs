//! The cost's weights and the cache's fill, shared by both `kv` policies (`kv.rs`, in predicted
//! milliseconds; `kv_tokens.rs`, in tokens of prefill work) and the pair choice (`pairs.rs`):
//! one definition of each term. Why each weight has its value: `docs/bench/kv-cost.md` and
//! `docs/routing.md`.

use serde::{Deserialize, Serialize};

use super::types::{AdapterFit, Candidate};

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
    /// KV bytes per token (2 x layers x KV heads x head size x bytes per value), to price a
    /// block's load from a lower tier: 131,072 (128 KiB, a Llama-3-8B-sized model in 16 bits).
    pub kv_bytes_per_token: f64,
    /// Host-to-device bandwidth (GB/s) of loading a host-memory block (Dynamo's mocker: 32).
    pub host_bandwidth_gbps: f64,
    /// Bandwidth (GB/s) of reading a block from local disk (Dynamo's mocker's G3 tier: 10);
    /// it then takes the host copy too, as vLLM's tiering promotes it through host memory.
    pub disk_bandwidth_gbps: f64,
    /// Bandwidth (GB/s) of loading a block from the shared store (100 Gb/s Ethernet: 12.5).
    pub external_bandwidth_gbps: f64,
    /// The `kv` cost (predicted milliseconds): weight of the time a request adds to the
    /// requests decoding on its worker against its own time to first token (1: a
    /// millisecond of theirs counts as one of its own). 0 by default: at 1 it moved every
    /// request off a prefix's busy owner (docs/routing.md).
    pub running_delay_weight: f64,
    /// The `kv` cost: seconds over which each worker's reused and new tokens are averaged to
    /// price a token evicted there (`schedule::reuse`).
    pub reuse_window_s: f64,
    /// The `kv` cost: most recomputes a token evicted from a cache is priced at (1: one, the
    /// price before #65).
    pub reuse_cap: f64,
    /// The `kv` cost: tokens of evidence a worker's reuse starts with, at the fleet's ratio.
    pub reuse_prior_tokens: f64,
    /// The `kv` cost: the most two costs may differ, as a share of the lower, and be treated
    /// as equal; the band is the fleet's recent prediction error up to this (`pick_near`;
    /// 0.25: about a first token's own noise).
    pub near_tie: f64,
    /// 1: credit lower-tier blocks by the fixed weights below instead of by bandwidth.
    pub fixed_tier_weights: f64,
    /// Credit of a host block with fixed weights (Dynamo's `host_cache_hit_weight`: 0.75).
    pub host_weight: f64,
    /// Credit of a disk block with fixed weights (Dynamo's `disk_cache_hit_weight`: 0.25).
    pub disk_weight: f64,
    /// Credit of a shared-store block with fixed weights (Dynamo's shared pool: 0.5).
    pub external_weight: f64,
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
            kv_bytes_per_token: 131_072.0,
            host_bandwidth_gbps: 32.0,
            disk_bandwidth_gbps: 10.0,
            external_bandwidth_gbps: 12.5,
            running_delay_weight: 0.0,
            reuse_window_s: 30.0,
            reuse_cap: 8.0,
            reuse_prior_tokens: 2048.0,
            near_tie: 0.25,
            fixed_tier_weights: 0.0,
            host_weight: DYNAMO_TIER_WEIGHTS[0],
            disk_weight: DYNAMO_TIER_WEIGHTS[1],
            external_weight: DYNAMO_TIER_WEIGHTS[2],
        }
    }
}

/// Dynamo 1.6's credits for a host, disk and shared-pool block (its defaults).
pub const DYNAMO_TIER_WEIGHTS: [f64; 3] = [0.75, 0.25, 0.5];

impl KvConfig {
    /// What one block of each lower tier (host, disk, external) counts for, against a block
    /// on the device.
    pub fn tier_credits(&self, block_size: usize) -> [f64; 3] {
        if self.fixed_tier_weights > 0.0 {
            return [self.host_weight, self.disk_weight, self.external_weight];
        }
        let bytes = self.kv_bytes_per_token * block_size as f64;
        let recompute = block_size as f64 / self.prefill_tokens_per_s.max(1.0);
        let seconds = |gbps: f64| match gbps > 0.0 {
            true => Some(bytes / (gbps * 1e9)),
            false => None,
        };
        let host = seconds(self.host_bandwidth_gbps);
        // A disk block reaches the device through host memory, as vLLM's tiering promotes a
        // secondary tier's blocks: its read, then the host copy.
        let disk = seconds(self.disk_bandwidth_gbps).map(|d| d + host.unwrap_or(0.0));
        let external = seconds(self.external_bandwidth_gbps);
        [host, disk, external].map(|load| match load {
            Some(load) => (1.0 - load / recompute).max(0.0),
            None => 0.0,
        })
    }
}

/// Blocks of `c`'s lower-tier run past the first `have` blocks of the request, each counted
/// at its tier's credit: the run starts where the device prefix ends.
pub fn loaded_blocks(c: &Candidate, have: u32, credits: [f64; 3]) -> f64 {
    let mut at = c.overlap_blocks;
    let mut loaded = 0.0;
    for (blocks, credit) in c.tier_blocks.into_iter().zip(credits) {
        let end = at + blocks;
        loaded += f64::from(end.saturating_sub(have.max(at))) * credit;
        at = end;
    }
    loaded
}

/// A candidate's cache as the cost sees it: its capacity in blocks, when it reports one, and
/// how full its index is (1 when the capacity is unknown).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Fill {
    pub(crate) total: Option<f64>,
    pub(crate) fullness: f64,
    /// Blocks the cache holds nothing in yet (0 when its capacity is unknown).
    pub(crate) free_blocks: f64,
}

impl Fill {
    pub(crate) fn of(c: &Candidate) -> Self {
        let total = c.load.kv_total_blocks.filter(|&t| t > 0).map(|t| t as f64);
        Self {
            total,
            fullness: total.map_or(1.0, |t| (c.tree_size as f64 / t).min(1.0)),
            free_blocks: total.map_or(0.0, |t| (t - c.tree_size as f64).max(0.0)),
        }
    }

    /// Of `tokens` stored, those that do not fit in the free room: what storing them evicts.
    pub(crate) fn overflow(self, tokens: f64, block_size: usize) -> f64 {
        (tokens - self.free_blocks * block_size as f64).max(0.0)
    }
}

/// Blocks a request of `num_blocks` takes on `c` while it runs: every one is referenced (cached
/// ones too) except those already in flight there, plus one for its first output token.
pub(crate) fn blocks_needed(c: &Candidate, num_blocks: usize) -> usize {
    num_blocks.saturating_sub(c.inflight_prefix_blocks as usize) + 1
}

/// The share of `c`'s cache its running requests hold (its reported KV usage when its
/// capacity is unknown).
pub(crate) fn kv_share(c: &Candidate, fill: Fill) -> f64 {
    match fill.total {
        Some(t) => (c.active.blocks as f64 / t).min(1.0),
        None => c.load.kv_cache_usage.unwrap_or(0.0),
    }
}

/// The cost's terms, each in tokens of prefill work, shared by the `kv` cost and the pair
/// cost's decode side (`pairs.rs`), so there is one definition of each.
impl KvConfig {
    /// `evict_i`: what storing `tokens` more evicts.
    pub(crate) fn evict_tokens(&self, tokens: f64, fill: Fill) -> f64 {
        self.eviction_weight * tokens * fill.fullness
    }

    /// `decode_i`: the decode work running there, by its share of the cache (or its tokens,
    /// when the capacity is unknown).
    pub(crate) fn decode_tokens(&self, c: &Candidate, fill: Fill, block_size: usize) -> f64 {
        match fill.total {
            Some(t) => self.decode_full_cache_tokens * (c.active.blocks as f64 / t).min(1.0),
            None => self.decode_weight * (c.active.blocks * block_size) as f64,
        }
    }

    /// `wait_i`: every block of a request of `num_blocks` is referenced while it runs (cached
    /// ones too), except those already in flight there, plus one for its first output token;
    /// past the capacity it waits for memory.
    pub(crate) fn wait_tokens(&self, c: &Candidate, fill: Fill, num_blocks: usize) -> f64 {
        let needs = blocks_needed(c, num_blocks);
        match fill.total {
            Some(t) if (c.active.blocks + needs) as f64 > t => self.memory_wait_tokens,
            _ => 0.0,
        }
    }

    /// `lora_i`: what running the request's adapter on a candidate adds, in prefill tokens
    /// (nothing when `priced` is off: the adapter-blind baseline). A load holds up the
    /// engine's step: every request there still waiting for its first token waits for it
    /// too, so it counts once for this request and once for each of them.
    pub(crate) fn adapter_tokens(&self, c: &Candidate, priced: bool) -> f64 {
        let held = 1.0 + c.active.prefilling as f64;
        match (priced, c.adapter) {
            (false, _) | (true, AdapterFit::Resident) => 0.0,
            (true, AdapterFit::Load) => self.adapter_load_tokens * held,
            (true, AdapterFit::LoadEvicting) => {
                self.adapter_load_tokens * held + self.adapter_evict_tokens
            }
            (true, AdapterFit::Wait) => self.adapter_wait_tokens,
        }
    }

    /// Tokens of prefill work as seconds.
    pub(crate) fn seconds(&self, tokens: f64) -> f64 {
        tokens / self.prefill_tokens_per_s.max(1.0)
    }
}

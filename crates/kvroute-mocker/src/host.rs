//! Host memory below the GPU cache, as vLLM's offloading connector keeps it with its CPU
//! backend (`OffloadingConnector`, `kv_offload/cpu`), with Dynamo's mocker's flag names:
//!
//! - **Stores write through.** Every block the GPU cache stores is copied to host memory as
//!   it is computed (vLLM offloads a request's blocks as they fill), announced as
//!   `BlockStored` with medium `CPU`; the copy outlives the GPU block.
//! - **Least recently used goes first.** A block stored or loaded is touched, a request's
//!   blocks in reverse order (as vLLM touches them), so a prefix outlives its tails. Evictions
//!   are announced as `BlockRemoved` with medium `CPU`.
//! - **Loads.** A request admitted with a GPU prefix of `g` blocks loads the host blocks that
//!   follow it, while they are consecutive (vLLM's lookup from the end of the GPU hit),
//!   instead of computing them. They count as cached tokens, as vLLM counts them.
//! - **Time.** A load of `n` blocks takes `n x block bytes / h2d bandwidth`. By default it
//!   runs beside the steps and the request waits for it, as vLLM loads asynchronously and
//!   Dynamo's mocker times it; `--tier-loads sync` makes it hold up the step that admits the
//!   request instead ([`crate::loads`]). Stores are asynchronous in vLLM and take no step time
//!   here.
//! - **Storage below host memory** (`--num-storage-blocks`, `--storage-bandwidth-gbps`), as
//!   vLLM 0.33's tiering manager keeps a secondary tier (`kv_offload/tiering`): every block
//!   stored to host memory is cascaded to storage too, announced with medium `STORAGE`, and
//!   evicted from it least recently used first. A block the lookup finds in storage and not
//!   in host memory is promoted through host memory (vLLM's staged promotion: secondary tiers
//!   cannot reach the GPU), so its load takes the storage read and then the host-to-device
//!   copy, and it is in host memory again afterwards.

use std::collections::BTreeSet;
use std::time::Duration;

use kvroute_core::SequenceHash;
use rustc_hash::FxHashMap;

/// The host tier's settings (`--num-host-blocks` and Dynamo's bandwidth flags).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct HostConfig {
    /// Blocks of host memory; 0: no host tier.
    pub num_blocks: usize,
    /// Host-to-device bandwidth (GB/s, decimal) of a load.
    pub h2d_gbps: f64,
    /// Device-to-host bandwidth (GB/s) of a store (stores take no step time; kept for the
    /// report and for Dynamo's flag).
    pub d2h_gbps: f64,
    /// KV bytes per token: a block is `kv_bytes_per_token x block size` bytes.
    pub kv_bytes_per_token: f64,
    /// Blocks of storage below host memory; 0: none (it needs a host tier).
    pub storage_blocks: usize,
    /// Bandwidth (GB/s) of reading a block from storage into host memory.
    pub storage_gbps: f64,
    /// Bandwidth (GB/s) of loading a block from the shared store (`--store-url`,
    /// [`crate::store`]) into the GPU cache.
    pub store_gbps: f64,
    /// Whether a load runs beside the steps or inside the admitting one ([`crate::loads`]).
    pub loads: crate::loads::TierLoads,
}

impl Default for HostConfig {
    /// No host tier; Dynamo's mocker's default bandwidths (32 GB/s host, 10 GB/s for its disk
    /// tier), 128 KiB per token, and a shared store over 100 Gb/s Ethernet (12.5 GB/s, the
    /// router's `external_bandwidth_gbps`).
    fn default() -> Self {
        Self {
            num_blocks: 0,
            h2d_gbps: 32.0,
            d2h_gbps: 32.0,
            kv_bytes_per_token: 131_072.0,
            storage_blocks: 0,
            storage_gbps: 10.0,
            store_gbps: 12.5,
            loads: crate::loads::TierLoads::Async,
        }
    }
}

impl HostConfig {
    /// Host memory: its blocks, loaded at the host-to-device bandwidth.
    pub(crate) fn host_tier(&self) -> Tier {
        Tier::new(self.num_blocks, self.h2d_gbps, self.kv_bytes_per_token)
    }

    /// Storage: its blocks, read at the storage bandwidth (then copied like host blocks).
    pub(crate) fn storage_tier(&self) -> Tier {
        Tier::new(self.storage_tier_blocks(), self.storage_gbps, self.kv_bytes_per_token)
    }

    /// The shared store as the engine loads from it (it holds no blocks here: the store does).
    pub(crate) fn store_tier(&self) -> Tier {
        Tier::new(0, self.store_gbps, self.kv_bytes_per_token)
    }

    /// Blocks of storage in use: none without host memory above it.
    pub fn storage_tier_blocks(&self) -> usize {
        if self.num_blocks > 0 { self.storage_blocks } else { 0 }
    }
}

/// What a tier has done since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TierStats {
    /// Blocks loaded from it (into the GPU cache; from storage, through host memory).
    pub loaded_blocks: u64,
    /// Prompt tokens served from it (part of the cached tokens).
    pub hit_tokens: u64,
    /// Blocks evicted from it.
    pub evicted_blocks: u64,
}

/// A tier below the GPU cache (host memory, or storage below it): blocks by last touch.
#[derive(Debug)]
pub(crate) struct Tier {
    num_blocks: usize,
    load_gbps: f64,
    kv_bytes_per_token: f64,
    stamps: FxHashMap<SequenceHash, u64>,
    /// Blocks by last touch, oldest first.
    order: BTreeSet<(u64, SequenceHash)>,
    clock: u64,
    pub(crate) stats: TierStats,
}

impl Tier {
    pub(crate) fn new(num_blocks: usize, load_gbps: f64, kv_bytes_per_token: f64) -> Self {
        Self {
            num_blocks,
            load_gbps,
            kv_bytes_per_token,
            stamps: FxHashMap::default(),
            order: BTreeSet::new(),
            clock: 0,
            stats: TierStats::default(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.num_blocks > 0
    }

    pub(crate) fn holds(&self, block: &SequenceHash) -> bool {
        self.stamps.contains_key(block)
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Touches blocks of one request, last first (so its first block is the most recent).
    pub(crate) fn touch(&mut self, blocks: &[SequenceHash]) {
        for &s in blocks.iter().rev() {
            if let Some(stamp) = self.stamps.get_mut(&s) {
                self.order.remove(&(*stamp, s));
                self.clock += 1;
                *stamp = self.clock;
                self.order.insert((self.clock, s));
            }
        }
    }

    /// Stores blocks of one request (in its order): the positions in `blocks` of those it
    /// did not hold go to `new`, what it evicted for them to `evicted`.
    pub(crate) fn store(
        &mut self,
        blocks: &[SequenceHash],
        new: &mut Vec<usize>,
        evicted: &mut Vec<SequenceHash>,
    ) {
        if !self.enabled() {
            return;
        }
        for (i, &s) in blocks.iter().enumerate() {
            if self.stamps.contains_key(&s) {
                continue;
            }
            while self.stamps.len() >= self.num_blocks {
                let Some((_, victim)) = self.order.pop_first() else { break };
                self.stamps.remove(&victim);
                self.stats.evicted_blocks += 1;
                evicted.push(victim);
            }
            self.stamps.insert(s, 0);
            new.push(i);
        }
        self.touch(blocks);
    }

    /// How long loading `blocks` blocks of `block_size` tokens from it takes.
    pub(crate) fn load_time(&self, blocks: usize, block_size: usize) -> Duration {
        let bytes = blocks as f64 * block_size as f64 * self.kv_bytes_per_token;
        match self.load_gbps > 0.0 {
            true => Duration::from_secs_f64(bytes / (self.load_gbps * 1e9)),
            false => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(xs: &[u64]) -> Vec<SequenceHash> {
        xs.iter().copied().map(SequenceHash).collect()
    }

    #[test]
    fn a_full_host_tier_evicts_the_tails_it_touched_least_recently() {
        let mut host = HostConfig { num_blocks: 4, ..HostConfig::default() }.host_tier();
        let (mut new, mut gone) = (Vec::new(), Vec::new());
        host.store(&seq(&[1, 2, 3]), &mut new, &mut gone);
        assert_eq!((new.clone(), gone.clone()), (vec![0, 1, 2], vec![]));
        // Two more blocks of another request: the first request's tail (3) goes first.
        new.clear();
        host.store(&seq(&[7, 8]), &mut new, &mut gone);
        assert_eq!((new, gone), (vec![0, 1], seq(&[3])));
        let held: Vec<bool> = seq(&[1, 2, 3, 7, 8]).iter().map(|s| host.holds(s)).collect();
        assert_eq!(held, [true, true, false, true, true]);
        assert_eq!(host.len(), 4);
    }

    #[test]
    fn a_load_takes_its_bytes_over_the_bandwidth() {
        let config = HostConfig { num_blocks: 1, storage_blocks: 8, ..HostConfig::default() };
        // 100 blocks of 16 tokens x 128 KiB at 32 GB/s, and from storage at 10.
        let want = 100.0 * 16.0 * 131_072.0 / 32e9;
        assert!((config.host_tier().load_time(100, 16).as_secs_f64() - want).abs() < 1e-9);
        let want = 100.0 * 16.0 * 131_072.0 / 10e9;
        assert!((config.storage_tier().load_time(100, 16).as_secs_f64() - want).abs() < 1e-9);
        // Storage needs host memory above it (vLLM's secondary tiers need the CPU tier).
        let alone = HostConfig { num_blocks: 0, storage_blocks: 8, ..HostConfig::default() };
        assert!(!alone.storage_tier().enabled());
    }
}

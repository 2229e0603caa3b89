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
//! - **Time.** A load of `n` blocks takes `n x block bytes / h2d bandwidth` and holds up the
//!   step that admits the request (vLLM loads asynchronously and schedules the request when
//!   its load is done; holding the step is the simpler, slightly pessimistic model). Stores
//!   are asynchronous in vLLM and take no step time here.

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
}

impl Default for HostConfig {
    /// No host tier; Dynamo's mocker's default bandwidths (32 GB/s) and 128 KiB per token.
    fn default() -> Self {
        Self { num_blocks: 0, h2d_gbps: 32.0, d2h_gbps: 32.0, kv_bytes_per_token: 131_072.0 }
    }
}

/// What the host tier has done since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostStats {
    /// Blocks loaded into the GPU cache from host memory.
    pub loaded_blocks: u64,
    /// Prompt tokens served from host memory (part of the cached tokens).
    pub hit_tokens: u64,
    /// Blocks evicted from host memory.
    pub evicted_blocks: u64,
}

#[derive(Debug)]
pub(crate) struct HostTier {
    config: HostConfig,
    stamps: FxHashMap<SequenceHash, u64>,
    /// Blocks by last touch, oldest first.
    order: BTreeSet<(u64, SequenceHash)>,
    clock: u64,
    pub(crate) stats: HostStats,
}

impl HostTier {
    pub(crate) fn new(config: HostConfig) -> Self {
        Self {
            config,
            stamps: FxHashMap::default(),
            order: BTreeSet::new(),
            clock: 0,
            stats: HostStats::default(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.config.num_blocks > 0
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.stamps.len()
    }

    /// How many blocks of `seq` from `from` on it holds without a gap, at most `max`.
    pub(crate) fn run(&self, seq: &[SequenceHash], from: usize, max: usize) -> usize {
        seq.iter().skip(from).take(max).take_while(|s| self.stamps.contains_key(s)).count()
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
            while self.stamps.len() >= self.config.num_blocks {
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

    /// How long loading `blocks` blocks of `block_size` tokens takes.
    pub(crate) fn load_time(&self, blocks: usize, block_size: usize) -> Duration {
        let bytes = blocks as f64 * block_size as f64 * self.config.kv_bytes_per_token;
        match self.config.h2d_gbps > 0.0 {
            true => Duration::from_secs_f64(bytes / (self.config.h2d_gbps * 1e9)),
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
        let mut host = HostTier::new(HostConfig { num_blocks: 4, ..HostConfig::default() });
        let (mut new, mut gone) = (Vec::new(), Vec::new());
        host.store(&seq(&[1, 2, 3]), &mut new, &mut gone);
        assert_eq!((new.clone(), gone.clone()), (vec![0, 1, 2], vec![]));
        // Two more blocks of another request: the first request's tail (3) goes first.
        new.clear();
        host.store(&seq(&[7, 8]), &mut new, &mut gone);
        assert_eq!((new, gone), (vec![0, 1], seq(&[3])));
        assert_eq!(host.run(&seq(&[1, 2, 3]), 0, 9), 2);
        assert_eq!(host.run(&seq(&[1, 2, 3]), 1, 9), 1);
        assert_eq!(host.run(&seq(&[1, 2, 3]), 0, 1), 1);
        assert_eq!(host.len(), 4);
    }

    #[test]
    fn a_load_takes_its_bytes_over_the_bandwidth() {
        let host = HostTier::new(HostConfig { num_blocks: 1, ..HostConfig::default() });
        // 100 blocks of 16 tokens x 128 KiB at 32 GB/s.
        let want = 100.0 * 16.0 * 131_072.0 / 32e9;
        assert!((host.load_time(100, 16).as_secs_f64() - want).abs() < 1e-9);
    }
}

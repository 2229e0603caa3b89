//! Where an admitted request's blocks come from besides the GPU cache: the sliding-window
//! group's hit, host memory, storage and the shared store (their loads and their time), and
//! a prefill engine's KV for a decode leg.

use std::time::Duration;

use kvroute_core::SequenceHash;

use super::events::*;
use super::state::Engine;
use crate::kv::Stored;
use crate::sequence::{Block, Sequence};

/// Where a block loaded from below the GPU comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    Host,
    /// Storage, promoted through host memory.
    Storage,
    Store,
}

impl Engine {
    /// A prompt's cache hit given its `full_hits` leading full-attention blocks: as far as
    /// the sliding-window group can serve it too ([`crate::window::hit`]), with the window
    /// blocks the hit uses; `(full_hits, None)` for a model without a window.
    pub(super) fn window_hit(
        &self,
        hashes: &[SequenceHash],
        full_hits: usize,
    ) -> (usize, Option<std::ops::Range<usize>>) {
        let Some(window) = self.config.sliding_window else { return (full_hits, None) };
        let bs = self.config.block_size.tokens();
        let need = crate::window::blocks_needed(window, bs);
        let hit = crate::window::hit(full_hits, need, |i| self.cache.holds(1, hashes[i]));
        (hit, Some(hit.saturating_sub(need)..hit))
    }

    /// Loads the blocks that follow a request's `hits` GPU blocks (at most up to block
    /// `max`) from the tiers below into the GPU cache, as cached blocks of the request,
    /// announced on the GPU again: a run of blocks each in host memory, or else in storage
    /// (promoted through host memory, where it is stored again), or else in the shared
    /// store (as it held them when the engine asked). Returns how many, and how long their
    /// loads take; 0 without a tier or room.
    pub(super) fn load_from_tiers(
        &mut self,
        s: &mut Sequence,
        hashes: &[SequenceHash],
        hits: usize,
        max: usize,
        events: &mut Events,
    ) -> (usize, Duration) {
        let bs = self.config.block_size.tokens();
        let run = self.tier_run(&s.in_store, hashes, hits, max);
        let n = run.len();
        if n == 0 || !self.adopt(s, &hashes[hits..hits + n], hits, events) {
            return (0, Duration::ZERO);
        }
        let promoted: Vec<usize> =
            (0..n).filter(|&j| run[j] == Source::Storage).map(|j| hits + j).collect();
        let from_store = run.iter().filter(|&&r| r == Source::Store).count();
        self.store.stats.loaded_blocks += from_store as u64;
        self.store.stats.hit_tokens += (from_store * bs) as u64;
        let in_host = n - promoted.len() - from_store;
        self.host.touch(&hashes[hits..hits + n]);
        self.host.stats.loaded_blocks += in_host as u64;
        self.host.stats.hit_tokens += (in_host * bs) as u64;
        if !promoted.is_empty() {
            let blocks: Vec<SequenceHash> = promoted.iter().map(|&b| hashes[b]).collect();
            self.storage.touch(&blocks);
            self.storage.stats.loaded_blocks += blocks.len() as u64;
            self.storage.stats.hit_tokens += (blocks.len() * bs) as u64;
            store_in(&mut self.host, bs, s, &promoted, &blocks, CPU, events);
        }
        (n, self.run_time(&run))
    }

    /// Where each block after the GPU prefix of `hits` blocks (up to `max`) would load from,
    /// while consecutive: host memory, else storage, else the shared store (as it held them
    /// when the engine asked).
    pub(super) fn tier_run(
        &self,
        in_store: &[bool],
        hashes: &[SequenceHash],
        hits: usize,
        max: usize,
    ) -> Vec<Source> {
        let from = |b: usize| match (self.host.holds(&hashes[b]), self.storage.holds(&hashes[b])) {
            (true, _) => Some(Source::Host),
            (false, true) => Some(Source::Storage),
            (false, false) if in_store.get(b).copied().unwrap_or(false) => Some(Source::Store),
            (false, false) => None,
        };
        (hits..max.min(hashes.len())).map_while(from).collect()
    }

    /// How long loading `run` takes (a storage block is read, then copied from host memory).
    pub(super) fn run_time(&self, run: &[Source]) -> Duration {
        let bs = self.config.block_size.tokens();
        let count = |src| run.iter().filter(|&&r| r == src).count();
        let (storage, store) = (count(Source::Storage), count(Source::Store));
        self.host.load_time(run.len() - store, bs)
            + self.storage.load_time(storage, bs)
            + self.store.load_time(store, bs)
    }

    /// With loads beside the steps, the time the front request's load takes, if its prompt
    /// continues below the GPU and it has not loaded yet; its blocks there are touched, so
    /// they outlive the load.
    pub(super) fn start_load(
        &mut self,
        hashes: &[SequenceHash],
        hits: usize,
        max: usize,
    ) -> Option<Duration> {
        let front = self.waiting.front()?;
        if self.config.host.loads != crate::loads::TierLoads::Async || front.reserved > 0 {
            return None;
        }
        let run = self.tier_run(&front.in_store, hashes, hits, max);
        if run.is_empty() {
            return None;
        }
        let took = self.run_time(&run);
        let blocks = &hashes[hits..hits + run.len()];
        self.host.touch(blocks);
        self.storage.touch(blocks);
        Some(took)
    }

    /// Takes the prompt blocks after a decode request's `hits` local ones as received from
    /// its prefill engine (all but the last token's block, which the engine computes, as
    /// vLLM's decode side does): cached blocks of the request, announced on the GPU.
    /// Returns how many; 0 without room.
    pub(super) fn receive_remote(
        &mut self,
        s: &mut Sequence,
        hashes: &[SequenceHash],
        hits: usize,
        events: &mut Events,
    ) -> usize {
        let bs = self.config.block_size.tokens();
        let n = ((s.len() - 1) / bs).min(hashes.len()).saturating_sub(hits);
        if n == 0 || !self.adopt(s, &hashes[hits..hits + n], hits, events) {
            return 0;
        }
        self.stats.remote_tokens += (n * bs) as u64;
        n
    }

    /// Allocates blocks for `hashes` (the request's blocks from `first` on, known computed)
    /// and caches them as the request's; the new ones are announced on the GPU. False
    /// without room.
    pub(super) fn adopt(
        &mut self,
        s: &mut Sequence,
        hashes: &[SequenceHash],
        first: usize,
        events: &mut Events,
    ) -> bool {
        let mut gone = Vec::new();
        if self.cache.grow(hashes.len(), &mut gone).is_err() {
            return false;
        }
        self.stats.evicted_blocks += gone.len() as u64;
        events.removed(&gone);
        let mut announced = Vec::with_capacity(hashes.len());
        for (b, &h) in hashes.iter().enumerate() {
            match self.cache.fill(0, h) {
                Stored::New => {
                    s.blocks.push(Block::Cached(h));
                    announced.push(first + b);
                }
                Stored::Duplicate => s.blocks.push(Block::Private),
            }
        }
        events.stored_runs(self.config.block_size.tokens(), s, &announced, GPU, 0);
        true
    }
}

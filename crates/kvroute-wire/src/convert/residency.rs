//! Where each block a TensorRT-LLM stream stored sits now (see `trtllm.rs`): what the engine
//! no longer says when it moves or removes a block.

use std::collections::HashMap;

use kvroute_core::{LocalBlockHash, StorageTier};

/// Blocks a stream remembers (about 50 bytes each: 25 MiB at the bound, an engine holding
/// half a million blocks across its levels).
pub const MAX_REMEMBERED: usize = 1 << 19;

/// TensorRT-LLM's cache level as a tier: 0 device memory, 1 host memory, 2 and up disk.
pub(super) fn tier_of(level: u32) -> StorageTier {
    match level {
        0 => StorageTier::Device,
        1 => StorageTier::HostPinned,
        _ => StorageTier::Disk,
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Remembered {
    pub(super) parent: Option<u64>,
    pub(super) tokens_hash: LocalBlockHash,
    pub(super) level: u32,
}

/// The blocks one TensorRT-LLM stream stored, by attention rank and engine hash.
#[derive(Clone, Debug, Default)]
pub(crate) struct Residency {
    pub(super) blocks: HashMap<(u32, u64), Remembered>,
}

impl Residency {
    pub(super) fn remember(&mut self, key: (u32, u64), block: Remembered) {
        if self.blocks.len() < MAX_REMEMBERED || self.blocks.contains_key(&key) {
            self.blocks.insert(key, block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_stops_at_its_bound_but_keeps_what_it_holds_current() {
        let mut r = Residency::default();
        let block = |level| Remembered { parent: None, tokens_hash: LocalBlockHash(1), level };
        for h in 0..MAX_REMEMBERED as u64 {
            r.remember((0, h), block(0));
        }
        r.remember((0, u64::MAX), block(0));
        assert_eq!(r.blocks.len(), MAX_REMEMBERED);
        assert!(!r.blocks.contains_key(&(0, u64::MAX)));
        // A block it holds is still updated at the bound.
        r.remember((0, 7), block(1));
        assert_eq!(r.blocks[&(0, 7)].level, 1);
    }
}

//! TensorRT-LLM's events into core events, and where each block of a stream sits.
//!
//! TensorRT-LLM keeps a block under one hash wherever it is: offloading it to host memory
//! (`offloadBlock`) or bringing it back (`onboardBlock`) announces only `updated` with the
//! `cache_level` before and after, and a later `removed` names the hash at whatever level the
//! block has reached. The index keeps the device (a tree) and the lower tiers (by sequence
//! hash) apart, so a move becomes a removal from the old tier and a store in the new one, and a
//! removal goes to the tier the block is in. Both need what the engine no longer says: the
//! block's content hash, its parent and its level, which [`super::residency::Residency`] remembers for every
//! block the stream stored (up to [`super::residency::MAX_REMEMBERED`] per stream; past that a block is still
//! indexed, but a move of it is skipped and counted as `moved_unknown`).

use kvroute_core::hash::mm_hash_from_identifier;
use kvroute_core::{
    BlockHasher, DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, StorageTier,
};

use super::converter::Converter;
use super::residency::{Remembered, tier_of};
use crate::trtllm::{TrtBlock, TrtData, TrtDiff, TrtEvent};

fn event(id: u64, data: KvCacheEventData, tier: StorageTier) -> KvCacheEvent {
    let mut e = KvCacheEvent::new(id, data, DpRank(0));
    e.storage_tier = tier;
    e
}

impl Converter {
    /// A TensorRT-LLM event: the core events it makes (none for events that do not touch the
    /// index, two for a move), appended to `out`. At rank 0, as [`Self::vllm_batch`].
    pub fn trtllm_event(&mut self, e: &TrtEvent, out: &mut Vec<KvCacheEvent>) {
        let rank = e.attention_dp_rank.unwrap_or(0);
        match &e.data {
            TrtData::Stored { parent_hash, blocks } => {
                if let Some(stored) = self.trt_stored(rank, *parent_hash, blocks, e.event_id) {
                    out.push(stored);
                }
            }
            TrtData::Removed { block_hashes } => {
                self.stats.blocks_removed += block_hashes.len() as u64;
                // One removal per tier the blocks are in, in the order the tiers first appear.
                let mut by_tier: Vec<(StorageTier, Vec<ExternalBlockHash>)> = Vec::new();
                for &h in block_hashes {
                    let tier = self
                        .trt
                        .blocks
                        .remove(&(rank, h))
                        .map_or(StorageTier::Device, |r| tier_of(r.level));
                    if !tier.is_device() {
                        self.stats.lower_tier += 1;
                    }
                    match by_tier.iter_mut().find(|(t, _)| *t == tier) {
                        Some((_, hashes)) => hashes.push(ExternalBlockHash(h)),
                        None => by_tier.push((tier, vec![ExternalBlockHash(h)])),
                    }
                }
                for (tier, block_hashes) in by_tier {
                    let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes });
                    out.push(event(e.event_id, data, tier));
                }
            }
            TrtData::Updated { block_hash, cache_level: Some(TrtDiff { new_value, .. }) } => {
                self.trt_moved(rank, *block_hash, *new_value, e.event_id, out);
            }
            TrtData::Created {} | TrtData::Updated { .. } | TrtData::Other => {
                self.stats.other_events += 1;
            }
        }
    }

    /// Blocks stored at one level (the first block's; the rest of the event stops at a block
    /// of another level or size, since a dropped block breaks the chain).
    fn trt_stored(
        &mut self,
        rank: u32,
        parent_hash: Option<u64>,
        blocks: &[TrtBlock],
        id: u64,
    ) -> Option<KvCacheEvent> {
        let level = |b: &TrtBlock| b.cache_level.unwrap_or(0);
        let bs = self.config.block_size.tokens();
        let hasher = BlockHasher::new(self.config.block_size);
        let first = blocks.first().map_or(0, level);
        let tier = tier_of(first);
        let mut out = Vec::with_capacity(blocks.len());
        let mut parent = parent_hash;
        for (i, b) in blocks.iter().enumerate() {
            let rest = (blocks.len() - i) as u64;
            if level(b) != first {
                self.stats.skipped_medium += rest;
                break;
            }
            if b.tokens.len() != bs {
                self.stats.wrong_block_size += rest;
                self.stats.seen_block_size = u32::try_from(b.tokens.len()).ok();
                break;
            }
            let ids: Vec<u64> = b.tokens.iter().map(|t| t.token_id).collect();
            let images: Vec<u64> =
                b.mm_keys.iter().map(|k| mm_hash_from_identifier(&k.hash)).collect();
            let block = self.block(&hasher, b.block_hash, &ids, &images);
            let remembered = Remembered { parent, tokens_hash: block.tokens_hash, level: first };
            self.trt.remember((rank, b.block_hash), remembered);
            parent = Some(b.block_hash);
            out.push(block);
        }
        if out.is_empty() {
            return None;
        }
        self.stats.blocks_stored += out.len() as u64;
        if !tier.is_device() {
            self.stats.lower_tier += out.len() as u64;
        }
        let data = KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent_hash.map(ExternalBlockHash),
            blocks: out,
        });
        Some(event(id, data, tier))
    }

    /// A block moved to level `to`: out of the tier the stream last put it in, into the new
    /// one, under its parent (which the engine moves first when it onboards a prefix).
    fn trt_moved(&mut self, rank: u32, hash: u64, to: u32, id: u64, out: &mut Vec<KvCacheEvent>) {
        let Some(block) = self.trt.blocks.get_mut(&(rank, hash)) else {
            self.stats.moved_unknown += 1;
            return;
        };
        let (from, into) = (tier_of(block.level), tier_of(to));
        block.level = to;
        if from == into {
            self.stats.other_events += 1;
            return;
        }
        self.stats.moved += 1;
        let removed = KvCacheRemoveData { block_hashes: vec![ExternalBlockHash(hash)] };
        out.push(event(id, KvCacheEventData::Removed(removed), from));
        let stored = KvCacheStoreData {
            parent_hash: block.parent.map(ExternalBlockHash),
            blocks: vec![KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(hash),
                tokens_hash: block.tokens_hash,
                mm_extra_info: None,
            }],
        };
        out.push(event(id, KvCacheEventData::Stored(stored), into));
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::index::{IndexConfig, ShardedIndex};
    use kvroute_core::{BlockSize, RouterEvent, WorkerWithDpRank};
    use proptest::prelude::*;

    use super::*;
    use crate::ConvertConfig;
    use crate::trtllm::TrtToken;

    const CHAIN: usize = 6;

    /// What TensorRT-LLM may do to one chain of blocks, each kept in device (0) or host (1)
    /// memory: its blocks exist from the root up (a child is freed before its parent), a block
    /// is stored or onboarded only under a parent on the device, and any device block may be
    /// offloaded.
    #[derive(Clone, Debug)]
    enum Op {
        StoreNext,
        Offload(usize),
        Onboard(usize),
        RemoveLast,
    }

    fn trt(id: u64, data: TrtData) -> TrtEvent {
        TrtEvent { event_id: id, data, window_size: None, attention_dp_rank: None }
    }

    fn stored(i: usize) -> TrtData {
        let tokens = (0..4).map(|t| TrtToken { token_id: (i * 4 + t) as u64, token_extra_id: 0 });
        let block = TrtBlock {
            block_hash: 500 + i as u64,
            tokens: tokens.collect(),
            mm_keys: vec![],
            cache_level: Some(0),
            lora_id: None,
        };
        let parent_hash = i.checked_sub(1).map(|p| 500 + p as u64);
        TrtData::Stored { parent_hash, blocks: vec![block] }
    }

    fn moved(i: usize, old_value: u32, new_value: u32) -> TrtData {
        let cache_level = Some(TrtDiff { old_value, new_value });
        TrtData::Updated { block_hash: 500 + i as u64, cache_level }
    }

    /// The engine's event for `op` on `levels` (the model, updated), if the op is possible.
    fn play(op: &Op, levels: &mut Vec<u32>) -> Option<TrtData> {
        let parent_on_device = |i: usize| i == 0 || levels[i - 1] == 0;
        match *op {
            Op::StoreNext if levels.len() < CHAIN && parent_on_device(levels.len()) => {
                levels.push(0);
                Some(stored(levels.len() - 1))
            }
            Op::Offload(i) if levels.get(i) == Some(&0) => {
                levels[i] = 1;
                Some(moved(i, 0, 1))
            }
            Op::Onboard(i) if levels.get(i) == Some(&1) && parent_on_device(i) => {
                levels[i] = 0;
                Some(moved(i, 1, 0))
            }
            Op::RemoveLast if !levels.is_empty() => {
                levels.pop();
                Some(TrtData::Removed { block_hashes: vec![500 + levels.len() as u64] })
            }
            _ => None,
        }
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::StoreNext),
            2 => (0..CHAIN).prop_map(Op::Offload),
            2 => (0..CHAIN).prop_map(Op::Onboard),
            1 => Just(Op::RemoveLast),
        ]
    }

    proptest! {
        /// After every event, the index holds each block in the tier the engine has it in,
        /// and a lookup of the whole chain gives the device prefix and then the host run.
        #[test]
        fn the_index_follows_each_block_to_its_level(ops in prop::collection::vec(op(), 1..60)) {
            let bs = BlockSize::new(4).unwrap();
            let mut c = Converter::new(ConvertConfig::new(bs));
            let index = ShardedIndex::new(1, IndexConfig::default());
            let worker = WorkerWithDpRank::new(1u64, 0u32);
            let tokens: Vec<u32> = (0..(CHAIN * 4) as u32).collect();
            let query = BlockHasher::new(bs).local_hashes(&tokens, None);
            let mut levels = Vec::new();
            let mut out = Vec::new();
            for (id, op) in ops.iter().enumerate() {
                let Some(data) = play(op, &mut levels) else { continue };
                c.trtllm_event(&trt(id as u64, data), &mut out);
                for e in out.drain(..) {
                    prop_assert_eq!(index.apply_event(&RouterEvent::new(1u64, e)), Ok(()));
                }
                let on_device = levels.iter().filter(|&&l| l == 0).count();
                let on_host = levels.iter().filter(|&&l| l == 1).count();
                prop_assert_eq!(index.tree_size(worker), on_device, "{:?} after {:?}", levels, op);
                let host = index.lower_tier_sizes().first().map_or(0, |(_, t)| t[0]);
                prop_assert_eq!(host, on_host, "{:?}", levels);
                let prefix = levels.iter().take_while(|&&l| l == 0).count();
                let run = levels[prefix..].iter().take_while(|&&l| l == 1).count();
                let found = index.find_matches(&query);
                let got = found.score(worker);
                let tiers = found.tiers.as_ref().map_or([0; 3], |t| t.run(worker, got));
                prop_assert_eq!((got as usize, tiers[0] as usize), (prefix, run), "{:?}", levels);
            }
            prop_assert_eq!(c.stats().moved_unknown, 0);
        }
    }
}

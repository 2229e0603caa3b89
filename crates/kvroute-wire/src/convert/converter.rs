//! The converter of one stream: its settings, its counts, and vLLM's and SGLang's events
//! into core events (TensorRT-LLM's are `trtllm_stream.rs`).

use kvroute_core::hash::mm_hash_from_identifier;
use kvroute_core::{
    BlockExtraInfo, BlockHasher, BlockMmObjectInfo, BlockSize, DpRank, ExternalBlockHash,
    GroupKind, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, StorageTier,
};
use serde::{Deserialize, Serialize};

/// Where an event's blocks go: their tier, cache group and the group's kind.
type Place = (StorageTier, u32, Option<GroupKind>);
use crate::vllm::{BlockRemoved, BlockStored, EngineEvent, ExtraKey, KvEventBatch};

use super::residency::Residency;

/// What the converter must know about a worker's model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvertConfig {
    pub block_size: BlockSize,
    /// The model's image pad token id, which the front door writes at image positions.
    pub image_token_id: Option<u32>,
    /// The model's vocabulary size: ids at or above it are image placeholders.
    pub vocab_size: Option<u32>,
}

impl ConvertConfig {
    pub fn new(block_size: BlockSize) -> Self {
        Self { block_size, image_token_id: None, vocab_size: None }
    }
}

/// What conversion kept and skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConvertStats {
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    /// Blocks of a medium no engine defines.
    pub skipped_medium: u64,
    /// Blocks stored or removed below the device (host, disk, a shared store), kept in the
    /// index's lower tiers; counted in `blocks_stored`/`blocks_removed` too.
    pub lower_tier: u64,
    /// Blocks of a hybrid model's cache group of a kind not modelled (or below the device).
    pub skipped_group: u64,
    /// Blocks whose size is not the configured block size.
    pub wrong_block_size: u64,
    /// The last such size seen (what the engine is configured with).
    pub seen_block_size: Option<u32>,
    /// Events whose fields did not fit together.
    pub malformed: u64,
    /// Events of types that do not touch the index (or that this version does not know).
    pub other_events: u64,
    /// Blocks moved from one tier to another under the same engine hash (TensorRT-LLM's
    /// `updated` with a new `cache_level`), each a removal and a store.
    pub moved: u64,
    /// Moves of blocks the stream never stored (or no longer remembers), skipped.
    pub moved_unknown: u64,
}

impl ConvertStats {
    /// Every count with its name (the `outcome` label of
    /// `kvroute_router_converted_blocks_total`): the one list of the counts, which adding and
    /// the metrics both read.
    pub fn counts(&self) -> [(&'static str, u64); 11] {
        [
            ("stored", self.blocks_stored),
            ("removed", self.blocks_removed),
            ("cleared", self.clears),
            ("lower_tier", self.lower_tier),
            ("skipped_medium", self.skipped_medium),
            ("skipped_group", self.skipped_group),
            ("wrong_block_size", self.wrong_block_size),
            ("malformed_event", self.malformed),
            ("other_event", self.other_events),
            ("moved", self.moved),
            ("moved_unknown", self.moved_unknown),
        ]
    }

    fn counts_mut(&mut self) -> [&mut u64; 11] {
        [
            &mut self.blocks_stored,
            &mut self.blocks_removed,
            &mut self.clears,
            &mut self.lower_tier,
            &mut self.skipped_medium,
            &mut self.skipped_group,
            &mut self.wrong_block_size,
            &mut self.malformed,
            &mut self.other_events,
            &mut self.moved,
            &mut self.moved_unknown,
        ]
    }
}

impl std::ops::AddAssign for ConvertStats {
    fn add_assign(&mut self, other: Self) {
        for (mine, (_, theirs)) in self.counts_mut().into_iter().zip(other.counts()) {
            *mine = mine.saturating_add(theirs);
        }
        self.seen_block_size = other.seen_block_size.or(self.seen_block_size);
    }
}

/// One stream's conversion: its model's settings, what it counted, and (for TensorRT-LLM)
/// where each block it stored sits now.
#[derive(Clone, Debug)]
pub struct Converter {
    pub(super) config: ConvertConfig,
    pub(super) stats: ConvertStats,
    pub(super) trt: Residency,
}

impl Converter {
    pub fn new(config: ConvertConfig) -> Self {
        Self { config, stats: ConvertStats::default(), trt: Default::default() }
    }

    pub fn stats(&self) -> ConvertStats {
        self.stats
    }

    /// What was counted since the last call (one message's counts, for a stream's converter).
    pub fn take_stats(&mut self) -> ConvertStats {
        std::mem::take(&mut self.stats)
    }

    /// A vLLM/SGLang batch. Batches carry no event ids: every event gets the batch's ZMQ
    /// sequence number. Events come out at rank 0: which rank they belong to is the
    /// [`crate::pipeline::Pipeline`]'s to say.
    pub fn vllm_batch(&mut self, batch: &KvEventBatch, seq: u64) -> Vec<KvCacheEvent> {
        let dp_rank = DpRank(0);
        let mut out = Vec::with_capacity(batch.events.len());
        for event in &batch.events {
            let data = match event {
                EngineEvent::BlockStored(s) => self.vllm_stored(s),
                EngineEvent::BlockRemoved(r) => self.vllm_removed(r),
                EngineEvent::AllBlocksCleared => {
                    self.stats.clears += 1;
                    Some((KvCacheEventData::Cleared, (StorageTier::Device, 0, None)))
                }
                EngineEvent::Unknown { .. } => {
                    self.stats.other_events += 1;
                    None
                }
                EngineEvent::Malformed { .. } => {
                    self.stats.malformed += 1;
                    None
                }
            };
            if let Some((data, place)) = data {
                let mut e = KvCacheEvent::new(seq, data, dp_rank);
                (e.storage_tier, e.group, e.group_kind) = place;
                out.push(e);
            }
        }
        out
    }

    /// The tier blocks of this `medium` and `locality` live in, or `None` (counted) for a
    /// medium nobody defines or a cache group other than the first.
    /// Where blocks of this `medium`, `locality` and cache group go, or `None` (counted) for
    /// a medium nobody defines, a group kind not modelled or a lower tier of a group beyond
    /// the first. A group's kind comes with its stores (`kind`); removals have none.
    pub(crate) fn place(
        &mut self,
        (medium, locality): (Option<&str>, Option<&str>),
        group: Option<u32>,
        kind: Option<(&str, Option<u32>)>,
        blocks: usize,
    ) -> Option<Place> {
        let Some(tier) = StorageTier::from_medium(medium, locality) else {
            self.stats.skipped_medium += blocks as u64;
            return None;
        };
        let group = group.unwrap_or(0);
        let group_kind = kind.and_then(|(k, w)| GroupKind::from_vllm(k, w));
        let unmodelled = kind.is_some() && group_kind.is_none();
        if group != 0 && (unmodelled || !tier.is_device()) {
            self.stats.skipped_group += blocks as u64;
            return None;
        }
        if !tier.is_device() {
            self.stats.lower_tier += blocks as u64;
        }
        Some((tier, group, if group == 0 { None } else { group_kind }))
    }

    fn vllm_stored(&mut self, s: &BlockStored) -> Option<(KvCacheEventData, Place)> {
        let n = s.block_hashes.len();
        let medium = (s.medium.as_deref(), s.locality.as_deref());
        let kind = s.kv_cache_spec_kind.as_deref().map(|k| (k, s.kv_cache_spec_sliding_window));
        let place = self.place(medium, s.group_idx, kind, n)?;
        if s.block_size != self.config.block_size.get() {
            self.stats.wrong_block_size += n as u64;
            self.stats.seen_block_size = Some(s.block_size);
            return None;
        }
        let bs = self.config.block_size.tokens();
        if s.token_ids.len() != n * bs || n == 0 {
            self.stats.malformed += 1;
            return None;
        }
        let hasher = BlockHasher::new(self.config.block_size)
            .with_lora(s.lora_name.as_deref())
            .with_namespace(s.cache_salt.as_deref());
        let blocks = s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
            .map(|(i, (&hash, ids))| {
                let keys = s.extra_keys.as_ref().and_then(|k| k.get(i)).and_then(Option::as_ref);
                let images: Vec<u64> = keys
                    .into_iter()
                    .flatten()
                    .filter_map(|k| match k {
                        ExtraKey::Mm(id, _) => Some(mm_hash_from_identifier(id)),
                        _ => None,
                    })
                    .collect();
                self.block(&hasher, hash, ids, &images)
            })
            .collect();
        self.stats.blocks_stored += n as u64;
        let parent_hash = s.parent_block_hash.map(ExternalBlockHash);
        Some((KvCacheEventData::Stored(KvCacheStoreData { parent_hash, blocks }), place))
    }

    fn vllm_removed(&mut self, r: &BlockRemoved) -> Option<(KvCacheEventData, Place)> {
        let n = r.block_hashes.len();
        let medium = (r.medium.as_deref(), r.locality.as_deref());
        let place = self.place(medium, r.group_idx, None, n)?;
        self.stats.blocks_removed += n as u64;
        let block_hashes = r.block_hashes.iter().copied().map(ExternalBlockHash).collect();
        Some((KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }), place))
    }

    /// One block: placeholders normalised, images attached, content hashed.
    ///
    /// Images come from the engine's names for them (`named`, in order) matched to the runs
    /// of image tokens in the block; placeholder runs with no name (SGLang) are named by their
    /// pad value.
    pub(crate) fn block(
        &self,
        hasher: &BlockHasher,
        hash: u64,
        ids: &[u64],
        named: &[u64],
    ) -> KvCacheStoredBlockData {
        let pad = self.config.image_token_id;
        let is_placeholder = |t: u64| {
            t > u64::from(u32::MAX) || self.config.vocab_size.is_some_and(|v| t >= u64::from(v))
        };
        let mut tokens = Vec::with_capacity(ids.len());
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (value, start, end)
        for (i, &t) in ids.iter().enumerate() {
            let image = is_placeholder(t) || pad.is_some_and(|p| t == u64::from(p));
            tokens.push(if is_placeholder(t) { pad.unwrap_or(t as u32) } else { t as u32 });
            if !image {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.0 == t && run.2 == i => run.2 = i + 1,
                _ => runs.push((t, i, i + 1)),
            }
        }
        let mut objects: Vec<BlockMmObjectInfo> = named
            .iter()
            .enumerate()
            .map(|(k, &mm_hash)| {
                let offsets = runs.get(k).map_or(vec![(0, ids.len())], |&(_, s, e)| vec![(s, e)]);
                BlockMmObjectInfo { mm_hash, offsets }
            })
            .collect();
        if named.is_empty() {
            objects.extend(
                runs.iter().filter(|r| is_placeholder(r.0)).map(|&(value, s, e)| {
                    BlockMmObjectInfo { mm_hash: value, offsets: vec![(s, e)] }
                }),
            );
        }
        let info = (!objects.is_empty()).then_some(BlockExtraInfo { mm_objects: objects });
        KvCacheStoredBlockData {
            block_hash: ExternalBlockHash(hash),
            tokens_hash: hasher.hash_block(&tokens, info.as_ref()),
            mm_extra_info: info,
        }
    }
}

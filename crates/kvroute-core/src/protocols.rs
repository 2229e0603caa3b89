//! Identifiers and KV-cache events, in the JSON shapes Dynamo's router uses.
//!
//! Four kinds of block identity meet in a router, and mixing them up is the classic bug:
//!
//! ```text
//!  tokens  [t0 .. t15][t16 .. t31][t32 .. t47]       one block = kv_block_size tokens
//!               │           │           │
//!  LocalBlockHash    L0          L1          L2       xxh3(tokens [+ image hashes]) : content of ONE block
//!               │           │           │
//!  SequenceHash      S0 ───────▶ S1 ───────▶ S2       S_i = xxh3(S_{i-1} ‖ L_i)    : the whole prefix
//!
//!  ExternalBlockHash  E0          E1          E2       whatever the engine calls the block; opaque, per
//!                                                       worker (vLLM's may differ between instances)
//!  WorkerWithDpRank   (worker 7, rank 0)               who holds it
//! ```
//!
//! The index is keyed by `LocalBlockHash` under its parent (so the path from the root *is* the
//! sequence), and uses each worker's `ExternalBlockHash` only to find the node an event talks about.

use std::fmt;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use crate::Error;

mod ids;

pub use ids::{
    DpRank, ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerId, WorkerWithDpRank,
};

/// Tokens per KV block. Never zero: a zero block size is rejected where it enters
/// ([`BlockSize::new`]), so nothing downstream can divide by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct BlockSize(NonZeroU32);

impl BlockSize {
    pub fn new(tokens: u32) -> Result<Self, Error> {
        NonZeroU32::new(tokens).map(Self).ok_or(Error::ZeroBlockSize)
    }

    pub fn get(self) -> u32 {
        self.0.get()
    }

    /// The block size as a `usize`, for slicing.
    pub fn tokens(self) -> usize {
        self.0.get() as usize
    }
}

impl Default for BlockSize {
    /// 16 tokens, kvroute's default (docs/running.md).
    fn default() -> Self {
        Self(NonZeroU32::new(16).expect("16 is not zero"))
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = Error;
    fn try_from(v: u32) -> Result<Self, Error> {
        Self::new(v)
    }
}

impl From<BlockSize> for u32 {
    fn from(b: BlockSize) -> u32 {
        b.get()
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a worker keeps a block: its device memory, or a tier below it that the engine loads
/// blocks back from (docs/routing.md, "Tiers"). Names as Dynamo's `StorageTier`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    /// GPU memory: what the engine's prefix cache serves directly.
    #[default]
    Device,
    /// Host (CPU) memory: vLLM's offloading connector, SGLang's HiCache host tier,
    /// TensorRT-LLM's secondary level.
    HostPinned,
    /// Local disk or file system.
    Disk,
    /// A store outside the engine that every worker can load from (LMCache, Mooncake's
    /// store, SGLang's HiCache storage layer): a block there serves any worker.
    External,
}

impl StorageTier {
    /// The tiers below the device, cheapest to load from first.
    pub const LOWER: [StorageTier; 3] = [Self::HostPinned, Self::Disk, Self::External];

    pub fn is_device(&self) -> bool {
        *self == Self::Device
    }

    /// The tier an engine names by its `medium` (vLLM, SGLang) and `locality`: the names
    /// vLLM 0.33 and Dynamo use, case-insensitive. `None` for a medium nobody defines.
    pub fn from_medium(medium: Option<&str>, locality: Option<&str>) -> Option<Self> {
        if locality.is_some_and(|l| l.eq_ignore_ascii_case("remote")) {
            return Some(Self::External);
        }
        let Some(m) = medium else { return Some(Self::Device) };
        let is = |names: &[&str]| names.iter().any(|n| m.eq_ignore_ascii_case(n));
        if is(&["GPU", "DEVICE"]) {
            Some(Self::Device)
        } else if is(&["CPU", "CPU_PINNED", "CPU_TIER1", "HOST"]) {
            Some(Self::HostPinned)
        } else if is(&["STORAGE", "DISK", "NVME", "CPU_TIER2", "FILE"]) {
            Some(Self::Disk)
        } else if is(&["EXTERNAL", "NETWORK", "REMOTE", "SHARED"]) {
            Some(Self::External)
        } else {
            None
        }
    }

    /// The tier's name in metrics and on the status page.
    pub fn name(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::HostPinned => "host",
            Self::Disk => "disk",
            Self::External => "external",
        }
    }
}

/// What a hybrid model's KV cache group keeps (vLLM's `kv_cache_spec_kind`): a prefix hits
/// only as far as every group can serve it (`crate::index::HybridGroups`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Every block of the prefix.
    FullAttention,
    /// Only the blocks inside the window (tokens) before the hit's end.
    SlidingWindow { window: u32 },
    /// State at checkpoints only: a hit ends at a block whose state was kept.
    Mamba,
}

impl GroupKind {
    /// From vLLM's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`; `None` for a kind
    /// the router does not model.
    pub fn from_vllm(kind: &str, window: Option<u32>) -> Option<Self> {
        match kind {
            "full_attention" => Some(Self::FullAttention),
            "sliding_window" => {
                window.filter(|&w| w > 0).map(|window| Self::SlidingWindow { window })
            }
            "mamba" | "linear_attention" => Some(Self::Mamba),
            _ => None,
        }
    }
}

/// One KV-cache event from one worker, as Dynamo's router carries it.
///
/// JSON: `{"event_id":1,"data":{"stored":{..}},"dp_rank":0}`, `"data":{"removed":{..}}`,
/// `"data":"cleared"`. `dp_rank` defaults to 0 when absent; `storage_tier` to the device (and
/// is left out for it). Dynamo carries the tier on its `RouterEvent`; here it rides with the
/// event, since one engine batch mixes tiers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    pub event_id: u64,
    pub data: KvCacheEventData,
    #[serde(default)]
    pub dp_rank: DpRank,
    #[serde(default, skip_serializing_if = "StorageTier::is_device")]
    pub storage_tier: StorageTier,
    /// A hybrid model's KV cache group (0: the first, full attention), and what the group
    /// keeps (stores name it; removals need not).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub group: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_kind: Option<GroupKind>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl KvCacheEvent {
    /// An event about the device tier of the first cache group.
    pub fn new(event_id: u64, data: KvCacheEventData, dp_rank: impl Into<DpRank>) -> Self {
        Self {
            event_id,
            data,
            dp_rank: dp_rank.into(),
            storage_tier: StorageTier::Device,
            group: 0,
            group_kind: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheEventData {
    Stored(KvCacheStoreData),
    Removed(KvCacheRemoveData),
    Cleared,
}

impl KvCacheEventData {
    /// How many blocks it stores or removes (none for a clear).
    pub fn blocks(&self) -> usize {
        match self {
            Self::Stored(d) => d.blocks.len(),
            Self::Removed(d) => d.block_hashes.len(),
            Self::Cleared => 0,
        }
    }
}

/// Blocks newly filled, in order, each the child of the one before; the first is the child of
/// `parent_hash` (the engine's id of a block this worker already holds), or of the root if `None`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoreData {
    pub parent_hash: Option<ExternalBlockHash>,
    pub blocks: Vec<KvCacheStoredBlockData>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoredBlockData {
    /// The engine's id of this block (opaque, per worker).
    pub block_hash: ExternalBlockHash,
    /// The router's hash of the block's content, computed by [`crate::hash`].
    pub tokens_hash: LocalBlockHash,
    #[serde(default)]
    pub mm_extra_info: Option<BlockExtraInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheRemoveData {
    pub block_hashes: Vec<ExternalBlockHash>,
}

/// A [`KvCacheEvent`] and the worker it came from. Read also in Dynamo's shape, whose
/// `storage_tier` sits here rather than in the event (it wins when both say).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "RouterEventWire")]
pub struct RouterEvent {
    pub worker_id: WorkerId,
    pub event: KvCacheEvent,
}

#[derive(Deserialize)]
struct RouterEventWire {
    worker_id: WorkerId,
    event: KvCacheEvent,
    #[serde(default)]
    storage_tier: Option<StorageTier>,
}

impl From<RouterEventWire> for RouterEvent {
    fn from(w: RouterEventWire) -> Self {
        let mut event = w.event;
        if let Some(tier) = w.storage_tier {
            event.storage_tier = tier;
        }
        Self { worker_id: w.worker_id, event }
    }
}

impl RouterEvent {
    pub fn new(worker_id: impl Into<WorkerId>, event: KvCacheEvent) -> Self {
        Self { worker_id: worker_id.into(), event }
    }

    /// The cache this event is about.
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank { worker_id: self.worker_id, dp_rank: self.event.dp_rank }
    }
}

/// One multimodal object (an image) inside one block. `offsets` are half-open `[start, end)`
/// token ranges relative to the block's first token; they are informative and not hashed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockMmObjectInfo {
    pub mm_hash: u64,
    #[serde(default)]
    pub offsets: Vec<(usize, usize)>,
}

/// What, besides tokens, decides a block's content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockExtraInfo {
    #[serde(default)]
    pub mm_objects: Vec<BlockMmObjectInfo>,
}

/// One multimodal object in a whole request; `offsets` are half-open token ranges of the request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RequestMmObjectInfo {
    pub mm_hash: u64,
    #[serde(default)]
    pub offsets: Vec<(usize, usize)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RequestExtraInfo {
    #[serde(default)]
    pub mm_objects: Vec<RequestMmObjectInfo>,
}

impl RequestExtraInfo {
    /// Cuts request-level ranges into per-block infos: one entry per block of `total_tokens`
    /// (a trailing partial block included), `None` where no object touches the block.
    ///
    /// Each range `[s, e)` is clipped to `[0, total_tokens)`; empty or reversed ranges are
    /// dropped. A piece that falls in block `b` becomes block-local offsets in
    /// `[0, block_size]`, and pieces of one `mm_hash` in one block merge into one object, in
    /// order of first appearance.
    ///
    /// ```
    /// use kvroute_core::{BlockSize, RequestExtraInfo, RequestMmObjectInfo};
    /// let req = RequestExtraInfo {
    ///     mm_objects: vec![RequestMmObjectInfo { mm_hash: 7, offsets: vec![(2, 6)] }],
    /// };
    /// let blocks = req.to_block_level(BlockSize::new(4).unwrap(), 10);
    /// assert_eq!(blocks.len(), 3);
    /// assert_eq!(blocks[0].as_ref().unwrap().mm_objects[0].offsets, vec![(2, 4)]);
    /// assert_eq!(blocks[1].as_ref().unwrap().mm_objects[0].offsets, vec![(0, 2)]);
    /// assert!(blocks[2].is_none());
    /// ```
    pub fn to_block_level(
        &self,
        block_size: BlockSize,
        total_tokens: usize,
    ) -> Vec<Option<BlockExtraInfo>> {
        let bs = block_size.tokens();
        let mut blocks: Vec<Option<BlockExtraInfo>> = vec![None; total_tokens.div_ceil(bs)];
        for object in &self.mm_objects {
            for &(start, end) in &object.offsets {
                let end = end.min(total_tokens);
                if start >= end {
                    continue;
                }
                // Invariant: every block index visited is < blocks.len(), since
                // start < end <= total_tokens.
                for (index, block) in
                    blocks.iter_mut().enumerate().take(end.div_ceil(bs)).skip(start / bs)
                {
                    let block_start = index * bs;
                    let piece = (
                        start.max(block_start) - block_start,
                        end.min(block_start + bs) - block_start,
                    );
                    let info = block.get_or_insert_with(BlockExtraInfo::default);
                    match info.mm_objects.iter_mut().find(|o| o.mm_hash == object.mm_hash) {
                        Some(existing) => existing.offsets.push(piece),
                        None => info.mm_objects.push(BlockMmObjectInfo {
                            mm_hash: object.mm_hash,
                            offsets: vec![piece],
                        }),
                    }
                }
            }
        }
        blocks
    }
}

#[cfg(test)]
mod tests;

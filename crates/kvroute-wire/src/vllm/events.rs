//! vLLM's KV event batch as it is on the wire (`vllm.distributed.kv_events`).

use serde::Serialize;

/// One decoded batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvEventBatch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    pub dp_rank: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum EngineEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event of a type this decoder does not know (skipped, counted).
    Unknown {
        kind: String,
    },
    /// An event whose fields could not be read (skipped, counted).
    Malformed {
        reason: &'static str,
    },
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BlockStored {
    /// The engine's block ids, as u64 (signed ones as their bits, 32-byte ones as their last
    /// 8 bytes, big-endian).
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    /// Token ids of all the blocks, in order. u64: SGLang writes image pad values above u32.
    pub token_ids: Vec<u64>,
    pub block_size: u32,
    #[serde(skip_serializing)]
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block: that block's extra keys, or `None`.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    pub cache_salt: Option<String>,
    #[serde(skip_serializing)]
    pub group_idx: Option<u32>,
    /// `LOCAL` or `REMOTE` (a store outside the engine), vLLM 0.33's offloading tiers.
    #[serde(skip_serializing)]
    pub locality: Option<String>,
    /// What the block's cache group keeps (`full_attention`, `sliding_window`, `mamba`, ...)
    /// and a sliding window's length in tokens: vLLM 0.33's hybrid allocator.
    #[serde(skip_serializing)]
    pub kv_cache_spec_kind: Option<String>,
    #[serde(skip_serializing)]
    pub kv_cache_spec_sliding_window: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    #[serde(skip_serializing)]
    pub group_idx: Option<u32>,
    #[serde(skip_serializing)]
    pub locality: Option<String>,
}

/// One of a block's extra hash keys.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ExtraKey {
    /// A multimodal object: its identifier and an offset.
    Mm(String, i64),
    /// A LoRA name or cache salt.
    Text(String),
    /// Anything else (kept opaque, not hashed).
    Other(#[serde(skip)] ()),
}

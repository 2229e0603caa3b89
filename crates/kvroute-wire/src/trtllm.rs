//! TensorRT-LLM's KV cache events, as its `KVCacheEventSerializer` writes them (the dicts of
//! `get_kv_cache_events()`), republished as JSON or MessagePack by a worker wrapper: one event
//! or a list of them. Unknown keys are ignored and unknown event types kept as `Other`.

use serde::{Deserialize, Deserializer};

use crate::WireError;
use crate::msgpack;

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TrtEvent {
    pub event_id: u64,
    pub data: TrtData,
    #[serde(default)]
    pub window_size: Option<u64>,
    #[serde(default)]
    pub attention_dp_rank: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TrtData {
    Stored {
        #[serde(default, deserialize_with = "opt_hash")]
        parent_hash: Option<u64>,
        blocks: Vec<TrtBlock>,
    },
    Removed {
        #[serde(deserialize_with = "hashes")]
        block_hashes: Vec<u64>,
    },
    Created {},
    /// A block that changed in place. TensorRT-LLM moves a block between device and host
    /// memory under its hash and says so only here (`offloadBlock`: level 0 to 1,
    /// `onboardBlock`: 1 to 0); a priority change comes with no `cache_level`.
    Updated {
        #[serde(deserialize_with = "hash")]
        block_hash: u64,
        #[serde(default)]
        cache_level: Option<TrtDiff>,
    },
    #[serde(other)]
    Other,
}

/// `_event_diff_to_json`: a field's value before and after.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct TrtDiff {
    pub old_value: u32,
    pub new_value: u32,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TrtBlock {
    #[serde(deserialize_with = "hash")]
    pub block_hash: u64,
    pub tokens: Vec<TrtToken>,
    #[serde(default)]
    pub mm_keys: Vec<TrtMmKey>,
    /// 0 is device memory (the only level that enters the index); 1 and up are offloaded.
    #[serde(default)]
    pub cache_level: Option<u32>,
    #[serde(default)]
    pub lora_id: Option<i64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
pub struct TrtToken {
    pub token_id: u64,
    #[serde(default)]
    pub token_extra_id: u64,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TrtMmKey {
    /// The image's hash, 64 hex digits.
    pub hash: String,
    /// Position of the block's first image token inside the image (not hashed).
    #[serde(default)]
    pub start_offset: u64,
}

/// Block hashes arrive as Python ints: unsigned or signed 64-bit (taken as their bits).
fn hash<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum AnyInt {
        U(u64),
        I(i64),
    }
    Ok(match AnyInt::deserialize(d)? {
        AnyInt::U(u) => u,
        AnyInt::I(i) => i as u64,
    })
}

fn opt_hash<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrap(#[serde(deserialize_with = "hash")] u64);
    Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
}

fn hashes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrap(#[serde(deserialize_with = "hash")] u64);
    Ok(Vec::<Wrap>::deserialize(d)?.into_iter().map(|w| w.0).collect())
}

/// Decodes JSON: one event object or a list of them.
pub fn decode_json(bytes: &[u8]) -> Result<Vec<TrtEvent>, WireError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)?;
    from_json(value)
}

/// Decodes MessagePack: one event map or a list of them.
pub fn decode_msgpack(bytes: &[u8]) -> Result<Vec<TrtEvent>, WireError> {
    from_json(msgpack::decode(bytes)?.to_json())
}

fn from_json(value: serde_json::Value) -> Result<Vec<TrtEvent>, WireError> {
    Ok(match value {
        serde_json::Value::Array(_) => serde_json::from_value(value)?,
        other => vec![serde_json::from_value(other)?],
    })
}

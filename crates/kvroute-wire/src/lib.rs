//! Engine KV-event wire formats, decoded tolerantly and converted into kvroute-core events.
//!
//! ```text
//!  ZMQ frames ──split_frames──▶ payload ──vllm::decode_batch──▶ KvEventBatch ─┐
//!  TRT-LLM JSON/msgpack ──trtllm::decode_*──▶ Vec<TrtEvent> ──────────────────┼─▶ Converter ─▶ KvCacheEvent
//!  kvroute JSON ──decode_router_events──▶ Vec<RouterEvent> (already core events)│
//! ```
//!
//! Wire types mirror each engine's layout; [`convert::Converter`] is the one bridge into core
//! types, and [`pipeline::Pipeline`] the one way from a socket's frames to events (one
//! decoder per [`EventFormat`]). Every decoder takes untrusted bytes and returns an error, never panics (property
//! tests feed them garbage and mutated real payloads). The encoder writes vLLM's map form, for
//! kvroute's simulated engine and the Python publisher.

#![forbid(unsafe_code)]

pub mod convert;
pub mod msgpack;
pub mod pipeline;
#[cfg(feature = "publisher")]
pub mod publisher;
pub mod replica;
#[cfg(feature = "zmq")]
pub mod transport;
pub mod trtllm;
pub mod vllm;
mod vllm_fast;

pub use convert::{ConvertConfig, ConvertStats, Converter};
use kvroute_core::RouterEvent;
pub use pipeline::{Decoded, EventFormat, Framed, Framing, Pipeline, UnknownFormat};
pub use vllm::{BlockRemoved, BlockStored, EngineEvent, ExtraKey, KvEventBatch};

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("bad MessagePack: {0}")]
    Msgpack(&'static str),
    #[error("unexpected structure: {0}")]
    Shape(&'static str),
    #[error("a KV event message has 2 or 3 frames, not {0}")]
    Frames(usize),
    #[error("the sequence frame has 8 bytes, not {0}")]
    Sequence(usize),
    #[error("bad JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// kvroute's native form: Dynamo's `RouterEvent` JSON, one object or a list.
pub fn decode_router_events(bytes: &[u8]) -> Result<Vec<RouterEvent>, WireError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)?;
    Ok(match value {
        serde_json::Value::Array(_) => serde_json::from_value(value)?,
        other => vec![serde_json::from_value(other)?],
    })
}

/// The `extra_keys` entry a publisher writes for an image of `mm_hash` starting at
/// `offset_in_block` (maps back to the same `mm_hash` through the identifier rule).
pub fn publisher_mm_key(mm_hash: u64, offset_in_block: i64) -> ExtraKey {
    ExtraKey::Mm(format!("{mm_hash:016x}"), offset_in_block)
}

/// A block's images as `extra_keys`, in the publisher form.
pub fn publisher_extra_keys(info: &kvroute_core::BlockExtraInfo) -> Vec<ExtraKey> {
    info.mm_objects
        .iter()
        .map(|o| publisher_mm_key(o.mm_hash, o.offsets.first().map_or(0, |r| r.0 as i64)))
        .collect()
}

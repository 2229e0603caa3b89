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
mod error;
pub mod msgpack;
mod native;
pub mod pipeline;
#[cfg(feature = "publisher")]
pub mod publisher;
pub mod replica;
#[cfg(feature = "zmq")]
pub mod transport;
pub mod trtllm;
pub mod vllm;

pub use convert::{ConvertConfig, ConvertStats, Converter};
pub use error::WireError;
pub use native::decode_router_events;
pub use pipeline::{Decoded, EventFormat, Framed, Framing, Pipeline, UnknownFormat};
pub use vllm::{
    BlockRemoved, BlockStored, EngineEvent, ExtraKey, KvEventBatch, publisher_extra_keys,
    publisher_mm_key,
};

//! kvroute's simulated engine: a GPU-free worker whose cache behaves like vLLM's (paged,
//! prefix-cached, LRU-evicting), whose scheduler batches like vLLM's (continuous batching,
//! chunked prefill, preemption), and whose steps take the time Dynamo's mocker model says, on
//! a simulated clock so tests run fast and exactly. It reports real cache hits (the ground
//! truth of benchmarks) and emits vLLM-format KV events.
//!
//! This crate is the engine core; its OpenAI API, ZMQ publishing and `kvroute mocker` come
//! with the simulated-engine issue.

pub mod engine;
mod kv;
pub mod timing;

pub use engine::{
    Engine, EngineConfig, EngineError, EngineRequest, EngineStats, Output, Step, Usage,
};
pub use timing::Timing;

#[cfg(test)]
mod tests;

//! Seeded, reproducible workloads with token-exact prompts.
//!
//! Every request carries the prompt as the engine will see it: the token ids (text workloads
//! send them as ids to `/v1/completions`, so nothing is lost to a tokenizer round trip) or,
//! for images, the chat messages plus the tokens and block hashes the shared preprocessor
//! derives from them. Multi-turn requests are chat turns: each resends the conversation with
//! the server's own answers, so their prompts are known only when sent; the harness derives
//! their tokens then, with the same preprocessor. From the block hashes (prompts' and those
//! the answers fill) the harness computes the best achievable cache hit rate (see
//! [`crate::stats`]).
//!
//! Arrivals are open loop: a Poisson process at a given rate, drawn once, so every policy of
//! a run sees the same schedule. Multi-turn rounds are the exception by nature: a user's next
//! round leaves a (pre-drawn) think time after the previous answer arrived.

mod draw;
mod kind;
mod lora;
mod request;
mod synthetic;
mod tenants;
mod trace;

pub use draw::{
    exponential, extended_blocks, generated_png, poisson_arrivals, random_tokens, token_blocks,
};
pub use kind::WorkloadKind;
pub use lora::{MultiLora, adapter_name, sessions};
pub use request::{BenchRequest, Prompt, RequestTag, Start, Workload};
pub use synthetic::{LongPrompts, MultiTurn, Multimodal, RandomPrompts, SharedPrefix};
pub use tenants::{CLASSES, Class, INTERACTIVE_SLO_MS, tenants_overload};
pub use trace::{TRACE_BLOCK_TOKENS, TraceReplay};

#[cfg(test)]
mod tests;

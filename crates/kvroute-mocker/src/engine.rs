//! The simulated engine's scheduler, stepped on a simulated clock. It follows the vLLM
//! scheduler as Dynamo 1.6.1's mocker simulates it (`aisimulate-core` 0.13,
//! `engine/scheduler/vllm/core.rs` and `policy.rs`), step by step:
//!
//! 1. **Running requests, in admission order**, each get `min(unscheduled tokens, budget)`
//!    of the step's token budget (`max_batched_tokens`): one token for a decoding request, a
//!    chunk for one still prefilling. Blocks are allocated for exactly the tokens scheduled; a
//!    request that cannot get one preempts the newest running request (LIFO, recompute:
//!    its blocks freed, it goes back to the front of the queue), itself if it is the newest.
//! 2. **Waiting requests, first come first served**, while the budget lasts, fewer than
//!    `max_num_seqs` run and nothing was preempted in this step: a request is admitted when its
//!    known tokens' blocks, less its cached prefix blocks that running requests already hold,
//!    fit in the blocks running requests do not hold (cached blocks nobody holds are evicted
//!    as needed, least recently freed first, a request's tail before its prefix); otherwise it
//!    and every later one wait. There is no free-block watermark (vLLM v1 and Dynamo's vLLM
//!    path keep none). Its cached prefix is at most `(len - 1) / block_size` blocks: the last
//!    token is always computed, for its logits.
//! 3. **Time**: the step lasts the prefill time of the prompt tokens it computed,
//!    `poly(count x (mean isl - mean prefix))` over the requests that computed prompt tokens,
//!    plus, when some request decodes, a decode step at `p = min(1, sum of the decoding
//!    requests' lengths / KV capacity in tokens)` (logical tokens: a shared prefix counts once
//!    per request). A request whose prompt completes in the step samples its first token from
//!    that forward pass: it adds no decode time.
//! 4. **Outputs** at the end of the step: every request whose known tokens are all computed
//!    samples one token (its KV is computed by the next step, so a finished request's last
//!    token is never cached). Full computed blocks, prompt or generated, are cached and
//!    announced as `BlockStored` the moment the scheduler fills them, evictions as
//!    `BlockRemoved`, in the order they happen.
//!
//! Deliberate differences from Dynamo's mocker: the generated tokens are words of the model's
//! vocabulary chosen by the prompt and the seed (see [`OutputPlan`]), not synthetic ids, so a
//! client can send the answer back; host memory below the GPU cache is vLLM's offloading
//! connector's ([`crate::host`]), not Dynamo's model of it; Dynamo's other features beyond a
//! single vLLM worker (disk tiers, speculative decoding, disaggregation, data-parallel
//! cadence) are not simulated.

pub use crate::disagg::{DisaggConfig, Handoff, Role};
pub use crate::host::HostConfig;
pub use crate::lora::{LoraConfig, LoraStats};
pub use crate::sequence::OutputPlan;

mod events;
mod state;
mod step;
mod tiers;
mod types;

pub use state::Engine;
pub use types::{
    AdapterCounts, EngineConfig, EngineError, EngineRequest, EngineStats, Output, SchedulingPolicy,
    Step, Usage,
};

//! Dynamo's KV router cost, kept exact so benchmarks can compare against it.
//!
//! For each candidate: `prefill_blocks = (max(0, isl - credit * bs) + inflight_prefill) / bs`,
//! where `credit` = the device overlap plus Dynamo's fixed credits for the blocks after it in
//! host memory (0.75), on disk (0.25) and in a shared pool (0.5),
//! `decode_blocks` = the candidate's distinct in-flight blocks plus this request's blocks it
//! does not have in flight, `cost = overlap_weight * prefill_blocks + decode_blocks`; lowest
//! wins, or a softmax at a temperature (see [`super::pick_by_cost`]).
//!
//! The decode term is why it scatters a shared prefix: the worker that holds a prefix also runs
//! that prefix's requests, so its decode blocks grow and a cold worker soon looks cheaper.

use super::cost::DYNAMO_TIER_WEIGHTS;
use super::{Candidate, Policy, RequestInfo};

#[derive(Clone, Copy, Debug, Default)]
pub struct DynamoPolicy;

/// Dynamo's cost of sending `request` to `c`.
pub fn cost(request: &RequestInfo, c: &Candidate) -> f64 {
    let bs = request.block_size;
    let lower: f64 =
        c.tier_blocks.iter().zip(DYNAMO_TIER_WEIGHTS).map(|(&n, w)| f64::from(n) * w).sum();
    let credit = f64::from(c.overlap_blocks) + lower;
    let new_tokens = (request.isl_tokens as f64 - credit * bs as f64).max(0.0);
    let prefill_blocks = (new_tokens + c.active.prefill_tokens as f64) / bs as f64;
    let lacking = request.num_blocks.saturating_sub(c.inflight_prefix_blocks as usize);
    let decode_blocks = (c.active.blocks + lacking) as f64;
    request.overlap_weight * prefill_blocks + decode_blocks
}

impl Policy for DynamoPolicy {
    fn name(&self) -> &'static str {
        "dynamo"
    }

    fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Option<Vec<f64>> {
        Some(candidates.iter().map(|c| cost(request, c)).collect())
    }

    fn cost_unit(&self) -> Option<&'static str> {
        Some("blocks")
    }
}

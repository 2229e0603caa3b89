//! Baseline: the power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
//! Load Balancing", 2001) on in-flight tokens: of two random candidates, the one with fewer
//! prefill tokens queued plus decode tokens in flight. Blind to caches.

use super::{Candidate, Policy, RequestInfo, Rng};

#[derive(Clone, Copy, Debug, Default)]
pub struct LeastLoaded;

fn inflight_tokens(c: &Candidate, block_size: usize) -> usize {
    c.active.prefill_tokens + c.active.blocks * block_size
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(&mut self, request: &RequestInfo, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let n = candidates.len();
        if n == 1 {
            return 0;
        }
        let a = rng.below(n);
        let b = (a + 1 + rng.below(n - 1)) % n; // a different one
        let load = |i: usize| inflight_tokens(&candidates[i], request.block_size);
        if load(b) < load(a) { b } else { a }
    }
}

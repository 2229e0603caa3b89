//! Baseline: a uniformly random candidate (seeded).

use super::{Candidate, Policy, RequestInfo, Rng};

#[derive(Clone, Copy, Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn blind(&self) -> bool {
        true
    }

    fn select(&mut self, _: &RequestInfo, candidates: &[Candidate], rng: &mut Rng) -> usize {
        rng.below(candidates.len())
    }
}

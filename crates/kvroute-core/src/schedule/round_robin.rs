//! Baseline: each candidate in turn, blind to caches and load.

use super::{Candidate, Policy, RequestInfo, Rng};

#[derive(Clone, Copy, Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn blind(&self) -> bool {
        true
    }

    fn select(&mut self, _: &RequestInfo, candidates: &[Candidate], _: &mut Rng) -> usize {
        let i = self.next % candidates.len();
        self.next = self.next.wrapping_add(1);
        i
    }
}

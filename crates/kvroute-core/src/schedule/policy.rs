//! What a routing policy is: a cost per candidate, the cheapest taken.

use crate::schedule::types::Candidate;
use crate::schedule::types::RequestInfo;
use crate::schedule::types::Rng;
use std::fmt;

/// Picks one of the candidates (never given an empty slice): by cost ([`Policy::costs`], the
/// lowest or a softmax sample, see [`pick_by_cost`]) or by a rule of its own
/// ([`Policy::select`], the baselines).
pub trait Policy: Send + Sync + fmt::Debug {
    fn name(&self) -> &'static str;
    /// A baseline blind to load (round-robin, random): busy workers stay candidates, so it
    /// spreads requests exactly as its name says. Load-aware policies see only idle ones.
    fn blind(&self) -> bool {
        false
    }
    /// Each candidate's cost, in order (lower is better), for a policy that prices them; the
    /// scheduler picks by [`pick_by_cost`] and shows the costs with its recent decisions.
    fn costs(&self, _request: &RequestInfo, _candidates: &[Candidate]) -> Option<Vec<f64>> {
        None
    }
    /// [`Policy::costs`] by their terms of the candidates at `which`, for a cost that has them
    /// (`kv`): the scheduler keeps them with its recent decisions (computed for the few it
    /// records, not for every candidate of every decision).
    fn cost_terms(
        &self,
        _request: &RequestInfo,
        _candidates: &[Candidate],
        _which: &[usize],
    ) -> Option<Vec<super::CostTerms>> {
        None
    }
    /// What [`Policy::costs`] counts in, for people reading them (`None`: no costs).
    fn cost_unit(&self) -> Option<&'static str> {
        None
    }
    /// Whether its costs read each candidate's learned [`Candidate::ttft_factor`].
    fn learns_ttft(&self) -> bool {
        false
    }
    /// Whether its costs price a worker's memory (the wait of a request that does not fit,
    /// what it evicts): a worker over `busy_kv_usage` then stays a candidate, priced, rather
    /// than being dropped (dropping its prefix's holder copies the prefix elsewhere, which
    /// filled the other workers in turn and spread every prefix over every worker: #65).
    fn weighs_memory(&self) -> bool {
        false
    }
    /// The choice of a policy without costs (a priced one picks by its costs).
    fn select(&mut self, request: &RequestInfo, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let costs = self.costs(request, candidates).unwrap_or_else(|| vec![0.0; candidates.len()]);
        pick_by_cost(&costs, candidates, request.temperature, rng)
    }
}

/// Picks the lowest of `costs`, or samples with a softmax at temperature `t > 0`:
/// `p_i ∝ exp(-(c_i - min) / ((max - min) * t))`, uniform when all costs are equal. Ties at
/// temperature 0 go as [`pick_near`]'s.
pub fn pick_by_cost(
    costs: &[f64],
    candidates: &[Candidate],
    temperature: f64,
    rng: &mut Rng,
) -> usize {
    pick_near(costs, candidates, temperature, &|_: &Candidate| 0.0, rng)
}

/// [`pick_by_cost`] with each candidate's cost within its `tolerance` of the lowest (a share
/// of it: the prediction's own error there) taken as equal to it. Equals go to the one running fewest requests, then
/// to the smaller tree (so new prefixes spread over the idle workers, newcomers first), then
/// to a seeded coin. What a cached prefix saves, and what copying it evicts, is in the costs
/// already: a holder is passed over only for a worker the model cannot tell from it. A
/// newcomer priced 1% above another from one first token took every new conversation for
/// 20 s while the other got none (#78).
pub fn pick_near(
    costs: &[f64],
    candidates: &[Candidate],
    temperature: f64,
    tolerance: &dyn Fn(&Candidate) -> f64,
    rng: &mut Rng,
) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if temperature > 0.0 && costs.len() > 1 {
        let weights: Vec<f64> = if max > min {
            costs.iter().map(|c| (-(c - min) / ((max - min) * temperature)).exp()).collect()
        } else {
            vec![1.0; costs.len()]
        };
        let total: f64 = weights.iter().sum();
        let mut x = rng.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        return costs.len() - 1;
    }
    let band = |i: usize| min + tolerance(&candidates[i]).max(0.0) * min.abs();
    let key = |i: usize| (candidates[i].active.requests, candidates[i].tree_size);
    let mut best: Vec<usize> = Vec::new();
    for (i, &c) in costs.iter().enumerate() {
        if c.is_nan() || c > band(i) {
            continue;
        }
        match best.first().map(|&b| key(i).cmp(&key(b))) {
            Some(std::cmp::Ordering::Greater) => continue,
            Some(std::cmp::Ordering::Less) => best.clear(),
            _ => {}
        }
        best.push(i);
    }
    match best.len() {
        0 => 0, // only NaN costs: any
        1 => best[0],
        n => best[rng.below(n)],
    }
}

//! The statistics of a run: percentiles, spread, prediction error, and the best cache hit
//! rate a workload allows.

use std::collections::{BTreeSet, HashMap, HashSet};

/// The `q`-quantile (0..=1) of `values` by linear interpolation between closest ranks (the
/// definition of numpy's default); `None` for no values. NaNs are ignored.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(quantile_sorted(&v, q))
}

/// [`quantile`] of values already sorted ascending (non-empty).
pub fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// Coefficient of variation (population standard deviation / mean); 0 when all are 0.
pub fn coefficient_of_variation(values: &[f64]) -> Option<f64> {
    let m = mean(values)?;
    if m == 0.0 {
        return Some(0.0);
    }
    let var = values.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / values.len() as f64;
    Some(var.sqrt() / m)
}

/// Mean absolute error of `predicted` against `actual`, pairwise.
pub fn mean_absolute_error(pairs: &[(f64, f64)]) -> Option<f64> {
    (!pairs.is_empty())
        .then(|| pairs.iter().map(|(p, a)| (p - a).abs()).sum::<f64>() / pairs.len() as f64)
}

/// Points of the empirical CDF of `values`, at most `max_points` of them (evenly by rank).
pub fn cdf_points(values: &[f64], max_points: usize) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 || max_points == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(max_points).max(1);
    let mut out: Vec<(f64, f64)> =
        (0..n).step_by(step).map(|i| (v[i], (i + 1) as f64 / n as f64)).collect();
    if out.last().is_none_or(|&(_, p)| p < 1.0) {
        out.push((v[n - 1], 1.0));
    }
    out
}

/// One request's blocks (sequence hashes): those it can find cached (its prompt's leading
/// full blocks, at most `(prompt tokens - 1) / block size`: the last token is always computed)
/// and those it leaves computed (its prompt's full blocks and those its answer filled).
#[derive(Clone, Copy, Debug)]
pub struct Uses<'a> {
    pub query: &'a [u64],
    pub computed: &'a [u64],
}

impl<'a> Uses<'a> {
    /// A request whose computed blocks are its query (no answer counted).
    pub fn prompt(blocks: &'a [u64]) -> Self {
        Self { query: blocks, computed: blocks }
    }
}

/// Cached tokens per request if every block ever computed stayed cached somewhere and every
/// request went where its longest computed prefix is: the leading blocks of its query that any
/// earlier request (in `order`) computed. An upper bound on any fleet's hits.
pub fn unbounded_cache_hits(requests: &[Uses<'_>], block_size: usize) -> Vec<usize> {
    let mut seen: HashSet<u64> = HashSet::new();
    requests
        .iter()
        .map(|r| {
            let hit = r.query.iter().take_while(|b| seen.contains(b)).count();
            seen.extend(r.computed.iter().copied());
            hit * block_size
        })
        .collect()
}

/// Cached tokens per request with the fleet's capacity counted: one pooled cache of
/// `capacity` blocks (every worker's blocks together, no copy held twice) that evicts the
/// block whose next use is furthest away (Belady's choice). Separate caches of the same total
/// size cannot hold more than one pooled cache, and Belady's choice is optimal for blocks
/// counted one by one (hits here only count as a leading run, where it is a close estimate
/// rather than a proof), so this is the best achievable figure a fleet is measured against
/// when its caches cannot hold the whole workload.
pub fn pooled_cache_hits(requests: &[Uses<'_>], block_size: usize, capacity: usize) -> Vec<usize> {
    // Next use of each (request, computed block): the next request whose query holds it.
    let mut next_use: Vec<Vec<usize>> =
        requests.iter().map(|r| vec![usize::MAX; r.computed.len()]).collect();
    let mut last_seen: HashMap<u64, usize> = HashMap::new();
    for (i, r) in requests.iter().enumerate().rev() {
        for (j, b) in r.computed.iter().enumerate() {
            next_use[i][j] = last_seen.get(b).copied().unwrap_or(usize::MAX);
        }
        for b in r.query.iter() {
            last_seen.insert(*b, i);
        }
    }
    // Cached blocks with their next use; ordered by (next use, hash) to find the furthest.
    let mut cached: HashMap<u64, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut hits = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        hits.push(r.query.iter().take_while(|b| cached.contains_key(b)).count() * block_size);
        for (j, &b) in r.computed.iter().enumerate() {
            if let Some(old) = cached.insert(b, next_use[i][j]) {
                by_next.remove(&(old, b));
            }
            by_next.insert((next_use[i][j], b));
        }
        while cached.len() > capacity {
            let Some((_, victim)) = by_next.pop_last() else { break };
            cached.remove(&victim);
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(quantile(&v, 0.0), Some(1.0));
        assert_eq!(quantile(&v, 1.0), Some(4.0));
        assert_eq!(quantile(&v, 0.5), Some(2.5));
        assert!((quantile(&v, 0.9).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[f64::NAN, 7.0], 0.5), Some(7.0));
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((quantile(&hundred, 0.99).unwrap() - 99.01).abs() < 1e-9);
    }

    #[test]
    fn spread_and_error() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), Some(0.0));
        // mean 2, population sd 1.
        assert!((coefficient_of_variation(&[1.0, 3.0]).unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), Some(0.0));
        assert_eq!(coefficient_of_variation(&[]), None);
        assert_eq!(mean_absolute_error(&[(3.0, 1.0), (1.0, 2.0)]), Some(1.5));
        assert_eq!(mean_absolute_error(&[]), None);
    }

    #[test]
    fn cdf_is_monotone_and_ends_at_one() {
        let v: Vec<f64> = (0..1000).rev().map(f64::from).collect();
        let pts = cdf_points(&v, 50);
        assert!(pts.len() <= 51);
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(pts.last(), Some(&(999.0, 1.0)));
        assert_eq!(pts[0], (0.0, 0.001));
        assert!(cdf_points(&[], 10).is_empty());
    }

    fn prompts<'a>(blocks: &[&'a [u64]]) -> Vec<Uses<'a>> {
        blocks.iter().map(|b| Uses::prompt(b)).collect()
    }

    #[test]
    fn unbounded_counts_leading_blocks_seen_before() {
        let a: &[u64] = &[1, 2, 3];
        let b: &[u64] = &[1, 2, 4];
        let c: &[u64] = &[9, 2, 3];
        assert_eq!(unbounded_cache_hits(&prompts(&[a, b, a, c]), 16), vec![0, 32, 48, 0]);
    }

    #[test]
    fn blocks_an_answer_filled_count_for_the_next_turn() {
        // Turn 1 asks [1, 2] and leaves [1, 2, 3] (its answer filled block 3); turn 2 asks
        // [1, 2, 3, 4].
        let turn1 = Uses { query: &[1, 2], computed: &[1, 2, 3] };
        let turn2 = Uses { query: &[1, 2, 3, 4], computed: &[1, 2, 3, 4] };
        assert_eq!(unbounded_cache_hits(&[turn1, turn2], 16), vec![0, 48]);
        assert_eq!(pooled_cache_hits(&[turn1, turn2], 16, 3), vec![0, 48]);
        // Without the answer's block only the prompt's blocks are found.
        let asked_only = Uses::prompt(&[1, 2]);
        assert_eq!(unbounded_cache_hits(&[asked_only, turn2], 16), vec![0, 32]);
    }

    #[test]
    fn pooled_keeps_what_comes_back() {
        // Capacity 3: after [1,2,3] then [7,8], Belady keeps the blocks used again soonest.
        let a: &[u64] = &[1, 2, 3];
        let b: &[u64] = &[7, 8];
        let c: &[u64] = &[1, 2];
        let hits = pooled_cache_hits(&prompts(&[a, b, c, b]), 1, 3);
        // [7,8] evicts 3 (never used again) and then one of 7/8 or 1/2: 1,2 are used next.
        assert_eq!(hits[..3], [0, 0, 2]);
        // Unlimited capacity equals the unbounded figure.
        let reqs = prompts(&[a, b, c, b, a]);
        assert_eq!(pooled_cache_hits(&reqs, 16, 1000), unbounded_cache_hits(&reqs, 16));
        // Never above the unbounded figure, whatever the capacity.
        for cap in 0..6 {
            let p = pooled_cache_hits(&reqs, 16, cap);
            let u = unbounded_cache_hits(&reqs, 16);
            assert!(p.iter().zip(&u).all(|(p, u)| p <= u), "capacity {cap}");
        }
    }
}

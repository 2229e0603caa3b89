//! What a worker's cached tokens are worth: how many times a token stored there is used again
//! before the cache lets it go, learned from the requests routed there.
//!
//! A worker's LRU cache keeps a token until as many new tokens as the cache holds have come
//! in after it. A token there is used again at rate `R / C` (`R`: tokens served from the
//! cache per second, `C`: tokens held) for that residence, `C / N` seconds (`N`: new tokens
//! stored per second). So a token evicted early loses `R / N` uses on average, each a
//! recompute: the price of evicting one is `R / N` recomputes, not one.
//!
//! ```text
//! reuse_w = (R_w + prior x fleet) / (N_w + prior)     R_w, N_w: tokens, decayed over window_s
//! fleet   = (R + prior) / (N + prior)                 R, N: the same over all workers
//!           capped at `cap`; 1 (one recompute) before anything is known
//! ```
//!
//! A worker little seen is priced as the fleet: `prior` tokens of the fleet's ratio are its
//! prior (#78: every learned number earns its weight).
//!
//! On a fleet whose groups share long system prompts, `R / N` is in the tens: spreading a
//! group over a worker whose cache holds other groups evicts what they use many times, and
//! they prefill it again, queue, and spread in turn (the collapse of #65). A worker whose
//! cache holds what nobody asks for again has `R / N` near 0, and storing there is free.

use std::time::Instant;

use crate::protocols::WorkerWithDpRank;
use rustc_hash::FxHashMap;

/// Settings of the reuse estimate (the `kv` cost's `reuse_*` weights).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReuseConfig {
    /// Seconds over which the reused and new tokens are averaged (exponentially: a token
    /// routed this long ago counts `1/e` of one routed now).
    pub window_s: f64,
    /// Most recomputes one evicted token is priced at.
    pub cap: f64,
    /// Tokens of evidence both counts start with, at the fleet's ratio (one use each for the
    /// fleet's own): a worker little seen is priced near the fleet's price.
    pub prior_tokens: f64,
}

impl ReuseConfig {
    pub fn of(kv: &super::cost::KvConfig) -> Self {
        Self { window_s: kv.reuse_window_s, cap: kv.reuse_cap, prior_tokens: kv.reuse_prior_tokens }
    }
}

impl Default for ReuseConfig {
    fn default() -> Self {
        Self::of(&super::cost::KvConfig::default())
    }
}

#[derive(Clone, Copy, Debug)]
struct Decayed {
    reused: f64,
    new: f64,
    at: Instant,
}

/// Each worker's reused and new tokens, decayed.
#[derive(Clone, Debug, Default)]
pub struct Reuse {
    config: ReuseConfig,
    workers: FxHashMap<WorkerWithDpRank, Decayed>,
    /// All workers' together.
    fleet: Option<Decayed>,
}

impl Reuse {
    pub fn new(config: ReuseConfig) -> Self {
        Self { config, workers: FxHashMap::default(), fleet: None }
    }

    fn decay(&self, since: Instant, now: Instant) -> f64 {
        let window = self.config.window_s;
        match window > 0.0 {
            true => (-now.saturating_duration_since(since).as_secs_f64() / window).exp(),
            false => 0.0,
        }
    }

    /// A request routed to `worker`: `reused` prompt tokens served from its cache, `new`
    /// tokens it stores there (its prompt's others and its answer).
    pub fn routed(&mut self, worker: WorkerWithDpRank, reused: usize, new: usize, now: Instant) {
        let add = |flow: Option<Decayed>| {
            let keep = flow.map_or(0.0, |f| self.decay(f.at, now));
            let (r, n) = flow.map_or((0.0, 0.0), |f| (f.reused, f.new));
            let at = flow.map_or(now, |f| f.at.max(now));
            Decayed { reused: r * keep + reused as f64, new: n * keep + new as f64, at }
        };
        let (one, all) = (add(self.workers.get(&worker).copied()), add(self.fleet));
        self.workers.insert(worker, one);
        self.fleet = Some(all);
    }

    /// Recomputes one token evicted from `worker` is priced at (the module's formula).
    pub fn factor(&self, worker: WorkerWithDpRank) -> f64 {
        let prior = self.config.prior_tokens.max(1.0);
        let (r, n) = self.workers.get(&worker).map_or((0.0, 0.0), |f| (f.reused, f.new));
        let (fr, fnew) = self.fleet.map_or((0.0, 0.0), |f| (f.reused, f.new));
        let fleet = (fr + prior) / (fnew + prior);
        ((r + prior * fleet) / (n + prior)).clamp(0.0, self.config.cap.max(0.0))
    }

    pub fn forget(&mut self, worker: WorkerWithDpRank) {
        self.workers.remove(&worker);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0u32)
    }

    #[test]
    fn a_cache_of_shared_prompts_is_worth_many_recomputes_and_a_cold_one_few() {
        let now = Instant::now();
        let mut r = Reuse::new(ReuseConfig::default());
        assert_eq!(r.factor(w(1)), 1.0, "nothing known: one recompute");
        for _ in 0..200 {
            // Shared-prefix: 2,048 tokens served from the cache, 64 + 32 stored.
            r.routed(w(1), 2048, 96, now);
            // Every prompt new.
            r.routed(w(2), 0, 2144, now);
        }
        assert_eq!(r.factor(w(1)), 8.0, "21 uses, capped");
        assert!(r.factor(w(2)) < 0.01, "{}", r.factor(w(2)));
        // A newcomer is priced as the fleet: the two above together.
        let fleet = (200.0 * 2048.0 + 2048.0) / (200.0 * (96.0 + 2144.0) + 2048.0);
        assert!((r.factor(w(3)) - fleet).abs() < 1e-9, "{}", r.factor(w(3)));
        r.forget(w(1));
        assert!((r.factor(w(1)) - fleet).abs() < 1e-9);
    }

    #[test]
    fn the_window_lets_the_old_evidence_go() {
        let now = Instant::now();
        let mut r = Reuse::new(ReuseConfig { cap: 100.0, ..ReuseConfig::default() });
        for _ in 0..100 {
            r.routed(w(1), 0, 2000, now);
        }
        let later = now + Duration::from_secs(300);
        for _ in 0..100 {
            r.routed(w(1), 2000, 100, later);
        }
        // Ten windows later the cold past weighs e^-10 of itself (the one worker is the
        // fleet, and its prior the fleet's ratio).
        let f = r.factor(w(1));
        let (reused, new) = (200_000.0, 10_000.0 + 200_000.0 * (-10f64).exp());
        let fleet = (reused + 2048.0) / (new + 2048.0);
        assert!((f - (reused + 2048.0 * fleet) / (new + 2048.0)).abs() < 0.01, "{f}");
        // A clock that goes back does not grow the evidence.
        r.routed(w(1), 0, 0, now);
        assert!((r.factor(w(1)) - f).abs() < 1e-9);
    }
}

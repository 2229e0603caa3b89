//! The engine's shape, learned: each worker's time to first token fitted online from what it
//! served, for engines whose timing is not the simulated engine's (a real vLLM on a CPU pays
//! a fixed cost per request that dwarfs its prefill, and its prefill grows at another rate).
//!
//! The fit is linear least squares over six terms of the request's situation there:
//!
//! ```text
//! ttft ≈ θ0 + θ1 T + θ2 R + θ3 prefill(T) + θ4 decode + θ5 rest
//!   T        prompt tokens to compute before its first token (queued ahead and its own), in
//!            thousands
//!   R        requests running there
//!   prefill  the engine model's prefill of them, ms; decode: the model's decode steps
//!            in between (and the step under way), ms; rest: its lower-tier loads and memory
//!            wait, ms (predict.rs)
//! ```
//!
//! It starts as the model (θ = 0, 0, 0, 1, 1, 1) and moves from there by recursive least squares
//! weighted by `1 / model²` (so that it minimises the relative error, the error that matters
//! to a cost that compares workers), with a forgetting factor (an engine's speed drifts; the
//! last few hundred first tokens count) and its covariance bounded by the prior (a stream of
//! alike requests cannot wind it up). Six terms because that is what tells a fixed cost
//! (θ0), a prefill rate of another slope (θ1) or curvature (θ3), a batch that slows with
//! each request in it (θ2), and the decode and wait the model prices (θ4, θ5) apart; a table by token count learns the same with more samples and
//! no extrapolation. Each worker's fit starts from the fleet's ([`ShapeFits`]).

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::protocols::WorkerWithDpRank;

/// The fit's terms.
pub const TERMS: usize = 6;

/// A request's situation on a worker as the fit reads it (the module's terms).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Features(pub [f64; TERMS]);

impl Features {
    /// `tokens` to compute before the first token, `running` requests there, and the engine
    /// model's prediction by its parts (prefill, decode, rest; ms).
    pub fn new(tokens: usize, running: usize, model_parts: [f64; 3]) -> Self {
        let [prefill, decode, rest] = model_parts;
        Self([1.0, tokens as f64 / 1e3, running as f64, prefill, decode, rest])
    }

    /// What the engine model predicts of it, ms (the prior's prediction).
    pub fn model_ms(&self) -> f64 {
        self.0[3] + self.0[4] + self.0[5]
    }
}

/// Settings of the learned shape.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShapeConfig {
    /// Fit the shape (false: the model with one factor per worker, as before).
    pub enabled: bool,
    /// Weight of the previous first tokens at each new one (1: never forget).
    pub forgetting: f64,
    /// Relative noise of one first token (its spread around the truth): how far one
    /// observation moves the fit against the prior.
    pub noise: f64,
    /// Prior spread of the fixed cost, ms, of the cost per thousand tokens, ms, and of the
    /// cost per running request, ms.
    pub fixed_ms: f64,
    pub per_thousand_ms: f64,
    pub per_running_ms: f64,
    /// Prior spread of the model's terms' factors.
    pub model_factor: f64,
    /// First tokens of a worker before its own fit is compared with the model's.
    pub min_observed: u64,
}

impl Default for ShapeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            forgetting: 0.995,
            noise: 0.2,
            fixed_ms: 20.0,
            per_thousand_ms: 20.0,
            per_running_ms: 5.0,
            model_factor: 1.0,
            min_observed: 16,
        }
    }
}

/// The fit's terms at the start: the engine model.
const PRIOR: [f64; TERMS] = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0];

fn diagonal(d: [f64; TERMS]) -> [[f64; TERMS]; TERMS] {
    let mut p = [[0.0; TERMS]; TERMS];
    for (i, v) in d.into_iter().enumerate() {
        p[i][i] = v;
    }
    p
}

/// One recursive least-squares fit.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    theta: [f64; TERMS],
    p: [[f64; TERMS]; TERMS],
    /// The prior's diagonal: the covariance is kept below it.
    cap: [f64; TERMS],
    pub observed: u64,
}

impl Fit {
    /// The engine model, with the prior of `config`.
    pub fn prior(config: &ShapeConfig) -> Self {
        let n = config.noise.max(1e-3);
        let spread = [
            config.fixed_ms,
            config.per_thousand_ms,
            config.per_running_ms,
            config.model_factor,
            config.model_factor,
            config.model_factor,
        ];
        let cap = spread.map(|s| (s / n) * (s / n));
        Self { theta: PRIOR, p: diagonal(cap), cap, observed: 0 }
    }

    /// Its prediction, ms: at least a tenth of the model's, at most ten times it.
    pub fn predict(&self, x: &Features) -> f64 {
        let model = x.model_ms();
        let y: f64 = self.theta.iter().zip(x.0).map(|(t, v)| t * v).sum();
        match model > 0.0 {
            true => y.clamp(model / 10.0, model * 10.0),
            false => y.max(0.0),
        }
    }

    /// Learns one first token `observed_ms` at `x`.
    pub fn observe(&mut self, x: &Features, observed_ms: f64, forgetting: f64) {
        let model = x.model_ms();
        if !(model > 0.0 && observed_ms.is_finite() && observed_ms > 0.0) {
            return;
        }
        // Weighted by 1 / model²: the relative error is what is minimised.
        let xs = x.0.map(|v| v / model);
        let y = observed_ms / model;
        let lambda = forgetting.clamp(0.5, 1.0);
        let mut px = [0.0; TERMS];
        for (i, row) in self.p.iter().enumerate() {
            px[i] = row.iter().zip(xs).map(|(a, b)| a * b).sum();
        }
        let denom = lambda + xs.iter().zip(px).map(|(a, b)| a * b).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let err = y - self.theta.iter().zip(xs).map(|(t, v)| t * v).sum::<f64>();
        let gain = px.map(|v| v / denom);
        for (t, g) in self.theta.iter_mut().zip(gain) {
            *t += g * err;
        }
        for (row, g) in self.p.iter_mut().zip(gain) {
            for (v, x) in row.iter_mut().zip(px) {
                *v = (*v - g * x) / lambda;
            }
        }
        // Bounded by the prior: forgetting without new directions would wind it up.
        let over = (0..TERMS).map(|i| self.p[i][i] / self.cap[i]).fold(1.0, f64::max);
        if over > 1.0 {
            self.p.iter_mut().flatten().for_each(|v| *v /= over);
        }
        if self.theta.iter().any(|t| !t.is_finite()) {
            *self = Self { observed: self.observed, ..Self::prior_like(self) };
        }
        self.observed += 1;
    }

    fn prior_like(other: &Self) -> Self {
        Self { theta: PRIOR, p: diagonal(other.cap), cap: other.cap, observed: 0 }
    }

    /// The fitted terms (θ0..θ5).
    pub fn terms(&self) -> [f64; TERMS] {
        self.theta
    }
}

/// A worker's fit and how its predictions fared against the corrected model's.
#[derive(Clone, Debug)]
struct WorkerShape {
    fit: Fit,
    /// Running means of |ln(predicted / observed)|: the fit's and the corrected model's.
    fit_error: f64,
    model_error: f64,
}

/// The fleet's fit and each worker's.
#[derive(Clone, Debug)]
pub struct ShapeFits {
    config: ShapeConfig,
    fleet: Fit,
    workers: FxHashMap<WorkerWithDpRank, WorkerShape>,
}

impl Default for ShapeFits {
    fn default() -> Self {
        Self::new(ShapeConfig::default())
    }
}

/// Weight of a new first token in the running errors.
const ERROR_RATE: f64 = 0.05;

impl ShapeFits {
    pub fn new(config: ShapeConfig) -> Self {
        Self { config, fleet: Fit::prior(&config), workers: FxHashMap::default() }
    }

    /// The fit's prediction for `worker` at `x`, ms, when it is to be used there: the
    /// worker's own fit once it has learned enough and predicts better than the corrected
    /// model did. `None`: use the corrected model.
    pub fn predict(&self, worker: WorkerWithDpRank, x: &Features) -> Option<f64> {
        if !self.config.enabled {
            return None;
        }
        let w = self.workers.get(&worker)?;
        (w.fit.observed >= self.config.min_observed && w.fit_error < w.model_error)
            .then(|| w.fit.predict(x))
    }

    /// Whether `worker`'s own fit gives its predictions now.
    pub fn in_use(&self, worker: WorkerWithDpRank) -> bool {
        self.config.enabled
            && self.workers.get(&worker).is_some_and(|w| {
                w.fit.observed >= self.config.min_observed && w.fit_error < w.model_error
            })
    }

    /// Learns a first token `observed_ms` on `worker` at `x`, where the corrected model had
    /// predicted `corrected_ms`.
    pub fn observe(
        &mut self,
        worker: WorkerWithDpRank,
        x: &Features,
        corrected_ms: f64,
        observed_ms: f64,
    ) {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !self.config.enabled || !positive(observed_ms) || !positive(corrected_ms) {
            return;
        }
        let lambda = self.config.forgetting;
        let fleet = &self.fleet;
        let w = self.workers.entry(worker).or_insert_with(|| WorkerShape {
            fit: Fit { observed: 0, ..fleet.clone() },
            fit_error: f64::INFINITY,
            model_error: f64::INFINITY,
        });
        let fit_ms = w.fit.predict(x);
        let err = |p: f64| (p / observed_ms).ln().abs();
        let mix = |old: f64, new: f64| match old.is_finite() {
            true => old + ERROR_RATE * (new - old),
            false => new,
        };
        if w.fit.observed > 0 {
            w.fit_error = mix(w.fit_error, err(fit_ms));
        }
        w.model_error = mix(w.model_error, err(corrected_ms));
        w.fit.observe(x, observed_ms, lambda);
        self.fleet.observe(x, observed_ms, lambda);
    }

    pub fn forget(&mut self, worker: WorkerWithDpRank) {
        self.workers.remove(&worker);
    }

    /// `worker`'s fitted terms and whether its fit is the one used.
    pub fn terms(&self, worker: WorkerWithDpRank) -> Option<([f64; TERMS], bool)> {
        let w = self.workers.get(&worker)?;
        let used = self.config.enabled
            && w.fit.observed >= self.config.min_observed
            && w.fit_error < w.model_error;
        Some((w.fit.terms(), used))
    }
}

#[cfg(test)]
mod tests {
    use super::super::predict::{EngineModel, Situation};
    use super::*;

    fn at(model: &EngineModel, own: usize, decoding: usize) -> Features {
        let s = Situation {
            own_tokens: own,
            decoding,
            running: decoding,
            kv_share: 0.2,
            ..Situation::default()
        };
        model.features(&s)
    }

    #[test]
    fn it_starts_as_the_model() {
        let m = EngineModel::default();
        let fit = Fit::prior(&ShapeConfig::default());
        for (own, d) in [(10, 0), (1000, 0), (4000, 3)] {
            let x = at(&m, own, d);
            let model = m.ttft_ms(&Situation {
                own_tokens: own,
                decoding: d,
                running: d,
                kv_share: 0.2,
                ..Situation::default()
            });
            assert!((fit.predict(&x) - model).abs() < 1e-9, "{own}: {} {model}", fit.predict(&x));
        }
    }

    /// A real CPU engine's shape: a fixed 9 ms and 19 ms per thousand tokens, each request
    /// decoding beside adding 2 ms; the fit learns it from noisy first tokens to within 5%.
    #[test]
    fn it_learns_another_shape() {
        let m = EngineModel::default();
        let truth = |own: usize, d: usize| 9.0 + 0.019 * own as f64 + 2.0 * d as f64;
        let mut fit = Fit::prior(&ShapeConfig::default());
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as f64 / (1u64 << 31) as f64
        };
        for _ in 0..2000 {
            let own = (next() * 3000.0) as usize;
            let d = (next() * 4.0) as usize;
            let noise = 1.0 + 0.2 * (next() - 0.5);
            fit.observe(&at(&m, own, d), truth(own, d) * noise, 0.995);
        }
        let mut model_error = 0.0;
        for (own, d) in [(32, 0), (500, 1), (1000, 0), (2500, 3)] {
            let p = fit.predict(&at(&m, own, d));
            let t = truth(own, d);
            assert!((p - t).abs() / t < 0.05, "{own} {d}: {p} against {t}");
            model_error += (at(&m, own, d).model_ms() - t).abs() / t / 4.0;
        }
        assert!(model_error > 0.3, "the model alone is far off: {model_error}");
    }

    #[test]
    fn alike_requests_do_not_wind_it_up_and_junk_is_ignored() {
        let m = EngineModel::default();
        let mut fit = Fit::prior(&ShapeConfig::default());
        let x = at(&m, 1000, 0);
        for _ in 0..100_000 {
            fit.observe(&x, 20.0, 0.995);
        }
        assert!((fit.predict(&x) - 20.0).abs() < 0.01);
        for i in 0..TERMS {
            assert!(fit.p[i][i] <= fit.cap[i] * (1.0 + 1e-9));
        }
        let before = fit.clone();
        fit.observe(&x, f64::NAN, 0.995);
        fit.observe(&x, -1.0, 0.995);
        fit.observe(&Features([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), 5.0, 0.995);
        assert_eq!(fit, before);
        // A different request still predicts something sane.
        let other = fit.predict(&at(&m, 3000, 2));
        assert!(other.is_finite() && other > 0.0);
    }

    #[test]
    fn a_worker_uses_its_fit_only_once_it_predicts_better() {
        let m = EngineModel::default();
        let (a, b) = (WorkerWithDpRank::new(1u64, 0u32), WorkerWithDpRank::new(2u64, 0u32));
        let mut fits = ShapeFits::new(ShapeConfig::default());
        let x = |own: usize| at(&m, own, 0);
        assert_eq!(fits.predict(a, &x(100)), None, "nothing learned");
        for k in 0..200usize {
            let own = 100 + (k * 37) % 2000;
            let model = x(own).model_ms();
            // `a` has another shape; `b` is the model itself.
            fits.observe(a, &x(own), model, 5.0 + 0.01 * own as f64);
            fits.observe(b, &x(own), model, model);
        }
        let p = fits.predict(a, &x(1500)).expect("a's fit predicts better than the model");
        assert!((p - 20.0).abs() / 20.0 < 0.05, "{p}");
        assert_eq!(fits.predict(b, &x(1500)), None, "the model was as good: kept");
        let off = ShapeFits::new(ShapeConfig { enabled: false, ..ShapeConfig::default() });
        assert_eq!(off.predict(a, &x(1500)), None);
    }
}

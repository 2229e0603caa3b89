//! Time to first token and per output token, predicted per worker from the engine model, and
//! corrected online from the first tokens the router sees.
//!
//! The engine model is the one the simulated engine runs (Dynamo's mocker's fit to a real
//! GPU, docs/mocker.md), a step at a time:
//!
//! ```text
//! prefill(t) = p0 + p1 t + p2 t^2      ms to prefill t prompt tokens in one step
//! decode(s)  = d0 + d1 s + d2 s^2      ms of a step's decodes, s = running KV / capacity
//! budget     = step_tokens             tokens one step takes (chunked prefill), one per
//!                                      decoding request, the rest prompt tokens
//! ```
//!
//! A request placed on worker `w` waits for the prompt tokens queued there and its own
//! (`Q + u`, FCFS), taken `budget - decoding` a step; each step also decodes the running
//! requests; the blocks it loads from lower tiers hold up its step:
//!
//! ```text
//! steps  = ceil((Q + u) / (budget - decoding))
//! ttft_w = residual + sum over steps of prefill(chunk) + steps * decode(s) [decoding > 0]
//!          + load_ms (lower-tier blocks: bytes / tier bandwidth) + memory
//! residual = decode(s) / 2 when anything runs there (the step under way, half done)
//! memory   = when it does not fit beside the running requests' blocks (answers included):
//!            k of them must end, the k-th of d ends after k / (d + 1) of an answer's steps
//!            (answers' lengths from their max_tokens) * decode(s)
//! ```
//!
//! All of it is divided by `speedup`. What the model cannot know (the network, the engine's
//! own overheads, a GPU unlike the fit) is learned: each worker's observed/predicted ratio of
//! first-token times, averaged in log space, multiplies its predictions ([`Corrections`]).

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use super::Predicted;
use super::shape::{Features, ShapeConfig, ShapeFits};
use crate::protocols::WorkerWithDpRank;

/// The engine's timing, as the simulated engine runs it (its defaults: Dynamo's mocker).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineModel {
    /// Prefill of `t` tokens in one step, ms: `[p0, p1, p2]` of `p0 + p1 t + p2 t^2`.
    pub prefill_ms: [f64; 3],
    /// A step's decodes at KV share `s` (0..1), ms: `[d0, d1, d2]` of `d0 + d1 s + d2 s^2`.
    pub decode_ms: [f64; 3],
    /// Tokens one step takes (the chunked-prefill budget, vLLM's `max_num_batched_tokens`).
    pub step_tokens: usize,
    /// The engines run this many times faster than the model (the simulated engine's
    /// `--speedup`).
    pub speedup: f64,
}

impl Default for EngineModel {
    fn default() -> Self {
        Self {
            prefill_ms: [16.501_42, 1.518_344e-2, 4.209_989e-7],
            decode_ms: [5.74, 54.01, -25.74],
            step_tokens: 8_192,
            speedup: 1.0,
        }
    }
}

/// What the model needs of a worker and a request to predict the request's first token there.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Situation {
    /// Prompt tokens queued ahead of it (routed there, first token not yet seen).
    pub queued_tokens: usize,
    /// Its own prompt tokens to compute (not served from a cache).
    pub own_tokens: usize,
    /// Requests there past their first token (each decodes a token every step).
    pub decoding: usize,
    /// Requests there in all (a step is under way when there are any).
    pub running: usize,
    /// The running requests' KV blocks over the worker's capacity (0..1).
    pub kv_share: f64,
    /// Milliseconds of loading its blocks from lower tiers (at the model's speed).
    pub load_ms: f64,
    /// Blocks it lacks beside what the running requests hold (0: it fits): the engine admits
    /// it when enough of them end.
    pub shortfall_blocks: usize,
    /// Blocks a running request there holds, on average.
    pub blocks_per_request: f64,
    /// Tokens a running request's answer there may run to, on average (0: unknown).
    pub mean_answer_tokens: f64,
}

/// A predicted time to first token by its parts, ms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftParts {
    /// The prompt tokens queued there and its own, a chunk a step.
    pub prefill: f64,
    /// The running requests' decodes in those steps, and the step under way.
    pub decode: f64,
    /// Its blocks loaded from lower tiers, and its wait for memory.
    pub rest: f64,
}

impl EngineModel {
    fn scaled(&self, ms: f64) -> f64 {
        ms / self.speedup.max(1e-9)
    }

    /// One step's prefill of `tokens` prompt tokens, ms (0 for none).
    pub fn prefill_step_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        let [p0, p1, p2] = self.prefill_ms;
        self.scaled(p0 + p1 * t + p2 * t * t)
    }

    /// One step's decodes at KV share `share`, ms.
    pub fn decode_step_ms(&self, share: f64) -> f64 {
        let s = share.clamp(0.0, 1.0);
        let [d0, d1, d2] = self.decode_ms;
        self.scaled(d0 + d1 * s + d2 * s * s).max(0.0)
    }

    /// Prompt tokens a step takes beside `decoding` decodes.
    fn chunk(&self, decoding: usize) -> usize {
        self.step_tokens.saturating_sub(decoding).max(1)
    }

    /// The prefill time of `tokens` prompt tokens taken a chunk a step: `(steps, ms)`.
    pub fn prefill_ms(&self, tokens: usize, decoding: usize) -> (usize, f64) {
        let chunk = self.chunk(decoding);
        let (full, rest) = (tokens / chunk, tokens % chunk);
        let ms = full as f64 * self.prefill_step_ms(chunk) + self.prefill_step_ms(rest);
        (full + usize::from(rest > 0), ms)
    }

    /// Predicted time to first token, ms (the module's formula).
    pub fn ttft_ms(&self, s: &Situation) -> f64 {
        let parts = self.ttft_parts(s);
        parts.decode + parts.prefill + parts.rest
    }

    /// The situation as the learned shape reads it ([`super::shape`]).
    pub fn features(&self, s: &Situation) -> Features {
        let p = self.ttft_parts(s);
        Features::new(s.queued_tokens + s.own_tokens, s.running, [p.prefill, p.decode, p.rest])
    }

    /// The module's formula by its parts.
    pub fn ttft_parts(&self, s: &Situation) -> TtftParts {
        let (steps, prefill) = self.prefill_ms(s.queued_tokens + s.own_tokens, s.decoding);
        let decode = self.decode_step_ms(s.kv_share);
        let decodes = match s.decoding {
            0 => 0.0,
            _ => steps.max(1) as f64 * decode,
        };
        let residual = match s.running {
            0 => 0.0,
            _ => decode / 2.0,
        };
        TtftParts {
            prefill,
            decode: residual + decodes,
            rest: self.scaled(s.load_ms) + self.memory_wait_ms(s).unwrap_or(0.0),
        }
    }

    /// How long a request that does not fit waits for running requests to end, ms: `k` of
    /// them must end to free its shortfall, and the `k`-th of `d` decoding requests whose
    /// answers are spread evenly over their length ends after `k / (d + 1)` of an answer's
    /// decode steps. 0 when it fits; `None` when it does not and the answers' lengths are
    /// unknown.
    pub fn memory_wait_ms(&self, s: &Situation) -> Option<f64> {
        if s.shortfall_blocks == 0 {
            return Some(0.0);
        }
        if s.mean_answer_tokens <= 0.0 || s.blocks_per_request <= 0.0 {
            return None;
        }
        let k =
            (s.shortfall_blocks as f64 / s.blocks_per_request).ceil().min(s.running.max(1) as f64);
        let steps = s.mean_answer_tokens * k / (s.decoding + 1) as f64;
        Some(steps * self.decode_step_ms(s.kv_share))
    }

    /// What the request costs the requests decoding there, ms summed over them: its prompt
    /// tokens lengthen the steps that hold up each of their tokens, and its `output_tokens`
    /// of KV (`added_share` of the capacity) slow each step of theirs while it decodes. A
    /// step's fixed cost is not counted: under load a worker's steps carry prefills anyway,
    /// and whether this one gets a step of its own depends on when it lands.
    pub fn added_decode_ms(&self, s: &Situation, added_share: f64, output_tokens: usize) -> f64 {
        if s.decoding == 0 {
            return 0.0;
        }
        let [_, p1, p2] = self.prefill_ms;
        let (q, t) = (s.queued_tokens as f64, (s.queued_tokens + s.own_tokens) as f64);
        let prefill = self.scaled(p1 * (t - q) + p2 * (t * t - q * q));
        let slower =
            self.decode_step_ms(s.kv_share + added_share) - self.decode_step_ms(s.kv_share);
        s.decoding as f64 * (prefill + output_tokens as f64 * slower.max(0.0))
    }

    /// Time per output token, ms: a decode step at the share the running requests hold.
    pub fn tpot_ms(&self, kv_share: f64) -> f64 {
        self.decode_step_ms(kv_share)
    }

    /// Prefill ms of one more prompt token in a step (the model's slope): what recomputing a
    /// token later costs.
    pub fn token_ms(&self) -> f64 {
        self.scaled(self.prefill_ms[1])
    }
}

/// Settings of the online correction.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CorrectionConfig {
    /// Most weight one new first token has in a worker's average (log of observed/predicted)
    /// once the average has `1 / rate` of them.
    pub rate: f64,
    /// Seconds the average spans: a first token weighs `1 - e^(-dt / window_s)` after `dt`
    /// seconds without one (at most `rate`), so a burst of slow first tokens in a short spell
    /// moves it by what that spell is worth in the window, not by how many answers it held
    /// (a noisy second at 18 req/s moved every worker's factor and spread every prefix group
    /// over the fleet: #65).
    pub window_s: f64,
    /// Largest correction either way (a factor): a worker is never thought more than this
    /// much slower or faster than the model.
    pub max_factor: f64,
    /// Largest correction of one worker against the fleet's, either way (a factor): what all
    /// workers share (the network, the engine's overheads) is the fleet's; a worker differs
    /// from it by its own hardware, not by a queue it once had.
    pub max_spread: f64,
    /// Seconds after which a worker not heard from starts returning to the fleet's correction
    /// (over as many seconds again), so a slow spell cannot keep a worker unused and its
    /// correction unrevised.
    pub forget_s: f64,
    /// First tokens the fleet's correction is worth as a worker's prior: a worker's own
    /// departure from the fleet counts `n / (n + prior_samples)` after `n` first tokens, so
    /// a newcomer is priced as the fleet. One first token at the most a worker may differ
    /// (`max_spread`, 2x) moves its price by 1.10x, two by 1.19x: no more than a first
    /// token's own noise (the shape's `noise`, 0.2). One sample decided a newcomer's price
    /// and starved the other newcomer for 20 s (#78).
    pub prior_samples: f64,
}

impl Default for CorrectionConfig {
    fn default() -> Self {
        Self {
            rate: 0.05,
            window_s: 30.0,
            max_factor: 4.0,
            max_spread: 2.0,
            forget_s: 30.0,
            prior_samples: 6.0,
        }
    }
}

/// First tokens kept per worker for the error's quantiles.
pub const ERROR_WINDOW: usize = 512;

#[derive(Clone, Debug, Default)]
struct WorkerFit {
    /// Mean log(observed / model).
    log_ratio: f64,
    last: Option<Instant>,
    observed: u64,
    /// Recent relative errors of the corrected prediction, |predicted - observed| / observed.
    errors: VecDeque<f32>,
}

/// The fleet's and each worker's correction of the model, their learned shapes
/// ([`super::shape`]), and how far off the predictions were.
#[derive(Clone, Debug, Default)]
pub struct Corrections {
    config: CorrectionConfig,
    shapes: ShapeFits,
    fleet: f64,
    fleet_observed: u64,
    fleet_last: Option<Instant>,
    /// Mean relative error of the corrected predictions over the fleet (recent ones).
    fleet_error: f64,
    workers: FxHashMap<WorkerWithDpRank, WorkerFit>,
}

/// A worker's predictions as they turned out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PredictionStats {
    pub worker: WorkerWithDpRank,
    /// First tokens observed.
    pub observed: u64,
    /// Its correction: observed/model, as a factor.
    pub factor: f64,
    /// Median and 90th percentile of the recent relative errors (|pred - obs| / obs).
    pub error_p50: f64,
    pub error_p90: f64,
    /// Its learned shape's terms ([`super::shape`]), and whether its predictions are the
    /// shape's (they are once it predicts better than the corrected model).
    pub shape: Option<[f64; super::shape::TERMS]>,
    pub shape_used: bool,
}

/// One first token: what was predicted and what came.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    pub worker: WorkerWithDpRank,
    pub predicted_ms: f64,
    pub observed_ms: f64,
}

impl Observation {
    /// |predicted - observed| / observed.
    pub fn relative_error(&self) -> f64 {
        (self.predicted_ms - self.observed_ms).abs() / self.observed_ms.max(1e-6)
    }
}

impl Corrections {
    pub fn new(config: CorrectionConfig, shape: ShapeConfig) -> Self {
        Self { config, shapes: ShapeFits::new(shape), ..Self::default() }
    }

    /// What is predicted of a first token on `worker` at `x`, ms: the model corrected by the
    /// worker's factor, and the prediction used (the worker's learned shape when it predicts
    /// better, else the same).
    pub fn predict(&self, worker: WorkerWithDpRank, x: &Features, now: Instant) -> (f64, f64) {
        let corrected = x.model_ms() * self.factor(worker, now);
        (corrected, self.shapes.predict(worker, x).unwrap_or(corrected))
    }

    /// The factor every model millisecond of `worker` is multiplied by for a request at `x`:
    /// its prediction over the model's.
    /// `x` is read only for a worker whose shape is in use (the situation is not computed
    /// twice for the others).
    pub fn factor_at(
        &self,
        worker: WorkerWithDpRank,
        x: impl FnOnce() -> Features,
        now: Instant,
    ) -> f64 {
        if !self.shapes.in_use(worker) {
            return self.factor(worker, now);
        }
        let x = x();
        let model = x.model_ms();
        match self.shapes.predict(worker, &x) {
            Some(p) if model > 0.0 => p / model,
            _ => self.factor(worker, now),
        }
    }

    /// The learned shapes.
    pub fn shapes(&self) -> &ShapeFits {
        &self.shapes
    }

    fn limit(&self) -> f64 {
        self.config.max_factor.max(1.0).ln()
    }

    /// The factor `worker`'s model predictions are multiplied by at `now`: the fleet's, times
    /// the worker's own departure from it weighed by its evidence (`n / (n + prior)` after
    /// `n` first tokens) and, once it is not heard from, fading.
    pub fn factor(&self, worker: WorkerWithDpRank, now: Instant) -> f64 {
        let own = self.workers.get(&worker).map_or(0.0, |fit| self.own(fit, now));
        (self.fleet + own).exp().clamp(1.0 / self.limit().exp(), self.limit().exp())
    }

    /// What the fit of a worker adds to the fleet's log factor at `now`.
    fn own(&self, fit: &WorkerFit, now: Instant) -> f64 {
        (1.0 - self.prior_share(fit.observed)) * self.departure(fit, now)
    }

    /// The worker's mean less the fleet's, bounded by `max_spread` and fading once it is not
    /// heard from.
    fn departure(&self, fit: &WorkerFit, now: Instant) -> f64 {
        let spread = self.config.max_spread.max(1.0).ln();
        self.fading(fit.last, now) * (fit.log_ratio - self.fleet).clamp(-spread, spread)
    }

    /// How much of a worker's own departure is kept at `now`: all of it until it is not
    /// heard from for `forget_s`, then less over as many seconds again.
    fn fading(&self, last: Option<Instant>, now: Instant) -> f64 {
        let age = last.map_or(f64::INFINITY, |t| now.saturating_duration_since(t).as_secs_f64());
        let forget = self.config.forget_s;
        match forget > 0.0 && age > forget {
            true => (-(age - forget) / forget).exp(),
            false => 1.0,
        }
    }

    /// How much of `worker`'s price is still the fleet's: `prior / (n + prior)` after `n`
    /// first tokens (1 for a worker never heard from).
    pub fn unproven(&self, worker: WorkerWithDpRank) -> f64 {
        self.prior_share(self.workers.get(&worker).map_or(0, |f| f.observed))
    }

    /// The fleet's share of a price after `n` first tokens: `prior / (n + prior)`.
    fn prior_share(&self, n: u64) -> f64 {
        let prior = self.config.prior_samples.max(0.0);
        let n = n as f64;
        if n + prior <= 0.0 { 0.0 } else { prior / (n + prior) }
    }

    /// How far off the corrected predictions were lately, over the fleet: the mean of
    /// `|predicted - observed| / observed` (0 before any first token). Costs closer than
    /// this are within what the model can tell apart.
    pub fn relative_error(&self) -> f64 {
        self.fleet_error
    }

    /// Weight of a first token in an average of `n` of them whose last came at `last`.
    fn step(&self, n: u64, last: Option<Instant>, now: Instant) -> f64 {
        let rate = self.config.rate.clamp(0.0, 1.0);
        let window = self.config.window_s;
        let timed = match (last, window > 0.0) {
            (Some(t), true) => {
                1.0 - (-now.saturating_duration_since(t).as_secs_f64() / window).exp()
            }
            _ => rate,
        };
        // The first observations count fully until the average has `1 / rate` of them.
        (1.0 / (n as f64 + 1.0)).max(timed.min(rate))
    }

    /// Learns from a first token `observed_ms` after routing, where `p` was predicted.
    pub fn observe(
        &mut self,
        worker: WorkerWithDpRank,
        p: &Predicted,
        observed_ms: f64,
        now: Instant,
    ) -> Observation {
        let (model_ms, predicted_ms) = (p.model_ms, p.predicted_ms);
        let seen = Observation { worker, predicted_ms, observed_ms };
        self.shapes.observe(worker, &p.features, p.corrected_ms, observed_ms);
        if model_ms > 0.0 && observed_ms > 0.0 {
            let limit = self.limit();
            let x = (observed_ms / model_ms).ln().clamp(-limit, limit);
            let fleet_step = self.step(self.fleet_observed, self.fleet_last, now);
            self.fleet += fleet_step * (x - self.fleet);
            let error = seen.relative_error().min(10.0);
            self.fleet_error += fleet_step * (error - self.fleet_error);
            self.fleet_observed += 1;
            self.fleet_last = Some(self.fleet_last.map_or(now, |t| t.max(now)));
            let start = match self.workers.get(&worker) {
                Some(fit) => self.fleet + self.departure(fit, now),
                None => self.fleet,
            };
            let (n, last) = self.workers.get(&worker).map_or((0, None), |f| (f.observed, f.last));
            let step = self.step(n, last, now);
            let fit = self.workers.entry(worker).or_default();
            fit.log_ratio = start + step * (x - start);
            fit.last = Some(now);
            fit.observed += 1;
            if fit.errors.len() == ERROR_WINDOW {
                fit.errors.pop_front();
            }
            fit.errors.push_back(seen.relative_error() as f32);
        }
        seen
    }

    /// Whether nothing was learned yet (every factor is 1).
    pub fn is_empty(&self) -> bool {
        self.fleet_observed == 0
    }

    pub fn forget(&mut self, worker: WorkerWithDpRank) {
        self.workers.remove(&worker);
        self.shapes.forget(worker);
    }

    /// Each worker's predictions as they turned out, by worker.
    pub fn stats(&self, now: Instant) -> Vec<PredictionStats> {
        let mut out: Vec<PredictionStats> = self
            .workers
            .iter()
            .map(|(&worker, fit)| {
                let mut e: Vec<f32> = fit.errors.iter().copied().collect();
                e.sort_by(f32::total_cmp);
                let q = |p: f64| match e.len() {
                    0 => 0.0,
                    n => f64::from(e[((n - 1) as f64 * p).round() as usize]),
                };
                PredictionStats {
                    worker,
                    observed: fit.observed,
                    factor: self.factor(worker, now),
                    error_p50: q(0.5),
                    error_p90: q(0.9),
                    shape: self.shapes.terms(worker).map(|(t, _)| t),
                    shape_used: self.shapes.terms(worker).is_some_and(|(_, used)| used),
                }
            })
            .collect();
        out.sort_by_key(|s| s.worker);
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Corrections with the default settings and no learned shape.
    fn unshaped() -> Corrections {
        Corrections::new(
            CorrectionConfig::default(),
            ShapeConfig { enabled: false, ..ShapeConfig::default() },
        )
    }

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0u32)
    }

    fn pred(model_ms: f64, predicted_ms: f64) -> Predicted {
        Predicted {
            model_ms,
            predicted_ms,
            corrected_ms: predicted_ms,
            features: Features::default(),
        }
    }

    #[test]
    fn the_model_is_the_simulated_engines() {
        let m = EngineModel::default();
        // 1,000 uncached tokens: 0.421 + 15.183 + 16.501 = 32.105 ms (the mocker's figure).
        assert!((m.prefill_step_ms(1000) - 32.105).abs() < 0.01);
        assert!((m.decode_step_ms(0.5) - (-6.435 + 27.005 + 5.74)).abs() < 1e-9);
        let idle = Situation { own_tokens: 2117, ..Situation::default() };
        // A 2,117-token miss alone: 59.5 ms on Dynamo's mocker, 59.9 on ours.
        let t = m.ttft_ms(&idle);
        assert!((t - 50.5).abs() < 1.0, "{t}");
        let fast = EngineModel { speedup: 10.0, ..m };
        assert!((fast.ttft_ms(&idle) - t / 10.0).abs() < 1e-9);
    }

    #[test]
    fn a_queue_and_running_requests_come_first() {
        let m = EngineModel::default();
        let alone = Situation { own_tokens: 500, ..Situation::default() };
        let queued = Situation { queued_tokens: 10_000, ..alone };
        let busy = Situation { decoding: 20, running: 20, kv_share: 0.6, ..alone };
        assert!(m.ttft_ms(&queued) > m.ttft_ms(&alone) + 100.0);
        // Two steps for 10,500 tokens at 8,192 a step.
        assert_eq!(m.prefill_ms(10_500, 0).0, 2);
        assert!(m.ttft_ms(&busy) > m.ttft_ms(&alone) + m.decode_step_ms(0.6));
        // A hit holds up the running requests less than a miss does.
        let miss = Situation { own_tokens: 2000, ..busy };
        assert!(m.added_decode_ms(&busy, 0.0, 0) < m.added_decode_ms(&miss, 0.0, 0));
        assert_eq!(m.added_decode_ms(&alone, 0.1, 100), 0.0);
        assert!(m.added_decode_ms(&busy, 0.1, 100) > m.added_decode_ms(&busy, 0.1, 0));
    }

    #[test]
    fn a_request_that_does_not_fit_waits_for_running_answers_to_end() {
        let m = EngineModel::default();
        let fits = Situation {
            own_tokens: 100,
            decoding: 4,
            running: 4,
            kv_share: 0.8,
            blocks_per_request: 110.0,
            mean_answer_tokens: 64.0,
            ..Situation::default()
        };
        assert_eq!(m.memory_wait_ms(&fits), Some(0.0));
        let one = Situation { shortfall_blocks: 50, ..fits };
        let two = Situation { shortfall_blocks: 150, ..fits };
        // One of four must end: a fifth of an answer's 64 steps.
        let step = m.decode_step_ms(0.8);
        assert!((m.memory_wait_ms(&one).unwrap() - 64.0 / 5.0 * step).abs() < 1e-9);
        assert!((m.memory_wait_ms(&two).unwrap() - 2.0 * 64.0 / 5.0 * step).abs() < 1e-9);
        assert!(m.ttft_ms(&two) > m.ttft_ms(&fits) + 2.0 * 64.0 / 5.0 * step - 1e-9);
        let unknown = Situation { mean_answer_tokens: 0.0, ..one };
        assert_eq!(m.memory_wait_ms(&unknown), None);
    }

    #[test]
    fn corrections_learn_a_slower_worker_and_forget_it_unheard() {
        let now = Instant::now();
        let mut c = unshaped();
        let (a, b) = (WorkerWithDpRank::new(1u64, 0u32), WorkerWithDpRank::new(2u64, 0u32));
        for _ in 0..200 {
            c.observe(a, &pred(10.0, 10.0), 20.0, now);
            c.observe(b, &pred(10.0, 10.0), 10.0, now);
        }
        assert!((c.factor(a, now) - 2.0).abs() < 0.05, "{}", c.factor(a, now));
        assert!((c.factor(b, now) - 1.0).abs() < 0.05);
        // Unheard for long, a worker takes the fleet's correction (here between the two).
        let later = now + Duration::from_secs(600);
        let fleet = c.factor(WorkerWithDpRank::new(9u64, 0u32), later);
        assert!((c.factor(a, later) - fleet).abs() < 1e-6);
        // Corrections stay inside the limit.
        for _ in 0..500 {
            c.observe(b, &pred(1.0, 1.0), 1000.0, now);
        }
        assert!(c.factor(b, now) <= 4.0 + 1e-9);
        let stats = c.stats(now);
        assert_eq!(stats.len(), 2);
        assert_eq!(stats[0].observed, 200);
        assert!((stats[0].error_p50 - 0.5).abs() < 1e-6, "predicted 10, observed 20");
    }

    #[test]
    fn a_newcomer_is_priced_as_the_fleet_until_its_own_first_tokens_say_otherwise() {
        let now = Instant::now();
        let mut c = unshaped();
        let (old, a, b) = (w(1), w(2), w(3));
        for k in 0..100u64 {
            c.observe(old, &pred(10.0, 10.0), 3.2, now + Duration::from_millis(100 * k));
        }
        let t = now + Duration::from_secs(10);
        let fleet = c.factor(old, t);
        assert!((fleet - 0.32).abs() < 0.01, "{fleet}");
        assert_eq!(c.factor(a, t), fleet, "nothing seen: the fleet's");
        // One slow first stream (the --speedup 5 run of #78: 0.70 against 0.32) moves the
        // newcomer by less than a first token's noise, not to 0.70.
        c.observe(a, &pred(10.0, 10.0), 7.0, t);
        let one = c.factor(a, t) / c.factor(b, t);
        assert!(one > 1.0 && one <= 1.105, "{one}");
        c.observe(a, &pred(10.0, 10.0), 7.0, t);
        let two = c.factor(a, t) / c.factor(b, t);
        assert!(two > one && two <= 1.2, "{two}");
        // Its own evidence, once there is some, says otherwise: it is slower than the old
        // worker by most of the 2.19x its first tokens show.
        for k in 0..200u64 {
            let at = t + Duration::from_millis(50 * k);
            c.observe(a, &pred(10.0, 10.0), 7.0, at);
            c.observe(old, &pred(10.0, 10.0), 3.2, at);
        }
        let end = t + Duration::from_secs(10);
        let learned = c.factor(a, end) / c.factor(old, end);
        assert!(learned > 1.9 && learned < 2.2, "{learned}");
    }

    #[test]
    fn a_short_slow_spell_moves_a_worker_little_and_a_worker_stays_near_its_fleet() {
        let start = Instant::now();
        let mut c = unshaped();
        let (a, b) = (WorkerWithDpRank::new(1u64, 0u32), WorkerWithDpRank::new(2u64, 0u32));
        // Two minutes of first tokens as predicted, 5 a second on each worker.
        for k in 0..600u64 {
            let now = start + Duration::from_millis(200 * k);
            c.observe(a, &pred(10.0, 10.0), 10.0, now);
            c.observe(b, &pred(10.0, 10.0), 10.0, now);
        }
        // Then a second of 50 answers on `a`, each 4x slower than predicted: by their count
        // at the old 5% each they would have moved it 3.6x; now each weighs a 30 s window's
        // 20 ms, or its share of the 600 first tokens before it, whichever is more.
        let spell = start + Duration::from_secs(120);
        for k in 0..50u64 {
            c.observe(a, &pred(10.0, 10.0), 40.0, spell + Duration::from_millis(20 * k));
        }
        let after = spell + Duration::from_secs(1);
        assert!(c.factor(a, after) < 1.15, "{}", c.factor(a, after));
        // Slow for two windows, it is learned, at most twice the fleet's.
        for k in 0..3000u64 {
            c.observe(a, &pred(10.0, 10.0), 80.0, after + Duration::from_millis(20 * k));
            c.observe(b, &pred(10.0, 10.0), 10.0, after + Duration::from_millis(20 * k));
        }
        let end = after + Duration::from_secs(60);
        let fleet = c.factor(WorkerWithDpRank::new(9u64, 0u32), end);
        let ratio = c.factor(a, end) / fleet;
        assert!(ratio > 1.2 && ratio <= 2.0 + 1e-9, "{ratio}");
        assert!(c.factor(b, end) < fleet);
    }
}

//! kvroute's default policy: the worker with the lowest predicted time to first token, plus
//! what the choice costs the requests already there and the hits it evicts, all in predicted
//! milliseconds of the engine model ([`super::predict`]).
//!
//! For each candidate `i` (its [`Situation`]: prompt tokens queued there, the request's own
//! tokens after its cached prefix and lower-tier blocks, requests decoding, KV share):
//!
//! ```text
//! ttft_i    = factor_i * model.ttft(situation_i)          the module `predict`'s formula,
//!                                                         corrected by worker i's first tokens
//!             (factor_i multiplies every model millisecond of worker i below too: an engine
//!             that answers faster than the model also recomputes faster)
//! running_i = running_delay_weight * model.added_decode(situation_i, added share, answer)
//!             what its prefill adds to each token of the requests decoding there, and its
//!             answer's KV to each of their steps (summed over them)
//! evict_i   = eviction_weight * stored_i * model.token_ms / (1 - kv share_i) * reuse_i
//!             stored_i = max(0, isl - device prefix_i - free_i) when any worker holds part
//!             of the prompt (storing evicts only past the free room), else
//!             (isl - device prefix_i) * max(fullness_i, kv share_i) (what nobody holds
//!             better is stored where it crowds least, counting the running requests' blocks
//!             that the events have not reported yet); what it evicts is computed again by later requests: as
//!             many times as a token there is used again before the cache lets it go
//!             (reuse_i, learned per worker: [`super::reuse`]); the fuller of running
//!             requests, the more recently used (and likelier wanted) what the LRU cache
//!             evicts from the rest;
//!             + max(0, held - device prefix_i - free_h) * the same price at the prefix's
//!             best holder h: placed away from it, the holder's copy serves no one and takes
//!             room there, once its cache has none free.
//!             (free_i: tokens of blocks the index holds nothing in. A cache with room
//!             evicts nothing, so at light load the cost is the predicted wait alone and an
//!             idle worker that answers sooner than the holder gets the request: #65.)
//! wait_i    = memory_wait_tokens / prefill_tokens_per_s - the model's wait in ttft_i (at
//!             least 0) when it does not fit beside the running requests (their answers'
//!             blocks included): a request that does not fit costs at least the fixed price,
//!             as the holder of its prefix keeps drawing its group there while every idle
//!             prefix there is evicted (priced at the model's wait alone, the holders of a
//!             fleet near its memory filled up and were dropped as busy: #65)
//! lora_i    = the `kv` cost's adapter term ([`super::kv_tokens`]) in the same seconds
//! cost_i    = ttft_i + running_i + evict_i + wait_i + lora_i        (seconds)
//! ```
//!
//! Every number comes from the engine model (the simulated engine's own timing by default,
//! its speed-up included), from what the router tracks in flight (this router's requests and
//! those its replicas routed), from the workers' KV events, or from the learned correction.
//! The `kv-tokens` policy keeps the earlier cost, in prefill tokens with weights, for
//! comparison.

use super::cost::{Fill, KvConfig, blocks_needed, kv_share, loaded_blocks};
use super::predict::{EngineModel, Situation};
use super::shape::Features;
use super::{Candidate, CostTerms, Policy, RequestInfo, reusable_tokens};

#[derive(Clone, Copy, Debug)]
pub struct KvPolicy {
    kv: KvConfig,
    model: EngineModel,
}

/// Milliseconds of loading one block from each lower tier (host, disk, shared store), at the
/// model's speed; `None` for a tier with no bandwidth set.
fn tier_block_ms(kv: &KvConfig, block_size: usize) -> [Option<f64>; 3] {
    let bytes = kv.kv_bytes_per_token * block_size as f64;
    let ms = |gbps: f64| (gbps > 0.0).then(|| bytes / (gbps * 1e9) * 1e3);
    let host = ms(kv.host_bandwidth_gbps);
    let disk = ms(kv.disk_bandwidth_gbps).map(|d| d + host.unwrap_or(0.0));
    [host, disk, ms(kv.external_bandwidth_gbps)]
}

/// The request's situation on candidate `c`.
pub fn situation(kv: &KvConfig, request: &RequestInfo, c: &Candidate) -> Situation {
    situation_with(request, c, tier_block_ms(kv, request.block_size))
}

/// [`situation`] with each lower tier's load time per block given (the same for every
/// candidate of a request).
fn situation_with(request: &RequestInfo, c: &Candidate, per_block: [Option<f64>; 3]) -> Situation {
    let bs = request.block_size;
    let have = c.overlap_blocks.max(c.inflight_prefix_blocks);
    let (loaded, load_ms) = match c.tier_blocks == [0; 3] {
        true => (0.0, 0.0),
        false => (
            loaded_blocks(c, have, per_block.map(|t| f64::from(u8::from(t.is_some())))),
            loaded_blocks(c, have, per_block.map(|t| t.unwrap_or(0.0))),
        ),
    };
    let cached = reusable_tokens(have + loaded as u32, request.isl_tokens, bs);
    let fill = Fill::of(c);
    let needs = blocks_needed(c, request.num_blocks);
    let shortfall = fill.total.map_or(0, |t| (c.active.blocks + needs).saturating_sub(t as usize));
    let per = |n: usize, of: usize| if of > 0 { n as f64 / of as f64 } else { 0.0 };
    Situation {
        shortfall_blocks: shortfall,
        blocks_per_request: per(c.active.blocks, c.active.requests),
        mean_answer_tokens: per(c.active.answer_tokens, c.active.answered),
        queued_tokens: c.active.prefill_tokens,
        own_tokens: request.isl_tokens - cached,
        decoding: c.active.requests.saturating_sub(c.active.prefilling),
        running: c.active.requests,
        kv_share: kv_share(c, fill),
        load_ms,
    }
}

/// How much likelier a block evicted at KV share `s` (held by running requests) is asked
/// for again than one evicted from an idle cache: an LRU cache evicts from the `1 - s` not
/// held, so its victim was last used `1 - s` times as long ago (capped at a cache 95% held).
fn pressure(share: f64) -> f64 {
    1.0 / (1.0 - share.clamp(0.0, 0.95))
}

/// What `c`'s first tokens taught of its speed: every millisecond the model predicts there
/// is multiplied by it (1 when none is filled in).
fn factor(c: &Candidate) -> f64 {
    match c.ttft_factor > 0.0 {
        true => c.ttft_factor,
        false => 1.0,
    }
}

/// Recomputes a token evicted from `c`'s cache costs later ([`super::reuse`]; 1 when not
/// filled in).
fn reuse(c: &Candidate) -> f64 {
    match c.reuse > 0.0 {
        true => c.reuse,
        false => 1.0,
    }
}

/// The engine model's first token of a request on a candidate, and what its learned
/// correction reads of it: what flow control and the learning ask of every decision, whatever
/// the policy (the `kv` cost prices with the same one).
#[derive(Clone, Copy, Debug)]
pub struct Predictor {
    kv: KvConfig,
    model: EngineModel,
}

impl Predictor {
    pub fn new(kv: KvConfig, model: EngineModel) -> Self {
        Self { kv, model }
    }

    /// The engine model's time to first token of `request` on `c`, ms (uncorrected).
    pub fn model_ttft_ms(&self, request: &RequestInfo, c: &Candidate) -> f64 {
        self.model.ttft_ms(&situation(&self.kv, request, c))
    }

    /// The situation of `request` on `c` as the learned shape reads it.
    pub fn features(&self, request: &RequestInfo, c: &Candidate) -> Features {
        self.model.features(&situation(&self.kv, request, c))
    }

    /// What the engine model, corrected, predicts of `request` on `c`, ms: its wait before
    /// its own prefill starts (the prompts queued ahead, a step under way, memory to free)
    /// and its first token.
    pub fn wait_and_ttft_ms(&self, request: &RequestInfo, c: &Candidate) -> (f64, f64) {
        let s = situation(&self.kv, request, c);
        let ahead = Situation { own_tokens: 0, load_ms: 0.0, ..s };
        let f = factor(c);
        (f * self.model.ttft_ms(&ahead), f * self.model.ttft_ms(&s))
    }
}

impl KvPolicy {
    pub fn new(kv: KvConfig, model: EngineModel) -> Self {
        Self { kv, model }
    }

    /// Each candidate's cost, seconds (the module's formula).
    pub fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Vec<f64> {
        self.priced(request, candidates, 0..candidates.len()).map(|t| t.total_s()).collect()
    }

    /// The cost by its terms of the candidates at `which` (the module's formula).
    pub fn terms(
        &self,
        request: &RequestInfo,
        candidates: &[Candidate],
        which: &[usize],
    ) -> Vec<CostTerms> {
        let which = which.iter().copied().filter(|&i| i < candidates.len());
        self.priced(request, candidates, which).collect()
    }

    /// The cost by its terms of the candidates at `which`, each priced among all of them (the
    /// prefix's best holder is the whole set's).
    fn priced<'a>(
        &'a self,
        request: &'a RequestInfo,
        candidates: &'a [Candidate],
        which: impl Iterator<Item = usize> + 'a,
    ) -> impl Iterator<Item = CostTerms> + 'a {
        let (kv, m) = (&self.kv, &self.model);
        let bs = request.block_size;
        let have =
            move |c: &Candidate| c.overlap_blocks.max(c.inflight_prefix_blocks) as usize * bs;
        // What a token of the prefix's best holder is worth where it is: placed elsewhere,
        // the holder's copy of the difference serves no one and takes room there.
        let holder = candidates.iter().max_by_key(|c| have(c));
        // Its free room takes a stranded copy at no cost (nothing evicted for it yet).
        let (held, held_free, held_token_ms) = holder.map_or((0, 0.0, 0.0), |h| {
            let fill = Fill::of(h);
            let per_token = kv.eviction_weight
                * m.token_ms()
                * pressure(kv_share(h, fill))
                * factor(h)
                * reuse(h);
            (have(h).min(request.isl_tokens), fill.free_blocks * bs as f64, per_token)
        });
        let per_block = tier_block_ms(kv, bs);
        which.map(move |i| {
            let c = &candidates[i];
            let s = situation_with(request, c, per_block);
            let fill = Fill::of(c);
            let factor = factor(c);
            let ttft = factor * m.ttft_ms(&s);
            let added_blocks = request.num_blocks.saturating_sub(c.inflight_prefix_blocks as usize)
                + request.output_tokens.div_ceil(bs.max(1));
            let added_share = fill.total.map_or(0.0, |t| added_blocks as f64 / t);
            let running = match kv.running_delay_weight > 0.0 {
                true => {
                    kv.running_delay_weight
                        * factor
                        * m.added_decode_ms(&s, added_share, request.output_tokens)
                }
                false => 0.0,
            };
            let lacks = request.isl_tokens.saturating_sub(have(c)) as f64;
            let stranded = held.saturating_sub(have(c)) as f64;
            // Where some worker holds part of the prompt, each candidate is charged what
            // storing the rest there evicts: nothing while its cache has room (the holder
            // too: charged by fullness while a copy went free, a holder with room lost
            // its own prefix's requests). A prompt nobody holds is stored where it crowds
            // least, by the cache's fullness: placed by the wait alone while the caches
            // had room, shared-prefix's 12 groups landed 4 on one worker, whose memory
            // then thrashed (p99 206 ms at 9 req/s; #65).
            // The cache holds at least its running requests' blocks, which its KV events
            // may not have reported yet: at 28 req/s every group's first request comes
            // within 2 s, and 4 landed on one worker whose index still looked empty.
            let stored = match held > 0 {
                true => fill.overflow(lacks, bs),
                false => lacks * fill.fullness.max(s.kv_share),
            };
            let evict = kv.eviction_weight
                * stored
                * m.token_ms()
                * pressure(s.kv_share)
                * factor
                * reuse(c)
                + (stranded - held_free).max(0.0) * held_token_ms;
            // A request that does not fit costs at least the fixed price: the model's
            // wait is its own, but the holder of its prefix keeps drawing its group there,
            // each request queued behind the last, while the worker's idle prefixes are
            // all evicted. The model's wait, when known, is in the first token already.
            let flat = kv.seconds(kv.wait_tokens(c, fill, request.num_blocks)) * 1e3;
            let wait = (flat - m.memory_wait_ms(&s).unwrap_or(0.0)).max(0.0);
            let lora = kv.seconds(kv.adapter_tokens(c, true)) * 1e3;
            CostTerms {
                ttft_ms: ttft,
                running_ms: running,
                evict_ms: evict,
                wait_ms: wait,
                lora_ms: lora,
            }
        })
    }
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn costs(&self, request: &RequestInfo, candidates: &[Candidate]) -> Option<Vec<f64>> {
        Some(KvPolicy::costs(self, request, candidates))
    }

    fn cost_terms(
        &self,
        request: &RequestInfo,
        candidates: &[Candidate],
        which: &[usize],
    ) -> Option<Vec<CostTerms>> {
        Some(self.terms(request, candidates, which))
    }

    fn cost_unit(&self) -> Option<&'static str> {
        Some("s")
    }

    fn learns_ttft(&self) -> bool {
        true
    }

    fn weighs_memory(&self) -> bool {
        true
    }
}

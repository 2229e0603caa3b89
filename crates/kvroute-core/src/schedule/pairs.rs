//! Disaggregated prefill and decode: choosing the pair of engines a request runs on, or
//! keeping it on one decode engine (docs/routing.md, "Prefill and decode").
//!
//! For a request of `isl` tokens (`n` full blocks an engine can take from elsewhere, all but
//! the block of its last token), in seconds, `s` the workers' prefill speed
//! (`kv.prefill_tokens_per_s`):
//!
//! ```text
//! prefill_p    = the kv cost of p for the request ([`super::kv_tokens`]: its queue, the prompt
//!                tokens it lacks, what storing them evicts, its memory)
//! transfer_pd  = (lacks_d + pulling_d,link) * bs * kv_bytes_per_token / link(p, d)
//!                lacks_d = n - blocks d holds of the prompt (its KV events and in flight):
//!                a decode engine pulls only the blocks it lacks, as vLLM's connector does
//!                pulling_d,link = blocks d's split requests in flight still pull over the
//!                same link (until their first token): they go first (`link_queue`)
//!                link(p, d) = link_within_node_gbps if p and d share a node, else
//!                link_across_nodes_gbps
//! decode_d     = (decode_full_cache_tokens * active_blocks_d / kv_total_blocks_d
//!                 + memory_wait_tokens if the request does not fit beside d's running ones
//!                 + eviction_weight * lacks_d * bs * fullness_d) / s
//! pair(p, d)   = prefill_p + transfer_pd + decode_d + handoff_overhead_s
//! alone(w)     = the kv cost of w for the request (w a decode worker, or a prefill worker
//!                when `prefill_decodes`: it runs the request whole)
//!                + interference_weight * running_w * (prefill_step_s + (isl - cached_w) / s)
//! ```
//!
//! A pulled request does not wait behind the prompts queued on its decode engine (its KV is
//! there; it joins the running batch), so `decode_d` has no queue term: the queue on `d`
//! counts against prefilling there in place, in its kv cost, and a busy decode engine's
//! requests are split. The cheapest of every pair and every in-place decode wins: a request whose prompt a
//! decode engine mostly holds (the next turn of a conversation it decoded), or one that
//! finds the prefill pool saturated, is prefilled where it decodes; the rest are split.
//! `interference_weight` prices the running decodes an in-place prefill holds up (each of
//! them waits for it: a step with a prefill in it takes `prefill_step_s` more, the timing
//! model's fixed cost of a prefill, and the prompt's tokens; their delay counts at that share
//! of this request's own time).
//!
//! The search is one pass per pool per pair of nodes: `min over p of prefill_p` per node,
//! then for each decode candidate `decode_d + transfer` against each node's best prefill,
//! so its cost grows with `P + D x nodes`, not `P x D`.

pub use super::types::Role;
use serde::{Deserialize, Serialize};

use super::cost::{Fill, KvConfig};
use super::{Candidate, RouteDecision, RouteRequest, reusable_tokens};

/// The pair cost's settings; each one by its field name (`--kv-cost NAME=VALUE` takes the
/// `kv` cost's, these are `--pd-cost NAME=VALUE`, the config file's `[pd_cost]`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PairConfig {
    /// KV bandwidth between a prefill and a decode engine on one node (GB/s; NVLink: 450).
    pub link_within_node_gbps: f64,
    /// Across nodes (GB/s; 200 Gb/s RDMA: 25).
    pub link_across_nodes_gbps: f64,
    /// What the second leg adds (seconds): a round trip and the decode engine's admission.
    pub handoff_overhead_s: f64,
    /// Share of each running decode's delay an in-place prefill causes, counted against it.
    pub interference_weight: f64,
    /// What a prefill adds to the step it runs in besides its tokens (seconds; the constant
    /// of Dynamo's mocker's prefill time, 16.5 ms).
    pub prefill_step_s: f64,
    /// 0: every link priced as within a node (the topology-blind baseline).
    pub topology: f64,
    /// 1: the pulls in flight into a decode engine over a link count ahead of a new one on
    /// it (the engine moves one pull at a time per link); 0: each pull alone.
    pub link_queue: f64,
    /// 0: decode candidates priced as if they held none of the prompt (the cache-blind
    /// baseline: every pair moves the whole prompt).
    pub decode_cache_credit: f64,
    /// 0: never prefill in place, on a decode or a prefill worker (always split).
    pub in_place: f64,
    /// 1: a prefill worker may also run a request whole (vLLM's NIXL engines, `kv_both`, do),
    /// when the decode pool cannot take it as cheaply; 0 for engines that only prefill
    /// (SGLang's prefill servers).
    pub prefill_decodes: f64,
}

impl Default for PairConfig {
    fn default() -> Self {
        Self {
            link_within_node_gbps: 450.0,
            link_across_nodes_gbps: 25.0,
            handoff_overhead_s: 0.002,
            interference_weight: 0.1,
            prefill_step_s: 0.0165,
            topology: 1.0,
            link_queue: 1.0,
            decode_cache_credit: 1.0,
            in_place: 1.0,
            prefill_decodes: 1.0,
        }
    }
}

/// The request as the pair cost sees it.
#[derive(Clone, Copy, Debug)]
pub struct PairRequest {
    pub isl_tokens: usize,
    pub block_size: usize,
    /// Its blocks the request needs while it runs (as the kv cost counts them).
    pub num_blocks: usize,
}

/// The chosen pair: indexes into the prefill and decode candidates (`prefill: None`: in
/// place on the decode one), what it costs and the blocks it moves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairChoice {
    pub prefill: Option<usize>,
    pub decode: usize,
    /// `decode` indexes the prefill candidates: the whole request runs on that prefill
    /// worker (the decode pool cannot take it as cheaply).
    pub on_prefill: bool,
    pub cost: f64,
    pub transfer_blocks: u32,
}

/// A node label as the pair cost takes it: unlabelled workers share node 0; a label is its
/// 32-bit hash (two labels of one fleet colliding is a 1-in-4-billion chance per pair). The
/// router and the simulated engines label nodes alike, so both see the same topology.
pub fn node_id(label: Option<&str>) -> u32 {
    match label {
        None | Some("") => 0,
        Some(l) => (crate::hash::mm_hash_from_identifier(l) as u32).max(1),
    }
}

/// What the router tells of each leg of a pair: where it goes, the blocks it holds there, and
/// the prompt tokens it must compute (a decode leg fed by a prefill computes only the last
/// block's; one alone, what it does not hold).
pub(super) fn pair_decisions(
    request: &RouteRequest<'_>,
    bs: usize,
    p: Option<&Candidate>,
    d: &Candidate,
) -> (Option<RouteDecision>, RouteDecision) {
    let isl = request.isl_tokens;
    let held =
        |c: &Candidate| reusable_tokens(c.overlap_blocks.max(c.inflight_prefix_blocks), isl, bs);
    let prefill = p.map(|p| RouteDecision {
        worker: p.worker,
        overlap_blocks: p.overlap_blocks,
        tier_blocks: p.tier_blocks,
        predicted_prefill_tokens: isl - held(p),
    });
    let decode = RouteDecision {
        worker: d.worker,
        overlap_blocks: d.overlap_blocks,
        tier_blocks: d.tier_blocks,
        predicted_prefill_tokens: match prefill {
            Some(_) => isl - pullable(isl, bs) as usize * bs,
            None => isl - held(d),
        },
    };
    (prefill, decode)
}

/// The prompt's blocks a decode engine can pull: every full block but the one holding the
/// last prompt token, which the decode engine computes itself.
pub(super) fn pullable(isl_tokens: usize, block_size: usize) -> u32 {
    (isl_tokens.saturating_sub(1) / block_size.max(1)) as u32
}

/// Blocks of the prompt `d` holds or has in flight, as the pair cost credits them.
pub(super) fn held(c: &Candidate, config: &PairConfig) -> u32 {
    match config.decode_cache_credit > 0.0 {
        true => c.overlap_blocks.max(c.inflight_prefix_blocks),
        false => 0,
    }
}

/// The decode-side terms of `d` for a request whose blocks it lacks `lacks` (seconds): the
/// kv cost's decode, wait and evict terms (no queue: a pulled request joins the batch).
pub(super) fn decode_cost(kv: &KvConfig, r: &PairRequest, d: &Candidate, lacks: u32) -> f64 {
    let fill = Fill::of(d);
    let decode = kv.decode_tokens(d, fill, r.block_size);
    let wait = kv.wait_tokens(d, fill, r.num_blocks);
    let evict = kv.evict_tokens(f64::from(lacks) * r.block_size as f64, fill);
    kv.seconds(decode + wait + evict)
}

/// Seconds to move `blocks` over the link between `p` and `d`.
pub(super) fn transfer(
    kv: &KvConfig,
    config: &PairConfig,
    r: &PairRequest,
    p: u32,
    d: u32,
    blocks: u32,
) -> f64 {
    let gbps = match config.topology > 0.0 && p != d {
        true => config.link_across_nodes_gbps,
        false => config.link_within_node_gbps,
    };
    let bytes = f64::from(blocks) * r.block_size as f64 * kv.kv_bytes_per_token;
    match gbps > 0.0 {
        true => bytes / (gbps * 1e9),
        false => f64::INFINITY,
    }
}

/// The cheapest way to run the request: a pair of `prefills[p]` and `decodes[d]`, or `d`
/// alone. `prefill_costs` and `in_place_costs` are the kv cost of each prefill and each
/// decode candidate; `nodes` gives a candidate's node. `None` with no decode candidate.
pub fn choose(
    kv: &KvConfig,
    config: &PairConfig,
    r: &PairRequest,
    (prefills, prefill_costs): (&[Candidate], &[f64]),
    (decodes, in_place_costs): (&[Candidate], &[f64]),
) -> Option<PairChoice> {
    let pullable = pullable(r.isl_tokens, r.block_size);
    // The cheapest prefill candidate of each node.
    let mut best_per_node: Vec<(u32, usize, f64)> = Vec::new();
    for (i, (p, &cost)) in prefills.iter().zip(prefill_costs).enumerate() {
        match best_per_node.iter_mut().find(|(node, _, _)| *node == p.node) {
            Some(best) if cost < best.2 => *best = (p.node, i, cost),
            Some(_) => {}
            None => best_per_node.push((p.node, i, cost)),
        }
    }
    let speed = kv.prefill_tokens_per_s.max(1.0);
    let mut best: Option<PairChoice> = None;
    let mut consider = |choice: PairChoice| {
        if best.is_none_or(|b| choice.cost < b.cost) {
            best = Some(choice);
        }
    };
    for (j, d) in decodes.iter().enumerate() {
        let lacks = pullable.saturating_sub(held(d, config));
        let decode = decode_cost(kv, r, d, lacks);
        for &(node, i, prefill) in &best_per_node {
            // The pulls into `d` over the same link go first.
            let queued = match config.link_queue > 0.0 {
                true => d.active.pulling_blocks[usize::from(node != d.node)] as u32,
                false => 0,
            };
            let moved = transfer(kv, config, r, node, d.node, lacks + queued);
            let cost = prefill + moved + decode + config.handoff_overhead_s;
            let transfer_blocks = lacks;
            consider(PairChoice {
                prefill: Some(i),
                decode: j,
                on_prefill: false,
                cost,
                transfer_blocks,
            });
        }
        if config.in_place > 0.0 || best_per_node.is_empty() {
            let cost = in_place_costs[j] + stall(config, r, d, speed);
            consider(PairChoice {
                prefill: None,
                decode: j,
                on_prefill: false,
                cost,
                transfer_blocks: 0,
            });
        }
    }
    if config.prefill_decodes > 0.0 && config.in_place > 0.0 {
        for (i, p) in prefills.iter().enumerate() {
            let cost = prefill_costs[i] + stall(config, r, p, speed);
            consider(PairChoice {
                prefill: None,
                decode: i,
                on_prefill: true,
                cost,
                transfer_blocks: 0,
            });
        }
    }
    best
}

/// What prefilling the request on `w` costs the requests running there (see the module).
pub(super) fn stall(config: &PairConfig, r: &PairRequest, w: &Candidate, speed: f64) -> f64 {
    let cached =
        (w.overlap_blocks.max(w.inflight_prefix_blocks) as usize * r.block_size).min(r.isl_tokens);
    config.interference_weight
        * w.active.requests as f64
        * (config.prefill_step_s + (r.isl_tokens - cached) as f64 / speed)
}

/// The legs of a request in a disaggregated fleet: its prefill (none: prefilled where it
/// decodes) and its decode, with the blocks the decode engine pulls.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PairDecision {
    pub prefill: Option<RouteDecision>,
    pub decode: RouteDecision,
    pub transfer_blocks: u32,
}

/// The id a request's prefill leg is tracked under (its decode leg has the request's).
pub fn prefill_leg_id(id: &str) -> String {
    format!("{id}/prefill")
}

/// What the pair choice did, since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PairCounts {
    /// Requests prefilled on a prefill worker and decoded on another.
    pub split: u64,
    /// Requests prefilled where they decode, that being cheaper.
    pub in_place: u64,
}

impl PairCounts {
    pub(super) fn record(&mut self, split: bool) {
        match split {
            true => self.split += 1,
            false => self.in_place += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::schedule::WorkerLoad;
    use crate::schedule::kv_tokens::KvTokensPolicy;
    use crate::{WorkerId, WorkerWithDpRank};

    fn candidate(id: u64, node: u32, overlap: u32) -> Candidate {
        Candidate {
            worker: WorkerWithDpRank::new(WorkerId(id), 0u32),
            overlap_blocks: overlap,
            node,
            load: WorkerLoad { kv_total_blocks: Some(1000), ..WorkerLoad::default() },
            ..Candidate::default()
        }
    }

    fn run(config: &PairConfig, prefills: &[Candidate], decodes: &[Candidate]) -> PairChoice {
        let kv = KvConfig::default();
        let r = PairRequest { isl_tokens: 2048, block_size: 16, num_blocks: 128 };
        let info = super::super::RequestInfo {
            isl_tokens: 2048,
            num_blocks: 128,
            block_size: 16,
            overlap_weight: 1.0,
            temperature: 0.0,
            output_tokens: 0,
        };
        let policy = KvTokensPolicy::new(kv);
        let (pc, dc) = (policy.costs(&info, prefills), policy.costs(&info, decodes));
        choose(&kv, config, &r, (prefills, &pc), (decodes, &dc)).unwrap()
    }

    fn decoding(id: u64, overlap: u32, running: usize) -> Candidate {
        let mut c = candidate(id, 0, overlap);
        c.active.requests = running;
        c.active.blocks = running * 130;
        c
    }

    /// A cold prompt is split when the decode engine has decodes to hold up (with none, a
    /// prefill there delays nobody and saves the hop); the decode engine that holds most of
    /// the prompt takes it in place; a prefill pool deep in work keeps it in place too.
    #[test]
    fn splits_cold_prompts_and_keeps_warm_ones_in_place() {
        let config = PairConfig { prefill_decodes: 0.0, ..PairConfig::default() };
        let idle = run(&config, &[candidate(0, 0, 0)], &[decoding(1, 0, 0)]);
        assert_eq!(idle.prefill, None);
        let cold = run(&config, &[candidate(0, 0, 0)], &[decoding(1, 0, 1)]);
        assert_eq!((cold.prefill, cold.decode, cold.transfer_blocks), (Some(0), 0, 127));
        let warm = run(&config, &[candidate(0, 0, 0)], &[decoding(1, 120, 4)]);
        assert_eq!(warm.prefill, None, "7 blocks to prefill: no reason to move 120 more");
        let mut saturated = candidate(0, 0, 0);
        saturated.active.prefill_tokens = 40_000;
        assert_eq!(run(&config, &[saturated], &[decoding(1, 0, 4)]).prefill, None);
        let never = PairConfig { in_place: 0.0, ..config };
        assert_eq!(run(&never, &[candidate(0, 0, 0)], &[decoding(1, 120, 4)]).prefill, Some(0));
    }

    /// A decode pool whose memory is full (the request waits for running ones to end) makes
    /// an idle prefill worker run the request whole, where its engine can; one that decodes
    /// already is left to its prefills.
    #[test]
    fn a_full_decode_pool_runs_requests_on_a_prefill_worker() {
        let config = PairConfig::default();
        let full = decoding(1, 0, 7);
        let alone = run(&config, &[candidate(0, 0, 0)], &[full]);
        assert_eq!((alone.prefill, alone.decode, alone.on_prefill), (None, 0, true));
        let mut busy = candidate(0, 0, 0);
        busy.active.requests = 40;
        let split = run(&config, &[busy], &[decoding(1, 0, 2)]);
        assert_eq!((split.prefill, split.on_prefill), (Some(0), false));
        let only_prefill = PairConfig { prefill_decodes: 0.0, ..config };
        assert!(!run(&only_prefill, &[candidate(0, 0, 0)], &[decoding(1, 0, 7)]).on_prefill);
    }

    /// Across nodes the link is slower: a decode engine on the prefill engine's node wins,
    /// unless the cost is blind to topology; and a decode engine that holds the prompt moves
    /// fewer blocks, unless the cost is blind to the decode cache.
    #[test]
    fn prefers_near_links_and_decode_engines_that_hold_the_prompt() {
        let config = PairConfig { in_place: 0.0, ..PairConfig::default() };
        let p = [candidate(0, 0, 0)];
        let far_first = [candidate(1, 1, 0), candidate(2, 0, 0)];
        assert_eq!(run(&config, &p, &far_first).decode, 1);
        // Blind to topology, the far link costs what the near one does.
        let blind = PairConfig { topology: 0.0, ..config };
        let far = [candidate(1, 1, 0)];
        let (aware, unaware) = (run(&config, &p, &far).cost, run(&blind, &p, &far).cost);
        let across = 127.0 * 16.0 * 131_072.0 * (1.0 / 25e9 - 1.0 / 450e9);
        assert!((aware - unaware - across).abs() < 1e-9, "{aware} {unaware} {across}");
        let holds = [candidate(1, 0, 0), candidate(2, 0, 64)];
        let chosen = run(&config, &p, &holds);
        assert_eq!((chosen.decode, chosen.transfer_blocks), (1, 63));
        let cache_blind = PairConfig { decode_cache_credit: 0.0, ..config };
        assert_eq!(run(&cache_blind, &p, &holds).transfer_blocks, 127);
    }

    /// Pulls in flight into a decode engine over a link go before a new one there: of two
    /// decode engines across the link, the one with nothing queued on it wins, and the
    /// queued blocks are priced at that link's bandwidth (none with `link_queue=0`).
    #[test]
    fn pulls_queued_on_a_link_go_first() {
        let config = PairConfig { in_place: 0.0, ..PairConfig::default() };
        let p = [candidate(0, 0, 0)];
        let mut queued = candidate(1, 1, 0);
        queued.active.pulling_blocks = [0, 500];
        let free = candidate(2, 1, 0);
        assert_eq!(run(&config, &p, &[queued, free]).decode, 1);
        let alone = PairConfig { link_queue: 0.0, ..config };
        let (with, without) = (run(&config, &p, &[queued]).cost, run(&alone, &p, &[queued]).cost);
        let ahead = 500.0 * 16.0 * 131_072.0 / 25e9;
        assert!((with - without - ahead).abs() < 1e-9, "{with} {without} {ahead}");
        // Pulls within its node do not hold up one across.
        queued.active.pulling_blocks = [500, 0];
        assert_eq!(run(&config, &p, &[queued]).cost, without);
    }
}

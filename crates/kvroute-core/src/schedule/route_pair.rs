//! [`Scheduler::route_pair`]: a request's prefill and decode workers in a disaggregated fleet
//! (the choice itself is `pairs.rs`).

use super::pairs::*;
use super::scheduler::Scheduler;
use super::{
    Candidate, PolicyKind, RequestBlocks, RequestInfo, RouteDecision, RouteRequest, TreeSizes,
    pick_by_cost,
};
use crate::index::OverlapScores;
use crate::schedule::pairs::pair_decisions;
use crate::schedule::pairs::pullable;
use std::time::Instant;

impl Scheduler {
    /// Chooses where a request runs in a disaggregated fleet: a prefill and a decode worker,
    /// or one decode worker alone, by the pair cost for the `kv` policies ([`choose`]) and by
    /// the policy over each pool for the others (the baselines, and `dynamo`: each pool on
    /// its own, as the peers route). A fleet with no prefill or no decode worker is routed
    /// as aggregated ([`Scheduler::route`]). With an id, both legs are tracked in flight:
    /// the prefill under [`prefill_leg_id`], the decode under the id.
    pub fn route_pair(
        &mut self,
        request: &RouteRequest<'_>,
        scores: &OverlapScores,
        sizes: &dyn TreeSizes,
        now: Instant,
    ) -> Option<PairDecision> {
        let mut all = std::mem::take(&mut self.scratch);
        self.fill_candidates(&mut all, request.local_hashes, scores, sizes);
        let adapters = &self.adapters;
        all.retain(|c| {
            !request.exclude.contains(&c.worker) && adapters.serves(c.worker, request.adapter)
        });
        let (prefills, decodes): (Vec<Candidate>, Vec<Candidate>) =
            all.iter().partition(|c| c.role == Role::Prefill);
        if prefills.is_empty() || decodes.is_empty() {
            // One pool is empty: route over what is left, as `route` would, without
            // filling the candidates again.
            if !decodes.is_empty() {
                all.retain(|c| c.role != Role::Prefill);
            }
            let decision = self.route_among(request, &mut all, now, None).unwrap_or(None);
            self.scratch = all;
            if decision.is_some() && request.id.is_some() && !decodes.is_empty() {
                self.pair_counts.record(false);
            }
            return Some(PairDecision { prefill: None, decode: decision?, transfer_blocks: 0 });
        }
        self.scratch = all;
        let bs = self.config.block_size.tokens();
        let info = self.info(request);
        let choice = self.choose_pair(&info, &prefills, &decodes)?;
        let d = match choice.on_prefill {
            true => prefills[choice.decode],
            false => decodes[choice.decode],
        };
        let p = choice.prefill.map(|i| prefills[i]);
        let (prefill, decode) = pair_decisions(request, bs, p.as_ref(), &d);
        if let Some(id) = request.id {
            let legs = (prefill.as_ref(), &decode);
            self.track_pair(request, id, legs, (p.as_ref(), &d), &choice, now);
        }
        Some(PairDecision { prefill, decode, transfer_blocks: choice.transfer_blocks })
    }

    /// Tracks both legs of a placed pair in flight (the prefill's as [`prefill_leg_id`]), the
    /// pull the decode leg makes, and the adapter it runs with.
    fn track_pair(
        &mut self,
        request: &RouteRequest<'_>,
        id: &str,
        (prefill, decode): (Option<&RouteDecision>, &RouteDecision),
        (p, d): (Option<&Candidate>, &Candidate),
        choice: &PairChoice,
        now: Instant,
    ) {
        let bs = self.config.block_size.tokens();
        let blocks =
            RequestBlocks { local: request.local_hashes, sequence: request.sequence_hashes };
        if let Some(prefill) = prefill {
            let leg = prefill_leg_id(id);
            self.active.add(&leg, prefill.worker, prefill.predicted_prefill_tokens, blocks, now);
            // A prefill leg answers with one token.
            self.active.hold_private(&leg, request.isl_tokens, 1, bs);
        }
        self.active.add(id, d.worker, decode.predicted_prefill_tokens, blocks, now);
        self.active.hold_private(id, request.isl_tokens, request.output_tokens, bs);
        if let Some(p) = p {
            self.active.set_pull(id, p.node != d.node, choice.transfer_blocks as usize);
        }
        if let Some(adapter) = request.adapter {
            self.adapters.routed(id, d.worker, adapter);
        }
        self.pair_counts.record(prefill.is_some());
    }

    fn choose_pair(
        &mut self,
        info: &RequestInfo,
        prefills: &[Candidate],
        decodes: &[Candidate],
    ) -> Option<PairChoice> {
        let priced = matches!(
            self.config.policy,
            PolicyKind::Kv | PolicyKind::KvTokens | PolicyKind::Sticky | PolicyKind::KvAdapterBlind
        );
        // Pairs are priced with the `kv-tokens` terms (the pair cost is built on them); the
        // predicted-milliseconds cost places aggregated requests.
        let tokens = super::kv_tokens::KvTokensPolicy::new(self.config.kv);
        let (pc, dc) = match self.config.policy {
            PolicyKind::Kv => {
                (Some(tokens.costs(info, prefills)), Some(tokens.costs(info, decodes)))
            }
            _ => (self.policy.costs(info, prefills), self.policy.costs(info, decodes)),
        };
        if let (true, Some(pc), Some(dc)) = (priced, &pc, &dc) {
            let r = PairRequest {
                isl_tokens: info.isl_tokens,
                block_size: info.block_size,
                num_blocks: info.num_blocks,
            };
            return choose(&self.config.kv, &self.config.pairs, &r, (prefills, pc), (decodes, dc));
        }
        let t = info.temperature;
        let p = match &pc {
            Some(c) => pick_by_cost(c, prefills, t, &mut self.rng),
            None => self.policy.select(info, prefills, &mut self.rng),
        };
        let d = match &dc {
            Some(c) => pick_by_cost(c, decodes, t, &mut self.rng),
            None => self.decode_policy.select(info, decodes, &mut self.rng),
        };
        // The baselines price nothing, but the decode engine still pulls only what it lacks.
        let lacks = pullable(info.isl_tokens, info.block_size)
            .saturating_sub(decodes[d].overlap_blocks.max(decodes[d].inflight_prefix_blocks));
        Some(PairChoice {
            prefill: Some(p),
            decode: d,
            on_prefill: false,
            cost: 0.0,
            transfer_blocks: lacks,
        })
    }

    /// How many requests were split and how many prefilled where they decode.
    pub fn pair_counts(&self) -> PairCounts {
        self.pair_counts
    }
}

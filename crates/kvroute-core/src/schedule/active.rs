//! In-flight (active) requests per cache: prefill tokens still to compute and blocks being
//! decoded, counted from the moment a request is routed, so a burst of identical requests sees
//! the first one's blocks before any KV event reports them.
//!
//! A request's blocks are named by their sequence hashes, so the blocks of a new request that
//! are in flight on a worker always form a prefix of it (a sequence hash names its whole
//! prefix). The in-flight blocks therefore live in a second [`RadixIndex`], refcounted per
//! (worker, block), and one `find_matches` gives every worker's in-flight prefix at once.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::index::{OverlapScores, RadixIndex};
use crate::protocols::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, SequenceHash, WorkerWithDpRank,
};

/// What one worker has in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActiveLoad {
    /// Uncached prompt tokens of requests not yet past prefill.
    pub prefill_tokens: usize,
    /// Distinct blocks of its in-flight requests (shared blocks counted once).
    pub blocks: usize,
    pub requests: usize,
    /// Requests not yet past prefill (waiting for their first token).
    pub prefilling: usize,
    /// Blocks its split requests still pull from their prefill workers (until their first
    /// token), over the link within its node and the one across: a new pull queues behind
    /// them, as the engine moves one pull at a time per link.
    pub pulling_blocks: [usize; 2],
    /// Tokens the answers of its requests may run to, summed (their `max_tokens`, where
    /// known): how long its running requests keep their blocks.
    pub answer_tokens: usize,
    /// Its requests whose answer bound is known (counted in `answer_tokens`).
    pub answered: usize,
}

#[derive(Debug)]
struct ActiveRequest {
    worker: WorkerWithDpRank,
    blocks: Vec<SequenceHash>,
    prefill_tokens: usize,
    prefill_done: bool,
    added: Instant,
    /// A split request's pull: its link (0 within the node, 1 across) and blocks.
    pull: Option<(usize, usize)>,
    /// Blocks only it holds beyond its full prompt blocks: its prompt's partial last block
    /// and the blocks its answer grows into ([`ActiveSequences::hold_private`]).
    private: usize,
    /// Tokens its answer may run to (0: unknown).
    answer: usize,
    /// Its first token as the engine model predicted it and as corrected, ms.
    predicted: Option<Predicted>,
}

/// A tracked request's first token as predicted when it was routed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Predicted {
    /// The engine model's time to first token, ms.
    pub model_ms: f64,
    /// The same, corrected by the worker's factor ([`super::predict`]).
    pub corrected_ms: f64,
    /// What was predicted: the worker's learned shape when it predicts better than the
    /// corrected model ([`super::shape`]), else the corrected model.
    pub predicted_ms: f64,
    /// The situation the prediction read, for the shape to learn from.
    pub features: super::shape::Features,
}

/// A request's first token arrived: where it ran, when it was routed, what was predicted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstToken {
    pub worker: WorkerWithDpRank,
    pub routed: Instant,
    pub predicted: Option<Predicted>,
}

/// The blocks of a request to track: content hashes and their sequence hashes, in order.
#[derive(Clone, Copy, Debug)]
pub struct RequestBlocks<'a> {
    pub local: &'a [LocalBlockHash],
    pub sequence: &'a [SequenceHash],
}

#[derive(Debug, Default)]
pub struct ActiveSequences {
    requests: FxHashMap<String, ActiveRequest>,
    loads: FxHashMap<WorkerWithDpRank, ActiveLoad>,
    refcounts: FxHashMap<(WorkerWithDpRank, SequenceHash), u32>,
    /// Which worker has which block in flight (engine hash = sequence hash).
    tree: RadixIndex,
    reclaimed: u64,
}

impl ActiveSequences {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts tracking `id` on `worker` with `prefill_tokens` uncached prompt tokens. Adding an
    /// id already tracked replaces it (the old one is freed first).
    pub fn add(
        &mut self,
        id: &str,
        worker: WorkerWithDpRank,
        prefill_tokens: usize,
        blocks: RequestBlocks<'_>,
        now: Instant,
    ) {
        self.free(id);
        let load = self.loads.entry(worker).or_default();
        load.prefill_tokens += prefill_tokens;
        load.requests += 1;
        load.prefilling += 1;
        let n = blocks.local.len().min(blocks.sequence.len());
        let mut new_from = n;
        for (i, &s) in blocks.sequence[..n].iter().enumerate() {
            let count = self.refcounts.entry((worker, s)).or_insert(0);
            *count += 1;
            if *count == 1 {
                load.blocks += 1;
                new_from = new_from.min(i);
            }
        }
        if new_from < n {
            // New blocks follow blocks already in flight: by the prefix property they are all
            // new from the first one on, so one Stored under the previous block suffices.
            let parent = new_from.checked_sub(1).map(|p| ExternalBlockHash(blocks.sequence[p].0));
            let stored = (new_from..n)
                .map(|i| KvCacheStoredBlockData {
                    block_hash: ExternalBlockHash(blocks.sequence[i].0),
                    tokens_hash: blocks.local[i],
                    mm_extra_info: None,
                })
                .collect();
            let data =
                KvCacheEventData::Stored(KvCacheStoreData { parent_hash: parent, blocks: stored });
            let _ = self.tree.apply_event(&event(worker, data));
        }
        let request = ActiveRequest {
            worker,
            blocks: blocks.sequence[..n].to_vec(),
            prefill_tokens,
            prefill_done: false,
            added: now,
            pull: None,
            private: 0,
            answer: 0,
            predicted: None,
        };
        self.requests.insert(id.to_owned(), request);
    }

    /// The tracked request `id` of `isl_tokens` holds, besides its full prompt blocks, the
    /// blocks of its prompt's partial last block and of an answer of up to `output_tokens`,
    /// `block_size` tokens each, counted in its worker's blocks until it is freed: an engine
    /// admits a request only where its blocks fit beside what the running ones hold, answers
    /// included (a 2,117-token prompt with a 64-token answer holds 137 blocks of 16, not 132).
    pub fn hold_private(
        &mut self,
        id: &str,
        isl_tokens: usize,
        output_tokens: usize,
        block_size: usize,
    ) {
        let Some(request) = self.requests.get_mut(id) else { return };
        let bs = block_size.max(1);
        let private = isl_tokens.saturating_add(output_tokens).div_ceil(bs) - isl_tokens / bs;
        if let Some(load) = self.loads.get_mut(&request.worker) {
            load.blocks = load.blocks - request.private + private;
            load.answer_tokens = load.answer_tokens - request.answer + output_tokens;
            load.answered =
                load.answered - usize::from(request.answer > 0) + usize::from(output_tokens > 0);
        }
        request.private = private;
        request.answer = output_tokens;
    }

    /// The tracked request `id` pulls `blocks` from its prefill worker, over the link across
    /// nodes or the one within; counted on its worker until its first token.
    pub fn set_pull(&mut self, id: &str, across: bool, blocks: usize) {
        let Some(request) = self.requests.get_mut(id) else { return };
        if request.prefill_done || request.pull.is_some() || blocks == 0 {
            return;
        }
        let link = usize::from(across);
        request.pull = Some((link, blocks));
        if let Some(load) = self.loads.get_mut(&request.worker) {
            load.pulling_blocks[link] += blocks;
        }
    }

    /// What was predicted of the tracked request `id`'s first token.
    pub fn set_prediction(&mut self, id: &str, predicted: Predicted) {
        if let Some(request) = self.requests.get_mut(id) {
            request.predicted = Some(predicted);
        }
    }

    /// The request produced its first token: its prefill tokens no longer wait (counted the
    /// first time only, which alone returns the request's worker and prediction).
    pub fn mark_prefill_done(&mut self, id: &str) -> Option<FirstToken> {
        let request = self.requests.get_mut(id)?;
        if request.prefill_done {
            return None;
        }
        request.prefill_done = true;
        let first = FirstToken {
            worker: request.worker,
            routed: request.added,
            predicted: request.predicted,
        };
        if let Some(load) = self.loads.get_mut(&request.worker) {
            load.prefill_tokens -= request.prefill_tokens;
            load.prefilling -= 1;
            if let Some((link, blocks)) = request.pull {
                load.pulling_blocks[link] -= blocks;
            }
        }
        Some(first)
    }

    /// The request ended (completed, failed or its client left). Unknown ids and repeated
    /// frees are harmless. Returns whether it was tracked.
    pub fn free(&mut self, id: &str) -> bool {
        let Some(request) = self.requests.remove(id) else { return false };
        let worker = request.worker;
        let Some(load) = self.loads.get_mut(&worker) else { return true };
        if !request.prefill_done {
            load.prefill_tokens -= request.prefill_tokens;
            load.prefilling -= 1;
            if let Some((link, blocks)) = request.pull {
                load.pulling_blocks[link] -= blocks;
            }
        }
        load.requests -= 1;
        load.blocks -= request.private;
        load.answer_tokens -= request.answer;
        load.answered -= usize::from(request.answer > 0);
        let mut gone = Vec::new();
        // Deepest first, so the in-flight tree loses leaves before their parents.
        for &s in request.blocks.iter().rev() {
            if let Some(count) = self.refcounts.get_mut(&(worker, s)) {
                *count -= 1;
                if *count == 0 {
                    self.refcounts.remove(&(worker, s));
                    load.blocks -= 1;
                    gone.push(ExternalBlockHash(s.0));
                }
            }
        }
        if *load == ActiveLoad::default() {
            self.loads.remove(&worker);
        }
        if !gone.is_empty() {
            let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes: gone });
            let _ = self.tree.apply_event(&event(worker, data));
        }
        true
    }

    /// Frees requests added more than `timeout` before `now` whose end was never reported.
    pub fn reclaim_stale(&mut self, now: Instant, timeout: Duration) -> usize {
        let stale: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, r)| now.saturating_duration_since(r.added) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            self.free(id);
        }
        self.reclaimed += stale.len() as u64;
        stale.len()
    }

    /// The engine's own word on `worker`: it runs or queues `engine` requests. While more are
    /// tracked there, the oldest not yet past prefill (no first token) and routed at least
    /// `window` before `now` are freed, up to the excess: placements the engine never saw
    /// (a client that placed a request and never sent it) give their capacity back instead of
    /// holding it to their deadline. A request past prefill is never freed here (the engine
    /// answered it); one younger than `window` may not be in the engine's report yet. Returns
    /// the ids freed, oldest first.
    pub fn reconcile(
        &mut self,
        worker: WorkerWithDpRank,
        engine: usize,
        now: Instant,
        window: Duration,
    ) -> Vec<String> {
        let tracked = self.load(worker).requests;
        if tracked <= engine {
            return Vec::new();
        }
        let mut unseen: Vec<(Instant, &String)> = self
            .requests
            .iter()
            // A split request's decode leg waits on its prefill leg elsewhere: its engine may
            // not have it yet, and that is no sign of a placement lost.
            .filter(|(_, r)| r.worker == worker && !r.prefill_done && r.pull.is_none())
            .filter(|(_, r)| now.saturating_duration_since(r.added) >= window)
            .map(|(id, r)| (r.added, id))
            .collect();
        unseen.sort();
        let freed: Vec<String> =
            unseen.into_iter().take(tracked - engine).map(|(_, id)| id.clone()).collect();
        for id in &freed {
            self.free(id);
        }
        freed
    }

    pub fn load(&self, worker: WorkerWithDpRank) -> ActiveLoad {
        self.loads.get(&worker).copied().unwrap_or_default()
    }

    /// Leading blocks of a request each worker has in flight.
    pub fn inflight_prefix(&self, local: &[LocalBlockHash]) -> OverlapScores {
        self.tree.find_matches(local)
    }

    /// Forgets everything in flight on `worker` (it left the fleet).
    pub fn remove_worker(&mut self, worker: WorkerWithDpRank) {
        let ids: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, r)| r.worker == worker)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.free(&id);
        }
    }

    /// Whether `id` is in flight.
    pub fn contains(&self, id: &str) -> bool {
        self.requests.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Requests reclaimed by [`Self::reclaim_stale`] so far.
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed
    }

    /// Sum of every worker's load (all zero when nothing is in flight).
    pub fn total(&self) -> ActiveLoad {
        self.loads.values().fold(ActiveLoad::default(), |a, l| ActiveLoad {
            prefill_tokens: a.prefill_tokens + l.prefill_tokens,
            blocks: a.blocks + l.blocks,
            requests: a.requests + l.requests,
            prefilling: a.prefilling + l.prefilling,
            pulling_blocks: [0, 1].map(|i| a.pulling_blocks[i] + l.pulling_blocks[i]),
            answer_tokens: a.answer_tokens + l.answer_tokens,
            answered: a.answered + l.answered,
        })
    }

    /// Blocks in the in-flight tree (zero when nothing is in flight).
    pub fn tree_blocks(&self) -> usize {
        self.tree.stats().blocks
    }
}

fn event(worker: WorkerWithDpRank, data: KvCacheEventData) -> RouterEvent {
    RouterEvent { worker_id: worker.worker_id, event: KvCacheEvent::new(0, data, worker.dp_rank) }
}

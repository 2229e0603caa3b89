//! The simulated engine's scheduler, stepped on a simulated clock.
//!
//! Each step, like vLLM's continuous batching with chunked prefill: admit waiting requests
//! (first come, first served) while sequences and blocks allow, reusing their cached leading
//! blocks; spend the token budget on one token for every decoding request, then on prefill
//! chunks; the step lasts the timing model's prefill time for its uncached prompt tokens plus a
//! decode step for its decoding requests. Prompt blocks computed in the step are announced as
//! `BlockStored`, evictions as `BlockRemoved` (vLLM's wire types). A request that cannot get a
//! block for its next token is preempted and starts again later (its blocks released).

use std::collections::VecDeque;
use std::time::Duration;

use kvroute_core::{BlockExtraInfo, BlockHasher, BlockSize, SequenceHash, sequence_hashes};
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent, ExtraKey, publisher_extra_keys};

use crate::kv::KvCache;
use crate::timing::Timing;

/// Engine settings; `Default` follows Dynamo's mocker (block size 16 for kvroute).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    pub num_blocks: usize,
    pub block_size: BlockSize,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    pub timing: Timing,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            num_blocks: 16_384,
            block_size: BlockSize::default(),
            max_num_seqs: 256,
            max_batched_tokens: 8_192,
            timing: Timing::default(),
        }
    }
}

/// A request as the engine sees it: tokens (images already expanded into placeholder tokens)
/// and, per block, the images each block covers.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    pub id: String,
    pub tokens: Vec<u32>,
    pub block_mm_infos: Option<Vec<Option<BlockExtraInfo>>>,
    /// Tokens to generate (at least 1).
    pub max_tokens: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EngineError {
    #[error("the prompt needs {needed} KV blocks but the cache has {capacity}")]
    PromptTooLarge { needed: usize, capacity: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("a request with id {0:?} is already queued or running")]
    DuplicateId(String),
}

/// What happened to a request in a step.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// The prompt is computed and the first token generated.
    FirstToken {
        id: String,
        cached_tokens: usize,
    },
    /// Another token (index from 0: the first token is index 0).
    Token {
        id: String,
        index: usize,
    },
    Finished {
        id: String,
        usage: Usage,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache (ground truth, vLLM's `cached_tokens`).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Step {
    pub duration: Duration,
    /// vLLM-format events of this step: evictions first, then stores.
    pub events: Vec<EngineEvent>,
    pub outputs: Vec<Output>,
}

/// Ground truth for benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    pub requests_finished: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub evicted_blocks: u64,
    pub preemptions: u64,
}

#[derive(Debug)]
struct Running {
    req: EngineRequest,
    seq: Vec<SequenceHash>,
    /// Cached blocks this request references (filled or hit), in order.
    held: usize,
    /// Private blocks: prompt blocks not yet computed, the partial tail, generated tokens.
    private: usize,
    /// Prompt tokens computed (cached ones included).
    computed: usize,
    cached_tokens: usize,
    generated: usize,
}

impl Running {
    fn prefilling(&self) -> bool {
        self.computed < self.req.tokens.len()
    }
}

#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    hasher: BlockHasher,
    cache: KvCache,
    clock: Duration,
    /// Requests not yet running, with the tokens they already generated (a preempted
    /// request resumes its stream, as vLLM's recompute preemption does).
    waiting: VecDeque<(EngineRequest, usize)>,
    running: Vec<Running>,
    stats: EngineStats,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        Self {
            hasher: BlockHasher::new(config.block_size),
            cache: KvCache::new(config.num_blocks),
            clock: Duration::ZERO,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: EngineStats::default(),
            config,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Simulated time so far (sum of step durations).
    pub fn now(&self) -> Duration {
        self.clock
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Share of the KV blocks running requests hold (vLLM's `kv_cache_usage`).
    pub fn kv_usage(&self) -> f64 {
        self.cache.in_use() as f64 / self.cache.capacity().max(1) as f64
    }

    /// Queues a request. Refuses prompts that could never fit.
    pub fn submit(&mut self, mut req: EngineRequest) -> Result<(), EngineError> {
        if req.tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let needed = req.tokens.len().div_ceil(self.config.block_size.tokens()) + 1;
        if needed > self.config.num_blocks {
            return Err(EngineError::PromptTooLarge { needed, capacity: self.config.num_blocks });
        }
        if self.waiting.iter().any(|(w, _)| w.id == req.id)
            || self.running.iter().any(|r| r.req.id == req.id)
        {
            return Err(EngineError::DuplicateId(req.id));
        }
        req.max_tokens = req.max_tokens.max(1);
        self.waiting.push_back((req, 0));
        Ok(())
    }

    /// Drops a request wherever it is (its client left); its blocks are released. Returns
    /// whether it was known.
    pub fn cancel(&mut self, id: &str) -> bool {
        if let Some(at) = self.waiting.iter().position(|(w, _)| w.id == id) {
            self.waiting.remove(at);
            return true;
        }
        match self.running.iter().position(|r| r.req.id == id) {
            Some(at) => {
                let r = self.running.remove(at);
                self.cache.release(&r.seq[..r.held], r.private);
                true
            }
            None => false,
        }
    }

    /// Drops every cached block nobody is using (vLLM's prefix-cache reset): `AllBlocksCleared`
    /// when the engine is idle, else the unreferenced blocks as removed.
    pub fn reset_prefix_cache(&mut self) -> Vec<EngineEvent> {
        let gone = self.cache.clear_unreferenced();
        if self.is_idle() {
            return vec![EngineEvent::AllBlocksCleared];
        }
        removed_event(&gone).into_iter().collect()
    }

    /// Runs one scheduler step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<Step> {
        let mut removed = Vec::new();
        self.admit(&mut removed);
        if self.running.is_empty() {
            return None;
        }
        let bs = self.config.block_size.tokens();
        let mut budget = self.config.max_batched_tokens;
        let mut out = Step::default();
        let mut stored = Vec::new();
        let mut prefill_tokens = 0;
        let mut decoding = 0;
        // Decode first: one token each. A request that needs a block and finds none makes the
        // newest running request give its blocks back (vLLM's recompute preemption), itself if
        // it is the newest.
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.prefilling() || budget == 0 {
                i += 1;
                continue;
            }
            // The next token opens a block when it is the first of one.
            if (r.req.tokens.len() + r.generated).is_multiple_of(bs) {
                let mut preempted_self = false;
                while self.cache.grow(1, &mut removed).is_err() {
                    let victim = self.running.len() - 1;
                    let v = self.running.remove(victim);
                    self.cache.release(&v.seq[..v.held], v.private);
                    self.stats.preemptions += 1;
                    self.waiting.push_front((v.req, v.generated));
                    if victim == i {
                        preempted_self = true;
                        break;
                    }
                }
                if preempted_self {
                    continue;
                }
                self.running[i].private += 1;
            }
            let r = &mut self.running[i];
            budget -= 1;
            decoding += 1;
            out.outputs.push(Output::Token { id: r.req.id.clone(), index: r.generated });
            r.generated += 1;
            i += 1;
        }
        // Then prefill chunks, in admission order.
        for r in self.running.iter_mut().filter(|r| r.prefilling()) {
            if budget == 0 {
                break;
            }
            let chunk = (r.req.tokens.len() - r.computed).min(budget);
            budget -= chunk;
            prefill_tokens += chunk;
            let before = r.computed / bs;
            r.computed += chunk;
            let full_now = (r.computed / bs).min(r.seq.len());
            // Blocks new to the cache, announced in runs of consecutive blocks (a block another
            // request computed meanwhile is shared, and splits the run).
            let mut run: Vec<usize> = Vec::new();
            for b in before.max(r.held)..full_now {
                let fresh = self.cache.fill(r.seq[b]);
                r.private -= 1;
                r.held += 1;
                if fresh {
                    run.push(b);
                } else if !run.is_empty() {
                    stored.push(stored_event(bs, r, &std::mem::take(&mut run)));
                }
            }
            if !run.is_empty() {
                stored.push(stored_event(bs, r, &run));
            }
            if !r.prefilling() && r.generated == 0 {
                out.outputs.push(Output::FirstToken {
                    id: r.req.id.clone(),
                    cached_tokens: r.cached_tokens,
                });
                out.outputs.push(Output::Token { id: r.req.id.clone(), index: 0 });
                r.generated = 1;
            }
        }
        let timing = self.config.timing;
        let kv_share = self.kv_usage();
        out.duration =
            (if prefill_tokens > 0 { timing.prefill(prefill_tokens) } else { Duration::ZERO })
                + (if decoding > 0 { timing.decode(kv_share) } else { Duration::ZERO });
        self.clock += out.duration;
        self.finish(&mut out);
        self.stats.evicted_blocks += removed.len() as u64;
        out.events.extend(removed_event(&removed));
        out.events.extend(stored);
        Some(out)
    }

    fn finish(&mut self, out: &mut Step) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.prefilling() || r.generated < r.req.max_tokens {
                i += 1;
                continue;
            }
            let r = self.running.remove(i);
            self.cache.release(&r.seq[..r.held], r.private);
            let usage = Usage {
                prompt_tokens: r.req.tokens.len(),
                cached_tokens: r.cached_tokens,
                completion_tokens: r.generated,
            };
            self.stats.requests_finished += 1;
            self.stats.prompt_tokens += usage.prompt_tokens as u64;
            self.stats.cached_tokens += usage.cached_tokens as u64;
            out.outputs.push(Output::Finished { id: r.req.id, usage });
        }
    }

    /// Admits waiting requests while sequences and blocks allow (first come, first served).
    fn admit(&mut self, removed: &mut Vec<SequenceHash>) {
        let bs = self.config.block_size.tokens();
        while self.running.len() < self.config.max_num_seqs {
            let Some((req, generated)) = self.waiting.front() else { break };
            let seq = sequence_hashes(
                &self.hasher.local_hashes(&req.tokens, req.block_mm_infos.as_deref()),
            );
            let hits = self.cache.cached_prefix(&seq);
            // Every block of the prompt and of the tokens generated so far (a resumed request),
            // plus the one the next token may open.
            let total = req.tokens.len() + generated;
            let private = total.div_ceil(bs) - hits + usize::from(total.is_multiple_of(bs));
            if self.cache.acquire(&seq, hits, private, removed).is_err() {
                break;
            }
            let (req, generated) =
                self.waiting.pop_front().unwrap_or_else(|| unreachable!("front exists"));
            // Even a fully cached prompt computes its last token (its logits are needed).
            let cached_tokens = (hits * bs).min(req.tokens.len() - 1);
            self.running.push(Running {
                seq,
                held: hits,
                private,
                computed: cached_tokens,
                cached_tokens: hits * bs,
                generated,
                req,
            });
        }
    }
}

/// `BlockStored` for consecutive blocks of a request, as vLLM writes it (images as
/// publisher-form `extra_keys`).
fn stored_event(bs: usize, r: &Running, blocks: &[usize]) -> EngineEvent {
    {
        let first = blocks[0];
        let extra_keys: Option<Vec<Option<Vec<ExtraKey>>>> =
            r.req.block_mm_infos.as_ref().map(|infos| {
                blocks
                    .iter()
                    .map(|&b| infos.get(b).and_then(Option::as_ref).map(publisher_extra_keys))
                    .collect()
            });
        let extra_keys = extra_keys.filter(|k| k.iter().any(Option::is_some));
        EngineEvent::BlockStored(BlockStored {
            block_hashes: blocks.iter().map(|&b| r.seq[b].0).collect(),
            parent_block_hash: first.checked_sub(1).map(|p| r.seq[p].0),
            token_ids: blocks
                .iter()
                .flat_map(|&b| r.req.tokens[b * bs..(b + 1) * bs].iter().map(|&t| u64::from(t)))
                .collect(),
            block_size: bs as u32,
            lora_id: None,
            medium: Some("GPU".to_owned()),
            lora_name: None,
            extra_keys,
            cache_salt: None,
            group_idx: None,
        })
    }
}

fn removed_event(removed: &[SequenceHash]) -> Option<EngineEvent> {
    (!removed.is_empty()).then(|| {
        EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: removed.iter().map(|s| s.0).collect(),
            medium: Some("GPU".to_owned()),
            group_idx: None,
        })
    })
}

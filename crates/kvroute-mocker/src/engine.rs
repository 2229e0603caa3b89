//! The simulated engine's scheduler, stepped on a simulated clock. It follows the vLLM
//! scheduler as Dynamo 1.6.1's mocker simulates it (`aisimulate-core` 0.13,
//! `engine/scheduler/vllm/core.rs` and `policy.rs`), step by step:
//!
//! 1. **Running requests, in admission order**, each get `min(unscheduled tokens, budget)`
//!    of the step's token budget (`max_batched_tokens`): one token for a decoding request, a
//!    chunk for one still prefilling. Blocks are allocated for exactly the tokens scheduled; a
//!    request that cannot get one preempts the newest running request (LIFO, recompute:
//!    its blocks freed, it goes back to the front of the queue), itself if it is the newest.
//! 2. **Waiting requests, first come first served**, while the budget lasts, fewer than
//!    `max_num_seqs` run and nothing was preempted in this step: a request is admitted when its
//!    known tokens' blocks, less its cached prefix blocks that running requests already hold,
//!    fit in the blocks running requests do not hold (cached blocks nobody holds are evicted
//!    as needed, least recently freed first, a request's tail before its prefix); otherwise it
//!    and every later one wait. There is no free-block watermark (vLLM v1 and Dynamo's vLLM
//!    path keep none). Its cached prefix is at most `(len - 1) / block_size` blocks: the last
//!    token is always computed, for its logits.
//! 3. **Time**: the step lasts the prefill time of the prompt tokens it computed,
//!    `poly(count x (mean isl - mean prefix))` over the requests that computed prompt tokens,
//!    plus, when some request decodes, a decode step at `p = min(1, sum of the decoding
//!    requests' lengths / KV capacity in tokens)` (logical tokens: a shared prefix counts once
//!    per request). A request whose prompt completes in the step samples its first token from
//!    that forward pass: it adds no decode time.
//! 4. **Outputs** at the end of the step: every request whose known tokens are all computed
//!    samples one token (its KV is computed by the next step, so a finished request's last
//!    token is never cached). Full computed blocks, prompt or generated, are cached and
//!    announced as `BlockStored` the moment the scheduler fills them, evictions as
//!    `BlockRemoved`, in the order they happen.
//!
//! Deliberate differences from Dynamo's mocker: the generated tokens are words of the model's
//! vocabulary chosen by the prompt and the seed (see [`OutputPlan`]), not synthetic ids, so a
//! client can send the answer back; host memory below the GPU cache is vLLM's offloading
//! connector's ([`crate::host`]), not Dynamo's model of it; Dynamo's other features beyond a
//! single vLLM worker (disk tiers, speculative decoding, disaggregation, data-parallel
//! cadence) are not simulated.

use std::collections::VecDeque;
use std::time::Duration;

use kvroute_core::{BlockExtraInfo, BlockHasher, BlockSize, SequenceHash};
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent, ExtraKey, publisher_extra_keys};

pub use crate::disagg::{DisaggConfig, Handoff, Role};
pub use crate::host::HostConfig;
use crate::host::Tier;
use crate::kv::{KvCache, Slot, Stored};
use crate::lora::Adapters;
pub use crate::lora::{LoraConfig, LoraStats};
pub use crate::sequence::OutputPlan;
use crate::sequence::{Block, Sequence};
use crate::timing::Timing;
use rustc_hash::FxHashMap;

/// Engine settings; `Default` follows Dynamo's mocker (block size 16 for kvroute).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    pub num_blocks: usize,
    pub block_size: BlockSize,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    pub timing: Timing,
    /// LoRA adapters: slots, host memory, load times ([`crate::lora`]).
    pub lora: LoraConfig,
    /// Host memory below the GPU cache ([`crate::host`]; none by default).
    pub host: HostConfig,
    /// Disaggregated prefill and decode: the engine's role and its KV link
    /// ([`crate::disagg`]; aggregated by default).
    pub disagg: DisaggConfig,
    /// A hybrid model's sliding window in tokens: the cache then keeps two groups in one
    /// pool, full attention (group 0) and a sliding window (group 1), as vLLM's hybrid
    /// allocator does ([`crate::window`]). `None`: full attention only.
    pub sliding_window: Option<u32>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            num_blocks: 16_384,
            block_size: BlockSize::default(),
            max_num_seqs: 256,
            max_batched_tokens: 8_192,
            timing: Timing::default(),
            lora: LoraConfig::default(),
            host: HostConfig::default(),
            disagg: DisaggConfig::default(),
            sliding_window: None,
        }
    }
}

/// A request as the engine sees it: tokens (images already expanded into placeholder tokens),
/// per block the images each block covers, and what it will generate.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    pub id: String,
    pub tokens: Vec<u32>,
    pub block_mm_infos: Option<Vec<Option<BlockExtraInfo>>>,
    /// Tokens to generate (at least 1).
    pub max_tokens: usize,
    pub plan: OutputPlan,
    /// The request's cache namespace (vLLM's `cache_salt`): its blocks are shared only with
    /// requests of the same one, and its events carry it.
    pub cache_salt: Option<String>,
    /// The LoRA adapter it runs with (vLLM's `lora_name`): it salts its blocks, takes a slot
    /// while it runs, and its events name it.
    pub lora: Option<String>,
    /// Its part in a disaggregated request: a prefill whose blocks are held for a decode
    /// engine, or a decode whose prompt KV came from a prefill engine.
    pub handoff: Handoff,
    /// Per leading block of the prompt, whether the shared store held it when the engine
    /// asked ([`crate::store`]); empty without a store.
    pub in_store: Vec<bool>,
}

impl EngineRequest {
    /// Sequence hashes of its full prompt blocks, as an engine of `block_size` hashes them.
    pub fn prompt_hashes(&self, block_size: BlockSize) -> Vec<SequenceHash> {
        let lora = self.lora.as_deref().filter(|l| !l.is_empty());
        let hasher = BlockHasher::new(block_size)
            .with_namespace(self.cache_salt.as_deref().filter(|s| !s.is_empty()))
            .with_lora(lora);
        kvroute_core::sequence_hashes(
            &hasher.local_hashes(&self.tokens, self.block_mm_infos.as_deref()),
        )
    }
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
    /// The prompt is computed and the first token sampled.
    FirstToken {
        id: String,
        cached_tokens: usize,
    },
    /// A generated token (`index` from 0).
    Token {
        id: String,
        index: usize,
        token: u32,
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
    /// vLLM-format events of this step, in the order they happened.
    pub events: Vec<EngineEvent>,
    pub outputs: Vec<Output>,
}

/// Requests per adapter, by name.
pub type AdapterCounts = Vec<(String, usize)>;

/// Ground truth for benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    pub requests_finished: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens served without computing them: from the GPU cache or host memory.
    pub cached_tokens: u64,
    pub evicted_blocks: u64,
    pub preemptions: u64,
    /// Of `cached_tokens`, those loaded from host memory, and the bytes those loads moved.
    pub host_hit_tokens: u64,
    pub host_loaded_bytes: u64,
    /// Blocks evicted from host memory, and the blocks it holds now.
    pub host_evicted_blocks: u64,
    pub host_blocks: u64,
    /// The same for storage below host memory: of `cached_tokens`, those promoted from it
    /// (their bytes read from it), its evictions and the blocks it holds now.
    pub storage_hit_tokens: u64,
    pub storage_loaded_bytes: u64,
    pub storage_evicted_blocks: u64,
    pub storage_blocks: u64,
    /// Of `cached_tokens`, those loaded from the shared store, and the bytes they moved.
    pub store_hit_tokens: u64,
    pub store_loaded_bytes: u64,
    /// Of `cached_tokens`, those whose KV came from a prefill engine.
    pub remote_tokens: u64,
    /// Of `prompt_tokens` and `cached_tokens`, those of requests whose KV came from a prefill
    /// engine (their prompt was counted there too: a fleet's hit rate leaves these out).
    pub pulled_prompt_tokens: u64,
    pub pulled_cached_tokens: u64,
    /// Blocks of finished prefills held for their decode engine now, and the prefills held.
    pub held_blocks: u64,
    pub held_requests: u64,
}

/// What a step scheduled for one request.
#[derive(Clone, Copy, Debug)]
struct Work {
    tokens: usize,
    /// Prompt tokens computed by this step, and those computed before it.
    prompt_tokens: usize,
    prompt_before: usize,
    /// Its prompt's KV came from a prefill engine: computing the rest takes no prefill time
    /// (as Dynamo's decode mocker prices it).
    remote: bool,
}

#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    hasher: BlockHasher,
    cache: KvCache,
    clock: Duration,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: EngineStats,
    adapters: Adapters,
    host: Tier,
    storage: Tier,
    /// The shared store: its loads (it holds no blocks here), and the writes to it.
    store: Tier,
    writes: crate::store::Writes,
    /// Finished prefills whose blocks are held for a decode engine to pull, by request id.
    held: FxHashMap<String, Sequence>,
    /// Requests out of the queue while their loads from below the GPU run.
    loading: crate::loads::Loading,
    /// GPU blocks kept free for loading requests (`Sequence::reserved`, summed).
    reserved: usize,
}

/// Collects a step's events in order, runs of one kind merged. A hybrid model's events
/// name their cache group and its kind, as vLLM's do; a full-attention model's name none
/// (as they always have here).
#[derive(Debug, Default)]
struct Events {
    events: Vec<EngineEvent>,
    /// The sliding window of a hybrid model.
    window: Option<u32>,
}

impl Events {
    fn new(window: Option<u32>) -> Self {
        Self { events: Vec::new(), window }
    }

    /// Evicted GPU blocks, in the order they went.
    fn removed(&mut self, gone: &[Slot]) {
        for s in gone {
            self.removed_from(&[s.hash], GPU, s.group);
        }
    }

    fn removed_from(&mut self, gone: &[SequenceHash], medium: &str, group: u32) {
        if gone.is_empty() {
            return;
        }
        let group_idx = self.window.map(|_| group);
        if let Some(EngineEvent::BlockRemoved(r)) = self.events.last_mut()
            && r.medium.as_deref() == Some(medium)
            && r.group_idx == group_idx
        {
            r.block_hashes.extend(gone.iter().map(|s| s.0));
            return;
        }
        self.events.push(EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: gone.iter().map(|s| s.0).collect(),
            medium: Some(medium.to_owned()),
            group_idx,
            locality: None,
        }));
    }

    /// `BlockStored` for blocks `blocks` (increasing) of `s` in `group`, one event per
    /// consecutive run.
    fn stored_runs(&mut self, bs: usize, s: &Sequence, blocks: &[usize], medium: &str, group: u32) {
        let mut start = 0;
        for i in 1..=blocks.len() {
            if i == blocks.len() || blocks[i] != blocks[i - 1] + 1 {
                if start < i {
                    let mut event = stored_event(bs, s, &blocks[start..i], medium);
                    if let Some(window) = self.window {
                        crate::window::name_group(&mut event, group, window);
                    }
                    self.events.push(EngineEvent::BlockStored(event));
                }
                start = i;
            }
        }
    }
}

/// The `medium` of the GPU cache's events, host memory's and storage's, as vLLM names them.
const GPU: &str = "GPU";
const CPU: &str = "CPU";
const STORAGE: &str = "STORAGE";

/// Stores the request `s`'s blocks at positions `blocks` (their hashes `hashes`) in `tier`,
/// announcing those it did not hold and what it evicted for them under `medium`.
fn store_in(
    tier: &mut Tier,
    bs: usize,
    s: &Sequence,
    blocks: &[usize],
    hashes: &[SequenceHash],
    medium: &str,
    events: &mut Events,
) {
    if !tier.enabled() || blocks.is_empty() {
        return;
    }
    let (mut new, mut gone) = (Vec::new(), Vec::new());
    tier.store(hashes, &mut new, &mut gone);
    events.removed_from(&gone, medium, 0);
    let new: Vec<usize> = new.into_iter().map(|i| blocks[i]).collect();
    events.stored_runs(bs, s, &new, medium, 0);
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
            adapters: Adapters::new(config.lora),
            host: config.host.host_tier(),
            storage: config.host.storage_tier(),
            store: config.host.store_tier(),
            writes: crate::store::Writes::default(),
            held: FxHashMap::default(),
            loading: crate::loads::Loading::default(),
            reserved: 0,
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
        let (host, storage, store) = (self.host.stats, self.storage.stats, self.store.stats);
        let block_bytes =
            self.config.block_size.tokens() as f64 * self.config.host.kv_bytes_per_token;
        EngineStats {
            host_hit_tokens: host.hit_tokens,
            host_loaded_bytes: (host.loaded_blocks as f64 * block_bytes) as u64,
            host_evicted_blocks: host.evicted_blocks,
            host_blocks: self.host.len() as u64,
            storage_hit_tokens: storage.hit_tokens,
            storage_loaded_bytes: (storage.loaded_blocks as f64 * block_bytes) as u64,
            storage_evicted_blocks: storage.evicted_blocks,
            storage_blocks: self.storage.len() as u64,
            store_hit_tokens: store.hit_tokens,
            store_loaded_bytes: (store.loaded_blocks as f64 * block_bytes) as u64,
            held_blocks: self.held.values().map(|s| s.blocks.len() as u64).sum(),
            held_requests: self.held.len() as u64,
            ..self.stats
        }
    }

    /// Requests waiting to run, those whose loads are under way included (as vLLM counts its
    /// `WAITING_FOR_REMOTE_KVS` requests).
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.loading.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The request next in the queue.
    pub fn next_waiting(&self) -> Option<&str> {
        self.waiting.front().map(|s| s.id.as_str())
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.loading.is_empty()
    }

    /// Share of the KV blocks running requests hold (vLLM's `kv_cache_usage`).
    pub fn kv_usage(&self) -> f64 {
        self.cache.in_use() as f64 / self.cache.capacity().max(1) as f64
    }

    /// Queues a request. Refuses prompts that could never fit.
    pub fn submit(&mut self, req: EngineRequest) -> Result<(), EngineError> {
        if req.tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        // A hybrid model's prompt takes its blocks once per group while it is computed.
        let groups = 1 + usize::from(self.config.sliding_window.is_some());
        let needed = req.tokens.len().div_ceil(self.config.block_size.tokens()) * groups + 1;
        if needed > self.config.num_blocks {
            return Err(EngineError::PromptTooLarge { needed, capacity: self.config.num_blocks });
        }
        if self.waiting.iter().chain(&self.running).any(|s| s.id == req.id)
            || self.held.contains_key(&req.id)
            || self.loading.contains(&req.id)
        {
            return Err(EngineError::DuplicateId(req.id));
        }
        let lora = req.lora.filter(|l| !l.is_empty()).map(|l| {
            let id = self.adapters.id(&l);
            (l, id)
        });
        self.waiting.push_back(Sequence {
            id: req.id,
            lora,
            prompt_len: req.tokens.len(),
            tokens: req.tokens,
            mm: req.block_mm_infos,
            namespace: req.cache_salt.filter(|s| !s.is_empty()),
            max_tokens: req.max_tokens.max(1),
            plan: req.plan,
            hashes: Vec::new(),
            blocks: Vec::new(),
            window: Vec::new(),
            filled: 0,
            computed: 0,
            generated: 0,
            cached_tokens: None,
            handoff: req.handoff,
            in_store: req.in_store,
            reserved: 0,
        });
        Ok(())
    }

    /// Drops a request wherever it is (its client left); its blocks are released. Returns
    /// whether it was known.
    pub fn cancel(&mut self, id: &str) -> bool {
        if let Some(at) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(at);
            self.reserved -= s.map_or(0, |s| s.reserved);
            return true;
        }
        if let Some(s) = self.loading.cancel(id) {
            self.reserved -= s.reserved;
            return true;
        }
        match self.running.iter().position(|s| s.id == id) {
            Some(at) => {
                let mut s = self.running.remove(at);
                s.release(&mut self.cache);
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
        let mut events = self.events();
        events.removed(&gone);
        events.events
    }

    /// Whether `s` can run beside the running requests: it has no adapter, its adapter is one
    /// of theirs, or a slot is left for it.
    fn slot_for(&self, s: &Sequence) -> bool {
        let Some(name) = s.adapter() else { return true };
        let mut in_use: Vec<&str> = self.running.iter().filter_map(Sequence::adapter).collect();
        in_use.sort_unstable();
        in_use.dedup();
        in_use.contains(&name) || in_use.len() < self.adapters.max_loras().max(1)
    }

    /// What the engine has done with adapters.
    pub fn lora_stats(&self) -> LoraStats {
        self.adapters.stats
    }

    /// The adapters in the GPU slots, least recently used first.
    pub fn resident_adapters(&self) -> &[String] {
        self.adapters.resident()
    }

    /// Requests per adapter, running and waiting (vLLM's `running_lora_adapters` and
    /// `waiting_lora_adapters`), each sorted by name.
    pub fn adapter_requests(&self) -> (AdapterCounts, AdapterCounts) {
        fn count<'a>(seqs: impl Iterator<Item = &'a Sequence>) -> AdapterCounts {
            let mut counts = std::collections::BTreeMap::<&str, usize>::new();
            for name in seqs.filter_map(Sequence::adapter) {
                *counts.entry(name).or_default() += 1;
            }
            counts.into_iter().map(|(n, c)| (n.to_owned(), c)).collect()
        }
        (count(self.running.iter()), count(self.waiting.iter()))
    }

    /// Forgets an adapter's slot and host copy (its requests keep running).
    pub fn unload_adapter(&mut self, name: &str) {
        self.adapters.remove(name);
    }

    fn events(&self) -> Events {
        Events::new(self.config.sliding_window)
    }

    /// Runs one scheduler step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<Step> {
        if self.is_idle() {
            return None;
        }
        // Requests whose loads are done go back to the front of the queue, in order.
        for s in self.loading.take_done(self.clock).into_iter().rev() {
            self.waiting.push_front(s);
        }
        let mut budget = self.config.max_batched_tokens;
        let mut events = self.events();
        // Per running request (by position), what this step scheduled for it.
        let mut work: Vec<Option<Work>> = vec![None; self.running.len()];
        let mut preempted_any = false;

        // 1. Running requests, in order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let n = (s.len() - s.computed).min(budget);
            match self.schedule(i, n, &mut work, &mut budget, &mut events, &mut preempted_any) {
                Scheduled::Yes => i += 1,
                Scheduled::Preempted => {}
                Scheduled::Blocked => break,
            }
        }

        // 2. Waiting requests, first come first served; one whose adapter would make one
        //    more than the slots hold is passed over (as vLLM skips it) and keeps its place.
        let mut skipped: Vec<Sequence> = Vec::new();
        let mut lora_time = Duration::ZERO;
        while !preempted_any && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(front) = self.waiting.front() else { break };
            if !self.slot_for(front) {
                skipped.extend(self.waiting.pop_front());
                continue;
            }
            let Some(front) = self.waiting.front_mut() else { break };
            let bs = self.config.block_size.tokens();
            let len = front.len();
            let own = front.reserved;
            let hashes = front.full_hashes(&self.hasher).to_vec();
            // The last token is always computed (its logits are needed).
            let full_hits = self.cache.cached_prefix(&hashes).min((len - 1) / bs);
            let (hits, run) = self.window_hit(&hashes, full_hits);
            let active_hits = self.cache.referenced(0, &hashes[..hits]);
            let mut needed = len.div_ceil(bs) - active_hits;
            if let Some(run) = &run {
                // The window group's new blocks, and the run's blocks nobody holds.
                let active = self.cache.referenced(1, &hashes[run.clone()]);
                needed += len.div_ceil(bs) - hits + run.len() - active;
            }
            // Room kept for loading requests is not this one's, unless it is its own.
            let free = self.cache.capacity() - self.cache.in_use();
            if needed > free.saturating_sub(self.reserved - own) {
                break;
            }
            if let Some(took) = self.start_load(&hashes, hits, (len - 1) / bs) {
                // Out of the queue while its load runs, its room kept; the next in line may
                // go meanwhile.
                let Some(mut s) = self.waiting.pop_front() else { break };
                s.reserved = needed;
                self.reserved += needed;
                self.loading.start(self.clock, self.config.timing.scale(took), s);
                continue;
            }
            let Some(mut s) = self.waiting.pop_front() else { break };
            // Its load, if it ran beside the steps, is paid.
            let paid = std::mem::take(&mut s.reserved);
            self.reserved -= paid;
            if let Some((name, _)) = &s.lora {
                let in_use: Vec<&str> = self.running.iter().filter_map(Sequence::adapter).collect();
                lora_time += self.adapters.activate(name, &in_use);
            }
            self.cache.reference(0, &hashes[..hits]);
            s.blocks = hashes[..hits].iter().map(|&h| Block::Cached(h)).collect();
            if let Some(run) = run {
                self.cache.reference(1, &hashes[run.clone()]);
                s.window = vec![Block::Skipped; run.start];
                s.window.extend(hashes[run].iter().map(|&h| Block::Cached(h)));
            }
            let (loaded, took) =
                self.load_from_tiers(&mut s, &hashes, hits, (len - 1) / bs, &mut events);
            if paid == 0 {
                lora_time += took;
            }
            let hits = hits + loaded;
            let hits = match s.handoff {
                Handoff::Remote => hits + self.receive_remote(&mut s, &hashes, hits, &mut events),
                _ => hits,
            };
            s.filled = hits;
            s.computed = hits * bs;
            s.cached_tokens.get_or_insert(hits * bs);
            self.running.push(s);
            work.push(None);
            let at = self.running.len() - 1;
            let n = (len - hits * bs).min(budget);
            match self.schedule(at, n, &mut work, &mut budget, &mut events, &mut preempted_any) {
                Scheduled::Yes => {}
                Scheduled::Preempted | Scheduled::Blocked => break,
            }
        }
        for s in skipped.into_iter().rev() {
            self.waiting.push_front(s);
        }

        // 3. How long the step takes.
        let timing = self.config.timing;
        let prefilled: Vec<&Work> =
            work.iter().flatten().filter(|w| w.prompt_tokens > 0 && !w.remote).collect();
        let prefill = match prefilled.len() {
            0 => Duration::ZERO,
            count => {
                let isl: usize = prefilled.iter().map(|w| w.prompt_before + w.prompt_tokens).sum();
                let prefix: usize = prefilled.iter().map(|w| w.prompt_before).sum();
                timing.prefill(count * (isl / count - prefix / count))
            }
        };
        let mut decoding = 0;
        let mut decoding_tokens = 0;
        for (s, w) in self.running.iter().zip(&work) {
            let ready = s.computed == s.len();
            let first_from_prefill = s.generated == 0 && w.is_some_and(|w| w.prompt_tokens > 0);
            if ready && !first_from_prefill {
                decoding += 1;
                decoding_tokens += s.len();
            }
        }
        let capacity_tokens = self.config.num_blocks * self.config.block_size.tokens();
        let decode = match decoding {
            0 => Duration::ZERO,
            _ => timing.decode(decoding_tokens as f64 / capacity_tokens.max(1) as f64),
        };
        // Each distinct adapter in the batch adds the LoRA kernels' work.
        let mut batch_adapters: Vec<&str> = self
            .running
            .iter()
            .zip(&work)
            .filter(|(_, w)| w.is_some())
            .filter_map(|(s, _)| s.adapter())
            .collect();
        batch_adapters.sort_unstable();
        batch_adapters.dedup();
        let lora_step = self.adapters.step_cost() * batch_adapters.len() as u32;
        // `lora_time` holds synchronous tier loads too: both hold up the step.
        let lora = timing.scale(lora_time + lora_step);
        let mut out = Step { duration: prefill + decode + lora, ..Step::default() };
        self.clock += out.duration;

        // 4. Outputs: every request with all its known tokens computed samples one.
        self.sample(&mut out);
        if out.duration.is_zero() && out.outputs.is_empty() {
            // Nothing ran: wait for the next load to finish (a little at a time, so that a
            // request arriving meanwhile is not kept waiting long).
            if let Some(done) = self.loading.next_done() {
                out.duration = done.saturating_sub(self.clock).min(crate::loads::MAX_WAIT);
                self.clock += out.duration;
            }
        }
        out.events = events.events;
        Some(out)
    }

    /// Schedules `n` tokens of running request `i`: allocates their blocks (preempting the
    /// newest running requests if the cache is full) and caches the blocks they complete.
    fn schedule(
        &mut self,
        i: usize,
        n: usize,
        work: &mut Vec<Option<Work>>,
        budget: &mut usize,
        events: &mut Events,
        preempted_any: &mut bool,
    ) -> Scheduled {
        let bs = self.config.block_size.tokens();
        if n == 0 {
            return Scheduled::Blocked;
        }
        if let Some(window) = self.config.sliding_window {
            self.running[i].skip_behind_window(&mut self.cache, window as usize, bs);
        }
        loop {
            let s = &self.running[i];
            let blocks = (s.computed + n).div_ceil(bs);
            let needed = blocks.saturating_sub(s.blocks.len());
            let window_needed = match self.config.sliding_window {
                Some(_) => blocks.saturating_sub(s.window.len()),
                None => 0,
            };
            let mut gone = Vec::new();
            if self.cache.grow(needed + window_needed, &mut gone).is_ok() {
                self.stats.evicted_blocks += gone.len() as u64;
                events.removed(&gone);
                let s = &mut self.running[i];
                s.blocks.extend(std::iter::repeat_n(Block::Private, needed));
                s.window.extend(std::iter::repeat_n(Block::Private, window_needed));
                break;
            }
            // No room: the newest running request gives its blocks back.
            let victim = self.running.len() - 1;
            let mut v = self.running.remove(victim);
            v.release(&mut self.cache);
            self.stats.preemptions += 1;
            *preempted_any = true;
            if let Some(undone) = work.remove(victim) {
                *budget += undone.tokens;
            }
            self.waiting.push_front(v);
            if victim == i {
                return Scheduled::Preempted;
            }
        }
        let s = &mut self.running[i];
        let prompt_before = s.computed.min(s.prompt_len);
        s.computed += n;
        let prompt_tokens = s.computed.min(s.prompt_len) - prompt_before;
        let remote = s.handoff == Handoff::Remote;
        work[i] = Some(Work { tokens: n, prompt_tokens, prompt_before, remote });
        *budget -= n;
        self.cache_computed_blocks(i, events);
        Scheduled::Yes
    }

    /// Caches the request's private blocks that are now full and computed; new ones are
    /// announced (a block another request cached first stays private, as vLLM keeps both),
    /// and written through to host memory and storage below it.
    fn cache_computed_blocks(&mut self, i: usize, events: &mut Events) {
        let bs = self.config.block_size.tokens();
        let s = &mut self.running[i];
        let full = (s.computed / bs).min(s.blocks.len());
        s.full_hashes(&self.hasher);
        let mut run: Vec<usize> = Vec::new();
        // Blocks before `filled` were dealt with by earlier steps.
        let mut window_run: Vec<usize> = Vec::new();
        for b in s.filled..full {
            let hash = s.hashes[b];
            if s.window.get(b) == Some(&Block::Private) && self.cache.fill(1, hash) == Stored::New {
                s.window[b] = Block::Cached(hash);
                window_run.push(b);
            }
            if s.blocks[b] != Block::Private || self.cache.fill(0, hash) == Stored::Duplicate {
                continue;
            }
            s.blocks[b] = Block::Cached(hash);
            run.push(b);
        }
        s.filled = s.filled.max(full);
        // Group by group, as vLLM's coordinator caches them.
        events.stored_runs(bs, s, &run, GPU, 0);
        events.stored_runs(bs, s, &window_run, GPU, 1);
        if self.writes.enabled && !run.is_empty() {
            self.writes.write(run.iter().map(|&b| stored_event(bs, s, &[b], GPU)).collect());
        }
        if !self.host.enabled() || run.is_empty() {
            return;
        }
        let hashes: Vec<SequenceHash> = run.iter().map(|&b| s.hashes[b]).collect();
        let s = &self.running[i];
        store_in(&mut self.host, bs, s, &run, &hashes, CPU, events);
        store_in(&mut self.storage, bs, s, &run, &hashes, STORAGE, events);
    }

    /// A prompt's cache hit given its `full_hits` leading full-attention blocks: as far as
    /// the sliding-window group can serve it too ([`crate::window::hit`]), with the window
    /// blocks the hit uses; `(full_hits, None)` for a model without a window.
    fn window_hit(
        &self,
        hashes: &[SequenceHash],
        full_hits: usize,
    ) -> (usize, Option<std::ops::Range<usize>>) {
        let Some(window) = self.config.sliding_window else { return (full_hits, None) };
        let bs = self.config.block_size.tokens();
        let need = crate::window::blocks_needed(window, bs);
        let hit = crate::window::hit(full_hits, need, |i| self.cache.holds(1, hashes[i]));
        (hit, Some(hit.saturating_sub(need)..hit))
    }

    /// Loads the blocks that follow a request's `hits` GPU blocks (at most up to block
    /// `max`) from the tiers below into the GPU cache, as cached blocks of the request,
    /// announced on the GPU again: a run of blocks each in host memory, or else in storage
    /// (promoted through host memory, where it is stored again), or else in the shared
    /// store (as it held them when the engine asked). Returns how many, and how long their
    /// loads take; 0 without a tier or room.
    fn load_from_tiers(
        &mut self,
        s: &mut Sequence,
        hashes: &[SequenceHash],
        hits: usize,
        max: usize,
        events: &mut Events,
    ) -> (usize, Duration) {
        let bs = self.config.block_size.tokens();
        let run = self.tier_run(&s.in_store, hashes, hits, max);
        let n = run.len();
        if n == 0 || !self.adopt(s, &hashes[hits..hits + n], hits, events) {
            return (0, Duration::ZERO);
        }
        let promoted: Vec<usize> =
            (0..n).filter(|&j| run[j] == Source::Storage).map(|j| hits + j).collect();
        let from_store = run.iter().filter(|&&r| r == Source::Store).count();
        self.store.stats.loaded_blocks += from_store as u64;
        self.store.stats.hit_tokens += (from_store * bs) as u64;
        let in_host = n - promoted.len() - from_store;
        self.host.touch(&hashes[hits..hits + n]);
        self.host.stats.loaded_blocks += in_host as u64;
        self.host.stats.hit_tokens += (in_host * bs) as u64;
        if !promoted.is_empty() {
            let blocks: Vec<SequenceHash> = promoted.iter().map(|&b| hashes[b]).collect();
            self.storage.touch(&blocks);
            self.storage.stats.loaded_blocks += blocks.len() as u64;
            self.storage.stats.hit_tokens += (blocks.len() * bs) as u64;
            store_in(&mut self.host, bs, s, &promoted, &blocks, CPU, events);
        }
        (n, self.run_time(&run))
    }

    /// Where each block after the GPU prefix of `hits` blocks (up to `max`) would load from,
    /// while consecutive: host memory, else storage, else the shared store (as it held them
    /// when the engine asked).
    fn tier_run(
        &self,
        in_store: &[bool],
        hashes: &[SequenceHash],
        hits: usize,
        max: usize,
    ) -> Vec<Source> {
        let from = |b: usize| match (self.host.holds(&hashes[b]), self.storage.holds(&hashes[b])) {
            (true, _) => Some(Source::Host),
            (false, true) => Some(Source::Storage),
            (false, false) if in_store.get(b).copied().unwrap_or(false) => Some(Source::Store),
            (false, false) => None,
        };
        (hits..max.min(hashes.len())).map_while(from).collect()
    }

    /// How long loading `run` takes (a storage block is read, then copied from host memory).
    fn run_time(&self, run: &[Source]) -> Duration {
        let bs = self.config.block_size.tokens();
        let count = |src| run.iter().filter(|&&r| r == src).count();
        let (storage, store) = (count(Source::Storage), count(Source::Store));
        self.host.load_time(run.len() - store, bs)
            + self.storage.load_time(storage, bs)
            + self.store.load_time(store, bs)
    }

    /// With loads beside the steps, the time the front request's load takes, if its prompt
    /// continues below the GPU and it has not loaded yet; its blocks there are touched, so
    /// they outlive the load.
    fn start_load(&mut self, hashes: &[SequenceHash], hits: usize, max: usize) -> Option<Duration> {
        let front = self.waiting.front()?;
        if self.config.host.loads != crate::loads::TierLoads::Async || front.reserved > 0 {
            return None;
        }
        let run = self.tier_run(&front.in_store, hashes, hits, max);
        if run.is_empty() {
            return None;
        }
        let took = self.run_time(&run);
        let blocks = &hashes[hits..hits + run.len()];
        self.host.touch(blocks);
        self.storage.touch(blocks);
        Some(took)
    }

    /// Takes the prompt blocks after a decode request's `hits` local ones as received from
    /// its prefill engine (all but the last token's block, which the engine computes, as
    /// vLLM's decode side does): cached blocks of the request, announced on the GPU.
    /// Returns how many; 0 without room.
    fn receive_remote(
        &mut self,
        s: &mut Sequence,
        hashes: &[SequenceHash],
        hits: usize,
        events: &mut Events,
    ) -> usize {
        let bs = self.config.block_size.tokens();
        let n = ((s.len() - 1) / bs).min(hashes.len()).saturating_sub(hits);
        if n == 0 || !self.adopt(s, &hashes[hits..hits + n], hits, events) {
            return 0;
        }
        self.stats.remote_tokens += (n * bs) as u64;
        n
    }

    /// Allocates blocks for `hashes` (the request's blocks from `first` on, known computed)
    /// and caches them as the request's; the new ones are announced on the GPU. False
    /// without room.
    fn adopt(
        &mut self,
        s: &mut Sequence,
        hashes: &[SequenceHash],
        first: usize,
        events: &mut Events,
    ) -> bool {
        let mut gone = Vec::new();
        if self.cache.grow(hashes.len(), &mut gone).is_err() {
            return false;
        }
        self.stats.evicted_blocks += gone.len() as u64;
        events.removed(&gone);
        let mut announced = Vec::with_capacity(hashes.len());
        for (b, &h) in hashes.iter().enumerate() {
            match self.cache.fill(0, h) {
                Stored::New => {
                    s.blocks.push(Block::Cached(h));
                    announced.push(first + b);
                }
                Stored::Duplicate => s.blocks.push(Block::Private),
            }
        }
        events.stored_runs(self.config.block_size.tokens(), s, &announced, GPU, 0);
        true
    }

    /// Frees a finished prefill's held blocks (its decode engine pulled them, or the hold
    /// expired); returns how many it held, `None` when none is held under `id`.
    pub fn release_held(&mut self, id: &str) -> Option<usize> {
        let mut s = self.held.remove(id)?;
        let blocks = s.blocks.len();
        s.release(&mut self.cache);
        Some(blocks)
    }

    /// From now on, every block the engine computes is written to the shared store
    /// ([`Self::take_store_puts`]).
    pub fn attach_store(&mut self) {
        self.writes.enabled = true;
    }

    /// Whether a shared store is attached.
    pub fn has_store(&self) -> bool {
        self.writes.enabled
    }

    /// The writes to the shared store made since the last call, in order.
    pub fn take_store_puts(&mut self) -> Vec<crate::store::Put> {
        self.writes.take()
    }

    /// The store's answer to a put (or a poll): the events it makes known, locality
    /// `REMOTE`, to publish now ([`crate::store`]).
    pub fn store_acked(&mut self, acked: crate::store::Acked) -> Vec<EngineEvent> {
        self.writes.acked(acked)
    }

    /// Blocks a decode request would find in this engine's cache: the leading full blocks of
    /// its prompt that are cached (what it need not pull from its prefill engine).
    pub fn cached_prompt_blocks(&self, req: &EngineRequest) -> usize {
        let hashes = req.prompt_hashes(self.config.block_size);
        let bs = self.config.block_size.tokens();
        self.cache.cached_prefix(&hashes).min((req.tokens.len() - 1) / bs)
    }

    /// Every running request whose known tokens are all computed samples its next token;
    /// those done finish and free their blocks.
    fn sample(&mut self, out: &mut Step) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.computed < s.len() {
                i += 1;
                continue;
            }
            let token = s.plan.token(s.generated);
            if s.generated == 0 {
                out.outputs.push(Output::FirstToken {
                    id: s.id.clone(),
                    cached_tokens: s.cached_tokens.unwrap_or(0),
                });
            }
            out.outputs.push(Output::Token { id: s.id.clone(), index: s.generated, token });
            s.tokens.push(token);
            s.generated += 1;
            if s.generated < s.max_tokens {
                i += 1;
                continue;
            }
            let mut s = self.running.remove(i);
            match s.handoff {
                // Its blocks wait for the decode engine to pull them ([`Self::release_held`]).
                Handoff::Hold => {}
                _ => s.release(&mut self.cache),
            }
            let usage = Usage {
                prompt_tokens: s.prompt_len,
                cached_tokens: s.cached_tokens.unwrap_or(0),
                completion_tokens: s.generated,
            };
            self.stats.requests_finished += 1;
            self.stats.prompt_tokens += usage.prompt_tokens as u64;
            self.stats.cached_tokens += usage.cached_tokens as u64;
            if s.handoff == Handoff::Remote {
                self.stats.pulled_prompt_tokens += usage.prompt_tokens as u64;
                self.stats.pulled_cached_tokens += usage.cached_tokens as u64;
            }
            let id = s.id.clone();
            if s.handoff == Handoff::Hold {
                self.held.insert(s.id.clone(), s);
            }
            out.outputs.push(Output::Finished { id, usage });
        }
    }
}

/// Where a block loaded from below the GPU comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Host,
    /// Storage, promoted through host memory.
    Storage,
    Store,
}

/// How scheduling a request went.
enum Scheduled {
    Yes,
    /// The request itself was preempted (it was the newest).
    Preempted,
    /// Nothing could be scheduled for it.
    Blocked,
}

/// `BlockStored` for consecutive blocks of a request, as vLLM writes it (images as
/// publisher-form `extra_keys`).
fn stored_event(bs: usize, s: &Sequence, blocks: &[usize], medium: &str) -> BlockStored {
    let first = blocks[0];
    let extra_keys: Option<Vec<Option<Vec<ExtraKey>>>> = s.mm.as_ref().map(|infos| {
        blocks
            .iter()
            .map(|&b| infos.get(b).and_then(Option::as_ref).map(publisher_extra_keys))
            .collect()
    });
    let extra_keys = extra_keys.filter(|k| k.iter().any(Option::is_some));
    // vLLM keys an adapter's blocks by its name too: each block's extra keys carry it.
    let extra_keys = match &s.lora {
        None => extra_keys,
        Some((name, _)) => Some(
            blocks
                .iter()
                .enumerate()
                .map(|(i, _)| {
                    let mut keys = extra_keys
                        .as_ref()
                        .and_then(|k| k.get(i).cloned().flatten())
                        .unwrap_or_default();
                    keys.push(ExtraKey::Text(name.clone()));
                    Some(keys)
                })
                .collect(),
        ),
    };
    BlockStored {
        block_hashes: blocks.iter().map(|&b| s.hashes[b].0).collect(),
        parent_block_hash: first.checked_sub(1).map(|p| s.hashes[p].0),
        token_ids: blocks
            .iter()
            .flat_map(|&b| s.tokens[b * bs..(b + 1) * bs].iter().map(|&t| u64::from(t)))
            .collect(),
        block_size: bs as u32,
        lora_id: s.lora.as_ref().map(|(_, id)| i64::from(*id)),
        medium: Some(medium.to_owned()),
        lora_name: s.lora.as_ref().map(|(name, _)| name.clone()),
        extra_keys,
        cache_salt: s.namespace.clone(),
        group_idx: None,
        locality: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }
}

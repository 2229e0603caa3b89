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
use kvroute_wire::EngineEvent;

pub use crate::disagg::{DisaggConfig, Handoff, Role};
pub use crate::host::HostConfig;
use crate::host::Tier;
use crate::kv::{KvCache, Stored};
use crate::lora::Adapters;
pub use crate::lora::{LoraConfig, LoraStats};
pub use crate::sequence::OutputPlan;
use crate::sequence::{Block, Sequence};
use crate::timing::Timing;
use rustc_hash::FxHashMap;

mod events;
mod step;
mod tiers;

use events::Events;

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
    /// Which waiting request goes first, and which running one is preempted (vLLM's
    /// `--scheduling-policy`).
    pub scheduling: SchedulingPolicy,
}

/// vLLM's scheduling policies: `fcfs` (its default: arrival order; the newest running request
/// is preempted) or `priority` (the lowest `priority` value first, then arrival; the running
/// request with the highest value, then the latest, is preempted). An engine on `fcfs`
/// refuses a request whose priority is not 0, as vLLM does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SchedulingPolicy {
    #[default]
    Fcfs,
    Priority,
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = kvroute_core::UnknownChoice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            _ => Err(kvroute_core::UnknownChoice::new("scheduling policy", s, "fcfs, priority")),
        }
    }
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
            scheduling: SchedulingPolicy::Fcfs,
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
    /// vLLM's `priority`: under the `priority` policy, lower values go first.
    pub priority: i64,
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
    /// Requests submitted so far: each one's arrival number.
    arrivals: u64,
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
            arrivals: 0,
            config,
        }
    }

    /// Puts a request back in the queue: at its head (fcfs: a preempted request, or one whose
    /// load is done, goes first), or in its place by priority and arrival.
    pub(crate) fn requeue(&mut self, s: Sequence) {
        match self.config.scheduling {
            SchedulingPolicy::Fcfs => self.waiting.push_front(s),
            SchedulingPolicy::Priority => self.enqueue(s),
        }
    }

    /// Adds a request to the queue: at its end (fcfs), or after every request whose
    /// (priority, arrival) comes first.
    fn enqueue(&mut self, s: Sequence) {
        match self.config.scheduling {
            SchedulingPolicy::Fcfs => self.waiting.push_back(s),
            SchedulingPolicy::Priority => {
                let key = (s.priority, s.arrival);
                let at = self.waiting.partition_point(|w| (w.priority, w.arrival) <= key);
                self.waiting.insert(at, s);
            }
        }
    }

    /// Which running request gives its blocks back when the cache is full: the newest
    /// (fcfs), or the one with the highest priority value, then the latest.
    pub(crate) fn preemption_victim(&self) -> usize {
        match self.config.scheduling {
            SchedulingPolicy::Fcfs => self.running.len() - 1,
            SchedulingPolicy::Priority => self
                .running
                .iter()
                .enumerate()
                .max_by_key(|(_, s)| (s.priority, s.arrival))
                .map_or(0, |(i, _)| i),
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
        self.arrivals += 1;
        self.enqueue(Sequence {
            priority: req.priority,
            arrival: self.arrivals,
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

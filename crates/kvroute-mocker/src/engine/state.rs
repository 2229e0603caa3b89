//! [`Engine`]: the queues, the cache and its tiers, the clock; a request's way in and out.
//! Each step is `step.rs`, the loads from below the GPU `tiers.rs`.

use std::collections::VecDeque;
use std::time::Duration;

use kvroute_core::BlockHasher;
use kvroute_wire::EngineEvent;

use crate::disagg::Handoff;
use crate::host::Tier;
use crate::kv::KvCache;
use crate::lora::Adapters;
use crate::lora::LoraStats;
use crate::sequence::Sequence;
use rustc_hash::FxHashMap;

use super::events::Events;
use super::types::*;

#[derive(Debug)]
pub struct Engine {
    pub(super) config: EngineConfig,
    pub(super) hasher: BlockHasher,
    pub(super) cache: KvCache,
    pub(super) clock: Duration,
    pub(super) waiting: VecDeque<Sequence>,
    pub(super) running: Vec<Sequence>,
    pub(super) stats: EngineStats,
    pub(super) adapters: Adapters,
    pub(super) host: Tier,
    pub(super) storage: Tier,
    /// The shared store: its loads (it holds no blocks here), and the writes to it.
    pub(super) store: Tier,
    pub(super) writes: crate::store::Writes,
    /// Finished prefills whose blocks are held for a decode engine to pull, by request id.
    pub(super) held: FxHashMap<String, Sequence>,
    /// Requests out of the queue while their loads from below the GPU run.
    pub(super) loading: crate::loads::Loading,
    /// GPU blocks kept free for loading requests (`Sequence::reserved`, summed).
    pub(super) reserved: usize,
    /// Requests submitted so far: each one's arrival number.
    pub(super) arrivals: u64,
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
    pub(super) fn enqueue(&mut self, s: Sequence) {
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
    pub(super) fn slot_for(&self, s: &Sequence) -> bool {
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

    pub(super) fn events(&self) -> Events {
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
    pub(super) fn sample(&mut self, out: &mut Step) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.computed < s.len() {
                i += 1;
                continue;
            }
            let token = s.plan.next_token();
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

//! What an engine is asked, answers and counts: its settings, a request, a step's output.

use std::time::Duration;

use kvroute_core::{BlockExtraInfo, BlockHasher, BlockSize, SequenceHash};
use kvroute_wire::EngineEvent;

use crate::disagg::{DisaggConfig, Handoff};
use crate::host::HostConfig;
use crate::lora::LoraConfig;
use crate::sequence::OutputPlan;
use crate::timing::Timing;

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

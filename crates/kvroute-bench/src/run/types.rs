//! What a run is about and what it leaves: the simulated fleet and the target, and the
//! records of each request, the workers' counters and the samples taken while it ran.

use std::path::PathBuf;

use anyhow::Context;
use kvroute_core::BlockSize;
use kvroute_core::schedule::PolicyKind;
use kvroute_router::Dialect;
use kvroute_router::{RouterConfig, WorkerSpec};
use kvroute_stack::Simulated;
use serde::{Deserialize, Serialize};

/// The simulated fleet of self-contained runs.
#[derive(Clone, Debug, Serialize)]
pub struct FleetConfig {
    pub workers: usize,
    /// Engines the bench did not start, in place of the simulated workers.
    #[serde(skip)]
    pub external: Vec<WorkerSpec>,
    pub num_blocks: usize,
    pub block_size: u32,
    pub speedup: f64,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    /// The model (`None`: the built-in one).
    #[serde(skip)]
    pub model_path: Option<PathBuf>,
    /// How the front door speaks to the simulated workers.
    pub dialect: Dialect,
    /// A chat template of the engines' own (a Jinja file), unlike the front door's.
    pub engine_chat_template: Option<PathBuf>,
    /// The LoRA adapters every engine serves (the workload's).
    pub adapters: Vec<String>,
    /// Distinct adapters one engine's batch may use (its GPU slots).
    pub max_loras: usize,
    /// The router's session margin, seconds (`--session-margin` of `kvroute serve`).
    pub session_margin: f64,
    /// Host memory below each worker's GPU cache (none by default).
    pub host: kvroute_mocker::HostConfig,
    /// Blocks of a store the workers share, started with the fleet (0: none).
    pub store_blocks: usize,
    /// Prefill and decode workers instead of `workers` aggregated ones.
    pub disagg: Option<(usize, usize)>,
    /// The prefill-to-decode link's bandwidth, GB/s (within a node, with `nodes`).
    pub kv_transfer_bandwidth: f64,
    /// Between nodes (`None`: the same).
    pub kv_transfer_bandwidth_across_nodes: Option<f64>,
    /// Nodes each pool is spread over.
    pub nodes: usize,
    /// The router's pair cost settings (NAME=VALUE over the defaults and the fleet's links).
    pub pd_cost: Vec<(String, f64)>,
    /// The router's cost weights (NAME=VALUE over the defaults and the fleet's host tier).
    pub kv_cost: Vec<(String, f64)>,
    /// The pair cost made blind to one thing (a baseline run).
    pub pd_baseline: Option<PdBaseline>,
    /// The router's flow control (`enabled: false`: every request placed at once).
    pub flow: kvroute_core::schedule::flow::FlowConfig,
    /// The engines schedule by priority (vLLM's `--scheduling-policy priority`) and the
    /// front door tells them each request's (`--engine-priority`).
    pub engine_priority: bool,
    /// Dynamo's busy thresholds (KV usage, queued prefill tokens): a request is refused (503)
    /// when every worker is past one.
    pub refuse_when_busy: Option<(f64, usize)>,
}

/// What a baseline pair cost is blind to (`kvroute bench --pd-baselines`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PdBaseline {
    /// Every link priced as within a node (`topology=0`).
    TopologyBlind,
    /// The decode pool's cache not credited (`decode_cache_credit=0`).
    CacheBlind,
}

impl PdBaseline {
    pub fn label(self) -> &'static str {
        match self {
            Self::TopologyBlind => "topology-blind",
            Self::CacheBlind => "cache-blind",
        }
    }

    /// The pair cost setting it overrides.
    pub(crate) fn setting(self) -> (String, f64) {
        let name = match self {
            Self::TopologyBlind => "topology",
            Self::CacheBlind => "decode_cache_credit",
        };
        (name.to_owned(), 0.0)
    }
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            external: Vec::new(),
            workers: 4,
            num_blocks: 550,
            block_size: 16,
            speedup: 2.0,
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            model_path: None,
            dialect: Simulated::default().dialect,
            engine_chat_template: None,
            adapters: Vec::new(),
            max_loras: kvroute_mocker::lora::LoraConfig::default().max_loras,
            session_margin: kvroute_core::schedule::SessionConfig::default().margin_s,
            host: kvroute_mocker::HostConfig::default(),
            store_blocks: 0,
            disagg: None,
            kv_transfer_bandwidth: kvroute_mocker::DisaggConfig::default()
                .kv_transfer_bandwidth_gbps,
            kv_transfer_bandwidth_across_nodes: None,
            nodes: 1,
            pd_cost: Vec::new(),
            kv_cost: Vec::new(),
            flow: kvroute_core::schedule::flow::FlowConfig::default(),
            engine_priority: false,
            refuse_when_busy: None,
            pd_baseline: None,
        }
    }
}

impl FleetConfig {
    pub fn block_size(&self) -> anyhow::Result<BlockSize> {
        BlockSize::new(self.block_size).context("--block-size")
    }

    /// The router prices a host (and storage) load as the workers take it.
    pub fn price_host_loads(&self, kv: &mut kvroute_core::schedule::cost::KvConfig) {
        kv.host_bandwidth_gbps = self.host.h2d_gbps;
        kv.disk_bandwidth_gbps = self.host.storage_gbps;
        kv.external_bandwidth_gbps = self.host.store_gbps;
        kv.kv_bytes_per_token = self.host.kv_bytes_per_token;
    }

    /// The router of a run with `policy` over `workers` (none: the fleet's simulated ones),
    /// priced as the fleet's engines work.
    pub(crate) fn router_config(
        &self,
        policy: PolicyKind,
        workers: Vec<WorkerSpec>,
    ) -> anyhow::Result<RouterConfig> {
        let mut router =
            RouterConfig { block_size: self.block_size()?, workers, ..RouterConfig::default() };
        router.scheduler.policy = policy;
        router.scheduler.sessions.margin_s = self.session_margin;
        self.price_host_loads(&mut router.scheduler.kv);
        if !self.kv_cost.is_empty() {
            let mut settings = kvroute_stack::settings::Settings::default();
            settings.routing.kv_cost = self.kv_cost.clone();
            // Refused as `kvroute serve` refuses them (an unknown name, a negative value).
            settings.router_config().context("--kv-cost")?;
            let mut kv = serde_json::to_value(router.scheduler.kv)?;
            for (name, value) in &self.kv_cost {
                kv[name] = serde_json::json!(value);
            }
            router.scheduler.kv = serde_json::from_value(kv)?;
        }
        router.scheduler.pairs = self.pair_config()?;
        router.scheduler.flow = self.flow;
        if let Some((kv, prefill)) = self.refuse_when_busy {
            router.scheduler.busy_kv_usage = Some(kv);
            router.scheduler.busy_prefill_tokens = Some(prefill);
            router.scheduler.refuse_when_busy = true;
        }
        // The predictions run at the simulated engines' speed.
        router.scheduler.predictor.engine.speedup = self.speedup;
        Ok(router)
    }

    /// The router's pair cost: its settings read as `kvroute serve` reads them, over the
    /// links the fleet's engines pull over.
    pub fn pair_config(&self) -> anyhow::Result<kvroute_core::schedule::PairConfig> {
        let mut settings = kvroute_stack::settings::Settings::default();
        settings.engine.kv_transfer_bandwidth = Some(self.kv_transfer_bandwidth);
        settings.engine.kv_transfer_bandwidth_across_nodes =
            self.kv_transfer_bandwidth_across_nodes;
        settings.routing.pd_cost = self.pd_cost.clone();
        settings.routing.pd_cost.extend(self.pd_baseline.map(PdBaseline::setting));
        Ok(settings.router_config().context("--pd-cost")?.scheduler.pairs)
    }

    /// Blocks of every worker together, host memory included (what the best achievable hit
    /// rate may keep).
    pub fn capacity_blocks(&self) -> usize {
        let per_engine = self.num_blocks + self.host.num_blocks + self.host.storage_tier_blocks();
        self.engines() * per_engine + self.store_blocks
    }

    /// Simulated engines in all.
    pub fn engines(&self) -> usize {
        self.disagg.map_or(self.workers, |(p, d)| p + d)
    }
}

/// What a run drives.
#[derive(Clone, Debug)]
pub enum Target {
    /// A fresh fleet with this policy; with `events` off the simulated workers publish no KV
    /// events and the router predicts their caches from its own decisions (approximate mode).
    /// `dialect`: how the front door speaks to the simulated workers.
    /// `pd_baseline`: the pair cost made blind to one thing. `store`: the fleet's shared
    /// store, if it has one, is started (off: the baseline without it). `gateway`: through
    /// the test gateway.
    Fleet {
        policy: PolicyKind,
        events: bool,
        replicas: Option<Replicas>,
        dialect: Dialect,
        pd_baseline: Option<PdBaseline>,
        store: bool,
        /// Requests go through the test gateway (Envoy's side of ext_proc): with kvroute as
        /// its Endpoint Picker, or, for round-robin, the gateway alone taking endpoints in
        /// turn.
        gateway: bool,
    },
    /// OpenAI-compatible endpoints (replicas of one front door: requests are sprayed across
    /// them), and the workers' base URLs whose `/stats` give the ground truth.
    /// `worker_stats`: the workers whose `/stats` are the ground truth (their tokens, if
    /// they have any, sent to them alone).
    Remote {
        urls: Vec<String>,
        worker_stats: Vec<WorkerSpec>,
        model: Option<String>,
        api: TargetApi,
    },
}

/// The API a `--target`'s requests use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetApi {
    /// OpenAI's: `/v1/completions` for prompts, `/v1/chat/completions` for chats.
    #[default]
    Openai,
    /// SGLang's native `/generate`: `input_ids` or `text`, its cumulative stream.
    SglangGenerate,
}

/// Router replicas in front of one fleet.
#[derive(Clone, Debug)]
pub struct Replicas {
    pub n: usize,
    /// Share decisions over NATS.
    pub sync: bool,
    pub nats_url: Option<String>,
}

/// One request as it went.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestRecord {
    /// Index in the workload.
    pub index: usize,
    /// Position in the order requests were sent.
    pub sent_order: usize,
    pub warmup: bool,
    /// Seconds from the run's start to sending.
    pub sent_at: f64,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Gaps between streamed tokens, milliseconds.
    #[serde(skip)]
    pub itl_ms: Vec<f64>,
    pub output_tokens: usize,
    /// From the response's usage (the worker's own counts).
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The router's expectation (`x-kvroute-overlap-tokens`), when the endpoint says.
    pub predicted_tokens: Option<u64>,
    /// Of those, the tokens expected from host memory, disk and the shared store
    /// (`x-kvroute-overlap-tier-tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_tier_tokens: Option<[u64; 3]>,
    /// `x-kvroute-worker`, when the endpoint says.
    pub worker: Option<String>,
    /// `x-kvroute-prefill-worker`: another worker prefilled it (its cached tokens count the
    /// KV pulled from there, so they are not compared with the prediction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_worker: Option<String>,
    /// The adapter it asked for.
    pub adapter: Option<String>,
    /// Prompt tokens as the harness derived them (the preprocessor of the engines).
    pub prompt_len: usize,
    /// Sequence hashes of the prompt's full blocks ...
    #[serde(skip)]
    pub prompt_blocks: Vec<u64>,
    /// ... and of every full block the request left computed (its answer's included; the last
    /// answer token's KV never is).
    #[serde(skip)]
    pub computed_blocks: Vec<u64>,
    /// The answer's text.
    #[serde(skip)]
    pub answer: String,
    pub error: Option<String>,
    /// The HTTP status of a request refused before any answer (429, 503, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Its `Retry-After`, seconds, when refused with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// Its class and tenant in an overload workload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// One worker's `/stats` (the fields the harness reads).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct WorkerStats {
    pub num_waiting_reqs: u64,
    pub num_running_reqs: u64,
    pub kv_cache_usage: f64,
    pub kv_total_blocks: u64,
    pub requests_finished: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub evicted_blocks: u64,
    pub preemptions: u64,
    /// Host memory below the GPU cache: its size, the prompt tokens loaded from it (part of
    /// `cached_tokens`) and the bytes those loads moved.
    pub host_total_blocks: u64,
    pub storage_total_blocks: u64,
    pub host_hit_tokens: u64,
    pub host_loaded_bytes: u64,
    /// Storage below host memory: the prompt tokens promoted from it (part of
    /// `cached_tokens`).
    pub storage_hit_tokens: u64,
    /// A store the fleet shares: whether the engine uses one, and the prompt tokens it
    /// loaded from it (part of `cached_tokens`).
    pub shared_store: bool,
    pub store_hit_tokens: u64,
    /// A decode engine's requests whose KV was pulled: their prompt and cached tokens (part
    /// of `prompt_tokens` and `cached_tokens`, and counted on their prefill engine too).
    pub pulled_prompt_tokens: u64,
    pub pulled_cached_tokens: u64,
    /// The engine's adapter counters (its `/stats` `lora`).
    pub lora: LoraView,
    /// What a decode engine pulled from prefill engines (its `/stats` `handoff`).
    pub handoff: HandoffView,
    /// Its role in a disaggregated fleet (`both`: aggregated).
    pub role: kvroute_core::schedule::Role,
}

/// What the harness reads of an engine's disaggregated legs.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct HandoffView {
    /// Decode legs whose prompt KV came from a prefill engine, and the bytes pulled.
    pub received: u64,
    pub received_bytes: u64,
    /// Of those, pulled from a prefill engine of another node.
    pub received_across_nodes: u64,
}

/// What the harness reads of an engine's adapters.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct LoraView {
    pub stats: LoraCounts,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct LoraCounts {
    /// Adapters read from storage into a slot.
    pub loads: u64,
    /// Adapters copied from host memory into a slot.
    pub swaps: u64,
}

/// Every worker's stats at one moment.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds from the run's start.
    pub t: f64,
    pub workers: Vec<WorkerStats>,
}

/// What one run produced.
#[derive(Clone, Debug, Serialize)]
pub struct RunData {
    pub label: String,
    pub records: Vec<RequestRecord>,
    pub samples: Vec<Sample>,
    pub stats_start: Vec<WorkerStats>,
    pub stats_end: Vec<WorkerStats>,
    /// From the first request sent to the last answer.
    pub wall_secs: f64,
    /// Workers the router found drifted during the run (its self-check; `None` when the
    /// target does not say).
    pub drifts: Option<u64>,
    /// The router's first-token predictions against what it saw (its
    /// `kvroute_router_ttft_prediction_error_ratio`): how many, and the median and 90th
    /// percentile relative error; `None` when the target does not say.
    pub ttft_error: Option<(u64, f64, f64)>,
    /// What flow control did with the requests (its `kvroute_router_flow_requests_total`
    /// by outcome, summed over priorities and tenants); empty when the target does not say.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub flow: std::collections::BTreeMap<String, f64>,
}

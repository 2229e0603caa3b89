//! `kvroute bench`'s command line ([`BenchArgs`]): every setting with its pinned default,
//! the quick look's, the checks run before any fleet starts, and the workloads and fleets the
//! settings describe.

use std::path::PathBuf;

use anyhow::Context;
use kvroute_core::schedule::PolicyKind;
use kvroute_preprocess::Preprocessor;

use crate::run::{self, FleetConfig};
use crate::workload;
use crate::workload::{
    MultiTurn, Multimodal, RandomPrompts, SharedPrefix, TraceReplay, Workload, WorkloadKind,
};

/// The command line of `kvroute bench` (every default is the pinned configuration).
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Workloads to run, in order: shared-prefix, multi-turn, multimodal, random, and trace
    /// (a recorded trace replayed, see --trace; not in the default set: 6 runs of ~100 s).
    /// Default: shared-prefix,multi-turn,multimodal,random (with --slo-ttft-p99:
    /// shared-prefix,multi-turn).
    #[arg(long, env = "KVROUTE_BENCH_WORKLOADS", value_delimiter = ',')]
    pub workloads: Vec<WorkloadKind>,
    /// A first look in about 10 seconds: shared-prefix only, 16 groups x 6 prompts of
    /// 2,048 + 64 tokens with 8 out, speedup 4, kv against round-robin. The 16 system prompts
    /// are four times what one worker's cache holds and about what the fleet's hold, as in
    /// production, where routing decides whether each prompt is computed once or on every
    /// worker (and a prompt computed again misses the 10 ms of the goodput). Sets those settings (workloads, policies, sizes, speedup; no approximate runs)
    /// over any given.
    #[arg(long, env = "KVROUTE_BENCH_QUICK")]
    pub quick: bool,
    /// The overload bench instead (docs/bench/overload.md): interactive (short prompts on a
    /// tenant's shared prefix, TTFT objective 250 ms, priority 10), standard (priority 0) and
    /// batch (long prompts, sheddable: priority -1) requests from 4 tenants, one of which
    /// sends 10x its share, offered at --overload-loads times the fleet's measured capacity;
    /// each load with flow control and without it, and at the highest load the dynamo policy
    /// with Dynamo's busy thresholds and round-robin, and flow control without the heavy
    /// tenant. Writes overload.md and overload.json.
    #[arg(long, env = "KVROUTE_BENCH_OVERLOAD")]
    pub overload: bool,
    /// The fault bench instead (docs/bench/faults.md): streams of 256 tokens at 6 requests/s
    /// over three engine processes, one killed (SIGKILL) at 8 s and back at 14 s; run with
    /// streams allowed to move to another worker and without. Writes faults.md and .json.
    #[arg(long, env = "KVROUTE_BENCH_FAULTS")]
    pub faults: bool,
    /// The membership bench instead (docs/bench/membership.md): engines join and leave while
    /// the shared-prefix schedule runs at 12 requests/s. scale: 2 workers, 4 at 40 s, 3 at
    /// 90 s; rolling: 4 workers each replaced by one at a new address, one every 20 s. Each
    /// through every --churn-sources and --churn-via. Writes membership.md, .json and .svg.
    #[arg(long, value_delimiter = ',')]
    pub churn: Vec<crate::churn::ChurnPlan>,
    /// With --churn: where the members come from (api, dns: a dnsmasq on loopback, nats: a
    /// bucket on a nats-server of the bench's own, kube: an InferencePool and its pods on an
    /// API server of the bench's own).
    #[arg(long, value_delimiter = ',', default_value = "api")]
    pub churn_sources: Vec<crate::churn::ChurnSource>,
    /// With --churn: requests through the front door, or through a gateway whose picker is
    /// kvroute.
    #[arg(long, value_delimiter = ',', default_value = "front")]
    pub churn_via: Vec<crate::churn::ChurnVia>,
    /// With --overload: the offered loads, as multiples of the measured capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,1.5,3")]
    pub overload_loads: Vec<f64>,
    /// With --overload: seconds of arrivals per run.
    #[arg(long, default_value_t = 30.0)]
    pub overload_seconds: f64,
    /// With --overload: run flow control alone (and without the heavy tenant at the highest
    /// load), not the comparisons without it (a shorter look while tuning).
    #[arg(long)]
    pub overload_flow_only: bool,
    /// With --overload: the fleet's capacity in requests per second of the overload mix
    /// (measured first when not given: the rate answered when offered far more, without flow
    /// control).
    #[arg(long)]
    pub capacity: Option<f64>,
    /// Flow control's --max-engine-wait-ms in the runs that have it (default: the router's).
    #[arg(long)]
    pub max_engine_wait_ms: Option<f64>,
    /// Flow control's --over-share-wait in the runs that have it (default: the router's; 1
    /// keeps no reserve for tenants within their share).
    #[arg(long)]
    pub over_share_wait: Option<f64>,
    /// Turn the router's flow control on in every run (`--overload` turns it on in its own
    /// runs).
    #[arg(long, env = "KVROUTE_BENCH_FLOW_CONTROL")]
    pub flow_control: bool,
    /// Routing policies compared (self-contained mode). Default:
    /// kv,dynamo,round-robin,random,least-loaded (with --slo-ttft-p99: kv,dynamo,round-robin).
    #[arg(long, env = "KVROUTE_BENCH_POLICIES", value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Goodput search instead of one run per policy: for each SLO (TTFT p99, ms), the
    /// highest load each policy keeps under it (the arrival rate; for multi-turn, a closed
    /// loop, the number of users), found by whole runs at chosen loads (doubling or halving
    /// from the workload's default, then bisecting to within 20%; at most 6 probes per SLO).
    /// Approximate-mode runs are left out.
    #[arg(long, env = "KVROUTE_BENCH_SLO_TTFT_P99", value_delimiter = ',')]
    pub slo_ttft_p99: Vec<f64>,
    /// With --slo-ttft-p99: the time per output token's p99 (ms) must stay under this as
    /// well (a joint SLO). Default: 25 with --disagg, none otherwise; 0: none.
    #[arg(long, env = "KVROUTE_BENCH_SLO_TPOT_P99")]
    pub slo_tpot_p99: Option<f64>,
    /// Policies also run with the simulated workers' KV events switched off, the router
    /// predicting their caches from its own decisions (approximate mode; labelled
    /// `<policy>-approx`). `--approximate` with no value runs none.
    #[arg(
        long,
        env = "KVROUTE_BENCH_APPROXIMATE",
        value_delimiter = ',',
        num_args = 0..,
        default_value = "kv"
    )]
    pub approximate: Vec<PolicyKind>,
    /// Output directory (report.md, results.json, SVG plots).
    #[arg(long, env = "KVROUTE_BENCH_OUT", default_value = "bench-results")]
    pub out: PathBuf,
    /// Seed of every workload (same seed, same requests and schedule).
    #[arg(long, env = "KVROUTE_BENCH_SEED", default_value_t = 42)]
    pub seed: u64,
    /// The TTFT (ms) a request must meet to count in the terminal table's goodput (answered
    /// requests per second within it). --quick sets 10: its engines run at 4x speed, where a
    /// whole 2,112-token prefill takes about 12 ms and a cached one about 5.
    #[arg(long, env = "KVROUTE_BENCH_GOODPUT_TTFT_MS", default_value_t = 100.0)]
    pub goodput_ttft_ms: f64,
    /// Send shared-prefix and random prompts to /v1/completions as text instead of token ids
    /// (each token a word of the model's vocabulary, so shared prefixes stay shared block for
    /// block), for routers that take no token ids, such as sglang-router.
    #[arg(long, env = "KVROUTE_BENCH_TEXT_PROMPTS")]
    pub text_prompts: bool,
    /// How the front door speaks to the simulated workers: vllm-generate (its token ids to
    /// vLLM's generate API) or openai-chat (the client's body, tokenized again by the
    /// engine). Several, comma-separated: each policy runs over each, side by side (labelled
    /// `<policy>@<dialect>`).
    #[arg(
        long = "dialect",
        env = "KVROUTE_BENCH_DIALECT",
        value_delimiter = ',',
        default_value = "vllm-generate"
    )]
    pub dialects: Vec<kvroute_router::Dialect>,
    /// A chat template of the simulated engines' own (a Jinja file, as vLLM's
    /// --chat-template), unlike the front door's: chats then tokenize differently in the
    /// engine, which the openai-chat dialect shows as drift and vllm-generate does not.
    #[arg(long, env = "KVROUTE_BENCH_ENGINE_CHAT_TEMPLATE")]
    pub engine_chat_template: Option<PathBuf>,
    /// Rate sweep: run every workload at each of these arrival rates (requests/s; users/s
    /// for multi-turn) instead of its own default. A range FROM..TO:STEP stands for FROM,
    /// FROM+STEP, ... up to TO, and TO itself: `--rates 6..28:3` is 6, 9, ..., 27, 28. The
    /// report then has a sweep table and a plot of hit rate and TTFT p99 against the rate.
    #[arg(long, env = "KVROUTE_BENCH_RATES", value_delimiter = ',', value_parser = RateSpec::parse)]
    pub rates: Vec<RateSpec>,
    /// Runs at each rate (with --rates, or of the default rate): the same schedule played
    /// again, so what differs between runs is the machine's timing alone. The sweep plot shows
    /// every run's point and a line through the medians.
    #[arg(long, env = "KVROUTE_BENCH_RUNS", default_value_t = 1)]
    pub runs: usize,
    /// Share of each schedule's first requests (multi-turn: first rounds) left out of the
    /// latency figures.
    #[arg(long, env = "KVROUTE_BENCH_WARMUP", default_value_t = 0.1)]
    pub warmup: f64,
    /// Output tokens of every request.
    #[arg(long, env = "KVROUTE_BENCH_OUTPUT_TOKENS", default_value_t = 32)]
    pub output_tokens: u32,

    /// Simulated workers (self-contained mode).
    #[arg(long, env = "KVROUTE_BENCH_WORKERS", default_value_t = 4)]
    pub workers: usize,
    /// Engines the bench did not start, in place of simulated workers: each run starts
    /// kvroute with its policy in front of them, as `--worker` (id, url, events, replay,
    /// metrics, dialect, ...), after emptying their prefix caches (vLLM's
    /// /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1). Repeat for each engine;
    /// scripts/real-engines bench runs it on vLLM's CPU build.
    #[arg(long = "engine", env = "KVROUTE_BENCH_ENGINES", value_delimiter = ';')]
    pub engines: Vec<kvroute_router::WorkerSpec>,
    /// KV blocks of each simulated worker.
    #[arg(long, env = "KVROUTE_BENCH_NUM_BLOCKS", default_value_t = 550)]
    pub num_blocks: usize,
    /// Tokens per block (workers and router).
    #[arg(long, env = "KVROUTE_BENCH_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// The simulated workers run this many times faster than the timing model.
    #[arg(long, env = "KVROUTE_BENCH_SPEEDUP", default_value_t = 2.0)]
    pub speedup: f64,
    /// Most requests a simulated worker runs at once.
    #[arg(long, env = "KVROUTE_BENCH_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of a simulated worker's step.
    #[arg(long, env = "KVROUTE_BENCH_MAX_BATCHED_TOKENS", default_value_t = 8192)]
    pub max_batched_tokens: usize,
    /// Blocks of host memory below each simulated worker's GPU cache (vLLM's CPU offloading;
    /// Dynamo's mocker's flag): evicted prefixes are loaded back instead of recomputed, and
    /// the best achievable hit rate counts these blocks too. 0: none.
    #[arg(long, env = "KVROUTE_BENCH_NUM_HOST_BLOCKS", default_value_t = 0)]
    pub num_host_blocks: usize,
    /// Host-to-device bandwidth (GB/s) of the simulated workers' host loads.
    #[arg(long, env = "KVROUTE_BENCH_HOST_H2D_GBPS", default_value_t = 32.0)]
    pub host_offload_h2d_bandwidth_gbps: f64,
    /// Blocks of storage below each simulated worker's host memory (vLLM's tiering: host
    /// blocks cascaded to it, promoted back through host memory; needs --num-host-blocks).
    /// The best achievable hit rate counts these blocks too. 0: none.
    #[arg(long, env = "KVROUTE_BENCH_NUM_STORAGE_BLOCKS", default_value_t = 0)]
    pub num_storage_blocks: usize,
    /// Bandwidth (GB/s) of reading a storage block into host memory.
    #[arg(long, env = "KVROUTE_BENCH_STORAGE_GBPS", default_value_t = 10.0)]
    pub storage_bandwidth_gbps: f64,
    /// Blocks of a KV store the fleet's workers share (docs/mocker.md, "Shared store"),
    /// started with each fleet: a prefix one worker computed, another loads from it at
    /// --store-bandwidth-gbps. The best achievable hit rate counts these blocks too. 0: none.
    #[arg(long, env = "KVROUTE_BENCH_NUM_STORE_BLOCKS", default_value_t = 0)]
    pub num_store_blocks: usize,
    /// Bandwidth (GB/s) of loading a block from the shared store.
    #[arg(long, env = "KVROUTE_BENCH_STORE_GBPS", default_value_t = 12.5)]
    pub store_bandwidth_gbps: f64,
    /// With --num-store-blocks: each policy also runs without the store, in the same run
    /// (labelled <policy>-no-store).
    #[arg(long, env = "KVROUTE_BENCH_STORE_BASELINE")]
    pub store_baseline: bool,
    /// How the simulated workers time a load from below the GPU: `async` (beside the steps,
    /// as vLLM's offloading connector and Dynamo's mocker) or `sync` (inside the admitting
    /// step).
    #[arg(long, env = "KVROUTE_BENCH_TIER_LOADS", default_value = "async")]
    pub tier_loads: kvroute_mocker::TierLoads,
    /// KV bytes per token of the simulated model (the size of a host load and of a prefill's
    /// transfer to its decode worker).
    #[arg(long, env = "KVROUTE_BENCH_KV_BYTES_PER_TOKEN", default_value_t = 131_072.0)]
    pub kv_bytes_per_token: f64,
    /// A disaggregated fleet of P prefill and D decode workers instead of --workers
    /// aggregated ones (docs/routing.md, "Prefill and decode"). Example: --disagg 2:2
    #[arg(long, env = "KVROUTE_BENCH_DISAGG", value_parser = parse_disagg)]
    pub disagg: Option<(usize, usize)>,
    /// Bandwidth (GB/s) of the link a decode worker pulls its prefill's KV over.
    #[arg(long, env = "KVROUTE_BENCH_KV_TRANSFER_BANDWIDTH", default_value_t = 25.0)]
    pub kv_transfer_bandwidth: f64,
    /// With --nodes: the bandwidth (GB/s) between workers of different nodes (then
    /// --kv-transfer-bandwidth is the link within a node). Default: the same.
    #[arg(long, env = "KVROUTE_BENCH_KV_TRANSFER_BANDWIDTH_ACROSS_NODES")]
    pub kv_transfer_bandwidth_across_nodes: Option<f64>,
    /// With --disagg: nodes each pool is spread over (node-0, node-1, ... in turn), labelled
    /// for the router and the engines alike.
    #[arg(long, env = "KVROUTE_BENCH_NODES", default_value_t = 1)]
    pub nodes: usize,
    /// With --disagg: a setting of the router's pair cost as NAME=VALUE, as `kvroute serve
    /// --pd-cost` takes it (the links' bandwidths default to the fleet's).
    #[arg(long, env = "KVROUTE_BENCH_PD_COST", value_delimiter = ',', value_parser = kvroute_stack::settings::kv_weight)]
    pub pd_cost: Vec<(String, f64)>,
    /// A weight of the router's cost as NAME=VALUE, as `kvroute serve --kv-cost` takes it
    /// (docs/routing.md; the host tier's bandwidth and bytes per token default to the fleet's).
    #[arg(long, env = "KVROUTE_BENCH_KV_COST", value_delimiter = ',', value_parser = kvroute_stack::settings::kv_weight)]
    pub kv_cost: Vec<(String, f64)>,
    /// With --disagg: the kv policy also runs with the pair cost blind to one thing, in the
    /// same run: topology-blind (every link priced as within a node, `topology=0`) or
    /// cache-blind (the decode pool's cache not credited, `decode_cache_credit=0`); labelled
    /// kv-topology-blind, kv-cache-blind.
    #[arg(long, env = "KVROUTE_BENCH_PD_BASELINES", value_delimiter = ',', value_enum)]
    pub pd_baselines: Vec<run::PdBaseline>,
    /// Model directory (tokenizer and chat template); default: the repository's kvroute-tiny.
    #[arg(long, env = "KVROUTE_BENCH_MODEL_PATH")]
    pub model_path: Option<PathBuf>,

    /// shared-prefix: groups (each with its own system prompt).
    #[arg(long, env = "KVROUTE_BENCH_GROUPS", default_value_t = 12)]
    pub groups: usize,
    /// shared-prefix: prompts per group.
    #[arg(long, env = "KVROUTE_BENCH_PROMPTS_PER_GROUP", default_value_t = 64)]
    pub prompts_per_group: usize,
    /// shared-prefix: system prompt tokens.
    #[arg(long, env = "KVROUTE_BENCH_SYSTEM_TOKENS", default_value_t = 2048)]
    pub system_tokens: usize,
    /// shared-prefix: question tokens.
    #[arg(long, env = "KVROUTE_BENCH_QUESTION_TOKENS", default_value_t = 64)]
    pub question_tokens: usize,
    /// shared-prefix: arrival rate, requests/s.
    #[arg(long, env = "KVROUTE_BENCH_SHARED_PREFIX_RATE", default_value_t = 24.0)]
    pub shared_prefix_rate: f64,

    /// multi-turn: users.
    #[arg(long, env = "KVROUTE_BENCH_USERS", default_value_t = 24)]
    pub users: usize,
    /// multi-turn: rounds per user.
    #[arg(long, env = "KVROUTE_BENCH_ROUNDS", default_value_t = 28)]
    pub rounds: usize,
    /// multi-turn: tokens of each user's opening context.
    #[arg(long, env = "KVROUTE_BENCH_CONTEXT_TOKENS", default_value_t = 256)]
    pub context_tokens: usize,
    /// multi-turn: tokens of each new user turn.
    #[arg(long, env = "KVROUTE_BENCH_TURN_TOKENS", default_value_t = 32)]
    pub turn_tokens: usize,
    /// multi-turn: mean think time between an answer and the next round, seconds.
    #[arg(long, env = "KVROUTE_BENCH_THINK_TIME", default_value_t = 0.5)]
    pub think_time: f64,
    /// multi-turn: users arriving per second.
    #[arg(long, env = "KVROUTE_BENCH_MULTI_TURN_RATE", default_value_t = 12.0)]
    pub multi_turn_rate: f64,

    /// multimodal: requests.
    #[arg(long, env = "KVROUTE_BENCH_MM_REQUESTS", default_value_t = 240)]
    pub mm_requests: usize,
    /// multimodal: distinct generated images in the pool.
    #[arg(long, env = "KVROUTE_BENCH_IMAGES", default_value_t = 24)]
    pub images: usize,
    /// multimodal: side of the square images, pixels.
    #[arg(long, env = "KVROUTE_BENCH_IMAGE_SIDE", default_value_t = 336)]
    pub image_side: u32,
    /// multimodal: arrival rate, requests/s.
    #[arg(long, env = "KVROUTE_BENCH_MULTIMODAL_RATE", default_value_t = 16.0)]
    pub multimodal_rate: f64,

    /// long-prompt: requests.
    #[arg(long, env = "KVROUTE_BENCH_LONG_REQUESTS", default_value_t = 120)]
    pub long_requests: usize,
    /// long-prompt: prompt tokens.
    #[arg(long, env = "KVROUTE_BENCH_LONG_PROMPT_TOKENS", default_value_t = 4096)]
    pub long_prompt_tokens: usize,
    /// long-prompt: the shared documents prompts open with, and their tokens.
    #[arg(long, env = "KVROUTE_BENCH_LONG_DOCUMENTS", default_value_t = 8)]
    pub long_documents: usize,
    #[arg(long, env = "KVROUTE_BENCH_LONG_DOCUMENT_TOKENS", default_value_t = 1024)]
    pub long_document_tokens: usize,
    /// long-prompt: answer tokens (its own: --output-tokens is the others').
    #[arg(long, env = "KVROUTE_BENCH_LONG_OUTPUT_TOKENS", default_value_t = 256)]
    pub long_output_tokens: u32,
    /// long-prompt: arrival rate, requests/s.
    #[arg(long, env = "KVROUTE_BENCH_LONG_RATE", default_value_t = 2.0)]
    pub long_rate: f64,
    /// long-prompt: KV blocks of each simulated worker (its requests hold ~270 blocks each:
    /// the fleet is sized to it).
    #[arg(long, env = "KVROUTE_BENCH_LONG_NUM_BLOCKS", default_value_t = 4096)]
    pub long_num_blocks: usize,

    /// random: requests.
    #[arg(long, env = "KVROUTE_BENCH_RANDOM_REQUESTS", default_value_t = 160)]
    pub random_requests: usize,
    /// random: prompt tokens.
    #[arg(long, env = "KVROUTE_BENCH_RANDOM_PROMPT_TOKENS", default_value_t = 1024)]
    pub random_prompt_tokens: usize,
    /// random: arrival rate, requests/s.
    #[arg(long, env = "KVROUTE_BENCH_RANDOM_RATE", default_value_t = 12.0)]
    pub random_rate: f64,

    /// multi-lora: distinct adapters (named lora-00, lora-01, ... by popularity); every
    /// engine serves them all.
    #[arg(long, env = "KVROUTE_BENCH_ADAPTERS", default_value_t = 32)]
    pub adapters: usize,
    /// multi-lora: Zipf exponent of adapter popularity.
    #[arg(long, env = "KVROUTE_BENCH_ADAPTER_ZIPF", default_value_t = 1.1)]
    pub adapter_zipf: f64,
    /// multi-lora: requests.
    #[arg(long, env = "KVROUTE_BENCH_LORA_REQUESTS", default_value_t = 480)]
    pub lora_requests: usize,
    /// multi-lora: tokens of each adapter's own system prompt.
    #[arg(long, env = "KVROUTE_BENCH_LORA_SYSTEM_TOKENS", default_value_t = 1024)]
    pub lora_system_tokens: usize,
    /// multi-lora: arrival rate, requests/s.
    #[arg(long, env = "KVROUTE_BENCH_MULTI_LORA_RATE", default_value_t = 12.0)]
    pub multi_lora_rate: f64,
    /// multi-lora: distinct adapters one engine's batch may use (its GPU slots, vLLM's
    /// --max-loras).
    #[arg(long, env = "KVROUTE_BENCH_MAX_LORAS", default_value_t = 4)]
    pub max_loras: usize,
    /// sessions: seconds of predicted time to first token by which another worker must beat
    /// a session's worker to take the session (the router's --session-margin).
    #[arg(long, env = "KVROUTE_BENCH_SESSION_MARGIN", default_value_t = 0.05)]
    pub session_margin: f64,

    /// trace: the trace replayed (Mooncake format: timestamp ms, input_length, output_length,
    /// hash_ids of 512-token blocks); default: the repository's
    /// traces/mooncake_conversation_trace.jsonl.
    #[arg(long, env = "KVROUTE_BENCH_TRACE")]
    pub trace: Option<PathBuf>,
    /// trace: its first requests replayed.
    #[arg(long, env = "KVROUTE_BENCH_TRACE_REQUESTS", default_value_t = 600)]
    pub trace_requests: usize,
    /// trace: tokens each 512-token hash_id becomes (every length scales by this / 512;
    /// keep it a multiple of --block-size).
    #[arg(long, env = "KVROUTE_BENCH_TRACE_BLOCK_TOKENS", default_value_t = 64)]
    pub trace_block_tokens: usize,
    /// trace: arrival times are multiplied by this (0.5 replays twice as fast); a --rates
    /// sweep scales to each mean rate instead.
    #[arg(long, env = "KVROUTE_BENCH_TRACE_TIME_SCALE", default_value_t = 0.5)]
    pub trace_time_scale: f64,
    /// trace: KV blocks of each simulated worker for the trace (its prompts are far longer
    /// than the synthetic workloads': the fleet is sized to it).
    #[arg(long, env = "KVROUTE_BENCH_TRACE_NUM_BLOCKS", default_value_t = 8192)]
    pub trace_num_blocks: usize,

    /// Drive this OpenAI-compatible endpoint instead of starting a fleet per policy (e.g.
    /// another router in front of `kvroute mocker` workers); several, comma-separated, are
    /// replicas of one front door: requests are sprayed across them round-robin, skipping one
    /// that refuses connections.
    #[arg(long, env = "KVROUTE_BENCH_TARGET")]
    pub target: Option<String>,
    /// With --target: the workers' base URLs, whose /stats give the ground-truth cache
    /// counters (comma-separated).
    #[arg(long, env = "KVROUTE_BENCH_WORKER_STATS", value_delimiter = ',', requires = "target")]
    pub worker_stats: Vec<String>,
    /// With --target: the name of the run in the report.
    #[arg(long, env = "KVROUTE_BENCH_LABEL", requires = "target")]
    pub label: Option<String>,
    /// With --target: the model name to send (default: the first of its /v1/models).
    #[arg(long, env = "KVROUTE_BENCH_MODEL", requires = "target")]
    pub model: Option<String>,
    /// With --target: the API its requests use: openai (/v1/completions for prompts,
    /// /v1/chat/completions for chats) or sglang-generate (SGLang's native /generate, a
    /// prompt's token ids as input_ids or its text as text; not for multi-turn or
    /// multimodal, whose requests are chats).
    #[arg(
        long,
        env = "KVROUTE_BENCH_TARGET_API",
        value_enum,
        default_value_t,
        requires = "target"
    )]
    pub target_api: run::TargetApi,

    /// Router replicas: each policy also runs with N front doors (each with its router) over
    /// the one fleet, requests sprayed round-robin across them as a load balancer would (a
    /// replica that refuses connections is skipped), once with the replicas sharing their
    /// decisions over NATS ("-sync") and once without ("-alone"), beside the one-replica run.
    #[arg(long, env = "KVROUTE_BENCH_REPLICAS", default_value_t = 1)]
    pub replicas: usize,
    /// Each policy also runs through the test gateway that plays Envoy's side of ext_proc
    /// (docs/kubernetes.md), labelled `<policy>-gateway`: with kvroute as the gateway's
    /// Endpoint Picker, or for round-robin the gateway alone, taking endpoints in turn.
    /// Compare with `--dialect openai-chat`, the body the gateway sends the engines.
    #[arg(long, env = "KVROUTE_BENCH_GATEWAY")]
    pub gateway: bool,
    /// With --replicas: the NATS server the replicas use (default: the bench starts a
    /// nats-server from PATH, or KVROUTE_NATS_SERVER, in a temporary directory).
    #[arg(long, env = "KVROUTE_BENCH_NATS")]
    pub nats: Option<String>,
}

/// The TPOT p99 a disaggregated fleet's goodput keeps under by default (ms).
pub const DISAGG_SLO_TPOT_MS: f64 = 25.0;

/// `P:D`, two counts of workers, neither 0.
fn parse_disagg(s: &str) -> anyhow::Result<(usize, usize)> {
    let (p, d) = s.split_once(':').context("expected P:D, e.g. 2:2")?;
    let n = |v: &str| v.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match (n(p), n(d)) {
        (Some(p), Some(d)) => Ok((p, d)),
        _ => anyhow::bail!("{s:?}: P and D must be counts above 0"),
    }
}

/// One `--rates` item: a rate, or a range `FROM..TO:STEP` (FROM, FROM+STEP, ... below TO,
/// then TO).
#[derive(Clone, Debug, PartialEq)]
pub struct RateSpec(pub Vec<f64>);

impl RateSpec {
    fn parse(s: &str) -> Result<Self, String> {
        let number = |t: &str| t.trim().parse::<f64>().map_err(|e| format!("{t:?}: {e}"));
        let Some((from, rest)) = s.split_once("..") else { return Ok(Self(vec![number(s)?])) };
        let (to, step) = rest.split_once(':').ok_or("a range is FROM..TO:STEP, e.g. 6..28:3")?;
        let (from, to, step) = (number(from)?, number(to)?, number(step)?);
        if !(step > 0.0 && from <= to && (to - from) / step <= 1_000.0) {
            return Err(format!("{s}: FROM must be <= TO and STEP > 0 (at most 1,000 steps)"));
        }
        let mut rates: Vec<f64> =
            (0..).map(|k| from + f64::from(k) * step).take_while(|r| *r < to - 1e-9).collect();
        rates.push(to);
        Ok(Self(rates))
    }
}

impl BenchArgs {
    /// The `--rates`, ranges spelled out.
    pub fn rates(&self) -> Vec<f64> {
        self.rates.iter().flat_map(|r| r.0.iter().copied()).collect()
    }

    pub fn fleet(&self) -> FleetConfig {
        FleetConfig {
            workers: self.workers,
            external: self.engines.clone(),
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            speedup: self.speedup,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            model_path: self.model_path.clone(),
            dialect: self.dialects.first().copied().unwrap_or_default(),
            engine_chat_template: self.engine_chat_template.clone(),
            adapters: Vec::new(),
            max_loras: self.max_loras,
            session_margin: self.session_margin,
            host: kvroute_mocker::HostConfig {
                num_blocks: self.num_host_blocks,
                h2d_gbps: self.host_offload_h2d_bandwidth_gbps,
                kv_bytes_per_token: self.kv_bytes_per_token,
                storage_blocks: self.num_storage_blocks,
                storage_gbps: self.storage_bandwidth_gbps,
                store_gbps: self.store_bandwidth_gbps,
                loads: self.tier_loads,
                ..kvroute_mocker::HostConfig::default()
            },
            store_blocks: self.num_store_blocks,
            disagg: self.disagg,
            kv_transfer_bandwidth: self.kv_transfer_bandwidth,
            kv_transfer_bandwidth_across_nodes: self.kv_transfer_bandwidth_across_nodes,
            nodes: self.nodes,
            pd_cost: self.pd_cost.clone(),
            kv_cost: self.kv_cost.clone(),
            pd_baseline: None,
            flow: self.flow_config(),
            engine_priority: false,
            refuse_when_busy: None,
        }
    }

    /// The TPOT p99 of the goodput's joint SLO (ms): as given (0: none), 25 with --disagg.
    pub fn slo_tpot(&self) -> Option<f64> {
        match self.slo_tpot_p99 {
            Some(ms) => (ms > 0.0).then_some(ms),
            None => self.disagg.map(|_| DISAGG_SLO_TPOT_MS),
        }
    }

    /// The workloads run: as given, or the mode's default.
    pub fn workloads(&self) -> Vec<WorkloadKind> {
        use WorkloadKind::*;
        match (self.workloads.is_empty(), self.slo_ttft_p99.is_empty()) {
            (false, _) => self.workloads.clone(),
            (true, true) => vec![SharedPrefix, MultiTurn, Multimodal, Random],
            (true, false) => vec![SharedPrefix, MultiTurn],
        }
    }

    /// The policies compared: as given, or the mode's default.
    pub fn policies(&self) -> Vec<PolicyKind> {
        use PolicyKind::*;
        match (self.policies.is_empty(), self.slo_ttft_p99.is_empty()) {
            (false, _) => self.policies.clone(),
            (true, true) => vec![Kv, Dynamo, RoundRobin, Random, LeastLoaded],
            (true, false) => vec![Kv, Dynamo, RoundRobin],
        }
    }

    /// The router's flow control in these runs.
    pub fn flow_config(&self) -> kvroute_core::schedule::flow::FlowConfig {
        let d = kvroute_core::schedule::flow::FlowConfig::default();
        kvroute_core::schedule::flow::FlowConfig {
            enabled: self.flow_control,
            max_engine_wait_ms: self.max_engine_wait_ms.unwrap_or(d.max_engine_wait_ms),
            over_share_wait: self.over_share_wait.unwrap_or(d.over_share_wait),
            ..d
        }
    }

    /// The arrival rate a workload runs at by default (the goodput search starts there).
    pub fn default_rate(&self, kind: WorkloadKind, preprocessor: &Preprocessor) -> f64 {
        match kind {
            WorkloadKind::SharedPrefix => self.shared_prefix_rate,
            WorkloadKind::MultiTurn | WorkloadKind::Sessions => self.multi_turn_rate,
            WorkloadKind::MultiLora => self.multi_lora_rate,
            WorkloadKind::Multimodal => self.multimodal_rate,
            WorkloadKind::Random => self.random_rate,
            WorkloadKind::LongPrompt => self.long_rate,
            WorkloadKind::Overload => 1.0,
            WorkloadKind::Trace => match self.workload(kind, None, preprocessor) {
                Ok(w) => {
                    let last = w.requests.iter().filter_map(|r| match r.start {
                        workload::Start::At(t) => Some(t),
                        workload::Start::After { .. } => None,
                    });
                    let span = last.fold(0.0, f64::max);
                    if span > 0.0 { w.requests.len() as f64 / span } else { 1.0 }
                }
                Err(_) => 1.0,
            },
        }
    }

    /// The fleet a workload runs on: the trace's is sized to it.
    pub fn fleet_for(&self, kind: WorkloadKind) -> FleetConfig {
        match kind {
            WorkloadKind::Trace => {
                FleetConfig { num_blocks: self.trace_num_blocks, ..self.fleet() }
            }
            WorkloadKind::LongPrompt => {
                FleetConfig { num_blocks: self.long_num_blocks, ..self.fleet() }
            }
            _ => self.fleet(),
        }
    }

    /// `--quick`: these settings with the quick look's workload, policies and sizes.
    pub(crate) fn quick_look(&self) -> BenchArgs {
        BenchArgs {
            quick: false,
            workloads: vec![WorkloadKind::SharedPrefix],
            policies: vec![PolicyKind::Kv, PolicyKind::RoundRobin],
            approximate: Vec::new(),
            groups: 16,
            prompts_per_group: 6,
            system_tokens: 2048,
            output_tokens: 8,
            speedup: 4.0,
            goodput_ttft_ms: 10.0,
            ..self.clone()
        }
    }

    pub(crate) fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.slo_ttft_p99.iter().all(|s| s.is_finite() && *s > 0.0),
            "--slo-ttft-p99: milliseconds > 0"
        );
        anyhow::ensure!(
            self.slo_ttft_p99.is_empty() || self.rates.is_empty(),
            "--slo-ttft-p99 chooses its own rates: leave out --rates"
        );
        anyhow::ensure!(
            self.slo_tpot_p99.is_none_or(|s| s.is_finite() && s >= 0.0),
            "--slo-tpot-p99: milliseconds >= 0"
        );
        anyhow::ensure!(self.nodes >= 1, "--nodes must be at least 1");
        anyhow::ensure!(
            self.goodput_ttft_ms.is_finite() && self.goodput_ttft_ms > 0.0,
            "--goodput-ttft-ms: milliseconds > 0"
        );
        anyhow::ensure!(
            !self.store_baseline || self.num_store_blocks > 0,
            "--store-baseline compares against a shared store: give --num-store-blocks"
        );
        anyhow::ensure!(
            self.num_store_blocks == 0 || self.disagg.is_none(),
            "the simulated engines share a store only without prefill and decode workers"
        );
        // A bad --pd-cost is reported before any fleet starts.
        self.fleet().pair_config()?;
        anyhow::ensure!(
            self.long_prompt_tokens > 0 && self.long_requests > 0 && self.long_rate > 0.0,
            "--long-prompt-tokens, --long-requests and --long-rate must be > 0"
        );
        anyhow::ensure!(
            self.disagg.is_some() || (self.pd_baselines.is_empty() && self.nodes == 1),
            "--pd-baselines and --nodes are for a disaggregated fleet: give --disagg P:D"
        );
        anyhow::ensure!(self.target.is_some() || self.workers > 0, "--workers must be > 0");
        anyhow::ensure!((0.0..1.0).contains(&self.warmup), "--warmup must be in [0, 1)");
        anyhow::ensure!(self.speedup > 0.0, "--speedup must be > 0");
        let rates =
            [self.shared_prefix_rate, self.multi_turn_rate, self.multimodal_rate, self.random_rate];
        anyhow::ensure!(
            rates.iter().chain(&self.rates()).all(|r| r.is_finite() && *r > 0.0),
            "rates must be > 0"
        );
        anyhow::ensure!(self.runs >= 1, "--runs must be >= 1");
        anyhow::ensure!(self.think_time >= 0.0, "--think-time must be >= 0");
        anyhow::ensure!(
            self.session_margin.is_finite() && self.session_margin >= 0.0,
            "--session-margin must be >= 0"
        );
        anyhow::ensure!(
            self.trace_time_scale.is_finite() && self.trace_time_scale > 0.0,
            "--trace-time-scale must be > 0"
        );
        anyhow::ensure!(self.trace_requests > 0, "--trace-requests must be > 0");
        anyhow::ensure!(self.replicas >= 1, "--replicas must be at least 1");
        anyhow::ensure!(
            self.replicas == 1 || self.target.is_none(),
            "--replicas starts its own fleet: leave out --target"
        );
        let chats = [WorkloadKind::MultiTurn, WorkloadKind::Sessions, WorkloadKind::Multimodal];
        anyhow::ensure!(
            self.target_api == run::TargetApi::Openai
                || !self.workloads.iter().any(|w| chats.contains(w)),
            "--target-api sglang-generate sends prompts, and multi-turn and multimodal send chats: pick other --workloads"
        );
        let targets = self.target.iter().flat_map(|t| t.split(',')).map(str::trim);
        for url in targets.chain(self.worker_stats.iter().map(String::as_str)) {
            anyhow::ensure!(
                url.starts_with("http://"),
                "{url:?}: give an http:// URL (--target, --worker-stats)"
            );
        }
        Ok(())
    }

    /// The multi-turn schedule at `rate` (users/s; its default when `None`).
    pub(crate) fn multi_turn(&self, rate: Option<f64>) -> MultiTurn {
        MultiTurn {
            users: self.users,
            rounds: self.rounds,
            context_tokens: self.context_tokens,
            turn_tokens: self.turn_tokens,
            output_tokens: self.output_tokens,
            rate: rate.unwrap_or(self.multi_turn_rate),
            think_time: self.think_time,
        }
    }

    /// The workload `kind` at `rate` (its default when `None`).
    pub fn workload(
        &self,
        kind: WorkloadKind,
        rate: Option<f64>,
        preprocessor: &Preprocessor,
    ) -> anyhow::Result<Workload> {
        let bs = self.fleet().block_size()?;
        let o = self.output_tokens;
        let workload = match kind {
            WorkloadKind::SharedPrefix => SharedPrefix {
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                system_tokens: self.system_tokens,
                question_tokens: self.question_tokens,
                output_tokens: o,
                rate: rate.unwrap_or(self.shared_prefix_rate),
            }
            .generate(self.seed, bs, self.warmup),
            WorkloadKind::MultiTurn => {
                self.multi_turn(rate).generate(self.seed, self.warmup, preprocessor)?
            }
            WorkloadKind::Sessions => {
                workload::sessions(&self.multi_turn(rate), self.seed, self.warmup, preprocessor)?
            }
            WorkloadKind::MultiLora => workload::MultiLora {
                adapters: self.adapters,
                zipf: self.adapter_zipf,
                requests: self.lora_requests,
                system_tokens: self.lora_system_tokens,
                question_tokens: self.question_tokens,
                output_tokens: o,
                rate: rate.unwrap_or(self.multi_lora_rate),
            }
            .generate(self.seed, bs, self.warmup)?,
            WorkloadKind::Multimodal => Multimodal {
                requests: self.mm_requests,
                images: self.images,
                image_side: self.image_side,
                output_tokens: o,
                rate: rate.unwrap_or(self.multimodal_rate),
                ..Multimodal::default()
            }
            .generate(self.seed, bs, self.warmup, preprocessor)?,
            WorkloadKind::Overload => {
                crate::workload::tenants_overload(self.seed, rate.unwrap_or(1.0), 30.0, true, bs)
            }
            WorkloadKind::LongPrompt => workload::LongPrompts {
                requests: self.long_requests,
                documents: self.long_documents,
                document_tokens: self.long_document_tokens,
                prompt_tokens: self.long_prompt_tokens,
                output_tokens: self.long_output_tokens,
                rate: rate.unwrap_or(self.long_rate),
            }
            .generate(self.seed, bs, self.warmup)
            .sized(&self.fleet_for(kind), "--long-num-blocks"),
            WorkloadKind::Random => RandomPrompts {
                requests: self.random_requests,
                prompt_tokens: self.random_prompt_tokens,
                output_tokens: o,
                rate: rate.unwrap_or(self.random_rate),
            }
            .generate(self.seed, bs, self.warmup),
            WorkloadKind::Trace => TraceReplay {
                path: self.trace.clone().unwrap_or_else(TraceReplay::default_path),
                requests: self.trace_requests,
                block_tokens: self.trace_block_tokens,
                time_scale: self.trace_time_scale,
                rate,
            }
            .generate(self.seed, bs, self.warmup)
            .map(|w| w.sized(&self.fleet_for(kind), "--trace-num-blocks"))?,
        };
        match self.text_prompts {
            true => workload.into_text(preprocessor, bs),
            false => Ok(workload),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RateSpec;

    #[test]
    fn a_rate_range_is_spelled_out_to_its_end() {
        let r = |s: &str| RateSpec::parse(s).map(|r| r.0);
        assert_eq!(r("18"), Ok(vec![18.0]));
        assert_eq!(r("6..28:3"), Ok(vec![6.0, 9.0, 12.0, 15.0, 18.0, 21.0, 24.0, 27.0, 28.0]));
        assert_eq!(r("6..12:3"), Ok(vec![6.0, 9.0, 12.0]));
        assert_eq!(r("5..5:1"), Ok(vec![5.0]));
        for bad in ["6..28", "28..6:3", "6..28:0", "6..28:-1", "x", "0..1e9:1e-3"] {
            assert!(r(bad).is_err(), "{bad}");
        }
    }
}

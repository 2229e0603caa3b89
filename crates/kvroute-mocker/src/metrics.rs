//! The simulated engine's Prometheus metrics: kvroute's own names, and the gauges and counters
//! vLLM serves under the same names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`,
//! `vllm:prefix_cache_hits_total`, `vllm:cache_config_info`), so a router that reads an
//! engine's `/metrics` (kvroute's with `metrics=http://...`, or another) reads this one too.
//! Values are the engine's snapshot at scrape time.

use kvroute_http::metrics::{CounterOf, Family, FloatGauge, Gauge, Registry};

use crate::service::{AdapterSnapshot, Snapshot};

pub const KV_USAGE: &str = "kvroute_mocker_kv_cache_usage";
pub const WAITING: &str = "kvroute_mocker_waiting_requests";
pub const RUNNING: &str = "kvroute_mocker_running_requests";
pub const PROMPT_TOKENS: &str = "kvroute_mocker_prompt_tokens";
pub const CACHED_TOKENS: &str = "kvroute_mocker_cached_prompt_tokens";
pub const EVICTED: &str = "kvroute_mocker_evicted_blocks";
pub const PREEMPTIONS: &str = "kvroute_mocker_preemptions";
pub const FINISHED: &str = "kvroute_mocker_requests_finished";
pub const RENDERED: &str = "kvroute_mocker_render_requests";
pub const GENERATED: &str = "kvroute_mocker_generate_requests";
pub const SGLANG_GENERATED: &str = "kvroute_mocker_sglang_generate_requests";
pub const ZMQ_REFUSED: &str = "kvroute_mocker_zmq_refused_messages";
pub const HOST_HIT_TOKENS: &str = "kvroute_mocker_host_hit_tokens";
pub const HOST_LOADED_BYTES: &str = "kvroute_mocker_host_loaded_bytes";
pub const HOST_BLOCKS: &str = "kvroute_mocker_host_blocks";
pub const STORAGE_HIT_TOKENS: &str = "kvroute_mocker_storage_hit_tokens";
pub const STORAGE_BLOCKS: &str = "kvroute_mocker_storage_blocks";
pub const STORE_HIT_TOKENS: &str = "kvroute_mocker_store_hit_tokens";
pub const HELD_BLOCKS: &str = "kvroute_mocker_kv_held_blocks";
pub const HELD_REQUESTS: &str = "kvroute_mocker_kv_held_requests";
pub const REMOTE_TOKENS: &str = "kvroute_mocker_kv_remote_tokens";
pub const VLLM_RUNNING: &str = "vllm:num_requests_running";
pub const VLLM_WAITING: &str = "vllm:num_requests_waiting";
pub const VLLM_KV_USAGE: &str = "vllm:kv_cache_usage_perc";
pub const VLLM_PREFIX_QUERIES: &str = "vllm:prefix_cache_queries";
pub const VLLM_PREFIX_HITS: &str = "vllm:prefix_cache_hits";
pub const VLLM_CACHE_CONFIG: &str = "vllm:cache_config_info";
pub const VLLM_LORA_INFO: &str = "vllm:lora_requests_info";
pub const LORA_LOADS: &str = "kvroute_mocker_lora_loads";
pub const LORA_SWAPS: &str = "kvroute_mocker_lora_swaps";

/// vLLM's `vllm:lora_requests_info` labels: `max_lora`, `waiting_lora_adapters`,
/// `running_lora_adapters` (names comma-joined).
type LoraLabels = Vec<(String, String)>;

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    kv_usage: FloatGauge,
    waiting: Gauge,
    running: Gauge,
    prompt_tokens: CounterOf,
    cached_tokens: CounterOf,
    evicted: CounterOf,
    preemptions: CounterOf,
    finished: CounterOf,
    rendered: kvroute_http::metrics::Counter,
    generated: kvroute_http::metrics::Counter,
    sglang_generated: kvroute_http::metrics::Counter,
    zmq_refused: CounterOf,
    vllm_running: Gauge,
    vllm_waiting: Gauge,
    vllm_kv_usage: FloatGauge,
    vllm_queries: CounterOf,
    vllm_hits: CounterOf,
    lora_info: Family<LoraLabels, FloatGauge>,
    lora_loads: CounterOf,
    lora_swaps: CounterOf,
    host_hit_tokens: CounterOf,
    host_loaded_bytes: CounterOf,
    host_blocks: Gauge,
    storage_hit_tokens: CounterOf,
    storage_blocks: Gauge,
    store_hit_tokens: CounterOf,
    held_blocks: Gauge,
    held_requests: Gauge,
    remote_tokens: CounterOf,
}

impl Metrics {
    pub fn new(model_name: &str, dp_rank: u32, block_size: u32, num_blocks: usize) -> Self {
        let m = Self {
            registry: Registry::default(),
            kv_usage: FloatGauge::default(),
            waiting: Gauge::default(),
            running: Gauge::default(),
            prompt_tokens: CounterOf::default(),
            cached_tokens: CounterOf::default(),
            evicted: CounterOf::default(),
            preemptions: CounterOf::default(),
            finished: CounterOf::default(),
            rendered: kvroute_http::metrics::Counter::default(),
            generated: kvroute_http::metrics::Counter::default(),
            sglang_generated: kvroute_http::metrics::Counter::default(),
            zmq_refused: CounterOf::default(),
            vllm_running: Gauge::default(),
            vllm_waiting: Gauge::default(),
            vllm_kv_usage: FloatGauge::default(),
            vllm_queries: CounterOf::default(),
            vllm_hits: CounterOf::default(),
            lora_info: Family::default(),
            lora_loads: CounterOf::default(),
            lora_swaps: CounterOf::default(),
            host_hit_tokens: CounterOf::default(),
            host_loaded_bytes: CounterOf::default(),
            host_blocks: Gauge::default(),
            storage_hit_tokens: CounterOf::default(),
            storage_blocks: Gauge::default(),
            store_hit_tokens: CounterOf::default(),
            held_blocks: Gauge::default(),
            held_requests: Gauge::default(),
            remote_tokens: CounterOf::default(),
        };
        let mut r = Registry::default();
        r.register(KV_USAGE, "Share of KV blocks in use (0-1)", m.kv_usage.clone());
        r.register(WAITING, "Requests waiting to be scheduled", m.waiting.clone());
        r.register(RUNNING, "Requests running", m.running.clone());
        r.register(
            PROMPT_TOKENS,
            "Prompt tokens of finished requests",
            m.prompt_tokens.counter.clone(),
        );
        r.register(
            CACHED_TOKENS,
            "Prompt tokens served from the prefix cache",
            m.cached_tokens.counter.clone(),
        );
        r.register(EVICTED, "KV blocks evicted", m.evicted.counter.clone());
        r.register(
            HOST_HIT_TOKENS,
            "Prompt tokens loaded from host memory instead of computed (part of the cached ones)",
            m.host_hit_tokens.counter.clone(),
        );
        r.register(
            HOST_LOADED_BYTES,
            "Bytes of KV loaded from host memory",
            m.host_loaded_bytes.counter.clone(),
        );
        r.register(HOST_BLOCKS, "KV blocks held in host memory", m.host_blocks.clone());
        r.register(
            STORAGE_HIT_TOKENS,
            "Prompt tokens promoted from storage instead of computed (part of the cached ones)",
            m.storage_hit_tokens.counter.clone(),
        );
        r.register(STORAGE_BLOCKS, "KV blocks held in storage", m.storage_blocks.clone());
        r.register(
            STORE_HIT_TOKENS,
            "Prompt tokens loaded from the shared store instead of computed (part of the cached ones)",
            m.store_hit_tokens.counter.clone(),
        );
        r.register(
            HELD_BLOCKS,
            "KV blocks of finished prefills held for their decode engine to pull",
            m.held_blocks.clone(),
        );
        r.register(
            HELD_REQUESTS,
            "Finished prefills held for their decode engine",
            m.held_requests.clone(),
        );
        r.register(
            REMOTE_TOKENS,
            "Prompt tokens whose KV came from a prefill engine",
            m.remote_tokens.counter.clone(),
        );
        r.register(PREEMPTIONS, "Requests preempted", m.preemptions.counter.clone());
        r.register(FINISHED, "Requests finished", m.finished.counter.clone());
        r.register(
            RENDERED,
            "Requests rendered to token ids (vLLM's render endpoints)",
            m.rendered.clone(),
        );
        r.register(
            GENERATED,
            "Requests taken as token ids by vLLM's /inference/v1/generate",
            m.generated.clone(),
        );
        r.register(
            SGLANG_GENERATED,
            "Requests taken by SGLang's native /generate",
            m.sglang_generated.clone(),
        );
        r.register(
            ZMQ_REFUSED,
            "Messages its ZMQ sockets refused before allocation for exceeding their size limit",
            m.zmq_refused.counter.clone(),
        );
        r.register(
            LORA_LOADS,
            "LoRA adapters read from storage into a GPU slot",
            m.lora_loads.counter.clone(),
        );
        r.register(
            LORA_SWAPS,
            "LoRA adapters copied from host memory into a GPU slot",
            m.lora_swaps.counter.clone(),
        );
        // As vLLM registers it: no model or engine label.
        r.register(VLLM_LORA_INFO, "Running stats on lora requests.", m.lora_info.clone());
        // vLLM's labels: the model and the data-parallel engine.
        let label = |k: &'static str, v: String| (k.into(), v.into());
        let vllm = r.sub_registry_with_labels(
            [label("model_name", model_name.to_owned()), label("engine", dp_rank.to_string())]
                .into_iter(),
        );
        vllm.register(
            VLLM_RUNNING,
            "Number of requests in model execution batches",
            m.vllm_running.clone(),
        );
        vllm.register(
            VLLM_WAITING,
            "Number of requests waiting to be processed",
            m.vllm_waiting.clone(),
        );
        vllm.register(
            VLLM_KV_USAGE,
            "KV-cache usage. 1 means 100 percent usage",
            m.vllm_kv_usage.clone(),
        );
        vllm.register(
            VLLM_PREFIX_QUERIES,
            "Prefix cache queries, in terms of number of queried tokens",
            m.vllm_queries.counter.clone(),
        );
        vllm.register(
            VLLM_PREFIX_HITS,
            "Prefix cache hits, in terms of number of cached tokens",
            m.vllm_hits.counter.clone(),
        );
        let config: Gauge = Gauge::default();
        config.set(1);
        vllm.sub_registry_with_labels(
            [
                label("block_size", block_size.to_string()),
                label("num_gpu_blocks", num_blocks.to_string()),
            ]
            .into_iter(),
        )
        .register(VLLM_CACHE_CONFIG, "Information of the LLMEngine CacheConfig", config);
        Self { registry: r, ..m }
    }

    /// A render endpoint answered.
    pub fn rendered(&self) {
        self.rendered.inc();
    }

    /// vLLM's generate endpoint took a request.
    pub fn generated(&self) {
        self.generated.inc();
    }

    /// SGLang's generate endpoint took a request.
    pub fn sglang_generated(&self) {
        self.sglang_generated.inc();
    }

    /// `vllm:lora_requests_info` and the adapter counters brought up to date with `a`. vLLM
    /// sets the gauge of the current labels to the time and keeps every older label set; this
    /// engine keeps only the current one (the newest is what a reader takes).
    pub fn refresh_adapters(&self, a: &AdapterSnapshot, enabled: bool) {
        self.lora_loads.sync(a.stats.loads);
        self.lora_swaps.sync(a.stats.swaps);
        if !enabled {
            return;
        }
        let names = AdapterSnapshot::joined;
        let labels = vec![
            ("max_lora".to_owned(), a.max_lora.to_string()),
            ("waiting_lora_adapters".to_owned(), names(&a.waiting)),
            ("running_lora_adapters".to_owned(), names(&a.running)),
        ];
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.lora_info.clear();
        self.lora_info.get_or_create(&labels).set(now);
    }

    /// The registry, brought up to date with `s`.
    pub fn refresh(&self, s: &Snapshot) -> &Registry {
        self.kv_usage.set(s.kv_cache_usage);
        self.waiting.set(s.num_waiting_reqs as i64);
        self.running.set(s.num_running_reqs as i64);
        self.prompt_tokens.sync(s.stats.prompt_tokens);
        self.cached_tokens.sync(s.stats.cached_tokens);
        self.evicted.sync(s.stats.evicted_blocks);
        self.host_hit_tokens.sync(s.stats.host_hit_tokens);
        self.host_loaded_bytes.sync(s.stats.host_loaded_bytes);
        self.host_blocks.set(s.stats.host_blocks as i64);
        self.storage_hit_tokens.sync(s.stats.storage_hit_tokens);
        self.storage_blocks.set(s.stats.storage_blocks as i64);
        self.store_hit_tokens.sync(s.stats.store_hit_tokens);
        self.held_blocks.set(s.stats.held_blocks as i64);
        self.held_requests.set(s.stats.held_requests as i64);
        self.remote_tokens.sync(s.stats.remote_tokens);
        self.preemptions.sync(s.stats.preemptions);
        self.finished.sync(s.stats.requests_finished);
        self.zmq_refused.sync(s.zmq_refused);
        self.vllm_running.set(s.num_running_reqs as i64);
        self.vllm_waiting.set(s.num_waiting_reqs as i64);
        self.vllm_kv_usage.set(s.kv_cache_usage);
        self.vllm_queries.sync(s.stats.prompt_tokens);
        self.vllm_hits.sync(s.stats.cached_tokens);
        &self.registry
    }
}

//! Workers and router settings: `--worker id=7,url=http://..,events=tcp://..` values or TOML
//! `[[workers]]` tables with the same keys and values (docs/running.md).

use std::str::FromStr;

use kvroute_core::index::{ApproxConfig, IndexConfig};
use kvroute_core::schedule::SchedulerConfig;
use kvroute_core::{BlockSize, WorkerId};
use serde::{Deserialize, Serialize};

pub mod replicas;

pub use kvroute_wire::EventFormat;

/// What a configuration cannot be (flags, files and their checks alike).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("endpoint {0:?} has no port")]
    NoPort(String),
    #[error("--worker {flag:?}: {why}")]
    WorkerFlag { flag: String, why: WorkerFlagError },
    #[error(transparent)]
    Nats(#[from] replicas::NatsConfigError),
    #[error("max_dp_size must be at least 1")]
    MaxDpSize,
    #[error("worker id {0} given twice")]
    DuplicateWorker(WorkerId),
    #[error("{0} workers configured: at most {1} (--max-workers)")]
    TooManyWorkers(usize, usize),
    #[error("worker {worker}: {why}")]
    Worker { worker: WorkerId, why: WorkerError },
}

/// What is wrong with one `--worker key=value,...` flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerFlagError {
    #[error("{0:?} is not key=value")]
    NotKeyValue(String),
    #[error("{key} must be a number, not {value:?}")]
    NotANumber { key: String, value: String },
    #[error("unknown key {0:?}")]
    UnknownKey(String),
    #[error("id is required")]
    NoId,
    #[error("dp_size must be at least 1")]
    NoRanks,
    #[error(transparent)]
    Format(#[from] kvroute_wire::UnknownFormat),
    #[error("unknown dialect {0:?} (known: {known})", known = Dialect::NAMES.join(", "))]
    Dialect(String),
    #[error(transparent)]
    Role(#[from] kvroute_core::UnknownChoice),
}

/// What is wrong with one configured worker.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    #[error("endpoint {0:?} must be tcp://host:port")]
    Endpoint(String),
    #[error(
        "metrics {0:?} must be tcp://host:port (load reports) or http://host:port/metrics (Prometheus)"
    )]
    Metrics(String),
    #[error("replay without events (give events, or neither for approximate mode)")]
    ReplayWithoutEvents,
    #[error("dp_size {dp_size} is above max_dp_size {max_dp_size}")]
    TooManyRanks { dp_size: u32, max_dp_size: u32 },
    #[error("{0}")]
    BlockSize(#[from] kvroute_core::Error),
}

/// How the front door speaks to a worker (docs/dialects.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dialect {
    /// The client's OpenAI body as it came, to any OpenAI-compatible server (which renders
    /// and tokenizes the prompt again).
    #[default]
    OpenaiChat,
    /// vLLM 0.33's `/inference/v1/generate`: the token ids the front door hashed go in, the
    /// text comes out; what that API cannot carry goes as chat.
    VllmGenerate,
    /// OpenAI's `/v1/completions` with the token ids as the prompt (vLLM, SGLang and most
    /// OpenAI-compatible engines take them); chat answers are made from its completions.
    OpenaiCompletionsTokens,
    /// SGLang's native `/generate`: the token ids go in as `input_ids`, the text comes out.
    SglangGenerate,
    /// vLLM's `/inference/v1/generate` with token ids both ways (`output_mode: "tokens"`):
    /// the front door detokenizes, so the engine needs no tokenizer at all (vLLM's
    /// `--skip-tokenizer-init`).
    VllmGenerateTokens,
}

impl Dialect {
    /// Every dialect's name, as `--worker dialect=` takes it.
    pub const NAMES: [&str; 5] = [
        "openai-chat",
        "vllm-generate",
        "openai-completions-tokens",
        "sglang-generate",
        "vllm-generate-tokens",
    ];

    /// Whether the engine gets the front door's token ids.
    pub fn sends_tokens(self) -> bool {
        self != Dialect::OpenaiChat
    }
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dialect::OpenaiChat => Dialect::NAMES[0],
            Dialect::VllmGenerate => Dialect::NAMES[1],
            Dialect::OpenaiCompletionsTokens => Dialect::NAMES[2],
            Dialect::SglangGenerate => Dialect::NAMES[3],
            Dialect::VllmGenerateTokens => Dialect::NAMES[4],
        })
    }
}

impl FromStr for Dialect {
    type Err = WorkerFlagError;

    fn from_str(s: &str) -> Result<Self, WorkerFlagError> {
        match s {
            "openai-chat" => Ok(Dialect::OpenaiChat),
            "vllm-generate" => Ok(Dialect::VllmGenerate),
            "openai-completions-tokens" => Ok(Dialect::OpenaiCompletionsTokens),
            "sglang-generate" => Ok(Dialect::SglangGenerate),
            "vllm-generate-tokens" => Ok(Dialect::VllmGenerateTokens),
            other => Err(WorkerFlagError::Dialect(other.to_owned())),
        }
    }
}

/// One worker (engine instance) of the fleet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    pub id: WorkerId,
    /// Its OpenAI-compatible HTTP endpoint (absent for a router that only scores).
    #[serde(default)]
    pub url: Option<String>,
    /// Its KV event publisher (absent: approximate mode, the router assumes what it routed
    /// there is cached for a while).
    #[serde(default)]
    pub events: Option<String>,
    /// Its replay (ROUTER) endpoint, for recovering missed batches.
    #[serde(default)]
    pub replay: Option<String>,
    /// Its load reports: a ZMQ stream of JSON messages (`tcp://`), or a Prometheus endpoint
    /// polled for vLLM's gauges (`http://.../metrics`).
    #[serde(default)]
    pub metrics: Option<String>,
    /// Defaults to the router's block size.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Data-parallel ranks; rank r publishes on the events port + r (as vLLM does).
    #[serde(default = "one")]
    pub dp_size: u32,
    /// The model's image pad token id (placeholder normalisation).
    #[serde(default)]
    pub image_token_id: Option<u32>,
    /// The model's vocabulary size (SGLang / TensorRT-LLM placeholders are at or above it).
    #[serde(default)]
    pub vocab_size: Option<u32>,
    #[serde(default)]
    pub format: EventFormat,
    /// How the front door sends it requests.
    #[serde(default)]
    pub dialect: Dialect,
    /// Its LoRA adapter slots (vLLM's `--max-loras`), until its reports say (they win).
    #[serde(default)]
    pub max_loras: Option<usize>,
    /// The token its HTTP routes want (`Authorization: Bearer`), sent to it alone: a
    /// simulated worker embedded in `kvroute serve` gets an unguessable one. Never
    /// serialized, never shown.
    #[serde(skip)]
    pub api_key: Option<WorkerKey>,
    /// Its part in a disaggregated fleet: `prefill`, `decode` or `both` (docs/routing.md,
    /// "Prefill and decode").
    #[serde(default)]
    pub role: kvroute_core::schedule::Role,
    /// Its node (or zone): workers with the same label share the fast link (`--pd-cost
    /// link_within_node_gbps`); unlabelled workers share one node.
    #[serde(default)]
    pub node: Option<String>,
    /// A prefill worker's SGLang bootstrap port (its host is its URL's), which the front door
    /// names to both legs of an SGLang request.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// An HTTP client of `workers`: each worker's own token (if it has one) goes to it alone.
pub fn workers_client(workers: &[WorkerSpec]) -> kvroute_http::HttpClient {
    workers.iter().fold(kvroute_http::HttpClient::new(), |client, w| match (&w.url, &w.api_key) {
        (Some(url), Some(key)) => client.with_bearer_for(url, &key.0),
        _ => client,
    })
}

/// A worker's token; its `Debug` shows none of it.
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerKey(pub String);

impl std::fmt::Debug for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerKey(<redacted>)")
    }
}

fn one() -> u32 {
    1
}

impl WorkerSpec {
    pub fn new(id: u64) -> Self {
        Self {
            id: WorkerId(id),
            url: None,
            events: None,
            replay: None,
            metrics: None,
            block_size: None,
            dp_size: 1,
            image_token_id: None,
            vocab_size: None,
            format: EventFormat::Vllm,
            dialect: Dialect::OpenaiChat,
            max_loras: None,
            api_key: None,
            role: kvroute_core::schedule::Role::Both,
            node: None,
            bootstrap_port: None,
        }
    }

    /// The event endpoint of data-parallel rank `rank` (the port moved up by `rank`).
    pub fn endpoint_for_rank(endpoint: &str, rank: u32) -> Result<String, ConfigError> {
        if rank == 0 {
            return Ok(endpoint.to_owned());
        }
        let no_port = || ConfigError::NoPort(endpoint.to_owned());
        let (head, port) = endpoint.rsplit_once(':').ok_or_else(no_port)?;
        let port: u32 = port.parse().map_err(|_| no_port())?;
        Ok(format!("{head}:{}", port + rank))
    }
}

impl FromStr for WorkerSpec {
    type Err = ConfigError;

    /// `id=7,url=http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://..:5558`
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let bad = |why: WorkerFlagError| ConfigError::WorkerFlag { flag: s.to_owned(), why };
        let mut id = None;
        let mut spec = WorkerSpec::new(0);
        for pair in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| bad(WorkerFlagError::NotKeyValue(pair.into())))?;
            let (key, value) = (key.trim(), value.trim().to_owned());
            let nan =
                |v: &str| bad(WorkerFlagError::NotANumber { key: key.into(), value: v.into() });
            let number = |v: &str| v.parse::<u64>().map_err(|_| nan(v));
            let small = |v: &str| v.parse::<u32>().map_err(|_| nan(v));
            match key {
                "id" => id = Some(number(&value)?),
                "url" => spec.url = Some(value),
                "events" => spec.events = Some(value),
                "replay" => spec.replay = Some(value),
                "metrics" => spec.metrics = Some(value),
                "block_size" => spec.block_size = Some(small(&value)?),
                "dp_size" => spec.dp_size = small(&value)?,
                "image_token_id" => spec.image_token_id = Some(small(&value)?),
                "vocab_size" => spec.vocab_size = Some(small(&value)?),
                "format" => {
                    spec.format = value.parse().map_err(|e| bad(WorkerFlagError::Format(e)))?;
                }
                "dialect" => spec.dialect = value.parse().map_err(bad)?,
                "max_loras" => spec.max_loras = Some(small(&value)? as usize),
                "role" => {
                    spec.role = value.parse().map_err(|e| bad(WorkerFlagError::Role(e)))?;
                }
                "node" => spec.node = Some(value),
                "bootstrap_port" => {
                    spec.bootstrap_port = Some(value.parse().map_err(|_| nan(&value))?);
                }
                other => return Err(bad(WorkerFlagError::UnknownKey(other.into()))),
            }
        }
        spec.id = WorkerId(id.ok_or_else(|| bad(WorkerFlagError::NoId))?);
        if spec.dp_size == 0 {
            return Err(bad(WorkerFlagError::NoRanks));
        }
        Ok(spec)
    }
}

/// Default of [`RouterConfig::max_dp_size`]: more than any data-parallel deployment uses.
pub const DEFAULT_MAX_DP_SIZE: u32 = 256;

/// Default of [`RouterConfig::zmq_max_message_bytes`].
pub use kvroute_wire::transport::DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_ZMQ_MAX_MESSAGE_BYTES;

/// Default of [`RouterConfig::max_learned_workers`].
pub const DEFAULT_MAX_LEARNED_WORKERS: usize = 1024;

/// Where routing decisions are logged and which share (`state::DecisionLog`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecisionLogConfig {
    pub path: std::path::PathBuf,
    /// Share of decisions logged, 0 to 1 (by a keyed hash of the request's id, its key drawn
    /// at start: no caller can choose ids that are always logged).
    pub ratio: f64,
    /// The file is rotated past this size: `path` becomes `path.1`, `path.1` `path.2`, ...
    pub max_bytes: u64,
    /// Files kept, the one written included (at least 1: then it is truncated instead).
    pub files: usize,
}

/// The decision log's rotation, unless configured: 100 MiB a file, 5 files.
pub const DEFAULT_DECISION_LOG_MAX_BYTES: u64 = 100 << 20;
pub const DEFAULT_DECISION_LOG_FILES: usize = 5;

/// Everything the router service needs, with kvroute's defaults.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouterConfig {
    pub block_size: BlockSize,
    pub workers: Vec<WorkerSpec>,
    /// Index shards: each its own tree behind its own lock, so writers to different shards
    /// run in parallel, but every lookup walks every shard (a prefix many workers hold is in
    /// each). One, the default, is the fastest lookup; more only help several event threads.
    pub shards: usize,
    pub index: IndexConfig,
    /// Most data-parallel ranks a worker may have: events naming a rank at or above it are
    /// refused (a rank is a slot in every per-worker table, so an unbounded one from the wire
    /// would size memory).
    pub max_dp_size: u32,
    /// Most workers the router learns from posted events (`/events`, `/debug/inject_event`)
    /// when no worker is configured; with configured workers, posted events naming another
    /// worker are refused.
    pub max_learned_workers: usize,
    /// Approximate mode (workers without `events`).
    pub approx: ApproxConfig,
    pub scheduler: SchedulerConfig,
    /// Replicas over NATS: decisions shared, events from a JetStream stream (docs/replicas.md).
    pub nats: Option<replicas::NatsConfig>,
    /// The largest ZMQ message (all frames) an engine's event, replay or load socket may
    /// send; larger ones are refused before anything is allocated and the peer dropped
    /// (see [`kvroute_wire::transport`]).
    pub zmq_max_message_bytes: usize,
    /// The sampled decision log; none by default.
    pub decision_log: Option<DecisionLogConfig>,
    /// Most members at once, from every source together (the configuration, the admin API,
    /// DNS, a bucket, Kubernetes): a join past it is refused, the members kept.
    pub max_workers: usize,
    /// Where the router keeps its state across restarts (the index and where each event
    /// stream was, [`crate::saved`]); none: it starts empty.
    pub state_dir: Option<std::path::PathBuf>,
}

/// Most members at once, unless configured (each source's own bound, too).
pub const DEFAULT_MAX_WORKERS: usize = 1024;

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: BlockSize::default(),
            workers: Vec::new(),
            shards: 1,
            // 16M (worker, block) pairs: ~0.8 GB of index at most, whatever the event flood.
            index: IndexConfig { max_held_blocks: Some(16 << 20) },
            max_dp_size: DEFAULT_MAX_DP_SIZE,
            max_learned_workers: DEFAULT_MAX_LEARNED_WORKERS,
            approx: ApproxConfig::default(),
            scheduler: SchedulerConfig::default(),
            nats: None,
            zmq_max_message_bytes: DEFAULT_ZMQ_MAX_MESSAGE_BYTES,
            decision_log: None,
            max_workers: DEFAULT_MAX_WORKERS,
            state_dir: None,
        }
    }
}

impl RouterConfig {
    /// Checks what serde cannot: unique worker ids, usable endpoints.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(nats) = &self.nats {
            nats.validate()?;
        }
        if self.max_dp_size == 0 {
            return Err(ConfigError::MaxDpSize);
        }
        if self.workers.len() > self.max_workers {
            return Err(ConfigError::TooManyWorkers(self.workers.len(), self.max_workers));
        }
        let mut ids: Vec<_> = self.workers.iter().map(|w| w.id).collect();
        ids.sort_unstable();
        if let Some(dup) = ids.windows(2).find(|p| p[0] == p[1]) {
            return Err(ConfigError::DuplicateWorker(dup[0]));
        }
        for w in &self.workers {
            w.validate(self.max_dp_size)
                .map_err(|why| ConfigError::Worker { worker: w.id, why })?;
        }
        Ok(())
    }
}

impl WorkerSpec {
    pub(crate) fn validate(&self, max_dp_size: u32) -> Result<(), WorkerError> {
        for endpoint in [&self.events, &self.replay].into_iter().flatten() {
            if !endpoint.starts_with("tcp://") {
                return Err(WorkerError::Endpoint(endpoint.clone()));
            }
        }
        if let Some(m) = &self.metrics
            && !m.starts_with("tcp://")
            && !m.starts_with("http://")
        {
            return Err(WorkerError::Metrics(m.clone()));
        }
        if self.replay.is_some() && self.events.is_none() {
            return Err(WorkerError::ReplayWithoutEvents);
        }
        if self.dp_size > max_dp_size {
            return Err(WorkerError::TooManyRanks { dp_size: self.dp_size, max_dp_size });
        }
        if let Some(bs) = self.block_size {
            BlockSize::new(bs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_flags_parse_with_clear_errors() {
        let w: WorkerSpec = "id=7,url=http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,dp_size=2"
            .parse()
            .unwrap();
        assert_eq!(w.id, WorkerId(7));
        assert_eq!(w.events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(
            WorkerSpec::endpoint_for_rank("tcp://127.0.0.1:5557", 1).unwrap(),
            "tcp://127.0.0.1:5558"
        );
        let err = "url=http://x".parse::<WorkerSpec>().unwrap_err().to_string();
        assert!(err.contains("id is required"), "{err}");
        let err = "id=1,colour=red".parse::<WorkerSpec>().unwrap_err().to_string();
        assert!(err.contains("unknown key \"colour\""), "{err}");
        assert!("id=x".parse::<WorkerSpec>().is_err());
    }

    #[test]
    fn toml_tables_take_every_key_and_value_of_the_flag() {
        #[derive(Deserialize)]
        struct File {
            workers: Vec<WorkerSpec>,
        }
        let file: File = toml::from_str(
            "[[workers]]\nid = 1\nevents = \"tcp://127.0.0.1:5557\"\nformat = \"sglang\"\n[[workers]]\nid = 2\nformat = \"trtllm-json\"\nmetrics = \"http://127.0.0.1:8000/metrics\"\n",
        )
        .unwrap();
        let flag: WorkerSpec = "id=1,events=tcp://127.0.0.1:5557,format=sglang".parse().unwrap();
        assert_eq!(file.workers[0], flag);
        assert_eq!(flag.dialect, Dialect::OpenaiChat, "the client's body by default");
        let tokens: WorkerSpec = "id=3,dialect=vllm-generate".parse().unwrap();
        let table: File =
            toml::from_str("[[workers]]\nid = 3\ndialect = \"vllm-generate\"\n").unwrap();
        assert_eq!((tokens.dialect, &table.workers[0]), (Dialect::VllmGenerate, &tokens));
        let err = "id=3,dialect=grpc".parse::<WorkerSpec>().unwrap_err().to_string();
        assert!(
            err.contains("unknown dialect \"grpc\" (known: openai-chat, vllm-generate, openai-completions-tokens, sglang-generate, vllm-generate-tokens)"),
            "{err}"
        );
        assert_eq!(file.workers[1].format, EventFormat::TrtllmJson);
        let bad = toml::from_str::<File>("[[workers]]\nid = 1\nformat = \"vlm\"\n");
        assert!(bad.is_err_and(|e| e.to_string().contains("unknown event format")));
        let config = RouterConfig { workers: file.workers, ..RouterConfig::default() };
        config.validate().unwrap();
        let dup = RouterConfig {
            workers: vec![WorkerSpec::new(1), WorkerSpec::new(1)],
            ..RouterConfig::default()
        };
        assert!(dup.validate().is_err());
    }
}

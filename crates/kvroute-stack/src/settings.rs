//! What configures a stack, from three sources merged setting by setting: a command-line flag
//! wins over its `KVROUTE_*` environment variable (clap reads both), which wins over the
//! `--config` TOML file, which wins over the default. A file uses the flags' names in
//! `snake_case` (`block_size = 32`, `policy = "dynamo"`) and `[[workers]]` tables with the
//! `--worker` keys; a key a command does not use is an error, not ignored.
//!
//! Workers add up across the file and the flags; a worker id given in both must have the same
//! keys (it is then one worker), else it is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_core::BlockSize;
use kvroute_core::index::{ApproxConfig, IndexConfig};
use kvroute_core::schedule::kv::KvConfig;
use kvroute_core::schedule::{PolicyKind, SchedulerConfig};
use kvroute_frontend::FrontDoorOptions;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_preprocess::fetch::FetchConfig;
use kvroute_router::nats::{DEFAULT_SNAPSHOT_EVERY, EventsVia, NatsConfig};
use kvroute_router::{RouterConfig, WorkerSpec};
use serde::{Deserialize, Serialize};

use kvroute_http::{Credentials, ServeOptions};

use crate::{Access, Simulated, StackConfig, StackError};

pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_READY_TIMEOUT_SECS: f64 = 10.0;
pub const DEFAULT_SIMULATED_WORKERS: usize = 4;
/// The ports the commands listen on by default.
pub const DEFAULT_FRONT_DOOR_PORT: u16 = 8000;
pub const DEFAULT_ROUTER_PORT: u16 = 8001;

/// Why settings could not be read or merged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    #[error("reading {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}")]
    Parse { path: PathBuf, source: toml::de::Error },
    #[error("{path}: `{key}` does not apply to `kvroute {command}`")]
    NotFor { path: PathBuf, key: String, command: String },
    #[error("{path}: unknown key `{key}`")]
    Unknown { path: PathBuf, key: String },
    #[error(
        "worker {0} is given twice with different keys (in the file and by --worker or KVROUTE_WORKERS)"
    )]
    WorkerTwice(kvroute_core::WorkerId),
    #[error("the settings cannot be written as TOML")]
    Print(#[source] toml::ser::Error),
    #[error("the merged settings do not read back")]
    Merge(#[source] toml::de::Error),
}

/// A setting's value that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    #[error(
        "refusing to listen on {host} without {missing}: anyone who reaches it could use it. Give them, listen on 127.0.0.1, or pass --insecure when a proxy in front authenticates"
    )]
    Exposed { host: String, missing: String },
    #[error("--tls-cert and --tls-key go together")]
    TlsPair,
    #[error("{0} must be at least 1")]
    AtLeastOne(&'static str),
    #[error("block_size: {0}")]
    BlockSize(#[source] kvroute_core::Error),
    #[error("temperature must be >= 0")]
    Temperature,
    #[error("--nats-events needs --nats-url")]
    NatsEventsWithoutUrl,
    #[error("speedup must be > 0")]
    Speedup,
    #[error("num_blocks, max_num_seqs and max_batched_tokens must be > 0")]
    EngineZero,
    #[error("reading {}: {source}", path.display())]
    ReadSecret { path: PathBuf, source: std::io::Error },
    #[error("{}: no token in it", .0.display())]
    NoToken(PathBuf),
    #[error("{0} must be a number of seconds >= 0")]
    Seconds(String),
    #[error("unknown kv_cost weight `{name}` (known: {known})")]
    KvCostName { name: String, known: String },
    #[error("kv_cost {name} must be >= 0, not {value}")]
    KvCostValue { name: String, value: f64 },
    /// The cost's weights do not round-trip as a table (a bug, not a setting).
    #[error("kv_cost: the weights do not write as a table")]
    KvCostWrite(#[source] toml::ser::Error),
    #[error("kv_cost: the weights do not read back")]
    KvCostRead(#[source] toml::de::Error),
}

/// Every setting, each optional (absent: the next source, or the default).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub host: Option<String>,
    pub port: Option<u16>,
    /// Connections one client may hold on the listener.
    pub max_connections_per_client: Option<usize>,
    /// Request body bytes being received, all clients together.
    pub max_body_bytes_in_flight: Option<usize>,
    /// Request body bytes one client may be sending.
    pub max_body_bytes_per_client: Option<usize>,
    pub block_size: Option<u32>,
    pub policy: Option<PolicyKind>,
    pub temperature: Option<f64>,
    pub overlap_weight: Option<f64>,
    pub shards: Option<usize>,
    pub max_index_blocks: Option<usize>,
    pub max_dp_size: Option<u32>,
    /// Seconds a routed request's blocks are assumed cached on a worker without events.
    pub approx_ttl: Option<f64>,
    /// Seconds to wait for the workers before serving anyway.
    pub ready_timeout: Option<f64>,
    /// Largest ZMQ message an engine's socket may send the router.
    pub zmq_max_message_bytes: Option<usize>,
    pub router_url: Option<String>,
    pub simulated_workers: Option<usize>,
    pub num_blocks: Option<usize>,
    pub max_num_seqs: Option<usize>,
    pub max_batched_tokens: Option<usize>,
    pub speedup: Option<f64>,
    pub seed: Option<u64>,
    pub max_model_len: Option<u64>,
    pub model_path: Option<PathBuf>,
    pub allow_private_image_urls: Option<bool>,
    /// API keys of the OpenAI routes, one per line (and `KVROUTE_API_KEYS`).
    pub api_keys_file: Option<PathBuf>,
    /// The admin token of the router's API and `/metrics` (or `KVROUTE_ADMIN_TOKEN`).
    pub admin_token_file: Option<PathBuf>,
    /// The remote router's admin token (or `KVROUTE_ROUTER_TOKEN`).
    pub router_token_file: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Listen beyond loopback without credentials.
    pub insecure: Option<bool>,
    /// Send `x-kvroute-overlap-tokens` with answers.
    pub expose_overlap: Option<bool>,
    /// Seconds a worker has to start a streamed answer.
    pub first_byte_timeout: Option<f64>,
    /// Each API key its own cache namespace.
    pub cache_namespace_per_key: Option<bool>,
    /// Probe each joining worker's parity (default on).
    pub parity_probe: Option<bool>,
    /// NATS server(s) of the replicas (docs/replicas.md); absent: one router alone.
    pub nats_url: Option<String>,
    /// Names the fleet's subjects, stream and bucket.
    pub nats_prefix: Option<String>,
    /// This replica's name (default: host, pid and a nonce).
    pub nats_replica: Option<String>,
    /// Share routing decisions with the other replicas (default on with NATS).
    pub nats_sync: Option<bool>,
    /// zmq (default), stream or relay.
    pub nats_events: Option<String>,
    pub nats_snapshot_every: Option<u64>,
    pub nats_stream_max_bytes: Option<i64>,
    /// Seconds the event stream keeps a message.
    pub nats_stream_max_age: Option<f64>,
    /// The NATS token (first line; or `KVROUTE_NATS_TOKEN`).
    pub nats_token_file: Option<PathBuf>,
    pub nats_user: Option<String>,
    /// The NATS user's password (first line; or `KVROUTE_NATS_PASSWORD`).
    pub nats_password_file: Option<PathBuf>,
    pub nats_tls_ca: Option<PathBuf>,
    pub nats_tls_cert: Option<PathBuf>,
    pub nats_tls_key: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerSpec>,
    /// Weights of the `kv` cost by [`KvConfig`] field name; each one overrides its default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kv_cost: BTreeMap<String, f64>,
}

/// Environment variables holding secrets themselves (flags and files name files instead, so
/// no key shows in `ps` or `--print-config`).
pub const ENV_API_KEYS: &str = "KVROUTE_API_KEYS";
pub const ENV_ADMIN_TOKEN: &str = "KVROUTE_ADMIN_TOKEN";
pub const ENV_ROUTER_TOKEN: &str = "KVROUTE_ROUTER_TOKEN";
pub const ENV_NATS_TOKEN: &str = "KVROUTE_NATS_TOKEN";
pub const ENV_NATS_PASSWORD: &str = "KVROUTE_NATS_PASSWORD";

/// The keys each command reads (from a file; its flags are these by construction).
pub mod keys {
    const LISTEN: [&str; 9] = [
        "host",
        "port",
        "admin_token_file",
        "tls_cert",
        "tls_key",
        "insecure",
        "max_connections_per_client",
        "max_body_bytes_in_flight",
        "max_body_bytes_per_client",
    ];
    const FRONT_DOOR: [&str; 5] = [
        "api_keys_file",
        "expose_overlap",
        "first_byte_timeout",
        "cache_namespace_per_key",
        "parity_probe",
    ];
    const ROUTING: [&str; 12] = [
        "block_size",
        "policy",
        "temperature",
        "overlap_weight",
        "shards",
        "max_index_blocks",
        "max_dp_size",
        "approx_ttl",
        "ready_timeout",
        "zmq_max_message_bytes",
        "workers",
        "kv_cost",
    ];
    const NATS: [&str; 14] = [
        "nats_url",
        "nats_prefix",
        "nats_replica",
        "nats_sync",
        "nats_events",
        "nats_snapshot_every",
        "nats_stream_max_bytes",
        "nats_stream_max_age",
        "nats_token_file",
        "nats_user",
        "nats_password_file",
        "nats_tls_ca",
        "nats_tls_cert",
        "nats_tls_key",
    ];
    const ENGINE: [&str; 8] = [
        "num_blocks",
        "max_num_seqs",
        "max_batched_tokens",
        "speedup",
        "seed",
        "max_model_len",
        "model_path",
        "allow_private_image_urls",
    ];

    pub fn router() -> Vec<&'static str> {
        [&LISTEN[..], &ROUTING[..], &NATS[..]].concat()
    }

    pub fn serve() -> Vec<&'static str> {
        let simulated = ["simulated_workers"];
        [&LISTEN[..], &ROUTING[..], &NATS[..], &ENGINE[..], &FRONT_DOOR[..], &simulated[..]]
            .concat()
    }

    pub fn frontend() -> Vec<&'static str> {
        let image = ["model_path", "allow_private_image_urls", "router_url", "router_token_file"];
        [&LISTEN[..], &ROUTING[..], &NATS[..], &image[..], &FRONT_DOOR[..]].concat()
    }
}

impl Settings {
    /// Reads a TOML file, refusing keys that `command` (named in errors) does not use.
    pub fn from_file(path: &Path, allowed: &[&str], command: &str) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| SettingsError::Read { path: path.to_owned(), source })?;
        Self::from_toml(&text, path, allowed, command)
    }

    /// [`Settings::from_file`] of text read from `path`.
    pub fn from_toml(
        text: &str,
        path: &Path,
        allowed: &[&str],
        command: &str,
    ) -> Result<Self, SettingsError> {
        let parse = |source| SettingsError::Parse { path: path.to_owned(), source };
        let table: toml::Table = toml::from_str(text).map_err(parse)?;
        if let Some(key) = table.keys().find(|k| !allowed.contains(&k.as_str())) {
            let (path, key) = (path.to_owned(), key.clone());
            return Err(match Self::is_key(&key) {
                true => SettingsError::NotFor { path, key, command: command.to_owned() },
                false => SettingsError::Unknown { path, key },
            });
        }
        table.try_into().map_err(parse)
    }

    fn is_key(key: &str) -> bool {
        keys::serve().contains(&key) || keys::frontend().contains(&key)
    }

    /// `self` under `high`: each setting `high` has wins; workers add up (the same id twice
    /// must have the same keys).
    pub fn overlaid_by(self, high: Settings) -> Result<Settings, SettingsError> {
        let low = self;
        let mut by_id: BTreeMap<u64, WorkerSpec> = BTreeMap::new();
        let mut order = Vec::new();
        for w in low.workers.iter().chain(&high.workers) {
            match by_id.get(&w.id.0) {
                Some(seen) if seen == w => {}
                Some(_) => return Err(SettingsError::WorkerTwice(w.id)),
                None => {
                    by_id.insert(w.id.0, w.clone());
                    order.push(w.id.0);
                }
            }
        }
        let workers = order.iter().filter_map(|id| by_id.remove(id)).collect();
        // Every other setting: `high`'s where it has one. Read off the settings' own
        // serialized form (an absent setting is an absent key), so no list of them is kept.
        let table = |s: &Settings| toml::Table::try_from(s).map_err(SettingsError::Print);
        let mut merged = table(&low)?;
        merged.extend(table(&high)?);
        let mut out: Settings = merged.try_into().map_err(SettingsError::Merge)?;
        let mut kv_cost = low.kv_cost;
        kv_cost.extend(high.kv_cost);
        out.workers = workers;
        out.kv_cost = kv_cost;
        Ok(out)
    }

    /// Every setting at its default, taken from the libraries' own `Default`s: what applies
    /// where no flag, variable or file sets one (`port`: the command's). Settings without a
    /// default (no NATS server, no files, the model's own context length) stay absent.
    pub fn defaults(port: u16) -> Settings {
        let listener = ServeOptions::default();
        let router = RouterConfig::default();
        let scheduler = SchedulerConfig::default();
        let engine = EngineConfig::default();
        let front_door = FrontDoorOptions::default();
        let kv_cost = toml::Table::try_from(KvConfig::default())
            .map(|t| t.into_iter().filter_map(|(k, v)| Some((k, v.as_float()?))).collect())
            .unwrap_or_default();
        Settings {
            host: Some(DEFAULT_HOST.to_owned()),
            port: Some(port),
            max_connections_per_client: Some(listener.max_connections_per_client),
            max_body_bytes_in_flight: Some(listener.max_body_bytes_in_flight),
            max_body_bytes_per_client: Some(listener.max_body_bytes_per_client),
            block_size: Some(BlockSize::default().get()),
            policy: Some(scheduler.policy),
            temperature: Some(scheduler.temperature),
            overlap_weight: Some(scheduler.overlap_weight),
            shards: Some(router.shards),
            max_index_blocks: router.index.max_held_blocks,
            max_dp_size: Some(router.max_dp_size),
            approx_ttl: Some(router.approx.ttl.as_secs_f64()),
            ready_timeout: Some(DEFAULT_READY_TIMEOUT_SECS),
            zmq_max_message_bytes: Some(router.zmq_max_message_bytes),
            simulated_workers: Some(DEFAULT_SIMULATED_WORKERS),
            num_blocks: Some(engine.num_blocks),
            max_num_seqs: Some(engine.max_num_seqs),
            max_batched_tokens: Some(engine.max_batched_tokens),
            speedup: Some(engine.timing.speedup),
            seed: Some(Simulated::default().seed),
            allow_private_image_urls: Some(FetchConfig::default().allow_private),
            insecure: Some(false),
            expose_overlap: Some(front_door.expose_overlap),
            first_byte_timeout: Some(front_door.first_byte_timeout.as_secs_f64()),
            cache_namespace_per_key: Some(front_door.namespace_per_key),
            parity_probe: Some(front_door.parity_probe),
            nats_prefix: Some(kvroute_router::nats::DEFAULT_PREFIX.to_owned()),
            nats_sync: Some(true),
            nats_events: Some("zmq".to_owned()),
            nats_stream_max_bytes: Some(kvroute_router::nats::DEFAULT_STREAM_MAX_BYTES),
            nats_stream_max_age: Some(kvroute_router::nats::DEFAULT_STREAM_MAX_AGE.as_secs_f64()),
            kv_cost,
            ..Settings::default()
        }
    }

    /// The settings `--print-config` shows: these over every default, as a config file of
    /// `allowed`'s keys (what the command reads back).
    pub fn printed(&self, port: u16, allowed: &[&str]) -> String {
        let full = match Self::defaults(port).overlaid_by(self.clone()) {
            Ok(full) => full,
            Err(e) => return format!("# cannot print the settings: {e}\n"),
        };
        match toml::Table::try_from(&full) {
            Ok(mut table) => {
                table.retain(|k, _| allowed.contains(&k));
                toml::to_string(&table)
                    .unwrap_or_else(|e| format!("# cannot print the settings: {e}\n"))
            }
            Err(e) => format!("# cannot print the settings: {e}\n"),
        }
    }

    /// The settings as TOML (what `--print-config` shows).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the settings: {e}\n"))
    }

    /// `host:port`, with `default_port`.
    pub fn address(&self, default_port: u16) -> String {
        let host = self.host.as_deref().unwrap_or(DEFAULT_HOST);
        let port = self.port.unwrap_or(default_port);
        match host.contains(':') && !host.starts_with('[') {
            true => format!("[{host}]:{port}"),
            false => format!("{host}:{port}"),
        }
    }

    /// The credentials: keys from the files and from the environment (`KVROUTE_API_KEYS`,
    /// comma-separated; `KVROUTE_ADMIN_TOKEN`; `KVROUTE_ROUTER_TOKEN`).
    pub fn access(&self) -> Result<Access, StackError> {
        self.access_with_env(|name| std::env::var(name).ok())
    }

    fn access_with_env(&self, env: impl Fn(&str) -> Option<String>) -> Result<Access, StackError> {
        let keys = |file: &Option<PathBuf>, var: &str, split: bool| {
            let from_file = match file {
                Some(path) => Credentials::from_file(path)?,
                None => Credentials::default(),
            };
            let value = env(var).unwrap_or_default();
            let list: Vec<&str> = match split {
                true => value.split(',').collect(),
                false => vec![value.as_str()],
            };
            Ok::<_, kvroute_http::auth::CredentialsError>(
                from_file.and(&Credentials::new(list, var)?),
            )
        };
        let router_token = match (&self.router_token_file, env(ENV_ROUTER_TOKEN)) {
            (Some(path), _) => Some(first_line(path)?),
            (None, token) => token.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()),
        };
        Ok(Access {
            api_keys: keys(&self.api_keys_file, ENV_API_KEYS, true)?,
            admin: keys(&self.admin_token_file, ENV_ADMIN_TOKEN, false)?,
            router_token,
        })
    }

    /// Refuses to listen beyond loopback without the credentials the command's routes need
    /// (`api_keys`: it serves OpenAI routes), unless `insecure`.
    pub fn check_exposure(&self, access: &Access, api_keys: bool) -> Result<(), StackError> {
        let host = self.host.as_deref().unwrap_or(DEFAULT_HOST);
        if self.insecure == Some(true) || is_loopback(host) {
            return Ok(());
        }
        let mut missing = Vec::new();
        if api_keys && access.api_keys.is_empty() {
            missing.push("API keys (--api-keys-file or KVROUTE_API_KEYS)");
        }
        if access.admin.is_empty() {
            missing.push("an admin token (--admin-token-file or KVROUTE_ADMIN_TOKEN)");
        }
        match missing.is_empty() {
            true => Ok(()),
            false => {
                Err(Invalid::Exposed { host: host.to_owned(), missing: missing.join(" and ") }
                    .into())
            }
        }
    }

    /// The listener's options: TLS when a certificate and key are given.
    pub fn serve_options(&self) -> Result<ServeOptions, StackError> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(kvroute_http::server::tls_acceptor(cert, key)?),
            (None, None) => None,
            _ => return Err(Invalid::TlsPair.into()),
        };
        let d = ServeOptions::default();
        let in_flight = self.max_body_bytes_in_flight.unwrap_or(d.max_body_bytes_in_flight);
        let options = ServeOptions {
            tls,
            max_connections_per_client: self
                .max_connections_per_client
                .unwrap_or(d.max_connections_per_client),
            max_body_bytes_in_flight: in_flight,
            max_body_bytes_per_client: self.max_body_bytes_per_client.unwrap_or(in_flight / 4),
            ..d
        };
        if options.max_connections_per_client == 0 {
            return Err(Invalid::AtLeastOne("max_connections_per_client").into());
        }
        Ok(options)
    }

    pub fn ready_timeout(&self) -> Result<Duration, StackError> {
        secs(self.ready_timeout.unwrap_or(DEFAULT_READY_TIMEOUT_SECS), "ready_timeout")
    }

    pub fn block_size(&self) -> Result<BlockSize, StackError> {
        BlockSize::new(self.block_size.unwrap_or(BlockSize::default().get()))
            .map_err(|e| Invalid::BlockSize(e).into())
    }

    /// The router's configuration, with the settings' workers.
    pub fn router_config(&self) -> Result<RouterConfig, StackError> {
        let d = RouterConfig::default();
        let mut config = RouterConfig {
            block_size: self.block_size()?,
            workers: self.workers.clone(),
            shards: self.shards.unwrap_or(d.shards),
            index: IndexConfig {
                max_held_blocks: self.max_index_blocks.or(d.index.max_held_blocks),
            },
            max_dp_size: self.max_dp_size.unwrap_or(d.max_dp_size),
            zmq_max_message_bytes: self.zmq_max_message_bytes.unwrap_or(d.zmq_max_message_bytes),
            approx: ApproxConfig {
                ttl: match self.approx_ttl {
                    Some(t) => secs(t, "approx_ttl")?,
                    None => d.approx.ttl,
                },
                ..d.approx
            },
            ..d
        };
        let s = &mut config.scheduler;
        s.policy = self.policy.unwrap_or(s.policy);
        s.temperature = self.temperature.unwrap_or(s.temperature);
        s.overlap_weight = self.overlap_weight.unwrap_or(s.overlap_weight);
        s.kv = kv_config(&self.kv_cost)?;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return Err(Invalid::Temperature.into());
        }
        if config.shards == 0 {
            return Err(Invalid::AtLeastOne("shards").into());
        }
        config.nats = self.nats_config(|name| std::env::var(name).ok())?;
        config.validate()?;
        Ok(config)
    }

    /// The replicas' NATS settings (`None` without `nats_url`); secrets from their files or
    /// the environment.
    fn nats_config(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<NatsConfig>, StackError> {
        let Some(url) = &self.nats_url else {
            if self.nats_events.as_deref().is_some_and(|e| e != "zmq") {
                return Err(Invalid::NatsEventsWithoutUrl.into());
            }
            return Ok(None);
        };
        let mut n = NatsConfig::new(url.clone());
        if let Some(prefix) = &self.nats_prefix {
            n.prefix.clone_from(prefix);
        }
        if let Some(replica) = &self.nats_replica {
            n.replica.clone_from(replica);
        }
        n.sync = self.nats_sync.unwrap_or(true);
        if let Some(events) = &self.nats_events {
            n.events = events.parse()?;
        }
        let default_every = match n.events {
            EventsVia::Relay => DEFAULT_SNAPSHOT_EVERY,
            _ => 0,
        };
        n.snapshot_every = self.nats_snapshot_every.unwrap_or(default_every);
        if let Some(bytes) = self.nats_stream_max_bytes {
            n.stream_max_bytes = bytes;
        }
        if let Some(age) = self.nats_stream_max_age {
            n.stream_max_age = secs(age, "nats_stream_max_age")?;
        }
        let secret = |file: &Option<PathBuf>, var: &str| match (file, env(var)) {
            (Some(path), _) => first_line(path).map(Some),
            (None, value) => Ok(value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())),
        };
        n.auth.token = secret(&self.nats_token_file, ENV_NATS_TOKEN)?;
        n.auth.password = secret(&self.nats_password_file, ENV_NATS_PASSWORD)?;
        n.auth.user.clone_from(&self.nats_user);
        n.tls_ca.clone_from(&self.nats_tls_ca);
        n.tls_cert.clone_from(&self.nats_tls_cert);
        n.tls_key.clone_from(&self.nats_tls_key);
        Ok(Some(n))
    }

    /// A simulated engine's settings (docs/running.md; defaults as Dynamo's mocker).
    pub fn engine_config(&self) -> Result<EngineConfig, StackError> {
        let d = EngineConfig::default();
        let engine = EngineConfig {
            num_blocks: self.num_blocks.unwrap_or(d.num_blocks),
            block_size: self.block_size()?,
            max_num_seqs: self.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_batched_tokens: self.max_batched_tokens.unwrap_or(d.max_batched_tokens),
            timing: Timing { speedup: self.speedup.unwrap_or(d.timing.speedup) },
        };
        let speedup = engine.timing.speedup;
        if !(speedup.is_finite() && speedup > 0.0) {
            return Err(Invalid::Speedup.into());
        }
        if engine.num_blocks == 0 || engine.max_num_seqs == 0 || engine.max_batched_tokens == 0 {
            return Err(Invalid::EngineZero.into());
        }
        Ok(engine)
    }

    /// The front door's own settings, each over its default.
    pub fn front_door(&self) -> Result<FrontDoorOptions, StackError> {
        let d = FrontDoorOptions::default();
        Ok(FrontDoorOptions {
            expose_overlap: self.expose_overlap.unwrap_or(d.expose_overlap),
            first_byte_timeout: match self.first_byte_timeout {
                Some(t) => secs(t, "first_byte_timeout")?,
                None => d.first_byte_timeout,
            },
            namespace_per_key: self.cache_namespace_per_key.unwrap_or(d.namespace_per_key),
            parity_probe: self.parity_probe.unwrap_or(d.parity_probe),
        })
    }

    pub fn fetch_config(&self) -> FetchConfig {
        FetchConfig {
            allow_private: self.allow_private_image_urls.unwrap_or(false),
            ..FetchConfig::default()
        }
    }

    /// A stack of `simulated` simulated workers (with the engine settings) and the settings'
    /// external workers, the router (embedded unless `router_url`) and, if asked, a front door.
    pub fn stack_config(
        &self,
        simulated: usize,
        frontend: bool,
    ) -> Result<StackConfig, StackError> {
        let engine = match simulated {
            0 => EngineConfig::default(),
            _ => self.engine_config()?,
        };
        Ok(StackConfig {
            simulated: Simulated {
                count: simulated,
                engine,
                events: true,
                seed: self.seed.unwrap_or(Simulated::default().seed),
                max_model_len: self.max_model_len,
            },
            router: self.router_config()?,
            router_url: self.router_url.clone(),
            frontend,
            model_path: self.model_path.clone(),
            fetch: self.fetch_config(),
            access: self.access()?,
            front_door: self.front_door()?,
        })
    }
}

fn first_line(path: &Path) -> Result<String, StackError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| Invalid::ReadSecret { path: path.to_owned(), source })?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .ok_or_else(|| Invalid::NoToken(path.to_owned()).into())
}

/// Whether `host` names only this machine.
pub fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn secs(value: f64, name: &str) -> Result<Duration, StackError> {
    Duration::try_from_secs_f64(value).map_err(|_| Invalid::Seconds(name.to_owned()).into())
}

/// The `kv` cost's weights: the defaults, each named one overridden. Names are
/// [`KvConfig`]'s fields (an unknown one is an error); values are finite and non-negative.
fn kv_config(overrides: &BTreeMap<String, f64>) -> Result<KvConfig, StackError> {
    let mut fields = toml::Table::try_from(KvConfig::default()).map_err(Invalid::KvCostWrite)?;
    for (name, &value) in overrides {
        if !fields.contains_key(name) {
            let known: Vec<&str> = fields.keys().map(String::as_str).collect();
            let known = known.join(", ");
            return Err(Invalid::KvCostName { name: name.clone(), known }.into());
        }
        if !(value.is_finite() && value >= 0.0) {
            return Err(Invalid::KvCostValue { name: name.clone(), value }.into());
        }
        fields.insert(name.clone(), value.into());
    }
    fields.try_into().map_err(|e| Invalid::KvCostRead(e).into())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn file(text: &str) -> Settings {
        Settings::from_toml(text, Path::new("f.toml"), &keys::serve(), "serve").unwrap()
    }

    fn router_file(text: &str) -> String {
        let err = Settings::from_toml(text, Path::new("f.toml"), &keys::router(), "router");
        DisplayChain(&err.unwrap_err()).to_string()
    }

    /// An error and its sources.
    struct DisplayChain<'a>(&'a dyn std::error::Error);

    impl std::fmt::Display for DisplayChain<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{}", self.0)?;
            let mut next = self.0.source();
            while let Some(e) = next {
                write!(f, ": {e}")?;
                next = e.source();
            }
            Ok(())
        }
    }

    #[test]
    fn a_flag_wins_over_the_file_and_the_file_over_the_default() {
        let from_file = file("block_size = 32\npolicy = \"dynamo\"\nshards = 2\n");
        let flags = Settings { policy: Some(PolicyKind::RoundRobin), ..Settings::default() };
        let merged = from_file.overlaid_by(flags).unwrap();
        let router = merged.router_config().unwrap();
        assert_eq!(router.scheduler.policy, PolicyKind::RoundRobin, "flag over file");
        assert_eq!((router.block_size.get(), router.shards), (32, 2), "file over default");
        assert_eq!(
            router.index.max_held_blocks,
            RouterConfig::default().index.max_held_blocks,
            "default"
        );
        assert_eq!(merged.engine_config().unwrap().block_size.get(), 32, "one block size for all");
    }

    #[test]
    fn keys_a_command_does_not_use_are_errors() {
        let err = router_file("num_blocks = 10\n");
        assert!(err.contains("`num_blocks` does not apply to `kvroute router`"), "{err}");
        let err = router_file("blocksize = 10\n");
        assert!(err.contains("unknown key `blocksize`"), "{err}");
        let err = router_file("block_size = \"x\"\n");
        assert!(err.starts_with("f.toml: ") && err.contains("block_size"), "{err}");
    }

    #[test]
    fn workers_add_up_and_the_same_id_must_agree() {
        let from_file = file(
            "[[workers]]\nid = 1\nurl = \"http://127.0.0.1:9001\"\nformat = \"sglang\"\n[[workers]]\nid = 2\n",
        );
        let same: WorkerSpec = "id=1,url=http://127.0.0.1:9001,format=sglang".parse().unwrap();
        let new: WorkerSpec = "id=3".parse().unwrap();
        let flags = Settings { workers: vec![same, new], ..Settings::default() };
        let merged = from_file.clone().overlaid_by(flags).unwrap();
        let ids: Vec<u64> = merged.workers.iter().map(|w| w.id.0).collect();
        assert_eq!(ids, [1, 2, 3]);
        let other: WorkerSpec = "id=2,url=http://127.0.0.1:9002".parse().unwrap();
        let err = from_file
            .overlaid_by(Settings { workers: vec![other], ..Settings::default() })
            .unwrap_err()
            .to_string();
        assert!(err.contains("worker 2 is given twice"), "{err}");
    }

    #[test]
    fn kv_cost_weights_come_by_name_from_the_file_and_the_flags() {
        let from_file = file("[kv_cost]\nqueue_weight = 0.25\neviction_weight = 2.0\n");
        let flags = Settings {
            kv_cost: [("eviction_weight".to_owned(), 0.5)].into(),
            ..Settings::default()
        };
        let merged = from_file.overlaid_by(flags).unwrap();
        let kv = merged.router_config().unwrap().scheduler.kv;
        let default = KvConfig::default();
        assert_eq!(
            (kv.queue_weight, kv.eviction_weight),
            (0.25, 0.5),
            "file, then the flag over it"
        );
        assert_eq!(
            kv.decode_full_cache_tokens, default.decode_full_cache_tokens,
            "the rest default"
        );
        assert_eq!(file(&merged.to_toml()), merged, "printed back as a [kv_cost] table");
        let named = |name: &str, value: f64| Settings {
            kv_cost: [(name.to_owned(), value)].into(),
            ..Settings::default()
        };
        let err = named("queue_wieght", 1.0).router_config().unwrap_err().to_string();
        assert!(err.contains("unknown kv_cost weight `queue_wieght`"), "{err}");
        assert!(err.contains("queue_weight"), "the known names are listed: {err}");
        let err = named("queue_weight", -1.0).router_config().unwrap_err().to_string();
        assert!(err.contains("must be >= 0"), "{err}");
        assert!(named("queue_weight", f64::NAN).router_config().is_err());
    }

    #[test]
    fn settings_print_as_a_file_that_reads_back() {
        let s = Settings {
            port: Some(9000),
            speedup: Some(2.5),
            workers: vec!["id=4,events=tcp://127.0.0.1:5557".parse().unwrap()],
            ..Settings::default()
        };
        assert_eq!(file(&s.to_toml()), s);
        assert_eq!(s.address(8000), "127.0.0.1:9000");
        let v6 = Settings { host: Some("::1".into()), ..Settings::default() };
        assert_eq!(v6.address(8000), "[::1]:8000");
        let bad = Settings { speedup: Some(0.0), ..Settings::default() };
        assert!(bad.engine_config().is_err());
    }

    #[test]
    fn keys_come_from_files_and_the_environment_and_exposure_needs_them() {
        let dir = std::env::temp_dir().join(format!("kvroute-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keys_file = dir.join("keys");
        std::fs::write(&keys_file, "# clients\nsk-from-file-1\n\nsk-from-file-2\n").unwrap();
        let token_file = dir.join("token");
        std::fs::write(&token_file, "router-token-1\n").unwrap();
        let s = Settings {
            api_keys_file: Some(keys_file),
            router_token_file: Some(token_file),
            host: Some("0.0.0.0".into()),
            ..Settings::default()
        };
        let env = |name: &str| match name {
            ENV_API_KEYS => Some("sk-from-env-1, sk-from-env-2".to_owned()),
            _ => None,
        };
        let access = s.access_with_env(env).unwrap();
        assert_eq!(access.api_keys.len(), 4);
        assert!(
            access.api_keys.accepts("sk-from-env-2") && access.api_keys.accepts("sk-from-file-1")
        );
        assert_eq!(access.router_token.as_deref(), Some("router-token-1"));
        let err = s.check_exposure(&access, true).unwrap_err().to_string();
        assert!(err.contains("without an admin token") && !err.contains("API keys"), "{err}");
        let admin = |_: &str| Some("admin-token-1".to_owned());
        let full = s.access_with_env(admin).unwrap();
        assert!(s.check_exposure(&full, true).is_ok());
        let open = Settings { host: Some("0.0.0.0".into()), ..Settings::default() };
        let err = open.check_exposure(&Access::default(), true).unwrap_err().to_string();
        assert!(err.contains("API keys") && err.contains("admin token"), "{err}");
        assert!(open.check_exposure(&Access::default(), true).is_err());
        let insecure = Settings { insecure: Some(true), ..open.clone() };
        assert!(insecure.check_exposure(&Access::default(), true).is_ok());
        for host in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["0.0.0.0", "::", "10.0.0.1", "example.invalid"] {
            assert!(!is_loopback(host), "{host}");
        }
        let bad = |_: &str| Some("short".to_owned());
        assert!(open.access_with_env(bad).is_err(), "a short key is refused");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

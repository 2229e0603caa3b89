//! From settings to the libraries' configurations, and back: each setting's default is the
//! library's own `Default` ([`Settings::defaults`]), and each configuration is built from the
//! settings over those defaults, its values checked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_core::BlockSize;
use kvroute_core::index::{ApproxConfig, IndexConfig};
use kvroute_core::schedule::cost::KvConfig;
use kvroute_core::schedule::flow::FlowConfig;
use kvroute_core::schedule::{PairConfig, SchedulerConfig, SessionConfig};
use kvroute_frontend::FrontDoorOptions;
use kvroute_http::{Credentials, ServeOptions};
use kvroute_mocker::lora::LoraConfig;
use kvroute_mocker::{DisaggConfig, EngineConfig, HostConfig, Timing};
use kvroute_preprocess::fetch::FetchConfig;
use kvroute_router::RouterConfig;
use kvroute_router::nats::{DEFAULT_SNAPSHOT_EVERY, EventsVia, NatsConfig};

use super::groups::Routing;
use super::{
    DEFAULT_HOST, DEFAULT_READY_TIMEOUT_SECS, DEFAULT_SIMULATED_WORKERS, ENV_ADMIN_TOKEN,
    ENV_API_KEYS, ENV_MEMBERS_KEY, ENV_NATS_PASSWORD, ENV_NATS_TOKEN, ENV_ROUTER_TOKEN,
    ENV_TENANT_SALT, Invalid, Settings,
};
use crate::{Access, SharedStore, Simulated, StackConfig, StackError};

impl Settings {
    /// `--model-priority`: each model's priority.
    pub fn model_priorities(&self) -> Result<BTreeMap<String, i32>, StackError> {
        use kvroute_core::schedule::flow::{MAX_PRIORITY, MIN_PRIORITY};
        let mut out = BTreeMap::new();
        for entry in &self.front_door.model_priorities {
            let bad = || Invalid::ModelPriority(entry.clone());
            let (name, priority) = entry.split_once('=').ok_or_else(bad)?;
            let priority: i32 = priority.trim().parse().map_err(|_| bad())?;
            if name.trim().is_empty() || !(MIN_PRIORITY..=MAX_PRIORITY).contains(&priority) {
                return Err(bad().into());
            }
            out.insert(name.trim().to_owned(), priority);
        }
        Ok(out)
    }

    /// Each setting's default as `--help` says it: the value `--print-config` shows, or in
    /// words where it depends on something else. Switches and tables are left out.
    pub(super) fn shown_defaults(&self) -> BTreeMap<String, String> {
        let mut shown: BTreeMap<String, String> = toml::Table::try_from(self)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(key, value)| {
                let text = match value {
                    toml::Value::String(s) => s,
                    toml::Value::Integer(i) => i.to_string(),
                    toml::Value::Float(f) => f.to_string(),
                    _ => return None,
                };
                Some((key, text))
            })
            .collect();
        let words = [
            ("max_body_bytes_per_client", "a quarter of --max-body-bytes-in-flight".to_owned()),
            ("nats_replica", "host, pid and a nonce".to_owned()),
            (
                "nats_snapshot_every",
                format!("{DEFAULT_SNAPSHOT_EVERY} with --nats-events relay, else 0"),
            ),
            ("model_path", format!("the built-in {}", kvroute_preprocess::BUILTIN_MODEL)),
            (
                "max_model_len",
                format!(
                    "the model's context length, else {}",
                    kvroute_http::openai::DEFAULT_MAX_MODEL_LEN
                ),
            ),
        ];
        shown.extend(words.map(|(key, text)| (key.to_owned(), text)));
        shown
    }

    /// `host:port`, with `default_port`.
    pub fn address(&self, default_port: u16) -> String {
        self.address_on(self.listen.port.unwrap_or(default_port))
    }

    /// `--host` with `port` (another listener's: the picker's, its health's), whatever
    /// `--port` says.
    pub fn address_on(&self, port: u16) -> String {
        let host = self.listen.host.as_deref().unwrap_or(DEFAULT_HOST);
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

    pub(super) fn access_with_env(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Access, StackError> {
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
        let router_token = match (&self.remote.router_token_file, env(ENV_ROUTER_TOKEN)) {
            (Some(path), _) => Some(first_line(path)?),
            (None, token) => token.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()),
        };
        let mut api_keys = keys(&self.front_door.api_keys_file, ENV_API_KEYS, true)?;
        let salt = match (&self.security.tenant_salt_file, env(ENV_TENANT_SALT)) {
            (Some(path), _) => Some(first_line(path)?),
            (None, salt) => salt.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()),
        };
        if let Some(salt) = salt {
            api_keys = api_keys.with_salt(salt.as_bytes());
        }
        Ok(Access {
            api_keys,
            admin: keys(&self.security.admin_token_file, ENV_ADMIN_TOKEN, false)?,
            router_token,
        })
    }

    /// Refuses to listen beyond loopback without the credentials the command's routes need
    /// (`api_keys`: it serves OpenAI routes), unless `insecure`.
    pub fn check_exposure(&self, access: &Access, api_keys: bool) -> Result<(), StackError> {
        let host = self.listen.host.as_deref().unwrap_or(DEFAULT_HOST);
        if self.security.insecure == Some(true) || is_loopback(host) {
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
        let tls = match (&self.security.tls_cert, &self.security.tls_key) {
            (Some(cert), Some(key)) => Some(kvroute_http::server::tls_acceptor(cert, key)?),
            (None, None) => None,
            _ => return Err(Invalid::TlsPair.into()),
        };
        let (l, d) = (&self.listen, ServeOptions::default());
        let in_flight = l.max_body_bytes_in_flight.unwrap_or(d.max_body_bytes_in_flight);
        let options = ServeOptions {
            tls,
            max_connections_per_client: l
                .max_connections_per_client
                .unwrap_or(d.max_connections_per_client),
            max_body_bytes_in_flight: in_flight,
            max_body_bytes_per_client: l.max_body_bytes_per_client.unwrap_or(in_flight / 4),
            ..d
        };
        if options.max_connections_per_client == 0 {
            return Err(Invalid::AtLeastOne("max_connections_per_client").into());
        }
        Ok(options)
    }

    pub fn ready_timeout(&self) -> Result<Duration, StackError> {
        let timeout = self.routing.ready_timeout.unwrap_or(DEFAULT_READY_TIMEOUT_SECS);
        secs(timeout, "ready_timeout")
    }

    pub fn block_size(&self) -> Result<BlockSize, StackError> {
        BlockSize::new(self.blocks.block_size.unwrap_or(BlockSize::default().get()))
            .map_err(|e| Invalid::BlockSize(e).into())
    }

    /// How many simulated workers `serve` starts.
    pub fn simulated_workers(&self) -> usize {
        self.simulated.simulated_workers.unwrap_or(DEFAULT_SIMULATED_WORKERS)
    }

    /// The decision log the settings ask for, its file opened once to check it can be
    /// written.
    pub fn decision_log(
        &self,
    ) -> Result<Option<kvroute_router::config::DecisionLogConfig>, StackError> {
        let t = &self.tracing;
        let Some(path) = &t.decision_log else { return Ok(None) };
        let ratio = t.decision_log_ratio.unwrap_or(super::DEFAULT_DECISION_LOG_RATIO);
        if !(0.0..=1.0).contains(&ratio) {
            return Err(Invalid::Fraction("decision_log_ratio").into());
        }
        let opened = std::fs::OpenOptions::new().create(true).append(true).open(path);
        opened.map_err(|source| super::SettingsError::Read { path: path.clone(), source })?;
        use kvroute_router::config::{DEFAULT_DECISION_LOG_FILES, DEFAULT_DECISION_LOG_MAX_BYTES};
        Ok(Some(kvroute_router::config::DecisionLogConfig {
            path: path.clone(),
            ratio,
            max_bytes: t.decision_log_max_bytes.unwrap_or(DEFAULT_DECISION_LOG_MAX_BYTES).max(1),
            files: t.decision_log_files.unwrap_or(DEFAULT_DECISION_LOG_FILES).max(1),
        }))
    }

    /// The router's configuration, with the settings' workers.
    pub fn router_config(&self) -> Result<RouterConfig, StackError> {
        let (r, d) = (&self.routing, RouterConfig::default());
        let mut config = RouterConfig {
            block_size: self.block_size()?,
            workers: r.workers.clone(),
            shards: r.shards.unwrap_or(d.shards),
            index: IndexConfig { max_held_blocks: r.max_index_blocks.or(d.index.max_held_blocks) },
            max_dp_size: r.max_dp_size.unwrap_or(d.max_dp_size),
            zmq_max_message_bytes: r.zmq_max_message_bytes.unwrap_or(d.zmq_max_message_bytes),
            decision_log: self.decision_log()?,
            max_workers: self.membership.max_workers.unwrap_or(d.max_workers).max(1),
            state_dir: r.state_dir.clone(),
            approx: ApproxConfig {
                ttl: match r.approx_ttl {
                    Some(t) => secs(t, "approx_ttl")?,
                    None => d.approx.ttl,
                },
                ..d.approx
            },
            ..d
        };
        let s = &mut config.scheduler;
        s.policy = r.policy.unwrap_or(s.policy);
        s.temperature = r.temperature.unwrap_or(s.temperature);
        s.overlap_weight = r.overlap_weight.unwrap_or(s.overlap_weight);
        s.kv = kv_config(&r.kv_cost)?;
        s.pairs = pd_config(&r.pd_cost)?;
        self.priced_by_engines(s);
        s.predictor.shape.enabled = r.learn_shape.unwrap_or(s.predictor.shape.enabled);
        let sd = s.sessions;
        s.sessions = SessionConfig {
            ttl: match r.session_ttl {
                Some(t) => secs(t, "session_ttl")?,
                None => sd.ttl,
            },
            margin_s: match r.session_margin {
                Some(m) if m.is_finite() && m >= 0.0 => m,
                Some(_) => return Err(Invalid::Negative("session_margin").into()),
                None => sd.margin_s,
            },
            capacity: r.max_sessions.unwrap_or(sd.capacity),
        };
        flow_settings(r, &mut s.flow)?;
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
        let s = &self.nats;
        let Some(url) = &s.nats_url else {
            if s.nats_events.as_deref().is_some_and(|e| e != "zmq") {
                return Err(Invalid::NatsEventsWithoutUrl.into());
            }
            return Ok(None);
        };
        let mut n = NatsConfig::new(url.clone());
        if let Some(prefix) = &s.nats_prefix {
            n.prefix.clone_from(prefix);
        }
        if let Some(replica) = &s.nats_replica {
            n.replica.clone_from(replica);
        }
        n.sync = s.nats_sync.unwrap_or(true);
        if let Some(events) = &s.nats_events {
            n.events = events.parse()?;
        }
        let default_every = match n.events {
            EventsVia::Relay => DEFAULT_SNAPSHOT_EVERY,
            _ => 0,
        };
        n.snapshot_every = s.nats_snapshot_every.unwrap_or(default_every);
        if let Some(bytes) = s.nats_stream_max_bytes {
            n.stream_max_bytes = bytes;
        }
        if let Some(age) = s.nats_stream_max_age {
            n.stream_max_age = secs(age, "nats_stream_max_age")?;
        }
        let secret = |file: &Option<PathBuf>, var: &str| match (file, env(var)) {
            (Some(path), _) => first_line(path).map(Some),
            (None, value) => Ok(value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())),
        };
        n.auth.token = secret(&s.nats_token_file, ENV_NATS_TOKEN)?;
        n.auth.password = secret(&s.nats_password_file, ENV_NATS_PASSWORD)?;
        n.auth.user.clone_from(&s.nats_user);
        n.tls_ca.clone_from(&s.nats_tls_ca);
        n.tls_cert.clone_from(&s.nats_tls_cert);
        n.tls_key.clone_from(&s.nats_tls_key);
        Ok(Some(n))
    }

    /// A simulated engine's settings (docs/mocker.md; defaults as Dynamo's mocker).
    pub fn engine_config(&self) -> Result<EngineConfig, StackError> {
        let (e, d) = (&self.engine, EngineConfig::default());
        let engine = EngineConfig {
            num_blocks: e.num_blocks.unwrap_or(d.num_blocks),
            block_size: self.block_size()?,
            max_num_seqs: e.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_batched_tokens: e.max_batched_tokens.unwrap_or(d.max_batched_tokens),
            timing: Timing { speedup: e.speedup.unwrap_or(d.timing.speedup) },
            lora: self.lora_config()?,
            host: self.host_config()?,
            disagg: self.disagg_config()?,
            sliding_window: self.sliding_window()?,
            scheduling: e.scheduling_policy.unwrap_or(d.scheduling),
        };
        if engine.sliding_window.is_some() && engine.host.num_blocks > 0 {
            return Err(Invalid::HybridWith("host memory (--num-host-blocks)").into());
        }
        let speedup = engine.timing.speedup;
        if !(speedup.is_finite() && speedup > 0.0) {
            return Err(Invalid::Speedup.into());
        }
        if engine.num_blocks == 0 || engine.max_num_seqs == 0 || engine.max_batched_tokens == 0 {
            return Err(Invalid::EngineZero.into());
        }
        Ok(engine)
    }

    /// The store simulated engines share: at `--store-url`, or one of `--num-store-blocks`
    /// started for them; none without simulated engines.
    pub fn shared_store(&self, engines: bool) -> Result<Option<SharedStore>, StackError> {
        let e = &self.engine;
        let store = match (&e.store_url, e.num_store_blocks.unwrap_or(0)) {
            _ if !engines => return Ok(None),
            (Some(_), blocks) if blocks > 0 => return Err(Invalid::StoreTwice.into()),
            (Some(url), _) => SharedStore::At(url.clone()),
            (None, 0) => return Ok(None),
            (None, blocks) => SharedStore::Start(blocks),
        };
        if self.sliding_window()?.is_some() {
            return Err(Invalid::HybridWith("a shared store").into());
        }
        Ok(Some(store))
    }

    /// The sliding window of the model's hybrid cache, from its `config.json`.
    fn sliding_window(&self) -> Result<Option<u32>, StackError> {
        let Some(dir) = &self.model.model_path else { return Ok(None) };
        Ok(kvroute_mocker::window::from_model_dir(dir).map_err(Invalid::ModelConfig)?)
    }

    /// A simulated engine's host memory, each setting over its default.
    fn host_config(&self) -> Result<HostConfig, StackError> {
        let (e, d) = (&self.engine, HostConfig::default());
        let host = HostConfig {
            num_blocks: e.num_host_blocks.unwrap_or(d.num_blocks),
            h2d_gbps: e.host_offload_h2d_bandwidth_gbps.unwrap_or(d.h2d_gbps),
            d2h_gbps: e.host_offload_d2h_bandwidth_gbps.unwrap_or(d.d2h_gbps),
            kv_bytes_per_token: e.kv_bytes_per_token.unwrap_or(d.kv_bytes_per_token),
            storage_blocks: e.num_storage_blocks.unwrap_or(d.storage_blocks),
            storage_gbps: e.storage_bandwidth_gbps.unwrap_or(d.storage_gbps),
            store_gbps: e.store_bandwidth_gbps.unwrap_or(d.store_gbps),
            loads: e.tier_loads.unwrap_or(d.loads),
        };
        let rates = [
            host.h2d_gbps,
            host.d2h_gbps,
            host.kv_bytes_per_token,
            host.storage_gbps,
            host.store_gbps,
        ];
        if !rates.iter().all(|r| r.is_finite() && *r >= 0.0) {
            return Err(Invalid::HostTier.into());
        }
        if host.storage_blocks > 0 && host.num_blocks == 0 {
            return Err(Invalid::StorageWithoutHost.into());
        }
        Ok(host)
    }

    /// A simulated engine's link to its peers in a disaggregated fleet (its role is set
    /// where the engine is started: `kvroute mocker --role`, `serve --prefill-workers`).
    fn disagg_config(&self) -> Result<DisaggConfig, StackError> {
        let (e, d) = (&self.engine, DisaggConfig::default());
        let bandwidth = e.kv_transfer_bandwidth.unwrap_or(d.kv_transfer_bandwidth_gbps);
        if !(bandwidth.is_finite() && bandwidth >= 0.0) {
            return Err(Invalid::Negative("kv_transfer_bandwidth").into());
        }
        let across = e.kv_transfer_bandwidth_across_nodes;
        if across.is_some_and(|b| !(b.is_finite() && b >= 0.0)) {
            return Err(Invalid::Negative("kv_transfer_bandwidth_across_nodes").into());
        }
        let hold_timeout = match e.kv_hold_timeout {
            Some(t) => secs(t, "kv_hold_timeout")?,
            None => d.hold_timeout,
        };
        Ok(DisaggConfig {
            role: d.role,
            kv_transfer_bandwidth_gbps: bandwidth,
            kv_transfer_bandwidth_across_nodes_gbps: across,
            node: kvroute_core::schedule::pairs::node_id(e.node.as_deref()),
            timing: e.kv_transfer_timing.unwrap_or(d.timing),
            hold_timeout,
            load_failure: e.kv_load_failure_policy.unwrap_or(d.load_failure),
        })
    }

    /// A simulated engine's adapter settings, each over its default.
    fn lora_config(&self) -> Result<LoraConfig, StackError> {
        let (e, d) = (&self.engine, LoraConfig::default());
        let ms = |v: Option<f64>, default: Duration| match v {
            Some(ms) if ms.is_finite() && ms >= 0.0 => Ok(Duration::from_secs_f64(ms / 1e3)),
            Some(_) => Err(StackError::from(Invalid::LoraTime)),
            None => Ok(default),
        };
        let max_loras = e.max_loras.unwrap_or(d.max_loras);
        if max_loras == 0 {
            return Err(Invalid::EngineZero.into());
        }
        Ok(LoraConfig {
            max_loras,
            max_cpu_loras: e.max_cpu_loras.unwrap_or(max_loras.max(d.max_cpu_loras)).max(max_loras),
            load: ms(e.lora_load_ms, d.load)?,
            swap: ms(e.lora_swap_ms, d.swap)?,
            step_cost: ms(e.lora_step_ms, d.step_cost)?,
        })
    }

    /// The adapters a simulated engine serves from the start (`--lora-modules NAME[=PATH]`).
    pub fn lora_modules(&self) -> Vec<(String, Option<String>)> {
        self.engine
            .lora_modules
            .iter()
            .map(|m| match m.split_once('=') {
                Some((name, path)) => (name.trim().to_owned(), Some(path.trim().to_owned())),
                None => (m.trim().to_owned(), None),
            })
            .collect()
    }

    /// The front door's own settings, each over its default.
    pub fn front_door(&self) -> Result<FrontDoorOptions, StackError> {
        let (f, d) = (&self.front_door, FrontDoorOptions::default());
        Ok(FrontDoorOptions {
            expose_overlap: f.expose_overlap.unwrap_or(d.expose_overlap),
            explain_decisions: f.explain_decisions.unwrap_or(d.explain_decisions),
            first_byte_timeout: match f.first_byte_timeout {
                Some(t) => secs(t, "first_byte_timeout")?,
                None => d.first_byte_timeout,
            },
            max_migrations: f.max_migrations.unwrap_or(d.max_migrations),
            inter_token_timeout: match f.inter_token_timeout {
                Some(t) => secs(t, "inter_token_timeout")?,
                None => d.inter_token_timeout,
            },
            namespace_per_key: f.cache_namespace_per_key.unwrap_or(d.namespace_per_key),
            parity_probe: f.parity_probe.unwrap_or(d.parity_probe),
            load_adapters: f.load_adapters.unwrap_or(d.load_adapters),
            trust_transfer_fields: f.trust_transfer_fields.unwrap_or(d.trust_transfer_fields),
            engine_priority: f.engine_priority.unwrap_or(
                self.engine.scheduling_policy == Some(kvroute_mocker::SchedulingPolicy::Priority),
            ),
            status_every: match f.status_sample_ms {
                Some(0) => return Err(Invalid::AtLeastOne("status_sample_ms").into()),
                Some(ms) => Duration::from_millis(ms),
                None => d.status_every,
            },
        })
    }

    pub fn fetch_config(&self) -> FetchConfig {
        let d = FetchConfig::default();
        FetchConfig {
            allow_private: self.model.allow_private_image_urls.unwrap_or(d.allow_private),
            ..d
        }
    }

    /// The simulated engines' own chat template (`--chat-template`), read.
    pub fn chat_template(&self) -> Result<Option<String>, StackError> {
        let Some(path) = &self.engine.chat_template else { return Ok(None) };
        std::fs::read_to_string(path)
            .map(Some)
            .map_err(|source| Invalid::ReadChatTemplate { path: path.clone(), source }.into())
    }

    /// Where members come from while kvroute runs (--discover-dns, --members-bucket).
    pub fn discovery(&self) -> Result<crate::Discovery, StackError> {
        use kvroute_router::members::{BucketConfig, DnsConfig, Template};
        let m = &self.membership;
        let d = super::groups::Membership::defaults();
        let secs = |v: Option<u64>, d: Option<u64>| Duration::from_secs(v.or(d).unwrap_or(0));
        let mut discovery = crate::Discovery {
            drain_timeout: secs(m.drain_timeout_secs, d.drain_timeout_secs),
            ..crate::Discovery::default()
        };
        let template = || -> Result<Template, Invalid> {
            let template = m.worker_template.as_deref().ok_or(Invalid::NoTemplate)?;
            template.parse().map_err(|e: kvroute_router::members::TemplateError| {
                Invalid::Template(e.to_string())
            })
        };
        if let Some(pool) = &m.kube_pool {
            discovery.kube = Some(kvroute_kube::KubeConfig {
                pool: pool.clone(),
                namespace: m
                    .kube_namespace
                    .clone()
                    .unwrap_or_else(kvroute_kube::KubeSource::own_namespace),
                template: template()?,
                own_pod: std::env::var("POD_NAME").or_else(|_| std::env::var("HOSTNAME")).ok(),
            });
        }
        if let Some(name) = &m.discover_dns {
            let template = template()?;
            let server = match &m.dns_server {
                Some(s) => Some(s.parse().map_err(|_| Invalid::DnsServer(s.clone()))?),
                None => None,
            };
            let every = m.discover_every_ms.or(d.discover_every_ms).unwrap_or(5000).max(100);
            let every = Duration::from_millis(every);
            discovery.dns = Some(DnsConfig { name: name.clone(), server, every, template });
        }
        if let Some(bucket) = &m.members_bucket {
            let nats = self.nats_config(|name| std::env::var(name).ok())?;
            let nats = nats.ok_or(Invalid::BucketWithoutNats)?;
            let ttl = secs(m.members_ttl_secs, d.members_ttl_secs).max(Duration::from_secs(1));
            let key = self.members_key(|name| std::env::var(name).ok())?;
            let allow = m
                .members_allow
                .iter()
                .map(|r| r.parse())
                .collect::<Result<_, kvroute_router::members::RegistrationError>>()
                .map_err(|e| Invalid::MembersKey(e.to_string()))?;
            discovery.bucket = Some(BucketConfig { nats, bucket: bucket.clone(), ttl, key, allow });
        }
        Ok(discovery)
    }

    /// The fleet's registration key: `--members-key-file`'s bytes, else `KVROUTE_MEMBERS_KEY`.
    pub(super) fn members_key(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<kvroute_router::members::MembersKey, StackError> {
        use kvroute_router::members::MembersKey;
        let secret = match (&self.membership.members_key_file, env(ENV_MEMBERS_KEY)) {
            (Some(path), _) => std::fs::read(path)
                .map_err(|source| Invalid::ReadSecret { path: path.clone(), source })?,
            (None, Some(secret)) => secret.into_bytes(),
            (None, None) => return Err(Invalid::BucketWithoutKey.into()),
        };
        MembersKey::from_secret(&secret).map_err(|e| Invalid::MembersKey(e.to_string()).into())
    }

    /// The simulated engines' seed.
    pub fn seed(&self) -> u64 {
        self.engine.seed.unwrap_or(Simulated::default().seed)
    }

    /// A stack of `simulated` simulated workers (with the engine settings) and the settings'
    /// external workers, the router (embedded unless `router_url`) and, if asked, a front door.
    pub fn stack_config(
        &self,
        simulated: usize,
        frontend: bool,
    ) -> Result<StackConfig, StackError> {
        let pd = match frontend && self.remote.router_url.is_none() {
            true => (
                self.simulated.prefill_workers.unwrap_or(0),
                self.simulated.decode_workers.unwrap_or(0),
            ),
            false => (0, 0),
        };
        let engine = match simulated + pd.0 + pd.1 {
            0 => EngineConfig::default(),
            _ => self.engine_config()?,
        };
        if engine.sliding_window.is_some() && pd.0 + pd.1 > 0 {
            return Err(Invalid::HybridWith("prefill and decode workers").into());
        }
        let store = self.shared_store(simulated + pd.0 + pd.1 > 0)?;
        if store.is_some() && pd.0 + pd.1 > 0 {
            return Err(Invalid::StoreWith("prefill and decode workers").into());
        }
        Ok(StackConfig {
            simulated: Simulated {
                count: simulated,
                prefill: pd.0,
                decode: pd.1,
                nodes: self.simulated.simulated_nodes.unwrap_or(1),
                engine,
                events: true,
                seed: self.seed(),
                max_model_len: self.engine.max_model_len,
                dialect: self.simulated.simulated_dialect.unwrap_or(Simulated::default().dialect),
                chat_template: self.chat_template()?,
                lora_modules: self.lora_modules(),
                lora_updating: self.engine.lora_updating.unwrap_or(false),
                kv_peer_token: match (&store, super::kv_peer_token()?) {
                    (Some(SharedStore::At(_)), None) => {
                        return Err(Invalid::NoPeerToken("--store-url").into());
                    }
                    (_, token) => token,
                },
                store,
                // Behind a gateway the engines are called by the gateway, which holds no
                // token of theirs (they listen on loopback only).
                tokenless: self.gateway.ext_proc_port.is_some(),
            },
            router: self.router_config()?,
            router_url: self.remote.router_url.clone(),
            frontend,
            model_path: self.model.model_path.clone(),
            fetch: self.fetch_config(),
            access: self.access()?,
            front_door: self.front_door()?,
            adapters: self.front_door.adapters.clone(),
            model_priorities: self.model_priorities()?,
            discovery: self.discovery()?,
        })
    }
}

pub(super) fn first_line(path: &Path) -> Result<String, StackError> {
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

/// The pair cost's settings, read as [`kv_config`] reads the `kv` cost's.
fn pd_config(overrides: &[(String, f64)]) -> Result<PairConfig, StackError> {
    let unknown = |name, known| Invalid::PdCostName { name, known };
    named_numbers(PairConfig::default(), overrides, unknown)
}

/// The `kv` cost's weights: the defaults, each named one overridden (the last of a name given
/// twice). Names are [`KvConfig`]'s fields (an unknown one is an error); values are finite and
/// non-negative.
fn kv_config(overrides: &[(String, f64)]) -> Result<KvConfig, StackError> {
    let unknown = |name, known| Invalid::KvCostName { name, known };
    named_numbers(KvConfig::default(), overrides, unknown)
}

/// `defaults` (a struct of numbers) with each named field overridden (the last of a name
/// given twice); an unknown name is `unknown(name, the known ones)`, a value must be finite
/// and non-negative.
fn named_numbers<T: serde::Serialize + serde::de::DeserializeOwned>(
    defaults: T,
    overrides: &[(String, f64)],
    unknown: impl Fn(String, String) -> Invalid,
) -> Result<T, StackError> {
    let mut fields = toml::Table::try_from(defaults).map_err(Invalid::KvCostWrite)?;
    for (name, value) in overrides {
        let value = *value;
        if !fields.contains_key(name) {
            let known: Vec<&str> = fields.keys().map(String::as_str).collect();
            return Err(unknown(name.clone(), known.join(", ")).into());
        }
        if !(value.is_finite() && value >= 0.0) {
            return Err(Invalid::KvCostValue { name: name.clone(), value }.into());
        }
        fields.insert(name.clone(), value.into());
    }
    fields.try_into().map_err(|e| Invalid::KvCostRead(e).into())
}

impl Settings {
    /// The simulated engines' host memory, disk, store and links price the cost's loads and
    /// the pairs' transfers, unless the cost names its own; the predictions run at their speed
    /// and step budget.
    fn priced_by_engines(&self, s: &mut SchedulerConfig) {
        let r = &self.routing;
        let e = &self.engine;
        // The simulated engines' host memory prices its loads, unless the cost names its own.
        let named = |n: &str| r.kv_cost.iter().any(|(k, _)| k == n);
        if let Some(b) = e.host_offload_h2d_bandwidth_gbps.filter(|_| !named("host_bandwidth_gbps"))
        {
            s.kv.host_bandwidth_gbps = b;
        }
        if let Some(b) = e.kv_bytes_per_token.filter(|_| !named("kv_bytes_per_token")) {
            s.kv.kv_bytes_per_token = b;
        }
        if let Some(b) = e.storage_bandwidth_gbps.filter(|_| !named("disk_bandwidth_gbps")) {
            s.kv.disk_bandwidth_gbps = b;
        }
        if let Some(b) = e.store_bandwidth_gbps.filter(|_| !named("external_bandwidth_gbps")) {
            s.kv.external_bandwidth_gbps = b;
        }
        // The predictions run at the simulated engines' speed and step budget.
        if let Some(x) = e.speedup.filter(|x| x.is_finite() && *x > 0.0) {
            s.predictor.engine.speedup = x;
        }
        if let Some(t) = e.max_batched_tokens.filter(|&t| t > 0) {
            s.predictor.engine.step_tokens = t;
        }
        // And their links price the pairs' transfers, unless the pair cost names its own.
        let named = |n: &str| r.pd_cost.iter().any(|(k, _)| k == n);
        if let Some(b) = e.kv_transfer_bandwidth.filter(|_| !named("link_within_node_gbps")) {
            s.pairs.link_within_node_gbps = b;
            s.pairs.link_across_nodes_gbps = b;
        }
        if let Some(b) =
            e.kv_transfer_bandwidth_across_nodes.filter(|_| !named("link_across_nodes_gbps"))
        {
            s.pairs.link_across_nodes_gbps = b;
        }
    }
}

/// Flow control's settings.
fn flow_settings(r: &Routing, f: &mut FlowConfig) -> Result<(), StackError> {
    f.enabled = r.flow_control.unwrap_or(f.enabled);
    f.max_engine_wait_ms = match r.max_engine_wait_ms {
        Some(ms) if ms.is_finite() && ms >= 0.0 => ms,
        Some(_) => return Err(Invalid::Negative("max_engine_wait_ms").into()),
        None => f.max_engine_wait_ms,
    };
    f.max_queued = r.max_queued.unwrap_or(f.max_queued);
    f.max_queued_per_tenant = r.max_queued_per_tenant.unwrap_or(f.max_queued_per_tenant);
    f.max_queued_bytes = r.max_queued_bytes.unwrap_or(f.max_queued_bytes);
    f.max_wait_ms = r.max_queue_wait_ms.unwrap_or(f.max_wait_ms);
    f.shed_at_once = r.queue_sheddable.map_or(f.shed_at_once, |queue| !queue);
    f.over_share = match r.over_share {
        Some(x) if x.is_finite() && x >= 0.0 => x,
        Some(_) => return Err(Invalid::Negative("over_share").into()),
        None => f.over_share,
    };
    f.over_share_wait = match r.over_share_wait {
        Some(x) if (0.0..=1.0).contains(&x) => x,
        Some(_) => return Err(Invalid::Fraction("over_share_wait").into()),
        None => f.over_share_wait,
    };
    Ok(())
}

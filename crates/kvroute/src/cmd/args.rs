//! Flag groups shared by the subcommands. Every flag is optional here: what is not given falls
//! back to its `KVROUTE_*` environment variable (clap), then to the `--config` file, then to
//! the default named in its help ([`kvroute_stack::settings`] merges them).

use std::path::PathBuf;

use clap::Args;
use kvroute_core::schedule::PolicyKind;
use kvroute_router::WorkerSpec;
use kvroute_stack::settings::Settings;

/// Where an HTTP API listens.
#[derive(Debug, Args)]
#[command(next_help_heading = "Listener")]
pub(crate) struct ListenArgs {
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long, env = "KVROUTE_HOST")]
    host: Option<String>,
    /// Port to listen on, 0 for any free port [default: 8000 for serve and frontend, 8001
    /// for router, 8100 for mocker].
    #[arg(long, env = "KVROUTE_PORT")]
    port: Option<u16>,
    /// Open connections one client (peer IP address) may hold; more are closed as they are
    /// accepted, so one client cannot take the listener's 4096. Behind a proxy every client
    /// is the proxy: raise it there [default: 1024].
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS_PER_CLIENT")]
    max_connections_per_client: Option<usize>,
    /// Request body bytes being received at once, all connections together; a body past it
    /// gets a 503 (retry) [default: 536870912, eight 64 MiB bodies].
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES_IN_FLIGHT")]
    max_body_bytes_in_flight: Option<usize>,
    /// Request body bytes one client may be sending at once [default: a quarter of
    /// --max-body-bytes-in-flight].
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES_PER_CLIENT")]
    max_body_bytes_per_client: Option<usize>,
}

/// Who may call the listener, and TLS.
#[derive(Debug, Args)]
#[command(next_help_heading = "Security")]
pub(crate) struct SecurityArgs {
    /// File holding the admin token (first line): the router's API (events, lifecycle, debug,
    /// status) and /metrics then need `Authorization: Bearer <token>`. Or the token itself in
    /// KVROUTE_ADMIN_TOKEN.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// PEM certificate chain to serve HTTPS with (with --tls-key); leave both out when a proxy
    /// in front terminates TLS.
    #[arg(long, env = "KVROUTE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KVROUTE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Listen on a non-loopback address without API keys or an admin token (refused
    /// otherwise), e.g. behind a proxy that authenticates.
    #[arg(long, env = "KVROUTE_INSECURE")]
    insecure: bool,
}

/// The OpenAI routes' keys and what answers tell.
#[derive(Debug, Args)]
#[command(next_help_heading = "Front door")]
pub(crate) struct FrontDoorArgs {
    /// File of API keys the OpenAI routes accept (`Authorization: Bearer <key>`), one per line,
    /// several at once; or the keys themselves, comma-separated, in KVROUTE_API_KEYS. Without
    /// keys anyone who reaches the port may call.
    #[arg(long, env = "KVROUTE_API_KEYS_FILE")]
    api_keys_file: Option<PathBuf>,
    /// Answer with x-kvroute-overlap-tokens (the prompt tokens the router expects cached).
    /// Off by default: it lets a client test guesses of other clients' prompts.
    #[arg(long, env = "KVROUTE_EXPOSE_OVERLAP")]
    expose_overlap: bool,
    /// Seconds a worker has to start a streamed answer before the request goes to another
    /// worker and this one is ejected for a while [default: 15].
    #[arg(long, env = "KVROUTE_FIRST_BYTE_TIMEOUT")]
    first_byte_timeout: Option<f64>,
    /// Give each API key its own cache namespace (vLLM's cache_salt, also in the router's
    /// hashes): a client then reuses only its own cached prefixes and cannot learn from
    /// cached_tokens what other clients sent. Engines must honour cache_salt.
    #[arg(long, env = "KVROUTE_CACHE_NAMESPACE_PER_KEY")]
    cache_namespace_per_key: bool,
    /// Do not send joining workers the parity probe (one short prompt whose announced blocks
    /// are compared with the front door's; a mismatch names its cause and routes the worker
    /// approximately). For engines that cannot take a request of their own.
    #[arg(long, env = "KVROUTE_NO_PARITY_PROBE")]
    no_parity_probe: bool,
}

/// Tokens per KV block.
#[derive(Debug, Args)]
#[command(next_help_heading = "Fleet")]
pub(crate) struct BlockSizeArg {
    /// Tokens per KV block; the engines must use the same [default: 16].
    #[arg(long, env = "KVROUTE_BLOCK_SIZE")]
    block_size: Option<u32>,
}

/// The router's settings and its workers.
#[derive(Debug, Args)]
#[command(next_help_heading = "Routing")]
pub(crate) struct RoutingArgs {
    /// A worker, as comma-separated key=value pairs: id (required), url, events, replay,
    /// metrics (tcp:// load reports or http://.../metrics), block_size, dp_size,
    /// image_token_id, vocab_size, format (the engine's event format: vllm by default; a name
    /// that is none lists them).
    /// Without events, the worker is routed approximately. Repeat for each worker; in the env
    /// twin, separate workers with ';'.
    /// Example: --worker id=7,url=http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
    #[arg(long = "worker", env = "KVROUTE_WORKERS", value_delimiter = ';', verbatim_doc_comment)]
    workers: Vec<WorkerSpec>,
    /// Routing policy: kv (predicted time to first token), dynamo (Dynamo's cost), or the
    /// baselines round-robin, random, least-loaded [default: kv].
    #[arg(long, env = "KVROUTE_POLICY")]
    policy: Option<PolicyKind>,
    /// Softmax temperature of the choice; 0 always takes the lowest cost [default: 0].
    #[arg(long, env = "KVROUTE_TEMPERATURE")]
    temperature: Option<f64>,
    /// Weight of prefill against decode blocks in the dynamo policy [default: 1].
    #[arg(long, env = "KVROUTE_OVERLAP_WEIGHT")]
    overlap_weight: Option<f64>,
    /// A weight of the kv policy's cost as NAME=VALUE; repeat or separate with ','. Names and
    /// defaults: docs/routing.md ("The kv cost"). Example: --kv-cost queue_weight=0.5
    #[arg(long = "kv-cost", env = "KVROUTE_KV_COST", value_delimiter = ',', value_parser = kv_weight)]
    kv_cost: Vec<(String, f64)>,
    /// Index shards: parallel readers, one writer each [default: 4].
    #[arg(long, env = "KVROUTE_SHARDS")]
    shards: Option<usize>,
    /// Most (worker, block) pairs the index keeps, all shards together, before evicting the
    /// coldest (~48 bytes each) [default: 16777216].
    #[arg(long, env = "KVROUTE_MAX_INDEX_BLOCKS")]
    max_index_blocks: Option<usize>,
    /// Most data-parallel ranks of one worker; events naming a higher rank are refused
    /// [default: 256].
    #[arg(long, env = "KVROUTE_MAX_DP_SIZE")]
    max_dp_size: Option<u32>,
    /// Seconds a request's blocks are assumed cached on a worker without events
    /// (approximate mode) [default: 120].
    #[arg(long, env = "KVROUTE_APPROX_TTL")]
    approx_ttl: Option<f64>,
    /// Seconds to wait at start for every worker's event stream and first load report; the
    /// ready line comes after [default: 10].
    #[arg(long, env = "KVROUTE_READY_TIMEOUT")]
    ready_timeout: Option<f64>,
    /// Largest ZMQ message, in bytes, an engine's event, replay or load socket may send
    /// (all its frames, 64 bytes counted per frame); a peer announcing more is refused
    /// before anything is allocated, disconnected and counted
    /// (kvroute_zmq_refused_messages_total). A replay answer may bring 4 times this
    /// [default: 16777216, one engine step's batch with a wide margin].
    #[arg(long, env = "KVROUTE_ZMQ_MAX_MESSAGE_BYTES")]
    zmq_max_message_bytes: Option<usize>,
}

/// Replicas over NATS with JetStream (docs/replicas.md).
#[derive(Debug, Args)]
#[command(next_help_heading = "Replicas (NATS)")]
pub(crate) struct NatsArgs {
    /// NATS server URL (nats://host:4222, tls://..., comma-separated for a cluster; the server
    /// runs with JetStream: `nats-server -js -sd DIR`). With it, this replica shares its
    /// routing decisions with the others on the same prefix, and may take its KV events from a
    /// JetStream stream (--nats-events). NATS down is degraded (local state), never fatal.
    #[arg(long, env = "KVROUTE_NATS_URL")]
    nats_url: Option<String>,
    /// Names the fleet: subjects PREFIX.decisions and PREFIX.events.>, the stream
    /// PREFIX_EVENTS, the snapshot bucket PREFIX_snapshots [default: kvroute].
    #[arg(long, env = "KVROUTE_NATS_PREFIX")]
    nats_prefix: Option<String>,
    /// This replica's name among its peers [default: host, pid and a nonce].
    #[arg(long, env = "KVROUTE_NATS_REPLICA")]
    nats_replica: Option<String>,
    /// Do not share routing decisions (each replica then prices only its own in-flight load).
    #[arg(long, env = "KVROUTE_NATS_NO_SYNC")]
    nats_no_sync: bool,
    /// Where the workers' KV events come from: zmq (each worker's stream, directly), stream
    /// (the JetStream stream another replica relays), or relay (subscribe to the engines and
    /// relay them into the stream, route from the stream, write snapshots) [default: zmq].
    #[arg(long, env = "KVROUTE_NATS_EVENTS")]
    nats_events: Option<String>,
    /// Write an index snapshot every this many stream messages, 0 for never [default: 10000
    /// with --nats-events relay, else 0].
    #[arg(long, env = "KVROUTE_NATS_SNAPSHOT_EVERY")]
    nats_snapshot_every: Option<u64>,
    /// The event stream keeps at most this many bytes [default: 1073741824] ...
    #[arg(long, env = "KVROUTE_NATS_STREAM_MAX_BYTES")]
    nats_stream_max_bytes: Option<i64>,
    /// ... for at most this many seconds [default: 86400]. Keep it well above the snapshot
    /// interval: a replica starts from the latest snapshot and needs what follows it.
    #[arg(long, env = "KVROUTE_NATS_STREAM_MAX_AGE")]
    nats_stream_max_age: Option<f64>,
    /// File holding the NATS token (first line); or the token itself in KVROUTE_NATS_TOKEN.
    #[arg(long, env = "KVROUTE_NATS_TOKEN_FILE")]
    nats_token_file: Option<PathBuf>,
    /// NATS user (with its password in --nats-password-file or KVROUTE_NATS_PASSWORD).
    #[arg(long, env = "KVROUTE_NATS_USER")]
    nats_user: Option<String>,
    /// File holding the NATS user's password (first line).
    #[arg(long, env = "KVROUTE_NATS_PASSWORD_FILE")]
    nats_password_file: Option<PathBuf>,
    /// CA certificate (PEM) the NATS server's certificate must chain to; implies TLS.
    #[arg(long, env = "KVROUTE_NATS_TLS_CA")]
    nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for a NATS server that verifies clients (with --nats-tls-key).
    #[arg(long, env = "KVROUTE_NATS_TLS_CERT", requires = "nats_tls_key")]
    nats_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(long, env = "KVROUTE_NATS_TLS_KEY", requires = "nats_tls_cert")]
    nats_tls_key: Option<PathBuf>,
}

/// The model and its images (front door and simulated workers).
#[derive(Debug, Args)]
#[command(next_help_heading = "Model")]
pub(crate) struct ModelArgs {
    /// Model directory (tokenizer.json, tokenizer_config.json) [default: the built-in
    /// kvroute-tiny].
    #[arg(long, env = "KVROUTE_MODEL_PATH")]
    model_path: Option<PathBuf>,
    /// Fetch image URLs that resolve to loopback or private addresses (refused by default, so
    /// the server is no relay into private networks).
    #[arg(long, env = "KVROUTE_ALLOW_PRIVATE_IMAGE_URLS")]
    allow_private_image_urls: bool,
}

/// A simulated engine's knobs, the same on `kvroute mocker` and `kvroute serve` (docs/running.md);
/// defaults follow Dynamo's mocker.
#[derive(Debug, Args)]
#[command(next_help_heading = "Simulated engine (on serve: its simulated workers only)")]
pub(crate) struct EngineArgs {
    /// KV cache capacity in blocks [default: 16384].
    #[arg(long, env = "KVROUTE_NUM_BLOCKS")]
    num_blocks: Option<usize>,
    /// Most requests running at once [default: 256].
    #[arg(long, env = "KVROUTE_MAX_NUM_SEQS")]
    max_num_seqs: Option<usize>,
    /// Token budget of one scheduler step (chunked prefill) [default: 8192].
    #[arg(long, env = "KVROUTE_MAX_BATCHED_TOKENS")]
    max_batched_tokens: Option<usize>,
    /// Time runs this many times faster than the timing model; 1 is a real GPU's pace
    /// [default: 1].
    #[arg(long, env = "KVROUTE_SPEEDUP")]
    speedup: Option<f64>,
    /// Seed of the generated words, the same on every worker [default: 0].
    #[arg(long, env = "KVROUTE_SEED")]
    seed: Option<u64>,
    /// Longest prompt plus output a worker takes [default: the model's context length, else
    /// 32768; at most the KV capacity].
    #[arg(long, env = "KVROUTE_MAX_MODEL_LEN")]
    max_model_len: Option<u64>,
}

/// `--config` and `--print-config`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Config file")]
pub(crate) struct ConfigArgs {
    /// TOML file of settings: the flags' names in snake_case (block_size = 32) and
    /// [[workers]] tables of the --worker keys. Flags and environment win over it.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Print every setting the command reads, after merging flags, environment and file over
    /// the defaults (as a config file it reads back), and exit.
    #[arg(long)]
    pub(crate) print_config: bool,
}

impl ListenArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.host.clone_from(&self.host);
        s.port = self.port;
        s.max_connections_per_client = self.max_connections_per_client;
        s.max_body_bytes_in_flight = self.max_body_bytes_in_flight;
        s.max_body_bytes_per_client = self.max_body_bytes_per_client;
    }
}

impl SecurityArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.admin_token_file.clone_from(&self.admin_token_file);
        s.tls_cert.clone_from(&self.tls_cert);
        s.tls_key.clone_from(&self.tls_key);
        s.insecure = self.insecure.then_some(true);
    }
}

impl FrontDoorArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.api_keys_file.clone_from(&self.api_keys_file);
        s.expose_overlap = self.expose_overlap.then_some(true);
        s.first_byte_timeout = self.first_byte_timeout;
        s.cache_namespace_per_key = self.cache_namespace_per_key.then_some(true);
        s.parity_probe = self.no_parity_probe.then_some(false);
    }
}

impl BlockSizeArg {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.block_size = self.block_size;
    }
}

impl RoutingArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.workers.clone_from(&self.workers);
        s.policy = self.policy;
        s.temperature = self.temperature;
        s.overlap_weight = self.overlap_weight;
        s.kv_cost = self.kv_cost.iter().cloned().collect();
        s.shards = self.shards;
        s.max_index_blocks = self.max_index_blocks;
        s.max_dp_size = self.max_dp_size;
        s.approx_ttl = self.approx_ttl;
        s.ready_timeout = self.ready_timeout;
        s.zmq_max_message_bytes = self.zmq_max_message_bytes;
    }
}

impl NatsArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.nats_url.clone_from(&self.nats_url);
        s.nats_prefix.clone_from(&self.nats_prefix);
        s.nats_replica.clone_from(&self.nats_replica);
        s.nats_sync = self.nats_no_sync.then_some(false);
        s.nats_events.clone_from(&self.nats_events);
        s.nats_snapshot_every = self.nats_snapshot_every;
        s.nats_stream_max_bytes = self.nats_stream_max_bytes;
        s.nats_stream_max_age = self.nats_stream_max_age;
        s.nats_token_file.clone_from(&self.nats_token_file);
        s.nats_user.clone_from(&self.nats_user);
        s.nats_password_file.clone_from(&self.nats_password_file);
        s.nats_tls_ca.clone_from(&self.nats_tls_ca);
        s.nats_tls_cert.clone_from(&self.nats_tls_cert);
        s.nats_tls_key.clone_from(&self.nats_tls_key);
    }
}

impl ModelArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.model_path.clone_from(&self.model_path);
        s.allow_private_image_urls = self.allow_private_image_urls.then_some(true);
    }
}

impl EngineArgs {
    pub(crate) fn apply(&self, s: &mut Settings) {
        s.num_blocks = self.num_blocks;
        s.max_num_seqs = self.max_num_seqs;
        s.max_batched_tokens = self.max_batched_tokens;
        s.speedup = self.speedup;
        s.seed = self.seed;
        s.max_model_len = self.max_model_len;
    }
}

impl ConfigArgs {
    /// The file's settings under `flags` (flags and environment win).
    pub(crate) fn merge(
        &self,
        flags: Settings,
        allowed: &[&str],
        command: &str,
    ) -> anyhow::Result<Settings> {
        let file = match &self.config {
            Some(path) => Settings::from_file(path, allowed, command)?,
            None => Settings::default(),
        };
        Ok(file.overlaid_by(flags)?)
    }

    /// With `--print-config`: prints `settings` over the defaults (the command's `port`,
    /// its `allowed` keys) and says to stop.
    pub(crate) fn printed(&self, settings: &Settings, port: u16, allowed: &[&str]) -> bool {
        if self.print_config {
            #[allow(clippy::print_stdout)]
            {
                print!("{}", settings.printed(port, allowed));
            }
        }
        self.print_config
    }
}

/// `NAME=VALUE` of `--kv-cost` (the name is checked against the cost's weights later).
fn kv_weight(arg: &str) -> Result<(String, f64), String> {
    let (name, value) = arg.split_once('=').ok_or("expected NAME=VALUE")?;
    let value = value.trim().parse().map_err(|e| format!("{value}: {e}"))?;
    Ok((name.trim().to_owned(), value))
}

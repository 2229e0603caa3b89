//! Every setting, declared once: its name is the field's, which is also its key in a config
//! file and, in kebab case, its flag; its environment variable is `KVROUTE_` and the flag's
//! name (see [`super::decorate`]); its help is the doc comment; its default is the library's
//! (`Settings::defaults`, shown in `--help` by [`super::decorate`]). Each group derives both
//! the flags (`clap::Args`, flattened into the commands that take it) and the file's keys
//! (serde, flattened into [`super::Settings`]). Every field is optional: absent, the next
//! source decides.
//!
//! A switch is `--name` (or its variable set to true, 1, yes or on); a negated switch
//! (`--no-parity-probe`) sets its setting (`parity_probe`) to false.

#![allow(rustdoc::broken_intra_doc_links)] // help texts name TOML tables: `[kv_cost]`

use std::path::PathBuf;

use clap::Args;
use clap::builder::{BoolishValueParser, TypedValueParser as _};
use kvroute_core::schedule::PolicyKind;
use kvroute_router::{Dialect, WorkerSpec};
use serde::{Deserialize, Serialize};

/// A switch's value: true, named or set (`--name`, `KVROUTE_NAME=1`).
fn switch() -> BoolishValueParser {
    BoolishValueParser::new()
}

/// A negated switch's value: false when named or set (`--no-name`, `KVROUTE_NO_NAME=1`).
fn negated() -> impl clap::builder::TypedValueParser<Value = bool> {
    BoolishValueParser::new().map(|on: bool| !on)
}

/// Where an HTTP API listens.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Listener")]
pub struct Listen {
    /// Address to listen on.
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on, 0 for any free port.
    #[arg(long)]
    pub port: Option<u16>,
    /// Open connections one client (peer IP address) may hold; more are closed as they are
    /// accepted, so one client cannot take the listener's 4096. Behind a proxy every client
    /// is the proxy: raise it there.
    #[arg(long)]
    pub max_connections_per_client: Option<usize>,
    /// Request body bytes being received at once, all connections together; a body past it
    /// gets a 503 (retry).
    #[arg(long)]
    pub max_body_bytes_in_flight: Option<usize>,
    /// Request body bytes one client may be sending at once.
    #[arg(long)]
    pub max_body_bytes_per_client: Option<usize>,
}

/// Who may call the listener, and TLS.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Security")]
pub struct Security {
    /// File holding the admin token (first line), or the token in KVROUTE_ADMIN_TOKEN: the
    /// router's API and /metrics then need `Authorization: Bearer <token>`; adding, draining or
    /// removing a worker needs it always (without one, those routes are closed).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// PEM certificate chain to serve HTTPS with (with --tls-key); leave both out when a proxy
    /// in front terminates TLS.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// File whose first line keys the API keys' ids (the tenant names in flow control,
    /// metrics and logs, and the per-key cache namespaces), the same on every replica; or the
    /// secret itself in KVROUTE_TENANT_SALT. Without it the ids are keyed by the set of keys
    /// itself, so adding or removing a key renames every tenant.
    #[arg(long)]
    pub tenant_salt_file: Option<PathBuf>,
    /// Listen on a non-loopback address without API keys or an admin token (refused
    /// otherwise), e.g. behind a proxy that authenticates.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub insecure: Option<bool>,
}

/// The OpenAI routes' keys and what answers tell.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Front door")]
pub struct FrontDoor {
    /// File of API keys the OpenAI routes accept (`Authorization: Bearer <key>`), one per line,
    /// several at once; or the keys themselves, comma-separated, in KVROUTE_API_KEYS. Without
    /// keys anyone who reaches the port may call.
    #[arg(long)]
    pub api_keys_file: Option<PathBuf>,
    /// Answer with x-kvroute-overlap-tokens (the prompt tokens the router expects cached).
    /// Off by default: it lets a client test guesses of other clients' prompts.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub expose_overlap: Option<bool>,
    /// Answer a request that asks with x-kvroute-explain: true, and shows the admin token in
    /// x-kvroute-admin-token, with its routing decision in x-kvroute-decision (the candidates,
    /// their cached blocks, costs and the kv cost's terms). Off by default: it shows what the
    /// other workers hold.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub explain_decisions: Option<bool>,
    /// Seconds a worker has to start a streamed answer before the request goes to another
    /// worker and this one is ejected for a while.
    #[arg(long)]
    pub first_byte_timeout: Option<f64>,
    /// Seconds a begun stream may go without a token before its worker is taken for broken
    /// (ejected, the stream moved to another worker).
    #[arg(long)]
    pub inter_token_timeout: Option<f64>,
    /// Times a stream may move to another worker (sent the prompt and the tokens so far) when
    /// its own breaks it off mid-answer; 0: never, it ends with an error event. Default 1.
    #[arg(long)]
    pub max_migrations: Option<u32>,
    /// Give each API key its own cache namespace (vLLM's cache_salt, also in the router's
    /// hashes): a client then reuses only its own cached prefixes and cannot learn from
    /// cached_tokens what other clients sent. Engines must honour cache_salt.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub cache_namespace_per_key: Option<bool>,
    /// Do not send joining workers the parity probe (one short prompt whose announced blocks
    /// are compared with the front door's; a mismatch names its cause and routes the worker
    /// approximately). For engines that cannot take a request of their own. In a file:
    /// parity_probe = false.
    #[arg(long = "no-parity-probe", num_args = 0, default_missing_value = "true", value_parser = negated())]
    pub parity_probe: Option<bool>,
    /// LoRA adapters the fleet serves over the base model, as a request's "model": NAME or
    /// NAME=PATH (the path --load-adapters sends); repeat or separate with ','. Those the
    /// workers list in /v1/models are served too (read every 10 s); any other model is a 404
    /// model_not_found.
    #[arg(long, value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    /// The priority of a model's requests that name none (x-kvroute-priority), as the
    /// Gateway API Inference Extension's InferenceObjective gives it: NAME=PRIORITY, the
    /// base model's name or an adapter's; repeat or separate with ','. A key's own default
    /// (its `priority=` in the keys file) comes first, and its ceiling (`max-priority=`)
    /// caps both.
    #[arg(long = "model-priority", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_priorities: Vec<String>,
    /// Load a request's adapter on the chosen worker through vLLM's /v1/load_lora_adapter
    /// when the worker does not list it (the engine must allow runtime LoRA updating); off:
    /// an adapter goes only to the workers that list it.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub load_adapters: Option<bool>,
    /// Pass a client's own KV-transfer fields (vLLM's kv_transfer_params, SGLang's
    /// bootstrap_host/port/room/pair_key, TensorRT-LLM's disaggregated_params, ...) on to
    /// the engines, for a trusted upstream that pairs prefill and decode itself. Off by
    /// default: a request carrying one is refused with a 400 naming it, since those fields
    /// make an engine call an address and take KV from it (docs/security.md).
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub trust_transfer_fields: Option<bool>,
    /// Tell the engines each request's priority in their own field (vLLM's priority, lower
    /// first; SGLang's, higher first), from x-kvroute-priority. The engines must schedule by
    /// priority (vLLM --scheduling-policy priority, SGLang --enable-priority-scheduling): an
    /// engine on first-come-first-served refuses a priority other than 0. On by default when
    /// the simulated engines run --scheduling-policy priority.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub engine_priority: Option<bool>,
    /// How often the status page's history samples the router's counters, in milliseconds;
    /// it keeps the last 300 samples (5 minutes at the default), which /ui draws when opened.
    #[arg(long)]
    pub status_sample_ms: Option<u64>,
}

/// The Endpoint Picker a Kubernetes inference gateway asks (docs/kubernetes.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Inference gateway")]
pub struct Gateway {
    /// Also serve the Endpoint Picker on this port (on --host): Envoy's external processing
    /// gRPC (ext_proc) as the Gateway API Inference Extension asks, with gRPC health
    /// (liveness, readiness, the ext_proc service). Pickers usually listen on 9002; 0 picks
    /// a free port. Off unless set. `serve`'s simulated workers then answer without a token
    /// (the gateway calls them; they listen on loopback).
    #[arg(long)]
    pub ext_proc_port: Option<u16>,
    /// Endpoints listed after the one picked in x-gateway-destination-endpoint, which the
    /// gateway tries in order when it cannot reach the first.
    #[arg(long, requires = "ext_proc_port")]
    pub epp_fallbacks: Option<usize>,
    /// Return the candidates' scores with each pick, as llm-d's picker does with
    /// --emit-endpoint-scores: x-gateway-destination-endpoint-scores in the envoy.lb dynamic
    /// metadata, endpoint (ip:port) to score from 0 to 1, higher better (the cheapest cost
    /// over each one's), for the chosen and the cheapest others.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch(), requires = "ext_proc_port")]
    pub epp_endpoint_scores: Option<bool>,
    /// File of the pool's endpoints as the gateway names them (host:port, one per line, '#'
    /// comments), reread when it changes (a ConfigMap, or a controller watching the pool's
    /// pods): the picker picks only among the workers it lists. A worker must also be in the
    /// fleet (--worker) to be picked. Without it every worker is in the pool.
    #[arg(long, requires = "ext_proc_port")]
    pub endpoints_file: Option<PathBuf>,
    /// PEM certificate chain the picker's port serves TLS with (with --ext-proc-tls-key),
    /// reread when the files change (a renewed Secret is taken without a restart).
    #[arg(long, requires = "ext_proc_tls_key", conflicts_with = "ext_proc_self_signed")]
    pub ext_proc_tls_cert: Option<PathBuf>,
    /// PEM private key of --ext-proc-tls-cert.
    #[arg(long, requires = "ext_proc_tls_cert")]
    pub ext_proc_tls_key: Option<PathBuf>,
    /// Serve the picker's port over TLS with a self-signed certificate drawn at start, as
    /// the Gateway API Inference Extension's picker does by default (gateways do not verify
    /// it; use --ext-proc-tls-cert where they do).
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch(), requires = "ext_proc_port")]
    pub ext_proc_self_signed: Option<bool>,
    /// File whose first line is the token a gateway must send on the picker's port
    /// (`authorization: Bearer <token>` in the gRPC metadata: Envoy's
    /// grpc_service.initial_metadata); or the token itself in KVROUTE_EXT_PROC_TOKEN. Without
    /// it any gateway that reaches the port may ask.
    #[arg(long, requires = "ext_proc_port")]
    pub ext_proc_token_file: Option<PathBuf>,
    /// Also serve the picker's gRPC health in plain text on this port (on --host), for
    /// Kubernetes' gRPC probes, which speak no TLS (GIE's picker uses 9003). Off unless set.
    #[arg(long, requires = "ext_proc_port")]
    pub ext_proc_health_port: Option<u16>,
}

/// Tokens per KV block, for the router and the simulated engines alike.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Fleet")]
pub struct Blocks {
    /// Tokens per KV block; the engines must use the same (a worker whose engine reports
    /// another size is refused). Left out with --worker: the size the workers' engines report
    /// on their metrics (vLLM's cache_config_info) when they agree, else the default.
    #[arg(long)]
    pub block_size: Option<u32>,
}

/// How many simulated workers `kvroute serve` starts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Fleet")]
pub struct SimulatedFleet {
    /// Simulated workers to start in-process, on free loopback ports; 0 with --worker for
    /// external workers only.
    #[arg(long, visible_alias = "workers")]
    pub simulated_workers: Option<usize>,
    /// How the front door speaks to the simulated workers: vllm-generate (the front door's
    /// token ids to vLLM's /inference/v1/generate), vllm-generate-tokens (the same with token
    /// ids back, which the front door detokenizes), sglang-generate (as input_ids to SGLang's
    /// /generate), openai-completions-tokens (the token ids as a /v1/completions prompt) or
    /// openai-chat (the client's body, which the engine renders and tokenizes again). External workers take theirs in --worker.
    #[arg(long)]
    pub simulated_dialect: Option<Dialect>,
    /// Simulated prefill workers to start besides them (a disaggregated fleet: docs/routing.md,
    /// "Prefill and decode"); they prefill for the decode workers, which pull their KV.
    #[arg(long)]
    pub prefill_workers: Option<usize>,
    /// Simulated decode workers to start besides them.
    #[arg(long)]
    pub decode_workers: Option<usize>,
    /// Nodes the simulated prefill and decode workers are spread over (each pool in turn:
    /// node-0, node-1, ...), labelled for the router and the engines alike: pulls across
    /// nodes take --kv-transfer-bandwidth-across-nodes. 0 or 1: one node.
    #[arg(long)]
    pub simulated_nodes: Option<usize>,
}

/// The router's settings and its workers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Routing")]
pub struct Routing {
    /// A worker, as comma-separated key=value pairs: id (required), url, events, replay,
    /// metrics (tcp:// load reports or http://.../metrics), block_size, dp_size,
    /// image_token_id, vocab_size, format (the engine's event format: vllm by default; a name
    /// that is none lists them), dialect (openai-chat by default, vllm-generate,
    /// vllm-generate-tokens, sglang-generate or openai-completions-tokens: see
    /// docs/dialects.md), max_loras (its LoRA adapter slots, until its reports say), role
    /// (both by default, prefill or decode: docs/routing.md, "Prefill and decode"), node (its
    /// node or zone label, for pulls across nodes), bootstrap_port (a prefill worker's SGLang
    /// bootstrap port, or a simulated one's side channel).
    /// Without events, the worker is routed approximately. Repeat for each worker; in the env
    /// twin, separate workers with ';'. In a file: [[workers]] tables of these keys.
    /// Example: --worker id=7,url=http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
    #[arg(long = "worker", env = "KVROUTE_WORKERS", value_delimiter = ';', verbatim_doc_comment)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerSpec>,
    /// Routing policy: kv (predicted time to first token), dynamo (Dynamo's cost), or the
    /// baselines round-robin, random, least-loaded, sticky (kv that keeps sessions on their
    /// worker whatever the margin), kv-adapter-blind (kv without adapter residency) and
    /// lora-affinity (llm-d's adapter scorer) (docs/routing.md).
    #[arg(long)]
    pub policy: Option<PolicyKind>,
    /// Softmax temperature of the choice; 0 always takes the lowest cost.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Weight of prefill against decode blocks in the dynamo policy.
    #[arg(long)]
    pub overlap_weight: Option<f64>,
    /// A weight of the kv policy's cost as NAME=VALUE; repeat or separate with ','. Names and
    /// defaults: docs/routing.md ("The kv cost"), or --print-config. In a file: a [kv_cost]
    /// table. Example: --kv-cost queue_weight=0.5
    #[arg(long, value_delimiter = ',', value_parser = super::kv_weight)]
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "super::weights")]
    pub kv_cost: Vec<(String, f64)>,
    /// A setting of the pair cost of a disaggregated fleet as NAME=VALUE (link bandwidths
    /// within and across nodes, the handoff's overhead, the in-place interference weight,
    /// baseline switches); repeat or separate with ','. Names and defaults: docs/routing.md
    /// ("Prefill and decode"), or --print-config. In a file: a [pd_cost] table. Example:
    /// --pd-cost link_across_nodes_gbps=50
    #[arg(long, value_delimiter = ',', value_parser = super::kv_weight)]
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "super::weights")]
    pub pd_cost: Vec<(String, f64)>,
    /// Index shards, each a tree behind its own lock: more let several event threads write at
    /// once, but every lookup walks every shard. One is the fastest lookup.
    #[arg(long)]
    pub shards: Option<usize>,
    /// A directory where the router keeps its index and where each engine's event stream was,
    /// written every 30 s and at shutdown and read at start: a restarted router asks each
    /// engine's replay for what followed instead of starting empty. None by default.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Most (worker, block) pairs the index keeps, all shards together, before evicting the
    /// coldest (~48 bytes each).
    #[arg(long)]
    pub max_index_blocks: Option<usize>,
    /// Most data-parallel ranks of one worker; events naming a higher rank are refused.
    #[arg(long)]
    pub max_dp_size: Option<u32>,
    /// Seconds a request's blocks are assumed cached on a worker without events
    /// (approximate mode).
    #[arg(long)]
    pub approx_ttl: Option<f64>,
    /// Seconds to wait at start for every worker's event stream and first load report; the
    /// ready line comes after.
    #[arg(long)]
    pub ready_timeout: Option<f64>,
    /// Largest ZMQ message, in bytes, an engine's event, replay or load socket may send
    /// (all its frames, 64 bytes counted per frame); a peer announcing more is refused
    /// before anything is allocated, disconnected and counted
    /// (kvroute_zmq_refused_messages_total). A replay answer may bring 4 times this. The
    /// default is one engine step's batch with a wide margin.
    #[arg(long)]
    pub zmq_max_message_bytes: Option<usize>,
    /// Seconds a session (a request's prompt_cache_key, or its x-session-id header) stays on
    /// the worker of its last request.
    #[arg(long)]
    pub session_ttl: Option<f64>,
    /// Seconds of predicted time to first token by which another worker must beat a session's
    /// worker to take the session.
    #[arg(long)]
    pub session_margin: Option<f64>,
    /// Sessions remembered at most; past it the least recently seen is forgotten.
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// Flow control: a request waits at the router while no worker can take it, highest
    /// priority first and tenants in turn, and a sheddable one is refused (priority from
    /// x-kvroute-priority, tenant from the API key or x-kvroute-tenant, objective from
    /// x-kvroute-ttft-slo-ms; docs/routing.md, "Overload"). Off, every request is placed at
    /// once, however saturated the fleet.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub flow_control: Option<bool>,
    /// Learn each worker's first-token time by least squares, used where it predicts better
    /// than the engine model with one factor per worker (docs/routing.md, "The learned
    /// shape"); --learn-shape=false keeps the model and its factor alone.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = switch())]
    pub learn_shape: Option<bool>,
    /// A worker can take a request without an objective while the engine model predicts its
    /// wait there, before its own prefill, within this many milliseconds.
    #[arg(long)]
    pub max_engine_wait_ms: Option<f64>,
    /// Requests that may wait at the router, per priority; past it, 429.
    #[arg(long)]
    pub max_queued: Option<usize>,
    /// Requests one tenant may have waiting, per priority; past it, 429.
    #[arg(long)]
    pub max_queued_per_tenant: Option<usize>,
    /// Bytes the waiting requests may hold in all; past it, 429.
    #[arg(long)]
    pub max_queued_bytes: Option<usize>,
    /// Longest a request waits at the router, ms (one with an objective: until the objective
    /// has passed); then 503 (429 if sheddable), with Retry-After.
    #[arg(long)]
    pub max_queue_wait_ms: Option<u64>,
    /// Keep sheddable requests (priority below 0) waiting like others when the fleet is
    /// saturated, instead of refusing them at once with 429.
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub queue_sheddable: Option<bool>,
    /// A tenant is over its share when it sent more than this many times the mean of the
    /// tenants sending lately (prompt tokens, half-life 10 s); 0: never. Its requests then
    /// take a worker only within --over-share-wait of the wait limit.
    #[arg(long)]
    pub over_share: Option<f64>,
    /// The share (0-1) of --max-engine-wait-ms within which a request of a tenant over its
    /// share may take a worker; the rest is kept for tenants within theirs.
    #[arg(long)]
    pub over_share_wait: Option<f64>,
}

/// A front door's remote router (`kvroute frontend`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Routing")]
pub struct RemoteRouter {
    /// A `kvroute router` to ask (its /find_best_worker and request lifecycle). Without it, a
    /// router runs embedded, subscribed to the workers' events.
    #[arg(long)]
    pub router_url: Option<String>,
    /// File holding the remote router's admin token (first line), sent with every call to it;
    /// or the token itself in KVROUTE_ROUTER_TOKEN.
    #[arg(long)]
    pub router_token_file: Option<PathBuf>,
}

/// Replicas over NATS with JetStream (docs/replicas.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Replicas (NATS)")]
pub struct Nats {
    /// NATS server URL (nats://host:4222, tls://..., comma-separated for a cluster; the server
    /// runs with JetStream: `nats-server -js -sd DIR`). With it, this replica shares its
    /// routing decisions with the others on the same prefix, and may take its KV events from a
    /// JetStream stream (--nats-events). NATS down is degraded (local state), never fatal.
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Names the fleet: subjects PREFIX.decisions and PREFIX.events.>, the stream
    /// PREFIX_EVENTS, the snapshot bucket PREFIX_snapshots.
    #[arg(long)]
    pub nats_prefix: Option<String>,
    /// This replica's name among its peers.
    #[arg(long)]
    pub nats_replica: Option<String>,
    /// Do not share routing decisions (each replica then prices only its own in-flight
    /// load). In a file: nats_sync = false.
    #[arg(long = "nats-no-sync", num_args = 0, default_missing_value = "true", value_parser = negated())]
    pub nats_sync: Option<bool>,
    /// Where the workers' KV events come from: zmq (each worker's stream, directly), stream
    /// (the JetStream stream another replica relays), or relay (subscribe to the engines and
    /// relay them into the stream, route from the stream, write snapshots).
    #[arg(long)]
    pub nats_events: Option<String>,
    /// Write an index snapshot every this many stream messages, 0 for never.
    #[arg(long)]
    pub nats_snapshot_every: Option<u64>,
    /// Most bytes the event stream keeps.
    #[arg(long)]
    pub nats_stream_max_bytes: Option<i64>,
    /// Seconds the event stream keeps a message. Keep it well above the snapshot interval: a
    /// replica starts from the latest snapshot and needs what follows it.
    #[arg(long)]
    pub nats_stream_max_age: Option<f64>,
    /// File holding the NATS token (first line); or the token itself in KVROUTE_NATS_TOKEN.
    #[arg(long)]
    pub nats_token_file: Option<PathBuf>,
    /// NATS user (with its password in --nats-password-file or KVROUTE_NATS_PASSWORD).
    #[arg(long)]
    pub nats_user: Option<String>,
    /// File holding the NATS user's password (first line).
    #[arg(long)]
    pub nats_password_file: Option<PathBuf>,
    /// CA certificate (PEM) the NATS server's certificate must chain to; implies TLS.
    #[arg(long)]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for a NATS server that verifies clients (with --nats-tls-key).
    #[arg(long, requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(long, requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
}

/// Where the fleet's members come from while kvroute runs, besides `--worker`
/// (docs/membership.md). Workers also join and leave through the admin API (`POST /workers`,
/// `POST /workers/{id}/drain`, `DELETE /workers/{id}`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Membership")]
pub struct Membership {
    /// A DNS name whose addresses are workers, resolved every --discover-every-ms: a
    /// Kubernetes headless Service's (engines.ns.svc.cluster.local: its ready pods), or an SRV
    /// name (_http._tcp.engines.ns.svc.cluster.local: each target's addresses, the record's
    /// port as {port}). Each address becomes a worker by --worker-template.
    #[arg(long)]
    pub discover_dns: Option<String>,
    /// The DNS server --discover-dns asks (IP:PORT); absent: the system's (/etc/resolv.conf).
    #[arg(long)]
    pub dns_server: Option<String>,
    /// Milliseconds between two DNS lookups.
    #[arg(long)]
    pub discover_every_ms: Option<u64>,
    /// A discovered worker: --worker's keys, without id (made from its address), with {host}
    /// for its address and {port} for an SRV record's port, e.g.
    /// url=http://{host}:8000,events=tcp://{host}:5557,metrics=http://{host}:8000/metrics
    #[arg(long)]
    pub worker_template: Option<String>,
    /// A NATS JetStream key-value bucket where workers register themselves (`kvroute
    /// register`, or the engines' own sidecars) on the --nats-url server: every replica
    /// watches it, so all see the same members.
    #[arg(long)]
    pub members_bucket: Option<String>,
    /// Seconds a registration lives without renewal (`kvroute register` renews it every third
    /// of it): a worker whose sidecar stops is drained after this.
    #[arg(long)]
    pub members_ttl_secs: Option<u64>,
    /// The fleet's registration key (a file of at least 16 secret bytes, or KVROUTE_MEMBERS_KEY),
    /// needed with --members-bucket: `kvroute register` signs with it, a router takes only
    /// what it signed (docs/security.md, "The control plane").
    #[arg(long)]
    pub members_key_file: Option<PathBuf>,
    /// Address ranges a registered worker's endpoints must all be in, e.g. 10.0.0.0/8,fd00::/8.
    #[arg(long, value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members_allow: Vec<String>,
    /// Seconds a draining worker's requests may run before it is removed all the same.
    #[arg(long)]
    pub drain_timeout_secs: Option<u64>,
    /// Most workers at once, from every source together: a join past it is refused.
    #[arg(long)]
    pub max_workers: Option<usize>,
    /// A Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) whose
    /// ready pods are the workers, watched through the Kubernetes API with the pod's service
    /// account (get inferencepools; list and watch pods): each by --worker-template, {host} its
    /// address and {port} the pool's target port, its role from llm-d's llm-d.ai/role label.
    #[arg(long)]
    pub kube_pool: Option<String>,
    /// The namespace of --kube-pool; absent: the pod's own (its service account's).
    #[arg(long)]
    pub kube_namespace: Option<String>,
}

impl Membership {
    /// Whether a source of members is named: a fleet may then start with no worker.
    pub fn has_source(&self) -> bool {
        self.discover_dns.is_some() || self.members_bucket.is_some() || self.kube_pool.is_some()
    }

    /// The membership group's defaults: the members' library's.
    pub(super) fn defaults() -> Self {
        use kvroute_router::members;
        Membership {
            discover_every_ms: Some(members::DNS_EVERY.as_millis() as u64),
            members_ttl_secs: Some(members::MEMBERS_TTL.as_secs()),
            drain_timeout_secs: Some(members::DRAIN_TIMEOUT.as_secs()),
            max_workers: Some(kvroute_router::config::DEFAULT_MAX_WORKERS),
            ..Membership::default()
        }
    }
}

/// kvroute's own spans and its decision log (docs/tracing.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Tracing")]
pub struct Tracing {
    /// Export kvroute's spans (the request, preprocess, hash, admit, decide, the engine call,
    /// the self-check) over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317. Off
    /// unless set: then no span is made at all.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Share of new traces sampled, 0 to 1. Parent-based: a request whose caller's
    /// traceparent is sampled is traced, one whose caller's is not is not; the ratio decides
    /// for the others.
    #[arg(long)]
    pub trace_ratio: Option<f64>,
    /// Append a sampled log of routing decisions to this file, JSON lines: the request id,
    /// its blocks, the candidates with their cost terms, the choice. Off unless set.
    #[arg(long)]
    pub decision_log: Option<PathBuf>,
    /// Share of decisions the decision log keeps, 0 to 1 (by a keyed hash of the request's
    /// id, its key drawn at start).
    #[arg(long)]
    pub decision_log_ratio: Option<f64>,
    /// The decision log is rotated past this many bytes (FILE to FILE.1, FILE.1 to FILE.2...).
    #[arg(long)]
    pub decision_log_max_bytes: Option<u64>,
    /// Decision log files kept, the one written included.
    #[arg(long)]
    pub decision_log_files: Option<usize>,
}

/// The model and its images (front door and simulated workers).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Model")]
pub struct Model {
    /// Model directory (tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    pub model_path: Option<PathBuf>,
    /// Fetch image URLs that resolve to loopback or private addresses (refused by default, so
    /// the server is no relay into private networks).
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub allow_private_image_urls: Option<bool>,
}

/// A simulated engine's knobs, the same on `kvroute mocker` and `kvroute serve`
/// (docs/mocker.md); defaults follow Dynamo's mocker.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
#[command(next_help_heading = "Simulated engine (on serve: its simulated workers only)")]
pub struct Engine {
    /// KV cache capacity in blocks.
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Most requests running at once.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one scheduler step (chunked prefill).
    #[arg(long)]
    pub max_batched_tokens: Option<usize>,
    /// Time runs this many times faster than the timing model; 1 is a real GPU's pace.
    #[arg(long)]
    pub speedup: Option<f64>,
    /// Seed of the generated words, the same on every worker.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Longest prompt plus output a worker takes (at most the KV capacity).
    #[arg(long)]
    pub max_model_len: Option<u64>,
    /// A chat template of the engine's own (a Jinja file), as vLLM's --chat-template: chats
    /// are rendered with it instead of the model's, so they tokenize unlike the front door's
    /// (the openai-chat dialect then drifts; vllm-generate, which sends token ids, does not).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// LoRA adapters served, as vLLM's --lora-modules: NAME or NAME=PATH (the path is only
    /// listed in /v1/models); repeat or separate with ','. Example: --lora-modules sql=/loras/sql,chat
    #[arg(long, value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora_modules: Vec<String>,
    /// Distinct LoRA adapters one batch may use (vLLM's --max-loras): the GPU slots.
    #[arg(long)]
    pub max_loras: Option<usize>,
    /// LoRA adapters kept in host memory (vLLM's --max-cpu-loras; at least --max-loras).
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Milliseconds to read an adapter from storage into a slot (docs/mocker.md, "Adapters").
    #[arg(long)]
    pub lora_load_ms: Option<f64>,
    /// Milliseconds to copy an adapter from host memory into a slot.
    #[arg(long)]
    pub lora_swap_ms: Option<f64>,
    /// Milliseconds each distinct adapter in a batch adds to its step.
    #[arg(long)]
    pub lora_step_ms: Option<f64>,
    /// Serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    #[arg(long, num_args = 0, default_missing_value = "true", value_parser = switch())]
    pub lora_updating: Option<bool>,
    /// Blocks of host memory below the GPU cache (vLLM's CPU offloading; Dynamo's mocker's
    /// flag): computed blocks are copied there and loaded back instead of recomputed, and
    /// announced with medium CPU. 0: none (docs/mocker.md, "Host memory").
    #[arg(long)]
    pub num_host_blocks: Option<usize>,
    /// Host-to-device bandwidth (GB/s) of loading a host block.
    #[arg(long)]
    pub host_offload_h2d_bandwidth_gbps: Option<f64>,
    /// Device-to-host bandwidth (GB/s) of storing one (stores take no step time).
    #[arg(long)]
    pub host_offload_d2h_bandwidth_gbps: Option<f64>,
    /// Blocks of storage below host memory (vLLM's tiering: every host block cascaded to
    /// it, announced with medium STORAGE, promoted through host memory on a hit). Needs
    /// --num-host-blocks. 0: none (docs/mocker.md, "Host memory").
    #[arg(long)]
    pub num_storage_blocks: Option<usize>,
    /// Bandwidth (GB/s) of reading a storage block into host memory.
    #[arg(long)]
    pub storage_bandwidth_gbps: Option<f64>,
    /// A KV store the fleet shares (`kvroute mocker --role store`), as an LMCache server or
    /// Mooncake's store: each engine writes the blocks it computes to it and loads from it
    /// the prompt blocks it lacks, announced with locality REMOTE (docs/mocker.md, "Shared
    /// store"). `serve` and `bench` start one of their own with --num-store-blocks instead.
    #[arg(long)]
    pub store_url: Option<String>,
    /// Blocks of the shared store: `kvroute mocker --role store` keeps this many; `serve`
    /// and `bench` start a store of this many for their simulated engines. 0: none.
    #[arg(long)]
    pub num_store_blocks: Option<usize>,
    /// Bandwidth (GB/s) of loading a block from the shared store into the GPU (it also
    /// prices store blocks in the kv cost, as `external_bandwidth_gbps`).
    #[arg(long)]
    pub store_bandwidth_gbps: Option<f64>,
    /// How a load from host memory, storage or the shared store is timed: `async` (beside
    /// the steps, the request waiting for its own load, as vLLM's offloading connector and
    /// Dynamo's mocker) or `sync` (inside the step that admits the request, which the whole
    /// batch waits for) (docs/mocker.md, "Host memory").
    #[arg(long)]
    pub tier_loads: Option<kvroute_mocker::TierLoads>,
    /// Which waiting request the simulated engine runs first: fcfs (arrival order, vLLM's
    /// default) or priority (a request's priority, lower first, then arrival; the least
    /// urgent running request is preempted first), as vLLM's --scheduling-policy.
    #[arg(long)]
    pub scheduling_policy: Option<kvroute_mocker::SchedulingPolicy>,
    /// KV bytes per token, the size of a block's load (2 x layers x KV heads x head size x
    /// bytes per value).
    #[arg(long)]
    pub kv_bytes_per_token: Option<f64>,
    /// Bandwidth (GB/s) of the link a decode engine pulls a prefill engine's KV over
    /// (Dynamo's mocker's flag; docs/mocker.md, "Prefill and decode").
    #[arg(long)]
    pub kv_transfer_bandwidth: Option<f64>,
    /// Bandwidth (GB/s) of the link between engines of different nodes (default: the same
    /// as --kv-transfer-bandwidth, which is then the link within a node).
    #[arg(long)]
    pub kv_transfer_bandwidth_across_nodes: Option<f64>,
    /// The simulated engine's node (or zone) label: a decode engine pulls from a prefill
    /// engine of another node over the across-nodes link. Give the router the same label
    /// (--worker node=...). `serve` labels its own with --simulated-nodes.
    #[arg(long)]
    pub node: Option<String>,
    /// What a decode engine's pull moves: `destination-missing` (the blocks it lacks, as
    /// vLLM's connector pulls) or `full-prompt` (Dynamo's mocker's default).
    #[arg(long)]
    pub kv_transfer_timing: Option<kvroute_mocker::TransferTiming>,
    /// Seconds a prefill engine holds a finished prefill's blocks for its decode engine
    /// before freeing them (vLLM's kv_lease_duration).
    #[arg(long)]
    pub kv_hold_timeout: Option<f64>,
    /// What a decode engine does when its pull fails: `fail` (a 500, vLLM 0.33's default
    /// kv_load_failure_policy and SGLang's only behaviour) or `recompute` (it prefills the
    /// prompt itself; vLLM's protocol only).
    #[arg(long)]
    pub kv_load_failure_policy: Option<kvroute_mocker::LoadFailurePolicy>,
}

//! kvroute's OpenAI-compatible front door, as stages, each in its own module:
//!
//! ```text
//!  client ─▶ auth + limits (kvroute_http: listener bounds, `auth::require`)
//!         ─▶ parse + check (handlers::parse: typed fields, sizes as the engine checks them)
//!         ─▶ preprocess (kvroute_preprocess: images fetched/decoded, chat template, tokens)
//!         ─▶ Outbound (dispatch.rs: block hashes with images and namespace, the body to send)
//!         ─▶ place (placer.rs: embedded router or a remote one → Placement, in flight from now)
//!         ─▶ dispatch (dispatch.rs: one hop, retries and ejection, the answer streamed back
//!            with its cached tokens read on the way, usage.rs; end or client gone = freed)
//!  the health tick (probes.rs): /health of every worker, parity probes of joining ones
//! ```
//!
//! The request body is passed on as the client sent it (fields kvroute does not read
//! included), but for image parts, which are inlined. A worker that refuses the connection, or
//! sends nothing back within the first-byte timeout, is skipped for another and ejected for a
//! while ([`health`]); one that breaks a stream mid-answer ends it with an SSE error event in
//! OpenAI's shape. A refused connection means the engine process is gone, and its cache with
//! it: the embedded router forgets its blocks. The journey, file by file, is in
//! `docs/architecture.md`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use kvroute_core::{BlockSize, WorkerId, WorkerWithDpRank};
use kvroute_http::auth::KeyId;
use kvroute_http::metrics::{Counter, Gauge, Registry};
use kvroute_http::models::Catalog;
use kvroute_http::{Credentials, HttpClient};
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::Fetcher;
use kvroute_router::{Dialect, RouterState, WorkerSpec};

mod dialect;
mod dispatch;
mod fleet_seam;
mod handlers;
pub mod health;
mod hop;
mod models;
pub mod native;
mod pair;
pub mod parity;
pub mod pick;
mod placer;
mod probes;
pub mod transfer;
mod translate;
mod usage;
pub use placer::{Placement, Placer, RemoteRouter};
pub use transfer::TRANSFER_FIELDS;

use health::{Failure, Health};

/// Longest wait between two tries of a parity probe that could not be made.
pub const PROBE_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Largest request body accepted: room for inline images (20 MB each once decoded, a third
/// more as base64).
pub const BODY_LIMIT: usize = 64 << 20;

/// Header naming the worker a response came from.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// The header that names a request's priority for flow control (higher first; below 0 it
/// is sheddable).
pub const PRIORITY_HEADER: &str = "x-kvroute-priority";
/// The header that names a request's tenant, when no API key does.
pub const TENANT_HEADER: &str = "x-kvroute-tenant";
/// The header that names a request's time-to-first-token objective, ms.
pub const SLO_HEADER: &str = "x-kvroute-ttft-slo-ms";

/// Header naming the worker that prefilled a response's prompt, when another one decoded it
/// (its cached tokens then count the KV pulled from there).
pub const PREFILL_WORKER_HEADER: &str = "x-kvroute-prefill-worker";

/// Header with the prompt tokens the router expected the chosen worker to serve from its cache
/// (its leading blocks held by the worker's KV events, in tokens, less the last block of a
/// fully cached prompt, which engines recompute): compare with the response's
/// `usage.prompt_tokens_details.cached_tokens` to see how exact the router's view is. Sent
/// only when asked for ([`FrontDoorOptions::expose_overlap`]): it tells a client how much of its
/// prompt someone sent before, so clients could probe each other's prompts with it.
pub const OVERLAP_HEADER: &str = "x-kvroute-overlap-tokens";

/// Beside [`OVERLAP_HEADER`]: of those tokens, the ones expected from host memory, disk and
/// the shared store, comma-separated (`0,0,0` when all come from the GPU).
pub const OVERLAP_TIER_HEADER: &str = "x-kvroute-overlap-tier-tokens";

pub const PROXIED: &str = "kvroute_frontend_proxied";
pub const RETRIES: &str = "kvroute_frontend_retries";
pub const IN_FLIGHT: &str = "kvroute_frontend_in_flight";
pub const EJECTIONS: &str = "kvroute_frontend_worker_ejections";
pub const EJECTED: &str = "kvroute_frontend_workers_ejected";
pub const BROKEN_STREAMS: &str = "kvroute_frontend_broken_streams";
pub const AS_TOKENS: &str = "kvroute_frontend_sent_as_tokens";
pub const DIALECT_FALLBACKS: &str = "kvroute_frontend_dialect_fallbacks";

/// How long a worker has to send a streamed answer's first bytes (its headers), and a whole
/// answer that is not streamed.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(15);
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Default)]
struct Metrics {
    registry: Registry,
    proxied: Counter,
    retried: Counter,
    in_flight: Gauge,
    ejections: Counter,
    ejected: Gauge,
    broken: Counter,
    as_tokens: Counter,
    fallbacks: Counter,
    pd_split: Counter,
    pd_in_place: Counter,
    pd_prefill_failed: Counter,
    pd_handoff_failed: Counter,
    priority_clamped: Counter,
}

impl Metrics {
    fn new() -> Self {
        let m = Self::default();
        let mut r = Registry::default();
        r.register(PROXIED, "Requests proxied to a worker", m.proxied.clone());
        r.register(
            RETRIES,
            "Workers skipped because they refused the connection or did not answer in time",
            m.retried.clone(),
        );
        r.register(IN_FLIGHT, "Requests between routing and their end", m.in_flight.clone());
        r.register(EJECTIONS, "Workers taken out of rotation after a failure", m.ejections.clone());
        r.register(EJECTED, "Workers out of rotation now", m.ejected.clone());
        r.register(BROKEN_STREAMS, "Answers a worker broke off mid-way", m.broken.clone());
        r.register(
            AS_TOKENS,
            "Requests sent as the front door's token ids (a worker's tokens dialect)",
            m.as_tokens.clone(),
        );
        r.register(
            DIALECT_FALLBACKS,
            "Requests sent as chat to a tokens-dialect worker: they asked for what its API does not carry",
            m.fallbacks.clone(),
        );
        r.register(
            "kvroute_frontend_pd_split_requests",
            "Requests prefilled on a prefill worker and decoded on another",
            m.pd_split.clone(),
        );
        r.register(
            "kvroute_frontend_pd_in_place_requests",
            "Requests of a disaggregated fleet prefilled where they decode (cheaper than any pair)",
            m.pd_in_place.clone(),
        );
        r.register(
            "kvroute_frontend_pd_prefill_failures",
            "Prefill legs whose worker did not answer (the request placed again)",
            m.pd_prefill_failed.clone(),
        );
        r.register(
            "kvroute_frontend_pd_handoff_failures",
            "Split requests whose decode worker could not take the prefill's KV (placed again \
             without that prefill worker)",
            m.pd_handoff_failed.clone(),
        );
        r.register(
            "kvroute_frontend_priority_clamped",
            "Requests that named a priority above their API key's ceiling (lowered to it)",
            m.priority_clamped.clone(),
        );
        Self { registry: r, ..m }
    }
}

/// The front door's own settings (its model, router, workers and keys are given apart): a
/// new front-door setting is a field here, its flag and its settings key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FrontDoorOptions {
    /// Answers carry [`OVERLAP_HEADER`] (off by default: it tells a client what others sent).
    pub expose_overlap: bool,
    /// How long a worker has to start a streamed answer.
    pub first_byte_timeout: Duration,
    /// Each API key its own cache namespace: requests reuse cached prefixes only of requests
    /// with the same key, so one client cannot learn from `cached_tokens` (or timing) what
    /// another sent. The namespace goes to the engine as vLLM's `cache_salt` (a client's own
    /// salt is kept inside the key's) and into the router's block hashes.
    pub namespace_per_key: bool,
    /// Probe each joining worker's parity ([`parity`]).
    pub parity_probe: bool,
    /// Load a request's adapter on the chosen worker through vLLM's dynamic API when the
    /// worker does not list it ([`crate::models`]); off: only workers that list it are chosen.
    pub load_adapters: bool,
    /// Pass a client's own KV-transfer fields ([`TRANSFER_FIELDS`]) on; off: refused (400).
    pub trust_transfer_fields: bool,
    /// Tell the engines each request's priority in their own field (they schedule by it).
    pub engine_priority: bool,
    /// How often the status page's history samples the counters
    /// ([`kvroute_http::status::History`]).
    pub status_every: Duration,
}

/// [`FrontendState::session_key`]: `per_key` is whether namespacing per key is on.
fn namespaced_session(
    per_key: bool,
    key: Option<&KeyId>,
    session: Option<String>,
) -> Option<String> {
    let session = session?;
    match (per_key, key) {
        (true, Some(KeyId { id: key, .. })) => {
            let mut h = blake3::Hasher::new();
            h.update(key.as_bytes()).update(b"\0").update(session.as_bytes());
            Some(format!("key-{}", &h.finalize().to_hex()[..32]))
        }
        _ => Some(session),
    }
}

impl Default for FrontDoorOptions {
    fn default() -> Self {
        Self {
            expose_overlap: false,
            first_byte_timeout: FIRST_BYTE_TIMEOUT,
            namespace_per_key: false,
            parity_probe: true,
            load_adapters: false,
            trust_transfer_fields: false,
            engine_priority: false,
            status_every: kvroute_http::status::SAMPLE_EVERY,
        }
    }
}

const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often each worker's `/health` is checked.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

pub struct FrontendState {
    pub preprocessor: Arc<Preprocessor>,
    pub fetcher: Fetcher,
    pub placer: Placer,
    block_size: BlockSize,
    urls: BTreeMap<WorkerId, String>,
    /// The workers configured with KV events (a restarted one is parity-probed again).
    evented: std::collections::BTreeSet<WorkerId>,
    /// How each worker is spoken to (absent: the client's OpenAI body).
    dialects: BTreeMap<WorkerId, Dialect>,
    /// Each worker's data-parallel ranks (all are excluded when it is ejected).
    ranks: BTreeMap<WorkerId, u32>,
    pub health: Health,
    /// What the settings chose ([`FrontendState::with_options`]).
    options: FrontDoorOptions,
    client: HttpClient,
    next_id: AtomicU64,
    metrics: Metrics,
    api_keys: Credentials,
    admin: Credentials,
    /// Workers still to be parity-probed (all at start; a restarted one again).
    to_probe: std::sync::Mutex<std::collections::BTreeSet<WorkerId>>,
    /// Probes that could not be made: when each is tried next, and its backoff.
    probe_retries: std::sync::Mutex<std::collections::BTreeMap<WorkerId, (Instant, Duration)>>,
    probed: tokio::sync::Notify,
    /// Prompt plus output tokens at most (checked before routing, as vLLM checks it).
    max_model_len: u64,
    /// The base model and the adapters the fleet serves ([`crate::models`]).
    pub models: Catalog,
    /// The adapters the settings name (always served), with where their weights are.
    configured_adapters: Vec<(String, Option<String>)>,
    /// What each worker listed in its `/v1/models`, when last read.
    listed: std::sync::Mutex<BTreeMap<WorkerId, std::collections::BTreeSet<String>>>,
    /// Each SGLang prefill worker's bootstrap host and port.
    bootstraps: BTreeMap<WorkerId, (String, u16)>,
    /// Some worker is a prefill worker (`--worker role=prefill`): with a remote router,
    /// requests are placed in pairs.
    prefill_workers: bool,
    /// Mixed into SGLang bootstrap rooms, so two front doors draw different ones.
    room_salt: u64,
    /// What the status page's chart draws ([`FrontendState::spawn_history`]).
    history: Arc<kvroute_http::status::History>,
    /// Metrics of a service beside the front door (the ext_proc picker), on its `/metrics`.
    beside: std::sync::OnceLock<Arc<Registry>>,
    /// The priority of each model's requests that name none (by the model's name as the
    /// catalog resolves it: an adapter's, or the base model's), as GIE's `InferenceObjective`.
    model_priorities: BTreeMap<String, i32>,
}

impl std::fmt::Debug for FrontendState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontendState").field("urls", &self.urls).finish_non_exhaustive()
    }
}

fn urls(workers: &[WorkerSpec]) -> BTreeMap<WorkerId, String> {
    workers
        .iter()
        .filter_map(|w| w.url.as_ref().map(|u| (w.id, u.trim_end_matches('/').to_owned())))
        .collect()
}

/// Each prefill worker's bootstrap host (its URL's) and port, when it has one.
fn bootstraps(workers: &[WorkerSpec]) -> BTreeMap<WorkerId, (String, u16)> {
    workers
        .iter()
        .filter_map(|w| {
            let url: hyper::Uri = w.url.as_deref()?.parse().ok()?;
            let host = url.host()?.trim_start_matches('[').trim_end_matches(']').to_owned();
            Some((w.id, (host, w.bootstrap_port?)))
        })
        .collect()
}

fn ranks(workers: &[WorkerSpec]) -> BTreeMap<WorkerId, u32> {
    workers.iter().map(|w| (w.id, w.dp_size)).collect()
}

impl FrontendState {
    /// A front door over the embedded `router`, proxying to its workers that have a URL.
    pub fn new(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        router: Arc<RouterState>,
    ) -> Self {
        let (block_size, workers) = (router.config.block_size, router.config.workers.clone());
        Self::with(preprocessor, fetcher, Placer::Embedded(router), block_size, &workers)
    }

    /// A front door asking the `kvroute router` at `router_url`, proxying to `workers`.
    pub fn remote(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        router_url: &str,
        router_token: Option<&str>,
        workers: &[WorkerSpec],
        block_size: BlockSize,
    ) -> Self {
        let placer = Placer::Remote(RemoteRouter::new(router_url, router_token));
        Self::with(preprocessor, fetcher, placer, block_size, workers)
    }

    fn with(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        placer: Placer,
        block_size: BlockSize,
        workers: &[WorkerSpec],
    ) -> Self {
        let max_model_len =
            preprocessor.max_model_len().unwrap_or(kvroute_http::openai::DEFAULT_MAX_MODEL_LEN);
        Self {
            fetcher,
            placer,
            block_size,
            urls: urls(workers),
            evented: workers.iter().filter(|w| w.events.is_some()).map(|w| w.id).collect(),
            dialects: workers.iter().map(|w| (w.id, w.dialect)).collect(),
            ranks: ranks(workers),
            health: Health::new(workers.iter().filter(|w| w.url.is_some()).map(|w| w.id)),
            options: FrontDoorOptions::default(),
            client: kvroute_router::workers_client(workers),
            next_id: AtomicU64::new(0),
            metrics: Metrics::new(),
            api_keys: Credentials::default(),
            admin: Credentials::default(),
            probe_retries: std::sync::Mutex::default(),
            to_probe: std::sync::Mutex::new(
                workers
                    .iter()
                    .filter(|w| w.url.is_some() && w.events.is_some())
                    .map(|w| w.id)
                    .collect(),
            ),
            probed: tokio::sync::Notify::new(),
            max_model_len,
            models: Catalog::new(preprocessor.model_name(), Some(max_model_len)),
            configured_adapters: Vec::new(),
            listed: std::sync::Mutex::default(),
            bootstraps: bootstraps(workers),
            prefill_workers: workers
                .iter()
                .any(|w| w.role == kvroute_core::schedule::Role::Prefill),
            room_salt: std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                0u8,
            ),
            history: Arc::default(),
            beside: std::sync::OnceLock::new(),
            model_priorities: BTreeMap::new(),
            preprocessor,
        }
    }

    /// Serves these LoRA adapters over the base model (besides those the workers list).
    /// `NAME` or `NAME=PATH` each (the path is what `load_adapters` sends vLLM).
    pub fn with_adapters<'a>(
        mut self,
        adapters: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, kvroute_http::models::AdapterError> {
        for spec in adapters {
            let (name, path) = match spec.split_once('=') {
                Some((name, path)) => (name.trim(), Some(path.trim().to_owned())),
                None => (spec.trim(), None),
            };
            self.models.insert(name, path.as_deref())?;
            self.configured_adapters.push((name.to_owned(), path));
        }
        Ok(self)
    }

    /// The longest prompt plus output accepted (default: the model's context length, else
    /// [`kvroute_http::openai::DEFAULT_MAX_MODEL_LEN`]).
    #[must_use]
    pub fn max_model_len(mut self, max_model_len: u64) -> Self {
        self.max_model_len = max_model_len;
        let adapters = self.models.adapters();
        self.models = Catalog::new(self.preprocessor.model_name(), Some(max_model_len));
        for name in adapters {
            let _ = self.models.insert(&name, None);
        }
        self
    }

    /// The OpenAI routes need one of `api_keys`, `/metrics` the `admin` token (each open when
    /// empty); `/health` is always open.
    #[must_use]
    pub fn guarded(mut self, api_keys: Credentials, admin: Credentials) -> Self {
        self.api_keys = api_keys;
        self.admin = admin;
        self
    }

    /// The cache namespace of a request: the client's `cache_salt`, inside its key's when
    /// namespaces are per key (`key-<id>:<salt>`: vLLM 0.33 refuses `/` and `@` in a salt).
    fn namespace(&self, key: Option<&KeyId>, client: Option<&str>) -> Option<String> {
        let client = client.filter(|c| !c.is_empty());
        match (self.options.namespace_per_key, key) {
            (true, Some(KeyId { id: key, .. })) => Some(match client {
                Some(c) => format!("key-{key}:{c}"),
                None => format!("key-{key}"),
            }),
            _ => client.map(str::to_owned),
        }
    }

    /// A request's session as the router keys it: with namespacing per key, inside the key's
    /// namespace (the key's id and the client's session, hashed to a fixed length), so that
    /// another key's requests naming the same session do not join it.
    pub(crate) fn session_key(
        &self,
        key: Option<&KeyId>,
        session: Option<String>,
    ) -> Option<String> {
        namespaced_session(self.options.namespace_per_key, key, session)
    }

    /// How a worker is spoken to.
    pub(crate) fn dialect(&self, worker: WorkerId) -> Dialect {
        self.dialects.get(&worker).copied().unwrap_or_default()
    }

    /// A prefill worker's SGLang bootstrap host and port.
    pub(crate) fn bootstrap(&self, worker: WorkerId) -> Option<(String, u16)> {
        self.bootstraps.get(&worker).cloned()
    }

    /// The tokens dialects some worker speaks (a request is made a body in each).
    fn tokens_dialects(&self) -> Vec<Dialect> {
        let mut dialects: Vec<Dialect> =
            self.dialects.values().copied().filter(|d| d.sends_tokens()).collect();
        dialects.sort_unstable_by_key(|d| *d as u8);
        dialects.dedup();
        dialects
    }

    /// Every rank of `worker`.
    fn all_ranks(&self, worker: WorkerId) -> impl Iterator<Item = WorkerWithDpRank> + use<> {
        let n = self.ranks.get(&worker).copied().unwrap_or(1);
        (0..n).map(move |r| WorkerWithDpRank::new(worker, r))
    }

    /// A worker failed a request: out of rotation for a while; a refused connection also
    /// means its cache is gone.
    fn worker_failed(&self, worker: WorkerId, why: Failure) {
        let was_ejected = self.health.is_ejected(worker);
        let backoff = self.health.failed(worker, why, Instant::now());
        if was_ejected {
            tracing::debug!(%worker, ?why, backoff_secs = backoff.as_secs_f64(), "still failing");
        } else {
            self.metrics.ejections.inc();
            tracing::warn!(%worker, ?why, backoff_secs = backoff.as_secs_f64(), "worker ejected");
        }
        if why == Failure::Connect {
            self.placer.forget_blocks(worker);
            self.forget_models(worker);
            // Whatever comes back on its port is probed again.
            let probed = self.evented.contains(&worker);
            if let (true, Ok(mut to_probe)) = (probed, self.to_probe.lock()) {
                to_probe.insert(worker);
            }
        }
    }

    /// Every one of `options`.
    #[must_use]
    pub fn with_options(mut self, options: FrontDoorOptions) -> Self {
        self.options = options;
        self
    }

    /// Each model's priority for its requests that name none (`--model-priority`).
    #[must_use]
    pub fn with_model_priorities(mut self, priorities: BTreeMap<String, i32>) -> Self {
        self.model_priorities = priorities;
        self
    }

    /// The configured priority of a request's model: its adapter's, else the base model's.
    pub(crate) fn model_priority(&self, adapter: Option<&str>) -> Option<i32> {
        let name = adapter.unwrap_or_else(|| self.preprocessor.model_name());
        self.model_priorities.get(name).copied()
    }

    /// Samples the counters the status page draws every `status_every` until the front door
    /// is dropped: the router's (embedded; a remote router's page has its own history).
    pub fn spawn_history(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        self.history.spawn(self.options.status_every, move || {
            let state = weak.upgrade()?;
            Some(match state.placer.registry() {
                Some(r) => kvroute_http::status::Counters::read(&[&state.metrics.registry, r]),
                None => kvroute_http::status::Counters::read(&[&state.metrics.registry]),
            })
        })
    }

    /// Serves `registry` on `/metrics` beside the front door's and the router's (once).
    pub fn serve_metrics_beside(&self, registry: Arc<Registry>) {
        let _ = self.beside.set(registry);
    }

    /// Requests routed and not yet ended.
    pub fn in_flight(&self) -> i64 {
        self.metrics.in_flight.get()
    }
}

/// Serves [`app`] on `listener` until `shutdown` resolves, then waits for open responses (bound
/// that wait outside).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<FrontendState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    kvroute_http::serve(listener, app(state), shutdown).await
}

pub fn app(state: Arc<FrontendState>) -> Router {
    use kvroute_http::auth::require;
    let openai = Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models));
    let routes = require(openai, state.api_keys.clone())
        .merge(kvroute_http::auth::admin(
            Router::new()
                .route("/metrics", get(handlers::metrics))
                .route("/workers", get(handlers::workers))
                .route("/ui/history", get(handlers::history)),
            state.admin.clone(),
            &state.api_keys,
        ))
        .route("/health", get(handlers::health))
        .route("/ui", get(kvroute_http::status_page))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    kvroute_http::fallbacks(routes).with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// #51 finding 12: with namespacing per key, two keys naming the same session are two
    /// sessions (and one key's is stable); without it, or without a key, the session is the
    /// client's.
    #[test]
    fn sessions_are_namespaced_per_key() {
        let (a, b) = (KeyId::named("aaaa"), KeyId::named("bbbb"));
        let s = || Some("s1".to_owned());
        let of_a = namespaced_session(true, Some(&a), s());
        assert_ne!(of_a, namespaced_session(true, Some(&b), s()));
        assert_eq!(of_a, namespaced_session(true, Some(&a), s()));
        assert_ne!(of_a, s());
        assert!(of_a.unwrap().len() <= kvroute_http::router_api::MAX_SESSION_KEY);
        assert_eq!(namespaced_session(false, Some(&a), s()), s());
        assert_eq!(namespaced_session(true, None, s()), s());
        assert_eq!(namespaced_session(true, Some(&a), None), None);
    }
}

//! kvroute's OpenAI-compatible front door.
//!
//! ```text
//!  client ──POST /v1/chat/completions──▶ parse ─▶ images: fetch/decode, identifier ─▶ chat
//!  template + tokenizer (kvroute-preprocess, as the engines) ─▶ block hashes (with images) ─▶
//!  Placer: embedded router or remote one (in flight from now) ─▶ proxy to the worker (images
//!  inline as data: URLs, `uuid` = identifier) ─▶ stream back; first bytes = prefill done;
//!  end, error or client gone = request freed
//! ```
//!
//! The request body is passed on as the client sent it (fields kvroute does not read
//! included), but for image parts, which are inlined. A worker that refuses the connection, or
//! sends nothing back within the first-byte timeout, is skipped for another and ejected for a
//! while ([`health`]); one that breaks a stream mid-answer ends it with an SSE error event in
//! OpenAI's shape. A refused connection means the engine process is gone, and its cache with
//! it: the embedded router forgets its blocks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, State};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use futures_util::StreamExt;
use http_body_util::Full;
use kvroute_core::{BlockHasher, BlockSize, WorkerId, WorkerWithDpRank};
use kvroute_http::auth::KeyId;
use kvroute_http::metrics::{Counter, Gauge, Registry};
use kvroute_http::openai::{ChatCompletionRequest, CompletionRequest, ModelList};
use kvroute_http::router_api::Answered;
use kvroute_http::{ApiError, ClientError, Credentials, HttpClient};
use kvroute_preprocess::fetch::{Fetcher, LoadedImage};
use kvroute_preprocess::{Prepared, Preprocessor};
use kvroute_router::{RouterState, WorkerSpec};
use serde_json::{Value, json};

pub mod health;
pub mod parity;
mod placer;
pub use placer::{Placed, Placer, RemoteRouter};

use health::{Failure, Health};

/// Longest wait between two tries of a parity probe that could not be made.
pub const PROBE_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Largest request body accepted: room for inline images (20 MB each once decoded, a third
/// more as base64).
pub const BODY_LIMIT: usize = 64 << 20;

/// Header naming the worker a response came from.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// Header with the prompt tokens the router expected the chosen worker to serve from its cache
/// (its leading blocks held by the worker's KV events, in tokens, less the last block of a
/// fully cached prompt, which engines recompute): compare with the response's
/// `usage.prompt_tokens_details.cached_tokens` to see how exact the router's view is. Sent
/// only when asked for ([`FrontendState::expose_overlap`]): it tells a client how much of its
/// prompt someone sent before, so clients could probe each other's prompts with it.
pub const OVERLAP_HEADER: &str = "x-kvroute-overlap-tokens";

pub const PROXIED: &str = "kvroute_frontend_proxied";
pub const RETRIES: &str = "kvroute_frontend_retries";
pub const IN_FLIGHT: &str = "kvroute_frontend_in_flight";
pub const EJECTIONS: &str = "kvroute_frontend_worker_ejections";
pub const EJECTED: &str = "kvroute_frontend_workers_ejected";
pub const BROKEN_STREAMS: &str = "kvroute_frontend_broken_streams";

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
        Self { registry: r, ..m }
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
    /// Each worker's data-parallel ranks (all are excluded when it is ejected).
    ranks: BTreeMap<WorkerId, u32>,
    pub health: Health,
    first_byte_timeout: Duration,
    client: HttpClient,
    next_id: AtomicU64,
    metrics: Metrics,
    api_keys: Credentials,
    admin: Credentials,
    expose_overlap: bool,
    /// Each API key gets its own cache namespace.
    namespace_per_key: bool,
    /// Workers still to be parity-probed (all at start; a restarted one again).
    to_probe: std::sync::Mutex<std::collections::BTreeSet<WorkerId>>,
    /// Probes that could not be made: when each is tried next, and its backoff.
    probe_retries: std::sync::Mutex<std::collections::BTreeMap<WorkerId, (Instant, Duration)>>,
    parity_probe: bool,
    probed: tokio::sync::Notify,
    /// Prompt plus output tokens at most (checked before routing, as vLLM checks it).
    max_model_len: u64,
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
        Self {
            fetcher,
            placer,
            block_size,
            urls: urls(workers),
            ranks: ranks(workers),
            health: Health::new(workers.iter().filter(|w| w.url.is_some()).map(|w| w.id)),
            first_byte_timeout: FIRST_BYTE_TIMEOUT,
            client: kvroute_router::workers_client(workers),
            next_id: AtomicU64::new(0),
            metrics: Metrics::new(),
            api_keys: Credentials::default(),
            admin: Credentials::default(),
            expose_overlap: false,
            namespace_per_key: false,
            probe_retries: std::sync::Mutex::default(),
            to_probe: std::sync::Mutex::new(
                workers
                    .iter()
                    .filter(|w| w.url.is_some() && w.events.is_some())
                    .map(|w| w.id)
                    .collect(),
            ),
            parity_probe: true,
            probed: tokio::sync::Notify::new(),
            max_model_len: preprocessor
                .max_model_len()
                .unwrap_or(kvroute_http::openai::DEFAULT_MAX_MODEL_LEN),
            preprocessor,
        }
    }

    /// The longest prompt plus output accepted (default: the model's context length, else
    /// [`kvroute_http::openai::DEFAULT_MAX_MODEL_LEN`]).
    #[must_use]
    pub fn max_model_len(mut self, max_model_len: u64) -> Self {
        self.max_model_len = max_model_len;
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

    /// Whether workers get the parity probe when they join ([`parity`]; on by default).
    #[must_use]
    pub fn parity_probe(mut self, on: bool) -> Self {
        self.parity_probe = on;
        self
    }

    fn probes_left(&self) -> Vec<WorkerId> {
        match self.parity_probe {
            true => self.to_probe.lock().map(|s| s.iter().copied().collect()).unwrap_or_default(),
            false => Vec::new(),
        }
    }

    /// Waits until every reachable worker had its parity probe, or `timeout`; the workers
    /// left (an unreachable one is probed when it answers; the health checks report it).
    pub async fn parity_done(&self, timeout: Duration) -> Vec<WorkerId> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.probed.notified();
            let mut left = self.probes_left();
            left.retain(|w| !self.health.is_ejected(*w));
            if left.is_empty() || tokio::time::Instant::now() >= deadline {
                return left;
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// Gives each API key its own cache namespace: requests reuse cached prefixes only of
    /// requests with the same key, so one client cannot learn from `cached_tokens` (or timing)
    /// what another sent. The namespace goes to the engine as vLLM's `cache_salt` (a client's
    /// own salt is kept inside the key's) and into the router's block hashes.
    #[must_use]
    pub fn namespace_per_key(mut self, on: bool) -> Self {
        self.namespace_per_key = on;
        self
    }

    /// The cache namespace of a request: the client's `cache_salt`, inside its key's when
    /// namespaces are per key.
    fn namespace(&self, key: Option<&KeyId>, client: Option<&str>) -> Option<String> {
        let client = client.filter(|c| !c.is_empty());
        match (self.namespace_per_key, key) {
            (true, Some(KeyId(key))) => Some(match client {
                Some(c) => format!("key-{key}/{c}"),
                None => format!("key-{key}"),
            }),
            _ => client.map(str::to_owned),
        }
    }

    /// How long a worker has to start a streamed answer ([`FIRST_BYTE_TIMEOUT`]).
    #[must_use]
    pub fn first_byte_timeout(mut self, timeout: Duration) -> Self {
        self.first_byte_timeout = timeout;
        self
    }

    /// Every rank of `worker`.
    fn all_ranks(&self, worker: WorkerId) -> impl Iterator<Item = WorkerWithDpRank> + use<> {
        let n = self.ranks.get(&worker).copied().unwrap_or(1);
        (0..n).map(move |r| WorkerWithDpRank::new(worker, r))
    }

    /// Whether `worker`'s parity probe may be tried at `now` (not backing off). Probes run on
    /// the health tick, and a backoff is counted from the end of the last round of probes: a
    /// deadline less than half a tick away counts as reached, or a 1 s backoff would wait for
    /// the tick after next (2 s; serve's readiness waited that long on a startup race).
    fn probe_due(&self, worker: WorkerId, now: Instant) -> bool {
        let now = now + HEALTH_INTERVAL / 2;
        self.probe_retries.lock().map_or(true, |r| r.get(&worker).is_none_or(|(at, _)| now >= *at))
    }

    /// A probe could not be made: tried again after a backoff that doubles from 1 s to
    /// [`PROBE_BACKOFF_MAX`], its cause in `/workers` (unless the worker failed a probe
    /// before: that cause stands) and logged when it first happens.
    fn probe_later(&self, worker: WorkerId, why: &parity::Retry) {
        let Ok(mut retries) = self.probe_retries.lock() else { return };
        let backoff = match retries.get(&worker) {
            Some((_, b)) => (*b * 2).min(PROBE_BACKOFF_MAX),
            None => {
                tracing::info!(%worker, cause = %why, "parity probe not made yet; trying again with a backoff");
                Duration::from_secs(1)
            }
        };
        retries.insert(worker, (Instant::now() + backoff, backoff));
        tracing::debug!(%worker, cause = %why, backoff_secs = backoff.as_secs(), "parity probe deferred");
        if let Some(router) = self.placer.router()
            && !router.parity_failed(worker)
        {
            let cause = format!("{why}; next try in {} s", backoff.as_secs());
            router.set_parity(worker, kvroute_router::Parity::Retrying(cause));
        }
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
        if why == Failure::Connect
            && let Some(router) = self.placer.router()
        {
            router.forget_blocks(worker);
            // Whatever comes back on its port is probed again.
            let probed = router.workers().iter().any(|w| w.id == worker && w.events.is_some());
            if let (true, Ok(mut to_probe)) = (probed, self.to_probe.lock()) {
                to_probe.insert(worker);
            }
        }
    }

    /// Checks every worker's `GET /health` each [`HEALTH_INTERVAL`] until the front door is
    /// dropped: a refused connection means its engine died (ejected, its blocks forgotten,
    /// before a client finds out); an ejected worker that answers once its backoff is over is
    /// back in rotation.
    pub fn spawn_probes(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEALTH_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(state) = weak.upgrade() else { return };
                let checks = state.urls.iter().map(|(&worker, base)| {
                    let state = Arc::clone(&state);
                    let url = format!("{base}/health");
                    async move { (worker, state.probe(&url).await) }
                });
                let results = futures_util::future::join_all(checks).await;
                let due = state.health.due_for_probe(Instant::now());
                for (worker, result) in results {
                    match result {
                        Ok(()) if due.contains(&worker) => {
                            state.health.succeeded(worker);
                            tracing::info!(%worker, "worker answers again: back in rotation");
                        }
                        Ok(()) => {}
                        Err(why) => state.worker_failed(worker, why),
                    }
                }
                let now = Instant::now();
                let probes = state
                    .probes_left()
                    .into_iter()
                    .filter(|w| !state.health.is_ejected(*w) && state.probe_due(*w, now))
                    .map(|worker| {
                        let state = Arc::clone(&state);
                        async move { (worker, parity::probe(&state, worker).await) }
                    });
                for (worker, outcome) in futures_util::future::join_all(probes).await {
                    match outcome {
                        Ok(Some(_)) => {
                            if let Ok(mut to_probe) = state.to_probe.lock() {
                                to_probe.remove(&worker);
                            }
                            state.probe_retries.lock().map(|mut r| r.remove(&worker)).ok();
                            state.probed.notify_waiters();
                        }
                        Ok(None) => {}
                        Err(why) => state.probe_later(worker, &why),
                    }
                }
            }
        })
    }

    /// One health check: `Err(Connect)` when the connection is refused, `Err(Probe)` for no
    /// or a bad answer in time.
    async fn probe(&self, url: &str) -> Result<(), Failure> {
        match tokio::time::timeout(PROBE_TIMEOUT, self.client.get(url)).await {
            Ok(Ok((status, _))) if status.is_success() => Ok(()),
            Ok(Err(e)) if e.is_connect() => Err(Failure::Connect),
            _ => Err(Failure::Probe),
        }
    }

    /// Answers carry [`OVERLAP_HEADER`].
    #[must_use]
    pub fn expose_overlap(mut self, expose: bool) -> Self {
        self.expose_overlap = expose;
        self
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
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models));
    let routes = require(openai, state.api_keys.clone())
        .merge(require(
            Router::new().route("/metrics", get(metrics)).route("/workers", get(workers)),
            state.admin.clone(),
        ))
        .route("/health", get(health))
        .route("/ui", get(kvroute_http::status_page))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    kvroute_http::fallbacks(routes).with_state(state)
}

/// The body decoded as `T` (the fields kvroute reads), checked as an engine checks it
/// ([`kvroute_http::openai::parse_request`]). The whole body as a JSON value, to pass on, is
/// read only once the request has passed its checks ([`raw`]): a body refused for its size is
/// never held twice.
fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    param: &'static str,
) -> Result<(Bytes, T), ApiError> {
    let body = body?;
    let fields = kvroute_http::openai::parse_request(&body, param, None)?;
    Ok((body, fields))
}

/// The body as a JSON value (it decoded as a request already); what no JSON value holds is a
/// 400 naming its field ([`kvroute_http::openai::body_value`]).
fn raw(body: &[u8]) -> Result<Value, ApiError> {
    kvroute_http::openai::body_value(body)
}

async fn chat(
    State(state): State<Arc<FrontendState>>,
    key: Option<Extension<KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, req) = parse::<ChatCompletionRequest>(body, "messages")?;
    let namespace = state.namespace(key.as_ref().map(|k| &k.0), req.cache_salt.as_deref());
    // Images: fetched once here, forwarded inline, named by their identifier.
    let (prepared, images) =
        state.preprocessor.prepare_chat_request(&req, &state.fetcher, state.max_model_len).await?;
    drop(req);
    let mut raw = raw(&body)?;
    drop(body);
    rewrite_image_parts(&mut raw, &images);
    route_and_proxy(&state, "/v1/chat/completions", raw, &prepared, namespace).await
}

/// Each `image_url` part, in order, gets its image inline (a fetched one as a `data:` URL)
/// and its identifier as `uuid`.
fn rewrite_image_parts(raw: &mut Value, images: &[LoadedImage]) {
    let mut next = images.iter();
    let Some(messages) = raw.get_mut("messages").and_then(Value::as_array_mut) else { return };
    let parts = messages
        .iter_mut()
        .filter_map(|m| m.get_mut("content").and_then(Value::as_array_mut))
        .flatten()
        .filter(|p| p.get("type").and_then(Value::as_str) == Some("image_url"));
    for part in parts {
        let Some(loaded) = next.next() else { return };
        let Some(image_url) = part.get_mut("image_url").and_then(Value::as_object_mut) else {
            continue;
        };
        if let Some(bytes) = &loaded.fetched {
            let inline = base64::engine::general_purpose::STANDARD.encode(bytes);
            image_url.insert("url".into(), Value::String(format!("data:image;base64,{inline}")));
        }
        image_url.insert("uuid".into(), Value::String(loaded.image.identifier.clone()));
    }
}

async fn completions(
    State(state): State<Arc<FrontendState>>,
    key: Option<Extension<KeyId>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, req) = parse::<CompletionRequest>(body, "prompt")?;
    let namespace = state.namespace(key.as_ref().map(|k| &k.0), req.cache_salt.as_deref());
    let prepared = state.preprocessor.prepare_completion_request(&req, state.max_model_len)?;
    let raw = raw(&body)?;
    route_and_proxy(&state, "/v1/completions", raw, &prepared, namespace).await
}

/// Frees the request's in-flight accounting when dropped: at the end of the response body,
/// on an error, or when the client goes away.
struct InFlight {
    state: Arc<FrontendState>,
    id: String,
    prefilled: bool,
    /// What the router predicted (worker, cached tokens, prompt tokens) and what the engine
    /// reported it served, compared when the request ends.
    predicted: Option<(WorkerWithDpRank, u64, u64)>,
    served: Option<u64>,
}

impl InFlight {
    fn new(state: &Arc<FrontendState>, id: String) -> Self {
        state.metrics.in_flight.inc();
        Self { state: Arc::clone(state), id, prefilled: false, predicted: None, served: None }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.metrics.in_flight.dec();
        self.state.placer.finish(&self.id);
        if let (Some((worker, predicted, prompt_tokens)), Some(served)) =
            (self.predicted, self.served)
        {
            self.state.placer.answered(Answered {
                worker_id: worker.worker_id,
                dp_rank: worker.dp_rank,
                prompt_tokens,
                predicted_cached_tokens: predicted,
                cached_tokens: served,
            });
        }
    }
}

async fn route_and_proxy(
    state: &Arc<FrontendState>,
    path: &str,
    mut raw: Value,
    prepared: &Prepared,
    namespace: Option<String>,
) -> Result<Response, ApiError> {
    if prepared.tokens.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    let bs = state.block_size;
    let block_infos = (!prepared.mm.mm_objects.is_empty())
        .then(|| prepared.mm.to_block_level(bs, prepared.tokens.len()));
    let local = BlockHasher::new(bs)
        .with_namespace(namespace.as_deref())
        .local_hashes(&prepared.tokens, block_infos.as_deref());
    if let (Some(ns), Some(fields)) = (namespace, raw.as_object_mut()) {
        fields.insert("cache_salt".to_owned(), Value::String(ns));
    }
    // The engine's cached tokens are compared with the router's prediction: a stream is asked
    // for its usage, which a client that did not ask for it does not see.
    let streamed = raw.get("stream").and_then(Value::as_bool) == Some(true);
    let client_usage =
        raw.pointer("/stream_options/include_usage").and_then(Value::as_bool) == Some(true);
    if streamed && !client_usage {
        let options =
            raw.as_object_mut().map(|o| o.entry("stream_options").or_insert_with(|| json!({})));
        if let Some(Value::Object(options)) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        }
    }
    let body = Bytes::from(serde_json::to_vec(&raw).map_err(ApiError::internal)?);
    let timeout = if streamed { state.first_byte_timeout } else { RESPONSE_TIMEOUT };
    let mut excluded: Vec<WorkerWithDpRank> = state
        .health
        .excluded(Instant::now())
        .into_iter()
        .flat_map(|w| state.all_ranks(w))
        .collect();
    loop {
        let id = format!("kvr-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
        let placed = state.placer.place(&local, prepared.tokens.len(), &id, &excluded).await?;
        let Some(Placed { worker, overlap_blocks }) =
            placed.filter(|p| !excluded.contains(&p.worker))
        else {
            return Err(ApiError::unavailable("no worker is available"));
        };
        let guard = InFlight::new(state, id);
        let Some(base) = state.urls.get(&worker.worker_id) else {
            excluded.push(worker);
            continue;
        };
        let request = hyper::Request::post(format!("{base}{path}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
            .map_err(ApiError::internal)?;
        // Until the answer's head arrives nothing has reached the client: another worker may
        // take the request (the first one drops it when we hang up).
        let failure = match tokio::time::timeout(timeout, state.client.send(request)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) if e.is_connect() => Err((Failure::Connect, e)),
            Ok(Err(e)) => Err((Failure::Broken, e)),
            Err(_) => Err((Failure::Timeout, ClientError::Timeout(timeout))),
        };
        let response = match failure {
            Ok(r) => r,
            Err((why, error)) => {
                let error = kvroute_http::error::chain(&error);
                tracing::warn!(%worker, %error, "worker failed; trying another");
                state.worker_failed(worker.worker_id, why);
                state.metrics.retried.inc();
                excluded.extend(state.all_ranks(worker.worker_id));
                continue;
            }
        };
        if state.health.succeeded(worker.worker_id) {
            tracing::info!(%worker, "worker answers again: back in rotation");
        }
        state.metrics.proxied.inc();
        let (parts, incoming) = response.into_parts();
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let overlap_tokens = kvroute_core::schedule::reusable_tokens(
            overlap_blocks,
            prepared.tokens.len(),
            bs.tokens(),
        );
        let mut guard = guard;
        if parts.status.is_success() {
            guard.predicted = Some((worker, overlap_tokens as u64, prepared.tokens.len() as u64));
        }
        let usage = Usage { sse, strip: streamed && !client_usage, ..Usage::default() };
        let stream = proxy_body(incoming, guard, worker.worker_id, usage);
        let mut out = Response::builder().status(parts.status);
        for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
            if let Some(v) = parts.headers.get(&name) {
                out = out.header(name, v.clone());
            }
        }
        out = out.header(WORKER_HEADER, HeaderValue::from(worker.worker_id.0));
        if state.expose_overlap {
            out = out.header(OVERLAP_HEADER, HeaderValue::from(overlap_tokens));
        }
        return out.body(Body::from_stream(stream)).map_err(ApiError::internal);
    }
}

/// The worker's answer, passed on as it arrives: its first bytes mark the prefill done, its
/// end (or the client leaving) frees the request. A worker that breaks off mid-answer is
/// ejected, and an event stream ends with an error event in OpenAI's shape and `[DONE]`
/// rather than a truncated body.
fn proxy_body(
    incoming: hyper::body::Incoming,
    guard: InFlight,
    worker: WorkerId,
    usage: Usage,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let chunks = http_body_util::BodyExt::into_data_stream(incoming);
    let sse = usage.sse;
    chunks.scan((guard, false, usage), move |(guard, done, usage), chunk| {
        if *done {
            return std::future::ready(None);
        }
        if !guard.prefilled {
            guard.prefilled = true;
            guard.state.placer.prefill_done(&guard.id);
        }
        let item = match chunk {
            Ok(bytes) => {
                let (bytes, served) = usage.pass(bytes);
                if served.is_some() {
                    guard.served = served;
                }
                Ok(bytes)
            }
            Err(e) => {
                *done = true;
                guard.state.metrics.broken.inc();
                guard.state.worker_failed(worker, Failure::Broken);
                tracing::warn!(%worker, error = %e, "the worker broke off its answer");
                match sse {
                    true => Ok(Bytes::from(stream_error_event(worker))),
                    false => Err(std::io::Error::other(e)),
                }
            }
        };
        std::future::ready(Some(item))
    })
}

/// Finds the engine's cached tokens in an answer as it passes: in an event stream, the usage
/// chunk (dropped when only the front door asked for it; events are passed on whole, as they
/// complete); in a whole JSON answer, its `usage` (the first [`USAGE_SCAN_LIMIT`] bytes).
#[derive(Debug)]
struct Usage {
    sse: bool,
    strip: bool,
    reader: kvroute_http::SseReader,
    whole: Vec<u8>,
    /// Nesting depth of a whole JSON answer so far (`None`: no longer scanned), and the
    /// string state of the scan.
    depth: Option<u32>,
    in_string: bool,
    escaped: bool,
}

impl Default for Usage {
    fn default() -> Self {
        Self {
            sse: false,
            strip: false,
            reader: kvroute_http::SseReader::default(),
            whole: Vec::new(),
            depth: Some(0),
            in_string: false,
            escaped: false,
        }
    }
}

/// Whole answers longer than this are not scanned for their usage.
const USAGE_SCAN_LIMIT: usize = 1 << 20;

/// An answer's `usage.prompt_tokens_details.cached_tokens` (vLLM reports it only when started
/// with `--enable-prompt-tokens-details`; without it nothing is compared).
fn cached_tokens(v: &Value) -> Option<u64> {
    v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64)
}

impl Usage {
    /// Feeds one byte of a whole JSON answer; true when it closes the top-level value.
    fn scan(&mut self, b: u8) -> bool {
        let Some(depth) = self.depth.as_mut() else { return false };
        if self.in_string {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.in_string = false,
                _ => {}
            }
            return false;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => *depth += 1,
            b'}' | b']' => {
                *depth = depth.saturating_sub(1);
                return *depth == 0;
            }
            _ => {}
        }
        false
    }

    /// The bytes to pass on, and the cached tokens if this chunk completed the usage.
    fn pass(&mut self, bytes: Bytes) -> (Bytes, Option<u64>) {
        if !self.sse {
            if self.whole.len() + bytes.len() > USAGE_SCAN_LIMIT {
                self.whole = Vec::new();
                self.depth = None; // too long to scan: not compared
                return (bytes, None);
            }
            self.whole.extend_from_slice(&bytes);
            // Parsed once, when the top-level object closes (a running count of brackets
            // outside strings), not at every chunk.
            let complete = self.depth.is_some_and(|_| bytes.iter().any(|&b| self.scan(b)));
            let served = complete
                .then(|| serde_json::from_slice::<Value>(&self.whole).ok())
                .flatten()
                .and_then(|v| cached_tokens(&v));
            return (bytes, served);
        }
        let mut out = Vec::with_capacity(bytes.len());
        let mut served = None;
        for event in self.reader.push(&bytes) {
            match event {
                kvroute_http::SseEvent::Done => out.extend_from_slice(b"data: [DONE]\n\n"),
                kvroute_http::SseEvent::Data(data) => {
                    let parsed = serde_json::from_str::<Value>(&data).ok();
                    let found = parsed.as_ref().and_then(cached_tokens);
                    if found.is_some() {
                        served = found;
                    }
                    let usage_only = parsed.as_ref().is_some_and(|v| {
                        v.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty)
                    });
                    if self.strip && found.is_some() {
                        if usage_only {
                            continue;
                        }
                        if let Some(mut v) = parsed {
                            if let Some(o) = v.as_object_mut() {
                                o.remove("usage");
                            }
                            out.extend_from_slice(format!("data: {v}\n\n").as_bytes());
                            continue;
                        }
                    }
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(data.as_bytes());
                    out.extend_from_slice(b"\n\n");
                }
            }
        }
        (Bytes::from(out), served)
    }
}

/// An error event ending a broken stream (the shape vLLM sends mid-stream), then `[DONE]`.
fn stream_error_event(worker: WorkerId) -> String {
    let error = ApiError::new(
        axum::http::StatusCode::BAD_GATEWAY,
        format!("worker {worker} failed mid-answer; the answer is incomplete"),
    );
    let body = serde_json::to_string(&error.body()).unwrap_or_default();
    format!("data: {body}\n\ndata: [DONE]\n\n")
}

async fn models(State(state): State<Arc<FrontendState>>) -> Json<ModelList> {
    Json(ModelList::one(state.preprocessor.model_name(), Some(state.max_model_len)))
}

/// The workers as the front door sees them (their health), and the embedded router's view.
async fn workers(State(state): State<Arc<FrontendState>>) -> Json<Value> {
    let health = state.health.snapshot(Instant::now());
    let router = state.placer.router();
    let decisions = router.map(|r| r.recent_decisions());
    Json(json!({"health": health, "workers": router.map(|r| r.workers()),
        "recent_decisions": decisions, "nats": router.and_then(|r| r.nats()).map(|n| n.summary())}))
}

/// Liveness; with an embedded router, its state (NATS away is degraded, not down).
async fn health(State(state): State<Arc<FrontendState>>) -> Json<Value> {
    match state.placer.router() {
        Some(router) => Json(router.health()),
        None => Json(json!({"status": "ok", "degraded": false})),
    }
}

async fn metrics(State(state): State<Arc<FrontendState>>) -> Response {
    state.metrics.ejected.set(state.health.ejected_count() as i64);
    match state.placer.router() {
        Some(router) => {
            kvroute_http::metrics::response(&[&state.metrics.registry, router.registry()])
        }
        None => kvroute_http::metrics::response(&[&state.metrics.registry]),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A whole answer is scanned once it closes, whatever its chunking (brackets inside
    /// strings do not count).
    #[test]
    fn the_usage_of_a_whole_answer_is_found_at_its_end() {
        let answer = br#"{"choices":[{"message":{"content":"a } tricky \" { text ]"}}],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        for cut in 1..answer.len() {
            let mut u = Usage::default();
            let (_, first) = u.pass(Bytes::copy_from_slice(&answer[..cut]));
            let (_, second) = u.pass(Bytes::copy_from_slice(&answer[cut..]));
            assert_eq!((first, second), (None, Some(32)), "cut at {cut}");
        }
        let mut u = Usage::default();
        let (_, none) = u.pass(Bytes::from_static(br#"{"usage":{"prompt_tokens":4}}"#));
        assert_eq!(none, None, "no details: nothing to compare");
    }

    /// A stream the front door asked for usage: the usage chunk is read and dropped; a
    /// stream whose client asked keeps it.
    #[test]
    fn a_usage_chunk_only_the_front_door_asked_for_is_dropped() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n";
        for strip in [true, false] {
            let mut u = Usage { sse: true, strip, ..Usage::default() };
            let (a, s1) = u.pass(Bytes::copy_from_slice(&stream.as_bytes()[..30]));
            let (b, s2) = u.pass(Bytes::copy_from_slice(&stream.as_bytes()[30..]));
            let out = String::from_utf8([a, b].concat()).unwrap();
            assert_eq!((s1, s2), (None, Some(16)));
            assert_eq!(out.contains("usage"), !strip, "{out}");
            assert!(out.contains("\"hi\"") && out.ends_with("data: [DONE]\n\n"), "{out}");
        }
    }
}

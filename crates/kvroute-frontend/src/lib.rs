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
//! included), but for image parts, which are inlined. A worker that refuses the connection is
//! skipped for another before any byte was sent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use futures_util::StreamExt;
use http_body_util::Full;
use kvroute_core::{BlockHasher, BlockSize, WorkerId, WorkerWithDpRank};
use kvroute_http::metrics::{Counter, Gauge, Registry};
use kvroute_http::openai::{ChatCompletionRequest, CompletionRequest, ModelList, check_model};
use kvroute_http::{ApiError, HttpClient};
use kvroute_preprocess::fetch::{Fetcher, LoadedImage};
use kvroute_preprocess::{Prepared, Preprocessor};
use kvroute_router::{RouterState, WorkerSpec};
use serde_json::{Value, json};

mod placer;
pub use placer::{Placed, Placer, RemoteRouter};

/// Largest request body accepted: room for inline images (20 MB each once decoded, a third
/// more as base64).
pub const BODY_LIMIT: usize = 64 << 20;

/// Header naming the worker a response came from.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// Header with the prompt tokens the router expected the chosen worker to serve from its cache
/// (its leading blocks held by the worker's KV events, in tokens, less the last block of a
/// fully cached prompt, which engines recompute): compare with the response's
/// `usage.prompt_tokens_details.cached_tokens` to see how exact the router's view is.
pub const OVERLAP_HEADER: &str = "x-kvroute-overlap-tokens";

pub const PROXIED: &str = "kvroute_frontend_proxied";
pub const RETRIES: &str = "kvroute_frontend_retries";
pub const IN_FLIGHT: &str = "kvroute_frontend_in_flight";

#[derive(Debug, Default)]
struct Metrics {
    registry: Registry,
    proxied: Counter,
    retried: Counter,
    in_flight: Gauge,
}

impl Metrics {
    fn new() -> Self {
        let m = Self::default();
        let mut r = Registry::default();
        r.register(PROXIED, "Requests proxied to a worker", m.proxied.clone());
        r.register(
            RETRIES,
            "Workers skipped because they refused the connection",
            m.retried.clone(),
        );
        r.register(IN_FLIGHT, "Requests between routing and their end", m.in_flight.clone());
        Self { registry: r, ..m }
    }
}

pub struct FrontendState {
    pub preprocessor: Arc<Preprocessor>,
    pub fetcher: Fetcher,
    pub placer: Placer,
    block_size: BlockSize,
    urls: BTreeMap<WorkerId, String>,
    client: HttpClient,
    next_id: AtomicU64,
    metrics: Metrics,
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

impl FrontendState {
    /// A front door over the embedded `router`, proxying to its workers that have a URL.
    pub fn new(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        router: Arc<RouterState>,
    ) -> Self {
        let (block_size, urls) = (router.config.block_size, urls(&router.config.workers));
        Self::with(preprocessor, fetcher, Placer::Embedded(router), block_size, urls)
    }

    /// A front door asking the `kvroute router` at `router_url`, proxying to `workers`.
    pub fn remote(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        router_url: &str,
        workers: &[WorkerSpec],
        block_size: BlockSize,
    ) -> Self {
        let placer = Placer::Remote(RemoteRouter::new(router_url));
        Self::with(preprocessor, fetcher, placer, block_size, urls(workers))
    }

    fn with(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        placer: Placer,
        block_size: BlockSize,
        urls: BTreeMap<WorkerId, String>,
    ) -> Self {
        Self {
            preprocessor,
            fetcher,
            placer,
            block_size,
            urls,
            client: HttpClient::new(),
            next_id: AtomicU64::new(0),
            metrics: Metrics::new(),
        }
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
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    kvroute_http::fallbacks(routes).with_state(state)
}

/// The body as JSON: an object, also decoded as `T` (the fields kvroute reads).
fn parse<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    param: &'static str,
) -> Result<(Value, T), ApiError> {
    let body = body?;
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    let fields = T::deserialize(&value)
        .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")).param(param))?;
    Ok((value, fields))
}

async fn chat(
    State(state): State<Arc<FrontendState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (mut raw, req) = parse::<ChatCompletionRequest>(body, "messages")?;
    // Images: fetched once here, forwarded inline, named by their identifier.
    let (prepared, images) = state.preprocessor.prepare_chat_request(&req, &state.fetcher).await?;
    rewrite_image_parts(&mut raw, &images);
    route_and_proxy(&state, "/v1/chat/completions", &raw, &prepared).await
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
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (raw, req) = parse::<CompletionRequest>(body, "prompt")?;
    check_model(state.preprocessor.model_name(), req.model.as_deref())?;
    let prepared = state
        .preprocessor
        .prepare_completion(req.prompt)
        .map_err(|e| ApiError::from(e).param("prompt"))?;
    route_and_proxy(&state, "/v1/completions", &raw, &prepared).await
}

/// Frees the request's in-flight accounting when dropped: at the end of the response body,
/// on an error, or when the client goes away.
struct InFlight {
    state: Arc<FrontendState>,
    id: String,
    prefilled: bool,
}

impl InFlight {
    fn new(state: &Arc<FrontendState>, id: String) -> Self {
        state.metrics.in_flight.inc();
        Self { state: Arc::clone(state), id, prefilled: false }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.metrics.in_flight.dec();
        self.state.placer.finish(&self.id);
    }
}

async fn route_and_proxy(
    state: &Arc<FrontendState>,
    path: &str,
    raw: &Value,
    prepared: &Prepared,
) -> Result<Response, ApiError> {
    if prepared.tokens.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    let bs = state.block_size;
    let block_infos = (!prepared.mm.mm_objects.is_empty())
        .then(|| prepared.mm.to_block_level(bs, prepared.tokens.len()));
    let local = BlockHasher::new(bs).local_hashes(&prepared.tokens, block_infos.as_deref());
    let body = Bytes::from(serde_json::to_vec(raw).map_err(ApiError::internal)?);
    let mut excluded: Vec<WorkerWithDpRank> = Vec::new();
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
        let response = match state.client.send(request).await {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                // Nothing was sent: another worker may take it.
                tracing::warn!(%worker, error = %e, "worker unreachable; trying another");
                state.metrics.retried.inc();
                excluded.push(worker);
                continue;
            }
            Err(e) => return Err(ApiError::bad_gateway(format!("worker {worker} failed"), e)),
        };
        state.metrics.proxied.inc();
        let (parts, incoming) = response.into_parts();
        let mut guard = guard;
        let stream = http_body_util::BodyExt::into_data_stream(incoming).map(move |chunk| {
            if !guard.prefilled {
                guard.prefilled = true;
                guard.state.placer.prefill_done(&guard.id);
            }
            chunk.map_err(std::io::Error::other)
        });
        let mut out = Response::builder().status(parts.status);
        for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
            if let Some(v) = parts.headers.get(&name) {
                out = out.header(name, v.clone());
            }
        }
        out = out.header(WORKER_HEADER, HeaderValue::from(worker.worker_id.0));
        let overlap_tokens = kvroute_core::schedule::reusable_tokens(
            overlap_blocks,
            prepared.tokens.len(),
            bs.tokens(),
        );
        out = out.header(OVERLAP_HEADER, HeaderValue::from(overlap_tokens));
        return out.body(Body::from_stream(stream)).map_err(ApiError::internal);
    }
}

async fn models(State(state): State<Arc<FrontendState>>) -> Json<ModelList> {
    Json(ModelList::one(state.preprocessor.model_name(), state.preprocessor.max_model_len()))
}

async fn metrics(State(state): State<Arc<FrontendState>>) -> Response {
    match state.placer.router() {
        Some(router) => {
            kvroute_http::metrics::response(&[&state.metrics.registry, router.registry()])
        }
        None => kvroute_http::metrics::response(&[&state.metrics.registry]),
    }
}

//! kvroute's OpenAI-compatible front door.
//!
//! ```text
//!  client ──POST /v1/chat/completions──▶ parse ─▶ images: fetch/decode, identifier ─▶ chat
//!  template + tokenizer (kvroute-preprocess, as the engines) ─▶ block hashes (with images) ─▶
//!  RouterState::place (in-flight from now) ─▶ proxy to the worker (images inline as data:
//!  URLs, `uuid` = identifier) ─▶ stream back; first bytes = prefill done; end, error or
//!  client gone = request freed
//! ```
//!
//! A worker that refuses the connection is skipped for another before any byte was sent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt as _;
use axum::{Json, Router};
use base64::Engine as _;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_core::{BlockHasher, BlockSize, WorkerId, WorkerWithDpRank};
use kvroute_preprocess::fetch::Fetcher;
use kvroute_preprocess::{
    ChatMessage, CompletionPrompt, Image, Prepared, Preprocessor, image_urls, images,
};
use kvroute_router::http::ApiError;
use kvroute_router::{RouterState, WorkerSpec};

mod placer;
pub use placer::{Placer, RemoteRouter};
use serde::Deserialize;
use serde_json::{Value, json};

/// Largest request body accepted.
pub const BODY_LIMIT: usize = 64 << 20;

/// Header naming the worker a response came from.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

/// Header with the prompt tokens the router expected the chosen worker to have cached (its
/// leading blocks held by the worker's KV events, in tokens): compare with the response's
/// `usage.prompt_tokens_details.cached_tokens` to see how exact the router's view is.
pub const OVERLAP_HEADER: &str = "x-kvroute-overlap-tokens";

pub struct FrontendState {
    pub preprocessor: Arc<Preprocessor>,
    pub fetcher: Fetcher,
    pub placer: Placer,
    block_size: BlockSize,
    urls: BTreeMap<WorkerId, String>,
    client: Client<HttpConnector, Full<Bytes>>,
    next_id: AtomicU64,
    proxied: AtomicU64,
    retried: AtomicU64,
}

impl std::fmt::Debug for FrontendState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontendState").field("urls", &self.urls).finish_non_exhaustive()
    }
}

/// The HTTP/1 client the front door proxies with (kept-alive connections, TCP_NODELAY); also
/// what clients of OpenAI endpoints in this workspace use.
pub fn http_client() -> Client<HttpConnector, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    // Without it, small SSE writes wait for delayed ACKs (the ~40 ms streaming floor).
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
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
        let remote = RemoteRouter {
            base: router_url.trim_end_matches('/').to_owned(),
            client: http_client(),
        };
        Self::with(preprocessor, fetcher, Placer::Remote(remote), block_size, urls(workers))
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
            client: http_client(),
            next_id: AtomicU64::new(0),
            proxied: AtomicU64::new(0),
            retried: AtomicU64::new(0),
        }
    }
}

/// Serves [`app`] on `listener` until `shutdown` resolves, then waits for open responses (bound
/// that wait outside).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<FrontendState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Streamed chunks go out at once: without TCP_NODELAY, Nagle's algorithm holds a chunk
    // until the previous one is acknowledged, and a delayed ACK makes that up to 40 ms.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app(state)).with_graceful_shutdown(shutdown).await
}

pub fn app(state: Arc<FrontendState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        // Room for inline images (20 MB each once decoded, a third more as base64).
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

#[derive(Debug, Deserialize)]
struct ChatFields {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
}

#[derive(Debug, Deserialize)]
struct CompletionFields {
    #[serde(default)]
    model: Option<String>,
    prompt: CompletionPrompt,
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, format!("the body is not valid JSON: {e}"))
    })?;
    if !value.is_object() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the body must be a JSON object"));
    }
    Ok(value)
}

fn check_model(state: &FrontendState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != state.preprocessor.model_name() => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "model {m:?} not found; this router serves {:?}",
                state.preprocessor.model_name()
            ),
        )
        .param("model")),
        _ => Ok(()),
    }
}

fn image_error(e: &kvroute_preprocess::PreprocessError) -> ApiError {
    let status = match e {
        kvroute_preprocess::PreprocessError::ImageTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    ApiError::new(status, e.to_string()).param("messages")
}

fn body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| ApiError::new(r.status(), r.body_text()))
}

async fn chat(
    State(state): State<Arc<FrontendState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut raw = parse_json(&self::body(body)?)?;
    let fields: ChatFields = serde_json::from_value(raw.clone()).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, format!("invalid chat request: {e}"))
            .param("messages")
    })?;
    check_model(&state, fields.model.as_deref())?;
    if fields.messages.is_empty() {
        return Err(
            ApiError::new(StatusCode::BAD_REQUEST, "messages must not be empty").param("messages")
        );
    }
    // Images: fetched once here, forwarded inline, named by their identifier.
    let config = state.preprocessor.image_config();
    let mut decoded: Vec<Image> = Vec::new();
    let mut inline: Vec<String> = Vec::new();
    for url in image_urls(&fields.messages) {
        let bytes = if url.starts_with("data:") {
            images::data_url_bytes(url, config).map_err(|e| image_error(&e))?
        } else {
            state.fetcher.fetch(url).await.map_err(|e| image_error(&e))?
        };
        decoded.push(images::decode(&bytes, config).map_err(|e| image_error(&e))?);
        inline.push(if url.starts_with("data:") {
            url.to_owned()
        } else {
            format!(
                "data:image;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(&bytes)
            )
        });
    }
    rewrite_image_parts(&mut raw, &decoded, &inline);
    let prepared = state
        .preprocessor
        .prepare_chat(&fields.messages, true, decoded)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()).param("messages"))?;
    route_and_proxy(&state, "/v1/chat/completions", &raw, &prepared).await
}

/// Each `image_url` part, in order, gets the image inline and its identifier as `uuid`.
fn rewrite_image_parts(raw: &mut Value, decoded: &[Image], inline: &[String]) {
    let mut k = 0;
    let Some(messages) = raw.get_mut("messages").and_then(Value::as_array_mut) else { return };
    for message in messages {
        let Some(parts) = message.get_mut("content").and_then(Value::as_array_mut) else {
            continue;
        };
        for part in parts {
            if part.get("type").and_then(Value::as_str) != Some("image_url") || k >= decoded.len() {
                continue;
            }
            if let Some(image_url) = part.get_mut("image_url").and_then(Value::as_object_mut) {
                image_url.insert("url".into(), Value::String(inline[k].clone()));
                image_url.insert("uuid".into(), Value::String(decoded[k].identifier.clone()));
            }
            k += 1;
        }
    }
}

async fn completions(
    State(state): State<Arc<FrontendState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let raw = parse_json(&body)?;
    let fields: CompletionFields = serde_json::from_value(raw.clone()).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, format!("invalid completion request: {e}"))
            .param("prompt")
    })?;
    check_model(&state, fields.model.as_deref())?;
    let prepared = state
        .preprocessor
        .prepare_completion(fields.prompt)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()).param("prompt"))?;
    route_and_proxy(&state, "/v1/completions", &raw, &prepared).await
}

/// Frees the request's in-flight accounting when dropped: at the end of the response body,
/// on an error, or when the client goes away.
struct InFlight {
    placer: Placer,
    id: String,
    prefilled: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.placer.finish(&self.id);
    }
}

async fn route_and_proxy(
    state: &Arc<FrontendState>,
    path: &str,
    raw: &Value,
    prepared: &Prepared,
) -> Result<Response, ApiError> {
    if prepared.tokens.is_empty() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the prompt is empty"));
    }
    let bs = state.block_size;
    let block_infos = (!prepared.mm.mm_objects.is_empty())
        .then(|| prepared.mm.to_block_level(bs, prepared.tokens.len()));
    let local = BlockHasher::new(bs).local_hashes(&prepared.tokens, block_infos.as_deref());
    let body = Bytes::from(serde_json::to_vec(raw).unwrap_or_default());
    let mut excluded: Vec<WorkerWithDpRank> = Vec::new();
    loop {
        let id = format!("kvr-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
        let placed = state.placer.place(&local, prepared.tokens.len(), &id, &excluded).await?;
        let (worker, overlap_blocks) = match placed {
            // A remote router does not take exclusions: a worker it names again is a dead end.
            Some((w, overlap)) if !excluded.contains(&w) => (w, overlap),
            _ => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no worker is available",
                ));
            }
        };
        let guard = InFlight { placer: state.placer.clone(), id, prefilled: false };
        let Some(base) = state.urls.get(&worker.worker_id) else {
            excluded.push(worker);
            continue;
        };
        let request = hyper::Request::post(format!("{base}{path}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let response = match state.client.request(request).await {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                // Nothing was sent: another worker may take it.
                tracing::warn!(%worker, error = %e, "worker unreachable; trying another");
                state.retried.fetch_add(1, Ordering::Relaxed);
                excluded.push(worker);
                continue;
            }
            Err(e) => {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("the worker failed: {e}"),
                ));
            }
        };
        state.proxied.fetch_add(1, Ordering::Relaxed);
        let (parts, incoming) = response.into_parts();
        let mut guard = guard;
        let stream = incoming.into_data_stream().map(move |chunk| {
            if !guard.prefilled {
                guard.prefilled = true;
                guard.placer.prefill_done(&guard.id);
            }
            chunk.map_err(std::io::Error::other)
        });
        let mut out = Response::builder().status(parts.status);
        for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
            if let Some(v) = parts.headers.get(&name) {
                out = out.header(name, v.clone());
            }
        }
        let name = worker.worker_id.to_string();
        out = out.header(
            WORKER_HEADER,
            HeaderValue::from_str(&name).unwrap_or(HeaderValue::from_static("?")),
        );
        let overlap_tokens = (overlap_blocks as usize * bs.tokens()).min(prepared.tokens.len());
        out = out.header(OVERLAP_HEADER, HeaderValue::from(overlap_tokens));
        return out
            .body(Body::from_stream(stream))
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
    }
}

async fn models(State(state): State<Arc<FrontendState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": state.preprocessor.model_name(), "object": "model", "created": 0, "owned_by": "kvroute"}]}),
    )
}

async fn metrics(State(state): State<Arc<FrontendState>>) -> impl IntoResponse {
    let mut text = state.placer.metrics();
    text.push_str(&format!(
        "# TYPE kvroute_frontend_proxied_total counter\nkvroute_frontend_proxied_total {}\n\
         # TYPE kvroute_frontend_retries_total counter\nkvroute_frontend_retries_total {}\n\
         # TYPE kvroute_frontend_in_flight gauge\nkvroute_frontend_in_flight {}\n",
        state.proxied.load(Ordering::Relaxed),
        state.retried.load(Ordering::Relaxed),
        state.placer.in_flight().map_or_else(|| "NaN".to_owned(), |n| n.to_string()),
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

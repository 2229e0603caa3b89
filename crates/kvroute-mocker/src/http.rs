//! The simulated engine's OpenAI-compatible API: `POST /v1/chat/completions` and
//! `POST /v1/completions` (streamed as SSE or not; `usage.prompt_tokens_details.cached_tokens`
//! is the engine's real cache hits), `GET /v1/models`, `/health`, `/metrics` (Prometheus) and
//! `/stats` (JSON ground truth). Generated text is readable words, the same for the same prompt
//! and seed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use kvroute_preprocess::fetch::Fetcher;
use kvroute_preprocess::{
    ChatMessage, CompletionPrompt, Image, Prepared, Preprocessor, image_urls, images,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{EngineRequest, Output, Usage};
use crate::service::{CancelOnDrop, EngineHandle};

pub struct AppState {
    pub engine: EngineHandle,
    pub preprocessor: Arc<Preprocessor>,
    pub seed: u64,
    pub fetcher: Fetcher,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        preprocessor: Arc<Preprocessor>,
        seed: u64,
        fetcher: Fetcher,
    ) -> Self {
        Self { engine, preprocessor, seed, fetcher, next_id: AtomicU64::new(0) }
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("engine", &self.engine)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

/// An OpenAI-shaped error.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), param: None }
    }

    fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = match r.status() {
            StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::PAYLOAD_TOO_LARGE => r.status(),
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(status, r.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status.as_u16()}});
        (self.status, Json(body)).into_response()
    }
}

pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        // Room for inline images (20 MB each once decoded, a third more as base64).
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: CompletionPrompt,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

/// Which API shape to answer in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

const WORDS: [&str; 48] = [
    "the",
    "cache",
    "router",
    "block",
    "token",
    "model",
    "answer",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "and",
    "then",
    "a",
    "small",
    "boat",
    "sails",
    "across",
    "calm",
    "water",
    "at",
    "sunset",
    "while",
    "birds",
    "sing",
    "in",
    "tall",
    "green",
    "trees",
    "near",
    "old",
    "stone",
    "bridge",
    "where",
    "children",
    "play",
    "with",
    "bright",
    "red",
    "kites",
    "every",
    "sunny",
    "afternoon",
    "together",
    "happily",
];

fn word(seed: u64, prompt_hash: u64, index: usize) -> &'static str {
    let mut x = seed ^ prompt_hash ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    WORDS[(x % WORDS.len() as u64) as usize]
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != state.preprocessor.model_name() => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "model {m:?} not found; this engine serves {:?}",
                state.preprocessor.model_name()
            ),
        )
        .param("model")),
        _ => Ok(()),
    }
}

/// The request's images, in order: `data:` URLs decoded, `http(s)://` URLs fetched (within the
/// fetch limits; private addresses only when allowed).
async fn decode_images(state: &AppState, messages: &[ChatMessage]) -> Result<Vec<Image>, ApiError> {
    let config = state.preprocessor.image_config();
    let mut out = Vec::new();
    for url in image_urls(messages) {
        let bytes = if url.starts_with("data:") {
            images::data_url_bytes(url, config).map_err(|e| image_error(&e))?
        } else {
            state.fetcher.fetch(url).await.map_err(|e| image_error(&e))?
        };
        out.push(images::decode(&bytes, config).map_err(|e| image_error(&e))?);
    }
    Ok(out)
}

fn image_error(e: &kvroute_preprocess::PreprocessError) -> ApiError {
    let status = match e {
        kvroute_preprocess::PreprocessError::ImageTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    ApiError::new(status, e.to_string()).param("messages")
}

async fn chat(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&state, req.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(
            ApiError::new(StatusCode::BAD_REQUEST, "messages must not be empty").param("messages")
        );
    }
    let images = decode_images(&state, &req.messages).await?;
    let prepared = state
        .preprocessor
        .prepare_chat(&req.messages, true, images)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()).param("messages"))?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(16);
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    generate(&state, Kind::Chat, prepared, max_tokens, req.stream, include_usage).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&state, req.model.as_deref())?;
    let prepared = state
        .preprocessor
        .prepare_completion(req.prompt)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e.to_string()).param("prompt"))?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    generate(
        &state,
        Kind::Completion,
        prepared,
        req.max_tokens.unwrap_or(16),
        req.stream,
        include_usage,
    )
    .await
}

async fn generate(
    state: &Arc<AppState>,
    kind: Kind,
    prepared: Prepared,
    max_tokens: usize,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let config = state.engine.config;
    let bs = config.block_size;
    if prepared.tokens.is_empty() {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "the prompt is empty"));
    }
    let needed = prepared.tokens.len().div_ceil(bs.tokens()) + 1;
    if needed > config.num_blocks {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the prompt needs {needed} KV blocks; this engine has {}", config.num_blocks),
        ));
    }
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{n}"),
        Kind::Completion => format!("cmpl-{n}"),
    };
    let prompt_hash = prepared
        .tokens
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3));
    let block_mm_infos = (!prepared.mm.mm_objects.is_empty())
        .then(|| prepared.mm.to_block_level(bs, prepared.tokens.len()));
    let request = EngineRequest {
        id: id.clone(),
        tokens: prepared.tokens,
        block_mm_infos,
        max_tokens: max_tokens.max(1),
    };
    let (outputs, guard) = state.engine.submit(request);
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let reply = Reply {
        kind,
        id,
        model: state.preprocessor.model_name().to_owned(),
        created,
        seed: state.seed,
        prompt_hash,
    };
    if stream {
        Ok(sse(reply, outputs, guard, include_usage).into_response())
    } else {
        Ok(Json(whole(reply, outputs, guard).await?).into_response())
    }
}

struct Reply {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    seed: u64,
    prompt_hash: u64,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn choice(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        match self.kind {
            Kind::Chat => {
                let mut delta = json!({"content": text});
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
            }
        }
    }

    fn chunk(&self, choices: &[Value], usage: Option<&Usage>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = usage_json(u);
        }
        v
    }

    fn piece(&self, index: usize) -> String {
        let w = word(self.seed, self.prompt_hash, index);
        if index == 0 { w.to_owned() } else { format!(" {w}") }
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

async fn whole(
    reply: Reply,
    mut outputs: mpsc::UnboundedReceiver<Output>,
    mut guard: CancelOnDrop,
) -> Result<Value, ApiError> {
    let mut text = String::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Token { index, .. } => text.push_str(&reply.piece(index)),
            Output::FirstToken { .. } => {}
            Output::Finished { usage, .. } => {
                guard.disarm();
                let choice = match reply.kind {
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length", "logprobs": null})
                    }
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "finish_reason": "length", "logprobs": null})
                    }
                };
                return Ok(json!({
                    "id": reply.id, "object": reply.object(false), "created": reply.created, "model": reply.model,
                    "choices": [choice], "usage": usage_json(&usage),
                }));
            }
        }
    }
    Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the engine stopped before the request finished",
    ))
}

/// SSE as OpenAI streams it: `data: {chunk}` per token, a final chunk with `finish_reason`,
/// a usage chunk if asked, then `data: [DONE]`. Dropping the stream (client gone) cancels.
fn sse(
    reply: Reply,
    outputs: mpsc::UnboundedReceiver<Output>,
    guard: CancelOnDrop,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<Event, std::convert::Infallible>>> {
    struct St {
        reply: Reply,
        outputs: mpsc::UnboundedReceiver<Output>,
        guard: CancelOnDrop,
        pending: std::collections::VecDeque<Event>,
        done: bool,
        include_usage: bool,
    }
    let st = St { reply, outputs, guard, pending: Default::default(), done: false, include_usage };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            match st.outputs.recv().await {
                Some(Output::Token { index, .. }) => {
                    let chunk = st
                        .reply
                        .chunk(&[st.reply.choice(&st.reply.piece(index), None, index == 0)], None);
                    st.pending.push_back(Event::default().data(chunk.to_string()));
                }
                Some(Output::FirstToken { .. }) => {}
                Some(Output::Finished { usage, .. }) => {
                    st.guard.disarm();
                    let last = st.reply.chunk(&[st.reply.choice("", Some("length"), false)], None);
                    st.pending.push_back(Event::default().data(last.to_string()));
                    if st.include_usage {
                        let u = st.reply.chunk(&[], Some(&usage));
                        st.pending.push_back(Event::default().data(u.to_string()));
                    }
                    st.pending.push_back(Event::default().data("[DONE]"));
                    st.done = true;
                }
                None => return None,
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": state.preprocessor.model_name(), "object": "model", "created": 0, "owned_by": "kvroute"}]}),
    )
}

async fn stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(serde_json::to_value(state.engine.snapshot()).unwrap_or(Value::Null))
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let s = state.engine.snapshot();
    let body = format!(
        "# TYPE kvroute_mocker_kv_cache_usage gauge\nkvroute_mocker_kv_cache_usage {}\n\
         # TYPE kvroute_mocker_waiting_requests gauge\nkvroute_mocker_waiting_requests {}\n\
         # TYPE kvroute_mocker_running_requests gauge\nkvroute_mocker_running_requests {}\n\
         # TYPE kvroute_mocker_prompt_tokens_total counter\nkvroute_mocker_prompt_tokens_total {}\n\
         # TYPE kvroute_mocker_cached_prompt_tokens_total counter\nkvroute_mocker_cached_prompt_tokens_total {}\n\
         # TYPE kvroute_mocker_evicted_blocks_total counter\nkvroute_mocker_evicted_blocks_total {}\n\
         # TYPE kvroute_mocker_preemptions_total counter\nkvroute_mocker_preemptions_total {}\n\
         # TYPE kvroute_mocker_requests_finished_total counter\nkvroute_mocker_requests_finished_total {}\n",
        s.kv_cache_usage,
        s.num_waiting_reqs,
        s.num_running_reqs,
        s.stats.prompt_tokens,
        s.stats.cached_tokens,
        s.stats.evicted_blocks,
        s.stats.preemptions,
        s.stats.requests_finished,
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
}

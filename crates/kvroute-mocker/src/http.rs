//! The simulated engine's OpenAI-compatible API: `POST /v1/chat/completions` and
//! `POST /v1/completions` (streamed as SSE or not; `usage.prompt_tokens_details.cached_tokens`
//! is the engine's real cache hits), `GET /v1/models`, `/health`, `/metrics` (Prometheus, with
//! vLLM's names) and `/stats` (JSON ground truth). Generated text is readable words, the same
//! for the same prompt and seed. Request and answer types are `kvroute_http::openai`'s; fields
//! the engine does not read are ignored, as vLLM ignores them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use kvroute_http::ApiError;
use kvroute_http::openai::{
    AssistantMessage, ChatCompletionRequest, Choice, Completion, CompletionRequest, Delta,
    ModelList, check_model,
};
use kvroute_preprocess::fetch::Fetcher;
use kvroute_preprocess::{Prepared, Preprocessor};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{EngineRequest, Output, Usage};
use crate::metrics::Metrics;
use crate::service::{CancelOnDrop, EngineHandle};

/// Largest request body accepted: room for inline images (20 MB each once decoded, a third
/// more as base64).
pub const BODY_LIMIT: usize = 64 << 20;

pub struct AppState {
    pub engine: EngineHandle,
    pub preprocessor: Arc<Preprocessor>,
    pub seed: u64,
    pub fetcher: Fetcher,
    metrics: Metrics,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        preprocessor: Arc<Preprocessor>,
        seed: u64,
        fetcher: Fetcher,
    ) -> Self {
        let c = engine.config;
        let metrics = Metrics::new(
            preprocessor.model_name(),
            engine.dp_rank,
            c.block_size.get(),
            c.num_blocks,
        );
        Self { engine, preprocessor, seed, fetcher, metrics, next_id: AtomicU64::new(0) }
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

pub fn app(state: Arc<AppState>) -> Router {
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    kvroute_http::fallbacks(routes).with_state(state)
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

async fn chat(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let (prepared, _) = state.preprocessor.prepare_chat_request(&req, &state.fetcher).await?;
    let max_tokens = req.max_output_tokens().unwrap_or(16);
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    generate(&state, Kind::Chat, prepared, max_tokens, req.stream, include_usage).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(state.preprocessor.model_name(), req.model.as_deref())?;
    let prepared = state
        .preprocessor
        .prepare_completion(req.prompt)
        .map_err(|e| ApiError::from(e).param("prompt"))?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    let max_tokens = req.max_tokens.unwrap_or(16);
    generate(&state, Kind::Completion, prepared, max_tokens, req.stream, include_usage).await
}

async fn generate(
    state: &Arc<AppState>,
    kind: Kind,
    prepared: Prepared,
    max_tokens: u64,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let config = state.engine.config;
    let bs = config.block_size;
    if prepared.tokens.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    let needed = prepared.tokens.len().div_ceil(bs.tokens()) + 1;
    if needed > config.num_blocks {
        return Err(ApiError::too_large(format!(
            "the prompt needs {needed} KV blocks; this engine has {}",
            config.num_blocks
        )));
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
        max_tokens: usize::try_from(max_tokens).unwrap_or(usize::MAX).max(1),
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
    fn completion(&self, chunk: bool, choices: Vec<Choice>, usage: Option<Usage>) -> Completion {
        let object = match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        };
        Completion {
            id: self.id.clone(),
            object: object.to_owned(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: usage.map(openai_usage),
        }
    }

    /// A streamed choice with `text` new.
    fn delta(&self, text: &str, finish: Option<&str>, first: bool) -> Choice {
        let finish_reason = finish.map(str::to_owned);
        match self.kind {
            Kind::Chat => Choice {
                delta: Some(Delta {
                    role: first.then(|| "assistant".to_owned()),
                    content: Some(text.to_owned()),
                }),
                finish_reason,
                ..Choice::default()
            },
            Kind::Completion => {
                Choice { text: Some(text.to_owned()), finish_reason, ..Choice::default() }
            }
        }
    }

    /// The whole answer's choice.
    fn whole(&self, text: String) -> Choice {
        let finish_reason = Some("length".to_owned());
        match self.kind {
            Kind::Chat => Choice {
                message: Some(AssistantMessage { role: "assistant".into(), content: text }),
                finish_reason,
                ..Choice::default()
            },
            Kind::Completion => Choice { text: Some(text), finish_reason, ..Choice::default() },
        }
    }

    fn piece(&self, index: usize) -> String {
        let w = word(self.seed, self.prompt_hash, index);
        if index == 0 { w.to_owned() } else { format!(" {w}") }
    }
}

fn openai_usage(u: Usage) -> kvroute_http::openai::Usage {
    kvroute_http::openai::Usage::new(
        u.prompt_tokens as u64,
        u.completion_tokens as u64,
        u.cached_tokens as u64,
    )
}

async fn whole(
    reply: Reply,
    mut outputs: mpsc::UnboundedReceiver<Output>,
    mut guard: CancelOnDrop,
) -> Result<Completion, ApiError> {
    let mut text = String::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Token { index, .. } => text.push_str(&reply.piece(index)),
            Output::FirstToken { .. } => {}
            Output::Finished { usage, .. } => {
                guard.disarm();
                return Ok(reply.completion(false, vec![reply.whole(text)], Some(usage)));
            }
        }
    }
    Err(ApiError::unavailable("the engine stopped before the request finished"))
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
    fn data(c: &Completion) -> Event {
        Event::default().data(serde_json::to_string(c).unwrap_or_default())
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
                    let r = &st.reply;
                    let chunk =
                        r.completion(true, vec![r.delta(&r.piece(index), None, index == 0)], None);
                    st.pending.push_back(data(&chunk));
                }
                Some(Output::FirstToken { .. }) => {}
                Some(Output::Finished { usage, .. }) => {
                    st.guard.disarm();
                    let r = &st.reply;
                    st.pending.push_back(data(&r.completion(
                        true,
                        vec![r.delta("", Some("length"), false)],
                        None,
                    )));
                    if st.include_usage {
                        st.pending.push_back(data(&r.completion(true, Vec::new(), Some(usage))));
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

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList::one(state.preprocessor.model_name(), state.preprocessor.max_model_len()))
}

async fn stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(serde_json::to_value(state.engine.snapshot()).unwrap_or(Value::Null))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let snapshot = state.engine.snapshot();
    kvroute_http::metrics::response(&[state.metrics.refresh(&snapshot)])
}

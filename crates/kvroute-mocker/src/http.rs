//! The simulated engine's OpenAI-compatible API: `POST /v1/chat/completions` and
//! `POST /v1/completions` (streamed as SSE or not; `usage.prompt_tokens_details.cached_tokens`
//! is the engine's real cache hits), `GET /v1/models`, `/health`, `/metrics` (Prometheus, with
//! vLLM's names) and `/stats` (JSON ground truth), and vLLM's endpoints for routers
//! ([`crate::vllm`]). An answer is words of the model's vocabulary chosen by the prompt and the
//! seed ([`crate::sequence::OutputPlan`]): its text tokenizes back to the generated token ids, and it runs to
//! `max_tokens` (`finish_reason: length`, as vLLM says of an answer cut by its length; `stop`
//! only when a `stop` string ends it). Request and answer types are `kvroute_http::openai`'s; fields
//! the engine does not read are ignored, as vLLM ignores them.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use kvroute_http::ApiError;
use kvroute_http::openai::{
    Api, AssistantMessage, ChatCompletionRequest, Choice, Completion, CompletionRequest, Delta,
    Envelope, ModelList, parse_request,
};
use kvroute_http::paths;
use kvroute_http::vllm_generate::check_cache_salt;
use kvroute_preprocess::{Prepared, Preprocessor};
use serde_json::{Value, json};
use tokio::sync::mpsc;

pub use crate::app::{AppState, BODY_LIMIT, DEFAULT_MAX_MODEL_LEN};
use crate::app::{Submission, Submitted};
use crate::engine::{Output, Usage};
use crate::legs::Leg;
use crate::service::CancelOnDrop;

/// The engine's routes: `/health` always open, every other one behind
/// [`AppState::api_keys`] when it has any.
pub fn app(state: Arc<AppState>) -> Router {
    let guarded = Router::new()
        .route(paths::CHAT_COMPLETIONS, post(chat))
        .route(paths::COMPLETIONS, post(completions))
        .route(paths::MODELS, get(models))
        .route("/stats", get(stats))
        .route(paths::METRICS, get(metrics))
        .route("/tokenize", post(crate::vllm::tokenize))
        .route("/detokenize", post(crate::vllm::detokenize))
        .route("/v1/chat/completions/render", post(crate::vllm::render_chat))
        .route("/v1/completions/render", post(crate::vllm::render_completion))
        .route(kvroute_http::vllm_generate::PATH, post(crate::generate::generate))
        .route(kvroute_http::vllm_generate::DERENDER_CHAT_PATH, post(crate::derender::chat))
        .route(
            kvroute_http::vllm_generate::DERENDER_COMPLETION_PATH,
            post(crate::derender::completion),
        )
        .route(kvroute_http::sglang_generate::PATH, post(crate::sglang::generate));
    let guarded = match state.runtime_lora_updating {
        true => guarded
            .route("/v1/load_lora_adapter", post(crate::lora_api::load))
            .route("/v1/unload_lora_adapter", post(crate::lora_api::unload)),
        false => guarded,
    };
    let traces = Arc::clone(&state.traces);
    let routes = kvroute_http::auth::require(guarded, state.api_keys.clone())
        .route(paths::HEALTH, get(|| async { Json(json!({"status": "ok"})) }))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                traces.seen(request.headers());
                next.run(request)
            },
        ));
    kvroute_http::fallbacks(routes).with_state(state)
}

async fn chat(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body?;
    let req: ChatCompletionRequest = parse_request(&body, "messages", Some(1))?;
    check_cache_salt(req.cache_salt.as_deref())?;
    let lora = state.catalog.resolve(req.model.as_deref())?;
    let logprobs = crate::logprobs::asked_by_chat(&body);
    let (prepared, _) =
        state.preprocessor.prepare_chat_request(&req, &state.fetcher, state.max_model_len).await?;
    let ask = Ask {
        kind: Api::Chat,
        max_tokens: req.max_output_tokens().unwrap_or(16),
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        ignore_eos: req.ignore_eos,
        cache_salt: req.cache_salt,
        priority: req.priority,
        logprobs,
        lora,
        leg: crate::handoff::leg(&body, state.engine.config.disagg.role)?,
    };
    generate(&state, prepared, ask).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body?;
    let req: CompletionRequest = parse_request(&body, "prompt", Some(1))?;
    check_cache_salt(req.cache_salt.as_deref())?;
    let lora = state.catalog.resolve(req.model.as_deref())?;
    let prepared = state.preprocessor.prepare_completion_request(&req, state.max_model_len)?;
    let ask = Ask {
        kind: Api::Completion,
        max_tokens: req.max_tokens.unwrap_or(16),
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        ignore_eos: req.ignore_eos,
        cache_salt: req.cache_salt,
        priority: req.priority,
        logprobs: None,
        lora,
        leg: crate::handoff::leg(&body, state.engine.config.disagg.role)?,
    };
    generate(&state, prepared, ask).await
}

/// What a request asks of the engine besides its prompt.
#[derive(Clone, Debug)]
struct Ask {
    kind: Api,
    max_tokens: u64,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
    cache_salt: Option<String>,
    /// vLLM's `priority` (lower first).
    priority: i64,
    /// Chat's `logprobs: true`, with this many alternatives per token (simulated).
    logprobs: Option<u32>,
    lora: Option<String>,
    /// Its leg of a disaggregated request (a vLLM prefill leg's key is its id here).
    leg: crate::handoff::Leg,
}

async fn generate(
    state: &Arc<AppState>,
    prepared: Prepared,
    ask: Ask,
) -> Result<Response, ApiError> {
    let Ask {
        kind,
        max_tokens,
        stream,
        include_usage,
        ignore_eos,
        cache_salt,
        priority,
        logprobs,
        lora,
        leg,
    } = ask;
    let model = lora.clone().unwrap_or_else(|| state.preprocessor.model_name().to_owned());
    let envelope = Envelope::new(kind, &state.next_id().to_string(), model);
    let window = state.preprocessor.decode_window(&prepared.tokens);
    let leg = match leg {
        Leg::Prefill { sglang: false, .. } => {
            Leg::Prefill { key: crate::handoff::fresh_key(), sglang: false }
        }
        leg => leg,
    };
    // vLLM's prefill answers name what the decode engine pulls.
    let produced = match &leg {
        Leg::Prefill { key, sglang: false } => {
            Some(state.produced_params(key, prepared.tokens.len()))
        }
        _ => None,
    };
    let mut submission = Submission {
        id: envelope.id.clone(),
        tokens: prepared.tokens,
        mm: Some(prepared.mm),
        max_tokens,
        ignore_eos,
        cache_salt,
        lora,
        handoff: crate::disagg::Handoff::None,
        hold: None,
        in_store: Vec::new(),
        priority,
    };
    state.arrange(&leg, &mut submission).await?;
    let Submitted { outputs, guard, end } = state.submit(submission)?;
    let vocab = u32::try_from(state.preprocessor.vocab_size()).unwrap_or(u32::MAX);
    let preprocessor = Arc::clone(&state.preprocessor);
    let reply = Reply { envelope, preprocessor, end, window, logprobs, vocab, produced };
    if stream {
        Ok(sse(reply, outputs, guard, include_usage).into_response())
    } else {
        Ok(Json(whole(reply, outputs, guard).await?).into_response())
    }
}

struct Reply {
    envelope: Envelope,
    preprocessor: Arc<Preprocessor>,
    /// The end-of-turn token, if the answer ends with it.
    end: Option<u32>,
    /// The answer's decoding so far, seeded with the prompt's end (vLLM's incremental
    /// detokenizer): a character split across tokens goes out whole.
    window: kvroute_preprocess::DecodeWindow,
    /// Logprobs asked for: this many alternatives per token.
    logprobs: Option<u32>,
    vocab: u32,
    /// A prefill leg's `kv_transfer_params`, sent with the answer's end.
    produced: Option<Value>,
}

impl Reply {
    /// The logprobs of `tokens`, when asked for.
    fn logprobs(&self, tokens: &[u32]) -> Option<serde_json::Value> {
        let k = self.logprobs?;
        Some(crate::logprobs::as_text(&self.preprocessor, tokens, k, self.vocab))
    }

    fn completion(&self, chunk: bool, choices: Vec<Choice>, usage: Option<Usage>) -> Completion {
        self.envelope.completion(chunk, choices, usage.map(openai_usage))
    }

    /// A streamed choice with `text` new.
    fn delta(&self, text: &str, finish: Option<&str>, first: bool) -> Choice {
        let finish_reason = finish.map(str::to_owned);
        match self.envelope.api {
            Api::Chat => Choice {
                delta: Some(Delta {
                    role: first.then(|| "assistant".to_owned()),
                    content: Some(text.to_owned()),
                }),
                finish_reason,
                ..Choice::default()
            },
            Api::Completion => {
                Choice { text: Some(text.to_owned()), finish_reason, ..Choice::default() }
            }
        }
    }

    /// Why the answer ended, given its last token.
    fn finish_reason(&self, last: Option<u32>) -> String {
        match last.is_some() && last == self.end {
            true => "stop".to_owned(),
            false => "length".to_owned(),
        }
    }

    /// The whole answer's choice.
    fn whole(&self, text: String, last: Option<u32>) -> Choice {
        let finish_reason = Some(self.finish_reason(last));
        match self.envelope.api {
            Api::Chat => Choice {
                message: Some(AssistantMessage { role: "assistant".into(), content: text }),
                finish_reason,
                ..Choice::default()
            },
            Api::Completion => Choice { text: Some(text), finish_reason, ..Choice::default() },
        }
    }

    /// The text one generated token adds (special tokens, the end of turn among them, add
    /// none; a token that leaves a character unfinished adds it with the next).
    fn piece(&mut self, token: u32) -> String {
        self.preprocessor.decode_next(&mut self.window, &[token])
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
    mut reply: Reply,
    mut outputs: mpsc::UnboundedReceiver<Output>,
    mut guard: CancelOnDrop,
) -> Result<Completion, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(output) = outputs.recv().await {
        match output {
            Output::Token { token, .. } => {
                text.push_str(&reply.piece(token));
                tokens.push(token);
            }
            Output::FirstToken { .. } => {}
            Output::Finished { usage, .. } => {
                guard.disarm();
                let mut choice = reply.whole(text, tokens.last().copied());
                choice.logprobs = reply.logprobs(&tokens);
                let mut answer = reply.completion(false, vec![choice], Some(usage));
                answer.kv_transfer_params = reply.produced.take();
                return Ok(answer);
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
        last: Option<u32>,
    }
    fn data(c: &Completion) -> Event {
        Event::default().data(serde_json::to_string(c).unwrap_or_default())
    }
    let st = St {
        reply,
        outputs,
        guard,
        pending: Default::default(),
        done: false,
        include_usage,
        last: None,
    };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            match st.outputs.recv().await {
                Some(Output::Token { index, token, .. }) => {
                    st.last = Some(token);
                    let piece = st.reply.piece(token);
                    let r = &st.reply;
                    // The end of turn has no text: the last chunk says `stop` instead.
                    if index == 0 || !piece.is_empty() {
                        let mut choice = r.delta(&piece, None, index == 0);
                        choice.logprobs = r.logprobs(&[token]);
                        st.pending.push_back(data(&r.completion(true, vec![choice], None)));
                    }
                }
                Some(Output::FirstToken { .. }) => {}
                Some(Output::Finished { usage, .. }) => {
                    st.guard.disarm();
                    let r = &st.reply;
                    let reason = r.finish_reason(st.last);
                    let last = r.delta("", Some(&reason), false);
                    let mut last = r.completion(true, vec![last], None);
                    last.kv_transfer_params = r.produced.clone();
                    st.pending.push_back(data(&last));
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
    Json(state.catalog.list())
}

async fn stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    let mut stats = serde_json::to_value(state.engine.snapshot()).unwrap_or(Value::Null);
    if let Some(fields) = stats.as_object_mut() {
        let adapters = serde_json::to_value(state.engine.adapters()).unwrap_or(Value::Null);
        fields.insert("lora".to_owned(), adapters);
        fields.insert("role".to_owned(), state.engine.config.disagg.role.name().into());
        fields.insert("handoff".to_owned(), state.holds.counts.to_json());
        fields.insert("trace".to_owned(), state.traces.to_json());
        let priorities = state.priorities.lock().map(|p| p.clone()).unwrap_or_default();
        let priorities: serde_json::Map<String, Value> =
            priorities.into_iter().map(|(p, n)| (p.to_string(), n.into())).collect();
        fields.insert("priorities".to_owned(), priorities.into());
    }
    Json(stats)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let snapshot = state.engine.snapshot();
    let enabled = state.runtime_lora_updating || !state.catalog.adapters().is_empty();
    state.metrics.refresh_adapters(&state.engine.adapters(), enabled);
    kvroute_http::metrics::response(&[state.metrics.refresh(&snapshot)])
}

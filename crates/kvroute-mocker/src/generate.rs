//! vLLM's token-in, token-out `POST /inference/v1/generate` ([`kvroute_http::vllm_generate`]),
//! as vLLM 0.33 serves it: the prompt comes as token ids, so the engine runs exactly the
//! tokens a router hashed; the answer is token ids (and the text, with `output_mode: "text"`),
//! whole or as SSE chunks ending in `data: [DONE]`. Requests are checked as vLLM checks them,
//! and refused in its shapes: 400 `"Bad Request"` for what its model refuses, 400
//! `"BadRequestError"` for what its server refuses, 404 `"NotFoundError"` for another model.
//!
//! Where the simulated engine differs from vLLM: it always reports `cached_tokens` (vLLM does
//! with `--enable-prompt-tokens-details`), answers one choice (`n` above 1 is refused), takes
//! no media but images in `content_parts` and no `output_mode: "derender"` (the derender endpoints are
//! [`crate::derender`]'s), and has no priority scheduling (a priority other
//! than 0 is refused, as vLLM refuses it without `--scheduling-policy priority`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use kvroute_http::ApiError;
use kvroute_http::openai::{MAX_ECHOED_CHARS, Usage as ApiUsage};
use kvroute_http::vllm_generate::{
    GenerateChoice, GenerateChunk, GenerateRequest, GenerateResponse, MultiModalFeatures,
    OutputMode, refused,
};
use tokio::sync::mpsc;

use crate::app::{AppState, Submission, Submitted, now_secs};
use crate::engine::{Output, Usage};
use crate::handoff::Leg;
use crate::service::CancelOnDrop;

pub(crate) async fn generate(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body?;
    let req: GenerateRequest = parse(&body)?;
    let leg = crate::handoff::leg(&body, state.engine.config.disagg.role)?;
    req.check()?;
    let model = state.preprocessor.model_name().to_owned();
    let lora = state.catalog.resolve(req.model.as_deref()).ok().flatten();
    if let Some(asked) =
        req.model.as_deref().filter(|m| !m.is_empty() && *m != model && lora.is_none())
    {
        // A megabyte of a name is not sent back, as on the other APIs.
        let shown: String = asked.chars().take(MAX_ECHOED_CHARS).collect();
        let cut = if asked.chars().nth(MAX_ECHOED_CHARS).is_some() { "..." } else { "" };
        let message = format!("The model `{shown}{cut}` does not exist. Valid aliases: {model}.");
        return Err(ApiError::not_found(message).kind("NotFoundError").param("model"));
    }
    let tokens = served_tokens(&state, &req)?;
    let (tokens, mm) = with_images(&state, &req, tokens).await?;
    let logprobs = asked_logprobs(&req.sampling_params)?;
    let base = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.request_id.clone())
        .unwrap_or_else(|| format!("{:032x}", state.next_id()));
    let id = format!("generate-tokens-{base}");
    let leg = match leg {
        Leg::Prefill { sglang: false, .. } => {
            Leg::Prefill { key: crate::handoff::fresh_key(), sglang: false }
        }
        leg => leg,
    };
    // A prefill leg answers with what its decode engine pulls, else the request's own.
    let kv_transfer_params = match &leg {
        Leg::Prefill { key, sglang: false } => {
            state.produced_params(key, tokens.len()).as_object().cloned()
        }
        _ => None,
    };
    let room = state.max_model_len.saturating_sub(tokens.len() as u64);
    let max_tokens = match req.sampling_params.max_tokens {
        Some(m) => u64::try_from(m).unwrap_or(1).min(room),
        None => room,
    };
    let mut submission = Submission {
        id: id.clone(),
        mm,
        tokens: tokens.clone(),
        max_tokens,
        ignore_eos: req.sampling_params.ignore_eos == Some(true),
        cache_salt: req.cache_salt.clone(),
        lora: lora.clone(),
        handoff: crate::disagg::Handoff::None,
        hold: None,
        in_store: Vec::new(),
        priority: req.priority,
    };
    state.arrange(&leg, &mut submission).await?;
    let submitted = state.submit(submission)?;
    state.metrics.generated();
    // A stream's text grows token by token through a window seeded with the prompt's end,
    // as vLLM's incremental detokenizer does.
    let window = (req.streamed() && req.output_mode == OutputMode::Text)
        .then(|| state.preprocessor.decode_window(&tokens));
    let answer = Answer {
        id,
        mode: req.output_mode,
        logprobs,
        vocab: u32::try_from(state.preprocessor.vocab_size()).unwrap_or(u32::MAX),
        window,
        prompt_len: tokens.len() as u64,
        prompt: req.return_token_ids.unwrap_or(false).then_some(tokens),
        preprocessor: Arc::clone(&state.preprocessor),
        kv_transfer_params,
    };
    match req.streamed() {
        true => {
            let o = req.stream_options.unwrap_or_default();
            let usage = Usages {
                last: o.include_usage == Some(true),
                continuous: o.include_usage == Some(true) && o.continuous_usage_stats == Some(true),
            };
            Ok(stream_answer(answer, submitted, max_tokens.max(1), usage).into_response())
        }
        false => {
            let mut whole = whole(answer, submitted).await?;
            whole.model = Some(lora.unwrap_or(model));
            whole.created = Some(now_secs());
            Ok(Json(whole).into_response())
        }
    }
}

/// The body as vLLM's model reads it: a JSON object, its fields of the right types.
/// A JSON object body as vLLM's pydantic models take it: anything else is 400 `Bad Request`.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad_request("1 validation error:\n  the body must be a JSON object")
            .kind("Bad Request"));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("1 validation error:\n  {e}")).kind("Bad Request")
    })
}

/// `sampling_params.logprobs`, as vLLM bounds it by its `max_logprobs` (20): a count from 0
/// (the sampled token only) to 20; -1 (the whole vocabulary) is past that bound too.
fn asked_logprobs(
    p: &kvroute_http::vllm_generate::SamplingParams,
) -> Result<Option<u32>, ApiError> {
    let k = match p.other.get("logprobs") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(v) => v.as_i64().ok_or_else(|| {
            ApiError::bad_request("1 validation error:\n  Input should be a valid integer")
                .kind("Bad Request")
                .param("sampling_params")
        })?,
    };
    if k < -1 {
        return Err(refused(format!("logprobs must be non-negative or -1, got {k}.")));
    }
    match u32::try_from(k).ok().filter(|&k| k <= MAX_LOGPROBS) {
        Some(k) => Ok(Some(k)),
        None => Err(refused(format!(
            "Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}"
        ))),
    }
}

/// The prompt with its images: `features` as they are (hashes over placeholder ranges the
/// ids already hold), or `content_parts`, whose media the engine resolves itself as vLLM's
/// server does: each image part's URL loaded (or, for a `uuid` processed before, its image
/// taken from the cache, as vLLM's processor cache does), keyed by its `uuid` (vLLM's
/// multimodal UUID, the item's hash) when given, and the prompt's one image token per part
/// expanded by the image's size, as vLLM's processor expands a token prompt's.
async fn with_images(
    state: &AppState,
    req: &GenerateRequest,
    tokens: Vec<u32>,
) -> Result<(Vec<u32>, Option<kvroute_core::RequestExtraInfo>), ApiError> {
    let Some(parts) = req.content_parts.as_ref().filter(|c| !c.is_empty()) else {
        return Ok((tokens, req.features.as_ref().map(MultiModalFeatures::extra_info)));
    };
    let mut urls = Vec::with_capacity(parts.len());
    let mut uuids = Vec::with_capacity(parts.len());
    for part in parts {
        let field = |k: &str| part.get(k).and_then(serde_json::Value::as_str);
        match (field("type"), field("url")) {
            (Some("image_url"), Some(url)) => {
                urls.push(url);
                uuids.push(field("uuid"));
            }
            (Some("image_url"), None) => {
                return Err(refused("an image_url content part needs a url").param("content_parts"));
            }
            (kind, _) => {
                let kind = kind.unwrap_or("untyped");
                let m = format!("{kind} content parts are not served by the simulated engine");
                return Err(refused(m).param("content_parts"));
            }
        }
    }
    let images = state.images(&urls, &uuids, req.cache_salt.as_deref()).await;
    let images = images.map_err(|e| ApiError::from(e).param("content_parts"))?;
    let expanded = state.preprocessor.expand_images(tokens, images);
    let expanded = expanded.map_err(|e| ApiError::from(e).param("content_parts"))?;
    let (len, limit) = (expanded.tokens.len() as u64, state.max_model_len);
    if len > limit {
        return Err(refused(format!(
            "The decoder prompt (length {len}) is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no smaller than the number of text tokens."
        )));
    }
    Ok((expanded.tokens, Some(expanded.mm)))
}

/// vLLM's default `max_logprobs`.
const MAX_LOGPROBS: u32 = 20;

/// The prompt's token ids, once the server's own checks pass (vLLM's order: the request,
/// then the prompt against the vocabulary and the context length).
fn served_tokens(state: &AppState, req: &GenerateRequest) -> Result<Vec<u32>, ApiError> {
    let p = &req.sampling_params;
    if p.n.unwrap_or(1) > 1 {
        return Err(refused("the simulated engine answers one choice: n must be 1").param("n"));
    }
    match req.output_mode {
        OutputMode::Derender if req.streamed() => {
            return Err(refused("output_mode='derender' does not support stream=true."));
        }
        OutputMode::Derender => {
            return Err(refused("output_mode='derender' is not served by the simulated engine; use 'tokens' or 'text'").param("output_mode"));
        }
        _ => {}
    }
    let vocab = i64::try_from(state.preprocessor.vocab_size()).unwrap_or(i64::MAX);
    if let Some(&max) = req.token_ids.iter().max().filter(|&&m| m >= vocab) {
        return Err(refused(format!("Token id {max} is out of vocabulary")).param("token_ids"));
    }
    let len = req.token_ids.len() as u64;
    let limit = state.max_model_len;
    if len > limit {
        return Err(refused(format!(
            "The decoder prompt (length {len}) is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no smaller than the number of text tokens."
        )));
    }
    if len == limit {
        return Err(refused(format!(
            "The decoder prompt (length {len}) plus the number of requested output tokens (at least 1) is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no smaller than the number of text tokens (prompt + requested output tokens)."
        )));
    }
    // In range of the vocabulary, so of u32.
    Ok(req.token_ids.iter().map(|&t| u32::try_from(t).unwrap_or(u32::MAX)).collect())
}

/// What every answer to one request shares.
struct Answer {
    id: String,
    mode: OutputMode,
    /// A text stream's decoding, so far.
    window: Option<kvroute_preprocess::DecodeWindow>,
    /// `sampling_params.logprobs`: this many candidates per token (simulated).
    logprobs: Option<u32>,
    vocab: u32,
    /// The prompt's ids, when asked for (`return_token_ids`).
    prompt: Option<Vec<u32>>,
    prompt_len: u64,
    preprocessor: Arc<kvroute_preprocess::Preprocessor>,
    kv_transfer_params: Option<serde_json::Map<String, serde_json::Value>>,
}

impl Answer {
    /// A choice of `tokens` (with their text in text mode).
    fn choice(&mut self, tokens: Vec<u32>, finish: Option<&str>) -> GenerateChoice {
        let text = match (self.mode, self.window.as_mut()) {
            (OutputMode::Text, Some(window)) => {
                Some(self.preprocessor.decode_next(window, &tokens))
            }
            (OutputMode::Text, None) => Some(self.preprocessor.decode(&tokens).unwrap_or_default()),
            _ => None,
        };
        let logprobs = self.logprobs.map(|k| match self.mode {
            OutputMode::Text => {
                crate::logprobs::as_text(&self.preprocessor, &tokens, k, self.vocab)
            }
            _ => crate::logprobs::by_id(&tokens, k, self.vocab),
        });
        GenerateChoice {
            index: 0,
            finish_reason: finish.map(str::to_owned),
            token_ids: Some(tokens),
            text,
            logprobs,
            ..GenerateChoice::default()
        }
    }
}

fn usage(u: Usage) -> ApiUsage {
    ApiUsage::new(u.prompt_tokens as u64, u.completion_tokens as u64, u.cached_tokens as u64)
}

/// Why the answer ended: the end-of-turn token, or its length.
fn finish_reason(end: Option<u32>, last: Option<u32>) -> &'static str {
    match last.is_some() && last == end {
        true => "stop",
        false => "length",
    }
}

async fn whole(answer: Answer, submitted: Submitted) -> Result<GenerateResponse, ApiError> {
    let end = submitted.end;
    let Some((tokens, u)) = submitted.finished().await else {
        return Err(ApiError::unavailable("the engine stopped before the request finished"));
    };
    let reason = finish_reason(end, tokens.last().copied());
    let mut answer = answer;
    let choice = answer.choice(tokens, Some(reason));
    Ok(GenerateResponse {
        request_id: answer.id,
        usage: Some(usage(u)),
        prompt_token_ids: answer.prompt,
        kv_transfer_params: answer.kv_transfer_params,
        output_mode: answer.mode,
        choices: vec![choice],
        ..GenerateResponse::default()
    })
}

/// Which usage a stream carries: a last chunk of it, and a running count on every chunk.
#[derive(Clone, Copy)]
struct Usages {
    last: bool,
    continuous: bool,
}

/// SSE as vLLM streams it: a chunk per new token (the prompt's ids on the first, when asked
/// for), the last with `finish_reason`; a usage chunk if asked; then `data: [DONE]`. Dropping
/// the stream (the client gone) cancels the request.
fn stream_answer(
    answer: Answer,
    submitted: Submitted,
    max_tokens: u64,
    usages: Usages,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    struct St {
        answer: Answer,
        outputs: mpsc::UnboundedReceiver<Output>,
        guard: CancelOnDrop,
        end: Option<u32>,
        usages: Usages,
        pending: VecDeque<Event>,
        /// Tokens the request may generate: the one of that index is the last.
        max_tokens: u64,
        /// The chunk with `finish_reason` went out.
        finished: bool,
        generated: u64,
        done: bool,
    }
    impl St {
        fn chunk(&mut self, tokens: Vec<u32>, finish: Option<&str>) {
            let choice = self.answer.choice(tokens, finish);
            self.generated += choice.token_ids.as_ref().map_or(0, |t| t.len() as u64);
            let usage = self.usages.continuous.then(|| ApiUsage {
                prompt_tokens_details: None,
                ..ApiUsage::new(self.answer.prompt_len, self.generated, 0)
            });
            let chunk = GenerateChunk {
                request_id: self.answer.id.clone(),
                usage,
                prompt_token_ids: self.answer.prompt.take(),
                output_mode: self.answer.mode,
                choices: vec![choice],
            };
            self.pending.push_back(data(&chunk));
        }
    }
    fn data(chunk: &GenerateChunk) -> Event {
        Event::default().data(serde_json::to_string(chunk).unwrap_or_default())
    }
    let Submitted { outputs, guard, end } = submitted;
    let st = St {
        answer,
        outputs,
        guard,
        end,
        usages,
        pending: VecDeque::new(),
        max_tokens,
        finished: false,
        generated: 0,
        done: false,
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
                Some(Output::FirstToken { .. }) => {}
                Some(Output::Token { token, index, .. }) => {
                    // The engine stops at the end of turn or at max_tokens: that token's
                    // chunk says so, as vLLM's last delta does.
                    let last = Some(token) == st.end || index as u64 + 1 >= st.max_tokens;
                    let reason = last.then(|| finish_reason(st.end, Some(token)));
                    st.finished |= last;
                    st.chunk(vec![token], reason);
                }
                Some(Output::Finished { usage: u, .. }) => {
                    st.guard.disarm();
                    if !st.finished {
                        st.chunk(Vec::new(), Some("length"));
                    }
                    if st.usages.last {
                        let chunk = GenerateChunk {
                            request_id: st.answer.id.clone(),
                            usage: Some(usage(u)),
                            output_mode: st.answer.mode,
                            ..GenerateChunk::default()
                        };
                        st.pending.push_back(data(&chunk));
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

//! SGLang's native API as sglang 0.5.23 serves it ([`kvroute_http::sglang_generate`]):
//! `POST /generate` (a prompt as token ids or text, SGLang's sampling parameters, an answer
//! of text, ids and `meta_info`, whole or as a cumulative SSE stream ending in
//! `data: [DONE]`). Requests are refused in SGLang's two shapes: `{"error": "..."}` for the contract, `{"error": {"message": "..."}}` for the
//! server's checks, both 400. Images come as `image_data` beside `input_ids` that hold one
//! image token per image, which is expanded by the image's size (SGLang's
//! `_expand_input_ids`) and keyed by the caller's `mm_hashes` when given.
//!
//! Where the simulated engine differs from SGLang: one prompt per request (a batch is
//! refused), one sample (`n` above 1 is refused), no adapters
//! (`lora_path` is refused as SGLang refuses it without `--enable-lora`), logprobs simulated
//! ([`crate::logprobs`]) and only for the output, and a
//! token id outside the vocabulary is refused rather than left to the scheduler.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use kvroute_http::sglang_generate::{
    FinishReason, GenerateRequest, GenerateResponse, MetaInfo, OneOrMany, Refusal, TokenIdsOrList,
    decode,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::app::{AppState, Submission, Submitted};
use crate::engine::{Output, Usage};
use crate::service::CancelOnDrop;

/// Why a request is not run: SGLang's refusal, or the engine's own (a prompt its cache can
/// never hold).
enum Refused {
    Sglang(Refusal),
    Engine(Box<kvroute_http::ApiError>),
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Refused::Sglang(r) => (StatusCode::BAD_REQUEST, Json(r.body())).into_response(),
            Refused::Engine(e) => e.into_response(),
        }
    }
}

fn invalid(message: impl Into<String>) -> Refused {
    Refused::Sglang(Refusal::Invalid(message.into()))
}

pub(crate) async fn generate(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return kvroute_http::ApiError::from(e).into_response(),
    };
    let req = match decode(&body).and_then(|r| r.check().map(|()| r)) {
        Ok(r) => r,
        Err(r) => return Refused::Sglang(r).into_response(),
    };
    let images = match images(&state, &req).await {
        Ok(images) => images,
        Err(refused) => return refused.into_response(),
    };
    let leg = match crate::handoff::leg(&body, state.engine.config.disagg.role) {
        Ok(leg) => leg,
        Err(e) => return e.into_response(),
    };
    match admit(&state, &req, images, &leg).await {
        Ok((answer, submitted)) if req.stream => stream_answer(answer, submitted).into_response(),
        Ok((answer, submitted)) => whole(answer, submitted).await,
        Err(refused) => refused.into_response(),
    }
}

/// The prompt handed to the engine and its answer, once SGLang's checks pass.
async fn admit(
    state: &Arc<AppState>,
    req: &GenerateRequest,
    images: Vec<kvroute_preprocess::Image>,
    leg: &crate::handoff::Leg,
) -> Result<(Answer, Submitted), Refused> {
    let tokens = prompt(state, req)?;
    // Each image's one token expanded by its size, as SGLang's processor does for input_ids.
    let (tokens, mm) = match images.is_empty() {
        true => (tokens, None),
        false => {
            let p = state.preprocessor.expand_images(tokens, images);
            let p = p.map_err(|e| invalid(e.to_string()))?;
            (p.tokens, Some(p.mm))
        }
    };
    let params = req.params();
    if params.n.unwrap_or(1) != 1 {
        return Err(invalid("the simulated engine answers one sample: n must be 1"));
    }
    if params.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(invalid("logit_bias is not served by the simulated engine"));
    }
    let len = tokens.len() as u64;
    let context = state.max_model_len;
    if len >= context {
        return Err(invalid(format!(
            "The input ({len} tokens) is longer than the model's context length ({context} tokens)."
        )));
    }
    let max_tokens = match params.max_new_tokens {
        Some(m) => {
            let m = u64::try_from(m).unwrap_or(0);
            if m + len > context {
                return Err(invalid(format!(
                    "Requested token count exceeds the model's maximum context length of {context} tokens. You requested a total of {} tokens: {len} tokens from the input messages and {m} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                    m + len
                )));
            }
            m
        }
        None => context - len,
    };
    if max_tokens == 0 {
        return Err(invalid(
            "the simulated engine generates at least one token: max_new_tokens must be at least 1",
        ));
    }
    let id = match req.rid.as_ref().and_then(OneOrMany::one) {
        Some(rid) => rid.clone(),
        None => format!("{:032x}", state.next_id()),
    };
    let mut submission = Submission {
        id: id.clone(),
        tokens,
        mm,
        max_tokens,
        ignore_eos: params.ignore_eos == Some(true),
        cache_salt: req.cache_salt.as_ref().and_then(OneOrMany::one).cloned(),
        lora: adapter(state, req)?,
        handoff: crate::disagg::Handoff::None,
        hold: None,
        in_store: Vec::new(),
        // SGLang's priority goes first when higher (its default); the engine's, when lower.
        priority: req.priority.map_or(0, i64::saturating_neg),
    };
    state.arrange(leg, &mut submission).await.map_err(|e| Refused::Engine(Box::new(e)))?;
    let submitted = state.submit(submission).map_err(|e| Refused::Engine(Box::new(e)))?;
    state.metrics.sglang_generated();
    let answer = Answer {
        logprobs: asked_logprobs(req)?,
        vocab: u32::try_from(state.preprocessor.vocab_size()).unwrap_or(u32::MAX),
        meta: MetaInfo { id, prompt_tokens: len, ..MetaInfo::default() },
        preprocessor: Arc::clone(&state.preprocessor),
        max_tokens,
    };
    Ok((answer, submitted))
}

/// The request's images (`image_data`: a URL, a data URL, or a list of them, each a string
/// or `{"url": ...}`), loaded within the model's image limits, each keyed by the caller's hash
/// when `mm_hashes` gives one (SGLang's prefix cache keys by it, so a router's hash is the
/// engine's; one processed before comes from the cache), else by its pixels.
async fn images(
    state: &AppState,
    req: &GenerateRequest,
) -> Result<Vec<kvroute_preprocess::Image>, Refused> {
    let urls: Vec<&str> = match req.image_data.as_ref() {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(image_url).collect::<Result<_, _>>()?,
        Some(one) => vec![image_url(one)?],
    };
    let hashes: Vec<Option<&str>> = match req.mm_hashes.as_ref() {
        None | Some(Value::Null) => vec![None; urls.len()],
        Some(Value::Array(h)) if h.len() == urls.len() => h.iter().map(Value::as_str).collect(),
        Some(Value::Array(h)) => {
            let (n, m) = (h.len(), urls.len());
            return Err(invalid(format!("mm_hashes has {n} entries for {m} images")));
        }
        Some(_) => return Err(invalid("mm_hashes must be a list of hex strings")),
    };
    let salt = req.cache_salt.as_ref().and_then(OneOrMany::one).map(String::as_str);
    let images = state.images(&urls, &hashes, salt).await;
    images.map_err(|e| invalid(e.to_string()))
}

/// `return_logprob` with `top_logprobs_num` (0 when absent) and `return_text_in_logprobs`,
/// within vLLM's and SGLang's usual bound of 20 candidates.
fn asked_logprobs(req: &GenerateRequest) -> Result<Option<(u32, bool)>, Refused> {
    if req.return_logprob.as_ref().and_then(OneOrMany::one) != Some(&true) {
        return Ok(None);
    }
    let k = req.top_logprobs_num.as_ref().and_then(OneOrMany::one).copied().unwrap_or(0);
    match u32::try_from(k).ok().filter(|&k| k <= 20) {
        Some(k) => Ok(Some((k, req.return_text_in_logprobs == Some(true)))),
        None => Err(invalid(format!(
            "top_logprobs_num must be between 0 and 20 on the simulated engine, got {k}"
        ))),
    }
}

/// One `image_data` item's URL.
fn image_url(item: &Value) -> Result<&str, Refused> {
    match item {
        Value::String(url) => Ok(url),
        Value::Object(o) => o
            .get("url")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("an image_data item needs a url")),
        _ => Err(invalid("an image_data item must be a URL string or an object with a url")),
    }
}

/// The adapter `lora_path` names (SGLang takes an adapter's name there): one the engine
/// serves, else refused as SGLang refuses it.
fn adapter(state: &AppState, req: &GenerateRequest) -> Result<Option<String>, Refused> {
    let lora = req.lora_path.as_ref().filter(|v| !v.is_null() && v.as_str() != Some(""));
    let Some(lora) = lora else { return Ok(None) };
    let first = match lora {
        Value::Array(a) => a.iter().find(|v| !v.is_null()).cloned().unwrap_or(Value::Null),
        other => other.clone(),
    };
    let name = first.as_str().map_or_else(|| first.to_string(), str::to_owned);
    if state.catalog.contains(&name) {
        return Ok(Some(name));
    }
    let shown: String = name.chars().take(kvroute_http::openai::MAX_ECHOED_CHARS).collect();
    if state.catalog.adapters().is_empty() {
        return Err(invalid(format!(
            "LoRA adapter '{shown}' was requested, but LoRA is not enabled. Please launch the server with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
        )));
    }
    Err(invalid(format!(
        "LoRA adapter '{shown}' is not loaded. Load it with /load_lora_adapter or --lora-paths first."
    )))
}

/// The prompt's token ids: `input_ids` (in the vocabulary), else `text` tokenized as it is.
fn prompt(state: &AppState, req: &GenerateRequest) -> Result<Vec<u32>, Refused> {
    if req.is_batch() {
        return Err(invalid(
            "the simulated engine takes one prompt per request: send input_ids as a flat list",
        ));
    }
    let vocab = i64::try_from(state.preprocessor.vocab_size()).unwrap_or(i64::MAX);
    match (&req.input_ids, &req.text) {
        (Some(TokenIdsOrList::One(ids)), _) => {
            if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= vocab) {
                return Err(invalid(format!(
                    "input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab})."
                )));
            }
            Ok(ids.iter().map(|&t| u32::try_from(t).unwrap_or(0)).collect())
        }
        (None, Some(OneOrMany::One(text))) => {
            state.preprocessor.encode(text).map_err(|e| invalid(e.to_string()))
        }
        _ => Err(invalid("Either text, input_ids or input_embeds should be provided.")),
    }
}

/// What every answer to one request shares.
struct Answer {
    meta: MetaInfo,
    preprocessor: Arc<kvroute_preprocess::Preprocessor>,
    max_tokens: u64,
    /// `return_logprob`: this many top candidates, and whether entries carry their text.
    logprobs: Option<(u32, bool)>,
    vocab: u32,
}

impl Answer {
    /// The answer so far: its whole text and ids, why it ended (if it has), its counts.
    fn so_far(
        &self,
        ids: &[u32],
        text: &str,
        finish: Option<FinishReason>,
        usage: Option<Usage>,
    ) -> Value {
        let mut meta = self.meta.clone();
        meta.completion_tokens = ids.len() as u64;
        meta.finish_reason = finish;
        meta.weight_version = Some("default".to_owned());
        if let Some(u) = usage {
            meta.cached_tokens = u.cached_tokens as u64;
            meta.completion_tokens = u.completion_tokens as u64;
        }
        if let Some((k, with_text)) = self.logprobs {
            let (sampled, top) =
                crate::logprobs::sglang(&self.preprocessor, ids, k, with_text, self.vocab);
            meta.output_token_logprobs_length = Some(sampled.len() as u64);
            meta.output_token_logprobs = Some(sampled);
            meta.input_token_logprobs = Some(Vec::new());
            if top.is_some() {
                meta.input_top_logprobs = Some(Vec::new());
            }
            meta.output_top_logprobs = top;
        }
        let text = Some(text.to_owned());
        let response = GenerateResponse { text, output_ids: ids.to_vec(), meta_info: meta };
        serde_json::to_value(response).unwrap_or_default()
    }

    /// Why `ids` ended: the stop token it generated, or its length.
    fn finish(&self, end: Option<u32>, ids: &[u32]) -> FinishReason {
        match ids.last().copied().filter(|&t| Some(t) == end) {
            Some(token) => FinishReason::matched_token(token),
            None => FinishReason::length(self.max_tokens),
        }
    }
}

async fn whole(answer: Answer, submitted: Submitted) -> Response {
    let end = submitted.end;
    match submitted.finished().await {
        Some((ids, usage)) => {
            let finish = answer.finish(end, &ids);
            let text = answer.preprocessor.decode(&ids).unwrap_or_default();
            Json(answer.so_far(&ids, &text, Some(finish), Some(usage))).into_response()
        }
        None => {
            let message = "the engine stopped before the request finished";
            let body = Json(json!({"error": {"message": message}}));
            (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
        }
    }
}

/// SSE as SGLang streams it by default: a chunk per token with the whole text and ids so
/// far, the last with `finish_reason` and the cache hits, then `data: [DONE]`. Dropping the
/// stream (the client gone) cancels the request.
fn stream_answer(
    answer: Answer,
    submitted: Submitted,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    struct St {
        answer: Answer,
        outputs: mpsc::UnboundedReceiver<Output>,
        guard: CancelOnDrop,
        end: Option<u32>,
        ids: Vec<u32>,
        /// The text so far, a token's piece at a time (decoding the whole answer again for
        /// every chunk would cost the square of its length), a character split across
        /// tokens added whole once its last token is in.
        text: String,
        window: kvroute_preprocess::DecodeWindow,
        /// `[DONE]` is due: the answer's last chunk went out.
        finished: bool,
        done: bool,
    }
    fn data(v: &Value) -> Event {
        Event::default().data(v.to_string())
    }
    let Submitted { outputs, guard, end } = submitted;
    let (ids, text) = (Vec::new(), String::new());
    let window = kvroute_preprocess::DecodeWindow::default();
    let st = St { answer, outputs, guard, end, ids, text, window, finished: false, done: false };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            if st.finished {
                st.done = true;
                return Some((Ok(Event::default().data("[DONE]")), st));
            }
            match st.outputs.recv().await {
                Some(Output::FirstToken { .. }) => {}
                Some(Output::Token { token, index, .. }) => {
                    st.ids.push(token);
                    let piece = st.answer.preprocessor.decode_next(&mut st.window, &[token]);
                    st.text.push_str(&piece);
                    // The last token's chunk waits for the engine's usage (the cache hits).
                    let last = Some(token) == st.end || index as u64 + 1 >= st.answer.max_tokens;
                    if !last {
                        return Some((
                            Ok(data(&st.answer.so_far(&st.ids, &st.text, None, None))),
                            st,
                        ));
                    }
                }
                Some(Output::Finished { usage, .. }) => {
                    st.guard.disarm();
                    st.finished = true;
                    let finish = st.answer.finish(st.end, &st.ids);
                    let last =
                        data(&st.answer.so_far(&st.ids, &st.text, Some(finish), Some(usage)));
                    return Some((Ok(last), st));
                }
                None => return None,
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

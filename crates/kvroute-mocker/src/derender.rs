//! vLLM 0.33's derender endpoints (`scale_out/derender` in its wheel): a whole
//! `output_mode: "tokens"` answer of `/inference/v1/generate` turned into OpenAI's chat
//! completion (`/v1/chat/completions/derender`) or completion (`/v1/completions/derender`),
//! decoded with the engine's tokenizer and no engine run: how a client that asked for token
//! ids gets the text. Refused as vLLM refuses: 400 `Bad Request` for an answer in another
//! mode, 400 `BadRequestError` past the server's bounds, 404 for another model.
//!
//! The streamed form (`stream: true`): one call per chunk of a tokens stream, the client
//! carrying `stream_state` (the decoding window) from each answer to the next call, decoded
//! as vLLM's plain path does (`Preprocessor::decode_next`, the window seeded with the
//! prompt's end); stop strings refused, as vLLM refuses them there.
//!
//! Where the simulated engine differs: no tool or reasoning parser runs (vLLM's plain path),
//! and no logprobs are resolved (the simulated engine has none).

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use kvroute_http::ApiError;
use kvroute_http::openai::{Api, AssistantMessage, Choice, Completion, Delta, Usage};
use kvroute_http::vllm_generate::{
    DerenderChatRequest, DerenderCompletionRequest, DerenderStreamRequest, DerenderStreamResponse,
    DerenderStreamState, GenerateResponse, OutputMode, STREAM_STOP_STRINGS, check_derender,
    derender_streamed, refused,
};
use kvroute_preprocess::DecodeWindow;
use serde_json::Value;

use crate::app::{AppState, now_secs};
use crate::generate::parse;

/// The model name the answer carries, once the request is for this engine's model.
fn admitted(state: &AppState, model: Option<&str>) -> Result<String, ApiError> {
    state.catalog.resolve(model)?;
    Ok(model.filter(|m| !m.is_empty()).unwrap_or(state.catalog.base()).to_owned())
}

/// Each choice's token ids decoded, as OpenAI's choices of `chat` or of a completion.
fn choices(
    state: &AppState,
    answer: &GenerateResponse,
    chat: bool,
) -> Result<Vec<Choice>, ApiError> {
    let mut out = Vec::with_capacity(answer.choices.len());
    for c in &answer.choices {
        let ids = c.token_ids.as_deref().unwrap_or_default();
        let text = state.preprocessor.decode(ids).map_err(|e| refused(e.to_string()))?;
        let finish_reason = c.finish_reason.clone();
        out.push(match chat {
            true => {
                let message = AssistantMessage { role: "assistant".to_owned(), content: text };
                Choice {
                    index: c.index,
                    message: Some(message),
                    finish_reason,
                    ..Choice::default()
                }
            }
            false => {
                Choice { index: c.index, text: Some(text), finish_reason, ..Choice::default() }
            }
        });
    }
    Ok(out)
}

fn usage(prompt_tokens: u64, answers: &[&GenerateResponse]) -> Usage {
    let completion: usize = answers
        .iter()
        .flat_map(|a| &a.choices)
        .map(|c| c.token_ids.as_ref().map_or(0, Vec::len))
        .sum();
    Usage { prompt_tokens_details: None, ..Usage::new(prompt_tokens, completion as u64, 0) }
}

pub(crate) async fn chat(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body?;
    if derender_streamed(&body) {
        let req = parse::<DerenderStreamRequest>(&body)?;
        return Ok(Json(streamed(&state, req, Api::Chat)?).into_response());
    }
    let req = parse::<DerenderChatRequest>(&body)?;
    let model = admitted(&state, req.model.as_deref())?;
    let answer = &req.generate_response;
    check_derender(std::slice::from_ref(answer), state.max_model_len)?;
    let choices = choices(&state, answer, true)?;
    Ok(Json(Completion {
        id: answer.request_id.clone(),
        object: "chat.completion".to_owned(),
        created: now_secs(),
        model,
        choices,
        usage: Some(usage(req.prompt_tokens.unwrap_or(0), &[answer])),
        kv_transfer_params: None,
    })
    .into_response())
}

pub(crate) async fn completion(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body?;
    if derender_streamed(&body) {
        let req = parse::<DerenderStreamRequest>(&body)?;
        return Ok(Json(streamed(&state, req, Api::Completion)?).into_response());
    }
    let req = parse::<DerenderCompletionRequest>(&body)?;
    let model = admitted(&state, req.model.as_deref())?;
    let answers = &req.generate_responses;
    for (name, len) in [
        ("prompt_tokens", req.prompt_tokens.as_ref().map(Vec::len)),
        ("prompt_token_ids", req.prompt_token_ids.as_ref().map(Vec::len)),
    ] {
        if let Some(n) = len.filter(|&n| n != answers.len()) {
            return Err(ApiError::bad_request(format!(
                "1 validation error:\n  Value error, {name} length ({n}) must equal generate_responses length ({})",
                answers.len()
            ))
            .kind("Bad Request"));
        }
    }
    check_derender(answers, state.max_model_len)?;
    // One choice per prompt's choice, numbered across the prompts, as vLLM numbers them.
    let mut all = Vec::new();
    for answer in answers {
        if let Some(c) =
            answer.choices.iter().find(|c| c.token_ids.as_ref().is_none_or(Vec::is_empty))
        {
            return Err(refused(format!(
                "choice {} in response {} has empty or null token_ids",
                c.index, answer.request_id
            )));
        }
        let base = all.len() as u32;
        all.extend(choices(&state, answer, false)?.into_iter().map(|mut c| {
            c.index += base;
            c
        }));
    }
    let prompt_tokens = req.prompt_tokens.as_ref().map_or(0, |p| p.iter().sum());
    let id = answers.first().map(|a| a.request_id.clone()).unwrap_or_default();
    Ok(Json(Completion {
        id,
        object: "text_completion".to_owned(),
        created: now_secs(),
        model,
        choices: all,
        usage: Some(usage(prompt_tokens, &answers.iter().collect::<Vec<_>>())),
        kv_transfer_params: None,
    })
    .into_response())
}

/// One chunk of a tokens stream derendered as `api`'s chunk, with the state for the next
/// call: vLLM's `derender_chat_stream` and `derender_completion_stream` on their plain path.
fn streamed(
    state: &AppState,
    req: DerenderStreamRequest,
    api: Api,
) -> Result<DerenderStreamResponse, ApiError> {
    let model = admitted(state, req.model.as_deref())?;
    let (request, name) = match api {
        Api::Chat => (req.chat_request.as_ref(), "derender_chat_stream"),
        Api::Completion => (req.completion_request.as_ref(), "derender_completion_stream"),
    };
    let stops = request.and_then(|r| r.get("stop")).filter(|s| match s {
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        _ => false,
    });
    if stops.is_some() {
        return Err(refused(STREAM_STOP_STRINGS));
    }
    let chunk = req.generate_chunk;
    if chunk.output_mode != OutputMode::Tokens {
        return Err(ApiError::bad_request(
            "1 validation error:\n  Input should be 'tokens' (generate_chunk.output_mode)",
        )
        .kind("Bad Request")
        .param("generate_chunk"));
    }
    if chunk.choices.len() > 1 {
        let n = chunk.choices.len();
        return Err(refused(format!("{name} expects at most one choice per chunk (got {n}).")));
    }
    if let Some(carried) = &req.stream_state {
        carried.check()?;
    }
    let prompt_len = req.prompt_token_ids.as_ref().map_or(0, Vec::len);
    let prior_len = req.stream_state.as_ref().map_or(0, |s| s.output_token_ids.len());
    let delta_len: usize =
        chunk.choices.iter().filter_map(|c| c.token_ids.as_ref()).map(Vec::len).sum();
    let max = state.max_model_len;
    if (prompt_len + prior_len + delta_len) as u64 > max {
        return Err(refused(format!(
            "prompt_token_ids length ({prompt_len}) plus output_token_ids length ({prior_len}) plus delta ({delta_len}) exceeds max_model_len ({max})."
        )));
    }
    let prompt = req.prompt_token_ids.as_ref().or(chunk.prompt_token_ids.as_ref());
    let mut carried = req.stream_state.unwrap_or_else(|| {
        let seeded = state.preprocessor.decode_window(prompt.map_or(&[][..], Vec::as_slice));
        DerenderStreamState {
            prev_tokens: seeded.prev_tokens,
            prefix_offset: seeded.prefix_offset,
            read_offset: seeded.read_offset,
            ..DerenderStreamState::default()
        }
    });
    let mut window = DecodeWindow {
        prev_tokens: std::mem::take(&mut carried.prev_tokens),
        prefix_offset: carried.prefix_offset,
        read_offset: carried.read_offset,
    };
    let mut choices = Vec::with_capacity(chunk.choices.len());
    for c in &chunk.choices {
        let ids = c.token_ids.as_deref().unwrap_or_default();
        // The token that stopped the answer, when it is named, is no text (as the engine's
        // own detokenizer leaves it out).
        let stopped_by = c.stop_reason.as_ref().and_then(Value::as_u64);
        let text_ids = match (c.finish_reason.as_deref(), ids.split_last()) {
            (Some("stop"), Some((&last, rest))) if stopped_by == Some(u64::from(last)) => rest,
            _ => ids,
        };
        let text = state.preprocessor.decode_next(&mut window, text_ids);
        let context: Vec<u32> =
            carried.logprob_context_token_ids.iter().chain(ids).copied().collect();
        carried.logprob_context_token_ids = context[context.len().saturating_sub(4)..].to_vec();
        let finish_reason = c.finish_reason.clone();
        choices.push(match api {
            Api::Chat => {
                let role = (!carried.role_sent).then(|| "assistant".to_owned());
                carried.role_sent = true;
                let content = (!text.is_empty()).then_some(text);
                let delta = Some(Delta { role, content });
                Choice { index: c.index, delta, finish_reason, ..Choice::default() }
            }
            Api::Completion => {
                carried.logprob_text_offset += text.chars().count();
                Choice { index: c.index, text: Some(text), finish_reason, ..Choice::default() }
            }
        });
    }
    carried.prev_tokens = window.prev_tokens;
    carried.prefix_offset = window.prefix_offset;
    carried.read_offset = window.read_offset;
    let usage = chunk.usage.as_ref().map(|u| {
        let prompt_tokens = req.prompt_tokens.unwrap_or(u.prompt_tokens);
        Usage { prompt_tokens_details: None, ..Usage::new(prompt_tokens, u.completion_tokens, 0) }
    });
    let object = match api {
        Api::Chat => "chat.completion.chunk",
        Api::Completion => "text_completion",
    };
    let chunk = Completion {
        id: chunk.request_id,
        object: object.to_owned(),
        created: now_secs(),
        model,
        choices,
        usage,
        kv_transfer_params: None,
    };
    Ok(DerenderStreamResponse { chunk, stream_state: carried })
}

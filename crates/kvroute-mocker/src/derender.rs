//! vLLM 0.33's derender endpoints (`scale_out/derender` in its wheel): a whole
//! `output_mode: "tokens"` answer of `/inference/v1/generate` turned into OpenAI's chat
//! completion (`/v1/chat/completions/derender`) or completion (`/v1/completions/derender`),
//! decoded with the engine's tokenizer and no engine run: how a client that asked for token
//! ids gets the text. Refused as vLLM refuses: 400 `Bad Request` for an answer in another
//! mode, 400 `BadRequestError` past the server's bounds, 404 for another model.
//!
//! Where the simulated engine differs: the streamed form (one call per chunk, carrying
//! `stream_state`) is refused, and no tool or reasoning parser runs (vLLM's plain path).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use kvroute_http::ApiError;
use kvroute_http::openai::{AssistantMessage, Choice, Completion, Usage, check_model};
use kvroute_http::vllm_generate::{
    DerenderChatRequest, DerenderCompletionRequest, GenerateResponse, check_derender, refused,
};

use crate::http::{AppState, now_secs};

/// The model name the answer carries, once the request is one this engine derenders: the
/// whole form, for its model.
fn admitted(state: &AppState, stream: bool, model: Option<&str>) -> Result<String, ApiError> {
    if stream {
        return Err(refused("streamed derender (stream: true with stream_state) is not served by the simulated engine; derender the whole answer").param("stream"));
    }
    let served = state.preprocessor.model_name();
    check_model(served, model)?;
    Ok(model.filter(|m| !m.is_empty()).unwrap_or(served).to_owned())
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
    body: Result<Json<DerenderChatRequest>, JsonRejection>,
) -> Result<Json<Completion>, ApiError> {
    let Json(req) = body?;
    let model = admitted(&state, req.stream, req.model.as_deref())?;
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
    }))
}

pub(crate) async fn completion(
    State(state): State<Arc<AppState>>,
    body: Result<Json<DerenderCompletionRequest>, JsonRejection>,
) -> Result<Json<Completion>, ApiError> {
    let Json(req) = body?;
    let model = admitted(&state, req.stream, req.model.as_deref())?;
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
    }))
}

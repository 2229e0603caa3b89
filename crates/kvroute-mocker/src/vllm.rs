//! vLLM's HTTP endpoints that routers call besides the OpenAI API, in the shapes of vLLM 0.11
//! and later: `POST /tokenize` and `/detokenize`, and `POST /v1/chat/completions/render` and
//! `/v1/completions/render` (a request's token ids without running it; vllm-router's
//! `kv_aware` policy hashes them to match the blocks of the KV events). Tokens are the
//! engine's own: the chat template, the tokenizer and image placeholders the OpenAI API uses.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use kvroute_http::ApiError;
use kvroute_http::openai::{ChatCompletionRequest, ChatMessage, CompletionRequest};
use serde::{Deserialize, Serialize};

use crate::app::AppState;

/// `POST /tokenize`: a prompt, or chat messages through the template.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenizeRequest {
    Chat {
        #[serde(default)]
        model: Option<String>,
        messages: Vec<ChatMessage>,
        #[serde(default = "yes")]
        add_generation_prompt: bool,
        #[serde(default)]
        return_token_strs: bool,
    },
    Prompt {
        #[serde(default)]
        model: Option<String>,
        prompt: String,
        #[serde(default)]
        return_token_strs: bool,
    },
}

fn yes() -> bool {
    true
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u64,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

pub(crate) async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let Json(req) = body?;
    let pre = &state.preprocessor;
    let (tokens, strs) = match req {
        TokenizeRequest::Chat { model, messages, add_generation_prompt, return_token_strs } => {
            state.catalog.resolve(model.as_deref())?;
            let loaded = pre
                .load_images(&messages, &state.fetcher)
                .await
                .map_err(|e| ApiError::from(e).param("messages"))?;
            let images = loaded.into_iter().map(|l| l.image).collect();
            let prepared = pre
                .prepare_chat(&messages, add_generation_prompt, images)
                .map_err(|e| ApiError::from(e).param("messages"))?;
            (prepared.tokens, return_token_strs)
        }
        TokenizeRequest::Prompt { model, prompt, return_token_strs } => {
            state.catalog.resolve(model.as_deref())?;
            let tokens = pre.encode(&prompt).map_err(|e| ApiError::from(e).param("prompt"))?;
            (tokens, return_token_strs)
        }
    };
    let token_strs = strs.then(|| pre.token_strings(&tokens));
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.max_model_len,
        tokens,
        token_strs,
    }))
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub(crate) async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let Json(req) = body?;
    let pre = &state.preprocessor;
    state.catalog.resolve(req.model.as_deref())?;
    let prompt = pre.decode(&req.tokens).map_err(|e| ApiError::from(e).param("tokens"))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// What a render answers: the request's prompt as the engine would run it.
#[derive(Debug, Serialize, Deserialize)]
pub struct RenderResponse {
    pub request_id: String,
    pub token_ids: Vec<u32>,
    pub prompt_token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub max_model_len: u64,
}

fn rendered(state: &AppState, tokens: Vec<u32>) -> RenderResponse {
    RenderResponse {
        request_id: format!("render-{:016x}", state.plan(&tokens, true).key()),
        num_prompt_tokens: tokens.len(),
        prompt_token_ids: tokens.clone(),
        token_ids: tokens,
        max_model_len: state.max_model_len,
    }
}

pub(crate) async fn render_chat(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Json<RenderResponse>, ApiError> {
    let Json(req) = body?;
    state.catalog.resolve(req.model.as_deref())?;
    let (prepared, _) =
        state.preprocessor.prepare_chat_request(&req, &state.fetcher, state.max_model_len).await?;
    state.metrics.rendered();
    Ok(Json(rendered(&state, prepared.tokens)))
}

pub(crate) async fn render_completion(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Json<RenderResponse>, ApiError> {
    let Json(req) = body?;
    state.catalog.resolve(req.model.as_deref())?;
    let prepared = state.preprocessor.prepare_completion_request(&req, state.max_model_len)?;
    state.metrics.rendered();
    Ok(Json(rendered(&state, prepared.tokens)))
}

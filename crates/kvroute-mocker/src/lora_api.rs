//! vLLM's dynamic adapter API (served with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; here with
//! `--enable-lora-updating`): `POST /v1/load_lora_adapter {lora_name, lora_path,
//! load_inplace}` and `POST /v1/unload_lora_adapter {lora_name}`, with vLLM 0.33's answers
//! (`entrypoints/openai/models/serving.py`): 200 and a text line on success, 400
//! `InvalidUserInput` for a missing field, a name already served or the base model's, 404
//! `NotFoundError` to unload an adapter that is not served.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use kvroute_http::ApiError;
use kvroute_http::models::AdapterError;
use serde::Deserialize;

use crate::app::AppState;

#[derive(Debug, Deserialize)]
pub(crate) struct LoadLoraAdapter {
    #[serde(default)]
    pub(crate) lora_name: String,
    #[serde(default)]
    pub(crate) lora_path: String,
    #[serde(default)]
    pub(crate) load_inplace: bool,
}

#[derive(Debug, Deserialize)]
pub(crate) struct UnloadLoraAdapter {
    #[serde(default)]
    pub(crate) lora_name: String,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message).kind("InvalidUserInput")
}

fn shown(name: &str) -> String {
    name.chars().take(kvroute_http::openai::MAX_ECHOED_CHARS).collect()
}

pub(crate) async fn load(
    State(state): State<Arc<AppState>>,
    body: Result<Json<LoadLoraAdapter>, JsonRejection>,
) -> Result<String, ApiError> {
    let Json(req) = body?;
    if req.lora_name.is_empty() || req.lora_path.is_empty() {
        return Err(invalid("Both 'lora_name' and 'lora_path' must be provided."));
    }
    let name = shown(&req.lora_name);
    if !req.load_inplace && state.catalog.contains(&req.lora_name) {
        return Err(invalid(format!(
            "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
        )));
    }
    match state.catalog.insert(&req.lora_name, Some(&req.lora_path)) {
        Ok(_) => Ok(format!("Success: LoRA adapter '{name}' added successfully.")),
        Err(AdapterError::BaseName) => {
            Err(invalid(format!("The lora adapter '{name}' conflicts with a served base model.")))
        }
        Err(e) => Err(invalid(e.to_string())),
    }
}

pub(crate) async fn unload(
    State(state): State<Arc<AppState>>,
    body: Result<Json<UnloadLoraAdapter>, JsonRejection>,
) -> Result<String, ApiError> {
    let Json(req) = body?;
    if req.lora_name.is_empty() {
        return Err(invalid("'lora_name' needs to be provided to unload a LoRA adapter."));
    }
    let name = shown(&req.lora_name);
    if !state.catalog.remove(&req.lora_name) {
        return Err(ApiError::not_found(format!("The lora adapter '{name}' cannot be found."))
            .kind("NotFoundError"));
    }
    state.engine.unload_adapter(&req.lora_name);
    Ok(format!("Success: LoRA adapter '{name}' removed successfully."))
}

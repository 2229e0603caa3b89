//! The engines' native token bodies, placed by their token ids: vLLM's token-in API
//! (`POST /inference/v1/generate`, [`kvroute_http::vllm_generate`]) and SGLang's `/generate`
//! with `input_ids` ([`kvroute_http::sglang_generate`]). A gateway fleet whose clients speak
//! these APIs gets KV-aware routing too: the picker hashes the ids as the front door hashes a
//! prompt it tokenized (images by their `mm_hashes` for vLLM's features; the key's cache
//! namespace and the adapter folded in) and places the request as any other.
//!
//! What is not placed goes on in turn (the picker's caller decides): a SGLang prompt given
//! as text, or a batch, which the engine tokenizes or splits itself.

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvroute_core::{BlockHasher, RequestExtraInfo};
use kvroute_http::ApiError;
use kvroute_http::auth::KeyId;
use kvroute_http::openai::Api;
use kvroute_http::{sglang_generate, vllm_generate};
use kvroute_router::PlaceRequest;
use serde_json::Value;

use crate::FrontendState;
use crate::outbound::Outbound;

/// The native routes the picker places.
pub const NATIVE_PATHS: [&str; 2] = [vllm_generate::PATH, sglang_generate::PATH];

/// What a native body names, read the way its engine reads it.
struct Native {
    tokens: Vec<u32>,
    mm: Option<RequestExtraInfo>,
    model: Option<String>,
    salt: Option<String>,
    streamed: bool,
    output_tokens: usize,
}

fn ids(ids: &[i64], param: &'static str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&t| u32::try_from(t))
        .collect::<Result<_, _>>()
        .map_err(|_| ApiError::bad_request(format!("{param} must be token ids")).param(param))
}

fn vllm(body: &[u8]) -> Result<Native, ApiError> {
    let req: vllm_generate::GenerateRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body: {e}")))?;
    req.check()?;
    Ok(Native {
        tokens: ids(&req.token_ids, "token_ids")?,
        mm: req.features.as_ref().map(vllm_generate::MultiModalFeatures::extra_info),
        model: req.model.clone(),
        salt: req.cache_salt.clone(),
        streamed: req.streamed(),
        output_tokens: req.sampling_params.max_tokens.map_or(0, |m| m.max(0) as usize),
    })
}

/// SGLang's body with one list of `input_ids` and no images; `None` otherwise.
fn sglang(body: &[u8]) -> Result<Option<Native>, ApiError> {
    let req: sglang_generate::GenerateRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body: {e}")))?;
    let Some(sglang_generate::TokenIdsOrList::One(input)) = &req.input_ids else {
        return Ok(None);
    };
    if req.image_data.is_some() || req.lora_path.is_some() {
        return Ok(None);
    }
    let salt = match &req.cache_salt {
        Some(s) => match s.one() {
            Some(s) => Some(s.clone()),
            None => return Ok(None),
        },
        None => None,
    };
    let output = req.sampling_params.as_ref().and_then(|p| p.one()?.max_new_tokens);
    Ok(Some(Native {
        tokens: ids(input, "input_ids")?,
        mm: None,
        model: None,
        salt,
        streamed: req.stream,
        output_tokens: output.map_or(0, |m| m.max(0) as usize),
    }))
}

impl FrontendState {
    /// A native token body at `path` (one of [`NATIVE_PATHS`]) made an [`Outbound`]: its
    /// transfer fields refused, its ids hashed with the key's namespace and its adapter, its
    /// class read as the front door reads one. `None` when it is not one the picker places.
    pub(crate) fn native_outbound(
        &self,
        path: &'static str,
        key: Option<&KeyId>,
        (headers, trace): (&HeaderMap, Option<kvroute_http::trace::TraceContext>),
        body: &Bytes,
    ) -> Result<Option<Outbound>, ApiError> {
        self.check_transfer_fields(body, Some("application/json"))?;
        let mut raw: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not JSON: {e}")))?;
        let native = match path {
            vllm_generate::PATH => vllm(body)?,
            _ => match sglang(body)? {
                Some(n) => n,
                None => return Ok(None),
            },
        };
        if native.tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        let adapter = self.models.resolve(native.model.as_deref())?;
        let (class, _) = crate::handlers::class(self, headers, key, adapter.as_deref())?;
        let session = crate::handlers::session(headers, None)?;
        let session = self.session_key(key, session);
        let namespace = self.namespace(key, native.salt.as_deref());
        let blocks = native.mm.as_ref().filter(|mm| !mm.mm_objects.is_empty());
        let blocks = blocks.map(|mm| mm.to_block_level(self.block_size, native.tokens.len()));
        let local = BlockHasher::new(self.block_size)
            .with_namespace(namespace.as_deref())
            .with_lora(adapter.as_deref())
            .local_hashes(&native.tokens, blocks.as_deref());
        if let (Some(ns), Some(fields)) = (&namespace, raw.as_object_mut())
            && native.salt.as_deref() != Some(ns.as_str())
        {
            fields.insert("cache_salt".to_owned(), Value::String(ns.clone()));
        }
        let body = Bytes::from(serde_json::to_vec(&raw).map_err(ApiError::internal)?);
        let prompt_tokens = native.tokens.len();
        Ok(Some(Outbound {
            path,
            body,
            kind: Api::Completion,
            tokens: Vec::new(),
            place: PlaceRequest {
                local_hashes: local.into(),
                num_tokens: prompt_tokens,
                output_tokens: native.output_tokens,
                adapter,
                session,
                class: Some(class),
                ..PlaceRequest::default()
            },
            prompt_tail: native.tokens[prompt_tokens.saturating_sub(8)..].to_vec(),
            streamed: native.streamed,
            strip_usage: false,
            trace,
            explain: crate::handlers::explain(self, headers),
            // A native route's answer is the engine's own shape: not continued elsewhere.
            resume: None,
            continued: false,
        }))
    }
}

//! vLLM's token-in, token-out API, field by field as vLLM 0.33 defines it
//! (`vllm/entrypoints/scale_out/token_in_token_out/protocol.py` and `serving.py` in its
//! wheel): `POST /inference/v1/generate` takes token ids and sampling parameters and answers
//! with token ids (`output_mode: "tokens"`, the default) or also the text (`"text"`), whole or
//! streamed as SSE. kvroute's front door sends it the prompt it already tokenized; the
//! simulated engine serves it.
//!
//! Like vLLM's pydantic models, the requests ignore fields they do not know (the sampling
//! parameters keep them, to pass on); [`GenerateRequest::check`] applies vLLM's own rules, with
//! its messages, so the simulated engine refuses what vLLM refuses.

use std::collections::BTreeMap;

use kvroute_core::hash::mm_hash_from_identifier;
use kvroute_core::{RequestExtraInfo, RequestMmObjectInfo};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ApiError;
use crate::openai::Usage;

/// `POST /inference/v1/generate`.
pub const PATH: &str = "/inference/v1/generate";

/// What the answer carries: token ids only, or the text too (vLLM's `derender`, a parsed chat
/// message, is not served).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputMode {
    #[default]
    Tokens,
    Text,
    Derender,
}

/// vLLM's `GenerateRequest`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The caller's id (vLLM answers `generate-tokens-<id>`); absent: a random one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// At least one, none negative (a number too large for `i64` does not parse).
    pub token_ids: Vec<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<MultiModalFeatures>,
    /// Raw multimodal input the server resolves; not with `features`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_parts: Option<Vec<Map<String, Value>>>,
    pub sampling_params: SamplingParams,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Answer with the prompt's token ids too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_token_ids: Option<bool>,
    #[serde(default)]
    pub output_mode: OutputMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ec_transfer_params: Option<Map<String, Value>>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// vLLM's `SamplingParams`, the fields the simulated engine reads or checks; every other one
/// is kept in `other`. Absent fields take vLLM's defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    /// Absent: as many as the context has room for (vLLM's server-side default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Default true; `output_mode` text needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detokenize: Option<bool>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// vLLM's `MultiModalFeatures`: each item's hash and where its placeholder tokens are.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MultiModalFeatures {
    pub mm_hashes: BTreeMap<String, Vec<String>>,
    pub mm_placeholders: BTreeMap<String, Vec<PlaceholderRange>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kwargs_data: Option<BTreeMap<String, Vec<Option<String>>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mm_metadata: Option<BTreeMap<String, Vec<Option<String>>>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaceholderRange {
    /// Start of the placeholder tokens in the prompt.
    pub offset: i64,
    /// How many (at least one).
    pub length: i64,
}

/// A choice of a whole answer (`GenerateTokensChoice`, or `GenerateTextChoice` with `text`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateChoice {
    pub index: u32,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub stop_reason: Option<Value>,
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    /// In `text` mode: the text (of the new tokens, in a stream chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default)]
    pub routed_experts: Option<String>,
    #[serde(default)]
    pub sampling_mask: Option<Value>,
    #[serde(default)]
    pub weight_versions: Option<Value>,
}

/// A whole answer (`GenerateTokensResponse` or `GenerateTextResponse`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateResponse {
    pub request_id: String,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub created: Option<u64>,
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub prompt_logprobs: Option<Value>,
    #[serde(default)]
    pub prompt_token_id_logprobs: Option<String>,
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub mm_placeholders: Option<BTreeMap<String, Vec<PlaceholderRange>>>,
    #[serde(default)]
    pub metrics: Option<Value>,
    #[serde(default)]
    pub kv_transfer_params: Option<Map<String, Value>>,
    #[serde(default)]
    pub ec_transfer_params: Option<Map<String, Value>>,
    #[serde(default)]
    pub output_mode: OutputMode,
    pub choices: Vec<GenerateChoice>,
}

/// One SSE chunk of a streamed answer: the new token ids of a choice, or at the end (with
/// `stream_options.include_usage`) no choice and the usage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateChunk {
    pub request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub output_mode: OutputMode,
    pub choices: Vec<GenerateChoice>,
}

/// `POST /v1/chat/completions/derender`: a whole `output_mode: "tokens"` answer turned into
/// OpenAI's chat completion, with no engine run.
pub const DERENDER_CHAT_PATH: &str = "/v1/chat/completions/derender";
/// `POST /v1/completions/derender`: one tokens answer per prompt into OpenAI's completion.
pub const DERENDER_COMPLETION_PATH: &str = "/v1/completions/derender";

/// vLLM's `DerenderChatRequest` (and, with `stream: true`, the streamed form's marker).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DerenderChatRequest {
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub generate_response: GenerateResponse,
    /// For the usage (0 when absent: the answer carries only output tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// The chat request as `/render` took it (vLLM's parsers read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_request: Option<Value>,
}

/// vLLM's `DerenderCompletionRequest`: one tokens answer per prompt.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DerenderCompletionRequest {
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub generate_responses: Vec<GenerateResponse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<Option<Vec<u32>>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_request: Option<Value>,
}

/// vLLM's `DerenderStreamState`: what a streamed derender's client carries from one call to
/// the next. The first three fields are the decoding window
/// (`kvroute_preprocess::DecodeWindow`); the parser fields are kept as they came (no parser
/// runs here), within vLLM's bounds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DerenderStreamState {
    #[serde(default)]
    pub prev_tokens: Vec<String>,
    #[serde(default)]
    pub prefix_offset: usize,
    #[serde(default)]
    pub read_offset: usize,
    #[serde(default)]
    pub role_sent: bool,
    #[serde(default)]
    pub logprob_context_token_ids: Vec<u32>,
    #[serde(default)]
    pub logprob_text_offset: usize,
    #[serde(default)]
    pub output_token_ids: Vec<u32>,
    #[serde(default)]
    pub output_chunk_lens: Vec<u64>,
    #[serde(default)]
    pub tools_streamed: bool,
    #[serde(default)]
    pub last_tool_call_ids: Vec<String>,
}

/// vLLM's bound on a carried window (`DerenderStreamState._bound_prev_tokens`).
pub const MAX_PREV_TOKENS: usize = 1024;

impl DerenderStreamState {
    /// vLLM's validators of a carried state: the window within [`MAX_PREV_TOKENS`], at most
    /// 4 logprob context ids, chunk lengths positive and summing to the output ids.
    pub fn check(&self) -> Result<(), ApiError> {
        let n = self.prev_tokens.len();
        if n > MAX_PREV_TOKENS {
            let m = format!(
                "Value error, prev_tokens length ({n}) exceeds maximum ({MAX_PREV_TOKENS})"
            );
            return Err(invalid("stream_state", &m));
        }
        if self.logprob_context_token_ids.len() > 4 {
            let m = "List should have at most 4 items after validation";
            return Err(invalid("stream_state", m));
        }
        if self.output_chunk_lens.contains(&0) {
            return Err(invalid("stream_state", "Input should be greater than 0"));
        }
        let total: u64 = self.output_chunk_lens.iter().sum();
        if total != self.output_token_ids.len() as u64 {
            let m = format!(
                "Value error, output_chunk_lens must sum to len(output_token_ids) (got sum={total}, len(output_token_ids)={})",
                self.output_token_ids.len()
            );
            return Err(invalid("stream_state", &m));
        }
        Ok(())
    }
}

/// vLLM's `DerenderChatStreamRequest` and `DerenderCompletionStreamRequest` (the request
/// field is `chat_request` or `completion_request`): one chunk of a tokens stream, with the
/// state the previous call returned.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DerenderStreamRequest {
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub generate_chunk: GenerateChunk,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_state: Option<DerenderStreamState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_request: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_request: Option<Value>,
}

/// The answer to one streamed derender call: OpenAI's chunk and the state for the next.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DerenderStreamResponse {
    pub chunk: crate::openai::Completion,
    pub stream_state: DerenderStreamState,
}

/// vLLM's refusal of stop strings in a streamed derender.
pub const STREAM_STOP_STRINGS: &str = "stop strings are not supported by streaming derender because text already sent cannot be cut. Use non-streaming derender or output_mode=text on /inference/v1/generate which holds stop strings back.";

/// Whether a derender body asks for the streamed form (`stream: true`): vLLM tells its two
/// request shapes apart by that field alone.
pub fn derender_streamed(body: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Flag {
        #[serde(default)]
        stream: Option<Value>,
    }
    serde_json::from_slice::<Flag>(body).is_ok_and(|f| f.stream == Some(Value::Bool(true)))
}

/// vLLM's `VLLM_MAX_N_SEQUENCES` default: the most answers, or choices of one, derendered.
pub const MAX_N_SEQUENCES: usize = 16384;

/// vLLM's checks of answers to derender, before any decoding: each is `output_mode:
/// "tokens"` (the others are already text), and none is larger than the server allows.
pub fn check_derender(answers: &[GenerateResponse], max_model_len: u64) -> Result<(), ApiError> {
    if let Some(a) = answers.iter().find(|a| a.output_mode != OutputMode::Tokens) {
        let mode = serde_json::to_string(&a.output_mode).unwrap_or_default().replace('"', "'");
        let m = format!("Input should be 'tokens' (output_mode is {mode})");
        return Err(invalid("output_mode", &m));
    }
    if answers.len() > MAX_N_SEQUENCES {
        return Err(refused(format!(
            "generate_responses count ({}) exceeds server maximum ({MAX_N_SEQUENCES}). Set VLLM_MAX_N_SEQUENCES to increase this limit.",
            answers.len()
        )));
    }
    for a in answers {
        if a.choices.len() > MAX_N_SEQUENCES {
            return Err(refused(format!(
                "choices count ({}) in response '{}' exceeds server maximum ({MAX_N_SEQUENCES}).",
                a.choices.len(),
                a.request_id
            )));
        }
        for c in &a.choices {
            let n = c.token_ids.as_ref().map_or(0, Vec::len);
            if n as u64 > max_model_len {
                return Err(refused(format!(
                    "token_ids length ({n}) in choice {} exceeds max_model_len ({max_model_len}).",
                    c.index
                )));
            }
        }
    }
    Ok(())
}

/// vLLM's length limit and forbidden characters of `cache_salt`.
pub const MAX_CACHE_SALT_CHARS: usize = 128;
const CACHE_SALT_FORBIDDEN: [char; 4] = ['@', '/', '\\', '\0'];

/// A request vLLM's pydantic model refuses: 400, `"type": "Bad Request"`, the field as
/// `param`.
fn invalid(param: &'static str, message: &str) -> ApiError {
    ApiError::bad_request(format!("1 validation error:\n  {message}"))
        .kind("Bad Request")
        .param(param)
}

/// A request vLLM's server refuses after parsing it: 400, `"type": "BadRequestError"`.
pub fn refused(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message).kind("BadRequestError")
}

/// vLLM 0.33's rule for `cache_salt`, on every API that takes one: not empty, at most 128
/// characters, none of `@ / \\` or NUL.
pub fn check_cache_salt(salt: Option<&str>) -> Result<(), ApiError> {
    let Some(salt) = salt else { return Ok(()) };
    if salt.is_empty() {
        let m = "Parameter 'cache_salt' must be a non-empty string if provided.";
        return Err(invalid("cache_salt", m));
    }
    if salt.chars().count() > MAX_CACHE_SALT_CHARS || salt.contains(CACHE_SALT_FORBIDDEN) {
        let m = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.";
        return Err(invalid("cache_salt", m));
    }
    Ok(())
}

impl GenerateRequest {
    /// Whether the answer streams.
    pub fn streamed(&self) -> bool {
        self.stream == Some(true)
    }

    /// vLLM's checks of the request and of its sampling parameters, in its words.
    pub fn check(&self) -> Result<(), ApiError> {
        if self.token_ids.is_empty() {
            return Err(invalid(
                "token_ids",
                "List should have at least 1 item after validation, not 0",
            ));
        }
        if self.token_ids.iter().any(|&t| t < 0) {
            return Err(invalid(
                "token_ids",
                "Value error, token_ids must not contain negative values",
            ));
        }
        if self.content_parts.as_ref().is_some_and(|c| !c.is_empty()) && self.features.is_some() {
            return Err(invalid(
                "features",
                "Value error, content_parts and features are mutually exclusive",
            ));
        }
        check_cache_salt(self.cache_salt.as_deref())?;
        if self.output_mode != OutputMode::Tokens && self.sampling_params.detokenize == Some(false)
        {
            let mode =
                serde_json::to_string(&self.output_mode).unwrap_or_default().replace('"', "'");
            return Err(invalid(
                "output_mode",
                &format!(
                    "Value error, output_mode={mode} requires sampling_params.detokenize to be true"
                ),
            ));
        }
        if let Some(features) = &self.features {
            features.check(self.token_ids.len())?;
        }
        self.sampling_params.check()
    }
}

impl MultiModalFeatures {
    /// The items as kvroute hashes them: each item's hash (kvroute's 16-hex form, or any
    /// identifier, by the identifier rule) over its placeholder range.
    pub fn extra_info(&self) -> RequestExtraInfo {
        let mut mm_objects = Vec::new();
        for (modality, hashes) in &self.mm_hashes {
            let placeholders = self.mm_placeholders.get(modality).map_or(&[][..], Vec::as_slice);
            for (hash, p) in hashes.iter().zip(placeholders) {
                let start = usize::try_from(p.offset).unwrap_or(0);
                let end = start.saturating_add(usize::try_from(p.length).unwrap_or(0));
                mm_objects.push(RequestMmObjectInfo {
                    mm_hash: mm_hash_from_identifier(hash),
                    offsets: vec![(start, end)],
                });
            }
        }
        RequestExtraInfo { mm_objects }
    }

    /// Hashes and placeholders of the same modalities and counts, placeholders sorted, apart
    /// and inside the prompt of `prompt_len` tokens.
    pub fn check(&self, prompt_len: usize) -> Result<(), ApiError> {
        let bad = |m: &str| Err(invalid("features", &format!("Value error, {m}")));
        if !self.mm_hashes.keys().eq(self.mm_placeholders.keys()) {
            return bad("mm_hashes and mm_placeholders must use the same modalities");
        }
        let mut ranges = Vec::new();
        for (modality, hashes) in &self.mm_hashes {
            let placeholders = &self.mm_placeholders[modality];
            if hashes.len() != placeholders.len() {
                return bad(&format!(
                    "{modality} mm_hashes and mm_placeholders must have the same length"
                ));
            }
            for p in placeholders {
                if p.offset < 0 || p.length <= 0 {
                    return bad("a placeholder's offset is at least 0 and its length at least 1");
                }
                ranges.push((p.offset, p.offset.saturating_add(p.length)));
            }
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
            return bad("mm_placeholders must be globally non-overlapping and sorted");
        }
        let len = i64::try_from(prompt_len).unwrap_or(i64::MAX);
        if ranges.iter().any(|&(_, end)| end > len) {
            return bad("mm_placeholders must remain within the token_ids sequence");
        }
        Ok(())
    }
}

impl SamplingParams {
    /// vLLM's `SamplingParams._verify_args`, the parts on the fields kept here.
    pub fn check(&self) -> Result<(), ApiError> {
        let bad =
            |param: &'static str, m: String| Err(invalid(param, &format!("Value error, {m}")));
        let n = self.n.unwrap_or(1);
        if n < 1 {
            return bad("n", format!("n must be at least 1, got {n}."));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = value.filter(|v| !(-2.0..=2.0).contains(v)) {
                return bad(name, format!("{name} must be in [-2, 2], got {v}."));
            }
        }
        if let Some(r) = self.repetition_penalty.filter(|r| !(r.is_finite() && *r > 0.0)) {
            return bad(
                "repetition_penalty",
                format!("repetition_penalty must be greater than zero, got {r}."),
            );
        }
        if let Some(t) = self.temperature.filter(|t| !(t.is_finite() && (0.0..=2.0).contains(t))) {
            return bad("temperature", format!("temperature must be in [0, 2], got {t}."));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad("top_p", format!("top_p must be in (0, 1], got {p}."));
        }
        if let Some(k) = self.top_k.filter(|k| *k < -1) {
            return bad("top_k", format!("top_k must be 0 (disable), or at least 1, got {k}."));
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad("min_p", format!("min_p must be in [0, 1], got {p}."));
        }
        if let Some(m) = self.max_tokens.filter(|m| *m < 1) {
            return bad("max_tokens", format!("max_tokens must be at least 1, got {m}."));
        }
        let min = self.min_tokens.unwrap_or(0);
        if min < 0 {
            return bad(
                "min_tokens",
                format!("min_tokens must be greater than or equal to 0, got {min}."),
            );
        }
        if let Some(max) = self.max_tokens.filter(|max| min > *max) {
            return bad(
                "min_tokens",
                format!("min_tokens must be less than or equal to max_tokens={max}, got {min}."),
            );
        }
        Ok(())
    }
}

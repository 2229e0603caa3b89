//! The OpenAI API as kvroute speaks it: chat and completion requests (only the fields kvroute
//! reads; everything else a client sends is passed on untouched by the front door and ignored
//! by the simulated engine, as vLLM ignores it), the answers and stream chunks the simulated
//! engine writes and the bench reads, and the model list.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ApiError;

/// A chat message: text, or parts of text and images.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "content must be a string or an array of content parts")]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImageUrl {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// A caller-chosen id of the image (vLLM's multimodal UUID); the front door sets it to the
    /// image's identifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn text(role: &str, text: &str) -> Self {
        Self { role: role.to_owned(), content: Some(MessageContent::Text(text.to_owned())) }
    }
}

/// One token's entry of OpenAI's chat logprobs (`choices[].logprobs.content[]`, and each of
/// its `top_logprobs`): the token's text, its log probability and its UTF-8 bytes.
pub fn chat_logprob(token: &str, logprob: impl Into<Value>) -> Value {
    serde_json::json!({"token": token, "logprob": logprob.into(), "bytes": token.as_bytes()})
}

/// The image URLs of `messages`, in the order their placeholders appear.
pub fn image_urls(messages: &[ChatMessage]) -> Vec<&str> {
    messages
        .iter()
        .filter_map(|m| match &m.content {
            Some(MessageContent::Parts(parts)) => Some(parts),
            _ => None,
        })
        .flatten()
        .filter_map(|p| match p {
            ContentPart::ImageUrl { image_url } => Some(image_url.url.as_str()),
            ContentPart::Text { .. } => None,
        })
        .collect()
}

/// A `/v1/completions` prompt: text, or token ids given directly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged, expecting = "prompt must be a string or an array of token ids")]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions`, the fields kvroute reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension: generate past the end-of-turn token, up to the output limit.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's cache namespace: prefixes are shared only between requests with the same salt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// OpenAI's key for requests that share a prompt prefix: kvroute routes it as a session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
    /// vLLM's extension: the request's priority under `--scheduling-policy priority` (lower
    /// first); an engine on `fcfs` refuses any other than 0.
    #[serde(default)]
    pub priority: i64,
}

impl ChatCompletionRequest {
    /// The output limit asked for (`max_completion_tokens` wins over `max_tokens`).
    pub fn max_output_tokens(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// `POST /v1/completions`, the fields kvroute reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: CompletionPrompt,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension: generate past the end-of-turn token, up to the output limit.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's cache namespace (see [`ChatCompletionRequest::cache_salt`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// See [`ChatCompletionRequest::prompt_cache_key`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
    /// See [`ChatCompletionRequest::priority`].
    #[serde(default)]
    pub priority: i64,
}

/// Tokens of one request; `prompt_tokens_details.cached_tokens` are the prompt tokens the
/// engine served from its prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    #[serde(default)]
    pub cached_tokens: u64,
}

impl Usage {
    pub fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    pub fn cached_tokens(&self) -> u64 {
        self.prompt_tokens_details.map_or(0, |d| d.cached_tokens)
    }
}

/// The assistant's whole answer in a non-streamed chat completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    pub role: String,
    pub content: String,
}

/// A streamed chunk's new text for a chat completion.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of an answer or a stream chunk, chat or completion: a chat answer has
/// `message`, a chat chunk `delta`, a completion (answer or chunk) `text`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
}

impl Choice {
    /// The text this choice adds, whatever its kind.
    pub fn new_text(&self) -> Option<&str> {
        self.text
            .as_deref()
            .or_else(|| self.delta.as_ref().and_then(|d| d.content.as_deref()))
            .or_else(|| self.message.as_ref().map(|m| m.content.as_str()))
    }
}

/// An answer (`chat.completion`, `text_completion`) or a stream chunk
/// (`chat.completion.chunk`, `text_completion`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// vLLM's extension: what a prefill engine answers a disaggregated prefill with, for the
    /// decode engine to pull its KV (on a whole answer, and a stream's last chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<serde_json::Value>,
}

/// Which OpenAI API a request and its answer are of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

/// What every answer and stream chunk of one request shares: its API, id, time and model.
#[derive(Clone, Debug)]
pub struct Envelope {
    pub api: Api,
    /// The answer's id (`chatcmpl-...`, `cmpl-...`).
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Envelope {
    /// For request `n` of `api`, now: the id is OpenAI's form of `n`.
    pub fn new(api: Api, n: &str, model: String) -> Self {
        let id = match api {
            Api::Chat => format!("chatcmpl-{n}"),
            Api::Completion => format!("cmpl-{n}"),
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self { api, id, created, model }
    }

    /// The answer (or, `chunk`, the stream chunk) carrying `choices`.
    pub fn completion(
        &self,
        chunk: bool,
        choices: Vec<Choice>,
        usage: Option<Usage>,
    ) -> Completion {
        let object = match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        };
        Completion {
            id: self.id.clone(),
            object: object.to_owned(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            kv_transfer_params: None,
        }
    }
}

impl Completion {
    /// Whether any choice carries new text.
    pub fn has_text(&self) -> bool {
        self.choices.iter().any(|c| c.new_text().is_some_and(|t| !t.is_empty()))
    }
}

/// The chunks of a whole streamed answer (its `text/event-stream` bytes), and whether it
/// ended with `data: [DONE]`.
pub fn stream_chunks(body: &[u8]) -> Result<(Vec<Completion>, bool), serde_json::Error> {
    let mut chunks = Vec::new();
    let mut done = false;
    for event in crate::SseReader::default().push(body) {
        match event {
            crate::SseEvent::Data(data) => chunks.push(serde_json::from_str(&data)?),
            crate::SseEvent::Done => done = true,
        }
    }
    Ok((chunks, done))
}

pub use crate::models::{MAX_ECHOED_CHARS, ModelCard, ModelList, check_model};

/// The context length of a model that does not state one.
pub const DEFAULT_MAX_MODEL_LEN: u64 = 32_768;

/// vLLM's length checks, before anything is routed: the prompt leaves room for at least one
/// token, `max_tokens` is at least 1 and fits in what is left of the context.
pub fn check_lengths(
    prompt_tokens: usize,
    max_tokens: Option<u64>,
    max_model_len: u64,
) -> Result<(), ApiError> {
    let prompt = prompt_tokens as u64;
    if prompt >= max_model_len {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input messages."
        ))
        .param("messages"));
    }
    match max_tokens {
        Some(0) => Err(ApiError::bad_request("max_tokens must be at least 1, got 0.")
            .param("max_tokens")),
        Some(m) if m > max_model_len - prompt => Err(ApiError::bad_request(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {max_model_len} tokens and your request has {prompt} input tokens ({m} > {max_model_len} - {prompt})."
        ))
        .param("max_tokens")),
        _ => Ok(()),
    }
}

/// The body decoded as `T` (the fields kvroute reads), then the sampling fields every engine
/// refuses alike ([`Sampling::check`]). Fields kvroute does not read are skipped unparsed, so
/// a large body is not held twice here; [`body_value`] reads the whole body once the request
/// has passed its checks.
///
/// `max_n`: the most choices the server returns (`None`: the engine behind decides).
pub fn parse_request<T: serde::de::DeserializeOwned>(
    body: &[u8],
    param: &'static str,
    max_n: Option<i64>,
) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    let fields = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            ApiError::bad_request(format!("invalid request: {e}")).param(param)
        }
        _ => not_json(body, &e),
    })?;
    let sampling: Sampling = serde_json::from_slice(body).map_err(|e| not_json(body, &e))?;
    sampling.check(max_n)?;
    Ok(fields)
}

/// The body parsed once: the whole of it as a JSON value (what is passed on, unknown fields
/// and all) and the fields kvroute reads, decoded from that value rather than from the bytes
/// again, then the sampling checks of [`parse_request`]. What no JSON value holds is a 400
/// naming its field ([`body_value`]); a field of the wrong type is a 400 naming `param`.
pub fn parse_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    param: &'static str,
    max_n: Option<i64>,
) -> Result<(Value, T), ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    let value = body_value(body)?;
    let invalid = |e: serde_json::Error| ApiError::bad_request(format!("invalid request: {e}"));
    let fields = T::deserialize(&value).map_err(|e| invalid(e).param(param))?;
    Sampling::deserialize(&value).map_err(invalid)?.check(max_n)?;
    Ok((value, fields))
}

/// The whole body as a JSON value (to pass on), once it decoded as a request. Whatever it
/// holds is the client's: nesting past serde_json's depth limit (128) or a number no `f64`
/// holds (`1e400`), in a field kvroute reads or not, is a 400 that names the top-level field,
/// never a 500.
pub fn body_value(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| not_json(body, &e))
}

fn not_json(body: &[u8], e: &serde_json::Error) -> ApiError {
    let error = ApiError::bad_request(format!("the body is not valid JSON: {e}"));
    match offending_field(body) {
        Some(field) => error.param_owned(field),
        None => error,
    }
}

/// The top-level field of a JSON object whose value does not decode (too deep, a number out
/// of range), when the object itself is well formed.
fn offending_field(body: &[u8]) -> Option<String> {
    let fields: std::collections::BTreeMap<String, &serde_json::value::RawValue> =
        serde_json::from_slice(body).ok()?;
    fields
        .into_iter()
        .find(|(_, v)| serde_json::from_str::<Value>(v.get()).is_err())
        .map(|(k, _)| k.chars().take(MAX_ECHOED_CHARS).collect())
}

/// Most log probabilities per token an engine returns (vLLM's default `max_logprobs`).
const MAX_LOGPROBS: i64 = 20;

/// The sampling fields whose bounds are the same on every engine, answered as vLLM answers
/// them: `n` at least 1, `best_of` at least `n`, `top_logprobs` and `logprobs` within
/// 0..=20 (chat's `logprobs: true` only switches `top_logprobs` on). Fields absent or `null`
/// are the engine's defaults.
#[derive(Debug, Default, Deserialize)]
pub struct Sampling {
    n: Option<Value>,
    best_of: Option<Value>,
    top_logprobs: Option<Value>,
    logprobs: Option<Value>,
}

impl Sampling {
    /// `max_n`: the most choices the server returns (`None`: no bound of its own).
    pub fn check(&self, max_n: Option<i64>) -> Result<(), ApiError> {
        let n = int("n", self.n.as_ref())?;
        if let Some(n) = n.filter(|&n| n < 1) {
            return Err(ApiError::bad_request(format!("n must be at least 1, got {n}.")).param("n"));
        }
        if let (Some(n), Some(max)) = (n, max_n)
            && n > max
        {
            return Err(ApiError::bad_request(format!(
                "n must be at most {max} on this server, got {n}."
            ))
            .param("n"));
        }
        if let Some(best_of) = int("best_of", self.best_of.as_ref())? {
            let n = n.unwrap_or(1);
            if best_of < n {
                return Err(ApiError::bad_request(format!(
                    "best_of must be greater than or equal to n, got n={n} and best_of={best_of}."
                ))
                .param("best_of"));
            }
            if let Some(max) = max_n.filter(|&max| best_of > max) {
                return Err(ApiError::bad_request(format!(
                    "best_of must be at most {max} on this server, got {best_of}."
                ))
                .param("best_of"));
            }
        }
        let logprobs = self.logprobs.as_ref().filter(|v| !v.is_boolean());
        for (name, value) in [("top_logprobs", self.top_logprobs.as_ref()), ("logprobs", logprobs)]
        {
            if let Some(k) = int(name, value)?.filter(|k| !(0..=MAX_LOGPROBS).contains(k)) {
                return Err(ApiError::bad_request(format!(
                    "{name} must be between 0 and {MAX_LOGPROBS}, got {k}."
                ))
                .param(name));
            }
        }
        Ok(())
    }
}

/// `value` as an integer, or a float with no fraction (saturated), as pydantic takes them.
fn int(name: &'static str, value: Option<&Value>) -> Result<Option<i64>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .map(Some)
            .ok_or_else(|| ApiError::bad_request(format!("{name} must be an integer")).param(name)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use serde_json::json;

    #[test]
    fn lengths_are_checked_as_vllm_checks_them() {
        assert!(check_lengths(10, Some(22), 32).is_ok());
        assert!(check_lengths(10, None, 32).is_ok());
        let e = check_lengths(10, Some(23), 32).unwrap_err();
        assert!(e.message().contains("(23 > 32 - 10)"), "{}", e.message());
        let e = check_lengths(10, Some(0), 32).unwrap_err();
        assert_eq!(e.body().error.param.as_deref(), Some("max_tokens"));
        let e = check_lengths(32, None, 32).unwrap_err();
        assert!(e.message().contains("your request has 32 input tokens"), "{}", e.message());
        assert!(check_lengths(1, Some(u64::MAX), 32).is_err());
    }

    #[test]
    fn shape_errors_name_fields_not_rust_types() {
        let e = serde_json::from_value::<ChatCompletionRequest>(
            json!({"messages": [{"role": "user", "content": 5}]}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("content must be a string or an array of content parts"), "{e}");
        assert!(!e.contains("enum"), "{e}");
        let e = serde_json::from_value::<CompletionRequest>(json!({"prompt": {"x": 1}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("prompt must be a string or an array of token ids"), "{e}");
    }

    #[test]
    fn requests_read_what_clients_send() {
        let chat: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}],
            "max_tokens": 3, "max_completion_tokens": 5, "temperature": 0.2, "stream": true
        }))
        .unwrap();
        assert_eq!(chat.max_output_tokens(), Some(5));
        assert_eq!(image_urls(&chat.messages), ["data:image/png;base64,AA"]);
        let c: CompletionRequest =
            serde_json::from_value(json!({"prompt": [1, 2, 3], "ignore_eos": true})).unwrap();
        assert_eq!(c.prompt, CompletionPrompt::Tokens(vec![1, 2, 3]));
    }

    #[test]
    fn chunks_of_either_kind_carry_text() {
        let chat: Completion = serde_json::from_value(json!({"id": "c", "object": "chat.completion.chunk",
            "created": 0, "model": "m", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}))
        .unwrap();
        assert!(chat.has_text());
        let done: Completion = serde_json::from_value(json!({"id": "c", "object": "text_completion",
            "created": 0, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 4}}}))
        .unwrap();
        assert!(!done.has_text());
        assert_eq!(done.usage.unwrap().cached_tokens(), 4);
    }

    #[test]
    fn another_model_is_404() {
        assert!(check_model("tiny", None).is_ok());
        assert!(check_model("tiny", Some("")).is_ok());
        assert!(check_model("tiny", Some("tiny")).is_ok());
        assert_eq!(check_model("tiny", Some("gpt-9")).unwrap_err().status().as_u16(), 404);
    }
}

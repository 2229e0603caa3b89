//! Dialects: how a request reaches an engine besides the client's own OpenAI body
//! (docs/dialects.md). With a tokens dialect the front door sends the token ids it rendered
//! and hashed, so the engine caches exactly the blocks the router predicted and tokenizes
//! nothing again, and it turns the engine's answer back into the OpenAI answer the client
//! asked for (a whole answer, or chunk by chunk) as it passes:
//! - `vllm-generate`: vLLM 0.33's `/inference/v1/generate`;
//! - `openai-completions-tokens`: `/v1/completions` with the token ids as the prompt.
//!
//! A request carries as tokens only what the API has a field for: the sampling fields below,
//! streaming and its usage, the cache namespace, and images (by their hash and placeholder
//! range; generate only). Anything else (tools, `response_format`, `logprobs`, `n` above 1,
//! ...) goes to the same worker as chat, counted as a fallback.

use axum::body::Bytes;
use kvroute_http::SseEvent;
use kvroute_http::openai::{Api, AssistantMessage, Choice, Completion, Delta, Envelope};
use kvroute_http::vllm_generate::{
    self, GenerateChunk, GenerateRequest, MultiModalFeatures, OutputMode, PlaceholderRange,
    SamplingParams, StreamOptions,
};
use kvroute_preprocess::Prepared;
use kvroute_router::Dialect;
use serde_json::{Map, Value};

/// Sampling fields of an OpenAI body that vLLM's `SamplingParams` takes under the same name.
const SAMPLING: [&str; 17] = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "length_penalty",
    "bad_words",
];

/// Fields the front door carries itself (the prompt as tokens, streaming, the namespace) or
/// that change nothing an engine computes.
const CARRIED: [&str; 11] = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "cache_salt",
    "user",
    "metadata",
    "store",
];

/// The request's body in a tokens `dialect`: the client's OpenAI body `raw` with its
/// `prepared` prompt as token ids, or `None` when it asks for what that API cannot carry (it
/// then goes as chat).
pub(crate) fn tokens_body(
    dialect: Dialect,
    raw: &Value,
    prepared: &Prepared,
    namespace: Option<&str>,
    streamed: bool,
) -> Option<Bytes> {
    let fields = raw.as_object()?;
    let n_is_one = fields.get("n").is_none_or(|n| n.as_i64() == Some(1));
    let carried = fields
        .keys()
        .all(|k| CARRIED.contains(&k.as_str()) || SAMPLING.contains(&k.as_str()) || k == "n");
    if !(carried && n_is_one) {
        return None;
    }
    let mut sampling = Map::new();
    for key in SAMPLING {
        if let Some(v) = fields.get(key).filter(|v| !v.is_null()) {
            sampling.insert(key.to_owned(), v.clone());
        }
    }
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| fields.get(*k).and_then(Value::as_i64));
    let body = match dialect {
        Dialect::OpenaiChat => return None,
        Dialect::VllmGenerate => {
            generate_body(prepared, sampling, max_tokens, namespace, streamed)?
        }
        Dialect::OpenaiCompletionsTokens => {
            if !prepared.mm.mm_objects.is_empty() {
                return None; // a completion's prompt has no images
            }
            let mut body = sampling;
            body.insert("prompt".to_owned(), prepared.tokens.clone().into());
            for key in ["model", "stream", "stream_options", "cache_salt"] {
                if let Some(v) = fields.get(key) {
                    body.insert(key.to_owned(), v.clone());
                }
            }
            if let Some(m) = max_tokens {
                body.insert("max_tokens".to_owned(), m.into());
            }
            serde_json::to_vec(&body).ok()?
        }
    };
    Some(Bytes::from(body))
}

fn generate_body(
    prepared: &Prepared,
    other: Map<String, Value>,
    max_tokens: Option<i64>,
    namespace: Option<&str>,
    streamed: bool,
) -> Option<Vec<u8>> {
    let sampling_params = SamplingParams { max_tokens, other, ..SamplingParams::default() };
    let features = (!prepared.mm.mm_objects.is_empty()).then(|| features(prepared));
    let request = GenerateRequest {
        token_ids: prepared.tokens.iter().map(|&t| i64::from(t)).collect(),
        features,
        sampling_params,
        output_mode: OutputMode::Text,
        stream: streamed.then_some(true),
        stream_options: streamed
            .then_some(StreamOptions { include_usage: Some(true), continuous_usage_stats: None }),
        cache_salt: namespace.map(str::to_owned),
        ..GenerateRequest::default()
    };
    serde_json::to_vec(&request).ok()
}

/// Where a tokens dialect's body goes.
pub(crate) fn path(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::OpenaiChat => "/v1/chat/completions",
        Dialect::VllmGenerate => vllm_generate::PATH,
        Dialect::OpenaiCompletionsTokens => "/v1/completions",
    }
}

/// The prompt's images as vLLM's features: each one's hash (kvroute's 16-hex form) over its
/// placeholder ranges.
fn features(prepared: &Prepared) -> MultiModalFeatures {
    let mut f = MultiModalFeatures::default();
    for object in &prepared.mm.mm_objects {
        for &(start, end) in &object.offsets {
            let range = PlaceholderRange {
                offset: i64::try_from(start).unwrap_or(i64::MAX),
                length: i64::try_from(end.saturating_sub(start)).unwrap_or(0),
            };
            f.mm_hashes
                .entry("image".to_owned())
                .or_default()
                .push(format!("{:016x}", object.mm_hash));
            f.mm_placeholders.entry("image".to_owned()).or_default().push(range);
        }
    }
    f
}

/// Turns a vLLM generate answer into the OpenAI answer the client asked for, as it passes: a
/// stream event by event, a whole answer at its end. An error answer (not 2xx) passes as it
/// is (vLLM's errors are OpenAI's shape).
#[derive(Debug)]
pub(crate) struct Translator {
    /// What the engine answers in: vLLM's generate shape, or OpenAI's completions.
    from: Dialect,
    envelope: Envelope,
    sse: bool,
    reader: kvroute_http::SseReader,
    /// The role goes out with the first delta.
    first: bool,
}

impl Translator {
    /// For the request numbered `id` (the answer's id is OpenAI's form of it).
    pub(crate) fn new(from: Dialect, api: Api, id: &str, model: String, sse: bool) -> Self {
        let envelope = Envelope::new(api, id, model);
        Self { from, envelope, sse, reader: kvroute_http::SseReader::default(), first: true }
    }

    pub(crate) fn sse(&self) -> bool {
        self.sse
    }

    /// A stream's bytes: the events they complete, each as OpenAI's chunk (the usage chunk
    /// and `[DONE]` kept; anything that is not the engine's chunk, such as an error event,
    /// passed as it is).
    pub(crate) fn stream(&mut self, bytes: &[u8]) -> Bytes {
        let mut out = Vec::new();
        for event in self.reader.push(bytes) {
            let data = match event {
                SseEvent::Done => "[DONE]".to_owned(),
                SseEvent::Data(data) => match self.piece(data.as_bytes()) {
                    Some(piece) => {
                        let c = self.emit(piece, true);
                        serde_json::to_string(&c).unwrap_or_default()
                    }
                    None => data,
                },
            };
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(data.as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        Bytes::from(out)
    }

    /// A whole answer: OpenAI's, or the bytes as they came when they are not the engine's
    /// answer.
    pub(crate) fn whole(&mut self, bytes: &[u8]) -> Bytes {
        let Some(piece) = self.piece(bytes) else { return Bytes::copy_from_slice(bytes) };
        let completion = self.emit(piece, false);
        serde_json::to_vec(&completion).map_or_else(|_| Bytes::copy_from_slice(bytes), Bytes::from)
    }

    /// The engine's answer or chunk, whatever its shape.
    fn piece(&self, data: &[u8]) -> Option<Piece> {
        match self.from {
            Dialect::VllmGenerate => {
                let chunk: GenerateChunk = serde_json::from_slice(data).ok()?;
                let choices = chunk
                    .choices
                    .into_iter()
                    .map(|c| (c.index, c.text.unwrap_or_default(), c.finish_reason))
                    .collect();
                Some(Piece { choices, usage: chunk.usage })
            }
            Dialect::OpenaiCompletionsTokens | Dialect::OpenaiChat => {
                let c: Completion = serde_json::from_slice(data).ok()?;
                let choices = c
                    .choices
                    .into_iter()
                    .map(|ch| {
                        let text = ch.new_text().unwrap_or_default().to_owned();
                        (ch.index, text, ch.finish_reason)
                    })
                    .collect();
                Some(Piece { choices, usage: c.usage })
            }
        }
    }

    /// `piece` as the OpenAI answer (or, `chunk`, stream chunk) the client asked for.
    fn emit(&mut self, piece: Piece, chunk: bool) -> Completion {
        let choices = piece
            .choices
            .into_iter()
            .map(|(index, text, finish_reason)| match (self.envelope.api, chunk) {
                (Api::Chat, true) => {
                    let first = std::mem::replace(&mut self.first, false);
                    let role = first.then(|| "assistant".to_owned());
                    let delta = Some(Delta { role, content: Some(text) });
                    Choice { index, delta, finish_reason, ..Choice::default() }
                }
                (Api::Chat, false) => {
                    let message = AssistantMessage { role: "assistant".to_owned(), content: text };
                    Choice { index, message: Some(message), finish_reason, ..Choice::default() }
                }
                (Api::Completion, _) => {
                    Choice { index, text: Some(text), finish_reason, ..Choice::default() }
                }
            })
            .collect();
        self.envelope.completion(chunk, choices, piece.usage)
    }
}

/// An engine's answer or chunk: each choice's index, new text and finish reason; the usage.
#[derive(Debug)]
struct Piece {
    choices: Vec<(u32, String, Option<String>)>,
    usage: Option<kvroute_http::openai::Usage>,
}

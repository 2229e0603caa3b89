//! Dialects: how a request reaches an engine besides the client's own OpenAI body
//! (docs/dialects.md). With a tokens dialect the front door sends the token ids it rendered
//! and hashed, so the engine caches exactly the blocks the router predicted and tokenizes
//! nothing again, and it turns the engine's answer back into the OpenAI answer the client
//! asked for (a whole answer, or chunk by chunk) as it passes:
//! - `vllm-generate`: vLLM 0.33's `/inference/v1/generate`;
//! - `vllm-generate-tokens`: the same with token ids back (`output_mode: "tokens"`), which
//!   the front door detokenizes as vLLM does (`Preprocessor::decode_next`);
//! - `openai-completions-tokens`: `/v1/completions` with the token ids as the prompt;
//! - `sglang-generate`: SGLang's native `/generate`, the token ids as `input_ids`.
//!
//! A request carries as tokens only what the API has a field for: the sampling fields below,
//! streaming and its usage, the cache namespace, images (by their hash and placeholder
//! range; vLLM's generate only) and chat's logprobs (vLLM's generate only: its
//! `sampling_params.logprobs`, answered in OpenAI's chat shape in text mode and by token id
//! in tokens mode, which the front door turns into text). Anything else (tools,
//! `response_format`, a completion's `logprobs`, `n` above 1, ...) goes to the same worker as
//! chat, counted as a fallback.

use std::sync::Arc;

use axum::body::Bytes;
use kvroute_http::SseEvent;
use kvroute_http::openai::{Api, AssistantMessage, Choice, Completion, Delta, Envelope};
use kvroute_http::sglang_generate::{self, OneOrMany, TokenIdsOrList};
use kvroute_http::vllm_generate::{
    self, GenerateChunk, GenerateRequest, MultiModalFeatures, OutputMode, PlaceholderRange,
    SamplingParams, StreamOptions,
};
use kvroute_preprocess::{DecodeWindow, Prepared, Preprocessor};
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
    let logprobs = chat_logprobs(fields)?;
    let carried = fields.keys().all(|k| {
        CARRIED.contains(&k.as_str())
            || SAMPLING.contains(&k.as_str())
            || ["n", "logprobs", "top_logprobs"].contains(&k.as_str())
    });
    if !(carried && n_is_one) {
        return None;
    }
    let generate = matches!(dialect, Dialect::VllmGenerate | Dialect::VllmGenerateTokens);
    if logprobs.is_some() && !generate {
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
    if let Some(k) = logprobs {
        sampling.insert("logprobs".to_owned(), k.into());
    }
    let body = match dialect {
        Dialect::OpenaiChat => return None,
        Dialect::VllmGenerate => {
            generate_body(prepared, sampling, max_tokens, namespace, streamed, OutputMode::Text)?
        }
        Dialect::VllmGenerateTokens => {
            generate_body(prepared, sampling, max_tokens, namespace, streamed, OutputMode::Tokens)?
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
        Dialect::SglangGenerate => {
            sglang_body(prepared, raw, &sampling, max_tokens, namespace, streamed)?
        }
    };
    Some(Bytes::from(body))
}

/// Chat's logprobs as the count of candidates per token vLLM's `sampling_params.logprobs`
/// takes: `Some(None)` when none are asked for, `Some(Some(k))` for `logprobs: true` with
/// `top_logprobs: k` (0 when absent), and `None` for what that field cannot say (a
/// completion's `logprobs`, or `top_logprobs` without `logprobs: true`, which vLLM refuses):
/// the request then goes as chat.
fn chat_logprobs(fields: &Map<String, Value>) -> Option<Option<u64>> {
    let chat = fields.contains_key("messages");
    let top = fields.get("top_logprobs").filter(|v| !v.is_null());
    match fields.get("logprobs").filter(|v| !v.is_null()) {
        None | Some(Value::Bool(false)) if top.is_none() => Some(None),
        Some(Value::Bool(true)) if chat => match top {
            None => Some(Some(0)),
            Some(k) => k.as_u64().map(Some),
        },
        _ => None,
    }
}

/// OpenAI's sampling fields under SGLang's names; those SGLang has no field for are not
/// carried (the request then goes as chat).
const SGLANG_NAMES: [(&str, &str); 14] = [
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("seed", "sampling_seed"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("ignore_eos", "ignore_eos"),
    ("min_tokens", "min_new_tokens"),
    ("skip_special_tokens", "skip_special_tokens"),
    ("spaces_between_special_tokens", "spaces_between_special_tokens"),
];

fn sglang_body(
    prepared: &Prepared,
    raw: &Value,
    sampling: &Map<String, Value>,
    max_tokens: Option<i64>,
    namespace: Option<&str>,
    streamed: bool,
) -> Option<Vec<u8>> {
    let (input_ids, images) = sglang_images(prepared, raw)?;
    let mut params = Map::new();
    for (key, v) in sampling {
        let (_, name) = SGLANG_NAMES.iter().find(|(openai, _)| openai == key)?;
        params.insert((*name).to_owned(), v.clone());
    }
    // OpenAI's default is as many as fit; SGLang's (the field absent) is 128.
    params.insert("max_new_tokens".to_owned(), max_tokens.into());
    // A value SGLang's contract refuses: the request goes as chat, refused there as usual.
    let params = serde_json::from_value(Value::Object(params)).ok()?;
    let (image_data, mm_hashes) = match images {
        Some((urls, hashes)) => (Some(urls.into()), Some(hashes.into())),
        None => (None, None),
    };
    let request = sglang_generate::GenerateRequest {
        input_ids: Some(TokenIdsOrList::One(input_ids)),
        image_data,
        mm_hashes,
        stream: streamed,
        sampling_params: Some(OneOrMany::One(params)),
        cache_salt: namespace.map(|ns| OneOrMany::One(ns.to_owned())),
        ..sglang_generate::GenerateRequest::default()
    };
    serde_json::to_vec(&request).ok()
}

/// The prompt as SGLang takes it with images: `input_ids` with each image's placeholder run
/// back to its one image token (SGLang expands it again by the image's size, as the front
/// door did), each image's URL (`image_data`, as the client sent it) and its hash in
/// kvroute's 16-hex form (`mm_hashes`, which SGLang keys its prefix cache by, so its blocks
/// are the router's). `None` when the images and the client's URLs do not pair up.
#[allow(clippy::type_complexity)]
fn sglang_images(
    prepared: &Prepared,
    raw: &Value,
) -> Option<(Vec<i64>, Option<(Vec<String>, Vec<String>)>)> {
    let mut runs: Vec<(usize, usize, u64)> = prepared
        .mm
        .mm_objects
        .iter()
        .flat_map(|o| o.offsets.iter().map(|&(start, end)| (start, end, o.mm_hash)))
        .collect();
    if runs.is_empty() {
        return Some((prepared.tokens.iter().map(|&t| i64::from(t)).collect(), None));
    }
    runs.sort_unstable();
    let urls: Vec<String> = raw["messages"]
        .as_array()?
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|part| part["type"] == "image_url")
        .map(|part| part["image_url"]["url"].as_str().map(str::to_owned))
        .collect::<Option<_>>()?;
    if urls.len() != runs.len() {
        return None;
    }
    let mut ids = Vec::with_capacity(prepared.tokens.len());
    let mut at = 0;
    for &(start, end, _) in &runs {
        ids.extend(prepared.tokens.get(at..start)?.iter().map(|&t| i64::from(t)));
        ids.push(i64::from(*prepared.tokens.get(start)?));
        at = end;
    }
    ids.extend(prepared.tokens.get(at..)?.iter().map(|&t| i64::from(t)));
    let hashes = runs.iter().map(|&(_, _, h)| format!("{h:016x}")).collect();
    Some((ids, Some((urls, hashes))))
}

fn generate_body(
    prepared: &Prepared,
    other: Map<String, Value>,
    max_tokens: Option<i64>,
    namespace: Option<&str>,
    streamed: bool,
    output_mode: OutputMode,
) -> Option<Vec<u8>> {
    let sampling_params = SamplingParams { max_tokens, other, ..SamplingParams::default() };
    let features = (!prepared.mm.mm_objects.is_empty()).then(|| features(prepared));
    let request = GenerateRequest {
        token_ids: prepared.tokens.iter().map(|&t| i64::from(t)).collect(),
        features,
        sampling_params,
        output_mode,
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
        Dialect::VllmGenerate | Dialect::VllmGenerateTokens => vllm_generate::PATH,
        Dialect::OpenaiCompletionsTokens => "/v1/completions",
        Dialect::SglangGenerate => sglang_generate::PATH,
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

/// Turns a tokens dialect's answer into the OpenAI answer the client asked for, as it
/// passes: a stream event by event, a whole answer at its end. An error answer (not 2xx)
/// passes as it is from vLLM (its errors are OpenAI's shape) and is put in OpenAI's shape
/// from SGLang ([`Translator::failed`]).
#[derive(Debug)]
pub(crate) struct Translator {
    /// What the engine answers in: vLLM's or SGLang's generate shape, or OpenAI's
    /// completions.
    from: Dialect,
    envelope: Envelope,
    sse: bool,
    reader: kvroute_http::SseReader,
    /// The role goes out with the first delta.
    first: bool,
    /// SGLang streams the whole text so far: how much of it has gone out.
    sent: usize,
    /// The engine refused the request with this status: its error is what passes.
    failed: Option<u16>,
    /// The engine answers in token ids: the front door's tokenizer turns them into text.
    detokenizer: Option<Detokenizer>,
}

/// Token ids into text, for an answer in `vllm-generate-tokens`: a whole answer decoded at
/// once, a stream's choices each through their own window.
#[derive(Debug)]
struct Detokenizer {
    preprocessor: Arc<Preprocessor>,
    /// The prompt's end, which seeds each choice's window.
    prompt_tail: Vec<u32>,
    windows: Vec<(u32, DecodeWindow)>,
}

impl Detokenizer {
    fn text(&mut self, index: u32, ids: &[u32], streamed: bool) -> String {
        if !streamed {
            return self.preprocessor.decode(ids).unwrap_or_default();
        }
        let at = match self.windows.iter().position(|(i, _)| *i == index) {
            Some(at) => at,
            None => {
                let window = self.preprocessor.decode_window(&self.prompt_tail);
                self.windows.push((index, window));
                self.windows.len() - 1
            }
        };
        self.preprocessor.decode_next(&mut self.windows[at].1, ids)
    }

    /// vLLM's logprobs by token id (`{"content": [{"token_id", "logprob", "top_logprobs":
    /// [...]}]}`) in OpenAI's chat shape, each token's text decoded alone (as vLLM's derender
    /// does); what is not that shape passes as it came.
    fn logprobs(&self, by_id: &Value) -> Value {
        let Some(content) = by_id["content"].as_array() else { return by_id.clone() };
        let entry = |e: &Value| {
            let id = e["token_id"].as_u64().and_then(|t| u32::try_from(t).ok());
            let token =
                id.map_or_else(String::new, |t| self.preprocessor.decode(&[t]).unwrap_or_default());
            let bytes: Vec<u8> = token.as_bytes().to_vec();
            serde_json::json!({"token": token, "logprob": e["logprob"], "bytes": bytes})
        };
        let content: Vec<Value> = content
            .iter()
            .map(|e| {
                let top = e["top_logprobs"]
                    .as_array()
                    .map_or_else(Vec::new, |t| t.iter().map(entry).collect());
                let mut out = entry(e);
                out["top_logprobs"] = Value::Array(top);
                out
            })
            .collect();
        serde_json::json!({ "content": content })
    }
}

impl Translator {
    /// For the request numbered `id` (the answer's id is OpenAI's form of it).
    pub(crate) fn new(from: Dialect, api: Api, id: &str, model: String, sse: bool) -> Self {
        let envelope = Envelope::new(api, id, model);
        let reader = kvroute_http::SseReader::default();
        Self { from, envelope, sse, reader, first: true, sent: 0, failed: None, detokenizer: None }
    }

    /// The same, for an answer in token ids that `preprocessor` decodes, each stream's
    /// window seeded with the prompt's end (`prompt_tail`).
    pub(crate) fn detokenizing(self, preprocessor: Arc<Preprocessor>, prompt_tail: &[u32]) -> Self {
        let prompt_tail = prompt_tail.to_vec();
        let detokenizer = Detokenizer { preprocessor, prompt_tail, windows: Vec::new() };
        Self { detokenizer: Some(detokenizer), ..self }
    }

    /// For an error answer of `status`: SGLang's two error shapes become OpenAI's; any other
    /// dialect's error passes as it is.
    pub(crate) fn failed(from: Dialect, status: u16) -> Option<Self> {
        let translator = Self::new(from, Api::Chat, "", String::new(), false);
        (from == Dialect::SglangGenerate).then_some(Self { failed: Some(status), ..translator })
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
            let mut datas = Vec::with_capacity(2);
            match event {
                SseEvent::Done => datas.push("[DONE]".to_owned()),
                SseEvent::Data(data) => match self.piece(data.as_bytes()) {
                    Some(mut piece) => {
                        // SGLang's last chunk carries the usage: OpenAI sends it apart.
                        let usage = match self.from {
                            Dialect::SglangGenerate => piece.usage.take(),
                            _ => None,
                        };
                        let c = self.emit(piece, true);
                        datas.push(serde_json::to_string(&c).unwrap_or_default());
                        if let Some(usage) = usage {
                            let apart = Piece { choices: Vec::new(), usage: Some(usage) };
                            let c = self.emit(apart, true);
                            datas.push(serde_json::to_string(&c).unwrap_or_default());
                        }
                    }
                    None => datas.push(data),
                },
            }
            for data in datas {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(data.as_bytes());
                out.extend_from_slice(b"\n\n");
            }
        }
        Bytes::from(out)
    }

    /// A whole answer: OpenAI's, or the bytes as they came when they are not the engine's
    /// answer.
    pub(crate) fn whole(&mut self, bytes: &[u8]) -> Bytes {
        if let Some(status) = self.failed {
            return sglang_error(status, bytes);
        }
        let Some(piece) = self.piece(bytes) else { return Bytes::copy_from_slice(bytes) };
        let completion = self.emit(piece, false);
        serde_json::to_vec(&completion).map_or_else(|_| Bytes::copy_from_slice(bytes), Bytes::from)
    }

    /// The engine's answer or chunk, whatever its shape.
    fn piece(&mut self, data: &[u8]) -> Option<Piece> {
        match self.from {
            Dialect::VllmGenerate | Dialect::VllmGenerateTokens => {
                let chunk: GenerateChunk = serde_json::from_slice(data).ok()?;
                let streamed = self.sse;
                let detokenizer = &mut self.detokenizer;
                let choices = chunk
                    .choices
                    .into_iter()
                    .map(|c| {
                        let (text, logprobs) = match (detokenizer.as_mut(), c.token_ids.as_deref())
                        {
                            (Some(d), Some(ids)) => {
                                let logprobs = c.logprobs.as_ref().map(|l| d.logprobs(l));
                                (d.text(c.index, ids, streamed), logprobs)
                            }
                            _ => (c.text.unwrap_or_default(), c.logprobs),
                        };
                        Said { index: c.index, text, finish: c.finish_reason, logprobs }
                    })
                    .collect();
                Some(Piece { choices, usage: chunk.usage })
            }
            Dialect::SglangGenerate => {
                let r: sglang_generate::GenerateResponse = serde_json::from_slice(data).ok()?;
                let meta = r.meta_info;
                // Whole so far by default; with --incremental-streaming-output, only the new
                // text (then its ids are fewer than the tokens generated).
                let text = r.text.unwrap_or_default();
                let cumulative = r.output_ids.len() as u64 == meta.completion_tokens;
                let new = match cumulative && self.sent <= text.len() {
                    true => text.get(self.sent..).unwrap_or_default().to_owned(),
                    false => text.clone(),
                };
                self.sent = match cumulative {
                    true => text.len(),
                    false => self.sent + text.len(),
                };
                let finish = meta.finish_reason.as_ref().map(|f| f.kind.clone());
                let usage = finish.is_some().then(|| {
                    kvroute_http::openai::Usage::new(
                        meta.prompt_tokens,
                        meta.completion_tokens,
                        meta.cached_tokens,
                    )
                });
                let said = Said { index: 0, text: new, finish, logprobs: None };
                Some(Piece { choices: vec![said], usage })
            }
            Dialect::OpenaiCompletionsTokens | Dialect::OpenaiChat => {
                let c: Completion = serde_json::from_slice(data).ok()?;
                let choices = c
                    .choices
                    .into_iter()
                    .map(|ch| {
                        let text = ch.new_text().unwrap_or_default().to_owned();
                        let (index, finish) = (ch.index, ch.finish_reason);
                        Said { index, text, finish, logprobs: None }
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
            .map(|Said { index, text, finish: finish_reason, logprobs }| {
                match (self.envelope.api, chunk) {
                    (Api::Chat, true) => {
                        let first = std::mem::replace(&mut self.first, false);
                        let role = first.then(|| "assistant".to_owned());
                        let delta = Some(Delta { role, content: Some(text) });
                        Choice { index, delta, finish_reason, logprobs, ..Choice::default() }
                    }
                    (Api::Chat, false) => {
                        let message =
                            AssistantMessage { role: "assistant".to_owned(), content: text };
                        let message = Some(message);
                        Choice { index, message, finish_reason, logprobs, ..Choice::default() }
                    }
                    (Api::Completion, _) => {
                        Choice { index, text: Some(text), finish_reason, ..Choice::default() }
                    }
                }
            })
            .collect();
        self.envelope.completion(chunk, choices, piece.usage)
    }
}

/// An engine's answer or chunk: what each choice said; the usage.
#[derive(Debug)]
struct Piece {
    choices: Vec<Said>,
    usage: Option<kvroute_http::openai::Usage>,
}

/// One choice of an engine's answer or chunk: its new text, finish reason and logprobs (in
/// OpenAI's chat shape).
#[derive(Debug)]
struct Said {
    index: u32,
    text: String,
    finish: Option<String>,
    logprobs: Option<Value>,
}

/// SGLang's error body (`{"error": "..."}` or `{"error": {"message": "..."}}`) in OpenAI's
/// shape, with the engine's status.
fn sglang_error(status: u16, bytes: &[u8]) -> Bytes {
    let body: Value = serde_json::from_slice(bytes).unwrap_or_default();
    let message = match &body["error"] {
        Value::String(m) => m.clone(),
        e => e["message"]
            .as_str()
            .map_or_else(|| String::from_utf8_lossy(bytes).into_owned(), str::to_owned),
    };
    let status =
        axum::http::StatusCode::from_u16(status).unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
    let error = kvroute_http::ApiError::new(status, message);
    serde_json::to_vec(&error.body()).map_or_else(|_| Bytes::copy_from_slice(bytes), Bytes::from)
}

//! Migration (#80): a stream its worker breaks after its first bytes goes on on another
//! worker, and the client sees one stream.
//!
//! ```text
//!  leg 1 ──events──▶ Transcript (the text the client got) ──▶ client
//!    ✗ broken                                                   ▲
//!  continuation: prompt ids + the text so far as ids, max_tokens less what was generated,
//!  placed by the same decision (dispatch) ──events──▶ Splice (its id, no second role,
//!  usage of the whole answer) ───────────────────────────────────┘
//! ```
//!
//! The tokens generated so far are the text the client was sent, encoded by the front door's
//! tokenizer: exact wherever an answer's text encodes back to its tokens (the simulated
//! engine's always do; a real model's greedy answers almost always), and the continuation goes
//! as token ids (a worker speaking only OpenAI's chat gets OpenAI's completions with the ids
//! as its prompt). Sampling fields are carried (a `seed` too: a greedy answer continues
//! exactly, a sampled one from a new draw). Not migrated: `n` > 1, prompts with images, a
//! completion's `echo`, fields no tokens dialect carries (tools, `response_format`,
//! `logit_bias`, a completion's `logprobs`): those end with the error event as before.

use axum::body::Bytes;
use kvroute_core::BlockSize;
use kvroute_http::SseEvent;
use kvroute_http::openai::Api;
use kvroute_preprocess::Prepared;
use kvroute_router::Dialect;
use serde_json::{Value, json};

use crate::dialect::Keys;

/// What a streamed request keeps to be continued elsewhere: its body and prompt as the first
/// worker got them, and how many more times it may move.
#[derive(Debug)]
pub(crate) struct Resume {
    pub(crate) path: &'static str,
    pub(crate) kind: Api,
    /// The client's body as the engines get it (its usage asked for).
    pub(crate) raw: Value,
    pub(crate) prompt: Vec<u32>,
    namespace: Option<String>,
    adapter: Option<String>,
    session: Option<String>,
    pub(crate) dialects: Vec<Dialect>,
    pub(crate) block_size: BlockSize,
    /// The client did not ask for the usage: the continuation's is dropped too.
    pub(crate) strip_usage: bool,
    /// Migrations left after this one.
    left: u32,
}

/// Why a stream is not continued (the reasons a request cannot be, read from its body).
fn refused(raw: &Value, prepared: &Prepared) -> Option<&'static str> {
    let n = raw.get("n").and_then(Value::as_u64).unwrap_or(1);
    if n > 1 {
        return Some("n");
    }
    if !prepared.mm.mm_objects.is_empty() {
        return Some("images");
    }
    if raw.get("echo").and_then(Value::as_bool) == Some(true) {
        return Some("echo");
    }
    None
}

impl Resume {
    /// For a stream whose migrations `left` are more than none, when it can be continued.
    pub(crate) fn of(
        (path, kind): (&'static str, Api),
        raw: &Value,
        prepared: &Prepared,
        keys: &Keys<'_>,
        (block_size, dialects): (BlockSize, &[Dialect]),
    ) -> Option<Self> {
        let left = keys.migrations.checked_sub(1)?;
        if refused(raw, prepared).is_some() {
            return None;
        }
        Some(Self {
            path,
            kind,
            raw: raw.clone(),
            prompt: prepared.tokens.clone(),
            namespace: keys.namespace.map(str::to_owned),
            adapter: keys.adapter.map(str::to_owned),
            session: keys.session.map(str::to_owned),
            dialects: dialects.to_vec(),
            block_size,
            strip_usage: false,
            left,
        })
    }

    /// The same, its continuation's usage dropped when the client did not ask for its own.
    pub(crate) fn stripping_usage(self, strip_usage: bool) -> Self {
        Self { strip_usage, ..self }
    }

    /// The body and prompt that continue an answer of which `generated` tokens went out:
    /// the prompt and those tokens as the prompt, for what is left of its bound.
    pub(crate) fn continued(&self, generated: &[u32]) -> (Value, Prepared) {
        let mut raw = self.raw.clone();
        let done = generated.len() as u64;
        for key in ["max_completion_tokens", "max_tokens", "min_tokens"] {
            if let Some(bound) = raw.get(key).and_then(Value::as_u64) {
                raw[key] = bound.saturating_sub(done).into();
            }
        }
        let mut tokens = self.prompt.clone();
        tokens.extend_from_slice(generated);
        (raw, Prepared { tokens, mm: Default::default(), images: Vec::new() })
    }

    /// The keys the continuation goes with: the first request's, with one migration less,
    /// and no class (flow control admitted it once).
    pub(crate) fn keys(&self) -> Keys<'_> {
        Keys {
            namespace: self.namespace.as_deref(),
            adapter: self.adapter.as_deref(),
            session: self.session.as_deref(),
            class: None,
            priority_named: false,
            migrations: self.left,
        }
    }

    /// Whether `generated` tokens are all its bound allows (only the answer's end was lost).
    pub(crate) fn complete(&self, generated: usize) -> bool {
        crate::dialect::answer_bound(&self.raw, Value::as_u64)
            .is_some_and(|b| b <= generated as u64)
    }
}

/// What the client has been sent of an answer: its id, model and time, and its text.
#[derive(Debug, Default)]
pub(crate) struct Transcript {
    reader: kvroute_http::SseReader,
    /// The answer's id, model and time.
    pub(crate) head: Option<(Value, Value, Value)>,
    pub(crate) text: String,
    /// The answer ended (a `finish_reason`, `[DONE]`, an error): nothing to continue.
    pub(crate) ended: bool,
}

/// What [`Transcript::record`] reads of a chunk.
#[derive(serde::Deserialize)]
struct Chunk<'a> {
    #[serde(borrow)]
    id: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    created: Option<&'a serde_json::value::RawValue>,
    #[serde(default, borrow)]
    choices: Vec<ChunkChoice<'a>>,
    error: Option<serde::de::IgnoredAny>,
}

#[derive(serde::Deserialize)]
struct ChunkChoice<'a> {
    #[serde(borrow)]
    delta: Option<ChunkDelta<'a>>,
    #[serde(borrow)]
    text: Option<std::borrow::Cow<'a, str>>,
    finish_reason: Option<serde::de::IgnoredAny>,
}

#[derive(serde::Deserialize)]
struct ChunkDelta<'a> {
    #[serde(borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
}

impl Transcript {
    /// Reads the events the client is sent.
    pub(crate) fn record(&mut self, bytes: &[u8]) {
        for event in self.reader.push(bytes) {
            let SseEvent::Data(data) = event else {
                self.ended = true;
                continue;
            };
            // Read in place (one chunk a token: no tree of values built).
            let Ok(chunk) = serde_json::from_str::<Chunk<'_>>(&data) else { continue };
            if chunk.error.is_some() {
                self.ended = true;
            }
            if let (None, Some(id)) = (&self.head, chunk.id) {
                let value = |raw: Option<&serde_json::value::RawValue>| {
                    raw.and_then(|r| serde_json::from_str(r.get()).ok()).unwrap_or(Value::Null)
                };
                let id = value(Some(id));
                self.head = Some((id, value(chunk.model), value(chunk.created)));
            }
            let Some(choice) = chunk.choices.first() else { continue };
            if let Some(text) = choice.delta.as_ref().and_then(|d| d.content.as_deref()) {
                self.text.push_str(text);
            } else if let Some(text) = &choice.text {
                self.text.push_str(text);
            }
            if choice.finish_reason.is_some() {
                self.ended = true;
            }
        }
    }
}

/// The continuation's events as the client's one stream goes on: the first answer's id, model
/// and time, no second `role`, and a usage that counts the whole answer.
#[derive(Debug)]
pub(crate) struct Splice {
    reader: kvroute_http::SseReader,
    head: Option<(Value, Value, Value)>,
    /// Tokens generated before the move, and the client's prompt's length.
    before: u64,
    prompt_tokens: u64,
    strip_usage: bool,
}

impl Splice {
    /// For the continuation of `resume`'s answer after `transcript`, which held `before`
    /// tokens.
    pub(crate) fn after(resume: &Resume, transcript: Transcript, before: usize) -> Self {
        Self {
            reader: kvroute_http::SseReader::default(),
            head: transcript.head,
            before: before as u64,
            prompt_tokens: resume.prompt.len() as u64,
            strip_usage: resume.strip_usage,
        }
    }

    /// The continuation's bytes as the client gets them.
    pub(crate) fn pass(&mut self, bytes: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(bytes.len() + 64);
        for event in self.reader.push(bytes) {
            let data = match event {
                SseEvent::Done => {
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    continue;
                }
                SseEvent::Data(data) => data,
            };
            let Ok(mut v) = serde_json::from_str::<Value>(&data) else { continue };
            if v.get("error").is_none() && !self.rewrite(&mut v) {
                continue;
            }
            out.extend_from_slice(format!("data: {v}\n\n").as_bytes());
        }
        Bytes::from(out)
    }

    /// One chunk rewritten; false when it is to be dropped (a usage the client did not ask).
    fn rewrite(&self, v: &mut Value) -> bool {
        if let Some((id, model, created)) = &self.head {
            for (key, value) in [("id", id), ("model", model), ("created", created)] {
                if !value.is_null() && v.get(key).is_some() {
                    v[key] = value.clone();
                }
            }
        }
        if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
            for choice in choices {
                if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                    delta.remove("role");
                }
            }
        }
        let usage_only = v["choices"].as_array().is_some_and(Vec::is_empty);
        let Some(usage) = v.get_mut("usage").filter(|u| !u.is_null()) else { return true };
        if self.strip_usage {
            if usage_only {
                return false;
            }
            v.as_object_mut().map(|o| o.remove("usage"));
            return true;
        }
        let completion = usage["completion_tokens"].as_u64().unwrap_or(0) + self.before;
        usage["prompt_tokens"] = self.prompt_tokens.into();
        usage["completion_tokens"] = completion.into();
        usage["total_tokens"] = (self.prompt_tokens + completion).into();
        if let Some(cached) = usage.pointer_mut("/prompt_tokens_details/cached_tokens") {
            // Of the client's prompt: what the finishing worker served from its cache.
            *cached = cached.as_u64().unwrap_or(0).min(self.prompt_tokens).into();
        }
        true
    }
}

/// The end of an answer whose every token went out before its worker broke off: a last chunk
/// (`finish_reason` `length`), then `[DONE]`.
pub(crate) fn ended(kind: Api, head: Option<&(Value, Value, Value)>) -> Bytes {
    let mut chunk = match kind {
        Api::Chat => json!({"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        Api::Completion => json!({"object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
    };
    if let Some((id, model, created)) = head {
        chunk["id"] = id.clone();
        chunk["model"] = model.clone();
        chunk["created"] = created.clone();
    }
    Bytes::from(format!("data: {chunk}\n\ndata: [DONE]\n\n"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use proptest::prelude::*;

    use super::*;

    fn resume(prompt_tokens: usize, strip_usage: bool) -> Resume {
        Resume {
            path: kvroute_http::paths::CHAT_COMPLETIONS,
            kind: Api::Chat,
            raw: json!({"max_tokens": 64}),
            prompt: vec![1; prompt_tokens],
            namespace: None,
            adapter: None,
            session: None,
            dialects: Vec::new(),
            block_size: BlockSize::new(16).unwrap(),
            strip_usage,
            left: 0,
        }
    }

    /// A chat stream as an engine sends it: `id`, the role with the first delta, one word a
    /// chunk, its end, its usage (`prompt` and the words' count) and `[DONE]`.
    fn stream(id: &str, words: &[String], prompt: usize) -> Vec<u8> {
        let mut out = String::new();
        for (i, w) in words.iter().enumerate() {
            let mut delta = json!({"content": w});
            if i == 0 {
                delta["role"] = "assistant".into();
            }
            let chunk = json!({"id": id, "object": "chat.completion.chunk", "created": 7,
                "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
            out.push_str(&format!("data: {chunk}\n\n"));
        }
        let end = json!({"id": id, "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]});
        let usage = json!({"id": id, "created": 7, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": words.len(),
                      "total_tokens": prompt + words.len(),
                      "prompt_tokens_details": {"cached_tokens": prompt}}});
        out.push_str(&format!("data: {end}\n\ndata: {usage}\n\ndata: [DONE]\n\n"));
        out.into_bytes()
    }

    /// `bytes` cut at `cuts` (any points).
    fn chunks(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        at.sort_unstable();
        at.dedup();
        let mut out = Vec::new();
        let mut from = 0;
        for c in at.into_iter().chain([bytes.len()]) {
            out.push(bytes[from..c].to_vec());
            from = c;
        }
        out
    }

    proptest! {
        /// A stream broken after any of its words, recorded in any chunks, and its continuation
        /// (the rest of the words from another engine, under another id, with its own role and
        /// usage) spliced in any chunks: the client gets the unbroken stream's words, one id,
        /// one role, `[DONE]`, and one usage that counts the whole answer.
        #[test]
        fn a_spliced_stream_is_the_unbroken_one(
            n in 2usize..24,
            cut_at in 1usize..23,
            prompt in 1usize..300,
            cuts in proptest::collection::vec(0usize..4000, 0..12),
            strip in any::<bool>(),
        ) {
            let cut = cut_at.min(n - 1);
            let words: Vec<String> = (0..n).map(|i| match i {
                0 => "Word".to_owned(),
                i => format!(" w{i}"),
            }).collect();
            let mut first = stream("chatcmpl-1", &words[..cut], prompt);
            // The worker broke off right after its `cut`-th word's event.
            let events: Vec<&[u8]> = first.split_inclusive(|b| *b == b'\n').collect();
            let kept: usize = events.iter().take(2 * cut).map(|e| e.len()).sum();
            first.truncate(kept);
            let mut transcript = Transcript::default();
            let mut client = Vec::new();
            for c in chunks(&first, &cuts) {
                transcript.record(&c);
                client.extend_from_slice(&c);
            }
            prop_assert!(!transcript.ended);
            let text: String = words[..cut].concat();
            prop_assert_eq!(&transcript.text, &text);
            let rest = stream("cmpl-other", &words[cut..], prompt + cut);
            let mut splice = Splice::after(&resume(prompt, strip), transcript, cut);
            for c in chunks(&rest, &cuts) {
                client.extend_from_slice(&splice.pass(&c));
            }
            let mut reader = kvroute_http::SseReader::default();
            let events = reader.push(&client);
            prop_assert_eq!(events.last(), Some(&SseEvent::Done));
            let chunks: Vec<Value> = events.iter().filter_map(|e| match e {
                SseEvent::Data(d) => serde_json::from_str(d).ok(),
                SseEvent::Done => None,
            }).collect();
            let said: String = chunks.iter()
                .filter_map(|c| c.pointer("/choices/0/delta/content")?.as_str()).collect();
            prop_assert_eq!(said, words.concat());
            prop_assert!(chunks.iter().all(|c| c["id"] == "chatcmpl-1"));
            let roles = chunks.iter().filter(|c| c.pointer("/choices/0/delta/role").is_some());
            prop_assert_eq!(roles.count(), 1);
            let usages: Vec<&Value> = chunks.iter().filter_map(|c| c.get("usage")).collect();
            if strip {
                prop_assert!(usages.is_empty());
            } else {
                prop_assert_eq!(usages.len(), 1);
                prop_assert_eq!(usages[0]["prompt_tokens"].as_u64(), Some(prompt as u64));
                prop_assert_eq!(usages[0]["completion_tokens"].as_u64(), Some(n as u64));
                prop_assert_eq!(usages[0]["total_tokens"].as_u64(), Some((prompt + n) as u64));
                let cached = usages[0]["prompt_tokens_details"]["cached_tokens"].as_u64();
                prop_assert_eq!(cached, Some(prompt as u64));
            }
        }
    }
}

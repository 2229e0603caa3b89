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

use std::sync::Arc;

use axum::body::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use kvroute_core::{BlockSize, WorkerId};
use kvroute_http::SseEvent;
use kvroute_http::openai::Api;
use kvroute_preprocess::Prepared;
use kvroute_router::Dialect;
use serde_json::{Value, json};

use crate::FrontendState;
use crate::dialect::Keys;
use crate::hop::Outbound;
use crate::usage::stream_error_event;

/// What a streamed request keeps to be continued elsewhere: its body and prompt as the first
/// worker got them, and how many more times it may move.
#[derive(Debug)]
pub(crate) struct Resume {
    path: &'static str,
    kind: Api,
    /// The client's body as the engines get it (its usage asked for).
    raw: Value,
    prompt: Vec<u32>,
    namespace: Option<String>,
    adapter: Option<String>,
    session: Option<String>,
    dialects: Vec<Dialect>,
    block_size: BlockSize,
    /// The client did not ask for the usage: the continuation's is dropped too.
    strip_usage: bool,
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
        strip_usage: bool,
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
            strip_usage,
            left,
        })
    }

    /// The request that continues an answer of which `generated` tokens went out: the prompt
    /// and those tokens as its prompt, for what is left of its bound, as token ids; `None`
    /// when no tokens dialect carries it.
    fn continuation(
        &self,
        generated: &[u32],
        trace: Option<&kvroute_http::trace::TraceContext>,
    ) -> Option<Outbound> {
        let mut raw = self.raw.clone();
        let done = generated.len() as u64;
        for key in ["max_completion_tokens", "max_tokens"] {
            if let Some(bound) = raw.get(key).and_then(Value::as_u64) {
                raw[key] = bound.saturating_sub(done).into();
            }
        }
        if let Some(min) = raw.get("min_tokens").and_then(Value::as_u64) {
            raw["min_tokens"] = min.saturating_sub(done).into();
        }
        let mut tokens = self.prompt.clone();
        tokens.extend_from_slice(generated);
        let prepared = Prepared { tokens, mm: Default::default(), images: Vec::new() };
        let keys = Keys {
            namespace: self.namespace.as_deref(),
            adapter: self.adapter.as_deref(),
            session: self.session.as_deref(),
            class: None,
            priority_named: false,
            migrations: self.left,
        };
        let mut dialects = self.dialects.clone();
        if !dialects.contains(&Dialect::OpenaiCompletionsTokens) {
            dialects.push(Dialect::OpenaiCompletionsTokens);
        }
        let out =
            Outbound::new(self.path, raw, &prepared, &keys, self.block_size, &dialects).ok()?;
        if out.tokens.is_empty() {
            return None;
        }
        Some(Outbound { continued: true, trace: trace.cloned(), ..out })
    }
}

/// What the client has been sent of an answer: its id, model and time, and its text.
#[derive(Debug, Default)]
pub(crate) struct Transcript {
    reader: kvroute_http::SseReader,
    head: Option<(Value, Value, Value)>,
    text: String,
    /// The answer ended (a `finish_reason`, `[DONE]`, an error): nothing to continue.
    ended: bool,
}

impl Transcript {
    /// Reads the events the client is sent.
    pub(crate) fn record(&mut self, bytes: &[u8]) {
        for event in self.reader.push(bytes) {
            let SseEvent::Data(data) = event else {
                self.ended = true;
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(&data) else { continue };
            if v.get("error").is_some() {
                self.ended = true;
            }
            if self.head.is_none() && v.get("id").is_some() {
                self.head = Some((v["id"].clone(), v["model"].clone(), v["created"].clone()));
            }
            let Some(choice) = v.pointer("/choices/0") else { continue };
            let text = choice.pointer("/delta/content").or_else(|| choice.get("text"));
            if let Some(text) = text.and_then(Value::as_str) {
                self.text.push_str(text);
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
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

/// A leg's answer as it passes: its bytes, or the worker broke it off.
pub(crate) enum Piece {
    Bytes(Bytes),
    Broken(WorkerId, std::io::Error),
}

type Answer = BoxStream<'static, Result<Bytes, std::io::Error>>;

/// Where the client's stream is: on its first leg, on the continuation, or ended.
enum Relay {
    First(BoxStream<'static, Result<Piece, std::io::Error>>, Transcript),
    Then(Answer, Splice),
    Done,
}

/// The client's stream of a migratable request: the first leg's pieces, recorded, and when
/// its worker breaks it, the continuation spliced on (or the error event when it cannot be).
pub(crate) fn migrating(
    state: Arc<FrontendState>,
    resume: Arc<Resume>,
    trace: Option<kvroute_http::trace::TraceContext>,
    leg: BoxStream<'static, Result<Piece, std::io::Error>>,
) -> Answer {
    let start = Relay::First(leg, Transcript::default());
    futures_util::stream::unfold(start, move |relay| {
        let (state, resume, trace) = (Arc::clone(&state), Arc::clone(&resume), trace.clone());
        async move {
            match relay {
                Relay::First(mut leg, mut transcript) => match leg.next().await? {
                    Err(e) => Some((Err(e), Relay::Done)),
                    Ok(Piece::Bytes(b)) => {
                        transcript.record(&b);
                        Some((Ok(b), Relay::First(leg, transcript)))
                    }
                    Ok(Piece::Broken(worker, _)) => {
                        drop(leg);
                        let to = (trace.as_ref(), worker);
                        match continued(&state, &resume, to, transcript).await {
                            Moved::On(rest, splice) => spliced(rest, splice).await,
                            Moved::Complete(end) => Some((Ok(end), Relay::Done)),
                            Moved::Not => {
                                let error = Bytes::from(stream_error_event(worker));
                                Some((Ok(error), Relay::Done))
                            }
                        }
                    }
                },
                Relay::Then(rest, splice) => spliced(rest, splice).await,
                Relay::Done => None,
            }
        }
    })
    .boxed()
}

/// The continuation's next bytes, spliced.
async fn spliced(
    mut rest: Answer,
    mut splice: Splice,
) -> Option<(Result<Bytes, std::io::Error>, Relay)> {
    let item = rest.next().await?;
    Some((item.map(|b| splice.pass(&b)), Relay::Then(rest, splice)))
}

/// What became of a broken stream.
enum Moved {
    /// It goes on: the continuation's answer and its splice.
    On(Answer, Splice),
    /// Every token of its bound had gone out: only its end was missing (these bytes).
    Complete(Bytes),
    /// It cannot go on (nothing to continue, no worker, an error): the error event ends it.
    Not,
}

/// Places the continuation of what `transcript` holds without `worker` and starts it.
async fn continued(
    state: &Arc<FrontendState>,
    resume: &Resume,
    (trace, worker): (Option<&kvroute_http::trace::TraceContext>, WorkerId),
    transcript: Transcript,
) -> Moved {
    if transcript.ended {
        return Moved::Not;
    }
    let Ok(generated) = state.preprocessor.encode(&transcript.text) else { return Moved::Not };
    let bound = crate::dialect::answer_bound(&resume.raw, Value::as_u64);
    if bound.is_some_and(|b| b <= generated.len() as u64) {
        return Moved::Complete(ended(resume.kind, transcript.head.as_ref()));
    }
    let Some(out) = resume.continuation(&generated, trace) else { return Moved::Not };
    tracing::info!(%worker, generated = generated.len(), "the worker broke off a stream: it goes on on another worker");
    state.metrics.migrated("broken");
    let answer = match crate::dispatch::dispatch(state, &out).await {
        Ok(a) if a.status().is_success() => a,
        Ok(a) => {
            tracing::warn!(status = %a.status(), "the continuation was refused");
            return Moved::Not;
        }
        Err(e) => {
            tracing::warn!(error = %e.message(), "the continuation could not be placed");
            return Moved::Not;
        }
    };
    let splice = Splice {
        reader: kvroute_http::SseReader::default(),
        head: transcript.head,
        before: generated.len() as u64,
        prompt_tokens: resume.prompt.len() as u64,
        strip_usage: resume.strip_usage,
    };
    let rest = answer.into_body().into_data_stream().map(|c| c.map_err(std::io::Error::other));
    Moved::On(rest.boxed(), splice)
}

/// The end of an answer whose every token went out before its worker broke off: a last chunk
/// (`finish_reason` `length`), then `[DONE]`.
fn ended(kind: Api, head: Option<&(Value, Value, Value)>) -> Bytes {
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

//! A tokens dialect's answer back into the OpenAI answer the client asked for
//! (docs/dialects.md): vLLM's generate shape (text, or token ids the front door detokenizes),
//! SGLang's `/generate` (its cumulative or incremental stream, its logprobs in `meta_info`,
//! its two error shapes) and OpenAI's completions, whole or chunk by chunk.

use std::sync::Arc;

use axum::body::Bytes;
use kvroute_http::SseEvent;
use kvroute_http::openai::{
    Api, AssistantMessage, Choice, Completion, Delta, Envelope, chat_logprob,
};
use kvroute_http::sglang_generate;
use kvroute_http::vllm_generate::GenerateChunk;
use kvroute_preprocess::{DecodeWindow, Preprocessor};
use kvroute_router::Dialect;
use serde_json::Value;

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
    /// ... and all its logprobs so far: how many have gone out.
    logprobs_sent: usize,
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
            chat_logprob(&token, e["logprob"].clone())
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
        let (first, sent, logprobs_sent) = (true, 0, 0);
        Self {
            from,
            envelope,
            sse,
            reader,
            first,
            sent,
            logprobs_sent,
            failed: None,
            detokenizer: None,
        }
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
                let logprobs = self.sglang_logprobs(&meta);
                let said = Said { index: 0, text: new, finish, logprobs };
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

    /// SGLang's logprobs new in this answer or chunk (its default stream repeats them all so
    /// far, its incremental one sends only the new) in OpenAI's chat shape.
    fn sglang_logprobs(&mut self, meta: &sglang_generate::MetaInfo) -> Option<Value> {
        let all = meta.output_token_logprobs.as_ref()?;
        let cumulative = all.len() as u64 == meta.completion_tokens;
        let from = match cumulative {
            true => self.logprobs_sent.min(all.len()),
            false => 0,
        };
        self.logprobs_sent = match cumulative {
            true => all.len(),
            false => self.logprobs_sent + all.len(),
        };
        let top = meta.output_top_logprobs.as_deref().unwrap_or_default();
        let entry = |e: &sglang_generate::LogprobEntry| {
            chat_logprob(e.2.as_deref().unwrap_or_default(), e.0)
        };
        let content: Vec<Value> = (from..all.len())
            .map(|i| {
                let mut out = entry(&all[i]);
                let alternatives = top.get(i).and_then(Option::as_ref);
                out["top_logprobs"] =
                    alternatives.map_or_else(Vec::new, |t| t.iter().map(entry).collect()).into();
                out
            })
            .collect();
        Some(serde_json::json!({ "content": content }))
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

//! A request as the engines get it ([`Outbound`]): made once from the client's body and its
//! tokenized prompt, in each tokens dialect the fleet speaks, with what routing needs; and,
//! for a stream a worker broke off, the request that continues it ([`Outbound::continuation`]).

use std::sync::Arc;

use axum::body::Bytes;
use kvroute_core::{BlockHasher, BlockSize, LocalBlockHash};
use kvroute_http::ApiError;
use kvroute_http::openai::Api;
use kvroute_http::paths;
use kvroute_http::trace::TraceContext;
use kvroute_preprocess::Prepared;
use kvroute_router::{Dialect, PlaceRequest};
use serde_json::{Value, json};

use crate::dialect::{Keys, tokens_body};
use crate::migrate::Resume;

/// A request ready for an engine: its body as the engine gets it, and what routing needs.
#[derive(Debug)]
pub(crate) struct Outbound {
    pub path: &'static str,
    pub body: Bytes,
    /// The OpenAI answer the client expects.
    pub kind: Api,
    /// The body in each tokens dialect the fleet speaks that the request fits.
    pub tokens: Vec<(Dialect, Bytes)>,
    /// What routing needs of it, made once: the prompt's block hashes (with its images,
    /// adapter and cache namespace), its length, adapter (routed only to workers that serve
    /// it), session, answer bound and class for flow control.
    pub place: PlaceRequest,
    /// The prompt's last ids, which seed the decoding of an answer that comes back as token
    /// ids (`vllm-generate-tokens`).
    pub prompt_tail: Vec<u32>,
    pub streamed: bool,
    /// The front door asked a stream for its usage, which the client did not: the usage
    /// chunk is read and dropped.
    pub strip_usage: bool,
    /// The client's or the gateway's trace context: each engine call goes on as its child.
    pub trace: Option<TraceContext>,
    /// The client asked for its decision ([`crate::EXPLAIN_HEADER`]).
    pub explain: bool,
    /// A stream that may move to another worker if its own breaks it off.
    pub resume: Option<Arc<Resume>>,
    /// It continues an answer another worker broke off: it goes as token ids to every
    /// worker, as OpenAI's completions to one that speaks only chat.
    pub continued: bool,
}

impl Outbound {
    /// The client's body (`raw`) as the engine gets it: in the cache `namespace` (as vLLM's
    /// `cache_salt`), a stream asked for its usage (the engine's cached tokens are compared
    /// with the router's prediction).
    pub(crate) fn new(
        path: &'static str,
        mut raw: Value,
        prepared: &Prepared,
        keys: &Keys<'_>,
        block_size: BlockSize,
        dialects: &[Dialect],
    ) -> Result<Self, ApiError> {
        let namespace = keys.namespace;
        let kind = match path {
            paths::COMPLETIONS => Api::Completion,
            _ => Api::Chat,
        };
        if prepared.tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        let local = hashed(prepared, keys, block_size);
        if let (Some(ns), Some(fields)) = (namespace, raw.as_object_mut()) {
            fields.insert("cache_salt".to_owned(), Value::String(ns.to_owned()));
        }
        if let (Some(class), true, Some(fields)) =
            (keys.class, keys.priority_named, raw.as_object_mut())
        {
            fields
                .entry("priority")
                .or_insert_with(|| crate::dialect::vllm_priority(class.priority).into());
        }
        let streamed = raw.get("stream").and_then(Value::as_bool) == Some(true);
        let output_tokens = crate::dialect::answer_bound(&raw, Value::as_u64)
            .map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX));
        let client_usage =
            raw.pointer("/stream_options/include_usage").and_then(Value::as_bool) == Some(true);
        if streamed && !client_usage {
            let options =
                raw.as_object_mut().map(|o| o.entry("stream_options").or_insert_with(|| json!({})));
            if let Some(Value::Object(options)) = options {
                options.insert("include_usage".to_owned(), Value::Bool(true));
            }
        }
        let resume = streamed
            .then(|| Resume::of((path, kind), &raw, prepared, keys, (block_size, dialects)))
            .flatten()
            .map(|r| Arc::new(r.stripping_usage(!client_usage)));
        let tokens = dialects
            .iter()
            .filter_map(|&d| Some((d, tokens_body(d, &raw, prepared, keys, streamed)?)))
            .collect();
        let body = Bytes::from(serde_json::to_vec(&raw).map_err(ApiError::internal)?);
        let prompt_tokens = prepared.tokens.len();
        let prompt_tail = prepared.tokens[prompt_tokens.saturating_sub(8)..].to_vec();
        Ok(Self {
            path,
            body,
            kind,
            tokens,
            place: PlaceRequest {
                local_hashes: local.into(),
                num_tokens: prompt_tokens,
                output_tokens,
                adapter: keys.adapter.map(str::to_owned),
                session: keys.session.map(str::to_owned),
                class: keys.class.cloned(),
                ..PlaceRequest::default()
            },
            prompt_tail,
            streamed,
            strip_usage: streamed && !client_usage,
            trace: None,
            explain: false,
            resume,
            continued: false,
        })
    }

    /// The request that continues `resume`'s answer of which `generated` tokens went out: the
    /// prompt and those tokens as its prompt, for what is left of its bound, as token ids (to a
    /// worker that speaks only chat, OpenAI's completions); `None` when no tokens dialect
    /// carries it.
    pub(crate) fn continuation(
        resume: &Resume,
        generated: &[u32],
        trace: Option<&TraceContext>,
    ) -> Option<Self> {
        let (raw, prepared) = resume.continued(generated);
        let keys = resume.keys();
        let mut dialects = resume.dialects.clone();
        if !dialects.contains(&Dialect::OpenaiCompletionsTokens) {
            dialects.push(Dialect::OpenaiCompletionsTokens);
        }
        let out =
            Self::new(resume.path, raw, &prepared, &keys, resume.block_size, &dialects).ok()?;
        if out.tokens.is_empty() {
            return None;
        }
        Some(Self { continued: true, trace: trace.cloned(), ..out })
    }
}

/// The prompt's block hashes (with its images, adapter and cache namespace), in their span.
fn hashed(prepared: &Prepared, keys: &Keys<'_>, block_size: BlockSize) -> Vec<LocalBlockHash> {
    let block_infos = (!prepared.mm.mm_objects.is_empty())
        .then(|| prepared.mm.to_block_level(block_size, prepared.tokens.len()));
    let hash = kvroute_http::span!("kvroute.hash", kvroute.blocks = tracing::field::Empty);
    let local = hash.in_scope(|| {
        BlockHasher::new(block_size)
            .with_namespace(keys.namespace)
            .with_lora(keys.adapter)
            .local_hashes(&prepared.tokens, block_infos.as_deref())
    });
    hash.record("kvroute.blocks", local.len() as i64);
    local
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvroute_preprocess::Preprocessor;
    use serde_json::json;

    use super::*;

    fn prepared(text: &str) -> Prepared {
        let p = Preprocessor::builtin();
        let req = serde_json::from_value(json!({"prompt": text})).unwrap();
        p.prepare_completion_request(&req, 4096).unwrap()
    }

    /// A stream is asked for its usage unless the client asked itself (then it is kept), and
    /// the namespace goes to the engine as `cache_salt` and into the block hashes.
    #[test]
    fn the_outbound_body_asks_for_usage_and_carries_the_namespace() {
        let bs = BlockSize::new(4).unwrap();
        let p = prepared("one two three four five six seven eight nine ten eleven twelve");
        let raw = json!({"prompt": "x", "stream": true, "extra_field": 1});
        let keys = Keys { namespace: Some("k"), ..Keys::default() };
        let out = Outbound::new("/v1/completions", raw.clone(), &p, &keys, bs, &[]).unwrap();
        let body: Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(
            (body["cache_salt"].as_str(), body["extra_field"].as_i64()),
            (Some("k"), Some(1))
        );
        assert!(out.streamed && out.strip_usage);
        let plain = Outbound::new("/v1/completions", raw.clone(), &p, &Keys::default(), bs, &[]);
        let plain = plain.unwrap();
        assert_ne!(
            plain.place.local_hashes, out.place.local_hashes,
            "the namespace changes every block's hash"
        );
        let both = Keys { adapter: Some("sql"), ..keys };
        let adapted = Outbound::new("/v1/completions", raw, &p, &both, bs, &[]).unwrap();
        assert_ne!(
            adapted.place.local_hashes, out.place.local_hashes,
            "the adapter salts them too"
        );
        let hasher = BlockHasher::new(bs).with_namespace(Some("k")).with_lora(Some("sql"));
        assert_eq!(*adapted.place.local_hashes, *hasher.local_hashes(&p.tokens, None));
        assert_eq!(adapted.place.adapter.as_deref(), Some("sql"));

        let asked = json!({"stream": true, "stream_options": {"include_usage": true}});
        let out = Outbound::new("/v1/completions", asked, &p, &Keys::default(), bs, &[]).unwrap();
        assert!(out.streamed && !out.strip_usage);
        let whole = Outbound::new("/v1/completions", json!({}), &p, &Keys::default(), bs, &[]);
        let whole = whole.unwrap();
        assert!(!whole.streamed && !whole.strip_usage);
        let body: Value = serde_json::from_slice(&whole.body).unwrap();
        assert!(body.get("stream_options").is_none());
    }
}

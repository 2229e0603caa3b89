//! Dialects: how a request reaches an engine besides the client's own OpenAI body
//! (docs/dialects.md). With a tokens dialect the front door sends the token ids it rendered
//! and hashed, so the engine caches exactly the blocks the router predicted and tokenizes
//! nothing again; [`crate::translate`] turns the engine's answer back into the OpenAI answer
//! the client asked for:
//! - `vllm-generate`: vLLM 0.33's `/inference/v1/generate`;
//! - `vllm-generate-tokens`: the same with token ids back (`output_mode: "tokens"`), which
//!   the front door detokenizes as vLLM does (`Preprocessor::decode_next`);
//! - `openai-completions-tokens`: `/v1/completions` with the token ids as the prompt;
//! - `sglang-generate`: SGLang's native `/generate`, the token ids as `input_ids`.
//!
//! A request carries as tokens only what the API has a field for: the sampling fields below,
//! streaming and its usage, the cache namespace, images (by URL beside one image token each,
//! with the router's hash: vLLM's `content_parts` with their `uuid`, SGLang's `image_data`
//! with `mm_hashes`)
//! and chat's logprobs (both generate APIs). Anything else (tools, `response_format`, a
//! completion's `logprobs`, `n` above 1, ...) goes to the same worker as chat, counted as a
//! fallback.

use axum::body::Bytes;
use kvroute_http::paths;
use kvroute_http::sglang_generate::{self, OneOrMany, TokenIdsOrList};
use kvroute_http::vllm_generate::{
    self, GenerateRequest, OutputMode, SamplingParams, StreamOptions,
};
use kvroute_preprocess::Prepared;
use kvroute_router::Dialect;
use serde_json::{Map, Value};

/// What keys a request beyond its prompt: its cache namespace (vLLM's `cache_salt`), its
/// LoRA adapter (both salt its block hashes, as engines salt theirs), its session, and its
/// class for flow control.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Keys<'a> {
    pub namespace: Option<&'a str>,
    pub adapter: Option<&'a str>,
    pub session: Option<&'a str>,
    pub class: Option<&'a kvroute_core::schedule::flow::RequestClass>,
    /// Whether the client named its priority (`x-kvroute-priority`): the engines are then
    /// told it in their own field, unless the body sets that itself.
    pub priority_named: bool,
    /// How many times its stream may move to another worker ([`crate::migrate`]).
    pub migrations: u32,
}

/// The engine's `priority` of a request of kvroute `priority` (higher first), as vLLM takes
/// it (lower first; SGLang's is the other way round, [`sglang_priority`]).
pub(crate) fn vllm_priority(priority: i32) -> i64 {
    -i64::from(priority)
}

/// Lowers a body's engine `priority` by one step, so that it runs after the requests of its
/// class from other tenants (and still before those of the class below): vLLM's is lower
/// first, SGLang's `/generate` higher first; a body without one was at 0.
pub(crate) fn lower_priority(body: &mut Value, dialect: Option<Dialect>) {
    let Some(fields) = body.as_object_mut() else { return };
    let now = fields.get("priority").and_then(Value::as_i64).unwrap_or(0);
    let lowered = match dialect {
        Some(Dialect::SglangGenerate) => now.saturating_sub(1),
        _ => now.saturating_add(1),
    };
    fields.insert("priority".to_owned(), lowered.into());
}

/// SGLang's `priority` (higher first, its default) of a body's vLLM-style one.
fn sglang_priority(vllm: i64) -> i64 {
    vllm.saturating_neg()
}

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

/// Fields the front door carries itself (the prompt as tokens, streaming, the namespace, the
/// model as an adapter) or that change nothing an engine computes (a session's key).
const CARRIED: [&str; 13] = [
    "priority",
    "model",
    "prompt_cache_key",
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

/// The answer's bound as an engine reads it: `max_completion_tokens` (chat's newer name),
/// else `max_tokens`; the first of them that `read` takes.
pub(crate) fn answer_bound<T>(body: &Value, read: impl Fn(&Value) -> Option<T>) -> Option<T> {
    ["max_completion_tokens", "max_tokens"].iter().find_map(|k| body.get(*k).and_then(&read))
}

/// The request's body in a tokens `dialect`: the client's OpenAI body `raw` with its
/// `prepared` prompt as token ids, or `None` when it asks for what that API cannot carry (it
/// then goes as chat).
pub(crate) fn tokens_body(
    dialect: Dialect,
    raw: &Value,
    prepared: &Prepared,
    keys: &Keys<'_>,
    streamed: bool,
) -> Option<Bytes> {
    let (namespace, adapter) = (keys.namespace, keys.adapter);
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
    if logprobs.is_some() && !(generate || dialect == Dialect::SglangGenerate) {
        return None;
    }
    let mut sampling = Map::new();
    for key in SAMPLING {
        if let Some(v) = fields.get(key).filter(|v| !v.is_null()) {
            sampling.insert(key.to_owned(), v.clone());
        }
    }
    let max_tokens = answer_bound(raw, Value::as_i64);
    if let (Some(k), true) = (logprobs, generate) {
        sampling.insert("logprobs".to_owned(), k.into());
    }
    let body = match dialect {
        Dialect::OpenaiChat => return None,
        Dialect::VllmGenerate | Dialect::VllmGenerateTokens => {
            let mode = match dialect {
                Dialect::VllmGenerateTokens => OutputMode::Tokens,
                _ => OutputMode::Text,
            };
            let asked = Asked { max_tokens, namespace, adapter, streamed, logprobs };
            generate_body(prepared, raw, sampling, &asked, mode)?
        }
        Dialect::OpenaiCompletionsTokens => {
            if !prepared.mm.mm_objects.is_empty() {
                return None; // a completion's prompt has no images
            }
            let mut body = sampling;
            body.insert("prompt".to_owned(), prepared.tokens.clone().into());
            for key in ["model", "stream", "stream_options", "cache_salt", "priority"] {
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
            let asked = Asked { max_tokens, namespace, adapter, streamed, logprobs };
            sglang_body(prepared, raw, &sampling, &asked)?
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

/// What a request asks of an engine besides its prompt and sampling fields.
struct Asked<'a> {
    max_tokens: Option<i64>,
    namespace: Option<&'a str>,
    /// The LoRA adapter: vLLM's `model`, SGLang's `lora_path` (an adapter's name there).
    adapter: Option<&'a str>,
    streamed: bool,
    /// Chat's logprobs: this many top candidates per token.
    logprobs: Option<u64>,
}

fn sglang_body(
    prepared: &Prepared,
    raw: &Value,
    sampling: &Map<String, Value>,
    asked: &Asked<'_>,
) -> Option<Vec<u8>> {
    let Asked { max_tokens, namespace, adapter, streamed, logprobs } = *asked;
    let (input_ids, images) = collapsed_images(prepared, raw)?;
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
        return_logprob: logprobs.map(|_| OneOrMany::One(true)),
        top_logprobs_num: logprobs.map(|k| OneOrMany::One(i64::try_from(k).unwrap_or(0))),
        return_text_in_logprobs: logprobs.map(|_| true),
        stream: streamed,
        sampling_params: Some(OneOrMany::One(params)),
        cache_salt: namespace.map(|ns| OneOrMany::One(ns.to_owned())),
        lora_path: adapter.map(|a| Value::String(a.to_owned())),
        priority: raw.get("priority").and_then(Value::as_i64).map(sglang_priority),
        ..sglang_generate::GenerateRequest::default()
    };
    serde_json::to_vec(&request).ok()
}

/// The prompt as vLLM and SGLang take it with images beside token ids: each image's
/// placeholder run back to its one image token (the engine expands it again by the image's
/// size, as the front door did), with each image's URL as the client sent it and its hash in
/// kvroute's 16-hex form, which both engines key their prefix cache by (SGLang's
/// `mm_hashes`, vLLM's multimodal `uuid`), so their blocks are the router's. `None` when the
/// images and the client's URLs do not pair up.
#[allow(clippy::type_complexity)]
fn collapsed_images(
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

/// vLLM's generate body. Images go as `content_parts` (each one's URL as the client sent it,
/// its `uuid` the router's hash, which vLLM takes as the item's hash), beside token ids with
/// one image token each, which vLLM's processor expands by the image's size as the front door
/// did; vLLM resolves the media itself. (`features` would carry only hashes and placeholders,
/// which a vLLM serves only for images it already holds.)
fn generate_body(
    prepared: &Prepared,
    raw: &Value,
    other: Map<String, Value>,
    asked: &Asked<'_>,
    output_mode: OutputMode,
) -> Option<Vec<u8>> {
    let Asked { max_tokens, namespace, adapter, streamed, .. } = *asked;
    let sampling_params = SamplingParams { max_tokens, other, ..SamplingParams::default() };
    let (token_ids, images) = collapsed_images(prepared, raw)?;
    let content_parts = images.map(|(urls, hashes)| {
        let part = |(url, uuid)| {
            let part = serde_json::json!({"type": "image_url", "url": url, "uuid": uuid});
            part.as_object().cloned().unwrap_or_default()
        };
        urls.into_iter().zip(hashes).map(part).collect()
    });
    let request = GenerateRequest {
        token_ids,
        content_parts,
        sampling_params,
        output_mode,
        stream: streamed.then_some(true),
        stream_options: streamed
            .then_some(StreamOptions { include_usage: Some(true), continuous_usage_stats: None }),
        cache_salt: namespace.map(str::to_owned),
        model: adapter.map(str::to_owned),
        priority: raw.get("priority").and_then(Value::as_i64).unwrap_or(0),
        ..GenerateRequest::default()
    };
    serde_json::to_vec(&request).ok()
}

/// Where a tokens dialect's body goes.
pub(crate) fn path(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::OpenaiChat => paths::CHAT_COMPLETIONS,
        Dialect::VllmGenerate | Dialect::VllmGenerateTokens => vllm_generate::PATH,
        Dialect::OpenaiCompletionsTokens => paths::COMPLETIONS,
        Dialect::SglangGenerate => sglang_generate::PATH,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_lowered_priority_is_one_step_later_in_each_engines_order() {
        // vLLM's (and an OpenAI body's): lower first, so later is one more; none was 0.
        let mut chat = json!({"messages": [], "priority": -10});
        lower_priority(&mut chat, None);
        assert_eq!(chat["priority"], -9);
        let mut plain = json!({"messages": []});
        lower_priority(&mut plain, Some(Dialect::VllmGenerate));
        assert_eq!(plain["priority"], 1);
        // SGLang's /generate: higher first, so later is one less.
        let mut sglang = json!({"input_ids": [1, 2], "priority": 10});
        lower_priority(&mut sglang, Some(Dialect::SglangGenerate));
        assert_eq!(sglang["priority"], 9);
        let mut odd = json!([1, 2]);
        lower_priority(&mut odd, None);
        assert_eq!(odd, json!([1, 2]), "not a body: left alone");
    }
}

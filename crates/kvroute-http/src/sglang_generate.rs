//! SGLang's native `POST /generate`, field by field as sglang 0.5.23 defines it (the JSON
//! contract `sglang/api/v1/api_types.py`, generated from the schema its Rust server decodes
//! with; `GenerateReqInput` in `srt/managers/io_struct.py`; the answers built in
//! `srt/managers/tokenizer_manager.py`). kvroute's front door sends it the prompt it already
//! tokenized (`input_ids`); the simulated engine serves it.
//!
//! SGLang refuses a request in two shapes, both 400:
//! - the contract (a field of the wrong type, an unknown sampling parameter):
//!   `{"error": "<serde's text>"}`. The request ignores fields it does not know; its
//!   `sampling_params` refuse them. Decoding with serde gives serde's own texts, which the
//!   contract was written to match.
//! - the server's checks (no prompt, a sampling value out of range, a prompt too long):
//!   `{"error": {"message": "..."}}`, with SGLang's messages ([`GenerateRequest::check`]).

use serde::de::{DeserializeOwned, Error as _, Unexpected};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value, json};

/// `POST /generate`.
pub const PATH: &str = "/generate";

/// SGLang's default `max_new_tokens` when the field is absent (null means no limit).
pub const DEFAULT_MAX_NEW_TOKENS: i64 = 128;

/// A field that takes one value or a batch of them (`StringOrList`, `BoolOrList`, ...): a JSON
/// array is the batch.
#[derive(Clone, Debug, PartialEq)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The value of a single request; `None` for a batch.
    pub fn one(&self) -> Option<&T> {
        match self {
            OneOrMany::One(t) => Some(t),
            OneOrMany::Many(_) => None,
        }
    }
}

/// The contract's name of a `OneOrMany<T>`, for its error text.
pub trait OrListName {
    const NAME: &'static str;
    /// A single value's own error stands (a struct's, such as an unknown field), rather than
    /// the or-list's.
    const OWN_ERRORS: bool = false;
}
impl OrListName for String {
    const NAME: &'static str = "StringOrList";
}
impl OrListName for bool {
    const NAME: &'static str = "BoolOrList";
}
impl OrListName for i64 {
    const NAME: &'static str = "Int64OrList";
}
impl OrListName for SamplingParams {
    const NAME: &'static str = "SamplingParamsOrList";
    const OWN_ERRORS: bool = true;
}

/// serde's name for a JSON value, as the contract's errors show it.
fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Other("null"),
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Unexpected::Signed(i),
            (None, Some(u)) => Unexpected::Unsigned(u),
            _ => Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

impl<'de, T: DeserializeOwned + OrListName> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        if v.is_array() {
            return serde_json::from_value(v).map(OneOrMany::Many).map_err(D::Error::custom);
        }
        serde_json::from_value(v.clone()).map(OneOrMany::One).map_err(|e| match T::OWN_ERRORS {
            true => D::Error::custom(e),
            false => {
                let expected = format!("a value or an array of values for {}", T::NAME);
                D::Error::invalid_type(unexpected(&v), &expected.as_str())
            }
        })
    }
}

impl<T: Serialize> Serialize for OneOrMany<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            OneOrMany::One(t) => t.serialize(s),
            OneOrMany::Many(v) => v.serialize(s),
        }
    }
}

/// `input_ids`: one prompt's token ids, or a batch of them (an array whose first element is
/// not a number).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TokenIdsOrList {
    One(Vec<i64>),
    Many(Vec<Vec<i64>>),
}

impl<'de> Deserialize<'de> for TokenIdsOrList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        let Value::Array(items) = &v else {
            let expected = "a value or an array of values for TokenIdsOrList";
            return Err(D::Error::invalid_type(unexpected(&v), &expected));
        };
        match items.first().is_none_or(Value::is_number) {
            true => serde_json::from_value(v).map(TokenIdsOrList::One),
            false => serde_json::from_value(v).map(TokenIdsOrList::Many),
        }
        .map_err(D::Error::custom)
    }
}

/// SGLang's `GenerateRequest`: the fields kvroute sends or the simulated engine reads; any
/// other is ignored, as SGLang ignores fields it does not know.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The caller's id, answered as `meta_info.id`; absent: a random one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<OneOrMany<String>>,
    /// A prompt as text, tokenized by the engine (without a chat template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<OneOrMany<String>>,
    /// A prompt as token ids; with `text` too, the ids are the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ids: Option<TokenIdsOrList>,
    #[serde(default, deserialize_with = "null_is_default", skip_serializing_if = "is_false")]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_params: Option<OneOrMany<SamplingParams>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_logprob: Option<OneOrMany<bool>>,
    /// With `return_logprob`: this many top candidates per output token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs_num: Option<OneOrMany<i64>>,
    /// With `return_logprob`: each logprob entry carries its token's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_text_in_logprobs: Option<bool>,
    /// Images: URLs, paths or base64, one per image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_data: Option<Value>,
    /// Each image's hash as the caller computed it, for the engine's prefix cache to key by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mm_hashes: Option<Value>,
    /// The cache namespace: prefixes of different salts never share blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<OneOrMany<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_path: Option<Value>,
    /// Disaggregation: where the prefill engine's KV is fetched from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_host: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_room: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_dp_rank: Option<i64>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn null_is_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn default_max_new_tokens() -> Option<i64> {
    Some(DEFAULT_MAX_NEW_TOKENS)
}

/// SGLang's `SamplingParams`, every field of its contract in its order (so an unknown one is
/// refused with the same list). Absent fields take SGLang's defaults, which serialize as
/// absent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParams {
    /// Absent: 128; null: as many as the context has room for.
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<OneOrMany<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<i64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_regex: Option<OneOrMany<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_new_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ebnf: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structural_tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spaces_between_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_stop_trim: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_interval: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_params: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beam_width: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watermark: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<Vec<String>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        serde_json::from_value(json!({})).unwrap_or_else(|_| unreachable!("all fields default"))
    }
}

/// A refusal, in SGLang's shape for it (both are 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The body breaks the JSON contract: `{"error": "<text>"}`.
    Contract(String),
    /// The server's own checks: `{"error": {"message": "<text>"}}`.
    Invalid(String),
}

impl Refusal {
    /// The answer's body.
    pub fn body(&self) -> Value {
        match self {
            Refusal::Contract(m) => json!({"error": m}),
            Refusal::Invalid(m) => json!({"error": {"message": m}}),
        }
    }
}

/// A request body as SGLang decodes it: JSON, then the contract.
pub fn decode(body: &[u8]) -> Result<GenerateRequest, Refusal> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| Refusal::Contract(e.to_string()))?;
    if !value.is_object() {
        // serde would read an array as the struct's fields in order.
        let e = serde_json::Error::invalid_type(unexpected(&value), &"struct GenerateRequest");
        return Err(Refusal::Contract(e.to_string()));
    }
    serde_json::from_value(value).map_err(|e| Refusal::Contract(e.to_string()))
}

impl GenerateRequest {
    /// SGLang's checks that need no model: a prompt is given, and its sampling parameters are
    /// in range (`SamplingParams.verify`). Those against the model (the vocabulary, the
    /// context length) are the engine's.
    pub fn check(&self) -> Result<(), Refusal> {
        if self.text.is_none() && self.input_ids.is_none() {
            return Err(Refusal::Invalid(
                "Either text, input_ids or input_embeds should be provided.".to_owned(),
            ));
        }
        match &self.sampling_params {
            Some(OneOrMany::One(p)) => p.verify(),
            Some(OneOrMany::Many(ps)) => ps.iter().try_for_each(SamplingParams::verify),
            None => Ok(()),
        }
    }

    /// The single prompt's sampling parameters (SGLang's defaults when absent).
    pub fn params(&self) -> SamplingParams {
        self.sampling_params.as_ref().and_then(OneOrMany::one).cloned().unwrap_or_default()
    }

    /// Whether the request is a batch of prompts.
    pub fn is_batch(&self) -> bool {
        matches!(self.input_ids, Some(TokenIdsOrList::Many(_)))
            || (self.input_ids.is_none() && matches!(self.text, Some(OneOrMany::Many(_))))
    }
}

/// A float as Python prints it (`-1.0`, not Rust's `-1`), for SGLang's messages.
fn py(x: f64) -> String {
    match x.is_finite() && x.fract() == 0.0 && x.abs() < 1e16 {
        true => format!("{x:.1}"),
        false => format!("{x}"),
    }
}

impl SamplingParams {
    /// SGLang's `SamplingParams.verify`, in its order and with its messages (temperature 0
    /// and top_k -1 are normalized before, so they pass).
    pub fn verify(&self) -> Result<(), Refusal> {
        let bad = |m: String| Err(Refusal::Invalid(m));
        if let Some(b) = self.beam_width.filter(|&b| b < 1) {
            return bad(format!("beam_width must be at least 1, got {b}."));
        }
        let t = self.temperature.unwrap_or(1.0);
        if !t.is_finite() || t < 0.0 {
            return bad(format!(
                "temperature must be a non-negative finite number, got {}.",
                py(t)
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}.", py(top_p)));
        }
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return bad(format!("min_p must be in [0, 1], got {}.", py(min_p)));
        }
        if let Some(k) = self.top_k.filter(|&k| k < 1 && k != -1) {
            return bad(format!("top_k must be -1 (disable) or at least 1, got {k}."));
        }
        let f = self.frequency_penalty.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&f) {
            return bad(format!("frequency_penalty must be in [-2, 2], got {}.", py(f)));
        }
        let p = self.presence_penalty.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&p) {
            return bad(format!("presence_penalty must be in [-2, 2], got {}.", py(p)));
        }
        let r = self.repetition_penalty.unwrap_or(1.0);
        if !(r > 0.0 && r <= 2.0) {
            return bad(format!(
                "repetition_penalty must be in (0, 2] (1.0 = no penalty), got {}.",
                py(r)
            ));
        }
        let min_new = self.min_new_tokens.unwrap_or(0);
        if min_new < 0 {
            return bad(format!("min_new_tokens must be in [0, max_new_tokens], got {min_new}."));
        }
        if let Some(max) = self.max_new_tokens {
            if max < 0 {
                return bad(format!("max_new_tokens must be at least 0, got {max}."));
            }
            if min_new > max {
                return bad(format!(
                    "min_new_tokens must be in [0, max_new_tokens({max})], got {min_new}."
                ));
            }
        }
        Ok(())
    }
}

/// Why an answer ended: `{"type": "length", "length": n}`, `{"type": "stop", "matched": ..}`
/// or `{"type": "abort", ...}`; `null` while it runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FinishReason {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(flatten)]
    pub detail: Map<String, Value>,
}

impl FinishReason {
    /// It reached `max_new_tokens` (`length`).
    pub fn length(length: u64) -> Self {
        let detail = Map::from_iter([("length".to_owned(), length.into())]);
        Self { kind: "length".to_owned(), detail }
    }

    /// It generated a stop token (`matched`).
    pub fn matched_token(token: u32) -> Self {
        let detail = Map::from_iter([("matched".to_owned(), token.into())]);
        Self { kind: "stop".to_owned(), detail }
    }
}

/// `meta_info`: the answer's id, why it ended, and what it cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaInfo {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    #[serde(default)]
    pub reasoning_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_latency: Option<f64>,
    /// With `return_logprob`: each output token's `[logprob, token_id, text or null]`, all
    /// of them so far in every chunk of a cumulative stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs: Option<Vec<LogprobEntry>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs_length: Option<u64>,
    /// The prompt's (empty: SGLang's default `logprob_start_len` of -1 asks none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_token_logprobs: Option<Vec<LogprobEntry>>,
    /// With `top_logprobs_num` above 0: each output token's top candidates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_top_logprobs: Option<Vec<Option<Vec<LogprobEntry>>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_top_logprobs: Option<Vec<Option<Vec<LogprobEntry>>>>,
}

/// One logprob as SGLang writes it: `[logprob, token_id, text]`, the text `null` unless
/// `return_text_in_logprobs`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogprobEntry(pub f64, pub i64, pub Option<String>);

/// An answer, or (streamed) a chunk of one. SGLang's stream is cumulative by default: every
/// chunk carries the whole text and ids so far (with `--incremental-streaming-output`, only
/// the new ones).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateResponse {
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub output_ids: Vec<u32>,
    #[serde(default)]
    pub meta_info: MetaInfo,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: &Value) -> Refusal {
        match decode(body.to_string().as_bytes()).and_then(|r| r.check().map(|()| r)) {
            Ok(r) => panic!("accepted: {r:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn decodes_the_shapes_sglang_takes() {
        let r = decode(br#"{"input_ids":[1,2,3],"stream":null,"sampling_params":{"max_new_tokens":8,"temperature":0},"rid":"a","cache_salt":"s","unknown":{"x":1}}"#).unwrap();
        assert_eq!(r.input_ids, Some(TokenIdsOrList::One(vec![1, 2, 3])));
        assert!(!r.stream);
        assert_eq!(r.params().max_new_tokens, Some(8));
        assert_eq!(r.rid, Some(OneOrMany::One("a".to_owned())));
        r.check().unwrap();
        // Absent max_new_tokens is 128; null is no limit.
        assert_eq!(decode(br#"{"text":"hi"}"#).unwrap().params().max_new_tokens, Some(128));
        let null = decode(br#"{"text":"hi","sampling_params":{"max_new_tokens":null}}"#).unwrap();
        assert_eq!(null.params().max_new_tokens, None);
        // A batch: an array of arrays, or of texts.
        let batch = decode(br#"{"input_ids":[[1],[2,3]]}"#).unwrap();
        assert_eq!(batch.input_ids, Some(TokenIdsOrList::Many(vec![vec![1], vec![2, 3]])));
        assert!(batch.is_batch());
        assert!(decode(br#"{"text":["a","b"]}"#).unwrap().is_batch());
        assert!(!decode(br#"{"input_ids":[]}"#).unwrap().is_batch());
        // What the front door sends reads back the same.
        let sent = GenerateRequest {
            input_ids: Some(TokenIdsOrList::One(vec![5, 6])),
            stream: true,
            sampling_params: Some(OneOrMany::One(SamplingParams {
                max_new_tokens: Some(4),
                ..SamplingParams::default()
            })),
            ..GenerateRequest::default()
        };
        assert_eq!(decode(&serde_json::to_vec(&sent).unwrap()).unwrap(), sent);
    }

    #[test]
    fn contract_errors_are_serdes_texts() {
        let cases = [
            (json!([1]), "invalid type: sequence, expected struct GenerateRequest"),
            (
                json!({"input_ids": "12"}),
                "invalid type: string \"12\", expected a value or an array of values for TokenIdsOrList",
            ),
            (json!({"input_ids": [1, "x"]}), "invalid type: string \"x\", expected i64"),
            (json!({"input_ids": [1.5]}), "invalid type: floating point `1.5`, expected i64"),
            (
                json!({"text": 3}),
                "invalid type: integer `3`, expected a value or an array of values for StringOrList",
            ),
            (
                json!({"text": "a", "stream": "yes"}),
                "invalid type: string \"yes\", expected a boolean",
            ),
            (
                json!({"text": "a", "sampling_params": {"max_new_tokens": "8"}}),
                "invalid type: string \"8\", expected i64",
            ),
            (
                json!({"text": "a", "sampling_params": [{"n": "1"}]}),
                "invalid type: string \"1\", expected i64",
            ),
        ];
        for (body, want) in cases {
            match refused(&body) {
                Refusal::Contract(m) => assert_eq!(m, want, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        let Refusal::Contract(m) =
            refused(&json!({"text": "a", "sampling_params": {"max_tokens": 8}}))
        else {
            panic!("not a contract error")
        };
        assert!(
            m.starts_with("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`,"),
            "{m}"
        );
        assert!(m.ends_with("`watermark`, `choice`"), "{m}");
        assert_eq!(Refusal::Contract("x".into()).body(), json!({"error": "x"}));
    }

    #[test]
    fn the_servers_checks_have_its_messages() {
        let cases = [
            (
                json!({"sampling_params": {}}),
                "Either text, input_ids or input_embeds should be provided.",
            ),
            (
                json!({"text": "a", "sampling_params": {"temperature": -1}}),
                "temperature must be a non-negative finite number, got -1.0.",
            ),
            (
                json!({"text": "a", "sampling_params": {"top_p": 0}}),
                "top_p must be in (0, 1], got 0.0.",
            ),
            (
                json!({"text": "a", "sampling_params": {"top_p": 1.5}}),
                "top_p must be in (0, 1], got 1.5.",
            ),
            (
                json!({"text": "a", "sampling_params": {"top_k": 0}}),
                "top_k must be -1 (disable) or at least 1, got 0.",
            ),
            (
                json!({"text": "a", "sampling_params": {"max_new_tokens": -1}}),
                "max_new_tokens must be at least 0, got -1.",
            ),
            (
                json!({"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}),
                "min_new_tokens must be in [0, max_new_tokens(2)], got 3.",
            ),
            (
                json!({"text": "a", "sampling_params": {"repetition_penalty": 3}}),
                "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 3.0.",
            ),
        ];
        for (body, want) in cases {
            let r = refused(&body);
            assert_eq!(r, Refusal::Invalid(want.to_owned()), "{body}");
            assert_eq!(r.body(), json!({"error": {"message": want}}));
        }
        // SGLang normalizes these before it checks.
        let ok = json!({"text": "a", "sampling_params": {"top_k": -1, "temperature": 0}});
        decode(ok.to_string().as_bytes()).unwrap().check().unwrap();
    }

    #[test]
    fn answers_have_sglangs_shape() {
        let answer = GenerateResponse {
            text: Some("hi".to_owned()),
            output_ids: vec![7, 8],
            meta_info: MetaInfo {
                id: "r".to_owned(),
                finish_reason: Some(FinishReason::length(2)),
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_tokens: 1,
                ..MetaInfo::default()
            },
        };
        let v = serde_json::to_value(&answer).unwrap();
        assert_eq!(v["meta_info"]["finish_reason"], json!({"type": "length", "length": 2}));
        assert_eq!(v["meta_info"]["cached_tokens"], 1);
        let stop = serde_json::to_value(FinishReason::matched_token(2)).unwrap();
        assert_eq!(stop, json!({"type": "stop", "matched": 2}));
        let running: GenerateResponse =
            serde_json::from_value(json!({"text": null, "output_ids": [1], "meta_info": {"id": "r", "finish_reason": null}}))
                .unwrap();
        assert_eq!(running.meta_info.finish_reason, None);
    }
}

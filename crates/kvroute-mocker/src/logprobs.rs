//! Log probabilities, simulated. The engine has no model, so it makes up a fixed
//! distribution: the sampled token has log probability -0.25 and rank 1, and the k - 1 ids
//! after it in the vocabulary follow at -1.25, -2.25, ... with ranks 2, 3, .... The values mean
//! nothing; the shapes are vLLM's, so a client (or the front door between them) that reads
//! logprobs is exercised end to end:
//! - the generate API's tokens mode: `{"content": [{"token_id", "logprob", "rank",
//!   "top_logprobs": [...]}]}` (`GenerateLogProbs`, ids only: that server has no tokenizer);
//! - its text mode and the chat API: OpenAI's chat logprobs, `{"content": [{"token",
//!   "logprob", "bytes", "top_logprobs": [...]}]}`, each token's text decoded alone;
//! - SGLang's `/generate`: `meta_info.output_token_logprobs` and `output_top_logprobs`,
//!   `[logprob, token_id, text or null]` each.

use kvroute_http::openai::chat_logprob;
use kvroute_http::sglang_generate::LogprobEntry;
use kvroute_preprocess::Preprocessor;
use serde::Deserialize;
use serde_json::{Value, json};

/// The sampled token's log probability.
const SAMPLED: f64 = -0.25;

/// How many log probabilities per token a request asked for, if any: chat's `logprobs:
/// true` with `top_logprobs` (0 when absent). Read from a body the API's own checks passed.
pub(crate) fn asked_by_chat(body: &[u8]) -> Option<u32> {
    #[derive(Deserialize)]
    struct Ask {
        #[serde(default)]
        logprobs: Option<Value>,
        #[serde(default)]
        top_logprobs: Option<Value>,
    }
    let ask: Ask = serde_json::from_slice(body).ok()?;
    (ask.logprobs == Some(Value::Bool(true))).then(|| {
        let k = ask.top_logprobs.as_ref().and_then(Value::as_u64).unwrap_or(0);
        u32::try_from(k).unwrap_or(0)
    })
}

/// `token`'s candidates, `k` of them (at least the sampled one): (id, log probability, rank).
fn candidates(token: u32, k: u32, vocab: u32) -> impl Iterator<Item = (u32, f64, u32)> {
    (0..k.max(1)).map(move |j| {
        let id = token.wrapping_add(j) % vocab.max(1);
        (id, SAMPLED - f64::from(j), j + 1)
    })
}

/// The generate API's tokens-mode logprobs of `tokens`, `k` candidates each.
pub(crate) fn by_id(tokens: &[u32], k: u32, vocab: u32) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|&t| {
            let top: Vec<Value> = candidates(t, k, vocab)
                .map(|(id, lp, rank)| json!({"token_id": id, "logprob": lp, "rank": rank}))
                .collect();
            json!({"token_id": t, "logprob": SAMPLED, "rank": 1, "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}

/// OpenAI's chat logprobs of `tokens`, `k` alternatives each (`top_logprobs` empty for 0).
pub(crate) fn as_text(p: &Preprocessor, tokens: &[u32], k: u32, vocab: u32) -> Value {
    let entry = |id: u32, lp: f64| chat_logprob(&p.decode(&[id]).unwrap_or_default(), lp);
    let content: Vec<Value> = tokens
        .iter()
        .map(|&t| {
            let top: Vec<Value> = match k {
                0 => Vec::new(),
                k => candidates(t, k, vocab).map(|(id, lp, _)| entry(id, lp)).collect(),
            };
            let mut e = entry(t, SAMPLED);
            e["top_logprobs"] = Value::Array(top);
            e
        })
        .collect();
    json!({ "content": content })
}

/// SGLang's logprobs of `tokens` (`meta_info.output_token_logprobs`, and with `k` above 0
/// `output_top_logprobs`): `[logprob, id, text]` entries, the text only when `with_text`.
#[allow(clippy::type_complexity)]
pub(crate) fn sglang(
    p: &Preprocessor,
    tokens: &[u32],
    k: u32,
    with_text: bool,
    vocab: u32,
) -> (Vec<LogprobEntry>, Option<Vec<Option<Vec<LogprobEntry>>>>) {
    let entry = |id: u32, lp: f64| {
        let text = with_text.then(|| p.decode(&[id]).unwrap_or_default());
        LogprobEntry(lp, i64::from(id), text)
    };
    let sampled = tokens.iter().map(|&t| entry(t, SAMPLED)).collect();
    let top = (k > 0).then(|| {
        tokens
            .iter()
            .map(|&t| Some(candidates(t, k, vocab).map(|(id, lp, _)| entry(id, lp)).collect()))
            .collect()
    });
    (sampled, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampled_token_comes_first_and_ranks_follow() {
        let v = by_id(&[7, 9], 3, 10);
        let first = &v["content"][0];
        assert_eq!((first["token_id"].as_u64(), first["rank"].as_u64()), (Some(7), Some(1)));
        let top = first["top_logprobs"].as_array().cloned().unwrap_or_default();
        let ids: Vec<u64> = top.iter().filter_map(|t| t["token_id"].as_u64()).collect();
        assert_eq!(ids, [7, 8, 9]);
        let wrapped = by_id(&[9], 3, 10);
        assert_eq!(
            wrapped["content"][0]["top_logprobs"][2]["token_id"], 1,
            "within the vocabulary"
        );
    }

    #[test]
    fn chat_asks_by_logprobs_true() {
        assert_eq!(asked_by_chat(br#"{"logprobs": true, "top_logprobs": 3}"#), Some(3));
        assert_eq!(asked_by_chat(br#"{"logprobs": true}"#), Some(0));
        assert_eq!(asked_by_chat(br#"{"logprobs": false, "top_logprobs": 3}"#), None);
        assert_eq!(asked_by_chat(br#"{"messages": []}"#), None);
    }
}

//! Reusing the token ids of a prompt's beginning that was tokenized before: shared-prefix
//! traffic sends the same long system prompt or document with a new question each time, and
//! tokenizing it again costs the front door milliseconds per request.
//!
//! A tokenizer's output for `a + b` is its output for `a` followed by its output for `b` when
//! the cut falls where its pre-tokenizer cuts anyway: pre-tokens are tokenized one by one.
//! That is proved here for one family only, and the cache is used only for it (every other
//! tokenizer tokenizes in full, [`PrefixCache::for_tokenizer`]):
//! - no normalizer, no truncation or padding, a BPE model without dropout;
//! - the GPT-2 byte-level pre-tokenizer (`ByteLevel`, its regex, no prefix space), whose
//!   pieces are `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`;
//! - added tokens that hold no space and strip nothing around them.
//!
//! The cut points are single ASCII spaces between two ASCII letters (`…a b…`): the letter run
//! before ends there in any text, the next piece starts there (` ?\p{L}+`), and no piece or
//! added token spans it. The cache keeps the ids between checkpoints (the first cut point past
//! every [`CHECKPOINT_BYTES`]), each chunk keyed by the blake3 hash of the text up to its end,
//! so two prompts that share a beginning share its chunks, and a prompt's ids are held once.
//! A prompt is tokenized from the end of its longest run of cached chunks on. `tests::cached_tokenizing_is_the_tokenizers` checks the
//! result against the tokenizer's own on random texts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[cfg(test)]
use tokenizers::Tokenizer;

/// Checkpoints are the first cut point at or past every multiple of this many bytes (about
/// 250 tokens of English).
pub const CHECKPOINT_BYTES: usize = 1024;

/// The most token ids the cache holds in all (4 MiB, room for 500 beginnings of 2,000 tokens;
/// a larger cache slowed cold prompts by its memory traffic); the least recently used chunks go
/// first.
pub const MAX_CACHED_TOKENS: usize = 1 << 20;

/// Cached chunks of ids by the blake3 hash of the text up to the chunk's end: the chunk is
/// the ids from the checkpoint before (or the start) to that one.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    inner: Mutex<Inner>,
    max_tokens: usize,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<[u8; 32], Entry>,
    tokens: usize,
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    ids: Arc<[u32]>,
    used: u64,
}

impl PrefixCache {
    /// A cache for a tokenizer (its serialized form), if its output is proved to compose at
    /// the cut points.
    pub(crate) fn for_tokenizer(json: &serde_json::Value) -> Option<Self> {
        eligible(json).then(|| Self::with_budget(MAX_CACHED_TOKENS))
    }

    fn with_budget(max_tokens: usize) -> Self {
        Self { inner: Mutex::new(Inner::default()), max_tokens }
    }

    /// Token ids of `text`, as `tokenizer.encode(text, false)` gives them.
    #[cfg(test)]
    pub(crate) fn encode(&self, tokenizer: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        self.encode_with(text, &|t| tokenizer.encode(t, false).map(|e| e.get_ids().to_vec()))
    }

    /// Token ids of `text`, its chunks past the cached ones tokenized by `encode` one by one
    /// (a cut point is where the tokenizer's output composes).
    pub(crate) fn encode_with(
        &self,
        text: &str,
        encode: &dyn Fn(&str) -> tokenizers::Result<Vec<u32>>,
    ) -> tokenizers::Result<Vec<u32>> {
        let cuts = checkpoints(text.as_bytes());
        let mut hasher = blake3::Hasher::new();
        let mut keys = Vec::with_capacity(cuts.len());
        let mut from = 0;
        for &cut in &cuts {
            hasher.update(&text.as_bytes()[from..cut]);
            keys.push(*hasher.finalize().as_bytes());
            from = cut;
        }
        let (mut ids, first_new) = self.cached_chunks(&keys);
        // The chunks up to the checkpoints past the cached ones, for the prompts to come.
        let mut fresh = Vec::new();
        let mut from = first_new.checked_sub(1).map_or(0, |k| cuts[k]);
        for k in first_new..cuts.len() {
            let chunk = encode(&text[from..cuts[k]])?;
            ids.extend_from_slice(&chunk);
            fresh.push((keys[k], Arc::<[u32]>::from(chunk)));
            from = cuts[k];
        }
        ids.extend(encode(&text[from..])?);
        self.insert(fresh);
        Ok(ids)
    }

    /// The ids of the text up to its longest run of cached checkpoints from the start (each
    /// entry holds the chunk since the checkpoint before it), and how many checkpoints that
    /// covers; the chunks are marked used.
    fn cached_chunks(&self, keys: &[[u8; 32]]) -> (Vec<u32>, usize) {
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.clock += 1;
        let now = inner.clock;
        let mut ids = Vec::new();
        for (k, key) in keys.iter().enumerate() {
            let Some(entry) = inner.map.get_mut(key) else { return (ids, k) };
            entry.used = now;
            ids.extend_from_slice(&entry.ids);
        }
        (ids, keys.len())
    }

    fn insert(&self, fresh: Vec<([u8; 32], Arc<[u32]>)>) {
        if fresh.is_empty() {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.clock += 1;
        let used = inner.clock;
        for (key, ids) in fresh {
            if ids.len() > self.max_tokens / 4 || inner.map.contains_key(&key) {
                continue;
            }
            inner.tokens += ids.len();
            inner.map.insert(key, Entry { ids, used });
        }
        if inner.tokens > self.max_tokens {
            evict(&mut inner, self.max_tokens * 3 / 4);
        }
    }

    #[cfg(test)]
    fn cached_tokens(&self) -> usize {
        self.inner.lock().map(|i| i.tokens).unwrap_or(0)
    }
}

/// Drops the least recently used chunks until at most `target` ids are held.
fn evict(inner: &mut Inner, target: usize) {
    let mut by_age: Vec<([u8; 32], u64, usize)> =
        inner.map.iter().map(|(k, e)| (*k, e.used, e.ids.len())).collect();
    by_age.sort_unstable_by_key(|&(_, used, _)| used);
    for (key, _, len) in by_age {
        if inner.tokens <= target {
            break;
        }
        inner.map.remove(&key);
        inner.tokens -= len;
    }
}

/// Whether a byte index is a cut point: a single ASCII space between two ASCII letters.
fn is_cut(bytes: &[u8], i: usize) -> bool {
    i > 0
        && i + 1 < bytes.len()
        && bytes[i] == b' '
        && bytes[i - 1].is_ascii_alphabetic()
        && bytes[i + 1].is_ascii_alphabetic()
}

/// The checkpoints of a text: the first cut point at or past each multiple of
/// [`CHECKPOINT_BYTES`], so that texts sharing a beginning share the checkpoints in it.
fn checkpoints(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut i = CHECKPOINT_BYTES;
    while i < bytes.len() {
        match (i..bytes.len()).find(|&j| is_cut(bytes, j)) {
            Some(cut) => {
                out.push(cut);
                i = (cut / CHECKPOINT_BYTES + 1) * CHECKPOINT_BYTES;
            }
            None => break,
        }
    }
    out
}

/// Whether the tokenizer is of the family whose output composes at cut points.
fn eligible(json: &serde_json::Value) -> bool {
    let pre = &json["pre_tokenizer"];
    let gpt2_bytes =
        pre["type"] == "ByteLevel" && pre["add_prefix_space"] == false && pre["use_regex"] == true;
    let model = &json["model"];
    let bpe = model["type"] == "BPE" && model["dropout"].is_null();
    let added_ok = json["added_tokens"].as_array().is_some_and(|added| {
        added.iter().all(|a| {
            a["lstrip"] == false
                && a["rstrip"] == false
                && a["content"].as_str().is_some_and(|c| !c.contains(char::is_whitespace))
        })
    });
    gpt2_bytes
        && bpe
        && added_ok
        && json["normalizer"].is_null()
        && json["truncation"].is_null()
        && json["padding"].is_null()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::Preprocessor;

    fn tokenizer() -> Tokenizer {
        Preprocessor::builtin().tokenizer
    }

    /// Text from the model's words with spaces, punctuation, digits, newlines and special
    /// tokens between them: the pieces a prompt is made of.
    fn pieces() -> impl Strategy<Value = String> {
        let tk = tokenizer();
        let words: Vec<String> = (0..tk.get_vocab_size(true) as u32)
            .filter_map(|id| tk.decode(&[id], true).ok())
            .filter(|w| !w.is_empty())
            .collect();
        let glue = prop::sample::select(vec![
            " ",
            " ",
            " ",
            "  ",
            "\n",
            ". ",
            ", ",
            "'s ",
            " 42 ",
            "\t",
            "<|im_start|>",
            "<|im_end|>\n",
            "é ",
            "",
        ]);
        prop::collection::vec((prop::sample::select(words), glue), 1..600)
            .prop_map(|v| v.into_iter().map(|(w, g)| format!("{w}{g}")).collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The naive model is the tokenizer itself: every text, cold or sharing a cached
        /// beginning with texts before it, tokenizes to its ids.
        #[test]
        fn cached_tokenizing_is_the_tokenizers(shared in pieces(), tails in prop::collection::vec(pieces(), 1..4)) {
            let tk = tokenizer();
            let cache = PrefixCache::with_budget(1 << 20);
            for tail in &tails {
                let text = format!("{shared}{tail}");
                let want = tk.encode(text.as_str(), false).unwrap().get_ids().to_vec();
                prop_assert_eq!(cache.encode(&tk, &text).unwrap(), want.clone());
                // Again, now from its own checkpoints.
                prop_assert_eq!(cache.encode(&tk, &text).unwrap(), want);
            }
        }
    }

    #[test]
    fn a_shared_beginning_is_tokenized_once() {
        let tk = tokenizer();
        let cache = PrefixCache::for_tokenizer(&serde_json::to_value(&tk).unwrap())
            .expect("the built-in tokenizer composes");
        let system = "the router sends each request to the worker holding its prefix ".repeat(60);
        let first = format!("{system}and what is a block");
        cache.encode(&tk, &first).unwrap();
        let held = cache.cached_tokens();
        assert!(held > 0);
        // A second question over the same text finds the checkpoints already cached.
        let second = format!("{system}and which worker holds it");
        let want = tk.encode(second.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(cache.encode(&tk, &second).unwrap(), want);
        assert_eq!(cache.cached_tokens(), held, "nothing new to keep");
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used() {
        let tk = tokenizer();
        let cache = PrefixCache::with_budget(4_000);
        for n in 0..20 {
            let text = format!("{n} {}", "worker blocks hold the prefix ".repeat(80));
            cache.encode(&tk, &text).unwrap();
            assert!(cache.cached_tokens() <= 4_000, "{}", cache.cached_tokens());
        }
    }

    #[test]
    fn only_the_proved_family_is_cached() {
        let of = |tk: &Tokenizer| PrefixCache::for_tokenizer(&serde_json::to_value(tk).unwrap());
        assert!(of(&tokenizer()).is_some());
        let mut json = serde_json::to_value(tokenizer()).unwrap();
        json["normalizer"] = serde_json::json!({"type": "NFC"});
        let normalized: Tokenizer = serde_json::from_value(json.clone()).unwrap();
        assert!(of(&normalized).is_none());
        json["normalizer"] = serde_json::Value::Null;
        json["pre_tokenizer"]["add_prefix_space"] = true.into();
        let prefixed: Tokenizer = serde_json::from_value(json).unwrap();
        assert!(of(&prefixed).is_none());
    }

    #[test]
    fn checkpoints_are_cut_points_past_each_kilobyte() {
        let text = "ab ".repeat(1000);
        let cuts = checkpoints(text.as_bytes());
        assert!(!cuts.is_empty());
        for (k, &c) in cuts.iter().enumerate() {
            assert!(is_cut(text.as_bytes(), c));
            assert!(c >= (k + 1) * CHECKPOINT_BYTES, "{cuts:?}");
        }
        assert!(checkpoints(b"no cut point here at all").is_empty());
        assert!(checkpoints("x".repeat(5000).as_bytes()).is_empty());
    }
}

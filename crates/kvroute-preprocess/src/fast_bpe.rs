//! The tokenizer's own ids for the byte-level BPE family, without its bookkeeping.
//!
//! `Tokenizer::encode` builds, for every token, its text, offsets and alignment maps, and runs
//! the GPT-2 split through `fancy_regex`'s backtracking machine for one lookahead. The front door
//! needs only the ids: on a ~100-token chat prompt the library took ~50 µs here, most of it
//! that bookkeeping (`benches/tokenize.rs`, `chat_100_tokens`).
//!
//! [`FastBpe`] computes the same ids by the same steps, for the one family it recognises
//! ([`FastBpe::for_tokenizer`]); any other tokenizer keeps the library's path:
//! - **added tokens** are cut out first, leftmost-longest, those matched before normalization
//!   and then the others, as `AddedVocabulary::extract_and_normalize` does (none may strip,
//!   need a word boundary or be empty);
//! - **no normalizer**, or one Unicode normal form (NFC as Qwen 2's, NFD, NFKC, NFKD) applied
//!   to each stretch between the first pass's added tokens, with the crate the library uses
//!   (`unicode-normalization-alignments`; an ASCII stretch is its own normal form);
//! - **the split**: GPT-2's `ByteLevel` regex, or a `Split` regex (isolated, not inverted)
//!   before a `ByteLevel` without its own regex, as Llama 3's and Qwen 2's are. Every such
//!   pattern ends in `\s+(?!\S)|\s+`, the only part a plain regex cannot say: the rest is
//!   matched anchored at each position by `regex_automata` (leftmost-first, as backtracking
//!   matches a pattern without lookaround), and a run of whitespace that matches none of it is
//!   a piece of its own, less its last character when more text follows and the run has two or
//!   more (the lookahead's backtracking). A piece that starts nowhere, or an empty one, hands
//!   the text back to the library;
//! - **BPE** per piece, its bytes as the byte-level alphabet's symbols (all 256 in the
//!   vocabulary, so nothing is unknown), merged lowest rank first, leftmost on ties, as
//!   `Word::merge_all` does, with `ignore_merges` honoured; no dropout, no subword affixes;
//! - no truncation, no padding, and a post-processor that adds nothing without special tokens
//!   (`ByteLevel` only trims offsets; a `TemplateProcessing` adds its tokens only with them).
//!
//! `tests::the_ids_are_the_tokenizers` checks the ids against the library's on random texts
//! for each variant of the family (GPT-2's split, `ignore_merges`, Llama 3's split and its
//! post-processor, Qwen 2's split, an added token matched after normalization, each normal
//! form).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::RwLock;

use aho_corasick::{AhoCorasick, MatchKind};
use regex_automata::{Anchored, Input, meta::Regex};
use rustc_hash::FxHashMap;
use serde_json::Value;

/// GPT-2's split, as `ByteLevel` with `use_regex` runs it.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The end every pattern of the family has: whitespace runs, with a lookahead.
const WHITESPACE_TAIL: &str = r"|\s+(?!\S)|\s+";

/// Pieces of at most this many bytes have their ids remembered (the library's cache takes
/// pieces under 256 bytes; words are far shorter, and a longer piece merges in microseconds).
const CACHED_PIECE_BYTES: usize = 64;

/// How many pieces are remembered at most; past it nothing more is added (as the library's
/// cache, whose capacity is 10,000). At most ~10 MiB even when every piece is as long as
/// allowed: a text cannot grow it further.
const CACHED_PIECES: usize = 1 << 15;

/// Added tokens matched by one trie, with their ids by pattern.
#[derive(Debug)]
struct Added {
    trie: AhoCorasick,
    ids: Vec<u32>,
}

#[derive(Debug)]
pub(crate) struct FastBpe {
    /// Added tokens matched on the text as given, then those matched after normalization.
    raw: Option<Added>,
    normalized: Option<Added>,
    /// The split without its whitespace tail.
    words: Regex,
    /// Each byte's symbol.
    byte_ids: [u32; 256],
    /// (left, right) -> (rank, merged id).
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`: the vocabulary by the bytes each entry stands for.
    whole: Option<FxHashMap<Box<[u8]>, u32>>,
    /// The normalizer's Unicode form, if any.
    form: Option<Form>,
    cache: RwLock<PieceIds>,
}

/// Pieces' ids by their bytes.
type PieceIds = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// A Unicode normal form, as the library's normalizers of the same names apply it.
#[derive(Clone, Copy, Debug)]
enum Form {
    Nfc,
    Nfd,
    Nfkc,
    Nfkd,
}

impl Form {
    fn apply(self, text: &str) -> String {
        use unicode_normalization_alignments::UnicodeNormalization;
        match self {
            Self::Nfc => text.nfc().map(|(c, _)| c).collect(),
            Self::Nfd => text.nfd().map(|(c, _)| c).collect(),
            Self::Nfkc => text.nfkc().map(|(c, _)| c).collect(),
            Self::Nfkd => text.nfkd().map(|(c, _)| c).collect(),
        }
    }
}

/// The byte-level alphabet: each byte's character (GPT-2's `bytes_to_unicode`).
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            extra += 1;
            255 + extra
        };
        out[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    out
}

impl FastBpe {
    /// The encoder for a tokenizer (its serialized form) of the family, else `None`.
    pub(crate) fn for_tokenizer(json: &Value) -> Option<Self> {
        if !(json["truncation"].is_null() && json["padding"].is_null()) {
            return None;
        }
        let form = match &json["normalizer"] {
            Value::Null => None,
            n => Some(match n["type"].as_str()? {
                "NFC" => Form::Nfc,
                "NFD" => Form::Nfd,
                "NFKC" => Form::Nfkc,
                "NFKD" => Form::Nfkd,
                _ => return None,
            }),
        };
        let pattern = split_pattern(&json["pre_tokenizer"])?;
        if !adds_nothing(&json["post_processor"]) {
            return None;
        }
        let model = &json["model"];
        let no_dropout = model["dropout"].is_null() || model["dropout"].as_f64() == Some(0.0);
        let no_affixes =
            model["continuing_subword_prefix"].is_null() && model["end_of_word_suffix"].is_null();
        if model["type"] != "BPE" || !no_dropout || !no_affixes {
            return None;
        }
        let words = Regex::new(pattern.strip_suffix(WHITESPACE_TAIL)?).ok()?;
        let vocab = model["vocab"].as_object()?;
        let id_of =
            |s: &str| vocab.get(s).and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok());
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_ids[b] = id_of(c.encode_utf8(&mut [0; 4]))?;
        }
        let mut merges = FxHashMap::default();
        for (rank, merge) in model["merges"].as_array()?.iter().enumerate() {
            let (left, right) = match merge {
                Value::String(s) => s.split_once(' ')?,
                Value::Array(pair) => (pair.first()?.as_str()?, pair.get(1)?.as_str()?),
                _ => return None,
            };
            let merged = id_of(&format!("{left}{right}"))?;
            merges.insert((id_of(left)?, id_of(right)?), (u32::try_from(rank).ok()?, merged));
        }
        let whole = (model["ignore_merges"] == true).then(|| {
            let to_byte: FxHashMap<char, u8> =
                chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
            vocab
                .iter()
                .filter_map(|(text, id)| {
                    let bytes: Option<Vec<u8>> =
                        text.chars().map(|c| to_byte.get(&c).copied()).collect();
                    Some((bytes?.into_boxed_slice(), u32::try_from(id.as_u64()?).ok()?))
                })
                .collect()
        });
        let (raw, normalized) = added_tries(json["added_tokens"].as_array()?)?;
        Some(Self {
            raw,
            normalized,
            words,
            byte_ids,
            merges,
            whole,
            form,
            cache: RwLock::new(FxHashMap::default()),
        })
    }

    /// The ids `tokenizer.encode(text, false)` gives, or `None` when this text is the
    /// library's to encode (see the module comment).
    pub(crate) fn encode(&self, text: &str) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        each_piece(self.raw.as_ref(), text, &mut out, &mut |piece, out| {
            let normalized = match self.form {
                Some(form) if !piece.is_ascii() => std::borrow::Cow::Owned(form.apply(piece)),
                _ => std::borrow::Cow::Borrowed(piece),
            };
            each_piece(self.normalized.as_ref(), &normalized, out, &mut |piece, out| {
                self.split(piece, out)
            })
        })?;
        Some(out)
    }

    /// The pre-tokenizer's pieces of `text`, each tokenized into `out`.
    fn split(&self, text: &str, out: &mut Vec<u32>) -> Option<()> {
        let mut at = 0;
        while at < text.len() {
            let input = Input::new(text).range(at..).anchored(Anchored::Yes);
            let end = match self.words.search(&input) {
                Some(m) => m.end(),
                None => whitespace_piece(text, at)?,
            };
            if end <= at {
                return None;
            }
            self.tokenize(&text.as_bytes()[at..end], out);
            at = end;
        }
        Some(())
    }

    /// One piece's ids.
    fn tokenize(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(id) = self.whole.as_ref().and_then(|w| w.get(piece)) {
            out.push(*id);
            return;
        }
        if let [b] = piece {
            out.push(self.byte_ids[usize::from(*b)]);
            return;
        }
        let cached = piece.len() <= CACHED_PIECE_BYTES;
        if cached {
            let cache = self.cache.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(ids) = cache.get(piece) {
                out.extend_from_slice(ids);
                return;
            }
        }
        let start = out.len();
        self.merge(piece, out);
        if cached
            && let Ok(mut cache) = self.cache.try_write()
            && cache.len() < CACHED_PIECES
        {
            cache.insert(piece.into(), out[start..].into());
        }
    }

    /// BPE over a piece's byte symbols: the lowest-ranked adjacent pair merges first, the
    /// leftmost of equal ranks, until no pair merges (`Word::merge_all` without dropout).
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let n = piece.len();
        // (id, prev, next, alive)
        let mut syms: Vec<(u32, usize, usize, bool)> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                let next = if i + 1 < n { i + 1 } else { NONE };
                (self.byte_ids[usize::from(b)], i.checked_sub(1).unwrap_or(NONE), next, true)
            })
            .collect();
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(&(rank, id)) = self.merges.get(&(syms[i].0, syms[i + 1].0)) {
                heap.push(Reverse((rank, i, id)));
            }
        }
        while let Some(Reverse((_, pos, id))) = heap.pop() {
            let (left, prev, next, alive) = syms[pos];
            if !alive || next == NONE {
                continue;
            }
            let right = syms[next];
            if self.merges.get(&(left, right.0)).is_none_or(|&(_, merged)| merged != id) {
                continue;
            }
            syms[pos].0 = id;
            syms[pos].2 = right.2;
            syms[next].3 = false;
            if right.2 != NONE {
                syms[right.2].1 = pos;
            }
            if prev != NONE
                && let Some(&(rank, merged)) = self.merges.get(&(syms[prev].0, id))
            {
                heap.push(Reverse((rank, prev, merged)));
            }
            if right.2 != NONE
                && let Some(&(rank, merged)) = self.merges.get(&(id, syms[right.2].0))
            {
                heap.push(Reverse((rank, pos, merged)));
            }
        }
        let mut at = 0;
        while at != NONE {
            out.push(syms[at].0);
            at = syms[at].2;
        }
    }
}

/// Whether a post-processor leaves the ids of `encode(text, false)` as they are: none,
/// `ByteLevel` (it trims offsets), a `TemplateProcessing` whose single-sequence template holds
/// the sequence once (its special tokens are added only with `add_special_tokens`), or a
/// `Sequence` of those (Llama 3's is `ByteLevel` then `TemplateProcessing`).
fn adds_nothing(post: &Value) -> bool {
    match post["type"].as_str() {
        None => post.is_null(),
        Some("ByteLevel") => true,
        Some("TemplateProcessing") => post["single"].as_array().is_some_and(|pieces| {
            let sequences = pieces.iter().filter(|p| !p["Sequence"].is_null()).count();
            let specials = pieces.iter().filter(|p| !p["SpecialToken"].is_null()).count();
            sequences == 1 && sequences + specials == pieces.len()
        }),
        Some("Sequence") => {
            post["processors"].as_array().is_some_and(|all| all.iter().all(adds_nothing))
        }
        Some(_) => false,
    }
}

/// The split's pattern, for a pre-tokenizer of the family.
fn split_pattern(pre: &Value) -> Option<String> {
    let byte_level = |p: &Value, regex: bool| {
        p["type"] == "ByteLevel" && p["add_prefix_space"] == false && p["use_regex"] == regex
    };
    if byte_level(pre, true) {
        return Some(GPT2_SPLIT.to_owned());
    }
    let [split, bytes] = pre["pretokenizers"].as_array()?.as_slice() else { return None };
    let isolated =
        split["type"] == "Split" && split["behavior"] == "Isolated" && split["invert"] == false;
    if pre["type"] != "Sequence" || !isolated || !byte_level(bytes, false) {
        return None;
    }
    split["pattern"]["Regex"].as_str().map(str::to_owned)
}

/// The tries of the added tokens matched before and after normalization; `None` when one
/// strips, needs a word boundary or is empty (the library's path handles those).
fn added_tries(added: &[Value]) -> Option<(Option<Added>, Option<Added>)> {
    let (mut raw, mut normalized) = (Vec::new(), Vec::new());
    for token in added {
        let plain =
            token["single_word"] == false && token["lstrip"] == false && token["rstrip"] == false;
        let content = token["content"].as_str().filter(|c| !c.is_empty())?;
        let id = u32::try_from(token["id"].as_u64()?).ok()?;
        if !plain {
            return None;
        }
        let side = if token["normalized"] == true { &mut normalized } else { &mut raw };
        side.push((content.to_owned(), id));
    }
    let trie = |tokens: Vec<(String, u32)>| -> Option<Option<Added>> {
        if tokens.is_empty() {
            return Some(None);
        }
        let built = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(c, _)| c))
            .ok()?;
        Some(Some(Added { trie: built, ids: tokens.into_iter().map(|(_, id)| id).collect() }))
    };
    Some((trie(raw)?, trie(normalized)?))
}

/// Each added token of `text` as its id, and each stretch between them through `rest`.
fn each_piece(
    added: Option<&Added>,
    text: &str,
    out: &mut Vec<u32>,
    rest: &mut dyn FnMut(&str, &mut Vec<u32>) -> Option<()>,
) -> Option<()> {
    let Some(added) = added else { return rest(text, out) };
    let mut from = 0;
    for m in added.trie.find_iter(text) {
        if from < m.start() {
            rest(&text[from..m.start()], out)?;
        }
        out.push(added.ids[m.pattern().as_usize()]);
        from = m.end();
    }
    if from < text.len() {
        rest(&text[from..], out)?;
    }
    Some(())
}

/// Where `\s+(?!\S)|\s+` ends a piece starting at `at`, or `None` when `at` is not whitespace.
fn whitespace_piece(text: &str, at: usize) -> Option<usize> {
    let mut chars = 0usize;
    let (mut last, mut end) = (at, at);
    for (i, c) in text[at..].char_indices() {
        if !c.is_whitespace() {
            break;
        }
        chars += 1;
        last = at + i;
        end = at + i + c.len_utf8();
    }
    match chars {
        0 => None,
        _ if end == text.len() || chars == 1 => Some(end),
        _ => Some(last),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Preprocessor;
    use proptest::prelude::*;
    use tokenizers::Tokenizer;

    fn builtin_json() -> Value {
        serde_json::to_value(&Preprocessor::builtin().tokenizer).unwrap()
    }

    /// The built-in tokenizer and variants of it the family covers, each as the library
    /// loads it.
    fn variants() -> Vec<(&'static str, Tokenizer)> {
        let base = builtin_json();
        let mut ignore = base.clone();
        ignore["model"]["ignore_merges"] = true.into();
        let split = |pattern: &str| {
            let mut json = base.clone();
            json["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ]});
            json
        };
        // Llama 3's and Qwen 2's splits (from their tokenizer.json), with Qwen 2's NFC.
        let llama3 = split(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        );
        let mut llama3_post = llama3.clone();
        llama3_post["post_processor"] = serde_json::json!({"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}},
        ]});
        let mut qwen2 = split(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        );
        qwen2["normalizer"] = serde_json::json!({"type": "NFC"});
        let forms: Vec<(&'static str, Value)> = ["NFD", "NFKC", "NFKD"]
            .into_iter()
            .map(|form| {
                let mut json = base.clone();
                json["normalizer"] = serde_json::json!({"type": form});
                (form, json)
            })
            .collect();
        let mut normalized_added = base.clone();
        if let Some(a) = normalized_added["added_tokens"].as_array_mut() {
            a[1]["normalized"] = true.into();
        }
        let load = |json: Value| Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        let mut all = vec![
            ("builtin", load(base)),
            ("ignore_merges", load(ignore)),
            ("llama3_split", load(llama3)),
            ("llama3_post_processor", load(llama3_post)),
            ("qwen2_split_nfc", load(qwen2)),
            ("normalized_added", load(normalized_added)),
        ];
        all.extend(forms.into_iter().map(|(name, json)| (name, load(json))));
        all
    }

    fn library(tk: &Tokenizer, text: &str) -> Vec<u32> {
        tk.encode(text, false).unwrap().get_ids().to_vec()
    }

    /// Texts from pieces that exercise each rule: letters of several scripts, digits, runs of
    /// mixed whitespace, contractions in both cases, punctuation, the added tokens.
    fn texts() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-zA-Z]{1,12}",
            "[0-9]{1,7}",
            "[ \t\n\r]{1,5}",
            Just("\u{a0}\u{3000} ".to_owned()),
            "'(s|t|re|ve|m|ll|d|S|T|RE|LL)",
            "[!-/:-@\\[-`{-~]{1,4}",
            "[àéîõüßøæ]{1,4}",
            "[а-я]{1,5}",
            "[一-十]{1,3}",
            "e\u{301}",
            Just("\u{fb01}\u{2460}\u{ff21}\u{1e9b}\u{323}".to_owned()),
            Just("\u{301}<|im_end|>\u{301}a".to_owned()),
            Just("<|im_start|>".to_owned()),
            Just("<|im_end|>".to_owned()),
            Just("<|image_pad|>".to_owned()),
            Just("<|im_".to_owned()),
            any::<char>().prop_map(String::from),
        ];
        prop::collection::vec(piece, 0..24).prop_map(|p| p.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The naive model is the library itself.
        #[test]
        fn the_ids_are_the_tokenizers(text in texts()) {
            for (name, tk) in variants() {
                let json = serde_json::to_value(&tk).unwrap();
                let fast = FastBpe::for_tokenizer(&json).unwrap_or_else(|| panic!("{name} is of the family"));
                let ids = fast.encode(&text);
                prop_assert_eq!(ids.as_ref(), Some(&library(&tk, &text)), "{} {:?}", name, text);
                // Cached pieces give the same ids the second time.
                prop_assert_eq!(fast.encode(&text), ids, "{} cached", name);
            }
        }
    }

    #[test]
    fn long_runs_and_the_conversation_corpus_match() {
        let corpus = include_str!("../../../models/corpus/conversations.txt");
        let long = ["a".repeat(5_000), " ".repeat(300) + "x", "\n\n\n x  y   ".repeat(50)];
        for (name, tk) in variants() {
            let fast = FastBpe::for_tokenizer(&serde_json::to_value(&tk).unwrap()).unwrap();
            for text in long.iter().map(String::as_str).chain([corpus]) {
                if let Some(ids) = fast.encode(text) {
                    assert_eq!(ids, library(&tk, text), "{name}");
                }
            }
        }
    }

    #[test]
    fn other_tokenizers_keep_the_librarys_path() {
        let base = builtin_json();
        assert!(FastBpe::for_tokenizer(&base).is_some());
        let changed = |edit: &dyn Fn(&mut Value)| {
            let mut json = base.clone();
            edit(&mut json);
            FastBpe::for_tokenizer(&json).is_none()
        };
        assert!(changed(&|j| j["normalizer"] = serde_json::json!({"type": "Lowercase"})));
        assert!(changed(&|j| j["pre_tokenizer"]["add_prefix_space"] = true.into()));
        assert!(changed(&|j| j["model"]["dropout"] = 0.1.into()));
        assert!(changed(&|j| j["model"]["continuing_subword_prefix"] = "##".into()));
        assert!(changed(&|j| j["added_tokens"][0]["lstrip"] = true.into()));
        assert!(changed(&|j| j["truncation"] = serde_json::json!({"max_length": 8})));
        assert!(changed(
            &|j| j["post_processor"] = serde_json::json!({"type": "RobertaProcessing"})
        ));
        // A template that repeats the sequence adds ids even without special tokens.
        assert!(changed(&|j| {
            j["post_processor"] = serde_json::json!({"type": "TemplateProcessing", "single": [
                {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]});
        }));
        // A split that does not end in the whitespace tail, or whose rest needs lookaround.
        let split = |pattern: &'static str| {
            move |j: &mut Value| {
                j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
                ]});
            }
        };
        assert!(changed(&split(r"\p{L}+|\s+")));
        assert!(changed(&split(r"\p{L}+(?=x)|\s+(?!\S)|\s+")));
        // A vocabulary missing a byte's symbol.
        assert!(changed(&|j| {
            j["model"]["vocab"].as_object_mut().unwrap().remove("!");
        }));
    }

    #[test]
    fn whitespace_runs_keep_their_last_character_for_what_follows() {
        assert_eq!(whitespace_piece("   x", 0), Some(2));
        assert_eq!(whitespace_piece(" x", 0), Some(1));
        assert_eq!(whitespace_piece("   ", 0), Some(3));
        assert_eq!(whitespace_piece("a  ", 1), Some(3));
        assert_eq!(whitespace_piece("x", 0), None);
        assert_eq!(whitespace_piece("\u{3000}\u{3000}y", 0), Some(3));
    }
}

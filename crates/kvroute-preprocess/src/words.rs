//! Words a simulated engine answers with: tokens of the vocabulary whose text tokenizes back to
//! exactly them, so an answer's text, sent back by a client in the next turn of a
//! conversation, becomes the very token ids the engine generated (and cached).
//!
//! A word is a token that decodes to ASCII letters (`first`: an answer's first token) or to a
//! space and ASCII letters (`rest`: every later one) and encodes back to itself alone. With a
//! pre-tokenizer that splits text at word boundaries (GPT-2's byte-level regex, which
//! Hugging Face BPE tokenizers use), a run `first rest rest ...` then encodes back to the same
//! run: every word is a piece of its own. The property is tested on the built-in model and on
//! the text-only fixture, in and after their chat templates.

use tokenizers::Tokenizer;

/// The vocabulary's word tokens, in id order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Words {
    /// Words without a leading space (an answer's first token, right after the template's
    /// assistant header).
    pub first: Vec<u32>,
    /// Words with a leading space.
    pub rest: Vec<u32>,
}

impl Words {
    pub(crate) fn scan(tokenizer: &Tokenizer) -> Self {
        let mut words = Self::default();
        let size = u32::try_from(tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX);
        for id in 0..size {
            let Ok(text) = tokenizer.decode(&[id], true) else { continue };
            let (spaced, word) = match text.strip_prefix(' ') {
                Some(word) => (true, word),
                None => (false, text.as_str()),
            };
            if word.is_empty() || !word.bytes().all(|b| b.is_ascii_alphabetic()) {
                continue;
            }
            let round_trip =
                tokenizer.encode(text.as_str(), false).is_ok_and(|e| e.get_ids() == [id]);
            if !round_trip {
                continue;
            }
            match spaced {
                true => words.rest.push(id),
                false => words.first.push(id),
            }
        }
        words
    }

    /// Whether answers can be made of words (the vocabulary has spaced words at least).
    pub fn usable(&self) -> bool {
        !self.rest.is_empty()
    }

    /// Whether `token` is a word (spaced or not).
    pub fn contains(&self, token: u32) -> bool {
        self.first.binary_search(&token).is_ok() || self.rest.binary_search(&token).is_ok()
    }

    /// The `index`-th token of an answer, chosen by `key` (a function of the prompt and the
    /// seed): the same key gives the same answer.
    pub fn pick(&self, key: u64, index: usize) -> Option<u32> {
        let pool = match (index, self.first.is_empty()) {
            (0, false) => &self.first,
            _ => &self.rest,
        };
        if pool.is_empty() {
            return None;
        }
        let mut x = key ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        Some(pool[(x % pool.len() as u64) as usize])
    }
}

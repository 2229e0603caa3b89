//! Text from token ids as they stream, the way vLLM turns them into text
//! (`detokenize_incrementally` in the 0.33 wheel's `vllm/tokenizers/detokenizer_utils.py`), so
//! the front door that detokenizes an engine's tokens sends a client the text the engine would
//! have sent, chunk for chunk.
//!
//! Decoding each token alone is wrong twice over: a character that spans tokens (byte-level
//! BPE splits most non-ASCII characters) comes out as U+FFFD halves, and SentencePiece's
//! decoder drops the leading space of whatever it starts on. So a stream keeps a short window
//! of token strings: the text of the window's tail is what the window with the new token adds
//! to the window without it, and nothing is added while the text ends in an unfinished
//! character. The window is trimmed to what the next token still reads.

use serde::{Deserialize, Serialize};
use tokenizers::Decoder;

use crate::Preprocessor;

/// How many tokens before the read point the window keeps (vLLM's
/// `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`).
const WINDOW: usize = 5;

/// Most tokens past the read point a window waits on. A character is at most 4 bytes, so
/// text still unfinished after this many tokens never will be (an invalid byte the model
/// generated): it goes out as it is, U+FFFD and all. vLLM waits without a bound, which makes
/// a stream of such tokens cost the square of its length.
const MAX_PENDING: usize = 8;

/// Where a stream's decoding stands: the token strings still read, and two offsets into
/// them. The fields are vLLM's `DerenderStreamState` fields of the same names, so a streamed
/// derender carries this between calls as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeWindow {
    pub prev_tokens: Vec<String>,
    pub prefix_offset: usize,
    pub read_offset: usize,
}

impl Preprocessor {
    /// A stream's window seeded with the end of its prompt (its last few ids suffice), as
    /// vLLM seeds its own: the first output token then keeps its leading space.
    pub fn decode_window(&self, prompt: &[u32]) -> DecodeWindow {
        let tail = &prompt[prompt.len().saturating_sub(WINDOW + 2)..];
        let prev_tokens = self.token_strings_kept(tail);
        let read_offset = prev_tokens.len();
        DecodeWindow { prefix_offset: read_offset.saturating_sub(WINDOW), read_offset, prev_tokens }
    }

    /// The text `ids` add to a stream whose decoding stands at `window`, which moves past
    /// them. Special tokens add nothing; an id outside the vocabulary adds nothing; text
    /// that would end in an unfinished character waits for the token that finishes it.
    pub fn decode_next(&self, window: &mut DecodeWindow, ids: &[u32]) -> String {
        let w = window;
        // Offsets from outside (a derender's client) may be anything: kept in order.
        w.read_offset = w.read_offset.min(w.prev_tokens.len());
        w.prefix_offset = w.prefix_offset.min(w.read_offset);
        let mut out = String::new();
        for &id in ids {
            w.prev_tokens.extend(self.token_strings_kept(&[id]));
            let before = self.text_of(&w.prev_tokens[w.prefix_offset..w.read_offset]);
            let after = self.text_of(&w.prev_tokens[w.prefix_offset..]);
            let skip = before.chars().count();
            let stuck = w.prev_tokens.len() - w.read_offset > MAX_PENDING;
            if stuck || (after.chars().count() > skip && !after.ends_with('\u{FFFD}')) {
                out.extend(after.chars().skip(skip));
                w.prefix_offset = w.read_offset;
                w.read_offset = w.prev_tokens.len();
            }
            // Nothing before the prefix offset is read again.
            w.prev_tokens.drain(..w.prefix_offset);
            w.read_offset -= w.prefix_offset;
            w.prefix_offset = 0;
        }
        out
    }

    /// Each id's vocabulary entry, special tokens left out (vLLM's `convert_ids_to_tokens`
    /// with `skip_special_tokens`), an id outside the vocabulary as an empty entry.
    fn token_strings_kept(&self, ids: &[u32]) -> Vec<String> {
        let added = self.tokenizer.get_added_vocabulary();
        ids.iter()
            .map(|&id| self.tokenizer.id_to_token(id).unwrap_or_default())
            .filter(|t| !added.is_special_token(t))
            .collect()
    }

    /// The text of vocabulary entries, through the tokenizer's decoder (`tokenizers`'s own
    /// `decode` after its id lookup).
    fn text_of(&self, tokens: &[String]) -> String {
        match self.tokenizer.get_decoder() {
            Some(decoder) => decoder.decode(tokens.to_vec()).unwrap_or_default(),
            None => tokens.join(" "),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn streamed(p: &Preprocessor, prompt: &[u32], ids: &[u32], chunk: usize) -> String {
        let mut window = p.decode_window(prompt);
        ids.chunks(chunk.max(1)).map(|c| p.decode_next(&mut window, c)).collect()
    }

    #[test]
    fn a_character_split_across_tokens_comes_out_whole() {
        let p = Preprocessor::builtin();
        let text = "naïve café: 東京 and 🦀 crabs";
        let ids = p.encode(text).unwrap_or_default();
        // Some character spans more than one token, or the test proves nothing.
        let alone: String = ids.iter().map(|&t| p.decode(&[t]).unwrap_or_default()).collect();
        assert_ne!(alone, text);
        assert_eq!(streamed(&p, &[], &ids, 1), text);
    }

    #[test]
    fn special_tokens_add_nothing_and_the_window_stays_short() {
        let p = Preprocessor::builtin();
        let mut ids = p.encode("Hello there, friend").unwrap_or_default();
        let special = p.encode("<|im_end|>").unwrap_or_default();
        assert_eq!(special.len(), 1);
        ids.insert(2, special[0]);
        let mut window = p.decode_window(&[]);
        let text: String = ids.iter().map(|&t| p.decode_next(&mut window, &[t])).collect();
        assert_eq!(text, "Hello there, friend");
        assert!(window.prev_tokens.len() <= WINDOW + 1, "{window:?}");
        assert_eq!(p.decode_next(&mut window, &[u32::MAX]), "");
    }

    #[test]
    fn tokens_that_never_finish_a_character_cannot_grow_the_window() {
        let p = Preprocessor::builtin();
        // A lone continuation byte: byte-level BPE's token for 0x80 never ends a character.
        let lone = p.encode("é").unwrap_or_default();
        let mut window = p.decode_window(&[]);
        let mut longest = 0;
        let mut text = String::new();
        for _ in 0..2_000 {
            text += &p.decode_next(&mut window, &lone[lone.len() - 1..]);
            text += &p.decode_next(&mut window, &[u32::MAX]);
            longest = longest.max(window.prev_tokens.len());
        }
        // What was read last plus what waits: each at most one more than MAX_PENDING.
        assert!(longest <= 2 * (MAX_PENDING + 1), "{longest}");
        assert!(text.contains('\u{FFFD}'), "what cannot be a character goes out as U+FFFD");
    }

    #[test]
    fn offsets_from_outside_cannot_break_it() {
        let p = Preprocessor::builtin();
        let mut window =
            DecodeWindow { prev_tokens: vec!["a".into()], prefix_offset: 9, read_offset: 3 };
        let ids = p.encode(" b").unwrap_or_default();
        let _ = p.decode_next(&mut window, &ids);
        assert!(window.prefix_offset <= window.read_offset);
        assert!(window.read_offset <= window.prev_tokens.len());
    }

    proptest! {
        /// Streamed in chunks of any size after any prompt, the text is the whole decode's
        /// (for text that ends on a whole character, which encoded text always does).
        #[test]
        fn streamed_text_is_the_whole_decode(
            prompt in "[a-z ]{0,20}",
            text in "[a-zA-Z0-9 ,.éü東京🦀\n]{1,60}",
            chunk in 1usize..6,
        ) {
            let p = Preprocessor::builtin();
            let prompt = p.encode(&prompt).unwrap_or_default();
            let ids = p.encode(&text).unwrap_or_default();
            let whole = p.decode(&ids).unwrap_or_default();
            prop_assert_eq!(streamed(&p, &prompt, &ids, chunk), whole);
        }
    }
}

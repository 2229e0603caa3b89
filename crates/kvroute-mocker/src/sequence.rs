//! One request inside the engine: its tokens (prompt, then generated), which of its blocks the
//! cache holds for it, and how far its KV is computed.
//!
//! ```text
//!  tokens   [p p p p | p p p p | p p g g | g .  ]      p prompt, g generated (bs = 4)
//!  blocks   [Cached  | Cached  | Private]              full + computed blocks become Cached
//!  computed ───────────────────────────▶|              (the last generated token's KV is
//!                                                       computed by the next step, as vLLM)
//! ```
//!
//! Block `b`'s [`SequenceHash`] chains the local hashes of blocks `0..=b` (images of the
//! prompt included), exactly as the router hashes a request, so a generated block is found by
//! the next turn of the conversation that sends it back.

use kvroute_core::{BlockExtraInfo, BlockHasher, SequenceHash};
use kvroute_preprocess::Words;
use std::sync::Arc;

use crate::kv::KvCache;

/// What an engine generates for a request: a function of the prompt and the seed (`key`),
/// the same on every worker; the last token is the model's end of turn unless the request
/// ignores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputPlan {
    pub key: u64,
    pub words: Arc<Words>,
    /// The end-of-turn token generated last (`None`: the answer stops at its length).
    pub end: Option<u32>,
    /// A token for vocabularies without words (any id below it).
    pub vocab_size: u32,
}

impl OutputPlan {
    /// The `index`-th generated token of an answer of `len` tokens.
    pub fn token(&self, index: usize, len: usize) -> u32 {
        if let Some(end) = self.end
            && index + 1 == len
        {
            return end;
        }
        self.words.pick(self.key, index).unwrap_or_else(|| {
            let x = self.key ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x % u64::from(self.vocab_size.max(1))) as u32
        })
    }
}

/// A block of a request: shared through the cache, or its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    /// Full, computed and in the cache (shared with others holding the same hash).
    Cached(SequenceHash),
    /// Allocated to this request alone: not yet full or computed, or a duplicate of a block
    /// another request cached first (vLLM keeps both copies).
    Private,
    /// A sliding-window block behind the window: given back to the cache (vLLM's null
    /// block), no longer the request's.
    Skipped,
}

#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) id: String,
    pub(crate) prompt_len: usize,
    pub(crate) tokens: Vec<u32>,
    pub(crate) mm: Option<Vec<Option<BlockExtraInfo>>>,
    /// Its cache namespace (`cache_salt`), folded into every block hash.
    pub(crate) namespace: Option<String>,
    /// Its LoRA adapter and the adapter's id, folded into every block hash.
    pub(crate) lora: Option<(String, u32)>,
    pub(crate) max_tokens: usize,
    pub(crate) plan: OutputPlan,
    /// Sequence hashes of the full blocks of `tokens`, as far as computed.
    pub(crate) hashes: Vec<SequenceHash>,
    pub(crate) blocks: Vec<Block>,
    /// Its blocks in a hybrid model's sliding-window group (group 1), by position; empty
    /// for a model without one.
    pub(crate) window: Vec<Block>,
    /// Leading blocks already full and dealt with (cached, or kept as duplicates), in every
    /// group.
    pub(crate) filled: usize,
    /// Tokens whose KV is computed (a cache hit counts as computed).
    pub(crate) computed: usize,
    pub(crate) generated: usize,
    /// The prefix found cached when first admitted (vLLM's `num_cached_tokens`).
    pub(crate) cached_tokens: Option<usize>,
    /// Its part in a disaggregated request.
    pub(crate) handoff: crate::handoff::Handoff,
    /// Per leading prompt block, whether the shared store held it when the engine asked.
    pub(crate) in_store: Vec<bool>,
    /// GPU blocks kept free for it from the start of its load beside the steps
    /// (`crate::loads`) to its admission, as vLLM allocates a loading request's blocks and
    /// Dynamo's mocker reserves them; above 0 exactly while its load is running or done and
    /// it is not yet admitted (admitting it then takes no more time for the load).
    pub(crate) reserved: usize,
}

impl Sequence {
    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Its adapter's name.
    pub(crate) fn adapter(&self) -> Option<&str> {
        self.lora.as_ref().map(|(name, _)| name.as_str())
    }

    /// Hashes of every full block of the known tokens.
    pub(crate) fn full_hashes(&mut self, hasher: &BlockHasher) -> &[SequenceHash] {
        let bs = hasher.block_size().tokens();
        let lora = self.lora.as_ref().map(|(name, _)| name.as_str());
        let hasher = hasher.with_namespace(self.namespace.as_deref()).with_lora(lora);
        let full = self.tokens.len() / bs;
        while self.hashes.len() < full {
            let b = self.hashes.len();
            let info = self.mm.as_ref().and_then(|m| m.get(b)).and_then(Option::as_ref);
            let local = hasher.hash_block(&self.tokens[b * bs..(b + 1) * bs], info);
            let seq = match self.hashes.last() {
                Some(&parent) => kvroute_core::hash::chain(parent, local),
                None => SequenceHash(local.0),
            };
            self.hashes.push(seq);
        }
        &self.hashes
    }

    /// Blocks currently referenced in the cache, in order.
    pub(crate) fn cached(&self) -> Vec<SequenceHash> {
        cached(&self.blocks)
    }

    pub(crate) fn private(&self) -> usize {
        self.blocks.iter().filter(|b| **b == Block::Private).count()
    }

    /// Gives every block back to the cache (tail first, group by group, as vLLM's
    /// coordinator frees them) and forgets the computed KV.
    pub(crate) fn release(&mut self, cache: &mut KvCache) {
        cache.release(0, &self.cached(), self.private());
        let private = self.window.iter().filter(|b| **b == Block::Private).count();
        cache.release(1, &cached(&self.window), private);
        self.blocks.clear();
        self.window.clear();
        self.filled = 0;
        self.computed = 0;
    }

    /// Gives back the sliding-window blocks wholly behind a window of `window` tokens (vLLM's
    /// `remove_skipped_blocks`: the first `(computed - window + 1) / bs` blocks), nearest
    /// the window first, so it is evicted first.
    pub(crate) fn skip_behind_window(&mut self, cache: &mut KvCache, window: usize, bs: usize) {
        let skipped = ((self.computed + 1).saturating_sub(window) / bs).min(self.window.len());
        let start = self.window[..skipped].iter().rposition(|b| *b == Block::Skipped);
        let range = start.map_or(0, |i| i + 1)..skipped;
        if range.is_empty() {
            return;
        }
        let freed = &mut self.window[range];
        let private = freed.iter().filter(|b| **b == Block::Private).count();
        cache.release(1, &cached(freed), private);
        freed.fill(Block::Skipped);
    }
}

fn cached(blocks: &[Block]) -> Vec<SequenceHash> {
    blocks
        .iter()
        .filter_map(|b| match b {
            Block::Cached(s) => Some(*s),
            Block::Private | Block::Skipped => None,
        })
        .collect()
}

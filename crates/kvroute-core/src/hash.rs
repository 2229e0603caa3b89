//! Block and sequence hashing, bit-compatible with Dynamo's `compute_block_hash_for_seq`.
//!
//! For each **full** block of `block_size` tokens (a trailing partial block is never hashed):
//!
//! ```text
//!  bytes = le32(t_0) ‖ le32(t_1) ‖ … ‖ le32(t_{bs-1})  ‖ le64(mm_a) ‖ le64(mm_b) …
//!                                                         └ the block's image hashes, sorted
//!  LocalBlockHash = xxh3_64_with_seed(bytes, seed)
//!  seed = 1337 (+ xxh3_64(lora_name)) (+ xxh3_64_with_seed(cache_namespace, 1))   all wrapping
//! ```
//!
//! Image placeholder tokens are the same for every image, so folding the images' hashes into the
//! block's bytes is what makes "same tokens, different picture" a different block. Offsets are
//! not hashed and duplicates are kept; so two images in one block, swapped, hash alike (a limit
//! shared with Dynamo, harmless because real images span whole blocks).
//!
//! Sequence hashes chain the local ones: `S_0 = L_0`, `S_i = xxh3_64_with_seed(le64(S_{i-1}) ‖
//! le64(L_i), 1337)`.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::Error;
use crate::protocols::{BlockExtraInfo, BlockSize, LocalBlockHash, SequenceHash};

/// Dynamo's seed for block and sequence hashes.
pub const KV_HASH_SEED: u64 = 1337;

/// Hashes blocks of one block size under one seed (LoRA adapter and cache namespace).
///
/// ```
/// use kvroute_core::{BlockHasher, BlockSize};
/// let hasher = BlockHasher::new(BlockSize::new(4).unwrap());
/// let local = hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None);
/// assert_eq!(local.len(), 2); // the ninth token is a partial block
/// let seq = kvroute_core::hash::sequence_hashes(&local);
/// assert_eq!(seq[0].0, local[0].0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: BlockSize,
    seed: u64,
}

impl BlockHasher {
    pub fn new(block_size: BlockSize) -> Self {
        Self { block_size, seed: KV_HASH_SEED }
    }

    /// Salts the seed with a LoRA adapter's name, so the same prompt under different adapters
    /// never shares blocks. `None` and `""` mean the base model.
    #[must_use]
    pub fn with_lora(mut self, lora_name: Option<&str>) -> Self {
        if let Some(name) = lora_name.filter(|n| !n.is_empty()) {
            self.seed = self.seed.wrapping_add(xxh3_64(name.as_bytes()));
        }
        self
    }

    /// Salts the seed with a cache namespace (vLLM/SGLang `cache_salt`, tenant isolation).
    /// `None` and `""` mean no namespace.
    #[must_use]
    pub fn with_namespace(mut self, namespace: Option<&str>) -> Self {
        if let Some(ns) = namespace.filter(|n| !n.is_empty()) {
            self.seed = self.seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
        }
        self
    }

    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Hashes every full block of `tokens`. `block_mm_infos[i]`, if present, holds the images
    /// of block `i`; missing entries (a shorter slice) mean no images.
    pub fn local_hashes(
        &self,
        tokens: &[u32],
        block_mm_infos: Option<&[Option<BlockExtraInfo>]>,
    ) -> Vec<LocalBlockHash> {
        let bs = self.block_size.tokens();
        let full = tokens.len() - tokens.len() % bs;
        // Serialise all full blocks once (a tight, vectorisable loop), then hash slices of it;
        // only blocks with images are copied again, to append their image hashes.
        let mut bytes = vec![0u8; full * 4];
        for (dst, token) in bytes.chunks_exact_mut(4).zip(&tokens[..full]) {
            dst.copy_from_slice(&token.to_le_bytes());
        }
        let mut scratch = Vec::new();
        bytes
            .chunks_exact(bs * 4)
            .enumerate()
            .map(|(i, block)| {
                let mm = block_mm_infos.and_then(|infos| infos.get(i)).and_then(Option::as_ref);
                match mm {
                    Some(info) if !info.mm_objects.is_empty() => {
                        scratch.clear();
                        scratch.extend_from_slice(block);
                        self.hash_with_images(&mut scratch, info)
                    }
                    _ => LocalBlockHash(xxh3_64_with_seed(block, self.seed)),
                }
            })
            .collect()
    }

    /// Hashes one block's tokens (any length: the caller decides what a block is, e.g. the
    /// wire layer, which checks engine block sizes itself) with the images it covers.
    pub fn hash_block(&self, tokens: &[u32], mm: Option<&BlockExtraInfo>) -> LocalBlockHash {
        let mut bytes = Vec::with_capacity(tokens.len() * 4 + 16);
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        match mm {
            Some(info) if !info.mm_objects.is_empty() => self.hash_with_images(&mut bytes, info),
            _ => LocalBlockHash(xxh3_64_with_seed(&bytes, self.seed)),
        }
    }

    /// Appends the block's image hashes, sorted, to its token bytes and hashes the lot.
    fn hash_with_images(&self, bytes: &mut Vec<u8>, info: &BlockExtraInfo) -> LocalBlockHash {
        let mut hashes: Vec<u64> = info.mm_objects.iter().map(|o| o.mm_hash).collect();
        hashes.sort_unstable();
        bytes.extend(hashes.iter().flat_map(|h| h.to_le_bytes()));
        LocalBlockHash(xxh3_64_with_seed(bytes, self.seed))
    }
}

/// Chains local block hashes into sequence hashes (one per block).
pub fn sequence_hashes(local: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    let mut parent: Option<SequenceHash> = None;
    for &l in local {
        let next = match parent {
            None => SequenceHash(l.0),
            Some(p) => chain(p, l),
        };
        out.push(next);
        parent = Some(next);
    }
    out
}

/// The sequence hash of block `local` following the prefix whose sequence hash is `parent`.
pub fn chain(parent: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceHash(xxh3_64_with_seed(&bytes, KV_HASH_SEED))
}

/// The `mm_hash` of an image from its identifier (docs/architecture.md, "Invariants"): a hex identifier (the
/// front door's BLAKE3 hex, TensorRT-LLM's 64-hex `mm_keys`, the publisher's 16-hex form)
/// gives its first 16 hex digits as a number, as the seed's example does; any other string
/// (an engine's own digest name) gives `xxh3_64` of its UTF-8 bytes.
///
/// ```
/// use kvroute_core::hash::mm_hash_from_identifier;
/// assert_eq!(mm_hash_from_identifier("00000000deadbeef99"), 0xdead_beef);
/// assert_eq!(mm_hash_from_identifier("5f5f5f5f5f5f5f5f5f5f"), 0x5f5f_5f5f_5f5f_5f5f);
/// assert_ne!(mm_hash_from_identifier("mmhashA"), 0);
/// ```
pub fn mm_hash_from_identifier(identifier: &str) -> u64 {
    let is_hex = !identifier.is_empty() && identifier.bytes().all(|b| b.is_ascii_hexdigit());
    match is_hex {
        true => u64::from_str_radix(&identifier[..identifier.len().min(16)], 16).unwrap_or(0),
        false => xxh3_64(identifier.as_bytes()),
    }
}

/// Dynamo's entry point, for callers that speak its terms: a zero block size is an error.
pub fn compute_block_hash_for_seq(
    tokens: &[u32],
    kv_block_size: u32,
    block_mm_infos: Option<&[Option<BlockExtraInfo>]>,
    lora_name: Option<&str>,
) -> Result<Vec<LocalBlockHash>, Error> {
    let hasher = BlockHasher::new(BlockSize::new(kv_block_size)?).with_lora(lora_name);
    Ok(hasher.local_hashes(tokens, block_mm_infos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::BlockMmObjectInfo;

    fn image(mm_hash: u64) -> Option<BlockExtraInfo> {
        Some(BlockExtraInfo {
            mm_objects: vec![BlockMmObjectInfo { mm_hash, offsets: vec![(0, 4)] }],
        })
    }

    fn hasher(bs: u32) -> BlockHasher {
        BlockHasher::new(BlockSize::new(bs).unwrap())
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(compute_block_hash_for_seq(&[1, 2], 0, None, None), Err(Error::ZeroBlockSize));
    }

    #[test]
    fn partial_block_is_not_hashed() {
        assert!(hasher(4).local_hashes(&[1, 2, 3], None).is_empty());
        assert_eq!(hasher(4).local_hashes(&[1, 2, 3, 4, 5], None).len(), 1);
    }

    #[test]
    fn image_changes_only_its_block() {
        let tokens: Vec<u32> = (0..12).collect();
        let plain = hasher(4).local_hashes(&tokens, None);
        let a = hasher(4).local_hashes(&tokens, Some(&[None, image(1), None]));
        let b = hasher(4).local_hashes(&tokens, Some(&[None, image(2), None]));
        assert_eq!(plain[0], a[0]);
        assert_ne!(plain[1], a[1]);
        assert_ne!(a[1], b[1]);
        assert_eq!(plain[2], a[2], "local hashes do not chain");
        assert_ne!(sequence_hashes(&plain)[2], sequence_hashes(&a)[2], "sequence hashes do");
    }

    #[test]
    fn empty_mm_info_equals_none_and_offsets_are_not_hashed() {
        let tokens: Vec<u32> = (0..4).collect();
        let none = hasher(4).hash_block(&tokens, None);
        assert_eq!(none, hasher(4).hash_block(&tokens, Some(&BlockExtraInfo::default())));
        let mut moved = image(9).unwrap();
        moved.mm_objects[0].offsets = vec![(1, 3)];
        assert_eq!(
            hasher(4).hash_block(&tokens, image(9).as_ref()),
            hasher(4).hash_block(&tokens, Some(&moved))
        );
    }

    #[test]
    fn images_are_sorted_and_duplicates_kept() {
        let tokens: Vec<u32> = (0..4).collect();
        let obj = |h| BlockMmObjectInfo { mm_hash: h, offsets: vec![] };
        let ab = BlockExtraInfo { mm_objects: vec![obj(1), obj(2)] };
        let ba = BlockExtraInfo { mm_objects: vec![obj(2), obj(1)] };
        let aab = BlockExtraInfo { mm_objects: vec![obj(1), obj(1), obj(2)] };
        let h = hasher(4);
        assert_eq!(h.hash_block(&tokens, Some(&ab)), h.hash_block(&tokens, Some(&ba)));
        assert_ne!(h.hash_block(&tokens, Some(&ab)), h.hash_block(&tokens, Some(&aab)));
    }

    #[test]
    fn lora_and_namespace_salt_the_seed() {
        let tokens: Vec<u32> = (0..4).collect();
        let base = hasher(4);
        assert_eq!(base.with_lora(Some("")), base);
        assert_eq!(base.with_namespace(None), base);
        let a = base.with_lora(Some("a")).hash_block(&tokens, None);
        let b = base.with_lora(Some("b")).hash_block(&tokens, None);
        let ns = base.with_namespace(Some("a")).hash_block(&tokens, None);
        let plain = base.hash_block(&tokens, None);
        assert!(a != b && a != plain && ns != plain && ns != a);
    }
}

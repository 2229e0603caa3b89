//! What the workloads draw: arrivals, tokens, words, images, Zipf popularity, block hashes.

use anyhow::Context;
use kvroute_core::schedule::Rng;
use kvroute_core::{BlockHasher, BlockSize, sequence_hashes};

/// Token ids drawn for synthetic text: inside the model's vocabulary, clear of its special
/// tokens (which sit at the top).
pub(super) const TOKEN_LO: u32 = 256;
pub(super) const TOKEN_HI: u32 = 900;

/// Exponential with the given mean.
pub fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.unit()).ln()
}

/// `n` Poisson arrival times at `rate` per second, the first at 0.
pub fn poisson_arrivals(rng: &mut Rng, n: usize, rate: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += exponential(rng, 1.0 / rate);
            }
            t
        })
        .collect()
}

pub fn random_tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| TOKEN_LO + rng.below((TOKEN_HI - TOKEN_LO) as usize) as u32).collect()
}

pub(super) fn shuffle<T>(rng: &mut Rng, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// Sequence hashes of the full blocks of a text prompt (salted with its adapter, if any).
pub fn token_blocks(tokens: &[u32], block_size: BlockSize, lora: Option<&str>) -> Vec<u64> {
    let local = BlockHasher::new(block_size).with_lora(lora).local_hashes(tokens, None);
    sequence_hashes(&local).into_iter().map(|h| h.0).collect()
}

/// The sequence hashes of every full block once `more` tokens (an answer's, no images)
/// follow a prompt whose full blocks are `blocks` and whose tokens are `prompt`.
pub fn extended_blocks(
    blocks: &[u64],
    prompt: &[u32],
    more: &[u32],
    bs: BlockSize,
    lora: Option<&str>,
) -> Vec<u64> {
    let hasher = BlockHasher::new(bs).with_lora(lora);
    let n = bs.tokens();
    let mut out = blocks.to_vec();
    let mut tail: Vec<u32> = prompt[blocks.len() * n..].to_vec();
    tail.extend_from_slice(more);
    for chunk in tail.chunks_exact(n) {
        let local = hasher.hash_block(chunk, None);
        let next = match out.last() {
            Some(&parent) => kvroute_core::hash::chain(kvroute_core::SequenceHash(parent), local),
            None => kvroute_core::SequenceHash(local.0),
        };
        out.push(next.0);
    }
    out
}

/// A generated square PNG: a pattern of its own per `index` (every image differs in its
/// pixels), smooth enough to stay a few kilobytes.
pub fn generated_png(index: usize, side: u32) -> anyhow::Result<Vec<u8>> {
    let k = index as u32;
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        let r = (x * (k % 7 + 1) + y * (k / 7 + 1)) & 0xff;
        let g = ((x ^ y) + k * 37) & 0xff;
        let b = ((x / 8 + y / 8) * (k + 3) + k) & 0xff;
        image::Rgb([r as u8, g as u8, b as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).context("encoding a generated PNG")?;
    Ok(out.into_inner())
}

pub(super) const SYLLABLES: [&str; 16] = [
    "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "da", "fe", "go", "hu", "ji", "po", "qu", "ze",
];

pub(super) fn words(rng: &mut Rng, n: usize) -> String {
    let mut out = String::new();
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        for _ in 0..2 + rng.below(2) {
            out.push_str(SYLLABLES[rng.below(SYLLABLES.len())]);
        }
    }
    out
}

/// Cumulative Zipf weights over `n` ranks.
pub(super) fn zipf_table(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    (0..n)
        .map(|k| {
            acc += 1.0 / ((k + 1) as f64).powf(s);
            acc
        })
        .collect()
}

pub(super) fn zipf_draw(rng: &mut Rng, table: &[f64]) -> usize {
    let total = table.last().copied().unwrap_or(0.0);
    let x = rng.unit() * total;
    table.partition_point(|&c| c <= x).min(table.len().saturating_sub(1))
}

//! The seeded workload, in neutral form (plain u64s), converted to each index's own events.
//!
//! Sequences of `seq_blocks` blocks. Sequence `s` belongs to prefix group `s / group` and lives on
//! worker `s % workers`; its first `shared` blocks have the group's content hashes, the rest its
//! own. Engine hashes are unique per sequence (different workers hash the same content apart,
//! as engines with their own seeds do) or chained from content (`exts=content`, the default
//! here: Dynamo's own chained xxh3, which its compressed trees and positional index assume). With `group = 4, shared = 128, seq_blocks = 512` this
//! is the workload of kvroute-core's own criterion benches (`benches/support/workload.rs`).
//!
//! The `hot` shape adds what a fleet with one popular document has: a 512-block document that
//! `hot_holders` of the workers hold, each a prefix of it whose length the engine's tail
//! eviction left (a quarter the whole document, the rest 16 to 511 blocks, seeded).

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub pairs: usize,
    pub workers: u64,
    pub seq_blocks: usize,
    pub shared: usize,
    pub group: usize,
    /// Workers that hold a prefix of the hot document (0: no hot document).
    pub hot_holders: u64,
    pub seed: u64,
    /// Engine hashes chained from content (the same prefix hashes alike on every engine, as
    /// vLLM's sha256 prefix hashes and Dynamo's own do), else unique per sequence (engines with
    /// their own hash seeds).
    pub content_exts: bool,
}

/// Worker `w`'s id: scattered, as engines' ids are (Dynamo's are lease ids), so that no index
/// gets its workers in id order for free.
pub fn worker_id(w: u64) -> u64 {
    splitmix(0x1D ^ w) >> 1
}

pub struct Seq {
    pub worker: u64,
    pub locals: Vec<u64>,
    pub exts: Vec<u64>,
}

pub struct Workload {
    pub seqs: Vec<Seq>,
    pub pairs: usize,
    /// The hot document's content hashes (empty without one).
    pub hot: Vec<u64>,
}

const HOT_BLOCKS: usize = 512;

impl Workload {
    pub fn new(shape: Shape) -> Self {
        let Shape { pairs, workers, seq_blocks, shared, group, hot_holders, seed, content_exts } =
            shape;
        let exts_of = |locals: &[u64], id: u64| -> Vec<u64> {
            if content_exts {
                let locals: Vec<_> =
                    locals.iter().map(|&l| kvroute_core::LocalBlockHash(l)).collect();
                kvroute_core::hash::sequence_hashes(&locals).into_iter().map(|h| h.0).collect()
            } else {
                (0..locals.len())
                    .map(|i| splitmix(!seed ^ splitmix(id) ^ ((i as u64) << 40)))
                    .collect()
            }
        };
        let hot: Vec<u64> = if hot_holders > 0 {
            (0..HOT_BLOCKS).map(|i| splitmix(seed ^ 0x4854 ^ splitmix(i as u64))).collect()
        } else {
            Vec::new()
        };
        let mut seqs = Vec::new();
        let mut total = 0;
        for w in 0..hot_holders.min(workers) {
            let r = splitmix(seed ^ 0x5EED ^ w);
            let len = if r.is_multiple_of(4) {
                HOT_BLOCKS
            } else {
                16 + (r >> 8) as usize % (HOT_BLOCKS - 16)
            };
            let locals = hot[..len].to_vec();
            let exts = exts_of(&locals, w | 1 << 60);
            seqs.push(Seq { worker: worker_id(w), locals, exts });
            total += len;
        }
        let mut s = 0u64;
        while total < pairs {
            let g = s / group as u64;
            let locals: Vec<u64> = (0..seq_blocks)
                .map(|i| {
                    let owner = if i < shared { g << 1 } else { (s << 1) | 1 };
                    splitmix(seed ^ splitmix(owner) ^ (i as u64))
                })
                .collect();
            let exts = exts_of(&locals, s);
            seqs.push(Seq { worker: worker_id(s % workers), locals, exts });
            total += seq_blocks;
            s += 1;
        }
        Self { seqs, pairs: total, hot }
    }

    /// Sequences of the group shape (not the hot document's).
    pub fn group_seqs(&self) -> &[Seq] {
        let hot = self.seqs.iter().take_while(|s| s.locals.first() == self.hot.first()).count();
        &self.seqs[if self.hot.is_empty() { 0 } else { hot }..]
    }
}

/// One event, neutral: Stored (parent, position of the first block, blocks) or Removed.
pub enum Ev {
    Stored { worker: u64, parent: Option<u64>, start: usize, blocks: Vec<(u64, u64)> },
    Removed { worker: u64, hashes: Vec<u64> },
}

/// A sequence as chained Stored events of `chunk` blocks.
pub fn stored(seq: &Seq, chunk: usize) -> impl Iterator<Item = Ev> + '_ {
    (0..seq.locals.len()).step_by(chunk).map(move |start| {
        let end = (start + chunk).min(seq.locals.len());
        let blocks = (start..end).map(|i| (seq.exts[i], seq.locals[i])).collect();
        let parent = start.checked_sub(1).map(|p| seq.exts[p]);
        Ev::Stored { worker: seq.worker, parent, start, blocks }
    })
}

/// A sequence's blocks removed leaves first (the order engines evict in), `chunk` at a time.
pub fn removed(seq: &Seq, chunk: usize) -> impl Iterator<Item = Ev> + '_ {
    let rev: Vec<u64> = seq.exts.iter().rev().copied().collect();
    let chunks: Vec<Vec<u64>> = rev.chunks(chunk).map(<[u64]>::to_vec).collect();
    chunks.into_iter().map(move |hashes| Ev::Removed { worker: seq.worker, hashes })
}

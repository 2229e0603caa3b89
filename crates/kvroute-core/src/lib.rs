//! kvroute's routing logic, free of I/O and of any async runtime so it can be benchmarked,
//! fuzzed and bound to Python on its own.
//!
//! - [`hash`]: block and sequence hashes (Dynamo-compatible, multimodal, LoRA and namespace salts);
//! - [`protocols`]: identifiers, multimodal block info and KV-cache events;
//! - [`index`]: the radix index of which cache holds which block, fed by those events;
//! - [`schedule`]: choosing a worker from those overlaps, in-flight load and worker metrics.
//!
//! See `protocols` for a picture of the four kinds of block identity.

pub mod hash;
pub mod index;
pub mod protocols;
pub mod schedule;

pub use hash::{BlockHasher, compute_block_hash_for_seq, sequence_hashes};
pub use index::{OverlapScores, RadixIndex};
pub use protocols::{
    BlockExtraInfo, BlockMmObjectInfo, BlockSize, DpRank, ExternalBlockHash, GroupKind,
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RequestExtraInfo, RequestMmObjectInfo, RouterEvent, SequenceHash, StorageTier,
    WorkerId, WorkerWithDpRank,
};

/// A setting's word that names none of its choices (`--role`, `--tier-loads`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {given:?} ({choices})")]
pub struct UnknownChoice {
    /// What the word was to name.
    pub what: &'static str,
    pub given: String,
    /// The words it takes, for the message.
    pub choices: &'static str,
}

impl UnknownChoice {
    pub fn new(what: &'static str, given: &str, choices: &'static str) -> Self {
        Self { what, given: given.to_owned(), choices }
    }
}

/// Everything kvroute-core can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("kv_block_size must be greater than 0")]
    ZeroBlockSize,
    /// A Stored event named a parent block the worker does not hold; nothing was applied.
    #[error("worker {worker} does not hold parent block {parent}")]
    UnknownParent { worker: WorkerWithDpRank, parent: ExternalBlockHash },
    /// A Removed event named blocks the worker does not hold; the others were removed.
    #[error("worker {worker} does not hold {count} of the removed blocks")]
    UnknownBlocks { worker: WorkerWithDpRank, count: usize },
    #[error(
        "unknown routing policy {0:?} (expected kv, kv-tokens, dynamo, round-robin, random, \
         least-loaded, sticky, kv-adapter-blind or lora-affinity)"
    )]
    UnknownPolicy(String),
}

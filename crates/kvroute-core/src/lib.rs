//! kvroute's routing logic, free of I/O and of any async runtime so it can be benchmarked,
//! fuzzed and bound to Python on its own.
//!
//! - [`hash`]: block and sequence hashes (Dynamo-compatible, multimodal, LoRA and namespace salts);
//! - [`protocols`]: identifiers, multimodal block info and KV-cache events.
//!
//! See `protocols` for a picture of the four kinds of block identity.

pub mod hash;
pub mod protocols;

pub use hash::{BlockHasher, compute_block_hash_for_seq, sequence_hashes};
pub use protocols::{
    BlockExtraInfo, BlockMmObjectInfo, BlockSize, DpRank, ExternalBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash,
    RequestExtraInfo, RequestMmObjectInfo, RouterEvent, SequenceHash, WorkerId, WorkerWithDpRank,
};

/// Everything kvroute-core can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("kv_block_size must be greater than 0")]
    ZeroBlockSize,
}

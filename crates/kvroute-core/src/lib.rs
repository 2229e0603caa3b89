//! kvroute's routing logic, free of I/O and of any async runtime so it can be benchmarked,
//! fuzzed and bound to Python on its own.
//!
//! - [`hash`]: block and sequence hashes (Dynamo-compatible, multimodal, LoRA and namespace salts);
//! - [`protocols`]: identifiers, multimodal block info and KV-cache events;
//! - [`index`]: the radix index of which cache holds which block, fed by those events;
//! - [`schedule`]: choosing a worker from those overlaps, in-flight load and worker metrics.
//!
//! See `protocols` for a picture of the four kinds of block identity.

mod error;
pub mod hash;
pub mod index;
pub mod protocols;
pub mod schedule;

pub use error::{Error, UnknownChoice};
pub use hash::{BlockHasher, compute_block_hash_for_seq, sequence_hashes};
pub use index::{OverlapScores, RadixIndex};
pub use protocols::{
    BlockExtraInfo, BlockMmObjectInfo, BlockSize, DpRank, ExternalBlockHash, GroupKind,
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RequestExtraInfo, RequestMmObjectInfo, RouterEvent, SequenceHash, StorageTier,
    WorkerId, WorkerWithDpRank,
};

//! The seeded synthetic workload of the index benches: sequences of 512 blocks whose first 128
//! blocks are shared within groups of 4 sequences; sequence `s` lives on worker `s % workers`
//! (so a group's shared prefix is held by 4 workers), with engine hashes unique per worker.

#![allow(dead_code, unreachable_pub)]

use kvroute_core::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerId, WorkerWithDpRank,
};

pub const SEQ_BLOCKS: usize = 512;
pub const SHARED_BLOCKS: usize = 128;
pub const GROUP: usize = 4;

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

pub struct Seq {
    pub worker: WorkerWithDpRank,
    pub locals: Vec<LocalBlockHash>,
    pub exts: Vec<ExternalBlockHash>,
}

pub struct Workload {
    pub seqs: Vec<Seq>,
    pub pairs: usize,
}

impl Workload {
    /// About `pairs` (worker, block) pairs over `workers` workers.
    pub fn new(pairs: usize, workers: u64, seed: u64) -> Self {
        let n = pairs.div_ceil(SEQ_BLOCKS);
        let seqs = (0..n)
            .map(|s| {
                let group = (s / GROUP) as u64;
                let worker = WorkerWithDpRank {
                    worker_id: WorkerId(s as u64 % workers),
                    dp_rank: DpRank(0),
                };
                let locals = (0..SEQ_BLOCKS)
                    .map(|i| {
                        let owner =
                            if i < SHARED_BLOCKS { group << 1 } else { ((s as u64) << 1) | 1 };
                        LocalBlockHash(splitmix(seed ^ splitmix(owner) ^ (i as u64)))
                    })
                    .collect();
                let exts = (0..SEQ_BLOCKS)
                    .map(|i| {
                        ExternalBlockHash(splitmix(!seed ^ splitmix(s as u64) ^ ((i as u64) << 40)))
                    })
                    .collect();
                Seq { worker, locals, exts }
            })
            .collect();
        Self { seqs, pairs: n * SEQ_BLOCKS }
    }

    /// Every sequence as chained Stored events of `chunk` blocks.
    pub fn stored_events(&self, chunk: usize) -> Vec<RouterEvent> {
        self.seqs.iter().flat_map(|seq| seq_stored(seq, chunk)).collect()
    }

    /// Every sequence's blocks removed, leaves first, in events of `chunk` blocks.
    pub fn removed_events(&self, chunk: usize) -> Vec<RouterEvent> {
        self.seqs.iter().flat_map(|seq| seq_removed(seq, chunk)).collect()
    }

    /// Steady state: each sequence evicted (leaves first) and stored again, in `chunk`-block
    /// events, so a full index keeps its size.
    pub fn evict_and_store_cycle(&self, chunk: usize) -> Vec<RouterEvent> {
        self.seqs
            .iter()
            .flat_map(|seq| {
                let mut events = seq_removed(seq, chunk);
                events.extend(seq_stored(seq, chunk));
                events
            })
            .collect()
    }

    /// Query of `len` blocks: a stored sequence's first `hit` blocks, then blocks nobody holds.
    pub fn query(&self, seq: usize, len: usize, hit: usize) -> Vec<LocalBlockHash> {
        let s = &self.seqs[seq % self.seqs.len()];
        (0..len)
            .map(
                |i| if i < hit { s.locals[i] } else { LocalBlockHash(splitmix(0xDEAD ^ i as u64)) },
            )
            .collect()
    }
}

pub fn seq_stored(seq: &Seq, chunk: usize) -> Vec<RouterEvent> {
    let mut parent = None;
    seq.locals
        .chunks(chunk)
        .zip(seq.exts.chunks(chunk))
        .map(|(locals, exts)| {
            let blocks = locals
                .iter()
                .zip(exts)
                .map(|(&tokens_hash, &block_hash)| KvCacheStoredBlockData {
                    block_hash,
                    tokens_hash,
                    mm_extra_info: None,
                })
                .collect();
            let data = KvCacheEventData::Stored(KvCacheStoreData { parent_hash: parent, blocks });
            parent = exts.last().copied();
            event(seq.worker, data)
        })
        .collect()
}

/// A sequence's blocks removed, leaves first (the order engines evict in).
pub fn seq_removed(seq: &Seq, chunk: usize) -> Vec<RouterEvent> {
    let rev: Vec<_> = seq.exts.iter().rev().copied().collect();
    rev.chunks(chunk)
        .map(|c| {
            let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes: c.to_vec() });
            event(seq.worker, data)
        })
        .collect()
}

fn event(worker: WorkerWithDpRank, data: KvCacheEventData) -> RouterEvent {
    RouterEvent { worker_id: worker.worker_id, event: KvCacheEvent::new(0, data, worker.dp_rank) }
}

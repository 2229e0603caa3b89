//! Each index behind one small interface: apply a neutral event, wait until applied, answer a
//! query. Reads go through each index's own public call, data-structure form or service form.

use std::cell::RefCell;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::nested_map::{PositionalIndexer, SearchMode};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, protocols as dy, radix_tree::RadixTree};
use kvroute_core as kv;

use crate::workload::Ev;

pub trait Peer {
    type Q;
    /// The index's own event type, built before the clock starts.
    type E;
    fn event(&self, ev: Ev) -> Self::E;
    fn apply_event(&self, e: Self::E);
    fn apply(&self, ev: Ev) {
        self.apply_event(self.event(ev));
    }
    /// Waits until every event handed to `apply` is applied.
    fn settle(&self) {}
    fn query(&self, q: &[u64]) -> Self::Q;
    /// (workers scored, best score).
    fn find(&self, q: &Self::Q) -> (usize, u32);
    /// Tree nodes, where the index says.
    fn nodes(&self) -> Option<usize> {
        None
    }
    /// The index's own estimate of its heap, where it gives one.
    fn heap_estimate(&self) -> Option<usize> {
        None
    }
}

// ---- kvroute ------------------------------------------------------------------------------

fn kv_event(ev: Ev) -> kv::RouterEvent {
    let (worker, data) = match ev {
        Ev::Stored { worker, parent, blocks, .. } => (
            worker,
            kv::KvCacheEventData::Stored(kv::KvCacheStoreData {
                parent_hash: parent.map(kv::ExternalBlockHash),
                blocks: blocks
                    .into_iter()
                    .map(|(e, l)| kv::KvCacheStoredBlockData {
                        block_hash: kv::ExternalBlockHash(e),
                        tokens_hash: kv::LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        ),
        Ev::Removed { worker, hashes } => (
            worker,
            kv::KvCacheEventData::Removed(kv::KvCacheRemoveData {
                block_hashes: hashes.into_iter().map(kv::ExternalBlockHash).collect(),
            }),
        ),
    };
    kv::RouterEvent::new(worker, kv::KvCacheEvent::new(0, data, kv::DpRank(0)))
}

fn kv_query(q: &[u64]) -> Vec<kv::LocalBlockHash> {
    q.iter().map(|&h| kv::LocalBlockHash(h)).collect()
}

fn kv_result(s: &kv::index::OverlapScores) -> (usize, u32) {
    (s.scores.len(), s.max_score())
}

pub struct KvRadix(pub RefCell<kv::RadixIndex>);

impl Peer for KvRadix {
    type Q = Vec<kv::LocalBlockHash>;
    type E = kv::RouterEvent;
    fn event(&self, ev: Ev) -> Self::E {
        kv_event(ev)
    }
    fn apply_event(&self, e: Self::E) {
        let _ = self.0.borrow_mut().apply_event(&e);
    }
    fn query(&self, q: &[u64]) -> Self::Q {
        kv_query(q)
    }
    fn find(&self, q: &Self::Q) -> (usize, u32) {
        kv_result(&self.0.borrow().find_matches(q))
    }
    fn nodes(&self) -> Option<usize> {
        Some(self.0.borrow().stats().nodes)
    }
    fn heap_estimate(&self) -> Option<usize> {
        Some(self.0.borrow().stats().heap_bytes)
    }
}

pub struct KvSharded(pub kv::index::ShardedIndex);

impl Peer for KvSharded {
    type Q = Vec<kv::LocalBlockHash>;
    type E = kv::RouterEvent;
    fn event(&self, ev: Ev) -> Self::E {
        kv_event(ev)
    }
    fn apply_event(&self, e: Self::E) {
        let _ = self.0.apply_event(&e);
    }
    fn query(&self, q: &[u64]) -> Self::Q {
        kv_query(q)
    }
    fn find(&self, q: &Self::Q) -> (usize, u32) {
        kv_result(&self.0.find_matches(q))
    }
    fn nodes(&self) -> Option<usize> {
        Some(self.0.stats().nodes)
    }
}

// ---- Dynamo -------------------------------------------------------------------------------

pub fn dy_event(ev: Ev) -> dy::RouterEvent {
    let (worker, data) = match ev {
        Ev::Stored { worker, parent, start, blocks } => (
            worker,
            dy::KvCacheEventData::Stored(dy::KvCacheStoreData {
                parent_hash: parent.map(dy::ExternalSequenceBlockHash),
                start_position: Some(start as u32),
                blocks: blocks
                    .into_iter()
                    .map(|(e, l)| dy::KvCacheStoredBlockData {
                        block_hash: dy::ExternalSequenceBlockHash(e),
                        tokens_hash: dy::LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        ),
        Ev::Removed { worker, hashes } => (
            worker,
            dy::KvCacheEventData::Removed(dy::KvCacheRemoveData {
                block_hashes: hashes.into_iter().map(dy::ExternalSequenceBlockHash).collect(),
            }),
        ),
    };
    dy::RouterEvent::new(worker, dy::KvCacheEvent { event_id: 0, data, dp_rank: 0 })
}

fn dy_query(q: &[u64]) -> Vec<dy::LocalBlockHash> {
    q.iter().map(|&h| dy::LocalBlockHash(h)).collect()
}

fn dy_result(s: &dy::OverlapScores) -> (usize, u32) {
    (s.scores.len(), s.scores.values().copied().max().unwrap_or(0))
}

/// Polls a future that completes without waiting (ThreadPoolIndexer's reads run inline).
pub fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("an inline read never waits"),
    }
}

pub struct DyRadix(pub RefCell<RadixTree>);

impl Peer for DyRadix {
    type Q = Vec<dy::LocalBlockHash>;
    type E = dy::RouterEvent;
    fn event(&self, ev: Ev) -> Self::E {
        dy_event(ev)
    }
    fn apply_event(&self, e: Self::E) {
        let _ = self.0.borrow_mut().apply_event(e);
    }
    fn query(&self, q: &[u64]) -> Self::Q {
        dy_query(q)
    }
    fn find(&self, q: &Self::Q) -> (usize, u32) {
        // Its API takes the query by value.
        dy_result(&self.0.borrow().find_matches(q.clone(), false))
    }
}

/// A backend behind Dynamo's ThreadPoolIndexer (the only way its writes are applied).
/// `service`: reads through the indexer's async `find_matches`; else the backend's own.
pub struct DyPool<T: SyncIndexer> {
    pub pool: ThreadPoolIndexer<T>,
    pub service: bool,
    pub rt: tokio::runtime::Runtime,
    pub pending: std::cell::Cell<usize>,
}

impl<T: SyncIndexer> DyPool<T> {
    pub fn new(backend: T, threads: usize, service: bool) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        let pool = ThreadPoolIndexer::new(backend, threads, 16);
        Self { pool, service, rt, pending: std::cell::Cell::new(0) }
    }
}

pub fn crtc() -> ConcurrentRadixTreeCompressed {
    ConcurrentRadixTreeCompressed::new()
}

pub fn positional() -> PositionalIndexer {
    PositionalIndexer::new_with_mode(32, SearchMode::Strided)
}

impl<T: SyncIndexer> Peer for DyPool<T> {
    type Q = Vec<dy::LocalBlockHash>;
    type E = dy::RouterEvent;
    fn event(&self, ev: Ev) -> Self::E {
        dy_event(ev)
    }
    fn apply_event(&self, e: Self::E) {
        self.pool.enqueue_event(e).expect("indexer online");
        // A feeder that lets its queue grow without bound measures memory, not speed.
        self.pending.set(self.pending.get() + 1);
        if self.pending.get() >= 4096 {
            self.settle();
        }
    }
    fn settle(&self) {
        self.rt.block_on(self.pool.flush_and_wait()).expect("flush");
        self.pending.set(0);
    }
    fn query(&self, q: &[u64]) -> Self::Q {
        dy_query(q)
    }
    fn find(&self, q: &Self::Q) -> (usize, u32) {
        if self.service {
            let out = ready(KvIndexerInterface::find_matches(&self.pool, q.clone()));
            dy_result(&out.expect("find_matches"))
        } else {
            dy_result(&self.pool.backend().find_matches(q, false))
        }
    }
}

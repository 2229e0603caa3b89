//! A KV store every engine of a fleet shares (docs/mocker.md, "Shared store"), as LMCache's
//! server, Mooncake's store or SGLang's HiCache storage layer serve one: `kvroute mocker
//! --role store` keeps blocks by sequence hash, and engines started with `--store-url` write
//! every block they compute to it and load from it the blocks of a prompt they do not hold.
//!
//! ```text
//!  engine A ──put [S0 S1 S2]──▶ store (LRU, --num-store-blocks) ◀──lookup [S0 S1 S2 S3]── engine B
//!     │      ◀─ evicted since ─┘                                 └─ held [1 1 1 0] ─▶  │
//!     ▼ events: BlockStored / BlockRemoved, locality REMOTE         loads S0..S2 at --store-bandwidth-gbps
//! ```
//!
//! - **Writes.** An engine sends each step's newly computed blocks (one put at a time, in
//!   order). The store answers with the blocks of this engine it evicted since the engine's
//!   last put (`evicted_before`) and while storing this put (`evicted`); the engine announces
//!   the first as `BlockRemoved`, then the put's blocks it wrote first as `BlockStored` (a
//!   block it wrote before and the store still holds is not announced again), then the
//!   second, all with `locality: "REMOTE"` (vLLM 0.33's tag for a store outside the
//!   engine), so a router sees the store's contents in the order they changed. An engine with nothing to write polls
//!   every 10 ms, so evictions reach routers while it is idle too. A put the store did not
//!   answer is not announced.
//! - **Every writer is told.** The store remembers which engines wrote each block; when it
//!   evicts one, each of them announces the removal (a router keeps the block once per
//!   engine that announced it).
//! - **Loads.** Before a prompt is queued, the engine asks which of its blocks the store holds
//!   (a lookup touches them, as a read does). At admission, the blocks after the engine's own
//!   GPU prefix, host memory and storage that the store held when asked, while consecutive,
//!   are loaded instead of computed, taking `bytes / --store-bandwidth-gbps`, timed as host
//!   loads are ([`crate::loads`]). They count as cached tokens.
//! - **Eviction.** Least recently written or read first.
//!
//! The wire is plain HTTP with JSON, kvroute's own: `POST /store/put`
//! `{"owner", "blocks": [u64]}`, `POST /store/lookup` `{"blocks": [u64]}`, `GET /stats`,
//! `GET /health`. Real stores move the bytes over RDMA or TCP; only their timing and their
//! effect on the engines' caches are simulated.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_http::paths;
use kvroute_http::{ApiError, HttpClient};
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// The most blocks one put or lookup may name.
pub const MAX_BLOCKS_PER_CALL: usize = 65_536;
/// The most engines a store tells apart; past it, the engine heard from least recently is
/// forgotten (its eviction notices dropped, its name on blocks removed).
pub const MAX_OWNERS: usize = 4_096;
/// The most engines one block names as its writers; another writer of it is answered as if
/// it had written it before (the store's blocks serve every engine in the router's index, so
/// nothing is lost but one more announcement).
pub const MAX_WRITERS: usize = 64;
/// Eviction notices kept for engines that have not asked for them, all engines together, per
/// block of the store's capacity (one more is dropped and counted).
const PENDING_PER_BLOCK: usize = 2;
/// Puts an engine keeps for announcing while the store has not answered them.
const MAX_UNANSWERED: usize = 4_096;
/// The longest a prompt waits for the store to say what it holds.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest a put waits for its answer (it is then not announced).
const PUT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an engine with nothing to write asks for its evictions.
const POLL: Duration = Duration::from_millis(10);

#[derive(Debug)]
struct Block {
    stamp: u64,
    /// Engines that wrote it (indices into `Store::owners`).
    writers: Vec<u32>,
}

/// What a store has done since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    pub blocks: usize,
    pub capacity: usize,
    pub puts: u64,
    pub stored_blocks: u64,
    pub lookups: u64,
    pub looked_up_blocks: u64,
    pub hit_blocks: u64,
    pub evicted_blocks: u64,
    /// Eviction notices dropped for engines that stopped asking.
    pub dropped_notices: u64,
    /// Engines forgotten to make room for others.
    pub forgotten_owners: u64,
}

/// What a store holds, counted in the entries that take its memory: each is bounded by the
/// capacity it was configured with ([`Footprint::bound`]), whatever its callers send.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Footprint {
    pub blocks: usize,
    /// Writer names on blocks, all blocks together.
    pub writers: usize,
    /// Eviction notices waiting, all engines together.
    pub pending: usize,
    pub owners: usize,
}

impl Footprint {
    /// The most of each a store of `capacity` blocks holds.
    pub fn bound(capacity: usize) -> Self {
        Self {
            blocks: capacity,
            writers: capacity * MAX_WRITERS,
            pending: capacity * PENDING_PER_BLOCK,
            owners: MAX_OWNERS,
        }
    }

    /// Bytes, roughly: a block's map and order entries (~80), a writer 4, a notice 8, an
    /// owner's name and queues (~400 at most).
    pub fn bytes(&self) -> usize {
        self.blocks * 80 + self.writers * 4 + self.pending * 8 + self.owners * 400
    }
}

/// The store's blocks, least recently used first.
#[derive(Debug)]
pub struct Store {
    capacity: usize,
    blocks: FxHashMap<u64, Block>,
    order: BTreeSet<(u64, u64)>,
    clock: u64,
    owners: FxHashMap<String, u32>,
    /// Per owner slot: its name and when it was last heard from (the store's clock).
    slots: Vec<(String, u64)>,
    /// Per owner, the blocks it wrote that were evicted since it last asked.
    pending: Vec<Vec<u64>>,
    /// Notices in `pending`, all owners together.
    pending_total: usize,
    writers_total: usize,
    stats: StoreStats,
}

/// The answer to a put.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutAnswer {
    /// The owner's blocks evicted before this put.
    pub evicted_before: Vec<u64>,
    /// The owner's blocks evicted while storing it (after the put's blocks were stored).
    pub evicted: Vec<u64>,
    /// Per block of the put, whether the owner now writes it for the first time (a block it
    /// wrote before and that is still held is not announced again).
    #[serde(default)]
    pub fresh: Vec<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    owner: String,
    #[serde(default)]
    blocks: Vec<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LookupBody {
    blocks: Vec<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct LookupAnswer {
    held: Vec<bool>,
}

/// Why a call was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("a call may name at most {MAX_BLOCKS_PER_CALL} blocks")]
    TooManyBlocks,
    #[error("the owner must be 1 to 256 bytes")]
    BadOwner,
}

impl Store {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            blocks: FxHashMap::default(),
            order: BTreeSet::new(),
            clock: 0,
            owners: FxHashMap::default(),
            slots: Vec::new(),
            pending: Vec::new(),
            pending_total: 0,
            writers_total: 0,
            stats: StoreStats { capacity, ..StoreStats::default() },
        }
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats { blocks: self.blocks.len(), ..self.stats }
    }

    pub fn footprint(&self) -> Footprint {
        Footprint {
            blocks: self.blocks.len(),
            writers: self.writers_total,
            pending: self.pending_total,
            owners: self.owners.len(),
        }
    }

    pub fn holds(&self, block: u64) -> bool {
        self.blocks.contains_key(&block)
    }

    fn touch(&mut self, block: u64) {
        if let Some(b) = self.blocks.get_mut(&block) {
            self.order.remove(&(b.stamp, block));
            self.clock += 1;
            b.stamp = self.clock;
            self.order.insert((self.clock, block));
        }
    }

    fn owner(&mut self, name: &str) -> Result<u32, StoreError> {
        if name.is_empty() || name.len() > 256 {
            return Err(StoreError::BadOwner);
        }
        self.clock += 1;
        if let Some(&i) = self.owners.get(name) {
            self.slots[i as usize].1 = self.clock;
            return Ok(i);
        }
        let i = match self.slots.len() < MAX_OWNERS {
            true => {
                self.slots.push((String::new(), 0));
                self.pending.push(Vec::new());
                (self.slots.len() - 1) as u32
            }
            false => self.forget_least_recent_owner(),
        };
        self.owners.insert(name.to_owned(), i);
        self.slots[i as usize] = (name.to_owned(), self.clock);
        Ok(i)
    }

    /// Forgets the owner heard from least recently (its notices, its name on blocks); its
    /// slot, to reuse.
    fn forget_least_recent_owner(&mut self) -> u32 {
        let oldest = self.slots.iter().enumerate().min_by_key(|(_, (_, seen))| *seen);
        let i = oldest.map_or(0, |(i, _)| i as u32);
        let name = std::mem::take(&mut self.slots[i as usize].0);
        self.owners.remove(&name);
        let notices = std::mem::take(&mut self.pending[i as usize]);
        self.pending_total -= notices.len();
        for b in self.blocks.values_mut() {
            let before = b.writers.len();
            b.writers.retain(|&w| w != i);
            self.writers_total -= before - b.writers.len();
        }
        self.stats.forgotten_owners += 1;
        i
    }

    /// The owner's notices, taken.
    fn notices(&mut self, me: u32) -> Vec<u64> {
        let taken = std::mem::take(&mut self.pending[me as usize]);
        self.pending_total -= taken.len();
        taken
    }

    /// Stores `blocks` (one request's, in order) for `owner`: what was evicted of the
    /// owner's blocks before and during it.
    pub fn put(&mut self, owner: &str, blocks: &[u64]) -> Result<PutAnswer, StoreError> {
        if blocks.len() > MAX_BLOCKS_PER_CALL {
            return Err(StoreError::TooManyBlocks);
        }
        let me = self.owner(owner)?;
        let evicted_before = self.notices(me);
        let mut fresh = vec![false; blocks.len()];
        if self.capacity == 0 || blocks.is_empty() {
            return Ok(PutAnswer { evicted_before, evicted: Vec::new(), fresh });
        }
        self.stats.puts += 1;
        // A put larger than the store keeps its first blocks (the prefix others reuse).
        let blocks = &blocks[..blocks.len().min(self.capacity)];
        // Its blocks held already are the most recent, so storing the rest cannot evict them.
        for &h in blocks.iter().rev() {
            self.touch(h);
        }
        for (i, &h) in blocks.iter().enumerate() {
            if let Some(b) = self.blocks.get_mut(&h) {
                if !b.writers.contains(&me) && b.writers.len() < MAX_WRITERS {
                    b.writers.push(me);
                    self.writers_total += 1;
                    fresh[i] = true;
                }
                continue;
            }
            fresh[i] = true;
            while self.blocks.len() >= self.capacity {
                let Some((_, victim)) = self.order.pop_first() else { break };
                self.evict(victim);
            }
            self.blocks.insert(h, Block { stamp: 0, writers: vec![me] });
            self.writers_total += 1;
            self.stats.stored_blocks += 1;
        }
        // A request's first block is the most recent: its prefix outlives its tail.
        for &h in blocks.iter().rev() {
            self.touch(h);
        }
        let evicted = self.notices(me);
        Ok(PutAnswer { evicted_before, evicted, fresh })
    }

    fn evict(&mut self, victim: u64) {
        let Some(b) = self.blocks.remove(&victim) else { return };
        self.stats.evicted_blocks += 1;
        self.writers_total -= b.writers.len();
        for w in b.writers {
            if self.pending_total < self.capacity * PENDING_PER_BLOCK {
                self.pending[w as usize].push(victim);
                self.pending_total += 1;
            } else {
                self.stats.dropped_notices += 1;
            }
        }
    }

    /// Which of `blocks` the store holds; those it holds are touched (read).
    pub fn lookup(&mut self, blocks: &[u64]) -> Result<Vec<bool>, StoreError> {
        if blocks.len() > MAX_BLOCKS_PER_CALL {
            return Err(StoreError::TooManyBlocks);
        }
        self.stats.lookups += 1;
        self.stats.looked_up_blocks += blocks.len() as u64;
        let held: Vec<bool> = blocks.iter().map(|h| self.blocks.contains_key(h)).collect();
        for (&h, _) in blocks.iter().zip(&held).rev().filter(|(_, held)| **held) {
            self.touch(h);
            self.stats.hit_blocks += 1;
        }
        Ok(held)
    }
}

/// Bytes through every decoder of the store's messages (the fuzz target `store`): each
/// message the store takes, decoded and applied to a small store whose bounds are then
/// checked, and each answer an engine takes, decoded and applied to its writes. Returns,
/// never panics (but for a broken bound).
pub fn fuzz(data: &[u8]) {
    let mut store = Store::new(16);
    for line in data.split(|&b| b == b'\n') {
        if let Ok(put) = serde_json::from_slice::<PutBody>(line) {
            let _ = store.put(&put.owner, &put.blocks);
        }
        if let Ok(lookup) = serde_json::from_slice::<LookupBody>(line)
            && let Ok(held) = store.lookup(&lookup.blocks)
        {
            assert_eq!(held.len(), lookup.blocks.len());
        }
        let f = store.footprint();
        let bound = Footprint::bound(16);
        assert!(f.blocks <= bound.blocks && f.writers <= bound.writers, "{f:?}");
        assert!(f.pending <= bound.pending && f.owners <= bound.owners, "{f:?}");
        let mut writes = Writes { enabled: true, ..Writes::default() };
        if let Ok(answer) = serde_json::from_slice::<PutAnswer>(line) {
            writes.write(vec![BlockStored {
                block_hashes: vec![1, 2],
                parent_block_hash: None,
                token_ids: vec![1; 32],
                block_size: 16,
                ..BlockStored::default()
            }]);
            let _ = writes.take();
            let _ = writes.acked(Acked { put: Some(0), answer: Some(answer) });
        }
        let _ = serde_json::from_slice::<LookupAnswer>(line);
    }
}

type Shared = Arc<Mutex<Store>>;

fn locked(store: &Shared) -> std::sync::MutexGuard<'_, Store> {
    store.lock().unwrap_or_else(PoisonError::into_inner)
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::TooManyBlocks => ApiError::too_large(e.to_string()).param("blocks"),
            StoreError::BadOwner => ApiError::bad_request(e.to_string()).param("owner"),
        }
    }
}

/// The store's HTTP API: every route but `/health` needs one of `writers` (the fleet's
/// token, `--kv-peer-token`) when it has any.
pub fn app(store: Shared, writers: kvroute_http::Credentials) -> Router {
    let guarded = Router::new()
        .route("/store/put", post(put))
        .route("/store/lookup", post(lookup))
        .route("/stats", get(stats));
    kvroute_http::auth::require(guarded, writers)
        .route(paths::HEALTH, get(|| async { "ok" }))
        .with_state(store)
}

async fn put(
    State(store): State<Shared>,
    body: Result<Json<PutBody>, JsonRejection>,
) -> Result<Json<PutAnswer>, ApiError> {
    let Json(body) = body?;
    Ok(Json(locked(&store).put(&body.owner, &body.blocks)?))
}

async fn lookup(
    State(store): State<Shared>,
    body: Result<Json<LookupBody>, JsonRejection>,
) -> Result<Json<LookupAnswer>, ApiError> {
    let Json(body) = body?;
    Ok(Json(LookupAnswer { held: locked(&store).lookup(&body.blocks)? }))
}

async fn stats(State(store): State<Shared>) -> Json<StoreStats> {
    Json(locked(&store).stats())
}

/// A store serving on `listener` (on the current runtime), guarded by `writers`; its state,
/// for tests.
pub fn spawn(
    capacity: usize,
    listener: tokio::net::TcpListener,
    writers: kvroute_http::Credentials,
) -> Shared {
    let store = Arc::new(Mutex::new(Store::new(capacity)));
    let app = app(Arc::clone(&store), writers);
    tokio::spawn(kvroute_http::serve(listener, app, std::future::pending()));
    store
}

// ---- the engine's side ----------------------------------------------------------------

/// An engine's link to the store (`--store-url`).
#[derive(Clone, Debug)]
pub struct StoreLink {
    base: String,
    client: HttpClient,
}

/// One put of the engine's, numbered in the order it was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Put {
    pub id: u64,
    pub blocks: Vec<u64>,
}

/// What the store answered to a put (`put: None`: a poll).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acked {
    pub put: Option<u64>,
    /// The store's answer; `None`: it did not answer (nothing is announced).
    pub answer: Option<PutAnswer>,
}

impl StoreLink {
    /// A link that sends `token` (the fleet's, which the store requires) with every call.
    pub fn new(url: &str, token: Option<&str>) -> Self {
        let client = HttpClient::bearing(token);
        Self { base: url.trim_end_matches('/').to_owned(), client }
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// Which of `blocks` the store holds; none if it does not answer within a second
    /// (logged): the prompt is then computed.
    pub async fn lookup(&self, blocks: &[u64]) -> Vec<bool> {
        let url = format!("{}/store/lookup", self.base);
        let blocks = &blocks[..blocks.len().min(MAX_BLOCKS_PER_CALL)];
        let body = serde_json::json!({ "blocks": blocks });
        let call = self.client.post_json::<LookupAnswer>(&url, &body);
        match tokio::time::timeout(LOOKUP_TIMEOUT, call).await {
            Ok(Ok(a)) if a.held.len() == blocks.len() => a.held,
            Ok(Ok(_)) => {
                tracing::warn!(%url, "the store answered a lookup with the wrong length");
                Vec::new()
            }
            Ok(Err(e)) => {
                tracing::warn!(%url, error = %kvroute_http::error::chain(&e), "store lookup failed");
                Vec::new()
            }
            Err(_) => {
                tracing::warn!(%url, "the store did not answer a lookup in time");
                Vec::new()
            }
        }
    }

    async fn put(&self, owner: &str, blocks: &[u64]) -> Option<PutAnswer> {
        let url = format!("{}/store/put", self.base);
        let body = serde_json::json!({ "owner": owner, "blocks": blocks });
        let call = self.client.post_json::<PutAnswer>(&url, &body);
        match tokio::time::timeout(PUT_TIMEOUT, call).await {
            Ok(Ok(a)) => Some(a),
            Ok(Err(e)) => {
                tracing::debug!(%url, error = %kvroute_http::error::chain(&e), "store put failed");
                None
            }
            Err(_) => None,
        }
    }

    /// Sends the engine's puts in order (and polls while there are none), handing each
    /// answer to `acked`, until `puts` closes.
    pub async fn writer(
        self,
        owner: String,
        mut puts: mpsc::UnboundedReceiver<Put>,
        acked: impl Fn(Acked) -> bool,
    ) {
        let mut failures = 0u64;
        loop {
            let next = tokio::time::timeout(POLL, puts.recv()).await;
            let (id, blocks) = match next {
                Ok(Some(put)) => (Some(put.id), put.blocks),
                Ok(None) => return,
                Err(_) => (None, Vec::new()),
            };
            let answer = self.put(&owner, &blocks).await;
            if answer.is_none() {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::warn!(url = %self.base, failures, "the shared store does not answer");
                }
            }
            let nothing = |a: &PutAnswer| a.evicted_before.is_empty() && a.evicted.is_empty();
            if id.is_none() && answer.as_ref().is_none_or(nothing) {
                continue;
            }
            if !acked(Acked { put: id, answer }) {
                return;
            }
        }
    }
}

/// An engine's writes to the store, announced once the store has answered them.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    /// A store is attached: computed blocks are written to it.
    pub(crate) enabled: bool,
    next: u64,
    /// Puts made since the engine's service last took them.
    ready: Vec<Put>,
    /// Per put not answered yet, each block's `BlockStored` (one block each, in order).
    stashed: std::collections::VecDeque<(u64, Vec<BlockStored>)>,
}

/// The `medium` and `locality` of the store's events, as vLLM 0.33's offloading connector
/// names a store outside the engine.
const MEDIUM: &str = "CPU";
const REMOTE: &str = "REMOTE";

impl Writes {
    /// Puts `blocks` (one request's, in order; each its own `BlockStored`) to the store.
    pub(crate) fn write(&mut self, blocks: Vec<BlockStored>) {
        if blocks.is_empty() {
            return;
        }
        let id = self.next;
        self.next += 1;
        let hashes = blocks.iter().flat_map(|b| b.block_hashes.iter().copied()).collect();
        self.ready.push(Put { id, blocks: hashes });
        self.stashed.push_back((id, blocks));
        // A store that stopped answering: its oldest puts will never be announced.
        while self.stashed.len() > MAX_UNANSWERED {
            self.stashed.pop_front();
        }
    }

    pub(crate) fn take(&mut self) -> Vec<Put> {
        std::mem::take(&mut self.ready)
    }

    /// The events an answer makes known: the engine's blocks evicted before the put, the
    /// put's blocks the engine wrote first, then those evicted while storing it.
    pub(crate) fn acked(&mut self, acked: Acked) -> Vec<EngineEvent> {
        let mut stored = Vec::new();
        if let Some(id) = acked.put {
            while let Some((front, blocks)) = self.stashed.pop_front() {
                if front == id {
                    stored = blocks;
                    break;
                }
                if front > id {
                    self.stashed.push_front((front, blocks));
                    break;
                }
            }
        }
        let Some(answer) = acked.answer else { return Vec::new() };
        let mut events = Vec::new();
        removed(&mut events, answer.evicted_before);
        let fresh = stored.into_iter().zip(answer.fresh).filter(|(_, f)| *f).map(|(b, _)| b);
        for mut block in fresh {
            block.medium = Some(MEDIUM.to_owned());
            block.locality = Some(REMOTE.to_owned());
            match events.last_mut() {
                Some(EngineEvent::BlockStored(run)) if follows(run, &block) => extend(run, block),
                _ => events.push(EngineEvent::BlockStored(block)),
            }
        }
        removed(&mut events, answer.evicted);
        events
    }
}

fn removed(events: &mut Vec<EngineEvent>, blocks: Vec<u64>) {
    if !blocks.is_empty() {
        events.push(EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: blocks,
            medium: Some(MEDIUM.to_owned()),
            group_idx: None,
            locality: Some(REMOTE.to_owned()),
        }));
    }
}

/// `next` continues `run`'s chain, with the same keys.
fn follows(run: &BlockStored, next: &BlockStored) -> bool {
    run.block_hashes.last().copied() == next.parent_block_hash
        && run.lora_name == next.lora_name
        && run.cache_salt == next.cache_salt
        && run.extra_keys.is_some() == next.extra_keys.is_some()
}

fn extend(run: &mut BlockStored, next: BlockStored) {
    run.block_hashes.extend(next.block_hashes);
    run.token_ids.extend(next.token_ids);
    if let (Some(keys), Some(more)) = (&mut run.extra_keys, next.extra_keys) {
        keys.extend(more);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn every_writer_of_an_evicted_block_is_told_once() {
        let mut store = Store::new(3);
        let fresh = |fresh: &[bool]| PutAnswer { fresh: fresh.to_vec(), ..PutAnswer::default() };
        assert_eq!(store.put("a", &[1, 2]).unwrap(), fresh(&[true, true]));
        // b writes them too: it announces them, and will hear of their eviction.
        assert_eq!(store.put("b", &[1, 2]).unwrap(), fresh(&[true, true]));
        assert_eq!(store.put("b", &[1, 2]).unwrap(), fresh(&[false, false]), "said once");
        // A request's first block is touched last, so 2 is the least recent and goes first.
        let a = store.put("c", &[5, 6]).unwrap();
        assert_eq!(a, fresh(&[true, true]), "c wrote none of what was evicted");
        assert!(store.holds(1) && !store.holds(2) && store.holds(5) && store.holds(6));
        // Both writers of 2 hear of it at their next call, once.
        assert_eq!(store.put("a", &[]).unwrap().evicted_before, vec![2]);
        assert_eq!(store.put("a", &[]).unwrap().evicted_before, Vec::<u64>::new());
        assert_eq!(store.put("b", &[]).unwrap().evicted_before, vec![2]);
        // A put that evicts its writer's own older block tells it in the same answer, after
        // the put; another writer's block goes to that writer.
        let a = store.put("c", &[7, 8]).unwrap();
        assert_eq!(a, PutAnswer { evicted: vec![6], ..fresh(&[true, true]) });
        assert_eq!(store.put("a", &[]).unwrap().evicted_before, vec![1]);
        assert_eq!(store.put("b", &[]).unwrap().evicted_before, vec![1]);
        assert_eq!(store.stats().evicted_blocks, 3);
    }

    #[test]
    fn a_lookup_reads_what_is_held_and_keeps_it() {
        let mut store = Store::new(2);
        store.put("a", &[1, 2]).unwrap();
        assert_eq!(store.lookup(&[1, 3, 2]).unwrap(), [true, false, true]);
        // 2 was read after 1 in the lookup's reverse order, so 1 is the most recent.
        store.put("a", &[9]).unwrap();
        assert!(store.holds(1) && !store.holds(2) && store.holds(9));
        let s = store.stats();
        assert_eq!((s.lookups, s.looked_up_blocks, s.hit_blocks), (1, 3, 2));
    }

    /// Over a real socket: an engine's link reads what the store holds, its writer announces
    /// each answer in order, and bad bodies get OpenAI-style errors.
    #[tokio::test]
    async fn the_store_over_http() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let token = "fleet-token-0123456789";
        let store = spawn(2, listener, kvroute_http::Credentials::new([token], "test").unwrap());
        // A stranger (no token, or another) can neither put, nor look up, nor read stats.
        for stranger in [HttpClient::new(), HttpClient::new().with_bearer("not-the-token")] {
            let put = json!({"owner": "x", "blocks": [1]});
            let r = stranger.post_json::<PutAnswer>(&format!("{url}/store/put"), &put).await;
            let Err(kvroute_http::ClientError::Status { status, .. }) = r else { panic!("{r:?}") };
            assert_eq!(status.as_u16(), 401);
            let r = stranger
                .post_json::<LookupAnswer>(&format!("{url}/store/lookup"), &json!({"blocks": [1]}))
                .await;
            let Err(kvroute_http::ClientError::Status { status, .. }) = r else { panic!("{r:?}") };
            assert_eq!(status.as_u16(), 401);
            let (status, _) = stranger.get(&format!("{url}/stats")).await.unwrap();
            assert_eq!(status.as_u16(), 401);
        }
        assert_eq!(locked(&store).stats().puts, 0, "no stranger's put was taken");
        let link = StoreLink::new(&url, Some(token));
        let (puts, rx) = mpsc::unbounded_channel();
        let (acks, mut acked) = mpsc::unbounded_channel();
        tokio::spawn(link.clone().writer("e".into(), rx, move |a| acks.send(a).is_ok()));
        puts.send(Put { id: 0, blocks: vec![1, 2] }).unwrap();
        puts.send(Put { id: 1, blocks: vec![3] }).unwrap();
        let first = acked.recv().await.unwrap();
        assert_eq!(first.put, Some(0));
        assert_eq!(first.answer.unwrap().fresh, [true, true]);
        let second = acked.recv().await.unwrap();
        let answer = second.answer.unwrap();
        assert_eq!((second.put, answer.evicted), (Some(1), vec![2]), "the tail made room");
        assert_eq!(link.lookup(&[1, 2, 3]).await, [true, false, true]);
        assert_eq!(locked(&store).stats().lookups, 1);
        // A store that is gone answers nothing: the prompt is computed.
        assert!(StoreLink::new("http://127.0.0.1:9", Some(token)).lookup(&[1]).await.is_empty());

        let client = HttpClient::new().with_bearer(token);
        for body in [json!({"owner": "e", "blocks": "x"}), json!({"blocks": [1], "more": 1})] {
            let r = client.post_json::<PutAnswer>(&format!("{url}/store/put"), &body).await;
            let Err(kvroute_http::ClientError::Status { status, .. }) = r else { panic!("{r:?}") };
            assert!(status.is_client_error(), "{status}");
        }
        let many = json!({"blocks": vec![0; MAX_BLOCKS_PER_CALL + 1]});
        let r = client.post_json::<LookupAnswer>(&format!("{url}/store/lookup"), &many).await;
        let Err(kvroute_http::ClientError::Status { status, .. }) = r else { panic!("{r:?}") };
        assert_eq!(status.as_u16(), 413);
    }

    /// Filled at every bound at once (all owners, writers on every block, evictions nobody
    /// asks for), the store holds at most what its capacity allows, and its counts stay
    /// exact as owners are forgotten and blocks evicted.
    #[test]
    fn memory_is_bounded_by_the_configured_blocks() {
        let capacity = 64;
        let mut store = Store::new(capacity);
        let bound = Footprint::bound(capacity);
        for round in 0..3u64 {
            for o in 0..MAX_OWNERS + 100 {
                let blocks: Vec<u64> =
                    (0..8).map(|b| round * 1_000_000 + (o as u64 % 8) * 8 + b).collect();
                store.put(&format!("engine-{o}"), &blocks).unwrap();
            }
            let f = store.footprint();
            assert!(f.blocks <= bound.blocks && f.writers <= bound.writers, "{f:?} {bound:?}");
            assert!(f.pending <= bound.pending && f.owners <= bound.owners, "{f:?} {bound:?}");
            // The running counts are the real ones.
            let writers: usize = store.blocks.values().map(|b| b.writers.len()).sum();
            let pending: usize = store.pending.iter().map(Vec::len).sum();
            assert_eq!((f.writers, f.pending), (writers, pending));
        }
        assert!(store.stats().dropped_notices > 0, "the notice bound was reached");
        assert!(store.blocks.values().any(|b| b.writers.len() == MAX_WRITERS));
        assert!(Footprint::bound(16_384).bytes() < 64 << 20, "16k blocks stay under 64 MiB");
    }

    #[test]
    fn bad_calls_are_refused() {
        let mut store = Store::new(2);
        assert_eq!(store.put("", &[1]), Err(StoreError::BadOwner));
        let many = vec![0; MAX_BLOCKS_PER_CALL + 1];
        assert_eq!(store.put("a", &many), Err(StoreError::TooManyBlocks));
        assert_eq!(store.lookup(&many), Err(StoreError::TooManyBlocks));
        for i in 0..MAX_OWNERS {
            store.put(&format!("o{i}"), &[]).unwrap();
        }
        // Past the bound, the engine heard from least recently is forgotten: new ones are
        // never locked out.
        store.put("o0", &[]).unwrap();
        store.put("one more", &[]).unwrap();
        assert_eq!(store.footprint().owners, MAX_OWNERS);
        assert_eq!(store.stats().forgotten_owners, 1);
        assert!(store.owners.contains_key("o0") && !store.owners.contains_key("o1"));
        // A store of no blocks holds nothing.
        let mut none = Store::new(0);
        none.put("a", &[1]).unwrap();
        assert!(!none.holds(1));
    }
}

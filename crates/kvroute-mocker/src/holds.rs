//! What a prefill engine holds for decode engines to pull ([`Holds`]: claimed keys, held
//! blocks, their bound and lease), who may pull ([`Peers`]), and the inbound links' queues:
//! the hand-off's state, with no HTTP in it ([`crate::handoff`] serves the protocol).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::StatusCode;
use kvroute_http::{ApiError, HttpClient};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::disagg::shown;
use crate::engine::Output;
use crate::service::EngineHandle;

/// Who an engine's transfers may involve: the credential its side channel and the shared
/// store require (and its own pulls and store calls send), and the prefill engines a decode
/// engine may pull from.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    /// The fleet's shared secret (`--kv-peer-token`); `None`: the side channel is open
    /// (only for engines built in-process without one; the command requires it).
    pub token: Option<String>,
    /// The side channels a decode engine may pull from (`--prefill-peers`); a decode leg
    /// naming any other is refused before anything is sent.
    pub prefill: Vec<SocketAddr>,
}

impl Peers {
    /// Whether a decode engine may pull from `addr`.
    pub fn allows(&self, addr: SocketAddr) -> bool {
        self.prefill.contains(&addr)
    }

    /// The side channel's and the store's guard.
    pub fn credentials(&self) -> kvroute_http::Credentials {
        let token = self.token.as_deref().into_iter();
        kvroute_http::Credentials::new(token, "--kv-peer-token").unwrap_or_default()
    }

    /// A client that sends the token.
    pub fn client(&self) -> HttpClient {
        HttpClient::bearing(self.token.as_deref())
    }
}

/// A held prefill.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    /// The engine's id of the request.
    pub(crate) engine_id: String,
    pub(crate) tokens: usize,
}

/// A prefill leg's key, from the leg's start: its blocks (counted against the bound once
/// held), which use of the key it is, and its hold once it ended.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) blocks: usize,
    pub(crate) generation: u64,
    pub(crate) held: Option<Held>,
}

/// Every key a prefill leg uses, each once, and the blocks held under them.
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub(crate) entries: HashMap<String, Entry>,
    /// Blocks of the entries held (legs under way are the engine's ordinary load).
    pub(crate) held_blocks: usize,
    pub(crate) generations: u64,
}

impl Table {
    /// `key`'s entry, if it is still the use `generation`.
    pub(crate) fn entry(&mut self, key: &str, generation: u64) -> Option<&mut Entry> {
        self.entries.get_mut(key).filter(|e| e.generation == generation)
    }

    /// Removes `key` (if it is still the use `generation`, when given).
    pub(crate) fn remove(&mut self, key: &str, generation: Option<u64>) -> Option<Entry> {
        let entry = self.entries.get(key)?;
        if generation.is_some_and(|g| g != entry.generation) {
            return None;
        }
        let entry = self.entries.remove(key)?;
        if entry.held.is_some() {
            self.held_blocks -= entry.blocks;
        }
        Some(entry)
    }
}

/// Why a prefill leg may not hold under a key.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HoldRefused {
    #[error("the transfer key is in use by another request")]
    Duplicate,
    #[error(
        "this prefill engine holds as much KV for decode engines as it may ({held} of at most \
         {bound} blocks), and none was pulled in time; this prompt needs {asked} more"
    )]
    Full { held: usize, bound: usize, asked: usize },
}

impl From<HoldRefused> for ApiError {
    fn from(e: HoldRefused) -> Self {
        match e {
            HoldRefused::Duplicate => {
                ApiError::new(StatusCode::CONFLICT, e.to_string()).kind("BadRequestError").no_code()
            }
            HoldRefused::Full { .. } => ApiError::unavailable(e.to_string()),
        }
    }
}

/// A prefill leg's claim on its key, from its start until its blocks are held (then the hold
/// owns the key) or it ends without a hold (then dropping it frees the key).
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) holds: Arc<Holds>,
    pub(crate) key: String,
    pub(crate) generation: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut table = lock(&self.holds.table);
        if table.entry(&self.key, self.generation).is_some_and(|e| e.held.is_none()) {
            table.remove(&self.key, Some(self.generation));
        }
    }
}

/// The prefills this engine holds for decode engines, and what its legs did.
#[derive(Debug, Default)]
pub struct Holds {
    pub(crate) table: Mutex<Table>,
    pub(crate) changed: tokio::sync::Notify,
    pub counts: HandoffCounts,
    /// This engine's inbound links (within its node, across nodes): pulls into it share them.
    pub(crate) links: Mutex<[Link; 2]>,
}

/// An inbound link that moves one pull at a time at its full bandwidth: a pull starts when
/// the ones before it are done, so concurrent pulls share the link's bytes per second (each
/// waits for those ahead, as a fair share would make the last one wait).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Link {
    pub(crate) busy_until: Option<tokio::time::Instant>,
}

impl Link {
    /// Books a transfer of `took` asked for at `now`: when it ends.
    pub(crate) fn book(
        &mut self,
        now: tokio::time::Instant,
        took: Duration,
    ) -> tokio::time::Instant {
        let start = self.busy_until.map_or(now, |b| b.max(now));
        let end = start + took;
        self.busy_until = Some(end);
        end
    }
}

/// What the engine's legs did since the start (`/stats`, `/metrics`).
#[derive(Debug, Default, Serialize)]
pub struct HandoffCounts {
    /// Prefills held for a decode engine, pulled by one, and freed unpulled at the lease's end.
    pub held: AtomicU64,
    pub pulled: AtomicU64,
    pub expired: AtomicU64,
    /// Decode legs whose KV came from a prefill engine, and the bytes pulled for them.
    pub received: AtomicU64,
    pub received_bytes: AtomicU64,
    /// Of those, the ones pulled from a prefill engine of another node.
    pub received_across_nodes: AtomicU64,
    /// Decode legs that could not pull (prefilled here instead).
    pub pull_failures: AtomicU64,
    /// Decode legs refused for naming a side channel that is no prefill peer.
    pub refused_peers: AtomicU64,
}

impl HandoffCounts {
    pub fn to_json(&self) -> Value {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({
            "held": n(&self.held), "pulled": n(&self.pulled), "expired": n(&self.expired),
            "received": n(&self.received), "received_bytes": n(&self.received_bytes),
            "received_across_nodes": n(&self.received_across_nodes),
            "pull_failures": n(&self.pull_failures),
            "refused_peers": n(&self.refused_peers),
        })
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Holds {
    /// Claims `key` for a prefill leg of `blocks` blocks: refused when another leg uses it,
    /// or when the holds waiting for their pull and this one would be more than `bound`
    /// blocks (legs still under way are the engine's ordinary load, bounded by its cache).
    pub(crate) fn reserve(
        self: &Arc<Self>,
        key: &str,
        blocks: usize,
        bound: usize,
    ) -> Result<Reservation, HoldRefused> {
        let mut table = lock(&self.table);
        if table.entries.contains_key(key) {
            return Err(HoldRefused::Duplicate);
        }
        if table.held_blocks + blocks > bound {
            return Err(HoldRefused::Full { held: table.held_blocks, bound, asked: blocks });
        }
        table.generations += 1;
        let generation = table.generations;
        table.entries.insert(key.to_owned(), Entry { blocks, generation, held: None });
        Ok(Reservation { holds: Arc::clone(self), key: key.to_owned(), generation })
    }

    /// Keys claimed or held, and the blocks held.
    pub fn claimed(&self) -> (usize, usize) {
        let table = lock(&self.table);
        (table.entries.len(), table.held_blocks)
    }

    /// Takes the hold under `key` (a decode engine pulled it); `None` while its leg runs.
    pub(crate) fn take(&self, key: &str) -> Option<Held> {
        let taken = {
            let mut table = lock(&self.table);
            table.entries.get(key)?.held.as_ref()?;
            table.remove(key, None)?.held
        };
        // Room for a prefill leg waiting on the bound.
        self.changed.notify_waiters();
        taken
    }

    /// [`Holds::reserve`], waiting up to `patience` while the bound is reached (as an engine
    /// whose cache is full makes a request wait): held blocks are pulled within moments in a
    /// healthy fleet, and each hold ends with its lease at the latest.
    pub(crate) async fn reserve_within(
        self: &Arc<Self>,
        key: &str,
        blocks: usize,
        bound: usize,
        patience: Duration,
    ) -> Result<Reservation, HoldRefused> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let changed = self.changed.notified();
            match self.reserve(key, blocks, bound) {
                Err(HoldRefused::Full { .. }) if tokio::time::Instant::now() < deadline => {
                    let _ = tokio::time::timeout_at(deadline, changed).await;
                }
                other => return other,
            }
        }
    }

    pub(crate) fn tokens(&self, key: &str) -> Option<usize> {
        lock(&self.table).entries.get(key)?.held.as_ref().map(|h| h.tokens)
    }

    /// Waits until `key` is held, at most `wait`; its prompt's tokens.
    pub(crate) async fn wait(&self, key: &str, wait: Duration) -> Option<usize> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let changed = self.changed.notified();
            if let Some(tokens) = self.tokens(key) {
                return Some(tokens);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.tokens(key);
            }
        }
    }
}

impl Holds {
    /// A prefill leg ended: its blocks are held under its key until pulled or the lease ends.
    pub(crate) fn hold(self: &Arc<Self>, engine: EngineHandle, claim: Reservation, held: Held) {
        {
            let mut table = lock(&self.table);
            let Some(entry) = table.entry(&claim.key, claim.generation) else { return };
            entry.held = Some(held);
            let blocks = entry.blocks;
            table.held_blocks += blocks;
        }
        self.counts.held.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_waiters();
        let holds = Arc::clone(self);
        let lease = engine.config.disagg.hold_timeout;
        let (key, generation) = (claim.key.clone(), claim.generation);
        // The key is held now: the claim ends without freeing it.
        drop(claim);
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            // The same use of the key only: a key pulled and used again keeps its new lease.
            let expired = lock(&holds.table).remove(&key, Some(generation));
            holds.changed.notify_waiters();
            if let Some(h) = expired.and_then(|e| e.held) {
                engine.release_held(&h.engine_id);
                holds.counts.expired.fetch_add(1, Ordering::Relaxed);
                let key = shown(&key);
                tracing::info!(%key, "a prefill's KV was not pulled within its lease: freed");
            }
        });
    }

    /// Relays a held leg's outputs; at its end its blocks are held under its claimed key (a
    /// leg that ends otherwise, cancelled or refused, frees the key).
    pub(crate) fn relay(
        self: &Arc<Self>,
        engine: EngineHandle,
        claim: Reservation,
        mut from: mpsc::UnboundedReceiver<Output>,
    ) -> mpsc::UnboundedReceiver<Output> {
        let (tx, rx) = mpsc::unbounded_channel();
        let holds = Arc::clone(self);
        tokio::spawn(async move {
            let mut claim = Some(claim);
            while let Some(output) = from.recv().await {
                if let Output::Finished { id, usage } = &output {
                    let held = Held { engine_id: id.clone(), tokens: usage.prompt_tokens };
                    if let Some(claim) = claim.take() {
                        holds.hold(engine.clone(), claim, held);
                    }
                }
                // The client may be gone: the hold stands all the same (the decode engine
                // may still pull it), until its lease ends.
                let _ = tx.send(output);
            }
        });
        rx
    }
}

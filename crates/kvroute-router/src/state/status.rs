//! What the router knows of one worker ([`WorkerStatus`]): its cache mode, parity,
//! connection and readiness per rank, and the part its event subscriptions write on every
//! batch without the registry's lock ([`Live`]). The registry that holds them is
//! `fleet.rs`'s.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvroute_core::WorkerId;
use kvroute_core::schedule::WorkerLoad;
use kvroute_wire::ConvertStats;
use serde::{Deserialize, Serialize};

use super::lock::lock;
use crate::check_status::CheckStatus;
use crate::config::WorkerSpec;

/// How the router knows a worker's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    /// From the KV events the engine publishes.
    Events,
    /// From its own routing decisions, for engines without events.
    Approximate,
}

impl CacheMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Events => "events",
            Self::Approximate => "approximate",
        }
    }
}

/// Whether a worker's KV events describe the blocks the front door hashes (the parity probe
/// at join: a known prompt sent to the worker, its announced blocks compared).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "cause")]
pub enum Parity {
    #[default]
    Unchecked,
    /// Not probed yet, and why: it is tried again after a backoff (its events trusted
    /// meanwhile).
    Retrying(String),
    Ok,
    /// Its events cannot be trusted: ignored, the worker routed approximately.
    Failed(String),
}

/// What the router knows of one worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerStatus {
    pub id: WorkerId,
    pub url: Option<String>,
    pub events: Option<String>,
    pub replay: Option<String>,
    pub metrics: Option<String>,
    pub mode: CacheMode,
    pub dp_size: u32,
    /// Per rank: ready to be routed to (see the module docs).
    pub ready: Vec<bool>,
    /// Per rank: is the event subscription connected, has its first replay caught up, and
    /// the last sequence number seen.
    pub connected: Vec<bool>,
    pub caught_up: Vec<bool>,
    pub last_seq: Vec<Option<u64>>,
    /// Per rank: blocks in the index and the last load report.
    pub tree_size: Vec<usize>,
    /// Per rank: blocks it keeps below its device, by tier (host, disk, external), by its
    /// events (filled in when read, like `tree_size`).
    pub lower_tier_blocks: Vec<[usize; 3]>,
    pub load: Vec<Option<WorkerLoad>>,
    /// What conversion did with the worker's event blocks (all ranks).
    pub conversion: ConvertStats,
    /// Known from configuration (false: it appeared through events).
    pub configured: bool,
    /// Its predictions against what it served: drift and silence (see [`crate::check_status`]).
    pub checks: CheckStatus,
    pub parity: Parity,
    /// Where its membership comes from (`config`, `api`, `dns`, `nats`, `kubernetes`, `file`;
    /// `events`: learned from its events).
    pub source: String,
    /// Leaving the fleet: no new decision; removed once its requests end.
    pub draining: bool,
    /// Why it is refused, never routed to: its engine's KV blocks are not the size the
    /// router reads them at (its load report or its events say so).
    pub refused: Option<String>,
    /// Its own `block_size`, when its spec names one.
    #[serde(skip)]
    pub(super) block_size: Option<u32>,
    /// Joined while the router runs with a front door that probes parity: ready only once
    /// its probe is made (passed, or failed and routed approximately).
    #[serde(skip)]
    pub(super) gate_on_parity: bool,
    /// Ranks with an event subscription of their own (the configured ones).
    #[serde(skip)]
    pub(super) subscribed: usize,
    /// What its subscriptions write per batch (`last_seq` and `conversion` are read from it).
    #[serde(skip)]
    pub(super) live: Arc<Live>,
}

/// The part of a worker's status its event subscriptions write on every batch, without the
/// registry's lock: atomics, and one mutex no other path takes while it is held.
#[derive(Debug, Default)]
pub(crate) struct Live {
    /// Its parity probe failed: its events are ignored (counted as rejected `parity`).
    pub(super) untrusted: AtomicBool,
    /// It left the fleet: what its subscription still applies is taken out again.
    pub(super) gone: AtomicBool,
    /// Per configured rank: the last sequence number seen, plus one (0: none yet).
    pub(super) last_seq: Box<[AtomicU64]>,
    /// What conversion did with its event blocks (all ranks).
    pub(super) conversion: Mutex<ConvertStats>,
}

impl Live {
    pub(super) fn new(ranks: usize) -> Self {
        Self { last_seq: (0..ranks).map(|_| AtomicU64::new(0)).collect(), ..Self::default() }
    }

    /// Batch `seq` of `rank` was handled.
    pub(super) fn seen(&self, rank: usize, seq: u64) {
        if let Some(last) = self.last_seq.get(rank) {
            last.store(seq.saturating_add(1), Ordering::Relaxed);
        }
    }

    pub(super) fn last_seq(&self, rank: usize) -> Option<u64> {
        let n = self.last_seq.get(rank)?.load(Ordering::Relaxed);
        n.checked_sub(1)
    }

    /// Adds what conversion did with one message of the worker's; the size of the first
    /// blocks of another size than the router's (the worker is then refused).
    pub(super) fn converted(&self, stats: &ConvertStats) -> Option<u32> {
        let mut total = lock(&self.conversion);
        let first = total.wrong_block_size == 0 && stats.wrong_block_size > 0;
        *total += *stats;
        first.then_some(stats.seen_block_size).flatten()
    }
}

impl WorkerStatus {
    pub(super) fn new(spec: &WorkerSpec, configured: bool) -> Self {
        let n = spec.dp_size as usize;
        let mode = match (&spec.events, configured) {
            (None, true) => CacheMode::Approximate,
            _ => CacheMode::Events,
        };
        let mut status = Self {
            id: spec.id,
            url: spec.url.clone(),
            events: spec.events.clone(),
            replay: spec.replay.clone(),
            metrics: spec.metrics.clone(),
            mode,
            dp_size: spec.dp_size,
            ready: vec![false; n],
            connected: vec![false; n],
            caught_up: vec![false; n],
            last_seq: vec![None; n],
            tree_size: vec![0; n],
            lower_tier_blocks: vec![[0; 3]; n],
            load: vec![None; n],
            conversion: ConvertStats::default(),
            configured,
            checks: CheckStatus::default(),
            parity: Parity::Unchecked,
            source: if configured { "config" } else { "events" }.to_owned(),
            draining: false,
            refused: None,
            block_size: spec.block_size,
            gate_on_parity: false,
            subscribed: if configured { n } else { 0 },
            live: Arc::new(Live::new(if configured { n } else { 0 })),
        };
        for rank in 0..n {
            status.ready[rank] = status.rank_ready(rank);
        }
        status
    }

    pub(super) fn follow_stream(&mut self, source: String) {
        self.events = Some(source);
        self.mode = CacheMode::Events;
        for rank in 0..self.ready.len() {
            self.ready[rank] = self.rank_ready(rank);
        }
    }

    pub(super) fn rank_ready(&self, rank: usize) -> bool {
        // Workers and ranks learned from events are as ready as what brought them.
        self.refused.is_none()
            && (rank >= self.subscribed
                || (self.stream_up(rank) && self.load_in(rank) && self.probed()))
    }

    /// Its engine runs blocks of `engine` tokens, the router `router` (unless the worker's
    /// own `block_size` says otherwise): refused when they differ. Whether that is new.
    pub(super) fn engine_block_size(&mut self, engine: u32, router: u32) -> bool {
        let expected = self.block_size.unwrap_or(router);
        if engine == expected || self.refused.is_some() {
            return false;
        }
        let own = match self.block_size {
            Some(_) => format!(" (its block_size={expected})"),
            None => String::new(),
        };
        let why = format!(
            "its engine runs KV blocks of {engine} tokens, kvroute reads them as {expected}{own}: \
             start kvroute with --block-size {engine}, or without --block-size to take the \
             engines' size"
        );
        tracing::error!(worker = %self.id, engine_block_size = engine, router_block_size = expected, "worker refused: {why}");
        self.refused = Some(why);
        true
    }

    /// Its parity probe made, when it must wait for one.
    pub(super) fn probed(&self) -> bool {
        !self.gate_on_parity
            || self.events.is_none()
            || matches!(self.parity, Parity::Ok | Parity::Failed(_))
    }

    /// Its event stream (if it has one) connected and caught up at `rank`.
    pub(super) fn stream_up(&self, rank: usize) -> bool {
        self.events.is_none()
            || (self.connected.get(rank) == Some(&true) && self.caught_up.get(rank) == Some(&true))
    }

    /// Its first load report (if it sends any) in at `rank`.
    pub(super) fn load_in(&self, rank: usize) -> bool {
        self.metrics.is_none() || self.load.get(rank).is_some_and(Option::is_some)
    }

    /// What `rank` still waits for before it is ready: its event stream, its first load
    /// report, its parity probe (with the cause when the probe could not be made yet).
    pub fn waiting_for(&self, rank: usize) -> Vec<String> {
        let mut missing = Vec::new();
        if let Some(why) = &self.refused {
            missing.push(format!("nothing: it is refused ({why})"));
        }
        if !self.stream_up(rank) {
            missing.push("its event stream".to_owned());
        }
        if !self.load_in(rank) {
            missing.push("its first load report".to_owned());
        }
        match &self.parity {
            Parity::Retrying(cause) => missing.push(format!("its parity probe ({cause})")),
            Parity::Unchecked if self.events.is_some() => {
                missing.push("its parity probe".to_owned());
            }
            _ => {}
        }
        missing
    }

    pub(super) fn grow(&mut self, n: usize) {
        if n <= self.connected.len() {
            return;
        }
        self.dp_size = n as u32;
        self.connected.resize(n, false);
        self.caught_up.resize(n, false);
        self.last_seq.resize(n, None);
        self.tree_size.resize(n, 0);
        self.lower_tier_blocks.resize(n, [0; 3]);
        self.load.resize(n, None);
        self.ready.resize(n, true);
    }
}

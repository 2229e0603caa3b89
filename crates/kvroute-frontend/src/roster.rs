//! The workers the front door speaks to ([`Workers`]): each one's URL, dialect, ranks, role
//! and token, rebuilt as a whole whenever the fleet's membership changes (the embedded
//! router's roster, `kvroute_router::members`) and read as one snapshot by each request.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_core::schedule::Role;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::HttpClient;
use kvroute_router::{Dialect, WorkerSpec};

/// One snapshot of the workers (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Workers {
    pub(crate) urls: BTreeMap<WorkerId, String>,
    /// The workers with KV events (parity-probed when they join or restart).
    pub(crate) evented: BTreeSet<WorkerId>,
    /// How each worker is spoken to (absent: the client's OpenAI body).
    pub(crate) dialects: BTreeMap<WorkerId, Dialect>,
    /// Each worker's data-parallel ranks (all are excluded when it is ejected).
    pub(crate) ranks: BTreeMap<WorkerId, u32>,
    /// Each SGLang prefill worker's bootstrap host and port.
    pub(crate) bootstraps: BTreeMap<WorkerId, (String, u16)>,
    /// Some worker is a prefill worker: with a remote router, requests are placed in pairs.
    pub(crate) prefill_workers: bool,
    /// The client, with each worker's own token for its origin.
    pub(crate) client: HttpClient,
    /// Workers leaving the fleet: spoken to for what they run, never offered anything new
    /// (not a fallback, not a request in turn).
    pub(crate) draining: BTreeSet<WorkerId>,
}

impl Workers {
    /// The snapshot of `workers`, their requests sent by `base` (its connections shared).
    pub(crate) fn new(workers: &[WorkerSpec], base: &HttpClient) -> Self {
        let client = workers.iter().fold(base.clone(), |client, w| match (&w.url, &w.api_key) {
            (Some(url), Some(key)) => client.with_bearer_for(url, &key.0),
            _ => client,
        });
        Self {
            urls: workers
                .iter()
                .filter_map(|w| w.url.as_ref().map(|u| (w.id, u.trim_end_matches('/').to_owned())))
                .collect(),
            evented: workers.iter().filter(|w| w.events.is_some()).map(|w| w.id).collect(),
            dialects: workers.iter().map(|w| (w.id, w.dialect)).collect(),
            ranks: workers.iter().map(|w| (w.id, w.dp_size)).collect(),
            bootstraps: workers.iter().filter_map(bootstrap).collect(),
            prefill_workers: workers.iter().any(|w| w.role == Role::Prefill),
            client,
            draining: BTreeSet::new(),
        }
    }

    /// How a worker is spoken to.
    pub(crate) fn dialect(&self, worker: WorkerId) -> Dialect {
        self.dialects.get(&worker).copied().unwrap_or_default()
    }

    /// A prefill worker's SGLang bootstrap host and port.
    pub(crate) fn bootstrap(&self, worker: WorkerId) -> Option<(String, u16)> {
        self.bootstraps.get(&worker).cloned()
    }

    /// The tokens dialects some worker speaks (a request is made a body in each).
    pub(crate) fn tokens_dialects(&self) -> Vec<Dialect> {
        let mut dialects: Vec<Dialect> =
            self.dialects.values().copied().filter(|d| d.sends_tokens()).collect();
        dialects.sort_unstable_by_key(|d| *d as u8);
        dialects.dedup();
        dialects
    }

    /// Every rank of `worker`.
    pub(crate) fn all_ranks(
        &self,
        worker: WorkerId,
    ) -> impl Iterator<Item = WorkerWithDpRank> + use<> {
        let n = self.ranks.get(&worker).copied().unwrap_or(1);
        (0..n).map(move |r| WorkerWithDpRank::new(worker, r))
    }

    /// A worker's base URL.
    pub(crate) fn url(&self, worker: WorkerId) -> Option<&str> {
        self.urls.get(&worker).map(String::as_str)
    }

    /// Workers with a URL and events: the ones a parity probe is made for.
    pub(crate) fn probed(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.urls.keys().copied().filter(|w| self.evented.contains(w))
    }
}

/// A prefill worker's bootstrap host (its URL's) and port, when it has one.
fn bootstrap(w: &WorkerSpec) -> Option<(WorkerId, (String, u16))> {
    let url: hyper::Uri = w.url.as_deref()?.parse().ok()?;
    let host = url.host()?.trim_start_matches('[').trim_end_matches(']').to_owned();
    Some((w.id, (host, w.bootstrap_port?)))
}

//! The picker: the front door's stages, the pool's endpoints (resolved, narrowed by the
//! endpoints file), its options and metrics.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_core::WorkerId;
use kvroute_frontend::{Decider, FrontendState};

use crate::budget::Budget;
use crate::endpoints::{Endpoints, parse_endpoints};
use crate::metrics;

/// The picker's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EppOptions {
    /// Fallback endpoints listed after the one picked (the gateway tries them in order when
    /// it cannot reach the first).
    pub fallbacks: usize,
    /// Largest request body read (a larger one is a 413).
    pub max_body_bytes: usize,
    /// A request's headers and whole body must come within this of its stream's opening (a
    /// 408 otherwise), as at the front door's listener.
    pub body_timeout: Duration,
    /// A placed request whose answer is not streamed must see its response begin within
    /// this (a streamed one within the front door's first-byte timeout), or its placement is
    /// freed and the stream ended with `DEADLINE_EXCEEDED`.
    pub response_timeout: Duration,
    /// Request body bytes held at once, all streams together (past it, a 503 to retry).
    pub max_body_bytes_in_flight: usize,
    /// Request body bytes one client holds at once ([`crate::budget`] says who a client is).
    pub max_body_bytes_per_client: usize,
    /// Largest gRPC message decoded: a full-duplex body chunk (Envoy's are at most its
    /// buffer, 1 MiB by default) or a whole buffered body, with its headers. A message is
    /// held whole before the picker sees it, so this bounds what one stream holds unseen;
    /// buffered bodies past it need `FULL_DUPLEX_STREAMED`, which the protocol asks for.
    pub max_message_bytes: usize,
    /// Also return the candidates' scores as llm-d's picker does with
    /// `--emit-endpoint-scores`: under `x-gateway-destination-endpoint-scores` in the
    /// `envoy.lb` dynamic metadata, a struct of endpoint (`ip:port`) to score, higher better.
    pub endpoint_scores: bool,
}

impl Default for EppOptions {
    fn default() -> Self {
        let listener = kvroute_http::server::ServeOptions::default();
        Self {
            fallbacks: 2,
            endpoint_scores: false,
            max_body_bytes: kvroute_frontend::BODY_LIMIT,
            body_timeout: listener.body_timeout,
            response_timeout: kvroute_frontend::RESPONSE_TIMEOUT,
            max_body_bytes_in_flight: listener.max_body_bytes_in_flight,
            max_body_bytes_per_client: listener.max_body_bytes_per_client,
            max_message_bytes: 4 << 20,
        }
    }
}

/// The picker: the front door's stages, the pool's endpoints and the picker's metrics.
#[derive(Debug)]
pub struct Picker {
    pub front: Arc<FrontendState>,
    /// The pool's endpoints, swapped whole when their names resolve anew.
    endpoints: std::sync::RwLock<Arc<Endpoints>>,
    pub options: EppOptions,
    pub metrics: metrics::EppMetrics,
    /// Where the next request without a prompt (a `GET`, another route) goes, in turn.
    turn: AtomicUsize,
    /// The workers the endpoints file lists (absent: every worker), [`Picker::watch`].
    members: std::sync::RwLock<Option<BTreeSet<WorkerId>>>,
    /// Request body bytes the streams hold.
    pub budget: Arc<Budget>,
    /// The token a gateway must send in its gRPC metadata (none: any gateway).
    token: Option<kvroute_http::Credentials>,
    /// The endpoints file's own workers: each `ip:port` it lists that is no worker of another
    /// source is written here, and the router's listed source joins it through the template
    /// ([`Picker::add_listed`]); it leaves with its line.
    joins: std::sync::OnceLock<kvroute_router::members::Listing>,
    /// The endpoints the file lists now (the pool narrowed to them, again as workers change).
    listed: std::sync::RwLock<Option<Vec<String>>>,
}

impl Picker {
    pub fn new(front: Arc<FrontendState>, options: EppOptions) -> Self {
        let endpoints = std::sync::RwLock::new(Arc::new(Endpoints::of(&front)));
        let metrics = metrics::EppMetrics::new();
        let members = std::sync::RwLock::new(None);
        let budget =
            Budget::new(options.max_body_bytes_in_flight, options.max_body_bytes_per_client);
        let turn = AtomicUsize::new(0);
        Self {
            front,
            endpoints,
            options,
            metrics,
            turn,
            members,
            budget,
            token: None,
            joins: std::sync::OnceLock::new(),
            listed: std::sync::RwLock::new(None),
        }
    }

    /// Streams must carry `token` in their gRPC metadata (`authorization: Bearer <token>`,
    /// as Envoy's `grpc_service.initial_metadata` sends it).
    #[must_use]
    pub fn with_token(mut self, token: kvroute_http::Credentials) -> Self {
        self.token = Some(token).filter(|t| !t.is_empty());
        self
    }

    /// Whether a stream's gRPC metadata carries the token (always, when none is set).
    pub fn admits(&self, metadata: &tonic::metadata::MetadataMap) -> bool {
        let Some(token) = &self.token else { return true };
        let value = metadata.get("authorization").map(|v| v.as_bytes());
        value.and_then(kvroute_http::auth::bearer_token).is_some_and(|t| token.accepts(t))
    }

    /// The pool's endpoints as they stand.
    pub fn endpoints(&self) -> Arc<Endpoints> {
        Arc::clone(&self.endpoints.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Resolves the workers' host names to the addresses the gateway names them by (an
    /// original-destination cluster routes to `ip:port`), now, every `every` and whenever the
    /// fleet's membership changes, until the picker is dropped. Workers named by address need
    /// none of it. A worker that joined is an endpoint from then on; one that left is not.
    pub fn spawn_resolver(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let mut changes = self.front.watch_workers();
        tokio::spawn(async move {
            while let Some(picker) = weak.upgrade() {
                let now = Endpoints::of(&picker.front).keeping(&picker.endpoints());
                picker.set_endpoints(now);
                let resolved = picker.endpoints().resolved().await;
                picker.set_endpoints(resolved);
                drop(picker);
                let _ = tokio::time::timeout(every, changes.changed()).await;
            }
        })
    }

    fn set_endpoints(&self, endpoints: Endpoints) {
        *self.endpoints.write().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Arc::new(endpoints);
        let listed = self.listed.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(listed) = listed {
            // The pool narrowed again: a worker that joined since is among its endpoints.
            self.set_members(&listed);
        }
    }

    /// From now on, each `ip:port` the endpoints file lists that is no worker of another
    /// source joins as a worker described by `template` (the address as `{host}`, the port
    /// as `{port}`), source `file`; one whose line goes drains. Needs the embedded router:
    /// `false` (nothing changes) with a remote one, or when set before.
    pub fn add_listed(
        &self,
        template: kvroute_router::members::Template,
        drain_timeout: std::time::Duration,
    ) -> bool {
        let Decider::Embedded(router) = &self.front.decider else { return false };
        let (source, listing) = kvroute_router::members::listed(template);
        if self.joins.set(listing).is_err() {
            return false;
        }
        kvroute_router::members::spawn_source(router, Box::new(source), drain_timeout);
        true
    }

    /// Writes to the listed source what the file lists that no worker of another source
    /// answers to (by the addresses its names resolved to).
    fn offer_listed(&self, listed: &[String]) {
        let Some(listing) = self.joins.get() else { return };
        let Decider::Embedded(router) = &self.front.decider else { return };
        let endpoints = self.endpoints();
        let view = router.view();
        let theirs = |endpoint: &String| {
            let workers = endpoints.allowed(std::slice::from_ref(endpoint));
            workers.iter().any(|w| view.member(*w).is_some_and(|m| m.source != "file"))
        };
        let addresses = listed.iter().filter(|e| !theirs(e)).filter_map(|e| e.parse().ok());
        listing.set(addresses.collect());
    }

    /// The workers a request may go to: those of its subset hint (absent: all) that the
    /// endpoints file lists (absent: all).
    pub(crate) fn eligible(
        &self,
        subset: Option<BTreeSet<WorkerId>>,
    ) -> Option<BTreeSet<WorkerId>> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        match (subset, members.as_ref()) {
            (s, None) => s,
            (None, Some(m)) => Some(m.clone()),
            (Some(s), Some(m)) => Some(s.intersection(m).copied().collect()),
        }
    }

    /// Takes the pool's endpoints (`host:port` as the gateway names them): later requests
    /// go only to the workers among them. Returns those that name no worker of the fleet.
    pub fn set_members(&self, listed: &[String]) -> Vec<String> {
        let endpoints = self.endpoints();
        let members = endpoints.allowed(listed);
        let unknown =
            listed.iter().filter(|e| endpoints.allowed(std::slice::from_ref(e)).is_empty());
        let unknown: Vec<String> = unknown.cloned().collect();
        *self.members.write().unwrap_or_else(|e| e.into_inner()) = Some(members);
        unknown
    }

    /// Rereads `path` every `every` and takes its endpoints when its text changed (one
    /// `host:port` per line, `#` comments), until the picker is dropped. A file that cannot
    /// be read leaves the pool as it was (a ConfigMap's file is swapped, never half written).
    pub fn watch(
        self: &Arc<Self>,
        path: std::path::PathBuf,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut seen: Option<String> = None;
            while let Some(picker) = weak.upgrade() {
                match tokio::fs::read_to_string(&path).await {
                    Ok(text) if seen.as_deref() != Some(text.as_str()) => {
                        picker.reread(&path, &text);
                        seen = Some(text);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let path = path.display();
                        tracing::warn!(%path, error = %e, "endpoints file unreadable: pool kept");
                    }
                }
                drop(picker);
                tokio::time::sleep(every).await;
            }
        })
    }

    fn reread(&self, path: &std::path::Path, text: &str) {
        let listed = parse_endpoints(text);
        *self.listed.write().unwrap_or_else(|e| e.into_inner()) = Some(listed.clone());
        self.offer_listed(&listed);
        let unknown = self.set_members(&listed);
        tracing::info!(path = %path.display(), endpoints = listed.len(), "pool endpoints read");
        if !unknown.is_empty() {
            tracing::warn!(?unknown, "pool endpoints that are no worker of the fleet (--worker)");
        }
    }

    /// The next worker in turn among `allowed` that is in rotation.
    pub(crate) fn in_turn(&self, allowed: Option<&BTreeSet<WorkerId>>) -> Option<WorkerId> {
        let listed: BTreeSet<WorkerId> = self.endpoints().workers().collect();
        let ready: Vec<WorkerId> =
            self.front.in_rotation(allowed).into_iter().filter(|w| listed.contains(w)).collect();
        let n = ready.len();
        (n > 0).then(|| ready[self.turn.fetch_add(1, Ordering::Relaxed) % n])
    }
}

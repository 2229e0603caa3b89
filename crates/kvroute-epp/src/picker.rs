//! The picker: the front door's stages, the pool's endpoints (resolved, narrowed by the
//! endpoints file), its options and metrics.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_core::WorkerId;
use kvroute_frontend::FrontendState;

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
}

impl Default for EppOptions {
    fn default() -> Self {
        Self { fallbacks: 2, max_body_bytes: kvroute_frontend::BODY_LIMIT }
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
}

impl Picker {
    pub fn new(front: Arc<FrontendState>, options: EppOptions) -> Self {
        let endpoints = std::sync::RwLock::new(Arc::new(Endpoints::of(&front)));
        let metrics = metrics::EppMetrics::new();
        let members = std::sync::RwLock::new(None);
        Self { front, endpoints, options, metrics, turn: AtomicUsize::new(0), members }
    }

    /// The pool's endpoints as they stand.
    pub fn endpoints(&self) -> Arc<Endpoints> {
        Arc::clone(&self.endpoints.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Resolves the workers' host names to the addresses the gateway names them by (an
    /// original-destination cluster routes to `ip:port`), now and every `every` until the
    /// picker is dropped. Workers named by address need none of it.
    pub fn spawn_resolver(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(picker) = weak.upgrade() {
                let resolved = picker.endpoints().resolved().await;
                *picker.endpoints.write().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Arc::new(resolved);
                drop(picker);
                tokio::time::sleep(every).await;
            }
        })
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
        let unknown = self.set_members(&listed);
        tracing::info!(path = %path.display(), endpoints = listed.len(), "pool endpoints read");
        if !unknown.is_empty() {
            tracing::warn!(?unknown, "pool endpoints that are no worker of the fleet (--worker)");
        }
    }

    /// The next worker in turn among `allowed` that is in rotation.
    pub(crate) fn in_turn(&self, allowed: Option<&BTreeSet<WorkerId>>) -> Option<WorkerId> {
        let ready: Vec<WorkerId> = self
            .endpoints()
            .workers()
            .filter(|w| allowed.is_none_or(|a| a.contains(w)) && self.front.in_rotation(*w))
            .collect();
        let n = ready.len();
        (n > 0).then(|| ready[self.turn.fetch_add(1, Ordering::Relaxed) % n])
    }
}

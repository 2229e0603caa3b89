//! [`FrontendState`]: what the front door holds (its model, router, workers, health, keys)
//! and the decisions that read it.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use kvroute_core::{BlockSize, WorkerId};
use kvroute_http::auth::KeyId;
use kvroute_http::metrics::Registry;
use kvroute_http::models::Catalog;
use kvroute_http::{Credentials, HttpClient};
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::Fetcher;
use kvroute_router::{RouterState, WorkerSpec};

use crate::adapters::ListedAdapters;
use crate::decider::{Decider, RemoteRouter};
use crate::health;
use crate::metrics::Metrics;
use crate::options::{FrontDoorOptions, namespaced_session};
use crate::parity_probes::ParityProbes;
use crate::roster::Workers;

use health::{Failure, Health};

pub struct FrontendState {
    pub preprocessor: Arc<Preprocessor>,
    pub fetcher: Fetcher,
    pub decider: Decider,
    pub(crate) block_size: BlockSize,
    /// The workers spoken to now, replaced as a whole when the membership changes.
    workers: RwLock<Arc<Workers>>,
    pub health: Health,
    /// What the settings chose ([`FrontendState::with_options`]).
    pub(crate) options: FrontDoorOptions,
    /// The client every worker's client shares its connections with.
    base_client: HttpClient,
    /// Counts the membership's changes, for who follows them (the picker's endpoints).
    changes: tokio::sync::watch::Sender<u64>,
    pub(crate) next_id: AtomicU64,
    pub(crate) metrics: Metrics,
    pub(crate) api_keys: Credentials,
    pub(crate) admin: Credentials,
    /// The parity probes' bookkeeping ([`crate::probes`]).
    pub(crate) parity: ParityProbes,
    /// Prompt plus output tokens at most (checked before routing, as vLLM checks it).
    pub(crate) max_model_len: u64,
    /// The base model and the adapters the fleet serves ([`crate::models`]).
    pub models: Catalog,
    /// The adapters the settings name and what each worker listed in its `/v1/models`.
    pub(crate) adapters: ListedAdapters,
    /// Mixed into SGLang bootstrap rooms, so two front doors draw different ones.
    pub(crate) room_salt: u64,
    /// What the status page's chart draws ([`FrontendState::spawn_history`]).
    pub(crate) history: Arc<kvroute_http::status::History>,
    /// Metrics of a service beside the front door (the ext_proc picker), on its `/metrics`.
    pub(crate) beside: std::sync::OnceLock<Arc<Registry>>,
    /// The priority of each model's requests that name none (by the model's name as the
    /// catalog resolves it: an adapter's, or the base model's), as GIE's `InferenceObjective`.
    pub(crate) model_priorities: BTreeMap<String, i32>,
}

impl std::fmt::Debug for FrontendState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontendState").field("urls", &self.workers().urls).finish_non_exhaustive()
    }
}

impl FrontendState {
    /// A front door over the embedded `router`, proxying to its workers that have a URL.
    pub fn new(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        router: Arc<RouterState>,
    ) -> Self {
        let (block_size, workers) = (router.config.block_size, router.config.workers.clone());
        Self::with(preprocessor, fetcher, Decider::Embedded(router), block_size, &workers)
    }

    /// A front door asking the `kvroute router` at `router_url`, proxying to `workers`.
    pub fn remote(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        router_url: &str,
        router_token: Option<&str>,
        workers: &[WorkerSpec],
        block_size: BlockSize,
    ) -> Self {
        let decider = Decider::Remote(RemoteRouter::new(router_url, router_token));
        Self::with(preprocessor, fetcher, decider, block_size, workers)
    }

    pub(crate) fn with(
        preprocessor: Arc<Preprocessor>,
        fetcher: Fetcher,
        decider: Decider,
        block_size: BlockSize,
        workers: &[WorkerSpec],
    ) -> Self {
        let max_model_len =
            preprocessor.max_model_len().unwrap_or(kvroute_http::openai::DEFAULT_MAX_MODEL_LEN);
        let base_client = HttpClient::new();
        let roster = Workers::new(workers, &base_client);
        Self {
            fetcher,
            decider,
            block_size,
            health: Health::new(roster.urls.keys().copied()),
            parity: ParityProbes::new(roster.probed()),
            workers: RwLock::new(Arc::new(roster)),
            options: FrontDoorOptions::default(),
            base_client,
            changes: tokio::sync::watch::Sender::new(0),
            next_id: AtomicU64::new(0),
            metrics: Metrics::new(),
            api_keys: Credentials::default(),
            admin: Credentials::default(),
            max_model_len,
            models: Catalog::new(preprocessor.model_name(), Some(max_model_len)),
            adapters: ListedAdapters::default(),
            room_salt: std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                0u8,
            ),
            history: Arc::default(),
            beside: std::sync::OnceLock::new(),
            model_priorities: BTreeMap::new(),
            preprocessor,
        }
    }

    /// Serves these LoRA adapters over the base model (besides those the workers list).
    /// `NAME` or `NAME=PATH` each (the path is what `load_adapters` sends vLLM).
    pub fn with_adapters<'a>(
        mut self,
        adapters: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, kvroute_http::models::AdapterError> {
        for spec in adapters {
            let (name, path) = match spec.split_once('=') {
                Some((name, path)) => (name.trim(), Some(path.trim().to_owned())),
                None => (spec.trim(), None),
            };
            self.models.insert(name, path.as_deref())?;
            self.adapters.configure(name, path);
        }
        Ok(self)
    }

    /// The longest prompt plus output accepted (default: the model's context length, else
    /// [`kvroute_http::openai::DEFAULT_MAX_MODEL_LEN`]).
    #[must_use]
    pub fn max_model_len(mut self, max_model_len: u64) -> Self {
        self.max_model_len = max_model_len;
        let adapters = self.models.adapters();
        self.models = Catalog::new(self.preprocessor.model_name(), Some(max_model_len));
        for name in adapters {
            let _ = self.models.insert(&name, None);
        }
        self
    }

    /// The OpenAI routes need one of `api_keys`, `/metrics` the `admin` token (each open when
    /// empty); `/health` is always open.
    #[must_use]
    pub fn guarded(mut self, api_keys: Credentials, admin: Credentials) -> Self {
        self.api_keys = api_keys;
        self.admin = admin;
        self
    }

    /// The cache namespace of a request: the client's `cache_salt`, inside its key's when
    /// namespaces are per key (`key-<id>:<salt>`: vLLM 0.33 refuses `/` and `@` in a salt).
    pub(crate) fn namespace(&self, key: Option<&KeyId>, client: Option<&str>) -> Option<String> {
        let client = client.filter(|c| !c.is_empty());
        match (self.options.namespace_per_key, key) {
            (true, Some(KeyId { id: key, .. })) => Some(match client {
                Some(c) => format!("key-{key}:{c}"),
                None => format!("key-{key}"),
            }),
            _ => client.map(str::to_owned),
        }
    }

    /// A request's session as the router keys it: with namespacing per key, inside the key's
    /// namespace (the key's id and the client's session, hashed to a fixed length), so that
    /// another key's requests naming the same session do not join it.
    pub(crate) fn session_key(
        &self,
        key: Option<&KeyId>,
        session: Option<String>,
    ) -> Option<String> {
        namespaced_session(self.options.namespace_per_key, key, session)
    }

    /// The workers spoken to now (one snapshot: read it once per decision).
    pub(crate) fn workers(&self) -> Arc<Workers> {
        Arc::clone(&self.workers.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// The membership changed: `workers` (draining ones included, until they leave) are the
    /// ones spoken to from now on. A newcomer is in the health checks and, with events, due
    /// for its parity probe; one gone leaves both.
    pub fn set_workers(
        &self,
        workers: &[WorkerSpec],
        draining: std::collections::BTreeSet<WorkerId>,
    ) -> Vec<WorkerId> {
        let mut joined = Vec::new();
        let roster = Arc::new(Workers { draining, ..Workers::new(workers, &self.base_client) });
        let old = std::mem::replace(
            &mut *self.workers.write().unwrap_or_else(PoisonError::into_inner),
            Arc::clone(&roster),
        );
        for &gone in old.urls.keys().filter(|w| !roster.urls.contains_key(w)) {
            self.health.remove(gone);
            self.parity.forget(gone);
            self.adapters.forget(gone);
        }
        for &new in roster.urls.keys().filter(|w| !old.urls.contains_key(w)) {
            self.health.add(new);
            if roster.evented.contains(&new) {
                self.parity.again(new);
                joined.push(new);
            }
        }
        self.changes.send_modify(|n| *n += 1);
        joined
    }

    /// Sees each change of the workers spoken to ([`Self::set_workers`]).
    pub fn watch_workers(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Follows the embedded router's membership until the front door is dropped: each change
    /// becomes the workers spoken to, and a newcomer's parity probe is made at once (not at
    /// the next health tick). Nothing to follow with a remote router.
    pub fn spawn_follow(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let roster = match &self.decider {
            Decider::Embedded(router) => Some(router.view().follow_members()),
            Decider::Remote(_) => None,
        };
        tokio::spawn(async move {
            let Some(mut roster) = roster else { return };
            while roster.changed().await.is_ok() {
                let members = roster.borrow_and_update().clone();
                let Some(state) = weak.upgrade() else { return };
                let specs: Vec<WorkerSpec> = members.iter().map(|m| m.spec.clone()).collect();
                let draining = members.iter().filter(|m| m.draining).map(|m| m.spec.id).collect();
                for worker in state.set_workers(&specs, draining) {
                    if state.options.parity_probe {
                        let state = Arc::clone(&state);
                        tokio::spawn(async move { state.probe_joined(worker).await });
                    }
                }
            }
        })
    }

    /// A worker failed a request: out of rotation for a while; a refused connection also
    /// means its cache is gone.
    pub(crate) fn worker_failed(&self, worker: WorkerId, why: Failure) {
        let was_ejected = self.health.is_ejected(worker);
        let backoff = self.health.failed(worker, why, Instant::now());
        if was_ejected {
            tracing::debug!(%worker, ?why, backoff_secs = backoff.as_secs_f64(), "still failing");
        } else {
            self.metrics.ejections.inc();
            tracing::warn!(%worker, ?why, backoff_secs = backoff.as_secs_f64(), "worker ejected");
        }
        if why == Failure::Connect {
            self.decider.forget_blocks(worker);
            self.adapters.forget(worker);
            // Whatever comes back on its port is probed again.
            if self.workers().evented.contains(&worker) {
                self.parity.again(worker);
            }
        }
    }

    /// Every one of `options`.
    #[must_use]
    pub fn with_options(mut self, options: FrontDoorOptions) -> Self {
        self.options = options;
        if let (true, Decider::Embedded(router)) = (self.options.parity_probe, &self.decider) {
            // Workers joining later wait for their probe before they are candidates.
            router.probe_joiners();
        }
        self
    }

    /// Each model's priority for its requests that name none (`--model-priority`).
    #[must_use]
    pub fn with_model_priorities(mut self, priorities: BTreeMap<String, i32>) -> Self {
        self.model_priorities = priorities;
        self
    }

    /// The configured priority of a request's model: its adapter's, else the base model's.
    pub(crate) fn model_priority(&self, adapter: Option<&str>) -> Option<i32> {
        let name = adapter.unwrap_or_else(|| self.preprocessor.model_name());
        self.model_priorities.get(name).copied()
    }

    /// Samples the counters the status page draws every `status_every` until the front door
    /// is dropped: the router's (embedded; a remote router's page has its own history).
    pub fn spawn_history(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        self.history.spawn(self.options.status_every, move || {
            let state = weak.upgrade()?;
            Some(match state.decider.registry() {
                Some(r) => kvroute_http::status::Counters::read(&[&state.metrics.registry, r]),
                None => kvroute_http::status::Counters::read(&[&state.metrics.registry]),
            })
        })
    }

    /// Serves `registry` on `/metrics` beside the front door's and the router's (once).
    pub fn serve_metrics_beside(&self, registry: Arc<Registry>) {
        let _ = self.beside.set(registry);
    }

    /// Requests routed and not yet ended.
    pub fn in_flight(&self) -> i64 {
        self.metrics.in_flight.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// #51 finding 12: with namespacing per key, two keys naming the same session are two
    /// sessions (and one key's is stable); without it, or without a key, the session is the
    /// client's.
    #[test]
    fn sessions_are_namespaced_per_key() {
        let (a, b) = (KeyId::named("aaaa"), KeyId::named("bbbb"));
        let s = || Some("s1".to_owned());
        let of_a = namespaced_session(true, Some(&a), s());
        assert_ne!(of_a, namespaced_session(true, Some(&b), s()));
        assert_eq!(of_a, namespaced_session(true, Some(&a), s()));
        assert_ne!(of_a, s());
        assert!(of_a.unwrap().len() <= kvroute_http::router_api::MAX_SESSION_KEY);
        assert_eq!(namespaced_session(false, Some(&a), s()), s());
        assert_eq!(namespaced_session(true, None, s()), s());
        assert_eq!(namespaced_session(true, Some(&a), None), None);
    }
}

//! The models the fleet serves: the base model, the adapters the settings name, and those
//! the workers list in their `GET /v1/models` (vLLM lists each adapter with its base model
//! as `parent`). Each worker's list is read at the first health tick and every
//! [`MODELS_EVERY`] ticks after; what it lists becomes the router's knowledge of which
//! adapters it serves, and the fleet's catalog is the settings' adapters and every listed one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kvroute_core::WorkerId;
use kvroute_http::openai::ModelList;

use crate::{FrontendState, PROBE_TIMEOUT};

/// Health ticks between two readings of the workers' model lists.
pub(crate) const MODELS_EVERY: u64 = 10;

impl FrontendState {
    /// Reads every worker's model list; a worker that does not answer keeps what it listed
    /// last (unknown at first: taken to serve any adapter).
    pub async fn discover_models(self: &Arc<Self>) {
        let workers = self.workers();
        let reads = workers.urls.iter().map(|(&worker, base)| {
            let state = Arc::clone(self);
            let url = format!("{base}{}", kvroute_http::paths::MODELS);
            async move { (worker, state.adapters_listed(&url).await) }
        });
        let listed = futures_util::future::join_all(reads).await;
        for (worker, adapters) in listed {
            let Some(adapters) = adapters else { continue };
            // Loading adapters on demand, any worker can serve any of them.
            let served = (!self.options.load_adapters).then(|| adapters.clone());
            for rank in self.all_ranks(worker) {
                self.placer.set_served_adapters(rank, served.clone());
            }
            if let Ok(mut known) = self.listed.lock() {
                known.insert(worker, adapters);
            }
        }
        self.refresh_catalog();
    }

    /// The adapters one worker lists over the base model; `None` when it did not answer.
    async fn adapters_listed(&self, url: &str) -> Option<BTreeSet<String>> {
        let client = self.client();
        let read = tokio::time::timeout(PROBE_TIMEOUT, client.get_json::<ModelList>(url));
        let list = read.await.ok()?.ok()?;
        Some(list.adapters_of(self.models.base()).into_iter().collect())
    }

    /// The catalog: the configured adapters and every one a worker lists now.
    fn refresh_catalog(&self) {
        let Ok(listed) = self.listed.lock() else { return };
        let configured = self.configured_adapters.iter().map(|(name, _)| name);
        let now: BTreeSet<&String> = listed.values().flatten().chain(configured).collect();
        for name in self.models.adapters() {
            if !now.contains(&name) {
                self.models.remove(&name);
            }
        }
        for name in now {
            if let Err(e) = self.models.insert(name, None) {
                tracing::debug!(adapter = %name, error = %e, "adapter not listed");
            }
        }
    }

    /// With `load_adapters`: makes sure `worker` (at `base`) serves `adapter`, loading it
    /// through vLLM's `/v1/load_lora_adapter` when its last list did not name it (the path is
    /// the settings', else the name). Whether it serves it now.
    pub(crate) async fn ensure_adapter(&self, worker: WorkerId, base: &str, adapter: &str) -> bool {
        if !self.options.load_adapters {
            return true;
        }
        let lists = |l: &BTreeMap<WorkerId, BTreeSet<String>>| {
            l.get(&worker).is_none_or(|served| served.contains(adapter))
        };
        if self.listed.lock().map_or(true, |l| lists(&l)) {
            return true;
        }
        let path = self
            .configured_adapters
            .iter()
            .find(|(name, _)| name == adapter)
            .and_then(|(_, path)| path.clone())
            .unwrap_or_else(|| adapter.to_owned());
        let body = serde_json::json!({"lora_name": adapter, "lora_path": path});
        let url = format!("{base}/v1/load_lora_adapter");
        let client = self.client();
        let call = client.call(axum::http::Method::POST, &url, Some(&body));
        let loaded = match tokio::time::timeout(PROBE_TIMEOUT, call).await {
            Ok(Ok(r)) => r.status().is_success(),
            _ => false,
        };
        match loaded {
            true => {
                tracing::info!(%worker, %adapter, "adapter loaded through vLLM's dynamic API");
                if let Ok(mut l) = self.listed.lock() {
                    l.entry(worker).or_default().insert(adapter.to_owned());
                }
            }
            false => tracing::warn!(%worker, %adapter, "the worker did not load the adapter"),
        }
        loaded
    }

    /// Forgets what a worker listed (it left, or restarted).
    pub(crate) fn forget_models(&self, worker: WorkerId) {
        if let Ok(mut listed) = self.listed.lock() {
            listed.remove(&worker);
        }
    }
}

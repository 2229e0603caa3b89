//! The models the fleet serves: the base model, the adapters the settings name, and those
//! the workers list in their `GET /v1/models` (vLLM lists each adapter with its base model
//! as `parent`). Each worker's list is read at the first health tick and every
//! [`MODELS_EVERY`] ticks after; what it lists becomes the router's knowledge of which
//! adapters it serves, and the fleet's catalog is the settings' adapters and every listed one.

use std::sync::Arc;

use kvroute_core::WorkerId;

use crate::adapters::adapters_listed;
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
            async move {
                let client = state.workers().client.clone();
                (worker, adapters_listed(&client, &url, state.models.base()).await)
            }
        });
        let listed = futures_util::future::join_all(reads).await;
        for (worker, adapters) in listed {
            let Some(adapters) = adapters else { continue };
            // Loading adapters on demand, any worker can serve any of them.
            let served = (!self.options.load_adapters).then(|| adapters.clone());
            for rank in self.workers().all_ranks(worker) {
                self.decider.set_served_adapters(rank, served.clone());
            }
            self.adapters.record(worker, adapters);
        }
        self.adapters.refresh(&self.models);
    }

    /// With `load_adapters`: makes sure `worker` (at `base`) serves `adapter`, loading it
    /// through vLLM's `/v1/load_lora_adapter` when its last list did not name it (the path is
    /// the settings', else the name). Whether it serves it now.
    pub(crate) async fn ensure_adapter(&self, worker: WorkerId, base: &str, adapter: &str) -> bool {
        if !self.options.load_adapters {
            return true;
        }
        if self.adapters.lists(worker, adapter) {
            return true;
        }
        let path = self.adapters.path_of(adapter);
        let body = serde_json::json!({"lora_name": adapter, "lora_path": path});
        let url = format!("{base}/v1/load_lora_adapter");
        let client = self.workers().client.clone();
        let call = client.call(axum::http::Method::POST, &url, Some(&body));
        let loaded = match tokio::time::timeout(PROBE_TIMEOUT, call).await {
            Ok(Ok(r)) => r.status().is_success(),
            _ => false,
        };
        match loaded {
            true => {
                tracing::info!(%worker, %adapter, "adapter loaded through vLLM's dynamic API");
                self.adapters.loaded(worker, adapter);
            }
            false => tracing::warn!(%worker, %adapter, "the worker did not load the adapter"),
        }
        loaded
    }
}

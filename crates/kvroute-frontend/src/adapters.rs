//! The adapters the front door knows of ([`ListedAdapters`]): those the settings name and
//! what each worker lists in its `GET /v1/models`; read and acted on by [`crate::models`].

use std::collections::{BTreeMap, BTreeSet};

use kvroute_core::WorkerId;
use kvroute_http::HttpClient;
use kvroute_http::models::Catalog;
use kvroute_http::openai::ModelList;

use crate::PROBE_TIMEOUT;

/// The adapters the settings name (always served, with where their weights are) and what each
/// worker listed when last read: an owner of its own, its lock a leaf.
#[derive(Debug, Default)]
pub(crate) struct ListedAdapters {
    configured: Vec<(String, Option<String>)>,
    listed: std::sync::Mutex<BTreeMap<WorkerId, BTreeSet<String>>>,
}

impl ListedAdapters {
    /// An adapter the settings name, at `path` (else its name).
    pub(crate) fn configure(&mut self, name: &str, path: Option<String>) {
        self.configured.push((name.to_owned(), path));
    }

    /// What `worker` lists now.
    pub(crate) fn record(&self, worker: WorkerId, adapters: BTreeSet<String>) {
        if let Ok(mut known) = self.listed.lock() {
            known.insert(worker, adapters);
        }
    }

    /// `catalog` made the configured adapters and every one a worker lists now.
    pub(crate) fn refresh(&self, catalog: &Catalog) {
        let Ok(listed) = self.listed.lock() else { return };
        let configured = self.configured.iter().map(|(name, _)| name);
        let now: BTreeSet<&String> = listed.values().flatten().chain(configured).collect();
        for name in catalog.adapters() {
            if !now.contains(&name) {
                catalog.remove(&name);
            }
        }
        for name in now {
            if let Err(e) = catalog.insert(name, None) {
                tracing::debug!(adapter = %name, error = %e, "adapter not listed");
            }
        }
    }

    /// Whether `worker` lists `adapter` (unknown: taken to).
    pub(crate) fn lists(&self, worker: WorkerId, adapter: &str) -> bool {
        let lists = |l: &BTreeMap<WorkerId, BTreeSet<String>>| {
            l.get(&worker).is_none_or(|served| served.contains(adapter))
        };
        self.listed.lock().map_or(true, |l| lists(&l))
    }

    /// Where `adapter`'s weights are: the settings' path, else its name.
    pub(crate) fn path_of(&self, adapter: &str) -> String {
        let configured = self.configured.iter().find(|(name, _)| name == adapter);
        configured.and_then(|(_, path)| path.clone()).unwrap_or_else(|| adapter.to_owned())
    }

    /// `worker` loaded `adapter`.
    pub(crate) fn loaded(&self, worker: WorkerId, adapter: &str) {
        if let Ok(mut l) = self.listed.lock() {
            l.entry(worker).or_default().insert(adapter.to_owned());
        }
    }

    /// Forgets what a worker listed (it left, or restarted).
    pub(crate) fn forget(&self, worker: WorkerId) {
        if let Ok(mut listed) = self.listed.lock() {
            listed.remove(&worker);
        }
    }
}

/// The adapters one worker lists over the `base` model; `None` when it did not answer.
pub(crate) async fn adapters_listed(
    client: &HttpClient,
    url: &str,
    base: &str,
) -> Option<BTreeSet<String>> {
    let read = tokio::time::timeout(PROBE_TIMEOUT, client.get_json::<ModelList>(url));
    let list = read.await.ok()?.ok()?;
    Some(list.adapters_of(base).into_iter().collect())
}

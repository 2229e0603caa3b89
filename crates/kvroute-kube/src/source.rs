//! The `InferencePool` as a source of members ([`KubeSource`]): the pool named in the
//! configuration is read for its selector and target port, then the pods it selects are
//! watched (kube-rs's watcher: a list, then a watch from its resource version, bookmarks kept,
//! a 410 Gone answered by a new list), and each change offers the ready ones as workers.
//!
//! Pods rather than EndpointSlices: the roles of a disaggregated pool are pod labels (llm-d's
//! `llm-d.ai/role`), which EndpointSlices do not carry, and a pod's Ready condition is what
//! an EndpointSlice's `ready` is made from.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures_util::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kvroute_router::members::{Sink, Source, Template};

use crate::pool::{PoolError, Skipped, pool_spec, workers};

/// What the source follows.
#[derive(Clone, Debug)]
pub struct KubeConfig {
    /// The `InferencePool`'s name and namespace.
    pub pool: String,
    pub namespace: String,
    /// Each ready pod as a worker: `{host}` its address, `{port}` the pool's target port.
    pub template: Template,
    /// The pod this process runs in (`POD_NAME`, or the host name): never a worker, even when
    /// the pool's selector matches it.
    pub own_pod: Option<String>,
}

/// Follows an `InferencePool` (see the module docs).
pub struct KubeSource {
    /// `None`: the service account's, made when the source starts.
    client: Option<kube::Client>,
    config: KubeConfig,
}

impl std::fmt::Debug for KubeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSource").field("config", &self.config).finish_non_exhaustive()
    }
}

/// GIE's `InferencePool`.
pub fn pool_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
    ApiResource::from_gvk_with_plural(&gvk, "inferencepools")
}

/// Why an InferencePool cannot be followed.
#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error("{url}: {source}")]
    Url { url: String, source: http::uri::InvalidUri },
    #[error("no Kubernetes client: {0}")]
    Client(kube::Error),
    #[error("the InferencePool cannot be read: {0}")]
    Pool(kube::Error),
    #[error(transparent)]
    Spec(#[from] PoolError),
}

impl KubeSource {
    /// With `client` (in a pod: `kube::Client::try_default()`, its service account).
    pub fn new(client: kube::Client, config: KubeConfig) -> Self {
        Self { client: Some(client), config }
    }

    /// With a client of an API server at `url` that asks for no credentials (a test's or a
    /// bench's on loopback).
    pub fn at(url: &str, config: KubeConfig) -> Result<Self, KubeSourceError> {
        let uri =
            url.parse().map_err(|source| KubeSourceError::Url { url: url.to_owned(), source })?;
        let mut kube_config = kube::Config::new(uri);
        kube_config.default_namespace.clone_from(&config.namespace);
        let client = kube::Client::try_from(kube_config).map_err(KubeSourceError::Client)?;
        Ok(Self::new(client, config))
    }

    /// With the client of the pod's service account (or `KUBECONFIG` outside a cluster).
    pub fn in_cluster(config: KubeConfig) -> Self {
        Self { client: None, config }
    }

    /// The namespace this pod runs in (its service account's), else `default`.
    pub fn own_namespace() -> String {
        std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
            .map(|n| n.trim().to_owned())
            .ok()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".to_owned())
    }

    /// Reads the pool, then watches its pods until the watch ends or the pool cannot be read.
    async fn follow(
        &self,
        client: &kube::Client,
        sink: &Sink,
        logged: &mut BTreeSet<String>,
    ) -> Result<(), KubeSourceError> {
        let ns = self.config.namespace.as_str();
        let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &pool_resource());
        let pool = pools.get(&self.config.pool).await.map_err(KubeSourceError::Pool)?;
        let spec = pool_spec(&pool)?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let watch = watcher::watcher(pods, watcher::Config::default().labels(&spec.selector));
        let mut events = std::pin::pin!(watch.default_backoff());
        let (mut current, mut listing) = (BTreeMap::<String, Pod>::new(), None);
        loop {
            let event = match events.try_next().await {
                Ok(Some(event)) => event,
                Ok(None) => return Ok(()),
                Err(err) => {
                    // The watcher lists again by itself (a 410 Gone among them).
                    tracing::debug!(pool = %self.config.pool, %err, "the pods' watch restarts");
                    continue;
                }
            };
            let changed = match event {
                Event::Init => {
                    listing = Some(BTreeMap::new());
                    false
                }
                Event::InitApply(pod) => {
                    if let (Some(list), Some(name)) = (listing.as_mut(), pod.metadata.name.clone())
                    {
                        list.insert(name, pod);
                    }
                    false
                }
                Event::InitDone => {
                    current = listing.take().unwrap_or_default();
                    true
                }
                Event::Apply(pod) => {
                    pod.metadata.name.clone().map(|n| current.insert(n, pod)).is_some()
                }
                Event::Delete(pod) => {
                    pod.metadata.name.as_ref().and_then(|n| current.remove(n)).is_some()
                }
            };
            if changed {
                self.offer(sink, &current, spec.port, logged);
            }
        }
    }

    fn offer(
        &self,
        sink: &Sink,
        pods: &BTreeMap<String, Pod>,
        port: u16,
        logged: &mut BTreeSet<String>,
    ) {
        let own = self.config.own_pod.as_deref();
        let (specs, skipped) = workers(pods, port, &self.config.template, own);
        for (pod, why) in skipped {
            // Each pod's refusal once (bounded: a pool's pods).
            if logged.len() < 4096 && logged.insert(pod.clone()) {
                match why {
                    Skipped::Itself => {
                        tracing::warn!(pool = %self.config.pool, %pod, "the pool's selector matches this process's own pod: it is no worker");
                    }
                    Skipped::Role(role) => {
                        tracing::warn!(pool = %self.config.pool, %pod, %role, "a pod with a role kvroute does not know: no worker");
                    }
                    Skipped::Template(err) => {
                        tracing::warn!(pool = %self.config.pool, %pod, %err, "a pod the worker template cannot describe");
                    }
                }
            }
        }
        sink.offer(specs);
    }
}

impl Source for KubeSource {
    fn name(&self) -> String {
        "kubernetes".to_owned()
    }

    fn run(self: Box<Self>, sink: Sink) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut logged = BTreeSet::new();
            let mut failing = false;
            loop {
                let client = match &self.client {
                    Some(client) => Ok(client.clone()),
                    None => kube::Client::try_default().await.map_err(KubeSourceError::Client),
                };
                let followed = match client {
                    Ok(client) => self.follow(&client, &sink, &mut logged).await,
                    Err(err) => Err(err),
                };
                match followed {
                    Ok(()) => failing = false,
                    Err(err) if !failing => {
                        failing = true;
                        tracing::warn!(pool = %self.config.pool, %err, "the InferencePool cannot be followed: the members stay as they are");
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    }
}

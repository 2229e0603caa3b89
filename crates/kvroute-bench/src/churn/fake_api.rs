//! A Kubernetes API server of the churn run's own, on loopback: it serves one `InferencePool`
//! and the pods it selects as the API does (a list with its resource version, a watch that
//! streams ADDED and DELETED events from the version asked), its pods changed by the plan.
//! kvroute's Kubernetes source watches it with kube's own client (no API server can be
//! installed here).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::broadcast;

pub(super) const NAMESPACE: &str = "churn";
pub(super) const POOL: &str = "churn-pool";

#[derive(Debug, Default)]
struct Pods {
    version: u64,
    /// Each pod by name, as the API shows it.
    pods: BTreeMap<String, Value>,
    /// Every event so far, with its version (a watch from a version replays what follows).
    events: Vec<(u64, String)>,
}

/// The server's state; its pods change with [`FakeApi::set`].
#[derive(Debug, Clone)]
pub(super) struct FakeApi {
    pods: Arc<Mutex<Pods>>,
    news: broadcast::Sender<(u64, String)>,
    port: u16,
}

fn pod(name: &str, ip: IpAddr, version: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": format!("uid-{name}"),
            "resourceVersion": version.to_string(), "labels": {"kvroute.io/pool": POOL}},
        "status": {"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}],
            "conditions": [{"type": "Ready", "status": "True"}]}})
}

impl FakeApi {
    /// Serves it on a free loopback port; its URL.
    pub(super) async fn start(port: u16) -> anyhow::Result<(Self, String)> {
        let (news, _) = broadcast::channel(1024);
        let api = Self { pods: Arc::default(), news, port };
        let app = axum::Router::new()
            .route(
                &format!("/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools/{POOL}"),
                get(pool),
            )
            .route(&format!("/api/v1/namespaces/{NAMESPACE}/pods"), get(pods))
            .with_state(api.clone());
        let url = kvroute_stack::serve_on_loopback(app).await?;
        Ok((api, url))
    }

    /// The pods are now these (name, address): the new ones ADDED, the gone ones DELETED.
    pub(super) fn set(&self, now: &[(String, IpAddr)]) {
        let mut p = self.pods.lock().unwrap_or_else(PoisonError::into_inner);
        let gone: Vec<String> =
            p.pods.keys().filter(|n| !now.iter().any(|(m, _)| m == *n)).cloned().collect();
        for name in gone {
            p.version += 1;
            let version = p.version;
            if let Some(mut object) = p.pods.remove(&name) {
                object["metadata"]["resourceVersion"] = json!(version.to_string());
                let line = json!({"type": "DELETED", "object": object}).to_string();
                p.events.push((version, line.clone()));
                let _ = self.news.send((version, line));
            }
        }
        for (name, ip) in now {
            if p.pods.contains_key(name) {
                continue;
            }
            p.version += 1;
            let object = pod(name, *ip, p.version);
            let line = json!({"type": "ADDED", "object": object}).to_string();
            let version = p.version;
            p.pods.insert(name.clone(), object);
            p.events.push((version, line.clone()));
            let _ = self.news.send((version, line));
        }
    }
}

async fn pool(State(api): State<FakeApi>) -> Response {
    axum::Json(json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NAMESPACE, "resourceVersion": "1"},
        "spec": {"selector": {"matchLabels": {"kvroute.io/pool": POOL}},
            "targetPorts": [{"number": api.port}],
            "endpointPickerRef": {"name": "kvroute", "port": {"number": 9002}}}}))
    .into_response()
}

async fn pods(State(api): State<FakeApi>, Query(q): Query<BTreeMap<String, String>>) -> Response {
    if q.get("watch").map(String::as_str) != Some("true") {
        let p = api.pods.lock().unwrap_or_else(PoisonError::into_inner);
        let items: Vec<Value> = p.pods.values().cloned().collect();
        let list = json!({"apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": p.version.to_string()}, "items": items});
        return axum::Json(list).into_response();
    }
    let from: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    // Subscribed first, then what followed the version asked: nothing falls between.
    let news = api.news.subscribe();
    let past: Vec<(u64, String)> = {
        let p = api.pods.lock().unwrap_or_else(PoisonError::into_inner);
        p.events.iter().filter(|(v, _)| *v > from).cloned().collect()
    };
    let last = past.last().map_or(from, |(v, _)| *v);
    let past = futures_util::stream::iter(
        past.into_iter().map(|(_, l)| Ok::<_, std::convert::Infallible>(format!("{l}\n"))),
    );
    let live = futures_util::stream::unfold((news, last), |(mut news, last)| async move {
        loop {
            match news.recv().await {
                Ok((v, line)) if v > last => return Some((Ok(format!("{line}\n")), (news, v))),
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    axum::body::Body::from_stream(futures_util::StreamExt::chain(past, live)).into_response()
}

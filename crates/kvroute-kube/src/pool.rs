//! What an `InferencePool` (GIE's `inference.networking.k8s.io/v1`) says of its endpoints,
//! and which of the pods it selects are workers: pure functions over the API's objects.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use kube::api::DynamicObject;
use kvroute_core::schedule::Role;
use kvroute_router::WorkerSpec;
use kvroute_router::members::Template;

/// The label llm-d puts on a pod to say what it serves in a disaggregated pool
/// (`prefill`, `decode`, or `both`; absent: both).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// What the pool names: its pods' labels and the port its model servers listen on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels`, as a label selector (`k=v,k2=v2`).
    pub selector: String,
    /// `spec.targetPorts[0].number`.
    pub port: u16,
}

/// Why a pool cannot be followed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("the InferencePool selects no pods: spec.selector.matchLabels is missing or empty")]
    NoSelector,
    #[error("the InferencePool has no target port (spec.targetPorts[0].number)")]
    NoPort,
}

/// The pool's selector and port.
pub fn pool_spec(pool: &DynamicObject) -> Result<PoolSpec, PoolError> {
    let spec = &pool.data["spec"];
    let labels = spec["selector"]["matchLabels"].as_object().ok_or(PoolError::NoSelector)?;
    let mut pairs: Vec<String> =
        labels.iter().filter_map(|(k, v)| Some(format!("{k}={}", v.as_str()?))).collect();
    if pairs.is_empty() {
        return Err(PoolError::NoSelector);
    }
    pairs.sort();
    let port = spec["targetPorts"][0]["number"].as_u64().and_then(|p| u16::try_from(p).ok());
    Ok(PoolSpec {
        selector: pairs.join(","),
        port: port.filter(|&p| p > 0).ok_or(PoolError::NoPort)?,
    })
}

/// Whether a pod serves: Ready, an address, not being deleted.
fn serving(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready =
        status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// What a pod's role label says (`None`: a value kvroute does not know).
fn role(pod: &Pod) -> Option<Role> {
    let labels = pod.metadata.labels.as_ref();
    match labels.and_then(|l| l.get(ROLE_LABEL)).map(String::as_str) {
        None | Some("both" | "prefill-decode") => Some(Role::Both),
        Some("prefill") => Some(Role::Prefill),
        Some("decode") => Some(Role::Decode),
        Some(_) => None,
    }
}

/// Why a selected pod is not a worker, counted and logged once per pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skipped {
    /// The pod kvroute itself runs in (a selector that matches the picker).
    Itself,
    /// A role label kvroute does not know.
    Role(String),
    /// The template cannot describe it.
    Template(String),
}

/// The workers among `pods` (by name): each ready pod with an address, at the pool's `port`,
/// described by `template`, with its role from [`ROLE_LABEL`]; `own` (this process's pod
/// name) is never one. Also what was skipped, and why.
pub fn workers(
    pods: &BTreeMap<String, Pod>,
    port: u16,
    template: &Template,
    own: Option<&str>,
) -> (Vec<WorkerSpec>, Vec<(String, Skipped)>) {
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for (name, pod) in pods {
        let Some(ip) = serving(pod) else { continue };
        if own == Some(name.as_str()) {
            skipped.push((name.clone(), Skipped::Itself));
            continue;
        }
        let Some(role) = role(pod) else {
            let label = pod.metadata.labels.as_ref().and_then(|l| l.get(ROLE_LABEL));
            skipped.push((name.clone(), Skipped::Role(label.cloned().unwrap_or_default())));
            continue;
        };
        match template.fill(ip, Some(port)) {
            Ok(mut spec) => {
                spec.role = role;
                out.push(spec);
            }
            Err(err) => skipped.push((name.clone(), Skipped::Template(err.to_string()))),
        }
    }
    (out, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, ready: bool, role: Option<&str>) -> (String, Pod) {
        let mut labels = BTreeMap::from([("app".to_owned(), "vllm".to_owned())]);
        if let Some(r) = role {
            labels.insert(ROLE_LABEL.to_owned(), r.to_owned());
        }
        let value = serde_json::json!({
            "metadata": {"name": name, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        });
        (name.to_owned(), serde_json::from_value(value).unwrap())
    }

    fn template() -> Template {
        "url=http://{host}:{port},events=tcp://{host}:5557".parse().unwrap()
    }

    #[test]
    fn ready_pods_are_workers_with_their_roles_and_the_picker_is_not() {
        let pods = BTreeMap::from([
            pod("p0", "10.0.0.1", true, Some("prefill")),
            pod("d0", "10.0.0.2", true, Some("decode")),
            pod("a0", "10.0.0.3", true, None),
            pod("slow", "10.0.0.4", false, None),
            pod("picker", "10.0.0.5", true, None),
            pod("odd", "10.0.0.6", true, Some("sidecar")),
        ]);
        let (workers, skipped) = workers(&pods, 8000, &template(), Some("picker"));
        let got: Vec<(&str, Role)> =
            workers.iter().map(|w| (w.url.as_deref().unwrap(), w.role)).collect();
        assert_eq!(
            got,
            [
                ("http://10.0.0.3:8000", Role::Both),
                ("http://10.0.0.2:8000", Role::Decode),
                ("http://10.0.0.1:8000", Role::Prefill),
            ]
        );
        assert_eq!(
            skipped,
            [
                ("odd".to_owned(), Skipped::Role("sidecar".into())),
                ("picker".to_owned(), Skipped::Itself)
            ]
        );
    }

    #[test]
    fn a_pool_without_a_selector_or_port_is_refused() {
        let pool = |spec: serde_json::Value| -> DynamicObject {
            serde_json::from_value(serde_json::json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "p"}, "spec": spec})).unwrap()
        };
        let ok = pool(
            serde_json::json!({"selector": {"matchLabels": {"b": "2", "a": "1"}}, "targetPorts": [{"number": 8000}]}),
        );
        assert_eq!(pool_spec(&ok), Ok(PoolSpec { selector: "a=1,b=2".into(), port: 8000 }));
        assert_eq!(
            pool_spec(&pool(serde_json::json!({"targetPorts": [{"number": 8000}]}))),
            Err(PoolError::NoSelector)
        );
        assert_eq!(
            pool_spec(&pool(
                serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]})
            )),
            Err(PoolError::NoSelector)
        );
        assert_eq!(
            pool_spec(&pool(serde_json::json!({"selector": {"matchLabels": {"a": "1"}}}))),
            Err(PoolError::NoPort)
        );
    }
}

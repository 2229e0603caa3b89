//! The pool's endpoints: each worker's `host:port` from its URL, and the `ip:port` the
//! gateway names it by once its host name resolves (Envoy's original-destination cluster
//! routes to addresses; a StatefulSet's pods are named by DNS in the fleet's configuration).

use std::collections::BTreeSet;

use kvroute_core::WorkerId;
use kvroute_frontend::FrontendState;

/// One worker's names.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Endpoint {
    worker: WorkerId,
    /// `host:port` as configured.
    name: String,
    /// `ip:port`: the name itself when it is an address, else what it last resolved to.
    address: String,
}

/// The endpoints of the pool.
#[derive(Clone, Debug, Default)]
pub struct Endpoints {
    all: Vec<Endpoint>,
}

impl Endpoints {
    /// Each worker's `host:port`, from its base URL (its address until it resolves).
    pub fn of(front: &FrontendState) -> Self {
        let all = front
            .worker_urls()
            .into_iter()
            .filter_map(|(worker, url)| {
                let name = host_port(&url)?;
                Some(Endpoint { worker, address: name.clone(), name })
            })
            .collect();
        Self { all }
    }

    /// These endpoints, each with the address `before` resolved for its name (a worker
    /// still a member keeps its address until it resolves anew).
    pub fn keeping(mut self, before: &Endpoints) -> Self {
        for e in &mut self.all {
            if let Some(old) = before.all.iter().find(|o| o.name == e.name) {
                e.address.clone_from(&old.address);
            }
        }
        self
    }

    /// The same endpoints with each host name resolved anew (an IPv4 address first); one
    /// that does not resolve keeps the address it had.
    pub async fn resolved(&self) -> Self {
        let mut all = self.all.clone();
        for e in &mut all {
            let Some((host, _)) = e.name.rsplit_once(':') else { continue };
            if host.trim_matches(['[', ']']).parse::<std::net::IpAddr>().is_ok() {
                continue;
            }
            match tokio::net::lookup_host(e.name.as_str()).await {
                Ok(found) => {
                    let mut found: Vec<std::net::SocketAddr> = found.collect();
                    found.sort_by_key(|a| !a.is_ipv4());
                    if let Some(a) = found.first() {
                        e.address = a.to_string();
                    }
                }
                Err(err) => tracing::warn!(endpoint = %e.name, error = %err, "cannot resolve"),
            }
        }
        Self { all }
    }

    /// The address the gateway is told for `worker`.
    pub fn endpoint(&self, worker: WorkerId) -> Option<&str> {
        self.all.iter().find(|e| e.worker == worker).map(|e| e.address.as_str())
    }

    /// The worker the gateway names by `endpoint` (an address, or a configured name).
    pub fn worker(&self, endpoint: &str) -> Option<WorkerId> {
        self.all.iter().find(|e| e.address == endpoint || e.name == endpoint).map(|e| e.worker)
    }

    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.all.iter().map(|e| e.worker)
    }

    /// The workers a subset hint allows: an entry `ip:port` names one endpoint, an entry
    /// without a port every endpoint at that address.
    pub fn allowed(&self, subset: &[String]) -> BTreeSet<WorkerId> {
        let matches = |s: &str, e: &str| s == e || e.rsplit_once(':').is_some_and(|(h, _)| h == s);
        self.all
            .iter()
            .filter(|e| subset.iter().any(|s| matches(s, &e.address) || matches(s, &e.name)))
            .map(|e| e.worker)
            .collect()
    }
}

/// The endpoints of an endpoints file: one per line, blank lines and `#` comments skipped.
pub fn parse_endpoints(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `host:port` of a base URL (`http://10.0.0.1:8000` → `10.0.0.1:8000`), the port the
/// scheme's when it names none.
pub fn host_port(url: &str) -> Option<String> {
    let uri: hyper::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    Some(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(names: &[&str]) -> Endpoints {
        let all = names
            .iter()
            .enumerate()
            .map(|(k, n)| Endpoint {
                worker: WorkerId(k as u64 + 1),
                name: (*n).to_owned(),
                address: (*n).to_owned(),
            })
            .collect();
        Endpoints { all }
    }

    #[test]
    fn urls_become_host_and_port() {
        assert_eq!(host_port("http://10.0.0.1:8000").as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(host_port("http://vllm-0.vllm/").as_deref(), Some("vllm-0.vllm:80"));
        assert_eq!(host_port("https://a.b").as_deref(), Some("a.b:443"));
        assert_eq!(host_port("not a url"), None);
    }

    #[test]
    fn a_subset_names_endpoints_or_whole_addresses() {
        let p = pool(&["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000"]);
        let ids = |s: &[&str]| {
            let s: Vec<String> = s.iter().map(|x| (*x).to_owned()).collect();
            p.allowed(&s).into_iter().map(|w| w.0).collect::<Vec<_>>()
        };
        assert_eq!(ids(&["10.0.0.1:8001"]), vec![2]);
        assert_eq!(ids(&["10.0.0.1"]), vec![1, 2]);
        assert_eq!(ids(&["10.0.0.3:8000", "10.0.0.2:8000"]), vec![3]);
        assert!(ids(&[]).is_empty());
        assert!(ids(&["10.0.0"]).is_empty(), "a prefix of an address is not the address");
    }

    #[tokio::test]
    async fn host_names_resolve_to_addresses_and_both_name_the_worker() {
        let p = pool(&["localhost:8000", "127.0.0.9:8001"]).resolved().await;
        assert_eq!(p.endpoint(WorkerId(1)), Some("127.0.0.1:8000"));
        assert_eq!(p.endpoint(WorkerId(2)), Some("127.0.0.9:8001"));
        assert_eq!(p.worker("127.0.0.1:8000"), Some(WorkerId(1)));
        assert_eq!(p.worker("localhost:8000"), Some(WorkerId(1)));
        assert_eq!(p.allowed(&["127.0.0.1".to_owned()]).len(), 1);
    }
}

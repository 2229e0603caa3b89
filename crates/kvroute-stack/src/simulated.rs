//! The simulated fleet of a stack: its engines started on loopback (aggregated ones, then the
//! prefill pool, then the decode pool), each added to the router's workers, with the fleet's
//! token, its prefill engines' side channels and its shared store.

use std::path::Path;
use std::sync::Arc;

use kvroute_core::schedule::Role;
use kvroute_mocker::{EngineConfig, MockerConfig};
use kvroute_preprocess::fetch::FetchConfig;
use kvroute_router::{RouterConfig, WorkerSpec};

use crate::{SharedStore, Simulated, StackError};

/// What every simulated engine of one fleet shares.
struct Shared<'a> {
    simulated: &'a Simulated,
    block_size: kvroute_core::BlockSize,
    model_path: Option<&'a Path>,
    fetch: &'a FetchConfig,
    store_url: Option<String>,
    /// The prefill engines a decode engine may pull from, as they start.
    peers: kvroute_mocker::Peers,
    first_id: u64,
}

/// Starts `simulated`'s engines and adds them to `router`'s workers, numbered after the
/// highest configured id.
pub(crate) async fn start(
    simulated: &Simulated,
    router: &mut RouterConfig,
    model_path: Option<&Path>,
    fetch: &FetchConfig,
) -> Result<Vec<Arc<kvroute_mocker::http::AppState>>, StackError> {
    // The simulated engines' own secret for their side channels and the store: 256 random
    // bits known to this process alone; the configured one (KVROUTE_KV_PEER_TOKEN) when the
    // fleet has engines outside.
    let fleet_token = match &simulated.kv_peer_token {
        Some(token) => token.clone(),
        None => worker_token()?,
    };
    // Decode engines pull from the fleet's prefill engines only: configured ones with a side
    // channel (bootstrap port), then the simulated ones as they start.
    let outside = router.workers.iter().filter(|w| w.role == Role::Prefill);
    let prefill = outside.filter_map(side_channel_of).collect();
    let mut fleet = Shared {
        simulated,
        block_size: router.block_size,
        model_path,
        fetch,
        store_url: shared_store(simulated, &fleet_token).await?,
        peers: kvroute_mocker::Peers { token: Some(fleet_token), prefill },
        first_id: router.workers.iter().map(|w| w.id.0 + 1).max().unwrap_or(0),
    };
    let roles = std::iter::repeat_n(Role::Both, simulated.count)
        .chain(std::iter::repeat_n(Role::Prefill, simulated.prefill))
        .chain(std::iter::repeat_n(Role::Decode, simulated.decode));
    let mut engines = Vec::new();
    for (k, role) in roles.enumerate() {
        // Prefill engines start before decode ones: each decode engine may pull from every
        // prefill engine of the fleet, and from nothing else.
        let (spec, state) = fleet.spawn(k, role).await?;
        fleet.peers.prefill.extend(state.side_channel);
        router.workers.push(spec);
        engines.push(state);
    }
    Ok(engines)
}

/// The shared store the engines write to: given, started here, or none.
async fn shared_store(
    simulated: &Simulated,
    fleet_token: &str,
) -> Result<Option<String>, StackError> {
    Ok(match &simulated.store {
        Some(SharedStore::At(url)) => Some(url.clone()),
        Some(SharedStore::Start(blocks)) => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("http://{}", listener.local_addr()?);
            let writers = kvroute_http::Credentials::new([fleet_token], "the fleet's token")?;
            kvroute_mocker::store::spawn(*blocks, listener, writers);
            tracing::info!(%url, blocks, "shared store started for the simulated engines");
            Some(url)
        }
        None => None,
    })
}

impl Shared<'_> {
    /// Starts the `k`-th engine in `role`; returns its worker spec and its state.
    async fn spawn(
        &self,
        k: usize,
        role: Role,
    ) -> Result<(WorkerSpec, Arc<kvroute_mocker::http::AppState>), StackError> {
        let simulated = self.simulated;
        let node = node_label(k, simulated);
        let disagg = kvroute_mocker::DisaggConfig {
            role,
            node: match &node {
                Some(label) => kvroute_core::schedule::pairs::node_id(Some(label)),
                None => simulated.engine.disagg.node,
            },
            ..simulated.engine.disagg
        };
        let endpoints = match simulated.events {
            true => kvroute_mocker::Endpoints::ephemeral(),
            false => kvroute_mocker::Endpoints::without_events(),
        };
        // Its HTTP routes answer only the front door: a token of 256 random bits, known to
        // this process alone (its ZMQ ports stay on loopback, see the README).
        let token = (!simulated.tokenless).then(worker_token).transpose()?;
        let api_keys = match &token {
            Some(t) => kvroute_http::Credentials::new([t], "the embedded worker's token")?,
            None => kvroute_http::Credentials::default(),
        };
        let mocker = MockerConfig {
            api_keys,
            engine: EngineConfig { block_size: self.block_size, disagg, ..simulated.engine },
            endpoints,
            model_path: self.model_path.map(Path::to_path_buf),
            chat_template: simulated.chat_template.clone(),
            seed: simulated.seed,
            max_model_len: simulated.max_model_len,
            dp_rank: 0,
            fetch: self.fetch.clone(),
            lora_modules: simulated.lora_modules.clone(),
            runtime_lora_updating: simulated.lora_updating,
            side_channel: None,
            store_url: self.store_url.clone(),
            peers: self.peers.clone(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let spawned = kvroute_mocker::spawn(mocker, listener).await?;
        let mut spec = WorkerSpec::new(self.first_id + k as u64);
        spec.url = Some(spawned.url);
        spec.events = spawned.events;
        spec.replay = spawned.replay;
        spec.metrics = spawned.metrics;
        spec.api_key = token.map(kvroute_router::WorkerKey);
        spec.dialect = simulated.dialect;
        spec.role = role;
        spec.node = node;
        spec.bootstrap_port = spawned.state.side_channel.map(|a| a.port());
        if !simulated.lora_modules.is_empty() {
            spec.max_loras = Some(simulated.engine.lora.max_loras);
        }
        Ok((spec, spawned.state))
    }
}

/// The node label of the `k`-th simulated worker (aggregated ones first, then the prefill
/// pool, then the decode pool): each pool spread over `nodes` in turn; none on one node.
fn node_label(k: usize, simulated: &Simulated) -> Option<String> {
    let within = match k.checked_sub(simulated.count) {
        None => return None,
        Some(i) if i < simulated.prefill => i,
        Some(i) => i - simulated.prefill,
    };
    (simulated.nodes > 1).then(|| format!("node-{}", within % simulated.nodes))
}

/// A configured prefill worker's side channel: its URL's host (an IP address or localhost)
/// and its bootstrap port.
fn side_channel_of(w: &WorkerSpec) -> Option<std::net::SocketAddr> {
    let port = w.bootstrap_port?;
    let rest = w.url.as_deref()?.split_once("://")?.1;
    let authority = rest.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = match host {
        "localhost" => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        _ => host.parse().ok()?,
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// An unguessable token: 32 bytes from the operating system's generator, in hex.
fn worker_token() -> Result<String, StackError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(StackError::Randomness)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_workers_side_channel_is_its_host_and_bootstrap_port() {
        let at = |url: &str, port: Option<u16>| {
            let mut w = WorkerSpec::new(1);
            w.url = Some(url.into());
            w.bootstrap_port = port;
            side_channel_of(&w).map(|a| a.to_string())
        };
        assert_eq!(at("http://127.0.0.1:8000", Some(9000)).as_deref(), Some("127.0.0.1:9000"));
        assert_eq!(at("http://[::1]:8000/", Some(9000)).as_deref(), Some("[::1]:9000"));
        assert_eq!(at("http://localhost", Some(9000)).as_deref(), Some("127.0.0.1:9000"));
        assert_eq!(at("http://prefill.example:8000", Some(9000)), None, "never resolved");
        assert_eq!(at("http://127.0.0.1:8000", None), None);
    }

    /// Each pool is spread over the nodes in turn; aggregated workers and one node: none.
    #[test]
    fn pools_are_spread_over_the_nodes() {
        let fleet = Simulated { count: 1, prefill: 3, decode: 2, nodes: 2, ..Simulated::default() };
        let labels: Vec<Option<String>> = (0..6).map(|k| node_label(k, &fleet)).collect();
        let want =
            [None, Some("node-0"), Some("node-1"), Some("node-0"), Some("node-0"), Some("node-1")];
        assert_eq!(labels, want.map(|l| l.map(str::to_owned)));
        let one = Simulated { nodes: 1, ..fleet };
        assert!((0..6).all(|k| node_label(k, &one).is_none()));
    }
}

//! One builder for a running kvroute stack, used by `kvroute serve`, `frontend` and `router`,
//! by `kvroute bench` and by the tests: simulated workers, external workers, the router
//! (embedded, or a remote `kvroute router`) and the front door. It sits above the crates it
//! assembles, so none of them depends on another to be set up.
//!
//! ```text
//!  StackConfig ──Stack::start──▶ simulated workers: kvroute_mocker::spawn on loopback,
//!                                ephemeral ports (events, replay, load reports)
//!                              ▶ router: RouterState over external + simulated workers,
//!                                its subscriptions and load readers (or a remote URL)
//!                              ▶ front door: FrontendState over the router
//!  Stack::ready ──▶ every subscription connected, replay caught up, first load reports in
//! ```
//!
//! [`settings`] reads what configures a stack from flags, environment and a TOML file.

pub mod nats_server;
pub mod settings;
mod simulated;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::WorkerWithDpRank;

pub use kvroute_frontend::FrontDoorOptions;
use kvroute_frontend::FrontendState;
use kvroute_http::Credentials;
use kvroute_mocker::EngineConfig;
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::{FetchConfig, Fetcher};
use kvroute_router::{Dialect, RouterConfig, RouterState, Tasks, WorkerSpec};

/// Everything a stack can fail with at start-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StackError {
    #[error(transparent)]
    Config(#[from] settings::Invalid),
    /// The local NATS server (tests, the bench) could not be started.
    #[error("nats-server: {0}")]
    NatsServer(#[from] nats_server::NatsServerError),
    #[error("no randomness for a worker token")]
    Randomness(#[source] getrandom::Error),
    #[error("the stack has no front door")]
    NoFrontDoor,
    #[error(transparent)]
    Settings(#[from] settings::SettingsError),
    #[error(transparent)]
    Router(#[from] kvroute_router::RouterError),
    #[error(transparent)]
    RouterConfig(#[from] kvroute_router::ConfigError),
    #[error(transparent)]
    Nats(#[from] kvroute_router::config::nats::NatsConfigError),
    #[error("a simulated worker")]
    Mocker(#[from] kvroute_mocker::MockerError),
    #[error("the model")]
    Model(#[from] kvroute_preprocess::PreprocessError),
    #[error("I/O")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Credentials(#[from] kvroute_http::auth::CredentialsError),
    #[error(transparent)]
    Tls(#[from] kvroute_http::server::TlsError),
    #[error("adapters: {0}")]
    Adapters(String),
}

/// Who may call what: the front door's API keys, the admin token of the router's API and of
/// `/metrics`, and the token to send a remote router. Empty sets leave routes open.
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub api_keys: Credentials,
    pub admin: Credentials,
    pub router_token: Option<String>,
}

/// The simulated workers of a stack.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulated {
    /// Aggregated workers.
    pub count: usize,
    /// Prefill and decode workers (`--prefill-workers`, `--decode-workers`), after those.
    pub prefill: usize,
    pub decode: usize,
    /// Nodes the prefill and decode workers are spread over, each pool in turn (`node-0`,
    /// `node-1`, ...; 0 or 1: unlabelled, one node).
    pub nodes: usize,
    /// Each one's engine (its block size is the router's).
    pub engine: EngineConfig,
    /// Whether they publish KV events (otherwise they are routed approximately).
    pub events: bool,
    /// Seeds the generated text, the same on every worker (so every routing policy sees the
    /// same conversations).
    pub seed: u64,
    /// The longest prompt plus output (`None`: the model's, at most the KV capacity).
    pub max_model_len: Option<u64>,
    /// How the front door speaks to them (they serve every dialect).
    pub dialect: Dialect,
    /// A chat template of their own (Jinja text) instead of the model's.
    pub chat_template: Option<String>,
    /// The LoRA adapters each serves from the start (name, path).
    pub lora_modules: Vec<(String, Option<String>)>,
    /// Each serves vLLM's dynamic adapter API.
    pub lora_updating: bool,
    /// The store they share (docs/mocker.md, "Shared store").
    pub store: Option<SharedStore>,
    /// The token an outside store (`SharedStore::At`) requires; otherwise the engines get
    /// a fresh one of their own.
    pub kv_peer_token: Option<String>,
    /// Their HTTP routes answer without a token, for a gateway that calls them itself
    /// (`--ext-proc-port`: the gateway holds no worker's token). Otherwise they answer only
    /// the front door, each with a token of its own.
    pub tokenless: bool,
}

/// Where simulated engines find the store they share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedStore {
    /// A store already running (`kvroute mocker --role store`).
    At(String),
    /// One of this many blocks, started with the stack on a loopback port.
    Start(usize),
}

impl Default for Simulated {
    fn default() -> Self {
        Self {
            count: 0,
            prefill: 0,
            decode: 0,
            nodes: 1,
            engine: EngineConfig::default(),
            events: true,
            seed: 0,
            max_model_len: None,
            dialect: Dialect::VllmGenerate,
            chat_template: None,
            lora_modules: Vec::new(),
            lora_updating: false,
            store: None,
            kv_peer_token: None,
            tokenless: false,
        }
    }
}

/// What to start.
#[derive(Clone, Debug)]
pub struct StackConfig {
    pub simulated: Simulated,
    /// The router's settings; its `workers` are the external ones (simulated ones are added,
    /// numbered after the highest external id).
    pub router: RouterConfig,
    /// Ask the `kvroute router` at this URL instead of embedding one.
    pub router_url: Option<String>,
    /// Build a front door.
    pub frontend: bool,
    /// The model of the front door and the simulated workers (`None`: the built-in one).
    pub model_path: Option<PathBuf>,
    /// Image fetching of the front door and the simulated workers.
    pub fetch: FetchConfig,
    pub access: Access,
    /// The front door's own settings (the bench asks for `expose_overlap`).
    pub front_door: FrontDoorOptions,
    /// LoRA adapters the front door serves besides those the workers list (the simulated
    /// workers' own are added).
    pub adapters: Vec<String>,
    /// Each model's priority for requests that name none.
    pub model_priorities: std::collections::BTreeMap<String, i32>,
}

impl Default for StackConfig {
    fn default() -> Self {
        Self {
            simulated: Simulated::default(),
            router: RouterConfig::default(),
            router_url: None,
            frontend: true,
            model_path: None,
            fetch: FetchConfig::default(),
            access: Access::default(),
            front_door: FrontDoorOptions::default(),
            adapters: Vec::new(),
            model_priorities: std::collections::BTreeMap::new(),
        }
    }
}

/// A running stack; dropping it stops the router's background tasks (simulated workers live
/// as long as the runtime that started them).
#[derive(Debug)]
pub struct Stack {
    /// Every worker, simulated ones included.
    pub workers: Vec<WorkerSpec>,
    /// The simulated workers' engines, in the order of their ids.
    pub simulated: Vec<Arc<kvroute_mocker::http::AppState>>,
    /// The embedded router, if any.
    pub router: Option<Arc<RouterState>>,
    pub frontend: Option<Arc<FrontendState>>,
    /// The admin token of the router's API.
    admin: Credentials,
    _tasks: Option<Tasks>,
    _probes: Option<Probes>,
}

/// The front door's health probes; stopped when the stack is dropped.
#[derive(Debug)]
struct Probes(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Probes {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

impl Stack {
    /// Starts everything `config` asks for on the current runtime. Returns as soon as it is
    /// started; [`Stack::ready`] waits for the workers.
    pub async fn start(config: StackConfig) -> Result<Self, StackError> {
        let StackConfig {
            simulated,
            mut router,
            router_url,
            frontend,
            model_path,
            fetch,
            access,
            front_door,
            adapters,
            model_priorities,
        } = config;
        let preprocessor = Arc::new(Preprocessor::load_or_builtin(model_path.as_deref())?);
        if let Some(why) = preprocessor.text_only_reason() {
            tracing::warn!(model = preprocessor.model_name(), %why, "the model takes text only");
        }
        let engines =
            simulated::start(&simulated, &mut router, model_path.as_deref(), &fetch).await?;
        router.validate()?;
        let workers = router.workers.clone();
        let block_size = router.block_size;
        let fetcher = Fetcher::new(fetch)?;
        let (state, tasks) = match &router_url {
            Some(_) => (None, None),
            None => {
                let state = Arc::new(RouterState::new(router));
                let tasks = kvroute_router::spawn_background(&state)?;
                (Some(state), Some(tasks))
            }
        };
        let frontend = match (frontend, &state, &router_url) {
            (false, _, _) => None,
            (true, Some(router), _) => {
                Some(FrontendState::new(preprocessor, fetcher, Arc::clone(router)))
            }
            (true, None, Some(url)) => Some(FrontendState::remote(
                preprocessor,
                fetcher,
                url,
                access.router_token.as_deref(),
                &workers,
                block_size,
            )),
            (true, None, None) => unreachable!("no router URL means an embedded router"),
        };
        let mut adapters = adapters;
        adapters.extend(simulated.lora_modules.iter().map(|(name, _)| name.clone()));
        let frontend = match frontend {
            Some(f) => {
                let limit = simulated.max_model_len;
                let f = configured(f, &access, front_door, limit, &adapters)?;
                Some(Arc::new(f.with_model_priorities(model_priorities)))
            }
            None => None,
        };
        let probes = frontend.as_ref().map(|f| Probes(vec![f.spawn_probes(), f.spawn_history()]));
        Ok(Self {
            workers,
            simulated: engines,
            router: state,
            frontend,
            admin: access.admin,
            _tasks: tasks,
            _probes: probes,
        })
    }

    /// Waits until every worker is ready (its event subscription connected and caught up by
    /// replay, its first load report in) or `timeout` passes. Workers still not ready are
    /// named in a warning and returned; they stay marked not ready (`/workers`) and are routed
    /// to only when no ready worker is left, until they become ready.
    pub async fn ready(&self, timeout: Duration) -> Vec<WorkerWithDpRank> {
        let Some(router) = &self.router else { return Vec::new() };
        // The subscriptions and the parity probes, side by side, within the one timeout.
        let parity = async {
            match &self.frontend {
                Some(frontend) => frontend.parity_done(timeout).await,
                None => Vec::new(),
            }
        };
        let (mut waiting, unprobed) = tokio::join!(router.fleet.wait_ready(timeout), parity);
        for worker in unprobed {
            let w = WorkerWithDpRank::new(worker, 0u32);
            if !waiting.contains(&w) {
                waiting.push(w);
            }
        }
        if !waiting.is_empty() {
            tracing::warn!(
                workers = %self.waiting_for(&waiting),
                timeout_secs = timeout.as_secs_f64(),
                "workers not ready: routed only when no other worker is"
            );
        }
        waiting
    }

    /// What each of `waiting` still waits for: its event stream, its first load report, or
    /// its parity probe (with the probe's cause when it could not be made).
    pub fn waiting_for(&self, waiting: &[WorkerWithDpRank]) -> String {
        let Some(router) = &self.router else { return String::new() };
        let workers = router.workers();
        let what = |w: &WorkerWithDpRank| match workers.iter().find(|s| s.id == w.worker_id) {
            Some(s) => format!("{w}: {}", s.waiting_for(w.dp_rank.0 as usize).join(", ")),
            None => format!("{w}: unknown"),
        };
        waiting.iter().map(what).collect::<Vec<_>>().join("; ")
    }

    /// Serves the front door on a free loopback port in the background (as long as the
    /// runtime runs); its base URL. Tests and the bench use it.
    pub async fn serve_frontend_on_loopback(&self) -> Result<String, StackError> {
        let app = self.frontend_app().ok_or(StackError::NoFrontDoor)?;
        serve_on_loopback(app).await
    }

    /// The front door's app (`None` without one).
    /// The Endpoint Picker over the front door ([`kvroute_epp`]), its metrics served on the
    /// front door's `/metrics`. None without a front door.
    /// Gateways must send `token` in their gRPC metadata when one is given.
    pub fn picker(
        &self,
        options: kvroute_epp::EppOptions,
        token: Option<kvroute_http::Credentials>,
    ) -> Option<Arc<kvroute_epp::Picker>> {
        let front = self.frontend.as_ref()?;
        let picker = kvroute_epp::Picker::new(Arc::clone(front), options);
        let picker = Arc::new(match token {
            Some(token) => picker.with_token(token),
            None => picker,
        });
        front.serve_metrics_beside(Arc::clone(&picker.metrics.registry));
        // Workers named by host (a StatefulSet's pods) are told to the gateway by address.
        picker.spawn_resolver(Duration::from_secs(10));
        Some(picker)
    }

    pub fn frontend_app(&self) -> Option<axum::Router> {
        self.frontend.as_ref().map(|f| kvroute_frontend::app(Arc::clone(f)))
    }

    /// Stops the embedded router's background tasks (event subscriptions, NATS): its state
    /// stays and still routes, on what it last knew. Tests use it to kill a replica's links.
    pub fn stop_router_tasks(&mut self) {
        self._tasks = None;
    }

    /// The router's HTTP API (`None` without an embedded router).
    pub fn router_app(&self) -> Option<axum::Router> {
        self.router.as_ref().map(|r| kvroute_router::http::app(Arc::clone(r), self.admin.clone()))
    }
}

/// Serves `app` on a free loopback port in the background (as long as the runtime runs);
/// its base URL.
pub async fn serve_on_loopback(app: axum::Router) -> Result<String, StackError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(kvroute_http::serve(listener, app, std::future::pending()));
    Ok(url)
}

/// The front door with its keys, options, context limit and served adapters.
fn configured(
    f: FrontendState,
    access: &Access,
    options: FrontDoorOptions,
    max_model_len: Option<u64>,
    adapters: &[String],
) -> Result<FrontendState, StackError> {
    let f = f.guarded(access.api_keys.clone(), access.admin.clone()).with_options(options);
    let f = match max_model_len {
        Some(n) => f.max_model_len(n),
        None => f,
    };
    f.with_adapters(adapters.iter().map(String::as_str))
        .map_err(|e| StackError::Adapters(e.to_string()))
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

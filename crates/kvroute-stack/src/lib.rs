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

pub mod addressed;
mod config;
mod error;
pub mod reload;
pub mod settings;
mod simulated;
pub mod telemetry;
pub mod tools;

pub use config::{Access, Discovery, SharedStore, Simulated, StackConfig};
pub use error::StackError;

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::WorkerWithDpRank;

pub use kvroute_frontend::FrontDoorOptions;
use kvroute_frontend::FrontendState;
use kvroute_http::Credentials;
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::Fetcher;
use kvroute_router::{RouterState, Tasks, WorkerSpec};

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

/// The router embedded in this process: its saved state loaded first (the subscriptions
/// resume where it left them), its tasks, and the sources of members `discovery` names.
fn embedded(
    router: kvroute_router::RouterConfig,
    discovery: &Discovery,
    simulated: &[WorkerSpec],
) -> Result<(Arc<RouterState>, kvroute_router::Tasks), StackError> {
    let state = Arc::new(RouterState::new(router));
    let saver = state.config.state_dir.clone().map(|d| kvroute_router::saved::follow(&state, d));
    let mut tasks = kvroute_router::spawn_background(&state)?;
    if let Some(saver) = saver {
        tasks.push(saver);
    }
    for source in sources(discovery.clone(), simulated) {
        tasks.push(kvroute_router::members::spawn_source(&state, source, discovery.drain_timeout));
    }
    Ok((state, tasks))
}

/// The sources of members `discovery` names.
fn sources(
    discovery: Discovery,
    simulated: &[WorkerSpec],
) -> Vec<Box<dyn kvroute_router::members::Source>> {
    use kvroute_router::members::{BucketSource, DnsSource};
    let mut out: Vec<Box<dyn kvroute_router::members::Source>> = Vec::new();
    if let Some(dns) = discovery.dns {
        match DnsSource::new(dns) {
            Ok(source) => out.push(Box::new(source)),
            Err(err) => tracing::error!(%err, "DNS discovery cannot start"),
        }
    }
    if let Some(bucket) = discovery.bucket {
        out.push(Box::new(BucketSource::new(bucket)));
    }
    if let Some(kube) = discovery.kube {
        out.push(Box::new(kvroute_kube::KubeSource::in_cluster(kube)));
    }
    if let Some(reload) = discovery.reload {
        out.push(Box::new(reload::ReloadSource::new(reload, simulated.to_vec())));
    }
    out
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
            discovery,
        } = config;
        let preprocessor = Arc::new(Preprocessor::load_or_builtin(model_path.as_deref())?);
        if let Some(why) = preprocessor.text_only_reason() {
            tracing::warn!(model = preprocessor.model_name(), %why, "the model takes text only");
        }
        let listed: Vec<_> = router.workers.iter().map(|w| w.id).collect();
        let engines =
            simulated::start(&simulated, &mut router, model_path.as_deref(), &fetch).await?;
        let simulated_specs: Vec<WorkerSpec> =
            router.workers.iter().filter(|w| !listed.contains(&w.id)).cloned().collect();
        router.validate()?;
        let workers = router.workers.clone();
        let block_size = router.block_size;
        let fetcher = Fetcher::new(fetch)?;
        let (state, tasks) = match &router_url {
            Some(_) => (None, None),
            None => {
                let (state, tasks) = embedded(router, &discovery, &simulated_specs)?;
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
        let probes = frontend
            .as_ref()
            .map(|f| Probes(vec![f.spawn_probes(), f.spawn_history(), f.spawn_follow()]));
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
        let (mut waiting, unprobed) = tokio::join!(router.view().wait_ready(timeout), parity);
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
        let workers = router.view().workers();
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

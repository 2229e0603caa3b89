//! `kvroute serve`: front door + router + simulated workers in one process.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_core::schedule::PolicyKind;
use kvroute_frontend::FrontendState;
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::Fetcher;
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Address of the OpenAI-compatible API.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port of the API (0: any free port).
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8000)]
    port: u16,
    /// Simulated workers to start in-process (on ephemeral loopback ports); 0 with --worker
    /// for external workers only.
    #[arg(long, env = "KVROUTE_WORKERS_EMBEDDED", default_value_t = 4)]
    workers: usize,
    /// An external worker, as in `kvroute router --worker` (id, url, events, replay, metrics,
    /// ...). Repeatable.
    #[arg(long = "worker", env = "KVROUTE_WORKERS", value_delimiter = ';')]
    external: Vec<WorkerSpec>,
    /// Routing policy: kv, dynamo, round-robin, random, least-loaded.
    #[arg(long, env = "KVROUTE_POLICY", default_value = "kv")]
    policy: PolicyKind,
    /// Each embedded simulated worker's knobs (the block size is the router's too).
    #[command(flatten)]
    engine: super::mocker::EngineArgs,
}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    crate::init_tracing();
    anyhow::ensure!(
        args.workers > 0 || !args.external.is_empty(),
        "no workers: use --workers N or --worker ..."
    );
    let block_size = args.engine.block_size()?;
    let model_dir = args.engine.model_dir();
    let fetch = args.engine.fetch();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().context("--host/--port")?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let mut workers = args.external.clone();
        let first_id = workers.iter().map(|w| w.id.0 + 1).max().unwrap_or(0);
        for k in 0..args.workers {
            let config = args.engine.mocker(k as u64, kvroute_mocker::Endpoints::default())?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let spawned = kvroute_mocker::spawn(config, listener).await?;
            let mut spec = WorkerSpec::new(first_id + k as u64);
            spec.url = Some(spawned.url);
            spec.events = spawned.events;
            spec.replay = spawned.replay;
            spec.metrics = spawned.metrics;
            workers.push(spec);
        }
        let mut router_config = RouterConfig { block_size, workers, ..RouterConfig::default() };
        router_config.scheduler.policy = args.policy;
        router_config.validate()?;
        let n = router_config.workers.len();
        let router = Arc::new(RouterState::new(router_config));
        let _tasks = kvroute_router::spawn_background(&router)?;
        let preprocessor = Arc::new(Preprocessor::load(&model_dir)?);
        let state = Arc::new(FrontendState::new(preprocessor, Fetcher::new(fetch)?, router));
        let local = listener.local_addr()?;
        #[allow(clippy::print_stdout)]
        {
            println!("kvroute serve ready on http://{local} ({n} workers, policy {})", args.policy);
            println!(
                "try: curl -s http://{local}/v1/chat/completions -H 'content-type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":16}}'"
            );
        }
        serve_front_door(listener, state).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Serves the front door until Ctrl-C/SIGTERM: then stops accepting and gives open streams
/// 5 s to finish.
pub(crate) async fn serve_front_door(
    listener: tokio::net::TcpListener,
    state: Arc<FrontendState>,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = kvroute_frontend::serve(listener, state, async move {
        crate::shutdown_signal().await;
        let _ = stop_tx.send(());
    });
    let grace = async move {
        let _ = stop_rx.await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        result = server => result?,
        () = grace => tracing::warn!("open streams cancelled after 5 s"),
    }
    Ok(())
}

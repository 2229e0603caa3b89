//! `kvroute frontend`: the front door alone, with a remote or an embedded router.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvroute_core::BlockSize;
use kvroute_core::schedule::PolicyKind;
use kvroute_frontend::FrontendState;
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::{FetchConfig, Fetcher};
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};

#[derive(Debug, Args)]
pub(crate) struct FrontendArgs {
    /// Address of the OpenAI-compatible API.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port of the API (0: any free port).
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8000)]
    port: u16,
    /// A `kvroute router` to ask (its /find_best_worker and request lifecycle). Without it, a
    /// router runs embedded, subscribed to the workers' events.
    #[arg(long, env = "KVROUTE_ROUTER_URL")]
    router_url: Option<String>,
    /// A worker: id and url (and, for an embedded router, events, replay, metrics, ...), as
    /// in `kvroute router --worker`. Repeatable.
    #[arg(long = "worker", env = "KVROUTE_WORKERS", value_delimiter = ';', required = true)]
    workers: Vec<WorkerSpec>,
    /// Tokens per KV block (must match the router's and the engines').
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// Policy of an embedded router: kv, dynamo, round-robin, random, least-loaded.
    #[arg(long, env = "KVROUTE_POLICY", default_value = "kv")]
    policy: PolicyKind,
    /// Model directory (tokenizer + chat template); default: models/kvroute-tiny.
    #[arg(long, env = "KVROUTE_MODEL_PATH")]
    model_path: Option<PathBuf>,
    /// Fetch image URLs that resolve to loopback or private addresses.
    #[arg(long, env = "KVROUTE_ALLOW_PRIVATE_IMAGE_URLS")]
    allow_private_image_urls: bool,
}

pub(crate) fn run(args: FrontendArgs) -> anyhow::Result<ExitCode> {
    crate::init_tracing();
    let block_size = BlockSize::new(args.block_size).context("--block-size")?;
    let model_dir = args.model_path.clone().unwrap_or_else(Preprocessor::default_model_dir);
    let preprocessor = Arc::new(Preprocessor::load(&model_dir)?);
    let fetcher = Fetcher::new(FetchConfig {
        allow_private: args.allow_private_image_urls,
        ..FetchConfig::default()
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let addr: SocketAddr =
            format!("{}:{}", args.host, args.port).parse().context("--host/--port")?;
        let listener =
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let mut _tasks = None;
        let state = match &args.router_url {
            Some(url) => {
                FrontendState::remote(preprocessor, fetcher, url, &args.workers, block_size)
            }
            None => {
                let mut config = RouterConfig {
                    block_size,
                    workers: args.workers.clone(),
                    ..RouterConfig::default()
                };
                config.scheduler.policy = args.policy;
                config.validate()?;
                let router = Arc::new(RouterState::new(config));
                _tasks = Some(kvroute_router::spawn_background(&router)?);
                FrontendState::new(preprocessor, fetcher, router)
            }
        };
        let local = listener.local_addr()?;
        #[allow(clippy::print_stdout)]
        {
            let via = args.router_url.as_deref().unwrap_or("an embedded router");
            println!(
                "kvroute frontend ready on http://{local} ({} workers, via {via})",
                args.workers.len()
            );
        }
        super::serve::serve_front_door(listener, Arc::new(state)).await?;
        Ok(ExitCode::SUCCESS)
    })
}

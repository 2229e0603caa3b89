//! `kvroute router`: the standalone router service (SPEC section 8).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvroute_core::BlockSize;
use kvroute_core::schedule::PolicyKind;
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};

#[derive(Debug, Args)]
pub(crate) struct RouterArgs {
    /// Address to listen on.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8001)]
    port: u16,
    /// A worker, as comma-separated key=value pairs: id (required), url, events, replay,
    /// metrics, block_size, dp_size, image_token_id, vocab_size, format
    /// (vllm|sglang|trtllm-json|trtllm-msgpack|kvroute). Repeat for each worker; in the env
    /// twin, separate workers with ';'.
    /// Example: --worker id=7,url=http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
    #[arg(long = "worker", env = "KVROUTE_WORKERS", value_delimiter = ';', verbatim_doc_comment)]
    workers: Vec<WorkerSpec>,
    /// TOML file with `block_size`, `shards` and `[[workers]]` tables of the --worker keys
    /// (flags add to it).
    #[arg(long, env = "KVROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// Tokens per KV block (engines must use the same).
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// Routing policy: kv (predicted time to first token), dynamo (Dynamo's cost), or the
    /// baselines round-robin, random, least-loaded.
    #[arg(long, env = "KVROUTE_POLICY", default_value = "kv")]
    policy: PolicyKind,
    /// Softmax temperature of the choice (0: always the lowest cost).
    #[arg(long, env = "KVROUTE_TEMPERATURE", default_value_t = 0.0)]
    temperature: f64,
    /// Weight of prefill against decode blocks in the dynamo policy.
    #[arg(long, env = "KVROUTE_OVERLAP_WEIGHT", default_value_t = 1.0)]
    overlap_weight: f64,
    /// Index shards (parallel readers, one writer each).
    #[arg(long, env = "KVROUTE_SHARDS", default_value_t = 4)]
    shards: usize,
    /// Most (worker, block) pairs the index keeps before evicting the coldest (~48 bytes each).
    #[arg(long, env = "KVROUTE_MAX_INDEX_BLOCKS", default_value_t = 16 << 20)]
    max_index_blocks: usize,
    /// Most data-parallel ranks of one worker; events naming a higher rank are refused.
    #[arg(long, env = "KVROUTE_MAX_DP_SIZE", default_value_t = kvroute_router::config::DEFAULT_MAX_DP_SIZE)]
    max_dp_size: u32,
}

impl RouterArgs {
    fn config(&self) -> anyhow::Result<RouterConfig> {
        let mut config = match &self.config {
            Some(path) => RouterConfig::from_toml_file(path)?,
            None => RouterConfig {
                block_size: BlockSize::new(self.block_size).context("--block-size")?,
                shards: self.shards,
                ..RouterConfig::default()
            },
        };
        config.workers.extend(self.workers.iter().cloned());
        config.index.max_held_blocks = Some(self.max_index_blocks);
        config.max_dp_size = self.max_dp_size;
        config.scheduler.policy = self.policy;
        config.scheduler.temperature = self.temperature;
        config.scheduler.overlap_weight = self.overlap_weight;
        anyhow::ensure!(self.temperature >= 0.0, "--temperature must be >= 0");
        config.validate()?;
        Ok(config)
    }
}

pub(crate) fn run(args: RouterArgs) -> anyhow::Result<ExitCode> {
    crate::init_tracing();
    let config = args.config()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port)
            .parse()
            .with_context(|| format!("--host {} --port {}", args.host, args.port))?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let workers = config.workers.len();
        let state = Arc::new(RouterState::new(config));
        let _tasks = kvroute_router::spawn_background(&state)?;
        let local = listener.local_addr()?;
        tracing::info!(%local, workers, policy = %args.policy, "kvroute router ready");
        #[allow(clippy::print_stdout)]
        {
            println!("kvroute router listening on http://{local} ({workers} configured workers, policy {})", args.policy);
            println!(
                "try: curl -s http://{local}/find_best_worker -H 'content-type: application/json' -d '{{\"local_hashes\":[1,2,3],\"num_tokens\":48}}'"
            );
        }
        kvroute_router::serve(listener, state, crate::shutdown_signal()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

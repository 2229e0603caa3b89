//! `kvroute mocker`: one simulated engine (SPEC section 9).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use axum::serve::ListenerExt as _;
use clap::Args;
use kvroute_core::BlockSize;
use kvroute_mocker::{Endpoints, EngineConfig, FetchConfig, MockerConfig, Timing};

/// A simulated engine's knobs, the same on `kvroute mocker` and `kvroute serve` (SPEC 11);
/// defaults follow Dynamo's mocker.
#[derive(Debug, Args)]
pub(crate) struct EngineArgs {
    /// KV cache capacity in blocks.
    #[arg(long, env = "KVROUTE_NUM_BLOCKS", default_value_t = 16_384)]
    pub(crate) num_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    pub(crate) block_size: u32,
    /// Most requests running at once.
    #[arg(long, env = "KVROUTE_MAX_NUM_SEQS", default_value_t = 256)]
    pub(crate) max_num_seqs: usize,
    /// Token budget of one scheduler step (chunked prefill).
    #[arg(long, env = "KVROUTE_MAX_BATCHED_TOKENS", default_value_t = 8192)]
    pub(crate) max_batched_tokens: usize,
    /// Time runs this many times faster than the timing model (1: as on a real GPU).
    #[arg(long, env = "KVROUTE_SPEEDUP", default_value_t = 1.0)]
    pub(crate) speedup: f64,
    /// Model directory (tokenizer.json + tokenizer_config.json); default: the repository's
    /// models/kvroute-tiny.
    #[arg(long, env = "KVROUTE_MODEL_PATH")]
    pub(crate) model_path: Option<PathBuf>,
    /// Seed of the generated words.
    #[arg(long, env = "KVROUTE_SEED", default_value_t = 0)]
    pub(crate) seed: u64,
    /// Fetch image URLs that resolve to loopback or private addresses (refused by default,
    /// so the server is no relay into private networks).
    #[arg(long, env = "KVROUTE_ALLOW_PRIVATE_IMAGE_URLS")]
    pub(crate) allow_private_image_urls: bool,
}

impl EngineArgs {
    pub(crate) fn block_size(&self) -> anyhow::Result<BlockSize> {
        BlockSize::new(self.block_size).context("--block-size")
    }

    pub(crate) fn model_dir(&self) -> PathBuf {
        self.model_path.clone().unwrap_or_else(kvroute_preprocess::Preprocessor::default_model_dir)
    }

    pub(crate) fn fetch(&self) -> FetchConfig {
        FetchConfig { allow_private: self.allow_private_image_urls, ..FetchConfig::default() }
    }

    /// The engine settings, checked.
    pub(crate) fn engine(&self) -> anyhow::Result<EngineConfig> {
        anyhow::ensure!(self.speedup > 0.0, "--speedup must be > 0");
        anyhow::ensure!(
            self.max_num_seqs > 0 && self.max_batched_tokens > 0,
            "--max-num-seqs and --max-batched-tokens must be > 0"
        );
        Ok(EngineConfig {
            num_blocks: self.num_blocks,
            block_size: self.block_size()?,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            timing: Timing { speedup: self.speedup },
        })
    }

    /// A simulated engine's configuration; `k` offsets the seed (one per embedded worker).
    pub(crate) fn mocker(&self, k: u64, endpoints: Endpoints) -> anyhow::Result<MockerConfig> {
        Ok(MockerConfig {
            engine: self.engine()?,
            endpoints,
            model_dir: self.model_dir(),
            seed: self.seed + k,
            dp_rank: 0,
            fetch: self.fetch(),
        })
    }
}

#[derive(Debug, Args)]
pub(crate) struct MockerArgs {
    /// Address of the OpenAI-compatible API.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port of the API (0: any free port).
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8100)]
    port: u16,
    #[command(flatten)]
    engine: EngineArgs,
    /// ZMQ PUB endpoint of the KV events (vLLM format; port 0: any).
    #[arg(long, env = "KVROUTE_EVENTS", default_value = "tcp://127.0.0.1:0")]
    events: String,
    /// ZMQ ROUTER endpoint replaying the last KV event batches.
    #[arg(long, env = "KVROUTE_REPLAY", default_value = "tcp://127.0.0.1:0")]
    replay: String,
    /// ZMQ PUB endpoint of the load reports (JSON).
    #[arg(
        long = "load-metrics",
        env = "KVROUTE_LOAD_METRICS",
        default_value = "tcp://127.0.0.1:0"
    )]
    load_metrics: String,
}

pub(crate) fn run(args: &MockerArgs) -> anyhow::Result<ExitCode> {
    crate::init_tracing();
    let endpoints = Endpoints {
        events: Some(args.events.clone()),
        replay: Some(args.replay.clone()),
        metrics: Some(args.load_metrics.clone()),
    };
    let config = args.engine.mocker(0, endpoints)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().context("--host/--port")?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let state = kvroute_mocker::start(config).await?;
        let local = listener.local_addr()?;
        let b = &state.engine.bound;
        #[allow(clippy::print_stdout)]
        {
            println!(
                "kvroute mocker listening on http://{local} (model {}); events {} replay {} load {}",
                state.preprocessor.model_name(),
                b.events.as_deref().unwrap_or("-"),
                b.replay.as_deref().unwrap_or("-"),
                b.metrics.as_deref().unwrap_or("-"),
            );
            println!(
                "try: curl -s http://{local}/v1/chat/completions -H 'content-type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}]}}'"
            );
        }
        // Streamed chunks go out at once (no Nagle delay behind a delayed ACK).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, kvroute_mocker::http::app(state))
            .with_graceful_shutdown(crate::shutdown_signal())
            .await?;
        Ok(ExitCode::SUCCESS)
    })
}

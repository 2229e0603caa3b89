//! `kvroute`: parse the command line, run the chosen subcommand. Everything else lives in the
//! library crates.

use std::process::ExitCode;

use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use kvroute_stack::telemetry;

mod cmd;

/// KV-cache-aware router for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about, long_about = None)]
struct Cli {
    /// Log lines as text (coloured on a terminal only) or as JSON objects. What is logged:
    /// KVROUTE_LOG (or RUST_LOG) as a tracing filter, e.g. KVROUTE_LOG=kvroute_router=debug.
    #[arg(long, global = true, env = "KVROUTE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The log's lines: text (coloured on a terminal only) or JSON objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hash token blocks: JSON Lines on stdin, one {"local_hashes","sequence_hashes"} line out per
    /// input line (debugging and conformance against other implementations).
    Hash(cmd::hash::HashArgs),
    /// Standalone router: subscribes to the workers' KV events and answers
    /// POST /find_best_worker (plus /events, /debug/*, /workers, /metrics, /health).
    Router(Box<cmd::router::RouterArgs>),
    /// One simulated engine (no GPU): OpenAI API, vLLM-format KV events on ZMQ with replay,
    /// load reports; its cache and timing behave like vLLM's.
    Mocker(Box<cmd::mocker::MockerArgs>),
    /// The main job: an OpenAI-compatible front door, the router and (by default) 4 simulated
    /// workers in one process; `--worker` adds external workers instead.
    Serve(Box<cmd::serve::ServeArgs>),
    /// The OpenAI-compatible front door alone, routing through a `kvroute router` at
    /// --router-url (or an embedded router over --worker) to the workers' URLs.
    Frontend(Box<cmd::frontend::FrontendArgs>),
    /// Benchmark: seeded workloads (shared-prefix, multi-turn, multimodal, random) played
    /// against a fresh simulated fleet per routing policy, or against --target; writes
    /// report.md, results.json and SVG plots.
    Bench(Box<kvroute_bench::BenchArgs>),
    /// Keeps one worker registered in the fleet's NATS key-value bucket (--members-bucket)
    /// while it runs: a sidecar beside an engine, for fleets without Kubernetes or DNS. On
    /// Ctrl-C or SIGTERM the registration is deleted and the routers drain the worker.
    Register(Box<cmd::register::RegisterArgs>),
}

fn main() -> ExitCode {
    let mut command = cmd::decorated(Cli::command());
    let matches = command.get_matches_mut();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut command).exit());
    let default_filter = match cli.command {
        Command::Bench(_) => "warn,kvroute_bench=info",
        _ => "info",
    };
    let json = cli.log_format == LogFormat::Json;
    telemetry::set_logging(telemetry::Logging { json, default: default_filter });
    // The serving commands start their log once their settings are read (with the spans'
    // exporter, when they ask for one); the others start it now.
    if !matches!(cli.command, Command::Serve(_) | Command::Frontend(_) | Command::Router(_)) {
        let _ = telemetry::init(None, "");
    }
    let result = match &cli.command {
        Command::Hash(args) => cmd::hash::run(args),
        Command::Router(args) => cmd::router::run(args),
        Command::Mocker(args) => cmd::mocker::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Frontend(args) => cmd::frontend::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Register(args) => cmd::register::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("kvroute: {err:#}");
            }
            ExitCode::FAILURE
        }
    }
}

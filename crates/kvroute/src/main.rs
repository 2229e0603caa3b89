//! `kvroute`: parse the command line, run the chosen subcommand. Everything else lives in the
//! library crates.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

/// KV-cache-aware router for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hash token blocks: JSON Lines on stdin, one {"local_hashes","sequence_hashes"} line out per
    /// input line (debugging and conformance against other implementations).
    Hash(cmd::hash::HashArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => cmd::hash::run(&args),
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

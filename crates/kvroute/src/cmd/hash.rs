//! `kvroute hash`: JSON Lines in, block and sequence hashes out.
//!
//! Input, one object per line:
//! `{"tokens":[u32..], "kv_block_size":n, "block_mm_infos":[null | {"mm_objects":[..]}]?, "lora_name":str?}`
//! Output, one line per input line: `{"local_hashes":[u64..],"sequence_hashes":[u64..]}`, or
//! `{"error":"..."}` for a line that cannot be hashed; the command goes on and exits 1 at the end
//! if any line failed. Blank lines are skipped.

use std::io::{self, BufRead, BufWriter, Write};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use kvroute_core::{BlockExtraInfo, BlockHasher, BlockSize, LocalBlockHash, SequenceHash};
use serde::{Deserialize, Serialize};

#[derive(Debug, Args)]
pub(crate) struct HashArgs {
    /// Salt every line with this cache namespace (vLLM/SGLang `cache_salt`) unless the line
    /// names its own `cache_namespace`.
    #[arg(long, env = "KVROUTE_CACHE_NAMESPACE")]
    cache_namespace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HashRequest {
    tokens: Vec<u32>,
    kv_block_size: u32,
    #[serde(default)]
    block_mm_infos: Option<Vec<Option<BlockExtraInfo>>>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_namespace: Option<String>,
}

#[derive(Debug, Serialize)]
struct HashResponse {
    local_hashes: Vec<LocalBlockHash>,
    sequence_hashes: Vec<SequenceHash>,
}

#[derive(Debug, Serialize)]
struct HashFailure {
    error: String,
}

pub(crate) fn run(args: &HashArgs) -> anyhow::Result<ExitCode> {
    let stdin = io::stdin().lock();
    let mut out = BufWriter::new(io::stdout().lock());
    let failed = hash_lines(stdin, &mut out, args)?;
    out.flush().context("writing to stdout")?;
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Hashes every line of `input` onto `out`; returns how many lines failed.
fn hash_lines(input: impl BufRead, out: &mut impl Write, args: &HashArgs) -> anyhow::Result<usize> {
    let mut failed = 0;
    for (index, line) in input.lines().enumerate() {
        let line = line.with_context(|| format!("reading line {} of stdin", index + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let written = match hash_line(&line, args) {
            Ok(response) => serde_json::to_writer(&mut *out, &response),
            Err(error) => {
                failed += 1;
                let error = format!("line {}: {error}", index + 1);
                serde_json::to_writer(&mut *out, &HashFailure { error })
            }
        };
        written.context("writing to stdout")?;
        out.write_all(b"\n").context("writing to stdout")?;
    }
    Ok(failed)
}

fn hash_line(line: &str, args: &HashArgs) -> anyhow::Result<HashResponse> {
    let request: HashRequest = serde_json::from_str(line)?;
    let namespace = request.cache_namespace.as_deref().or(args.cache_namespace.as_deref());
    let hasher = BlockHasher::new(BlockSize::new(request.kv_block_size)?)
        .with_lora(request.lora_name.as_deref())
        .with_namespace(namespace);
    let local_hashes = hasher.local_hashes(&request.tokens, request.block_mm_infos.as_deref());
    let sequence_hashes = kvroute_core::sequence_hashes(&local_hashes);
    Ok(HashResponse { local_hashes, sequence_hashes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_lines(input: &str) -> (Vec<serde_json::Value>, usize) {
        let mut out = Vec::new();
        let args = HashArgs { cache_namespace: None };
        let failed = hash_lines(input.as_bytes(), &mut out, &args).unwrap();
        let lines = String::from_utf8(out).unwrap();
        (lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect(), failed)
    }

    #[test]
    fn good_bad_and_blank_lines() {
        let input = concat!(
            r#"{"tokens":[1,2,3,4,1,2,3,4,1,2,3,4,1,2,3,4,1,2,3,4,1,2,3,4,1,2,3,4,1,2,3,4],"kv_block_size":32}"#,
            "\n\n",
            r#"{"tokens":[1,2],"kv_block_size":0}"#,
            "\nnot json\n",
            r#"{"tokens":[1,2,3,4],"kv_block_size":2,"block_mm_infos":[null,{"mm_objects":[{"mm_hash":18446744073709551615,"offsets":[[0,2]]}]}]}"#,
            "\n",
        );
        let (lines, failed) = run_lines(input);
        assert_eq!(lines.len(), 4);
        assert_eq!(failed, 2);
        assert_eq!(lines[0]["local_hashes"][0].as_u64(), Some(15_883_719_750_896_736_839));
        assert!(
            lines[1]["error"].as_str().unwrap().contains("kv_block_size must be greater than 0")
        );
        assert!(lines[2]["error"].as_str().unwrap().starts_with("line 4:"));
        assert_eq!(lines[3]["sequence_hashes"].as_array().unwrap().len(), 2);
    }
}

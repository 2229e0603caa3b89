//! A recorded trace replayed ([`TraceReplay`]): Mooncake's JSONL format, each line a
//! request's arrival, its prompt as hash ids of 512-token blocks, and its output length.

use std::collections::HashMap;

use anyhow::Context;
use kvroute_core::BlockSize;
use kvroute_core::schedule::Rng;
use serde::Serialize;

use super::draw::*;
use super::kind::WorkloadKind;
use super::request::*;

/// `trace`: a recorded trace in the Mooncake format replayed, one JSON object per line:
/// `timestamp` (ms from the trace's start), `input_length`, `output_length` and `hash_ids`,
/// the prompt's blocks of [`TRACE_BLOCK_TOKENS`] tokens as ids (equal leading ids, equal
/// prefix; the last block may be partial).
///
/// Prompts are synthesised so that equal ids give equal tokens: id `h`'s block is drawn from
/// a generator seeded by `h` (and the seed), and a partial last block is the first tokens of
/// its id's block, so two requests sharing ids share exactly those tokens. For a small fleet
/// every length scales by `block_tokens / 512` (ids stay block-aligned when `block_tokens`
/// is a multiple of the block size); arrival times scale by `time_scale`.
#[derive(Clone, Debug, Serialize)]
pub struct TraceReplay {
    pub path: std::path::PathBuf,
    /// The trace's first requests replayed.
    pub requests: usize,
    /// Tokens each `hash_id` becomes.
    pub block_tokens: usize,
    /// Arrival times are multiplied by this (0.5: twice as fast).
    pub time_scale: f64,
    /// Instead of `time_scale`: the mean arrival rate to scale the trace to (requests/s).
    pub rate: Option<f64>,
}

/// Tokens per `hash_id` in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

#[derive(Debug, serde::Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

impl TraceReplay {
    /// The committed trace (`traces/mooncake_conversation_trace.jsonl` of the repository):
    /// looked up under the working directory, then the source tree this binary was built from.
    pub fn default_path() -> std::path::PathBuf {
        let relative = std::path::Path::new("traces/mooncake_conversation_trace.jsonl");
        if relative.exists() {
            return relative.to_path_buf();
        }
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative)
    }

    fn read(&self) -> anyhow::Result<Vec<TraceLine>> {
        let text = std::fs::read_to_string(&self.path).with_context(|| {
            format!("reading the trace {} (give one with --trace PATH)", self.path.display())
        })?;
        let mut lines = Vec::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            if lines.len() == self.requests {
                break;
            }
            let parsed: TraceLine = serde_json::from_str(line)
                .with_context(|| format!("{} line {}", self.path.display(), n + 1))?;
            anyhow::ensure!(
                !parsed.hash_ids.is_empty() && parsed.input_length > 0,
                "{} line {}: a request needs hash_ids and an input_length",
                self.path.display(),
                n + 1
            );
            lines.push(parsed);
        }
        anyhow::ensure!(!lines.is_empty(), "{}: no requests", self.path.display());
        Ok(lines)
    }

    pub fn generate(&self, seed: u64, bs: BlockSize, warmup: f64) -> anyhow::Result<Workload> {
        anyhow::ensure!(self.block_tokens > 0, "tokens per trace block must be > 0");
        let lines = self.read()?;
        let t0 = lines.iter().map(|l| l.timestamp).fold(f64::INFINITY, f64::min);
        let span = (lines.iter().map(|l| l.timestamp).fold(0.0, f64::max) - t0) / 1000.0;
        let scale = match self.rate {
            Some(rate) if span > 0.0 => lines.len() as f64 / span / rate,
            _ => self.time_scale,
        };
        let scaled =
            |tokens: usize| (tokens * self.block_tokens).div_ceil(TRACE_BLOCK_TOKENS).max(1);
        let mut blocks: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut requests = Vec::with_capacity(lines.len());
        let mut prompt_tokens = 0;
        for (i, line) in lines.iter().enumerate() {
            let full = line.hash_ids.len() - 1;
            let last = line.input_length.saturating_sub(full * TRACE_BLOCK_TOKENS);
            let last = scaled(last.clamp(1, TRACE_BLOCK_TOKENS)).min(self.block_tokens);
            let mut tokens = Vec::with_capacity(full * self.block_tokens + last);
            for (k, id) in line.hash_ids.iter().enumerate() {
                let block = blocks.entry(*id).or_insert_with(|| {
                    let mut rng = Rng::new(seed ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    random_tokens(&mut rng, self.block_tokens)
                });
                let take = if k == full { last } else { self.block_tokens };
                tokens.extend_from_slice(&block[..take]);
            }
            prompt_tokens += tokens.len();
            let at = (line.timestamp - t0) / 1000.0 * scale;
            let output = scaled(line.output_length) as u32;
            requests.push(tokens_request(Start::At(at), tokens, output, i, bs));
        }
        mark_warmup(&mut requests, warmup);
        let n = requests.len();
        Ok(Workload {
            kind: WorkloadKind::Trace,
            params: vec![
                ("trace".into(), format!("{}, its first {n} requests", self.path.display())),
                (
                    "lengths".into(),
                    format!(
                        "x {}/{TRACE_BLOCK_TOKENS}: each hash_id {} tokens; prompts {} tokens on average",
                        self.block_tokens,
                        self.block_tokens,
                        prompt_tokens / n
                    ),
                ),
                (
                    "arrivals".into(),
                    format!(
                        "the trace's, times x {scale:.3}: {:.1} s, {:.1} req/s",
                        span * scale,
                        n as f64 / (span * scale).max(f64::MIN_POSITIVE)
                    ),
                ),
            ],
            requests,
            adapters: Vec::new(),
        })
    }
}

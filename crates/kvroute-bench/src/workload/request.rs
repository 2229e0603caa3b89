//! A request of a workload as the harness sends it, and a workload: its requests in order.

use std::sync::Arc;

use super::draw::token_blocks;
use super::kind::WorkloadKind;
use kvroute_core::BlockSize;
use kvroute_preprocess::Preprocessor;
use serde::Serialize;
use serde_json::Value;

/// What a request sends.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// `/v1/completions` with token ids.
    Tokens(Vec<u32>),
    /// `/v1/completions` with text (see [`Workload::into_text`]).
    Text(String),
    /// `/v1/chat/completions` with these messages (images inline as `data:` URLs).
    Chat(Arc<Value>),
    /// `/v1/chat/completions` with the user's conversation so far (the server's answers
    /// included) and then `text`; the first turn opens with the user's `context` as the system
    /// message.
    Turn { context: Option<Arc<str>>, text: String },
}

/// When a request leaves.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Start {
    /// Seconds after the run starts.
    At(f64),
    /// `think` seconds after request `prev` finished.
    After { prev: usize, think: f64 },
}

#[derive(Clone, Debug)]
pub struct BenchRequest {
    pub start: Start,
    pub prompt: Prompt,
    pub max_tokens: u32,
    /// Prompt tokens as the engine sees them (images expanded); empty for a conversation turn
    /// (known when sent).
    pub prompt_ids: Arc<Vec<u32>>,
    /// Sequence hashes of the prompt's full blocks, as the engine computes them (empty for a
    /// conversation turn).
    pub blocks: Vec<u64>,
    /// The group, user or image set the request belongs to (for tests and plots).
    pub group: usize,
    /// Left out of the latency figures (the start of the schedule, or a user's first rounds).
    pub warmup: bool,
    /// The LoRA adapter it asks for (its `model`; its blocks are salted with it).
    pub adapter: Option<Arc<str>>,
    /// The session it belongs to (sent as `prompt_cache_key`).
    pub session: Option<Arc<str>>,
    /// Its class for flow control (sent as `x-kvroute-priority`, `x-kvroute-tenant` and
    /// `x-kvroute-ttft-slo-ms`); none: the headers are not sent.
    pub class: Option<Arc<RequestTag>>,
}

/// A request's class in an overload workload ([`crate::overload`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestTag {
    /// `interactive`, `standard` or `batch`.
    pub class: &'static str,
    pub tenant: Arc<str>,
    pub priority: i32,
    pub slo_ms: Option<u32>,
}

#[derive(Clone, Debug)]
pub struct Workload {
    pub kind: WorkloadKind,
    /// Human-readable parameters, printed in the report.
    pub params: Vec<(String, String)>,
    pub requests: Vec<BenchRequest>,
    /// The adapters its requests ask for, in popularity order (the fleet serves them all).
    pub adapters: Vec<String>,
}

impl Workload {
    /// Says in its parameters that it runs on `fleet`, sized to it by `flag`.
    pub fn sized(mut self, fleet: &crate::run::FleetConfig, flag: &str) -> Self {
        let line = format!(
            "{} workers x {} blocks of {} tokens ({} tokens in all), sized to the workload ({flag})",
            fleet.engines(),
            fleet.num_blocks,
            fleet.block_size,
            fleet.capacity_blocks() * fleet.block_size as usize
        );
        self.params.push(("fleet".into(), line));
        self
    }

    /// Token-id prompts become text, for routers that take no token ids (sglang-router): each
    /// token becomes a word of the model's vocabulary (by its id; the prompt's first from the
    /// words without a leading space), and a run of words tokenizes back to exactly those
    /// words ([`kvroute_preprocess::Words`]), so equal prefixes stay equal block for block. The
    /// prompt as the engine sees it is the tokenized text (checked to end with the words).
    pub fn into_text(mut self, preprocessor: &Preprocessor, bs: BlockSize) -> anyhow::Result<Self> {
        let words = preprocessor.words();
        anyhow::ensure!(words.usable(), "--text-prompts: the model's vocabulary has no words");
        let mut converted = 0;
        for request in &mut self.requests {
            let Prompt::Tokens(tokens) = &request.prompt else { continue };
            let ids: Vec<u32> = tokens
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    let pool = match i == 0 && !words.first.is_empty() {
                        true => &words.first,
                        false => &words.rest,
                    };
                    pool[t as usize % pool.len()]
                })
                .collect();
            let text = preprocessor.decode(&ids)?;
            let seen = preprocessor.prepare_prompt(&text)?.tokens;
            anyhow::ensure!(
                seen.ends_with(&ids),
                "--text-prompts: a prompt's words do not tokenize back to themselves"
            );
            request.blocks = token_blocks(&seen, bs, request.adapter.as_deref());
            request.prompt_ids = Arc::new(seen);
            request.prompt = Prompt::Text(text);
            converted += 1;
        }
        if converted > 0 {
            self.params.push(("prompts".into(), "text (words of the vocabulary)".into()));
        }
        Ok(self)
    }
}

pub(super) fn tokens_request(
    start: Start,
    tokens: Vec<u32>,
    max_tokens: u32,
    group: usize,
    bs: BlockSize,
) -> BenchRequest {
    BenchRequest {
        start,
        blocks: token_blocks(&tokens, bs, None),
        prompt_ids: Arc::new(tokens.clone()),
        prompt: Prompt::Tokens(tokens),
        max_tokens,
        group,
        warmup: false,
        adapter: None,
        session: None,
        class: None,
    }
}

/// Marks the first `fraction` of the requests (by schedule) as warm-up.
pub(super) fn mark_warmup(requests: &mut [BenchRequest], fraction: f64) {
    let n = ((requests.len() as f64 * fraction).round() as usize).min(requests.len());
    for r in &mut requests[..n] {
        r.warmup = true;
    }
}

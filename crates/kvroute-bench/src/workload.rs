//! Seeded, reproducible workloads with token-exact prompts.
//!
//! Every request carries the prompt as the engine will see it: the token ids (text workloads
//! send them as ids to `/v1/completions`, so nothing is lost to a tokenizer round trip) or,
//! for images, the chat messages plus the tokens and block hashes the shared preprocessor
//! derives from them. Multi-turn requests are chat turns: each resends the conversation with
//! the server's own answers, so their prompts are known only when sent; the harness derives
//! their tokens then, with the same preprocessor. From the block hashes (prompts' and those
//! the answers fill) the harness computes the best achievable cache hit rate (see
//! [`crate::stats`]).
//!
//! Arrivals are open loop: a Poisson process at a given rate, drawn once, so every policy of
//! a run sees the same schedule. Multi-turn rounds are the exception by nature: a user's next
//! round leaves a (pre-drawn) think time after the previous answer arrived.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use base64::Engine as _;
use kvroute_core::schedule::Rng;
use kvroute_core::{BlockHasher, BlockSize, sequence_hashes};
use kvroute_preprocess::{ChatMessage, Preprocessor, images};
use serde::Serialize;
use serde_json::{Value, json};

/// Token ids drawn for synthetic text: inside the model's vocabulary, clear of its special
/// tokens (which sit at the top).
const TOKEN_LO: u32 = 256;
const TOKEN_HI: u32 = 900;

/// The workloads `kvroute bench` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    SharedPrefix,
    MultiTurn,
    Multimodal,
    Random,
    /// A recorded trace replayed ([`TraceReplay`]).
    Trace,
    /// Requests for many LoRA adapters of Zipf popularity ([`MultiLora`]).
    MultiLora,
    /// `multi-turn` with each user's requests tagged as a session (`prompt_cache_key`).
    Sessions,
    /// Long prompts (a shared document, then a long unique part) and long answers: where
    /// prefills stall decodes, so where disaggregation should matter ([`LongPrompts`]).
    LongPrompt,
    /// Classes and tenants past the fleet's capacity (`--overload`, [`crate::overload`]); not
    /// one of `--workloads`.
    Overload,
}

impl WorkloadKind {
    pub const ALL: [Self; 8] = [
        Self::SharedPrefix,
        Self::MultiTurn,
        Self::Multimodal,
        Self::Random,
        Self::Trace,
        Self::MultiLora,
        Self::Sessions,
        Self::LongPrompt,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::SharedPrefix => "shared-prefix",
            Self::MultiTurn => "multi-turn",
            Self::Multimodal => "multimodal",
            Self::Random => "random",
            Self::Trace => "trace",
            Self::MultiLora => "multi-lora",
            Self::Sessions => "sessions",
            Self::LongPrompt => "long-prompt",
            Self::Overload => "overload",
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WorkloadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!(
                "unknown workload {s:?} (shared-prefix, multi-turn, multimodal, random, trace, multi-lora, sessions, long-prompt)"
            )
        })
    }
}

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

/// A request's class in an overload workload ([`overload`]).
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

/// `shared-prefix`: groups of prompts sharing a long system prompt.
#[derive(Clone, Debug, Serialize)]
pub struct SharedPrefix {
    pub groups: usize,
    pub prompts_per_group: usize,
    pub system_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: u32,
    pub rate: f64,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        Self {
            groups: 12,
            prompts_per_group: 64,
            system_tokens: 2048,
            question_tokens: 64,
            output_tokens: 32,
            rate: 24.0,
        }
    }
}

/// `multi-turn`: users resending their growing conversation.
#[derive(Clone, Debug, Serialize)]
pub struct MultiTurn {
    pub users: usize,
    pub rounds: usize,
    /// Each user's own opening context.
    pub context_tokens: usize,
    /// Tokens of each new user turn.
    pub turn_tokens: usize,
    /// Tokens of each answer (also what the conversation keeps of it).
    pub output_tokens: u32,
    /// Users arrive at this rate (per second).
    pub rate: f64,
    /// Mean think time between an answer and the next round (exponential), seconds.
    pub think_time: f64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        Self {
            users: 24,
            rounds: 28,
            context_tokens: 256,
            turn_tokens: 32,
            output_tokens: 32,
            rate: 12.0,
            think_time: 0.5,
        }
    }
}

/// `multimodal`: a few instruction texts, each with 1-2 images drawn by Zipf popularity.
#[derive(Clone, Debug, Serialize)]
pub struct Multimodal {
    pub requests: usize,
    /// Distinct generated images (same size, different pixels).
    pub images: usize,
    /// Zipf exponent of image popularity.
    pub zipf: f64,
    /// Share of requests with two images (the rest have one).
    pub two_images: f64,
    /// Distinct instruction texts.
    pub texts: usize,
    /// Side of the square images, pixels.
    pub image_side: u32,
    pub output_tokens: u32,
    pub rate: f64,
}

impl Default for Multimodal {
    fn default() -> Self {
        Self {
            requests: 240,
            images: 24,
            zipf: 1.1,
            two_images: 0.4,
            texts: 4,
            image_side: 336,
            output_tokens: 32,
            rate: 16.0,
        }
    }
}

/// `random`: nothing shared (the control).
#[derive(Clone, Debug, Serialize)]
pub struct RandomPrompts {
    pub requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: u32,
    pub rate: f64,
}

impl Default for RandomPrompts {
    fn default() -> Self {
        Self { requests: 160, prompt_tokens: 1024, output_tokens: 32, rate: 12.0 }
    }
}

/// Exponential with the given mean.
pub fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.unit()).ln()
}

/// `n` Poisson arrival times at `rate` per second, the first at 0.
pub fn poisson_arrivals(rng: &mut Rng, n: usize, rate: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += exponential(rng, 1.0 / rate);
            }
            t
        })
        .collect()
}

pub(crate) fn random_tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| TOKEN_LO + rng.below((TOKEN_HI - TOKEN_LO) as usize) as u32).collect()
}

fn shuffle<T>(rng: &mut Rng, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// Sequence hashes of the full blocks of a text prompt (salted with its adapter, if any).
pub fn token_blocks(tokens: &[u32], block_size: BlockSize, lora: Option<&str>) -> Vec<u64> {
    let local = BlockHasher::new(block_size).with_lora(lora).local_hashes(tokens, None);
    sequence_hashes(&local).into_iter().map(|h| h.0).collect()
}

/// The sequence hashes of every full block once `more` tokens (an answer's, no images)
/// follow a prompt whose full blocks are `blocks` and whose tokens are `prompt`.
pub fn extended_blocks(
    blocks: &[u64],
    prompt: &[u32],
    more: &[u32],
    bs: BlockSize,
    lora: Option<&str>,
) -> Vec<u64> {
    let hasher = BlockHasher::new(bs).with_lora(lora);
    let n = bs.tokens();
    let mut out = blocks.to_vec();
    let mut tail: Vec<u32> = prompt[blocks.len() * n..].to_vec();
    tail.extend_from_slice(more);
    for chunk in tail.chunks_exact(n) {
        let local = hasher.hash_block(chunk, None);
        let next = match out.last() {
            Some(&parent) => kvroute_core::hash::chain(kvroute_core::SequenceHash(parent), local),
            None => kvroute_core::SequenceHash(local.0),
        };
        out.push(next.0);
    }
    out
}

fn tokens_request(
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
fn mark_warmup(requests: &mut [BenchRequest], fraction: f64) {
    let n = ((requests.len() as f64 * fraction).round() as usize).min(requests.len());
    for r in &mut requests[..n] {
        r.warmup = true;
    }
}

impl SharedPrefix {
    pub fn generate(&self, seed: u64, bs: BlockSize, warmup: f64) -> Workload {
        let mut rng = Rng::new(seed ^ 0x5348_4152_4544);
        let systems: Vec<Vec<u32>> =
            (0..self.groups).map(|_| random_tokens(&mut rng, self.system_tokens)).collect();
        let mut order: Vec<usize> = (0..self.groups * self.prompts_per_group)
            .map(|i| i / self.prompts_per_group.max(1))
            .collect();
        shuffle(&mut rng, &mut order);
        let arrivals = poisson_arrivals(&mut rng, order.len(), self.rate);
        let mut requests = order
            .iter()
            .zip(arrivals)
            .map(|(&g, at)| {
                let mut tokens = systems[g].clone();
                tokens.extend(random_tokens(&mut rng, self.question_tokens));
                tokens_request(Start::At(at), tokens, self.output_tokens, g, bs)
            })
            .collect::<Vec<_>>();
        mark_warmup(&mut requests, warmup);
        Workload {
            kind: WorkloadKind::SharedPrefix,
            params: vec![
                (
                    "groups x prompts".into(),
                    format!("{} x {}", self.groups, self.prompts_per_group),
                ),
                ("system prompt".into(), format!("{} tokens", self.system_tokens)),
                ("question".into(), format!("{} tokens", self.question_tokens)),
                ("output".into(), format!("{} tokens", self.output_tokens)),
                ("arrivals".into(), format!("Poisson, {} req/s", self.rate)),
            ],
            requests,
            adapters: Vec::new(),
        }
    }
}

impl MultiTurn {
    /// Requests are numbered round by round within a user: user `u`'s round `r` is request
    /// `u * rounds + r`. Each user's context and turns are words of the model's vocabulary
    /// (exactly `context_tokens` and `turn_tokens` tokens); the answers are the server's.
    pub fn generate(
        &self,
        seed: u64,
        warmup: f64,
        preprocessor: &Preprocessor,
    ) -> anyhow::Result<Workload> {
        let words = preprocessor.words();
        anyhow::ensure!(
            words.usable(),
            "multi-turn: the model's vocabulary has no words to write with"
        );
        let mut rng = Rng::new(seed ^ 0x4d55_4c54_4954);
        let starts = poisson_arrivals(&mut rng, self.users, self.rate);
        let warm_rounds = (self.rounds as f64 * warmup).round() as usize;
        let text = |rng: &mut Rng, n: usize| -> anyhow::Result<String> {
            let ids: Vec<u32> = (0..n).filter_map(|i| words.pick(rng.next_u64(), i)).collect();
            Ok(preprocessor.decode(&ids)?)
        };
        let mut requests = Vec::with_capacity(self.users * self.rounds);
        for (u, &at) in starts.iter().enumerate() {
            let context: Arc<str> = text(&mut rng, self.context_tokens)?.into();
            for r in 0..self.rounds {
                let start = if r == 0 {
                    Start::At(at)
                } else {
                    Start::After {
                        prev: requests.len() - 1,
                        think: exponential(&mut rng, self.think_time),
                    }
                };
                let turn = text(&mut rng, self.turn_tokens)?;
                requests.push(BenchRequest {
                    start,
                    prompt: Prompt::Turn {
                        context: (r == 0).then(|| Arc::clone(&context)),
                        text: turn,
                    },
                    max_tokens: self.output_tokens,
                    prompt_ids: Arc::new(Vec::new()),
                    blocks: Vec::new(),
                    group: u,
                    warmup: r < warm_rounds,
                    adapter: None,
                    session: None,
                    class: None,
                });
            }
        }
        Ok(Workload {
            kind: WorkloadKind::MultiTurn,
            params: vec![
                ("users x rounds".into(), format!("{} x {}", self.users, self.rounds)),
                ("context".into(), format!("{} tokens (system message)", self.context_tokens)),
                ("turn".into(), format!("{} tokens", self.turn_tokens)),
                (
                    "output".into(),
                    format!("{} tokens, sent back as the server wrote them", self.output_tokens),
                ),
                ("user arrivals".into(), format!("Poisson, {} users/s", self.rate)),
                ("think time".into(), format!("exponential, mean {} s", self.think_time)),
            ],
            requests,
            adapters: Vec::new(),
        })
    }
}

/// A generated square PNG: a pattern of its own per `index` (every image differs in its
/// pixels), smooth enough to stay a few kilobytes.
pub fn generated_png(index: usize, side: u32) -> anyhow::Result<Vec<u8>> {
    let k = index as u32;
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        let r = (x * (k % 7 + 1) + y * (k / 7 + 1)) & 0xff;
        let g = ((x ^ y) + k * 37) & 0xff;
        let b = ((x / 8 + y / 8) * (k + 3) + k) & 0xff;
        image::Rgb([r as u8, g as u8, b as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).context("encoding a generated PNG")?;
    Ok(out.into_inner())
}

const SYLLABLES: [&str; 16] = [
    "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "da", "fe", "go", "hu", "ji", "po", "qu", "ze",
];

fn words(rng: &mut Rng, n: usize) -> String {
    let mut out = String::new();
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        for _ in 0..2 + rng.below(2) {
            out.push_str(SYLLABLES[rng.below(SYLLABLES.len())]);
        }
    }
    out
}

/// Cumulative Zipf weights over `n` ranks.
fn zipf_table(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    (0..n)
        .map(|k| {
            acc += 1.0 / ((k + 1) as f64).powf(s);
            acc
        })
        .collect()
}

fn zipf_draw(rng: &mut Rng, table: &[f64]) -> usize {
    let total = table.last().copied().unwrap_or(0.0);
    let x = rng.unit() * total;
    table.partition_point(|&c| c <= x).min(table.len().saturating_sub(1))
}

impl Multimodal {
    /// Needs the engines' preprocessor: the tokens and block hashes of chat requests with
    /// images are the ones the engine derives.
    pub fn generate(
        &self,
        seed: u64,
        bs: BlockSize,
        warmup: f64,
        preprocessor: &Preprocessor,
    ) -> anyhow::Result<Workload> {
        anyhow::ensure!(
            self.images > 0 && self.texts > 0,
            "multimodal: images and texts must be > 0"
        );
        let mut rng = Rng::new(seed ^ 0x494d_4147_4553);
        let config = preprocessor.image_config();
        let mut pool = Vec::with_capacity(self.images);
        for k in 0..self.images {
            let png = generated_png(k, self.image_side)?;
            let url = format!(
                "data:image/png;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(&png)
            );
            pool.push((url, images::decode(&png, config).context("a generated image")?));
        }
        let texts: Vec<(String, String)> =
            (0..self.texts).map(|_| (words(&mut rng, 120), words(&mut rng, 12))).collect();
        let table = zipf_table(self.images, self.zipf);
        let arrivals = poisson_arrivals(&mut rng, self.requests, self.rate);
        let hasher = BlockHasher::new(bs);
        let mut requests = Vec::with_capacity(self.requests);
        let mut groups: HashMap<(usize, Vec<usize>), usize> = HashMap::new();
        for at in arrivals {
            let text = rng.below(self.texts);
            let mut picks = vec![zipf_draw(&mut rng, &table)];
            if rng.unit() < self.two_images {
                picks.push(zipf_draw(&mut rng, &table));
            }
            let mut parts: Vec<Value> = picks
                .iter()
                .map(|&k| json!({"type": "image_url", "image_url": {"url": pool[k].0}}))
                .collect();
            parts.push(json!({"type": "text", "text": texts[text].1}));
            let messages = json!([
                {"role": "system", "content": texts[text].0},
                {"role": "user", "content": parts},
            ]);
            let parsed: Vec<ChatMessage> = serde_json::from_value(messages.clone())?;
            let decoded = picks.iter().map(|&k| pool[k].1.clone()).collect();
            let prepared = preprocessor.prepare_chat(&parsed, true, decoded)?;
            let infos = prepared.mm.to_block_level(bs, prepared.tokens.len());
            let local = hasher.local_hashes(&prepared.tokens, Some(&infos));
            // One group per distinct (text, images): identical prompts.
            let next = groups.len();
            let group = *groups.entry((text, picks.clone())).or_insert(next);
            requests.push(BenchRequest {
                start: Start::At(at),
                prompt: Prompt::Chat(Arc::new(messages)),
                max_tokens: self.output_tokens,
                blocks: sequence_hashes(&local).into_iter().map(|h| h.0).collect(),
                prompt_ids: Arc::new(prepared.tokens),
                group,
                warmup: false,
                adapter: None,
                session: None,
                class: None,
            });
        }
        mark_warmup(&mut requests, warmup);
        Ok(Workload {
            kind: WorkloadKind::Multimodal,
            params: vec![
                ("requests".into(), self.requests.to_string()),
                (
                    "images".into(),
                    format!(
                        "pool of {} generated {}x{} PNGs ({} placeholder tokens each), Zipf s={}, {}% with two",
                        self.images,
                        self.image_side,
                        self.image_side,
                        pool[0].1.tokens,
                        self.zipf,
                        (self.two_images * 100.0).round()
                    ),
                ),
                ("texts".into(), format!("{} system + question pairs", self.texts)),
                ("output".into(), format!("{} tokens", self.output_tokens)),
                ("arrivals".into(), format!("Poisson, {} req/s", self.rate)),
            ],
            requests,
            adapters: Vec::new(),
        })
    }
}

impl RandomPrompts {
    pub fn generate(&self, seed: u64, bs: BlockSize, warmup: f64) -> Workload {
        let mut rng = Rng::new(seed ^ 0x5241_4e44_4f4d);
        let arrivals = poisson_arrivals(&mut rng, self.requests, self.rate);
        let mut requests = arrivals
            .into_iter()
            .enumerate()
            .map(|(i, at)| {
                let tokens = random_tokens(&mut rng, self.prompt_tokens);
                tokens_request(Start::At(at), tokens, self.output_tokens, i, bs)
            })
            .collect::<Vec<_>>();
        mark_warmup(&mut requests, warmup);
        Workload {
            kind: WorkloadKind::Random,
            params: vec![
                ("requests".into(), self.requests.to_string()),
                ("prompt".into(), format!("{} random tokens", self.prompt_tokens)),
                ("output".into(), format!("{} tokens", self.output_tokens)),
                ("arrivals".into(), format!("Poisson, {} req/s", self.rate)),
            ],
            requests,
            adapters: Vec::new(),
        }
    }
}

/// `long-prompt`: prompts of `prompt_tokens`, each opening with one of `documents` shared
/// documents of `document_tokens` (uniformly drawn) and going on with tokens of its own, with
/// answers of `output_tokens`: in an aggregated fleet every prefill of the unique part holds
/// up the running decodes for tens of milliseconds, which a disaggregated fleet keeps off
/// its decode workers.
#[derive(Clone, Debug)]
pub struct LongPrompts {
    pub requests: usize,
    pub documents: usize,
    pub document_tokens: usize,
    pub prompt_tokens: usize,
    pub output_tokens: u32,
    pub rate: f64,
}

impl Default for LongPrompts {
    fn default() -> Self {
        Self {
            requests: 120,
            documents: 8,
            document_tokens: 1024,
            prompt_tokens: 4096,
            output_tokens: 256,
            rate: 2.0,
        }
    }
}

impl LongPrompts {
    pub fn generate(&self, seed: u64, bs: BlockSize, warmup: f64) -> Workload {
        let mut rng = Rng::new(seed ^ 0x4c4f_4e47);
        let shared = self.document_tokens.min(self.prompt_tokens);
        let documents: Vec<Vec<u32>> =
            (0..self.documents.max(1)).map(|_| random_tokens(&mut rng, shared)).collect();
        let arrivals = poisson_arrivals(&mut rng, self.requests, self.rate);
        let mut requests = arrivals
            .into_iter()
            .map(|at| {
                let doc = rng.below(documents.len());
                let mut tokens = documents[doc].clone();
                tokens.extend(random_tokens(&mut rng, self.prompt_tokens - shared));
                tokens_request(Start::At(at), tokens, self.output_tokens, doc, bs)
            })
            .collect::<Vec<_>>();
        mark_warmup(&mut requests, warmup);
        Workload {
            kind: WorkloadKind::LongPrompt,
            params: vec![
                ("requests".into(), self.requests.to_string()),
                (
                    "prompt".into(),
                    format!(
                        "{} tokens: one of {} shared documents of {} tokens, then its own",
                        self.prompt_tokens, self.documents, shared
                    ),
                ),
                ("output".into(), format!("{} tokens", self.output_tokens)),
                ("arrivals".into(), format!("Poisson, {} req/s", self.rate)),
            ],
            requests,
            adapters: Vec::new(),
        }
    }
}

mod trace;
pub use trace::{TRACE_BLOCK_TOKENS, TraceReplay};

mod lora;
pub use lora::{MultiLora, adapter_name, sessions};

#[cfg(test)]
mod tests;

//! The synthetic workloads: shared prefixes, multi-turn chats, images, random and long prompts.

use std::collections::HashMap;
use std::sync::Arc;

use super::draw::*;
use super::kind::WorkloadKind;
use super::request::*;
use anyhow::Context;
use base64::Engine as _;
use kvroute_core::schedule::Rng;
use kvroute_core::{BlockHasher, BlockSize, sequence_hashes};
use kvroute_preprocess::{ChatMessage, Preprocessor, images};
use serde::Serialize;
use serde_json::{Value, json};

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

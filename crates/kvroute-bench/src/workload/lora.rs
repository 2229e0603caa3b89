//! `multi-lora`: requests for many LoRA adapters of one base model, each adapter with a
//! system prompt of its own (its users share it), adapters drawn by Zipf popularity, so a
//! few are hot and most are cold. Each request names its adapter as `model`; its blocks are
//! salted with the adapter's name, as engines salt them.
//!
//! `sessions`: the `multi-turn` schedule with each user's requests tagged as one session
//! (`prompt_cache_key`), to weigh conversation affinity against kv alone.

use std::sync::Arc;

use kvroute_core::BlockSize;
use kvroute_core::schedule::Rng;
use kvroute_preprocess::Preprocessor;
use serde::Serialize;

use super::draw::{poisson_arrivals, random_tokens, token_blocks, zipf_draw, zipf_table};
use super::kind::WorkloadKind;
use super::request::mark_warmup;
use super::request::{BenchRequest, Prompt, Start, Workload};
use super::synthetic::MultiTurn;

#[derive(Clone, Debug, Serialize)]
pub struct MultiLora {
    pub adapters: usize,
    /// Zipf exponent of adapter popularity.
    pub zipf: f64,
    pub requests: usize,
    /// Each adapter's own system prompt.
    pub system_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: u32,
    pub rate: f64,
}

impl Default for MultiLora {
    fn default() -> Self {
        Self {
            adapters: 32,
            zipf: 1.1,
            requests: 480,
            system_tokens: 1024,
            question_tokens: 64,
            output_tokens: 32,
            rate: 12.0,
        }
    }
}

/// The name of adapter `k` (in popularity order).
pub fn adapter_name(k: usize) -> String {
    format!("lora-{k:02}")
}

impl MultiLora {
    pub fn generate(&self, seed: u64, bs: BlockSize, warmup: f64) -> anyhow::Result<Workload> {
        anyhow::ensure!(self.adapters > 0, "multi-lora: --adapters must be > 0");
        let mut rng = Rng::new(seed ^ 0x4c4f_5241);
        let names: Vec<String> = (0..self.adapters).map(adapter_name).collect();
        let systems: Vec<Vec<u32>> =
            (0..self.adapters).map(|_| random_tokens(&mut rng, self.system_tokens)).collect();
        let table = zipf_table(self.adapters, self.zipf);
        let arrivals = poisson_arrivals(&mut rng, self.requests, self.rate);
        let mut requests: Vec<BenchRequest> = arrivals
            .into_iter()
            .map(|at| {
                let k = zipf_draw(&mut rng, &table);
                let mut tokens = systems[k].clone();
                tokens.extend(random_tokens(&mut rng, self.question_tokens));
                BenchRequest {
                    start: Start::At(at),
                    blocks: token_blocks(&tokens, bs, Some(&names[k])),
                    prompt_ids: Arc::new(tokens.clone()),
                    prompt: Prompt::Tokens(tokens),
                    max_tokens: self.output_tokens,
                    group: k,
                    warmup: false,
                    adapter: Some(names[k].as_str().into()),
                    session: None,
                    class: None,
                }
            })
            .collect();
        mark_warmup(&mut requests, warmup);
        Ok(Workload {
            kind: WorkloadKind::MultiLora,
            params: vec![
                (
                    "adapters".into(),
                    format!("{}, Zipf s={} by popularity", self.adapters, self.zipf),
                ),
                ("requests".into(), self.requests.to_string()),
                ("system prompt".into(), format!("{} tokens, one per adapter", self.system_tokens)),
                ("question".into(), format!("{} tokens", self.question_tokens)),
                ("output".into(), format!("{} tokens", self.output_tokens)),
                ("arrivals".into(), format!("Poisson, {} req/s", self.rate)),
            ],
            requests,
            adapters: names,
        })
    }
}

/// The `multi-turn` schedule of `turns`, each user's requests one session.
pub fn sessions(
    turns: &MultiTurn,
    seed: u64,
    warmup: f64,
    preprocessor: &Preprocessor,
) -> anyhow::Result<Workload> {
    let mut w = turns.generate(seed, warmup, preprocessor)?;
    for r in &mut w.requests {
        r.session = Some(format!("user-{}", r.group).into());
    }
    w.kind = WorkloadKind::Sessions;
    w.params.push(("sessions".into(), "one per user, as prompt_cache_key".into()));
    Ok(w)
}

//! The overload bench's workload: tenants (one of them heavy) in classes of priority.

use std::sync::Arc;

use kvroute_core::BlockSize;

use super::draw::{exponential, random_tokens, token_blocks};
use super::kind::WorkloadKind;
use super::request::{BenchRequest, Prompt, RequestTag, Start, Workload};

/// Tenants, and the heavy one's rate over each other's.
pub(super) const TENANTS: usize = 4;
pub(super) const HEAVY_SHARE: f64 = 10.0;
/// Interactive requests' TTFT objective, ms.
pub const INTERACTIVE_SLO_MS: u32 = 250;

/// One class of the mix.
#[derive(Clone, Copy, Debug)]
pub struct Class {
    pub name: &'static str,
    pub share: f64,
    pub priority: i32,
    pub slo_ms: Option<u32>,
    pub answer: u32,
}

pub const CLASSES: [Class; 3] = [
    Class {
        name: "interactive",
        share: 0.55,
        priority: 10,
        slo_ms: Some(INTERACTIVE_SLO_MS),
        answer: 16,
    },
    Class { name: "standard", share: 0.30, priority: 0, slo_ms: None, answer: 64 },
    Class { name: "batch", share: 0.15, priority: -1, slo_ms: None, answer: 128 },
];

/// The overload schedule at `rate` requests per second in all, `seconds` of arrivals; without
/// `heavy`, tenant `t0`'s requests are left out (the others' are the same).
pub fn tenants_overload(
    seed: u64,
    rate: f64,
    seconds: f64,
    heavy: bool,
    bs: BlockSize,
) -> Workload {
    let weights: Vec<f64> = (0..TENANTS).map(|t| if t == 0 { HEAVY_SHARE } else { 1.0 }).collect();
    let total: f64 = weights.iter().sum();
    let mut requests = Vec::new();
    for (t, w) in weights.iter().enumerate() {
        let mut rng = kvroute_core::schedule::Rng::new(seed ^ (0x4f56_4552 + t as u64 * 7919));
        let system = random_tokens(&mut rng, 768);
        let documents: Vec<Vec<u32>> = (0..8).map(|_| random_tokens(&mut rng, 1_024)).collect();
        let tenant: Arc<str> = Arc::from(format!("t{t}"));
        let own_rate = rate * w / total;
        let mut at = 0.0;
        loop {
            at += exponential(&mut rng, 1.0 / own_rate);
            if at >= seconds {
                break;
            }
            let pick = rng.unit();
            let class = match pick {
                p if p < CLASSES[0].share => &CLASSES[0],
                p if p < CLASSES[0].share + CLASSES[1].share => &CLASSES[1],
                _ => &CLASSES[2],
            };
            let tokens = match class.name {
                "interactive" => {
                    let own = 64 + rng.below(129);
                    [system.clone(), random_tokens(&mut rng, own)].concat()
                }
                "standard" => {
                    let doc = &documents[rng.below(documents.len())];
                    [doc.clone(), random_tokens(&mut rng, 256)].concat()
                }
                _ => {
                    let n = 3_072 + rng.below(2_049);
                    random_tokens(&mut rng, n)
                }
            };
            if t == 0 && !heavy {
                continue;
            }
            requests.push(BenchRequest {
                start: Start::At(at),
                blocks: token_blocks(&tokens, bs, None),
                prompt_ids: Arc::new(tokens.clone()),
                prompt: Prompt::Tokens(tokens),
                max_tokens: class.answer,
                group: t,
                warmup: false,
                adapter: None,
                session: None,
                class: Some(Arc::new(RequestTag {
                    class: class.name,
                    tenant: tenant.clone(),
                    priority: class.priority,
                    slo_ms: class.slo_ms,
                })),
            });
        }
    }
    requests.sort_by(|a, b| match (a.start, b.start) {
        (Start::At(x), Start::At(y)) => x.total_cmp(&y),
        _ => std::cmp::Ordering::Equal,
    });
    let params = vec![
        ("rate".into(), format!("{rate:.2} requests/s in all")),
        ("seconds".into(), format!("{seconds}")),
        ("tenants".into(), format!("{TENANTS}, t0 at {HEAVY_SHARE}x the others' rate")),
        ("heavy tenant".into(), if heavy { "in" } else { "left out" }.into()),
    ];
    Workload { kind: WorkloadKind::Overload, params, requests, adapters: Vec::new() }
}

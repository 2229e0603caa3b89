//! A run reduced to the figures the report compares.

use serde::Serialize;

use crate::run::{RequestRecord, RunData, WorkerStats};
use crate::stats::{
    Uses, coefficient_of_variation, mean_absolute_error, pooled_cache_hits, quantile,
    unbounded_cache_hits,
};

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

impl Percentiles {
    pub fn of(values: &[f64]) -> Self {
        Self { p50: quantile(values, 0.5), p90: quantile(values, 0.9), p99: quantile(values, 0.99) }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub label: String,
    pub requests: usize,
    pub errors: usize,
    /// Answered requests outside the warm-up: the latency figures' population.
    pub measured: usize,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    /// Time per output token of each request after its first: (e2e - TTFT) / (tokens - 1),
    /// over requests of two tokens or more.
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Fleet ground truth: cached prompt tokens / prompt tokens, from the workers' counters
    /// over the whole run (the usage of the answers when no counters were given).
    pub hit_rate: Option<f64>,
    /// The same from the answers' usage, outside the warm-up.
    pub hit_rate_measured: Option<f64>,
    /// Best achievable over the requests in the order they were sent: every computed block
    /// kept forever ...
    pub best_unbounded: f64,
    /// ... and with the fleet's capacity (one pooled cache, Belady eviction).
    pub best_capacity: Option<f64>,
    /// `hit_rate` / the tighter best.
    pub share_of_best: Option<f64>,
    /// Requests with a prediction (`x-kvroute-overlap-tokens`) and usage.
    pub predicted: usize,
    /// Mean |predicted - actual cached tokens|, tokens.
    pub prediction_mae: Option<f64>,
    /// Requests whose prediction exceeded the cached tokens the worker reported ...
    pub over_predicted: usize,
    /// ... and whose prediction was exactly what it served.
    pub exactly_predicted: usize,
    /// Requests predicted to hit blocks no earlier request ever computed (a false hit: e.g.
    /// the same text with another image taken for a match).
    pub false_hits: usize,
    /// Requests each worker finished during the run.
    pub worker_requests: Vec<u64>,
    /// Coefficient of variation of `worker_requests`.
    pub load_cv: Option<f64>,
    pub evicted_blocks: u64,
    pub preemptions: u64,
    /// Adapter loads and swaps into a slot over the run, per answered request (requests for
    /// an adapter only; `None` when none asked for one).
    pub adapter_loads_per_request: Option<f64>,
    /// Per adapter (by name, which is its popularity rank): its requests and the engines
    /// that served them.
    pub engines_per_adapter: Vec<(String, usize, usize)>,
    /// Prompt tokens the workers loaded from host memory / prompt tokens (part of
    /// `hit_rate`), and the KV bytes those loads moved per answered request; `None` without
    /// host memory.
    pub host_hit_rate: Option<f64>,
    /// Of the prompt tokens, those promoted from storage (with a storage tier).
    pub storage_hit_rate: Option<f64>,
    /// Of the prompt tokens, those loaded from the shared store (with one).
    #[serde(default)]
    pub store_hit_rate: Option<f64>,
    /// The router's prediction of the same (tokens from every tier below the GPU / prompt
    /// tokens), from the answers' `x-kvroute-overlap-tier-tokens`; `None` without host memory.
    #[serde(default)]
    pub predicted_below_rate: Option<f64>,
    pub host_loaded_mib_per_request: Option<f64>,
    /// A disaggregated fleet: the share of answered requests prefilled on a prefill worker,
    /// and the KV pulled by decode workers per answered request; `None` when nothing was.
    pub disaggregated_share: Option<f64>,
    /// Of the split requests, the share pulled across nodes.
    pub across_nodes_share: Option<f64>,
    pub transferred_mib_per_request: Option<f64>,
}

/// Per adapter, its answered requests and the distinct workers that served them.
fn engines_per_adapter(records: &[&crate::run::RequestRecord]) -> Vec<(String, usize, usize)> {
    let mut per: std::collections::BTreeMap<&str, (usize, std::collections::BTreeSet<&str>)> =
        std::collections::BTreeMap::new();
    for r in records {
        let Some(adapter) = r.adapter.as_deref() else { continue };
        let entry = per.entry(adapter).or_default();
        entry.0 += 1;
        entry.1.extend(r.worker.as_deref());
    }
    per.into_iter().map(|(a, (n, workers))| (a.to_owned(), n, workers.len())).collect()
}

fn delta(end: &[WorkerStats], start: &[WorkerStats], f: impl Fn(&WorkerStats) -> u64) -> Vec<u64> {
    end.iter().enumerate().map(|(i, e)| f(e).saturating_sub(start.get(i).map_or(0, &f))).collect()
}

fn ratio(num: f64, den: f64) -> Option<f64> {
    (den > 0.0).then(|| num / den)
}

/// The best hit rates achievable over the order the requests left in: each prompt's hits with
/// an unbounded cache, and the rates with an unbounded cache and with the fleet's capacity.
struct Best {
    unbounded: Vec<usize>,
    unbounded_rate: Option<f64>,
    capacity_rate: Option<f64>,
}

impl Best {
    fn of(sent: &[&RequestRecord], block_size: usize, capacity_blocks: Option<usize>) -> Self {
        // A prompt finds at most (len - 1) / block size of its blocks cached (the last token is
        // always computed); it leaves its own blocks and its answer's computed.
        let uses: Vec<Uses<'_>> = sent
            .iter()
            .map(|r| {
                let findable = r.prompt_len.saturating_sub(1) / block_size.max(1);
                Uses {
                    query: &r.prompt_blocks[..r.prompt_blocks.len().min(findable)],
                    computed: &r.computed_blocks,
                }
            })
            .collect();
        let prompt_total: usize = sent.iter().map(|r| r.prompt_len).sum();
        let unbounded = unbounded_cache_hits(&uses, block_size);
        let unbounded_rate = ratio(unbounded.iter().sum::<usize>() as f64, prompt_total as f64);
        let capacity_rate = capacity_blocks.and_then(|cap| {
            let hits = pooled_cache_hits(&uses, block_size, cap);
            ratio(hits.iter().sum::<usize>() as f64, prompt_total as f64)
        });
        Self { unbounded, unbounded_rate, capacity_rate }
    }
}

/// The router's predictions against what was served, of the answers served whole by one
/// worker: the pairs, how many were over, exact, and above the best achievable (false hits).
struct Checks {
    pairs: Vec<(f64, f64)>,
    over: usize,
    exact: usize,
    false_hits: usize,
}

impl Checks {
    fn of(sent: &[&RequestRecord], unbounded: &[usize]) -> Self {
        let mut checks = Checks { pairs: Vec::new(), over: 0, exact: 0, false_hits: 0 };
        for (k, r) in sent.iter().enumerate() {
            let Some(p) = r.predicted_tokens.filter(|_| r.prefill_worker.is_none()) else {
                continue;
            };
            if p > unbounded[k] as u64 {
                checks.false_hits += 1;
            }
            if let Some(c) = r.cached_tokens {
                checks.pairs.push((p as f64, c as f64));
                checks.over += usize::from(p > c);
                checks.exact += usize::from(p == c);
            }
        }
        checks
    }
}

/// `capacity_blocks`: the fleet's blocks together (`None`: unknown, e.g. a remote target
/// without worker stats).
pub fn summarize(run: &RunData, block_size: usize, capacity_blocks: Option<usize>) -> Summary {
    let records = &run.records;
    let ok: Vec<_> = records.iter().filter(|r| r.error.is_none()).collect();
    let measured: Vec<_> = ok.iter().filter(|r| !r.warmup).collect();
    let pick = |f: &dyn Fn(&crate::run::RequestRecord) -> Option<f64>| -> Vec<f64> {
        measured.iter().filter_map(|r| f(r)).collect()
    };
    let ttft = pick(&|r| r.ttft_ms);
    let e2e = pick(&|r| r.e2e_ms);
    let itl: Vec<f64> = measured.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    let tpot = pick(&|r| {
        let after_first = r.output_tokens.checked_sub(1).filter(|&n| n > 0)?;
        Some((r.e2e_ms? - r.ttft_ms?) / after_first as f64)
    });
    let output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();

    // Best achievable over the order the requests actually left in.
    let mut sent: Vec<_> = records.iter().collect();
    sent.sort_by_key(|r| r.sent_order);
    let best = Best::of(&sent, block_size, capacity_blocks);
    let (unbounded, best_unbounded, best_capacity) =
        (best.unbounded, best.unbounded_rate, best.capacity_rate);

    // Ground truth: the workers' counters, else the answers' usage.
    let have_stats = !run.stats_end.is_empty();
    let hit_rate = fleet_hit_rate(run, &ok);
    // Of the measured answers, those served whole by one worker (a split one's usage counts
    // the KV its decode worker pulled as cached).
    let whole = || measured.iter().filter(|r| r.prefill_worker.is_none());
    let cached: u64 = whole().filter_map(|r| r.cached_tokens).sum();
    let prompt: u64 = whole().filter_map(|r| r.prompt_tokens).sum();
    let best = best_capacity.or(best_unbounded);

    let checks = Checks::of(&sent, &unbounded);
    let worker_requests = delta(&run.stats_end, &run.stats_start, |s| s.requests_finished);
    let loads: Vec<f64> = worker_requests.iter().map(|&n| n as f64).collect();
    let mut summary = Summary {
        label: run.label.clone(),
        requests: records.len(),
        errors: records.len() - ok.len(),
        measured: measured.len(),
        ttft_ms: Percentiles::of(&ttft),
        itl_ms: Percentiles::of(&itl),
        tpot_ms: Percentiles::of(&tpot),
        e2e_ms: Percentiles::of(&e2e),
        requests_per_s: ratio(ok.len() as f64, run.wall_secs).unwrap_or(0.0),
        output_tokens_per_s: ratio(output_tokens as f64, run.wall_secs).unwrap_or(0.0),
        hit_rate,
        hit_rate_measured: ratio(cached as f64, prompt as f64),
        best_unbounded: best_unbounded.unwrap_or(0.0),
        best_capacity,
        share_of_best: hit_rate.zip(best).and_then(|(h, b)| ratio(h, b)),
        predicted: checks.pairs.len(),
        prediction_mae: mean_absolute_error(&checks.pairs),
        over_predicted: checks.over,
        exactly_predicted: checks.exact,
        false_hits: checks.false_hits,
        load_cv: coefficient_of_variation(&loads),
        worker_requests,
        evicted_blocks: 0,
        preemptions: 0,
        adapter_loads_per_request: None,
        engines_per_adapter: Vec::new(),
        host_hit_rate: None,
        storage_hit_rate: None,
        store_hit_rate: None,
        disaggregated_share: None,
        across_nodes_share: None,
        transferred_mib_per_request: None,
        predicted_below_rate: None,
        host_loaded_mib_per_request: None,
    };
    fleet_figures(run, &ok, have_stats, &mut summary);
    summary
}

/// The figures only the workers' own counters give: evictions, preemptions, adapters' loads,
/// each tier's hits, and a disaggregated fleet's hand-offs.
fn fleet_figures(run: &RunData, ok: &[&RequestRecord], have_stats: bool, summary: &mut Summary) {
    // A counter of the workers' own, summed over the fleet, over the run.
    let total = |f: &dyn Fn(&WorkerStats) -> u64| -> u64 {
        delta(&run.stats_end, &run.stats_start, f).iter().sum()
    };
    let has_host = run.stats_end.iter().any(|s| s.host_total_blocks > 0);
    let host_tokens = has_host.then(|| total(&|s| s.host_hit_tokens));
    let has_storage = run.stats_end.iter().any(|s| s.storage_total_blocks > 0);
    let storage_tokens = has_storage.then(|| total(&|s| s.storage_hit_tokens));
    let has_store = run.stats_end.iter().any(|s| s.shared_store);
    let store_tokens = has_store.then(|| total(&|s| s.store_hit_tokens));
    let prompt_tokens: u64 = total(&|s| s.prompt_tokens - s.pulled_prompt_tokens);
    // A fleet with prefill or decode workers: its figures are reported when nothing split.
    let disaggregated = run.stats_end.iter().any(|s| s.role != kvroute_core::schedule::Role::Both);
    let received: u64 = total(&|s| s.handoff.received);
    summary.evicted_blocks = total(&|s| s.evicted_blocks);
    summary.preemptions = total(&|s| s.preemptions);
    summary.adapter_loads_per_request = {
        let asked = ok.iter().filter(|r| r.adapter.is_some()).count();
        let loads = |s: &crate::run::WorkerStats| s.lora.stats.loads + s.lora.stats.swaps;
        let loads = total(&loads);
        ratio(loads as f64, asked as f64).filter(|_| have_stats)
    };
    summary.engines_per_adapter = engines_per_adapter(ok);
    summary.host_hit_rate = host_tokens.and_then(|t| ratio(t as f64, prompt_tokens as f64));
    summary.storage_hit_rate = storage_tokens.and_then(|t| ratio(t as f64, prompt_tokens as f64));
    summary.store_hit_rate = store_tokens.and_then(|t| ratio(t as f64, prompt_tokens as f64));
    summary.disaggregated_share =
        disaggregated.then(|| ratio(received as f64, ok.len() as f64)).flatten();
    summary.across_nodes_share = disaggregated
        .then(|| {
            let across: u64 = total(&|s| s.handoff.received_across_nodes);
            ratio(across as f64, received as f64)
        })
        .flatten();
    summary.transferred_mib_per_request = disaggregated
        .then(|| {
            let bytes: u64 = total(&|s| s.handoff.received_bytes);
            ratio(bytes as f64 / f64::from(1 << 20), ok.len() as f64)
        })
        .flatten();
    summary.predicted_below_rate = host_tokens.or(store_tokens).and_then(|_| {
        let tiers = ok.iter().filter_map(|r| r.predicted_tier_tokens);
        let predicted: u64 = tiers.map(|t| t.iter().sum::<u64>()).sum();
        ratio(predicted as f64, prompt_tokens as f64)
    });
    summary.host_loaded_mib_per_request = host_tokens.and_then(|_| {
        let bytes: u64 = total(&|s| s.host_loaded_bytes);
        ratio(bytes as f64 / f64::from(1 << 20), ok.len() as f64)
    });
}

/// The fleet's hit rate by the workers' own counters, else by the answers' usage. A request
/// split between two workers is counted on both: its prefill worker's count is the fleet's
/// (what was computed), its decode worker's (the pulled KV) is left out.
fn fleet_hit_rate(run: &RunData, ok: &[&RequestRecord]) -> Option<f64> {
    if run.stats_end.is_empty() {
        let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
        let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
        return ratio(cached as f64, prompt as f64);
    }
    let total = |f: &dyn Fn(&WorkerStats) -> u64| -> u64 {
        delta(&run.stats_end, &run.stats_start, f).iter().sum()
    };
    let cached: u64 = total(&|s| s.cached_tokens - s.pulled_cached_tokens);
    let prompt: u64 = total(&|s| s.prompt_tokens - s.pulled_prompt_tokens);
    ratio(cached as f64, prompt as f64)
}

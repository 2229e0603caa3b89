//! `kvroute bench --overload` (docs/bench/overload.md): what flow control keeps of the
//! interactive SLO when the fleet is offered more than it can serve.
//!
//! The schedule: 4 tenants, each a Poisson stream of its own (so a run without one tenant
//! sends the others exactly the same requests), tenant `t0` at ten times the others' rate.
//! Each request is of one class:
//!
//! | class | share | prompt | answer | priority | TTFT objective |
//! |---|---|---|---|---|---|
//! | interactive | 55% | the tenant's 768-token system prompt + 64-192 own | 16 | 10 | 250 ms |
//! | standard | 30% | one of 8 1,024-token documents of the tenant + 256 own | 64 | 0 | none |
//! | batch | 15% | 3,072-5,120 own tokens | 128 | -1 (sheddable) | none |
//!
//! Each load is a multiple of the fleet's capacity: the requests per second of this mix it
//! answers when offered far more without flow control (measured first unless given).

use std::sync::Arc;

use anyhow::Context;
use kvroute_core::BlockSize;
use kvroute_core::schedule::PolicyKind;
use kvroute_core::schedule::flow::FlowConfig;
use kvroute_preprocess::Preprocessor;
use serde::Serialize;

use crate::args::BenchArgs;
use crate::run::{FleetConfig, RequestRecord, RunData, Target};
use crate::workload::{CLASSES, INTERACTIVE_SLO_MS, tenants_overload as workload};

/// Dynamo's example busy thresholds (its request-rejection guide): KV usage, queued prefill
/// tokens.
const DYNAMO_BUSY: (f64, usize) = (0.85, 10_000);

/// One class's figures in one run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClassFigures {
    pub sent: usize,
    pub answered: usize,
    /// Refused with 429 / 503 (with `Retry-After`), and other failures.
    pub shed_429: usize,
    pub refused_503: usize,
    pub failed: usize,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Answered within the objective (every answer, for a class without one), per second.
    pub goodput: f64,
    /// Of those sent, the share answered (admitted and served).
    pub admitted: f64,
}

/// One run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct RunFigures {
    pub system: String,
    pub load: f64,
    pub rate: f64,
    pub heavy_tenant: bool,
    pub classes: Vec<(String, ClassFigures)>,
    /// The interactive TTFT p99 of the tenants other than t0.
    pub others_interactive_p99_ms: Option<f64>,
    /// Jain's index of the tenants' served prompt tokens over their max-min fair shares.
    pub jain: Option<f64>,
    /// What the router's flow control did (by outcome).
    pub flow: std::collections::BTreeMap<String, f64>,
    pub wall_secs: f64,
}

fn figures(data: &RunData, seconds: f64) -> Vec<(String, ClassFigures)> {
    CLASSES
        .iter()
        .map(|c| {
            let of: Vec<&RequestRecord> =
                data.records.iter().filter(|r| r.class.as_deref() == Some(c.name)).collect();
            let ok: Vec<&RequestRecord> =
                of.iter().copied().filter(|r| r.error.is_none()).collect();
            let ttfts: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
            let good = ok
                .iter()
                .filter(|r| match c.slo_ms {
                    Some(slo) => r.ttft_ms.is_some_and(|t| t <= f64::from(slo)),
                    None => true,
                })
                .count();
            let status = |s: u16| of.iter().filter(|r| r.status == Some(s)).count();
            let figures = ClassFigures {
                sent: of.len(),
                answered: ok.len(),
                shed_429: status(429),
                refused_503: status(503),
                failed: of.len() - ok.len() - status(429) - status(503),
                ttft_p50_ms: crate::stats::quantile(&ttfts, 0.5),
                ttft_p99_ms: crate::stats::quantile(&ttfts, 0.99),
                goodput: good as f64 / seconds,
                admitted: if of.is_empty() { 0.0 } else { ok.len() as f64 / of.len() as f64 },
            };
            (c.name.to_owned(), figures)
        })
        .collect()
}

/// Max-min fair shares of `capacity` among `demands` (water-filling).
pub fn max_min_fair(demands: &[f64], capacity: f64) -> Vec<f64> {
    let mut share = vec![0.0; demands.len()];
    let mut left = capacity;
    let mut open: Vec<usize> = (0..demands.len()).filter(|&i| demands[i] > 0.0).collect();
    while !open.is_empty() && left > 1e-9 {
        let each = left / open.len() as f64;
        let (done, rest): (Vec<usize>, Vec<usize>) =
            open.iter().partition(|&&i| demands[i] - share[i] <= each);
        if done.is_empty() {
            for &i in &rest {
                share[i] += each;
            }
            break;
        }
        for &i in &done {
            left -= demands[i] - share[i];
            share[i] = demands[i];
        }
        open = rest;
    }
    share
}

/// Jain's fairness index of `x` (1: all equal).
pub fn jain(x: &[f64]) -> Option<f64> {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    (squares > 0.0).then(|| sum * sum / (x.len() as f64 * squares))
}

/// Jain's index over the tenants of served prompt tokens, each over its max-min fair share of
/// what was served in all (given what each asked for).
fn tenant_fairness(data: &RunData) -> Option<f64> {
    let tenants: Vec<String> = {
        let mut t: Vec<String> = data.records.iter().filter_map(|r| r.tenant.clone()).collect();
        t.sort();
        t.dedup();
        t
    };
    let tokens = |t: &str, served: bool| -> f64 {
        data.records
            .iter()
            .filter(|r| r.tenant.as_deref() == Some(t) && (!served || r.error.is_none()))
            .map(|r| r.prompt_len as f64)
            .sum()
    };
    let demand: Vec<f64> = tenants.iter().map(|t| tokens(t, false)).collect();
    let served: Vec<f64> = tenants.iter().map(|t| tokens(t, true)).collect();
    let fair = max_min_fair(&demand, served.iter().sum());
    let x: Vec<f64> =
        served.iter().zip(&fair).filter(|(_, f)| **f > 0.0).map(|(s, f)| s / f).collect();
    jain(&x)
}

/// The systems compared: label, policy, flow control, engine priorities, busy refusal.
fn systems(args: &BenchArgs, all: bool) -> Vec<(String, FleetConfig, PolicyKind)> {
    let base = FleetConfig { speedup: args.speedup, ..args.fleet() };
    let off = FlowConfig { enabled: false, ..FlowConfig::default() };
    let mut out = vec![
        (
            "kv+flow".to_owned(),
            FleetConfig {
                flow: FlowConfig { enabled: true, ..args.flow_config() },
                engine_priority: true,
                ..base.clone()
            },
            PolicyKind::Kv,
        ),
        ("kv".to_owned(), FleetConfig { flow: off, ..base.clone() }, PolicyKind::Kv),
    ];
    if all {
        out.push((
            "dynamo-busy".to_owned(),
            FleetConfig { flow: off, refuse_when_busy: Some(DYNAMO_BUSY), ..base.clone() },
            PolicyKind::Dynamo,
        ));
        out.push((
            "round-robin".to_owned(),
            FleetConfig { flow: off, ..base },
            PolicyKind::RoundRobin,
        ));
    }
    out
}

fn target(policy: PolicyKind, fleet: &FleetConfig) -> Target {
    Target::Fleet {
        policy,
        events: true,
        replicas: None,
        dialect: fleet.dialect,
        pd_baseline: None,
        store: false,
        gateway: false,
    }
}

/// Runs the overload bench; writes `overload.md` and `overload.json` into `args.out`.
pub fn bench(
    args: &BenchArgs,
    preprocessor: &Arc<Preprocessor>,
) -> anyhow::Result<std::path::PathBuf> {
    let bs = BlockSize::new(args.block_size)?;
    let seconds = args.overload_seconds;
    let bar = indicatif::ProgressBar::hidden();
    let capacity = match args.capacity {
        Some(c) => c,
        None => measure_capacity(args, preprocessor, bs, &bar)?,
    };
    tracing::info!(capacity = format!("{capacity:.2}"), "the fleet's capacity, requests/s");
    let max_load = args.overload_loads.iter().copied().fold(0.0, f64::max);
    let mut runs = Vec::new();
    for &load in &args.overload_loads {
        let rate = load * capacity;
        let top = load == max_load;
        let mut compared = systems(args, top);
        if args.overload_flow_only {
            compared.retain(|(system, _, _)| system == "kv+flow");
        }
        for (system, fleet, policy) in compared {
            let mut heavies = vec![true];
            if top && system == "kv+flow" {
                heavies.push(false);
            }
            for heavy in heavies {
                let w = workload(args.seed, rate, seconds, heavy, bs);
                let label = match heavy {
                    true => system.clone(),
                    false => format!("{system} without t0"),
                };
                let data = crate::run::run(
                    &w,
                    &target(policy, &fleet),
                    &fleet,
                    &label,
                    &bar,
                    preprocessor,
                )?;
                let classes = figures(&data, seconds);
                let others = data
                    .records
                    .iter()
                    .filter(|r| {
                        r.class.as_deref() == Some("interactive")
                            && r.tenant.as_deref() != Some("t0")
                    })
                    .filter_map(|r| r.ttft_ms.filter(|_| r.error.is_none()))
                    .collect::<Vec<f64>>();
                let run = RunFigures {
                    system: label,
                    load,
                    rate,
                    heavy_tenant: heavy,
                    others_interactive_p99_ms: crate::stats::quantile(&others, 0.99),
                    jain: tenant_fairness(&data),
                    classes,
                    flow: data.flow.clone(),
                    wall_secs: data.wall_secs,
                };
                tracing::info!(system = %run.system, load, "overload run done");
                runs.push(run);
            }
        }
    }
    std::fs::create_dir_all(&args.out)?;
    let json = serde_json::json!({"capacity": capacity, "seconds": seconds, "runs": runs});
    std::fs::write(args.out.join("overload.json"), serde_json::to_vec_pretty(&json)?)?;
    let md = render(capacity, seconds, &runs);
    let path = args.out.join("overload.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The rate of this mix the fleet answers when offered 4x what it can (an estimate from a
/// first short run), without flow control.
fn measure_capacity(
    args: &BenchArgs,
    preprocessor: &Arc<Preprocessor>,
    bs: BlockSize,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<f64> {
    let fleet = FleetConfig {
        flow: FlowConfig { enabled: false, ..FlowConfig::default() },
        ..args.fleet()
    };
    let mut offered = 20.0;
    let mut answered_rate = 0.0;
    for _ in 0..3 {
        let seconds = args.overload_seconds.min(20.0);
        let w = workload(args.seed ^ 0xCA9A, offered, seconds, true, bs);
        let data = crate::run::run(
            &w,
            &target(PolicyKind::Kv, &fleet),
            &fleet,
            "capacity",
            bar,
            preprocessor,
        )?;
        let answered = data.records.iter().filter(|r| r.error.is_none()).count();
        if let Some(error) = data.records.iter().find_map(|r| r.error.as_deref()) {
            tracing::info!(sent = data.records.len(), answered, error, "capacity probe: a failure");
        }
        answered_rate = answered as f64 / data.wall_secs.max(seconds);
        tracing::info!(offered, answered_rate = format!("{answered_rate:.2}"), "capacity probe");
        if answered_rate < 0.6 * offered {
            break;
        }
        offered *= 3.0;
    }
    Ok(answered_rate)
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}"))
}

/// The report: per run, per class.
fn render(capacity: f64, seconds: f64, runs: &[RunFigures]) -> String {
    let mut md = format!(
        "# Overload\n\nCapacity of the mix: {capacity:.2} requests/s. Each run: {seconds} s of \
         arrivals. Goodput: answers per second within the class's objective (interactive: TTFT \
         {INTERACTIVE_SLO_MS} ms; the others: every answer).\n\n"
    );
    md.push_str("| load | system | class | sent | admitted | 429 | 503 | TTFT p50 | TTFT p99 | goodput/s |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for r in runs {
        for (name, c) in &r.classes {
            md.push_str(&format!(
                "| {:.1}x | {} | {name} | {} | {:.1}% | {} | {} | {} | {} | {:.2} |\n",
                r.load,
                r.system,
                c.sent,
                c.admitted * 100.0,
                c.shed_429,
                c.refused_503,
                ms(c.ttft_p50_ms),
                ms(c.ttft_p99_ms),
                c.goodput
            ));
        }
    }
    md.push_str("\n| load | system | other tenants' interactive p99 | Jain's index | queued | released | shed | expired | abandoned |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in runs {
        // Flow control's counts (none: it was off); an outcome it never had is 0.
        let f = |k: &str| match r.flow.is_empty() {
            true => "-".to_owned(),
            false => format!("{:.0}", r.flow.get(k).copied().unwrap_or(0.0)),
        };
        md.push_str(&format!(
            "| {:.1}x | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.load,
            r.system,
            ms(r.others_interactive_p99_ms),
            r.jain.map_or("-".into(), |j| format!("{j:.3}")),
            f("queued"),
            f("released"),
            f("shed"),
            f("expired"),
            f("abandoned"),
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Workload;

    #[test]
    fn max_min_fairness_fills_the_small_demands_first() {
        let fair = max_min_fair(&[10.0, 1.0, 1.0, 100.0], 30.0);
        assert_eq!(fair, vec![10.0, 1.0, 1.0, 18.0]);
        assert_eq!(max_min_fair(&[5.0, 5.0], 4.0), vec![2.0, 2.0]);
        assert!((jain(&[1.0, 1.0, 1.0]).unwrap() - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]).unwrap() - 0.25).abs() < 1e-12);
    }

    #[test]
    fn the_schedule_is_the_same_for_the_others_without_the_heavy_tenant() {
        let bs = BlockSize::new(16).unwrap();
        let with = workload(7, 30.0, 10.0, true, bs);
        let without = workload(7, 30.0, 10.0, false, bs);
        let others = |w: &Workload| -> Vec<(String, u32)> {
            w.requests
                .iter()
                .filter(|r| r.class.as_ref().is_some_and(|c| &*c.tenant != "t0"))
                .map(|r| (format!("{:?}", r.start), r.max_tokens))
                .collect()
        };
        assert_eq!(others(&with), others(&without));
        let heavy = with.requests.iter().filter(|r| r.group == 0).count() as f64;
        let light = with.requests.iter().filter(|r| r.group == 1).count() as f64;
        assert!(heavy > 6.0 * light, "t0 sends ~10x: {heavy} vs {light}");
        let interactive = with
            .requests
            .iter()
            .filter(|r| r.class.as_ref().is_some_and(|c| c.class == "interactive"))
            .count() as f64;
        assert!((interactive / with.requests.len() as f64 - 0.55).abs() < 0.06);
    }
}

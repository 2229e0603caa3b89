//! `kvroute bench`: seeded workloads played side by side against routing policies, with a
//! report people would rather look at than read.
//!
//! - [`workload`]: the generators (shared-prefix, multi-turn, multimodal, random);
//! - [`goodput`]: the highest rate each policy serves within a TTFT SLO;
//! - [`run`]: one run against a fresh simulated fleet or a `--target` endpoint;
//! - [`stats`] and [`summary`]: percentiles, spread, prediction error, best achievable hits;
//! - [`report`] and [`plot`]: `report.md`, `results.json` and SVG plots;
//! - [`terminal`]: the table printed at the end, and what the worst tail was made of.

mod args;
pub mod churn;
pub mod faults;
pub mod fixtures;
pub mod goodput;
pub mod overload;
pub mod plot;
pub mod report;
mod results;
pub mod run;
pub mod stats;
pub mod summary;
pub mod terminal;
pub mod workload;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvroute_core::schedule::PolicyKind;
use kvroute_preprocess::Preprocessor;

use crate::run::{Replicas, Target};
use crate::workload::Workload;

pub use args::{BenchArgs, DISAGG_SLO_TPOT_MS};
pub use results::WorkloadResult;

fn set_nats(targets: &mut [(String, Target)], url: &str) {
    for (_, target) in targets {
        if let Target::Fleet { replicas: Some(r), .. } = target {
            r.nats_url = Some(url.to_owned());
        }
    }
}

/// A nats-server with JetStream in `out/nats`, on a runtime that keeps its log drained.
fn own_nats_server(
    out: &std::path::Path,
) -> anyhow::Result<(crate::fixtures::nats_server::NatsServer, tokio::runtime::Runtime)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting a runtime")?;
    let store = out.join("nats");
    let server = runtime
        .block_on(crate::fixtures::nats_server::NatsServer::start(&store, 0))
        .context("starting nats-server for --replicas (or give --nats URL)")?;
    Ok((server, runtime))
}

fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{spinner} {msg:32} [{bar:30}] {pos}/{len} requests, {elapsed}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// What a bench leaves: its report, and the summary to print when it ends (empty for a
/// goodput search, whose report is its table).
#[derive(Clone, Debug)]
pub struct Finished {
    pub report: PathBuf,
    pub summary: String,
}

/// Runs everything `args` asks for and writes the report.
pub fn bench(args: &BenchArgs) -> anyhow::Result<Finished> {
    let quick;
    let args = match args.quick {
        true => {
            quick = args.quick_look();
            &quick
        }
        false => args,
    };
    args.check()?;
    let fleet = args.fleet();
    let preprocessor = std::sync::Arc::new(
        Preprocessor::load_or_builtin(fleet.model_path.as_deref()).context("loading the model")?,
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    if !args.churn.is_empty() {
        let report = churn::bench(args, &preprocessor)?;
        let summary = std::fs::read_to_string(&report).unwrap_or_default();
        return Ok(Finished { report, summary });
    }
    if args.faults {
        let report = faults::bench(args, &preprocessor)?;
        let summary = std::fs::read_to_string(&report).unwrap_or_default();
        return Ok(Finished { report, summary });
    }
    if args.overload {
        let report = overload::bench(args, &preprocessor)?;
        let summary = std::fs::read_to_string(&report).unwrap_or_default();
        return Ok(Finished { report, summary });
    }
    let targets = targets(args);
    // The replicas' NATS: given, or a server of the bench's own for as long as it runs.
    let mut targets = targets;
    let _nats = match (args.replicas > 1, &args.nats) {
        (false, _) => None,
        (true, Some(url)) => {
            set_nats(&mut targets, url);
            None
        }
        (true, None) => {
            let (server, runtime) = own_nats_server(&args.out)?;
            set_nats(&mut targets, &server.url());
            Some((server, runtime))
        }
    };
    if !args.slo_ttft_p99.is_empty() {
        let report = goodput_search(args, &targets, &preprocessor)?;
        return Ok(Finished { report, summary: String::new() });
    }

    let started = Instant::now();
    let results = run_workloads(args, &targets, &preprocessor)?;
    let elapsed = started.elapsed();
    let report = report::write(&args.out, args, &fleet, &results, elapsed)?;
    Ok(Finished { report, summary: terminal::render(&results, args.goodput_ttft_ms) })
}

/// What the bench runs each workload against: the remote target, or a fleet per policy and
/// variant (pair-cost baselines, no store, through the gateway, replicas, approximate mode),
/// each over each dialect asked for.
fn targets(args: &BenchArgs) -> Vec<(String, Target)> {
    let Some(url) = &args.target else { return fleet_targets(args) };
    let worker_stats = args
        .worker_stats
        .iter()
        .enumerate()
        .map(|(k, url)| {
            let mut w = kvroute_router::WorkerSpec::new(k as u64);
            w.url = Some(url.trim_end_matches('/').to_owned());
            w
        })
        .collect();
    let target = Target::Remote {
        api: args.target_api,
        urls: url.split(',').map(|u| u.trim().trim_end_matches('/').to_owned()).collect(),
        worker_stats,
        model: args.model.clone(),
    };
    vec![(args.label.clone().unwrap_or_else(|| "target".to_owned()), target)]
}

/// [`targets`] of the bench's own fleets.
fn fleet_targets(args: &BenchArgs) -> Vec<(String, Target)> {
    let dialects = match args.dialects.is_empty() {
        true => vec![kvroute_router::Dialect::VllmGenerate],
        false => args.dialects.clone(),
    };
    let fleet = |policy, events| Target::Fleet {
        policy,
        events,
        replicas: None,
        dialect: dialects[0],
        pd_baseline: None,
        store: true,
        gateway: false,
    };
    let with_events = args.policies().into_iter().flat_map(|p| variants(args, p, &fleet(p, true)));
    let approximate = args
        .approximate
        .iter()
        .filter(|_| args.slo_ttft_p99.is_empty())
        .map(|&p| (format!("{p}-approx"), fleet(p, false)));
    with_events.chain(approximate).flat_map(|run| per_dialect(&dialects, run)).collect()
}

/// A policy's fleet and the variants asked for beside it.
fn variants(args: &BenchArgs, p: PolicyKind, base: &Target) -> Vec<(String, Target)> {
    let with = |change: &dyn Fn(&mut Target)| {
        let mut target = base.clone();
        change(&mut target);
        target
    };
    let mut runs = vec![(p.to_string(), base.clone())];
    // The pair cost's baselines, beside the kv policy's own.
    for &b in args.pd_baselines.iter().filter(|_| p == PolicyKind::Kv) {
        let target = with(&|t| {
            if let Target::Fleet { pd_baseline, .. } = t {
                *pd_baseline = Some(b);
            }
        });
        runs.push((format!("{p}-{}", b.label()), target));
    }
    if args.store_baseline {
        let target = with(&|t| {
            if let Target::Fleet { store, .. } = t {
                *store = false;
            }
        });
        runs.push((format!("{p}-no-store"), target));
    }
    if args.gateway {
        let target = with(&|t| {
            if let Target::Fleet { gateway, .. } = t {
                *gateway = true;
            }
        });
        runs.push((format!("{p}-gateway"), target));
    }
    if args.replicas > 1 {
        for sync in [true, false] {
            let suffix = if sync { "sync" } else { "alone" };
            let r = Replicas { n: args.replicas, sync, nats_url: None };
            let target = with(&|t| {
                if let Target::Fleet { replicas, .. } = t {
                    *replicas = Some(r.clone());
                }
            });
            runs.push((format!("{p}-x{}-{suffix}", args.replicas), target));
        }
    }
    runs
}

/// One run over each dialect, side by side, when more than one is asked for.
fn per_dialect(
    dialects: &[kvroute_router::Dialect],
    (label, target): (String, Target),
) -> Vec<(String, Target)> {
    match target {
        Target::Fleet { .. } if dialects.len() > 1 => dialects
            .iter()
            .map(|&d| {
                let mut target = target.clone();
                if let Target::Fleet { dialect, .. } = &mut target {
                    *dialect = d;
                }
                (format!("{label}@{d}"), target)
            })
            .collect(),
        other => vec![(label, other)],
    }
}

/// Every workload at every rate, `--runs` times, against every target.
fn run_workloads(
    args: &BenchArgs,
    targets: &[(String, Target)],
    preprocessor: &std::sync::Arc<Preprocessor>,
) -> anyhow::Result<Vec<WorkloadResult>> {
    let rates: Vec<Option<f64>> = match args.rates() {
        rates if rates.is_empty() => vec![None],
        rates => rates.into_iter().map(Some).collect(),
    };
    let mut results = Vec::new();
    for kind in args.workloads() {
        let fleet = args.fleet_for(kind);
        // Engines the bench did not start have a capacity it does not know.
        let capacity = match &args.target {
            None if fleet.external.is_empty() => Some(fleet.capacity_blocks()),
            _ => None,
        };
        for (rate, run) in rates.iter().flat_map(|&r| (0..args.runs).map(move |n| (r, n))) {
            let workload = args.workload(kind, rate, preprocessor)?;
            let mut runs = Vec::new();
            for target in targets {
                runs.push(run_one(&workload, target, &fleet, capacity, preprocessor)?);
            }
            results.push(WorkloadResult { workload, rate, run, runs });
        }
    }
    Ok(results)
}

/// One run of `workload` against `target`, summarized.
fn run_one(
    workload: &Workload,
    (label, target): &(String, Target),
    fleet: &run::FleetConfig,
    capacity: Option<usize>,
    preprocessor: &std::sync::Arc<Preprocessor>,
) -> anyhow::Result<(run::RunData, summary::Summary)> {
    let bar = progress_bar();
    let data = run::run(workload, target, fleet, label, &bar, preprocessor)?;
    bar.finish_and_clear();
    let bs = fleet.block_size as usize;
    // A remote fleet's capacity: what its workers report.
    let cap = capacity.or_else(|| {
        let blocks: u64 = data
            .stats_end
            .iter()
            .map(|s| s.kv_total_blocks + s.host_total_blocks + s.storage_total_blocks)
            .sum();
        (blocks > 0).then_some(blocks as usize)
    });
    let summary = summary::summarize(&data, bs, cap);
    tracing::info!(
        workload = %workload.kind,
        policy = %label,
        secs = format!("{:.1}", data.wall_secs),
        ttft_p50_ms = format!("{:.1}", summary.ttft_ms.p50.unwrap_or(f64::NAN)),
        hit_rate = format!("{:.3}", summary.hit_rate.unwrap_or(f64::NAN)),
        errors = summary.errors,
        drifts = data.drifts.map_or("-".to_owned(), |d| d.to_string()),
        flow = format!("{:?}", data.flow),
        exact = format!("{}/{}", summary.exactly_predicted, summary.predicted),
        "run done"
    );
    Ok((data, summary))
}

/// `--slo-ttft-p99`: the goodput search of every workload and target; writes its report.
fn goodput_search(
    args: &BenchArgs,
    targets: &[(String, Target)],
    preprocessor: &std::sync::Arc<Preprocessor>,
) -> anyhow::Result<PathBuf> {
    let started = Instant::now();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let mut results = Vec::new();
    for kind in args.workloads() {
        let fleet = args.fleet_for(kind);
        let capacity =
            (args.target.is_none() && fleet.external.is_empty()).then(|| fleet.capacity_blocks());
        let load = goodput::Load::of(kind);
        let start = match load {
            goodput::Load::Rate => args.default_rate(kind, preprocessor),
            goodput::Load::Users => args.users as f64,
        };
        let mut policies = Vec::new();
        for (label, target) in targets {
            let probes = goodput::search(&args.slo_ttft_p99, start, load, |rate| {
                let workload = match load {
                    goodput::Load::Rate => args.workload(kind, Some(rate), preprocessor)?,
                    goodput::Load::Users => {
                        let args = BenchArgs { users: rate as usize, ..args.clone() };
                        args.workload(kind, None, preprocessor)?
                    }
                };
                let bar = progress_bar();
                let cpu_before = goodput::process_cpu_secs();
                let t0 = Instant::now();
                let data = run::run(&workload, target, &fleet, label, &bar, preprocessor)?;
                let wall = t0.elapsed().as_secs_f64();
                bar.finish_and_clear();
                let cpu = cpu_before.zip(goodput::process_cpu_secs()).map(|(a, b)| b - a);
                let share = cpu.map(|c| c / (wall * cores));
                let summary = summary::summarize(&data, fleet.block_size as usize, capacity);
                let probe =
                    goodput::Probe::new(rate, &summary, wall, share).with_tpot_slo(args.slo_tpot());
                tracing::info!(
                    workload = %kind,
                    policy = %label,
                    rate,
                    ttft_p99_ms = format!("{:.1}", probe.ttft_p99_ms.unwrap_or(f64::NAN)),
                    tpot_p99_ms = format!("{:.1}", probe.tpot_p99_ms.unwrap_or(f64::NAN)),
                    errors = probe.errors,
                    cpu = format!("{:.0}%", 100.0 * share.unwrap_or(f64::NAN)),
                    "goodput probe"
                );
                Ok(probe)
            })?;
            policies.push(goodput::PolicyGoodput { label: label.clone(), probes });
        }
        results.push(goodput::GoodputResult {
            workload: kind,
            load,
            start_rate: start,
            slos_ms: args.slo_ttft_p99.clone(),
            policies,
        });
    }
    report::write_goodput(&args.out, args, &results, started.elapsed())
}

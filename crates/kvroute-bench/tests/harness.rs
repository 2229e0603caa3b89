//! The harness end to end over real sockets: small workloads against a fresh simulated fleet
//! (self-contained mode) and against an endpoint by URL (`--target` mode), then the report.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use indicatif::ProgressBar;
use kvroute_bench::run::{self, FleetConfig, Target, TargetApi};
use kvroute_bench::summary::summarize;
use kvroute_bench::workload::{Multimodal, SharedPrefix};
use kvroute_bench::{BenchArgs, WorkloadResult};
use kvroute_core::schedule::PolicyKind;
use kvroute_preprocess::Preprocessor;
use kvroute_router::Dialect;

fn fleet() -> FleetConfig {
    FleetConfig { workers: 2, ..FleetConfig::default() }
}

/// `kvroute bench` arguments as the command line parses them (after `bench`; no argument
/// holds a space).
fn bench_args(line: &str) -> BenchArgs {
    let command = <BenchArgs as clap::Args>::augment_args(clap::Command::new("bench"));
    let matches = command.get_matches_from(std::iter::once("bench").chain(line.split_whitespace()));
    <BenchArgs as clap::FromArgMatches>::from_arg_matches(&matches).unwrap()
}

fn small_shared_prefix() -> kvroute_bench::workload::Workload {
    SharedPrefix {
        groups: 2,
        prompts_per_group: 8,
        system_tokens: 512,
        question_tokens: 32,
        output_tokens: 4,
        rate: 8.0,
    }
    .generate(1, fleet().block_size().unwrap(), 0.1)
}

/// Through the test gateway: over ext_proc to kvroute as its picker, or round-robin alone;
/// beside kvroute's own front door on the same kind of fleet (4 workers, 2 groups).
#[test]
fn through_the_gateway_the_picker_keeps_groups_together_and_round_robin_does_not() {
    let workload = small_shared_prefix();
    let fleet = FleetConfig { workers: 4, ..FleetConfig::default() };
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let mut hit = Vec::new();
    let runs = [(PolicyKind::Kv, false), (PolicyKind::Kv, true), (PolicyKind::RoundRobin, true)];
    for (policy, gateway) in runs {
        let target = Target::Fleet {
            policy,
            events: true,
            replicas: None,
            dialect: Dialect::OpenaiChat,
            pd_baseline: None,
            store: true,
            gateway,
        };
        let label = format!("{policy}-{gateway}");
        let data =
            run::run(&workload, &target, &fleet, &label, &ProgressBar::hidden(), &pre).unwrap();
        assert_eq!(data.records.len(), 16);
        assert!(data.records.iter().all(|r| r.error.is_none() && r.output_tokens == 4));
        let s = summarize(&data, 16, Some(fleet.capacity_blocks()));
        assert_eq!(s.errors, 0);
        hit.push(s.hit_rate.unwrap());
    }
    // Round robin sends each group to every worker (8 misses of 16); kvroute's front door
    // and its picker keep a group on few.
    let miss = 512.0 / (16.0 * 544.0);
    assert!((hit[2] - (1.0 - 8.0 * miss - 32.0 / 544.0)).abs() < 1e-9, "{hit:?}");
    assert!(hit[0] > hit[2] + 1.5 * miss && hit[1] > hit[2] + 1.5 * miss, "{hit:?}");
}

/// A self-contained fleet under `policy`, with KV events, over vLLM's generate API.
fn fleet_target(policy: PolicyKind) -> Target {
    Target::Fleet {
        policy,
        events: true,
        replicas: None,
        dialect: Dialect::VllmGenerate,
        pd_baseline: None,
        store: true,
        gateway: false,
    }
}

#[test]
fn a_fresh_fleet_per_policy_and_its_ground_truth() {
    let workload = small_shared_prefix();
    let fleet = fleet();
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let mut runs = Vec::new();
    for policy in [PolicyKind::Kv, PolicyKind::RoundRobin] {
        let label = policy.to_string();
        let data = run::run(
            &workload,
            &fleet_target(policy),
            &fleet,
            &label,
            &ProgressBar::hidden(),
            &pre,
        )
        .unwrap();
        assert_eq!(data.records.len(), 16);
        for r in &data.records {
            assert!(r.error.is_none(), "{r:?}");
            assert_eq!(r.output_tokens, 4);
            assert_eq!(r.prompt_tokens, Some(544), "the engine saw the generated tokens");
            assert!(r.ttft_ms.unwrap() <= r.e2e_ms.unwrap());
            assert_eq!(r.itl_ms.len(), 3);
            assert!(r.worker.is_some() && r.predicted_tokens.is_some());
        }
        // A fresh fleet: its counters start at the front door's parity probes (a text and an
        // image request of prompts nobody sent, so nothing cached).
        assert!(
            data.stats_start.iter().all(|s| s.requests_finished <= 2 && s.cached_tokens == 0),
            "{:?}",
            data.stats_start
        );
        let s = summarize(&data, 16, Some(fleet.capacity_blocks()));
        // The workers' counters and the answers' usage agree.
        let cached: u64 = data.records.iter().map(|r| r.cached_tokens.unwrap()).sum();
        assert_eq!(s.hit_rate, Some(cached as f64 / (16.0 * 544.0)));
        assert_eq!(s.worker_requests.iter().sum::<u64>(), 16);
        assert_eq!(s.errors, 0);
        assert_eq!(s.measured, 14, "two warm-up requests left out");
        // Two groups of 8 sharing 32 blocks: the best is 14 x 512 / (16 x 544).
        assert!((s.best_unbounded - 14.0 * 512.0 / (16.0 * 544.0)).abs() < 1e-9);
        assert_eq!(s.best_capacity, Some(s.best_unbounded), "everything fits");
        assert_eq!(s.false_hits, 0);
        assert_eq!(s.over_predicted, 0);
        if policy == PolicyKind::Kv {
            // Round robin splits each group over both workers; kv keeps it together.
            assert!(s.hit_rate.unwrap() > 0.5, "{s:?}");
        } else {
            assert_eq!(s.worker_requests, vec![8, 8]);
        }
        runs.push((data, s));
    }
    // The report of these runs.
    let out = std::env::temp_dir().join(format!("kvroute-bench-report-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let args = bench_args("--workers 2");
    let results = vec![WorkloadResult { workload, rate: None, run: 0, runs }];
    let report =
        kvroute_bench::report::write(&out, &args, &fleet, &results, Duration::ZERO).unwrap();
    let md = std::fs::read_to_string(report).unwrap();
    assert!(
        md.contains("## shared-prefix") && md.contains("| kv |") && md.contains("| round-robin |")
    );
    assert!(md.contains("kv hit rate >= 90% of the best achievable"));
    assert!(!md.contains("p50 at least"), "wave 1's p50 targets left the report");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["workloads"][0]["runs"][0]["records"].as_array().unwrap().len(), 16);
    for f in
        ["shared-prefix-ttft-cdf.svg", "shared-prefix-hit-rate.svg", "shared-prefix-workers.svg"]
    {
        assert!(std::fs::read_to_string(out.join(f)).unwrap().starts_with("<svg"), "{f}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// A disaggregated fleet (one prefill and one decode worker, every request split): each
/// prompt is counted once in the hit rate (on its prefill worker, where it was computed, not
/// again on the decode worker that pulled it), and split answers, whose cached tokens count
/// the pulled KV, are named and left out of the prediction checks.
#[test]
fn a_disaggregated_fleet_counts_each_prompt_once() {
    let workload = small_shared_prefix();
    let fleet = FleetConfig {
        workers: 0,
        disagg: Some((1, 1)),
        pd_cost: vec![("in_place".to_owned(), 0.0)],
        ..FleetConfig::default()
    };
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let target = fleet_target(PolicyKind::Kv);
    let data = run::run(&workload, &target, &fleet, "kv", &ProgressBar::hidden(), &pre).unwrap();
    assert!(data.records.iter().all(|r| r.error.is_none() && r.prefill_worker.is_some()));
    let s = summarize(&data, 16, Some(fleet.capacity_blocks()));
    assert_eq!(s.disaggregated_share, Some(1.0), "{s:?}");
    // The prefill worker's own counters are the fleet's hit rate.
    let delta = |f: &dyn Fn(&run::WorkerStats) -> u64| -> u64 {
        data.stats_end.iter().zip(&data.stats_start).map(|(e, b)| f(e) - f(b)).sum()
    };
    let prefill = |f: &dyn Fn(&run::WorkerStats) -> u64| {
        delta(&|s| if s.role == kvroute_core::schedule::Role::Prefill { f(s) } else { 0 })
    };
    let (cached, prompt) = (prefill(&|s| s.cached_tokens), prefill(&|s| s.prompt_tokens));
    assert_eq!(s.hit_rate, Some(cached as f64 / prompt as f64), "{s:?}");
    assert!(s.hit_rate.unwrap() <= s.best_unbounded, "no better than the best: {s:?}");
    // Every answer was split: none is compared with a prediction.
    assert_eq!((s.predicted, s.false_hits, s.over_predicted), (0, 0, 0), "{s:?}");
}

/// `--text-prompts`: the same workload as text through a real front door: the engines count
/// the prompts the bench derived, the router predicts their cached blocks exactly, and kv
/// keeps each group together as it does with token ids.
#[test]
fn text_prompts_reach_the_engines_as_the_same_blocks() {
    let fleet = fleet();
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let workload = small_shared_prefix().into_text(&pre, fleet.block_size().unwrap()).unwrap();
    let target = fleet_target(PolicyKind::Kv);
    let data = run::run(&workload, &target, &fleet, "kv", &ProgressBar::hidden(), &pre).unwrap();
    for r in &data.records {
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.prompt_tokens, Some(workload.requests[r.index].prompt_ids.len() as u64));
    }
    let s = summarize(&data, 16, Some(fleet.capacity_blocks()));
    assert_eq!((s.false_hits, s.over_predicted), (0, 0));
    assert!((s.best_unbounded - 14.0 * 512.0 / (16.0 * 544.0)).abs() < 1e-9);
    assert!(s.hit_rate.unwrap() > 0.5, "{s:?}");
}

#[test]
fn a_target_by_url_with_worker_stats() {
    // The endpoint under test runs on a runtime of its own, as another process would.
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let fleet = fleet();
    let (urls, workers) =
        host.block_on(run::start_fleet(&fleet, PolicyKind::Kv, true, None)).unwrap();
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let workload = Multimodal {
        requests: 12,
        images: 3,
        image_side: 56,
        output_tokens: 3,
        rate: 10.0,
        ..Multimodal::default()
    }
    .generate(2, fleet.block_size().unwrap(), 0.0, &pre)
    .unwrap();
    let target =
        Target::Remote { urls, worker_stats: workers, model: None, api: TargetApi::Openai };
    let data =
        run::run(&workload, &target, &fleet, "target", &ProgressBar::hidden(), &pre).unwrap();
    assert!(data.records.iter().all(|r| r.error.is_none()), "{:?}", data.records);
    let s = summarize(&data, 16, None);
    assert_eq!(s.worker_requests.iter().sum::<u64>(), 12);
    // Every request's prompt as the engine counted it is what the generator derived.
    for r in &data.records {
        assert_eq!(r.prompt_tokens, Some(workload.requests[r.index].prompt_ids.len() as u64));
    }
    assert_eq!(s.predicted, 12);
    assert_eq!(s.false_hits, 0);
    assert_eq!(s.over_predicted, 0);
    host.shutdown_timeout(Duration::from_secs(1));
}

/// `--engine`: engines the bench did not start (here another fleet's simulated engines, on
/// a runtime of their own as another process's would be), kvroute started per policy in front
/// of them; every request answered, every prediction exact, the hit rate from the answers'
/// usage.
#[test]
fn engines_the_bench_did_not_start() {
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (_, engines) =
        host.block_on(run::start_fleet(&fleet(), PolicyKind::RoundRobin, true, None)).unwrap();
    assert_eq!(engines.len(), 2);
    let fleet = FleetConfig { external: engines, ..fleet() };
    let workload = small_shared_prefix();
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let data = run::run(
        &workload,
        &fleet_target(PolicyKind::Kv),
        &fleet,
        "kv",
        &ProgressBar::hidden(),
        &pre,
    )
    .unwrap();
    assert_eq!(data.records.len(), 16);
    assert!(data.records.iter().all(|r| r.error.is_none()), "{:?}", data.records);
    assert!(data.stats_end.is_empty(), "no simulated engine's counters: the usage is the truth");
    let s = summarize(&data, 16, None);
    let cached: u64 = data.records.iter().map(|r| r.cached_tokens.unwrap()).sum();
    assert_eq!(s.hit_rate, Some(cached as f64 / (16.0 * 544.0)));
    assert!(s.hit_rate.unwrap() > 0.5, "kv kept each group on one engine: {s:?}");
    assert_eq!((s.predicted, s.over_predicted, s.false_hits), (16, 0, 0));
    host.shutdown_timeout(Duration::from_secs(1));
}

/// `--target-api sglang-generate`: a workload sent to an engine's SGLang `/generate` as token
/// ids, its cumulative stream read back (tokens timed, the answer and the cache hits kept).
#[test]
fn a_target_by_sglangs_native_api() {
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let fleet = fleet();
    let (_, workers) = host.block_on(run::start_fleet(&fleet, PolicyKind::Kv, true, None)).unwrap();
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let workload = small_shared_prefix();
    // One engine, straight: every repeat of a group's prefix is a hit there.
    let engine = workers[0].url.clone().unwrap();
    let target = Target::Remote {
        urls: vec![engine],
        worker_stats: workers[..1].to_vec(),
        model: None,
        api: TargetApi::SglangGenerate,
    };
    let data =
        run::run(&workload, &target, &fleet, "sglang", &ProgressBar::hidden(), &pre).unwrap();
    assert_eq!(data.records.len(), 16);
    for r in &data.records {
        assert!(r.error.is_none(), "{r:?}");
        assert_eq!(r.output_tokens, 4, "{r:?}");
        assert_eq!(r.itl_ms.len(), 3, "a token per chunk: {r:?}");
        assert!(r.ttft_ms.is_some() && !r.answer.is_empty(), "{r:?}");
        assert_eq!(r.prompt_tokens, Some(workload.requests[r.index].prompt_ids.len() as u64));
    }
    let hits = data.records.iter().filter(|r| r.cached_tokens.unwrap_or(0) >= 512).count();
    assert!(hits >= 12, "the repeats of each group's 512-token prefix hit: {hits} of 16");
    host.shutdown_timeout(Duration::from_secs(1));
}

/// `--slo-ttft-p99`: the search end to end on a tiny workload: probes are real runs; an SLO
/// no run can miss doubles the rate up to the highest rate probed; the report opens with the
/// goodput table and lists every probe with its CPU share. (The bracketing itself is unit
/// tested in `goodput`.)
#[test]
fn the_goodput_search_writes_its_table() {
    let out = std::env::temp_dir().join(format!("kvroute-goodput-{}", std::process::id()));
    let args = bench_args(&format!(
        "--workers 2 --workloads random --policies kv,round-robin --random-requests 6 \
         --random-prompt-tokens 64 --output-tokens 2 --random-rate 40 --slo-ttft-p99 100000 \
         --out {}",
        out.display()
    ));
    let report = kvroute_bench::bench(&args).unwrap().report;
    let md = std::fs::read_to_string(report).unwrap();
    assert!(md.starts_with("# kvroute bench: goodput"), "{md}");
    let table = md.split("## random: probes").next().unwrap();
    // A loaded machine may mark the probe host-bound; the goodput itself is still 320.
    let kv_row = table.lines().find(|l| l.starts_with("| random | kv |")).unwrap_or_default();
    assert!(kv_row.starts_with("| random | kv | 320 req/s"), "{table}");
    assert!(kv_row.contains("| 1.00x |"), "{table}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let probes = json["goodput"][0]["policies"][0]["probes"].as_array().unwrap();
    let rates: Vec<f64> = probes.iter().map(|p| p["rate"].as_f64().unwrap()).collect();
    assert_eq!(rates, vec![40.0, 80.0, 160.0, 320.0], "doubling up to the highest rate probed");
    assert!(probes.iter().all(|p| p["errors"] == 0 && p["cpu_share"].as_f64().is_some()));
    std::fs::remove_dir_all(&out).unwrap();
}

/// Multi-turn's goodput is searched over users (a closed loop), whole ones: an SLO every run
/// misses halves the users from the default down to one.
#[test]
fn multi_turn_goodput_is_searched_over_users() {
    let out = std::env::temp_dir().join(format!("kvroute-goodput-users-{}", std::process::id()));
    let args = bench_args(&format!(
        "--workers 2 --workloads multi-turn --policies kv --users 3 --rounds 2 \
         --context-tokens 16 --turn-tokens 8 --think-time 0.01 --output-tokens 2 \
         --slo-ttft-p99 0.001 --out {}",
        out.display()
    ));
    let md = std::fs::read_to_string(kvroute_bench::bench(&args).unwrap().report).unwrap();
    assert!(md.contains("| multi-turn | kv | none |"), "{md}");
    assert!(md.contains("| policy | users | TTFT p50 |"), "{md}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["goodput"][0]["load"], "users");
    let probes = json["goodput"][0]["policies"][0]["probes"].as_array().unwrap();
    let users: Vec<f64> = probes.iter().map(|p| p["rate"].as_f64().unwrap()).collect();
    assert_eq!(users, vec![1.0, 2.0, 3.0], "3 users, halved to 2 (1.5 rounded), then 1");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn replicas_share_one_fleet_and_a_dead_front_door_is_skipped() {
    let host =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let store = std::env::temp_dir().join(format!("kvroute-bench-nats-{}", std::process::id()));
    let nats =
        host.block_on(kvroute_bench::fixtures::nats_server::NatsServer::start(&store, 0)).unwrap();
    let fleet = fleet();
    let replicas = run::Replicas { n: 2, sync: true, nats_url: Some(nats.url()) };
    let (mut urls, workers) =
        host.block_on(run::start_fleet(&fleet, PolicyKind::Kv, true, Some(&replicas))).unwrap();
    assert_eq!(urls.len(), 2, "two front doors");
    // A third that refuses connections: a port bound, then closed.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    urls.push(format!("http://{closed}"));
    let pre = std::sync::Arc::new(Preprocessor::builtin());
    let workload = small_shared_prefix();
    let target = Target::Remote {
        urls: urls.clone(),
        worker_stats: workers,
        model: None,
        api: TargetApi::Openai,
    };
    let data =
        run::run(&workload, &target, &fleet, "replicas", &ProgressBar::hidden(), &pre).unwrap();
    assert!(data.records.iter().all(|r| r.error.is_none()), "{:?}", data.records);
    // Both live front doors served (their routers each counted decisions).
    let client = kvroute_http::HttpClient::new();
    for url in &urls[..2] {
        let (_, body) = host.block_on(client.get(&format!("{url}/metrics"))).unwrap();
        let text = String::from_utf8_lossy(&body).into_owned();
        let decisions: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("kvroute_router_decisions_total "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(decisions >= 5.0, "{url}: {decisions} decisions");
        assert!(text.contains("kvroute_replica_peers 1"), "{url} hears the other replica");
    }
    drop(nats);
    let _ = std::fs::remove_dir_all(&store);
}

/// `--quick`: shared-prefix alone, kv against round-robin, 96 requests each, whatever else
/// the command line says about workloads and policies.
#[test]
fn the_quick_look_runs_shared_prefix_for_kv_and_round_robin() {
    let out = std::env::temp_dir().join(format!("kvroute-quick-{}", std::process::id()));
    let args = bench_args(&format!(
        "--quick --workloads multi-turn --policies dynamo --out {}",
        out.display()
    ));
    let finished = kvroute_bench::bench(&args).unwrap();
    let md = std::fs::read_to_string(&finished.report).unwrap();
    assert!(md.contains("## shared-prefix") && !md.contains("## multi-turn"), "{md}");
    // The terminal's table: a row per policy with its hit rate, TTFT and goodput.
    let table = &finished.summary;
    assert!(table.contains("shared-prefix") && table.contains("goodput"), "{table}");
    for policy in ["kv", "round-robin"] {
        let row =
            table.lines().find(|l| l.trim_start().starts_with(&format!("{policy} "))).unwrap();
        assert!(row.contains(" ms") && row.ends_with("req/s"), "{row}");
    }
    assert!(table.contains("TTFT <= 10 ms"), "--quick's goodput SLO: {table}");
    assert!(md.contains("| kv |") && md.contains("| round-robin |"), "{md}");
    assert!(!md.contains("| dynamo |") && !md.contains("kv-approx"), "{md}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let runs = json["workloads"][0]["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r["records"].as_array().unwrap().len() == 96));
    std::fs::remove_dir_all(&out).unwrap();
}

//! `kvroute bench --faults` (docs/bench/faults.md): long streams at a steady rate over three
//! simulated engines run as processes of their own (`kvroute mocker`), one of them killed
//! with SIGKILL mid-run and restarted on the same ports a few seconds later; once with streams
//! allowed to move to another worker (`--max-migrations 1`, the default) and once without (0).
//! It reports the requests lost, those in flight on the killed engine (moved, or lost), and
//! the total time of those against the rest.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvroute_core::BlockSize;
use kvroute_core::schedule::PolicyKind;
use kvroute_preprocess::Preprocessor;
use kvroute_router::WorkerSpec;
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde::Serialize;

use crate::args::BenchArgs;
use crate::run::{RequestRecord, RunData};
use crate::stats::quantile;
use crate::workload::SharedPrefix;

/// The schedule: streams per second, tokens each, and how long it runs.
const RATE: f64 = 6.0;
const OUTPUT_TOKENS: u32 = 256;
const SECONDS: f64 = 24.0;
/// When engine 1 is killed, and when it is back.
const KILL_AT: f64 = 8.0;
const BACK_AT: f64 = 14.0;

/// One engine process and where it listens.
struct Engine {
    child: Child,
    spec: WorkerSpec,
    /// The ports it listens on: `--port`, `--events`, `--replay`, `--load-metrics`.
    ports: [String; 4],
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Engine {
    /// Starts `kvroute mocker` (this very binary) on free ports, or on `ports` again.
    fn start(args: &BenchArgs, id: u64, ports: Option<&[String; 4]>) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("the kvroute binary")?;
        let fleet = args.fleet();
        let mut cmd = Command::new(exe);
        cmd.args(["mocker", "--speedup", &fleet.speedup.to_string()])
            .args(["--num-blocks", &fleet.num_blocks.to_string()])
            .args(["--block-size", &fleet.block_size.to_string()]);
        match ports {
            None => cmd.args(["--port", "0"]),
            Some([http, events, replay, load]) => cmd
                .args(["--port", http.rsplit(':').next().unwrap_or("0")])
                .args(["--events", events, "--replay", replay, "--load-metrics", load]),
        };
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("its stdout")?).read_line(&mut line)?;
        anyhow::ensure!(!line.is_empty(), "the engine did not start");
        let after = |key: &str| -> anyhow::Result<String> {
            let at = line.find(key).with_context(|| format!("{key} in {line}"))? + key.len();
            let word = line[at..].split_whitespace().next().unwrap_or_default();
            Ok(word.trim_end_matches(';').to_owned())
        };
        let ports =
            [after("listening on ")?, after("events ")?, after("replay ")?, after("load ")?];
        let mut spec = WorkerSpec::new(id);
        spec.url = Some(ports[0].clone());
        spec.events = Some(ports[1].clone());
        spec.replay = Some(ports[2].clone());
        spec.metrics = Some(ports[3].clone());
        Ok(Self { child, spec, ports })
    }

    /// Starts it again on the same ports (they may take a moment to be free).
    fn restart(args: &BenchArgs, id: u64, ports: &[String; 4]) -> anyhow::Result<Self> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match Self::start(args, id, Some(ports)) {
                Ok(engine) => return Ok(engine),
                Err(e) if std::time::Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

/// What one run measured.
#[derive(Debug, Serialize)]
pub struct FaultRun {
    pub max_migrations: u32,
    pub requests: usize,
    pub lost: usize,
    /// In flight on the killed engine when it died.
    pub caught: usize,
    pub caught_lost: usize,
    pub migrations: u64,
    /// Total time, ms: p50 and p99 of those caught (complete ones), and of the rest.
    pub caught_e2e_ms: Option<(f64, f64)>,
    pub others_e2e_ms: Option<(f64, f64)>,
}

/// Both runs; the report's path.
pub fn bench(args: &BenchArgs, preprocessor: &Arc<Preprocessor>) -> anyhow::Result<PathBuf> {
    let bs = BlockSize::new(args.block_size)?;
    let mut runs = Vec::new();
    for max_migrations in [1, 0] {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        runs.push(runtime.block_on(one(args, preprocessor, bs, max_migrations))?);
        runtime.shutdown_timeout(Duration::from_secs(2));
    }
    write_report(&args.out, &runs)
}

async fn one(
    args: &BenchArgs,
    preprocessor: &Arc<Preprocessor>,
    bs: BlockSize,
    max_migrations: u32,
) -> anyhow::Result<FaultRun> {
    let mut engines: Vec<Engine> =
        (1..=3).map(|id| Engine::start(args, id, None)).collect::<anyhow::Result<_>>()?;
    let specs: Vec<WorkerSpec> = engines.iter().map(|e| e.spec.clone()).collect();
    let fleet = args.fleet();
    let config = StackConfig {
        simulated: Simulated { count: 0, ..Simulated::default() },
        router: fleet.router_config(PolicyKind::Kv, specs.clone())?,
        front_door: FrontDoorOptions { max_migrations, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await?;
    let base = stack.serve_frontend_on_loopback().await?;
    let router = Arc::clone(stack.router.as_ref().context("an embedded router")?);
    let waiting = router.view().wait_ready(Duration::from_secs(30)).await;
    anyhow::ensure!(waiting.is_empty(), "engines not ready in 30 s: {waiting:?}");

    let workload = SharedPrefix {
        groups: 4,
        prompts_per_group: (SECONDS * RATE / 4.0).ceil() as usize,
        output_tokens: OUTPUT_TOKENS,
        rate: RATE,
        ..SharedPrefix::default()
    }
    .generate(args.seed, bs, 0.0);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let drive =
        crate::run::drive_on(&workload, vec![base.clone()], &specs, preprocessor, bs, started_tx);
    let ports = engines[0].ports.clone();
    let script = async {
        let t0 = started_rx.await.context("the run's start")?;
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(KILL_AT)).await;
        let dead = engines.remove(0);
        drop(dead); // SIGKILL
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(BACK_AT)).await;
        let back = tokio::task::block_in_place(|| Engine::restart(args, 1, &ports))?;
        anyhow::Ok(back)
    };
    let (data, back) = tokio::join!(drive, script);
    let (data, _back): (RunData, Engine) = (data?, back?);
    let metrics = kvroute_http::HttpClient::new().get(&format!("{base}/metrics")).await?.1;
    let metrics = String::from_utf8_lossy(&metrics);
    let migrations = kvroute_http::metrics::sample(
        &metrics,
        "kvroute_frontend_migrations_total{reason=\"broken\"}",
    );
    Ok(figures(max_migrations, &data.records, migrations.unwrap_or(0.0) as u64, &specs[0]))
}

/// The run's figures: a request was caught when it went to the killed engine and had not
/// ended when it died.
fn figures(
    max_migrations: u32,
    records: &[RequestRecord],
    migrations: u64,
    killed: &WorkerSpec,
) -> FaultRun {
    let killed = killed.id.0.to_string();
    let caught = |r: &&RequestRecord| {
        let end = r.sent_at + r.e2e_ms.unwrap_or(f64::INFINITY) / 1e3;
        r.worker.as_deref() == Some(killed.as_str()) && r.sent_at < KILL_AT && end > KILL_AT
            || r.error.is_some() && r.sent_at < KILL_AT
    };
    let (mut caught_ms, mut others_ms) = (Vec::new(), Vec::new());
    let (mut n_caught, mut caught_lost) = (0, 0);
    for r in records {
        let is_caught = caught(&r);
        n_caught += usize::from(is_caught);
        caught_lost += usize::from(is_caught && r.error.is_some());
        if let (Some(ms), None) = (r.e2e_ms, &r.error) {
            match is_caught {
                true => caught_ms.push(ms),
                false => others_ms.push(ms),
            }
        }
    }
    let p = |v: &mut Vec<f64>| Some((quantile(v, 0.5)?, quantile(v, 0.99)?));
    FaultRun {
        max_migrations,
        requests: records.len(),
        lost: records.iter().filter(|r| r.error.is_some()).count(),
        caught: n_caught,
        caught_lost,
        migrations,
        caught_e2e_ms: p(&mut caught_ms),
        others_e2e_ms: p(&mut others_ms),
    }
}

fn write_report(out: &Path, runs: &[FaultRun]) -> anyhow::Result<PathBuf> {
    let ms = |v: Option<(f64, f64)>| v.map_or("-".to_owned(), |(a, b)| format!("{a:.0} / {b:.0}"));
    let mut md = format!(
        "# Faults: an engine killed mid-run\n\nThree simulated engines (`kvroute mocker` processes), \
         shared-prefix streams of {OUTPUT_TOKENS} tokens at {RATE} requests/s for {SECONDS} s; \
         engine 1 killed with SIGKILL at {KILL_AT} s and restarted on its ports at {BACK_AT} s.\n\n\
         | --max-migrations | requests | lost | caught by the kill | of those lost | migrations | \
         caught: total ms p50 / p99 | others: total ms p50 / p99 |\n|---|---|---|---|---|---|---|---|\n"
    );
    for r in runs {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.max_migrations,
            r.requests,
            r.lost,
            r.caught,
            r.caught_lost,
            r.migrations,
            ms(r.caught_e2e_ms),
            ms(r.others_e2e_ms),
        ));
    }
    let path = out.join("faults.md");
    std::fs::write(&path, md)?;
    std::fs::write(out.join("faults.json"), serde_json::to_vec_pretty(runs)?)?;
    Ok(path)
}

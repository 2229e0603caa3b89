//! One churn run: the engines, the stack with its source of members, the load, the changes
//! on their schedule, and a watch of the router's members while it runs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use kvroute_core::schedule::PolicyKind;
use kvroute_core::{BlockSize, WorkerId};
use kvroute_preprocess::Preprocessor;
use kvroute_router::RouterState;
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};

use super::figures::{ChurnRun, Timeline, figures, write_report};
use super::fleet::{Engines, Membership, admin_token};
use super::plan::{ChurnPlan, ChurnSource, ChurnVia, Plan};
use crate::args::BenchArgs;
use crate::run::{FleetConfig, RunData};
use crate::workload::SharedPrefix;

/// The schedule's rate, requests/s.
pub(super) const RATE: f64 = 12.0;

/// Every run `args` asks for (`--churn`, `--churn-sources`, `--churn-via`), one after another;
/// the report's path.
pub fn bench(args: &BenchArgs, preprocessor: &Arc<Preprocessor>) -> anyhow::Result<PathBuf> {
    let bs = BlockSize::new(args.block_size)?;
    let mut runs = Vec::new();
    for &plan in &args.churn {
        for &source in &args.churn_sources {
            for &via in &args.churn_via {
                tracing::info!(?plan, ?source, ?via, "churn run");
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                let fleet = args.fleet();
                let run = runtime.block_on(one(
                    plan,
                    source,
                    via,
                    &fleet,
                    preprocessor,
                    bs,
                    args.seed,
                ))?;
                runtime.shutdown_timeout(Duration::from_secs(2));
                runs.push(run);
            }
        }
    }
    write_report(&args.out, &runs)
}

/// One plan through one source and one way in.
async fn one(
    plan_kind: ChurnPlan,
    source: ChurnSource,
    via: ChurnVia,
    fleet: &FleetConfig,
    preprocessor: &Arc<Preprocessor>,
    bs: BlockSize,
    seed: u64,
) -> anyhow::Result<ChurnRun> {
    let plan = plan_kind.plan();
    let engines = Engines::start(plan.engines, fleet).await?;
    let store = std::env::temp_dir().join(format!("kvroute-churn-{}", std::process::id()));
    let (mut membership, discovery) = Membership::start(source, &engines, &store).await?;
    // Membership changes through the API need an admin token: the run draws its own.
    let token = admin_token()?;
    let config = StackConfig {
        simulated: Simulated { count: 0, ..Simulated::default() },
        router: fleet.router_config(PolicyKind::Kv, Vec::new())?,
        front_door: FrontDoorOptions { expose_overlap: true, ..FrontDoorOptions::default() },
        discovery,
        access: kvroute_stack::Access {
            admin: kvroute_http::Credentials::new([token.as_str()], "the churn run")?,
            ..Default::default()
        },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await?;
    let base = stack.serve_frontend_on_loopback().await?;
    membership.set_admin(&base, &token);
    let router = Arc::clone(stack.router.as_ref().context("an embedded router")?);
    let _kube = membership.kube_source(&engines)?.map(|source| {
        kvroute_router::members::spawn_source(&router, Box::new(source), Duration::from_secs(60))
    });
    let urls = match via {
        ChurnVia::Front => vec![base],
        ChurnVia::Picker => vec![gateway(&stack).await?],
    };
    membership.apply(&engines, &plan.initial, &plan.initial, &[]).await?;
    let initial: Vec<WorkerId> = plan.initial.iter().map(|&k| engines.id(k)).collect();
    let ready =
        wait_until(Duration::from_secs(30), || initial.iter().all(|&w| is_ready(&router, w))).await;
    anyhow::ensure!(
        ready,
        "the first workers were not ready in 30 s: {:?}",
        router.view().workers()
    );

    let workload = SharedPrefix {
        prompts_per_group: (plan.seconds * RATE / 12.0).ceil() as usize,
        rate: RATE,
        ..SharedPrefix::default()
    }
    .generate(seed, bs, 0.0);
    let specs = engines.specs.clone();
    let timeline = Arc::new(Mutex::new(Timeline::default()));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn(watch_members(Arc::clone(&router), Arc::clone(&timeline)));
    let script = {
        let (plan, timeline) = (plan.clone(), Arc::clone(&timeline));
        async move {
            let t0 = started_rx.await.context("the run's start")?;
            timeline.lock().unwrap_or_else(PoisonError::into_inner).t0 = Some(t0);
            changes(&plan, &engines, &mut membership, t0).await?;
            anyhow::Ok((engines, membership))
        }
    };
    let drive = crate::run::drive_on(&workload, urls, &specs, preprocessor, bs, started_tx);
    let (data, scripted) = tokio::join!(drive, script);
    let (engines, _membership) = scripted?;
    let data: RunData = data?;
    // What is left once the last drained worker had time to leave.
    tokio::time::sleep(Duration::from_secs(2)).await;
    watch.abort();
    let timeline = std::mem::take(&mut *timeline.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(figures(plan_kind, source, via, &plan, &engines, &data, &timeline, &router))
}

/// The plan's changes, each at its time from `t0`.
async fn changes(
    plan: &Plan,
    engines: &Engines,
    membership: &mut Membership,
    t0: tokio::time::Instant,
) -> anyhow::Result<()> {
    let mut members = plan.initial.clone();
    for change in &plan.changes {
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(change.at)).await;
        members.retain(|k| !change.leave.contains(k));
        members.extend(&change.join);
        membership.apply(engines, &members, &change.join, &change.leave).await?;
    }
    Ok(())
}

/// Records, every 50 ms, when each worker is first ready, seen draining and gone.
async fn watch_members(router: Arc<RouterState>, timeline: Arc<Mutex<Timeline>>) {
    let mut known: BTreeMap<WorkerId, ()> = BTreeMap::new();
    loop {
        let now = tokio::time::Instant::now();
        let workers = router.view().workers();
        {
            let mut t = timeline.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(t0) = t.t0 {
                let at = now.saturating_duration_since(t0).as_secs_f64();
                for w in &workers {
                    known.insert(w.id, ());
                    if w.ready.iter().all(|r| *r) && !w.draining {
                        t.ready.entry(w.id).or_insert(at);
                    }
                    if w.draining {
                        t.draining.entry(w.id).or_insert(at);
                    }
                }
                for id in known.keys() {
                    if !workers.iter().any(|w| w.id == *id) {
                        t.gone.entry(*id).or_insert(at);
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn is_ready(router: &RouterState, worker: WorkerId) -> bool {
    router.view().workers().iter().any(|w| w.id == worker && w.ready.iter().all(|r| *r))
}

async fn wait_until(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !f() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The test gateway with kvroute as its Endpoint Picker, in front of the stack.
async fn gateway(stack: &Stack) -> anyhow::Result<String> {
    use kvroute_test_gateway::{Gateway, GatewayConfig};
    let picker = stack.picker(kvroute_epp::EppOptions::default(), None).context("a picker")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(kvroute_epp::serve(listener, picker, async {}, std::future::pending()));
    let gateway = Gateway::new(GatewayConfig::ext_proc(url))?;
    Ok(kvroute_stack::serve_on_loopback(gateway.app()).await?)
}

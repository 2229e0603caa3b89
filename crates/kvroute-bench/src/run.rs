//! One run: a workload's schedule played against one endpoint, every request streamed and
//! timed, the workers' ground-truth counters sampled while it runs.
//!
//! Self-contained runs start their own fleet — simulated workers, the router with the policy
//! under test and the front door — on a runtime of their own, dropped at the end, so every
//! policy starts from empty caches and nothing of one run lingers into the next.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use http_body_util::BodyExt;
use indicatif::ProgressBar;
use kvroute_core::BlockSize;
use kvroute_core::schedule::PolicyKind;
use kvroute_http::openai::{Completion, ModelList};
use kvroute_http::paths;
use kvroute_http::{HttpClient, SseEvent, SseReader};
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_preprocess::{ChatMessage, Preprocessor};
use kvroute_router::{RouterConfig, WorkerSpec};
use kvroute_stack::{FrontDoorOptions, SharedStore, Simulated, Stack, StackConfig};
use serde_json::{Value, json};

use crate::workload::{BenchRequest, Prompt, Start, Workload, extended_blocks, token_blocks};

mod observe;
mod types;

use observe::{read_stats, router_figures, settled_stats, spawn_sampler};
pub use types::*;

/// A request that has not finished after this long is recorded as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// What every request of a run shares.
#[derive(Clone, Debug)]
struct Driver {
    client: HttpClient,
    /// The front doors, requests sprayed across them round-robin.
    bases: Vec<String>,
    model: Option<String>,
    preprocessor: Arc<Preprocessor>,
    block_size: BlockSize,
    t0: tokio::time::Instant,
    api: TargetApi,
}

/// Plays `workload` against `target` on a runtime of its own; `preprocessor` is the engines'
/// (conversation turns are tokenized with it when sent).
pub fn run(
    workload: &Workload,
    target: &Target,
    fleet: &FleetConfig,
    label: &str,
    progress: &ProgressBar,
    preprocessor: &Arc<Preprocessor>,
) -> anyhow::Result<RunData> {
    let bs = fleet.block_size()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting a runtime")?;
    let result = runtime.block_on(async {
        match target {
            Target::Fleet { policy, events, replicas, dialect, pd_baseline, store, gateway } => {
                let adapters = workload.adapters.clone();
                let fleet = FleetConfig {
                    dialect: *dialect,
                    adapters,
                    pd_baseline: *pd_baseline,
                    store_blocks: if *store { fleet.store_blocks } else { 0 },
                    ..fleet.clone()
                };
                let (urls, stats) = match gateway {
                    true => start_gateway(&fleet, *policy, *events).await?,
                    false => start_fleet(&fleet, *policy, *events, replicas.as_ref()).await?,
                };
                let driver = Driver::new(urls, None, preprocessor, bs, &stats);
                drive(workload, &driver, &stats_urls(&stats), label, progress).await
            }
            Target::Remote { urls, worker_stats, model, api } => {
                let model = match model {
                    Some(m) => Some(m.clone()),
                    None => {
                        let models = urls.iter().map(|u| first_model(u));
                        futures_util::future::join_all(models).await.into_iter().flatten().next()
                    }
                };
                let driver = Driver {
                    api: *api,
                    ..Driver::new(urls.clone(), model, preprocessor, bs, worker_stats)
                };
                drive(workload, &driver, &stats_urls(worker_stats), label, progress).await
            }
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

/// Starts `fleet.workers` simulated workers (publishing KV events or not), a router with
/// `policy` and a front door (or `replicas` of them), through the stack builder of `kvroute
/// serve`; returns the front doors' URLs and the workers once every worker is ready.
pub async fn start_fleet(
    fleet: &FleetConfig,
    policy: PolicyKind,
    events: bool,
    replicas: Option<&Replicas>,
) -> anyhow::Result<(Vec<String>, Vec<WorkerSpec>)> {
    // Engines the bench did not start publish their events whatever the run; an approximate
    // run does not subscribe to them.
    let external = fleet.external.iter().cloned().map(|mut e| {
        if !events {
            (e.events, e.replay) = (None, None);
        }
        e
    });
    let mut router = fleet.router_config(policy, external.collect())?;
    reset_engines(&fleet.external).await;
    if let Some(r) = replicas {
        anyhow::ensure!(r.nats_url.is_some() || !r.sync, "replica sync needs a NATS URL");
    }
    // Subjects of this run's own: nothing of one run's decisions reaches the next.
    let prefix = format!("bench{}", fleet_nonce());
    let nats_for = |k: usize| {
        let r = replicas.filter(|r| r.sync)?;
        let mut n = kvroute_router::nats::NatsConfig::new(r.nats_url.clone()?);
        n.replica = format!("bench-{k}");
        n.prefix.clone_from(&prefix);
        Some(n)
    };
    router.nats = nats_for(0);
    let config =
        StackConfig { simulated: fleet_simulated(fleet, events)?, ..front_door(router, fleet) };
    let stack = started(config, "the fleet").await?;
    // Engines the bench did not start serve no simulated engine's /stats: the hit rate is
    // read from the answers' usage (their own cached_tokens).
    let urls: Vec<WorkerSpec> = match fleet.external.is_empty() {
        true => stack.workers.iter().filter(|w| w.url.is_some()).cloned().collect(),
        false => Vec::new(),
    };
    let mut fronts = vec![stack.serve_frontend_on_loopback().await?];
    let mut stacks = vec![stack];
    for k in 1..replicas.map_or(1, |r| r.n) {
        // Another front door and router over the same workers (external to it).
        let mut router = fleet.router_config(policy, stacks[0].workers.clone())?;
        router.nats = nats_for(k);
        let replica = started(front_door(router, fleet), &format!("replica {k}")).await?;
        fronts.push(replica.serve_frontend_on_loopback().await?);
        stacks.push(replica);
    }
    // The stacks (the routers' tasks) live as long as the runtime of the run.
    tokio::spawn(async move {
        let _stacks = stacks;
        std::future::pending::<()>().await;
    });
    Ok((fronts, urls))
}

/// The simulated workers of `fleet` (publishing KV events or not).
fn fleet_simulated(fleet: &FleetConfig, events: bool) -> anyhow::Result<Simulated> {
    // A hybrid model's window, from its config.json (docs/mocker.md, "Hybrid models").
    let sliding_window = match &fleet.model_path {
        Some(dir) => kvroute_mocker::window::from_model_dir(dir)?,
        None => None,
    };
    anyhow::ensure!(
        sliding_window.is_none()
            || (fleet.host.num_blocks == 0 && fleet.disagg.is_none() && fleet.store_blocks == 0),
        "a hybrid model's simulated engines run without host memory, a shared store, and prefill and decode workers"
    );
    Ok(Simulated {
        count: if fleet.disagg.is_some() || !fleet.external.is_empty() { 0 } else { fleet.workers },
        prefill: fleet.disagg.map_or(0, |(p, _)| p),
        decode: fleet.disagg.map_or(0, |(_, d)| d),
        nodes: fleet.nodes,
        engine: EngineConfig {
            num_blocks: fleet.num_blocks,
            max_num_seqs: fleet.max_num_seqs,
            max_batched_tokens: fleet.max_batched_tokens,
            timing: Timing { speedup: fleet.speedup },
            lora: kvroute_mocker::lora::LoraConfig {
                max_loras: fleet.max_loras,
                max_cpu_loras: fleet.max_loras,
                ..kvroute_mocker::lora::LoraConfig::default()
            },
            host: fleet.host,
            disagg: kvroute_mocker::DisaggConfig {
                kv_transfer_bandwidth_gbps: fleet.kv_transfer_bandwidth,
                kv_transfer_bandwidth_across_nodes_gbps: fleet.kv_transfer_bandwidth_across_nodes,
                ..kvroute_mocker::DisaggConfig::default()
            },
            sliding_window,
            scheduling: match fleet.engine_priority {
                true => kvroute_mocker::SchedulingPolicy::Priority,
                false => kvroute_mocker::SchedulingPolicy::Fcfs,
            },
            ..EngineConfig::default()
        },
        lora_modules: fleet.adapters.iter().map(|a| (a.clone(), None)).collect(),
        events,
        seed: 0,
        max_model_len: None,
        dialect: fleet.dialect,
        chat_template: match &fleet.engine_chat_template {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?,
            ),
            None => None,
        },
        store: (fleet.store_blocks > 0).then_some(SharedStore::Start(fleet.store_blocks)),
        ..Simulated::default()
    })
}

/// Empties the prefix caches of engines the bench did not start, so that each run starts
/// cold as a simulated fleet does (vLLM's `/reset_prefix_cache`; an engine without it keeps
/// what earlier runs left, and is said to).
async fn reset_engines(engines: &[WorkerSpec]) {
    let client = HttpClient::new();
    for e in engines {
        let Some(url) = &e.url else { continue };
        let reset = format!("{url}/reset_prefix_cache");
        match client.post_json::<Value>(&reset, &json!({})).await {
            Ok(_) | Err(kvroute_http::ClientError::Json(_)) => {}
            Err(err) => tracing::warn!(
                worker = %e.id,
                %err,
                "could not empty the engine's prefix cache (serve vLLM with VLLM_SERVER_DEV_MODE=1): this run starts with what earlier runs left"
            ),
        }
    }
}

/// [`start_fleet`]'s fleet behind the test gateway, the gateway's URL in place of the front
/// door's: kvroute as its Endpoint Picker over ext_proc, or for round-robin the gateway
/// alone, taking the endpoints in turn. The engines answer without a token, as they do
/// behind a gateway.
pub async fn start_gateway(
    fleet: &FleetConfig,
    policy: PolicyKind,
    events: bool,
) -> anyhow::Result<(Vec<String>, Vec<WorkerSpec>)> {
    use kvroute_test_gateway::{Gateway, GatewayConfig, Picking};
    let mut router = fleet.router_config(policy, Vec::new())?;
    router.nats = None;
    let config = StackConfig {
        simulated: Simulated { tokenless: true, ..fleet_simulated(fleet, events)? },
        ..front_door(router, fleet)
    };
    let stack = started(config, "the fleet").await?;
    let workers: Vec<WorkerSpec> =
        stack.workers.iter().filter(|w| w.url.is_some()).cloned().collect();
    let config = match policy {
        PolicyKind::RoundRobin => {
            let endpoints =
                workers.iter().filter_map(|w| kvroute_epp::host_port(w.url.as_deref()?));
            GatewayConfig {
                picking: Picking::RoundRobin(endpoints.collect()),
                ..GatewayConfig::ext_proc("")
            }
        }
        _ => {
            let picker =
                stack.picker(kvroute_epp::EppOptions::default(), None).context("a picker")?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("http://{}", listener.local_addr()?);
            tokio::spawn(kvroute_epp::serve(listener, picker, async {}, std::future::pending()));
            GatewayConfig::ext_proc(url)
        }
    };
    let gateway = Gateway::new(config)?;
    let url = kvroute_stack::serve_on_loopback(gateway.app()).await?;
    tokio::spawn(async move {
        let _stack = stack;
        std::future::pending::<()>().await;
    });
    Ok((vec![url], workers))
}

/// A front door and router over `router`'s workers, as the bench runs them.
fn front_door(router: RouterConfig, fleet: &FleetConfig) -> StackConfig {
    StackConfig {
        router,
        model_path: fleet.model_path.clone(),
        // The predictions are part of the report.
        front_door: FrontDoorOptions {
            expose_overlap: true,
            engine_priority: fleet.engine_priority,
            ..FrontDoorOptions::default()
        },
        ..StackConfig::default()
    }
}

/// Starts a stack, ready when every subscription is up and every worker has reported its load
/// (its capacity is part of the kv policy's cost).
/// How long a fleet has to be ready: room for parity probes that fail (an engine rendering
/// with a template of its own): a failing probe waits out its 5 s, after any retries while a
/// worker's subscription catches up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

async fn started(config: StackConfig, what: &str) -> anyhow::Result<Stack> {
    let stack = Stack::start(config).await?;
    let waiting = stack.ready(READY_TIMEOUT).await;
    let secs = READY_TIMEOUT.as_secs();
    anyhow::ensure!(waiting.is_empty(), "{what}: workers not ready in {secs} s: {waiting:?}");
    Ok(stack)
}

/// A number that differs between runs (names each run's NATS subjects).
fn fleet_nonce() -> u32 {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, Ordering::Relaxed) as u32;
    std::process::id().wrapping_mul(1000).wrapping_add(run)
}

async fn first_model(base: &str) -> Option<String> {
    let list: ModelList =
        HttpClient::new().get_json(&format!("{base}{}", paths::MODELS)).await.ok()?;
    list.data.into_iter().next().map(|m| m.id)
}

fn stats_urls(workers: &[WorkerSpec]) -> Vec<String> {
    workers.iter().filter_map(|w| w.url.clone()).collect()
}

/// Requests that run one after another: a head starting at a time, then followers.
fn chains(requests: &[BenchRequest]) -> Vec<Vec<usize>> {
    let mut chains: Vec<Vec<usize>> = Vec::new();
    let mut chain_of = vec![usize::MAX; requests.len()];
    for (i, r) in requests.iter().enumerate() {
        match r.start {
            Start::After { prev, .. } if prev < i && chain_of[prev] != usize::MAX => {
                chain_of[i] = chain_of[prev];
                chains[chain_of[prev]].push(i);
            }
            _ => {
                chain_of[i] = chains.len();
                chains.push(vec![i]);
            }
        }
    }
    chains
}

impl Driver {
    fn new(
        bases: Vec<String>,
        model: Option<String>,
        pre: &Arc<Preprocessor>,
        bs: BlockSize,
        workers: &[WorkerSpec],
    ) -> Self {
        Self {
            client: kvroute_router::workers_client(workers),
            bases,
            model,
            preprocessor: Arc::clone(pre),
            block_size: bs,
            t0: tokio::time::Instant::now() + Duration::from_millis(50),
            api: TargetApi::Openai,
        }
    }
}

/// Plays `workload` against `urls` on the current runtime (a fleet the caller started and
/// changes while it runs), the workers' counters read from `workers`; the run's start, as
/// the workload's times count from it.
pub(crate) async fn drive_on(
    workload: &Workload,
    urls: Vec<String>,
    workers: &[WorkerSpec],
    preprocessor: &Arc<Preprocessor>,
    bs: BlockSize,
    started: tokio::sync::oneshot::Sender<tokio::time::Instant>,
) -> anyhow::Result<RunData> {
    let driver = Driver::new(urls, None, preprocessor, bs, workers);
    let _ = started.send(driver.t0);
    drive(workload, &driver, &stats_urls(workers), "churn", &ProgressBar::hidden()).await
}

async fn drive(
    workload: &Workload,
    driver: &Driver,
    stats_urls: &[String],
    label: &str,
    progress: &ProgressBar,
) -> anyhow::Result<RunData> {
    let client = driver.client.clone();
    let stats_start = read_stats(&client, stats_urls).await;
    let n = workload.requests.len();
    progress.set_length(n as u64);
    progress.set_position(0);
    progress.set_message(format!("{} / {label}", workload.kind));
    let records: Arc<Mutex<Vec<RequestRecord>>> = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let sent = Arc::new(AtomicUsize::new(0));
    let t0 = driver.t0;
    let handles = spawn_chains(workload, driver, &records, &sent, progress);
    // Sample the workers while the requests run.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sampler = spawn_sampler(client.clone(), stats_urls.to_vec(), t0, stop_rx);
    for h in handles {
        h.await.context("a request task failed")?;
    }
    let wall_secs = tokio::time::Instant::now().saturating_duration_since(t0).as_secs_f64();
    let _ = stop_tx.send(true);
    let mut samples = sampler.await.unwrap_or_default();
    let mut records = std::mem::take(&mut *records.lock().unwrap_or_else(PoisonError::into_inner));
    records.sort_by_key(|r| r.index);
    let answered = records.iter().filter(|r| r.error.is_none()).count() as u64;
    let stats_end = settled_stats(&client, stats_urls, &stats_start, answered).await;
    samples.push(Sample { t: wall_secs, workers: stats_end.clone() });
    let (drifts, ttft_error, flow) = router_figures(&client, &driver.bases).await;
    Ok(RunData {
        label: label.to_owned(),
        records,
        samples,
        stats_start,
        stats_end,
        wall_secs,
        drifts,
        ttft_error,
        flow,
    })
}

/// Each chain of the workload (one user's conversation, or one request) as a task of its own,
/// its records pushed as they end.
fn spawn_chains(
    workload: &Workload,
    driver: &Driver,
    records: &Arc<Mutex<Vec<RequestRecord>>>,
    sent: &Arc<AtomicUsize>,
    progress: &ProgressBar,
) -> Vec<tokio::task::JoinHandle<()>> {
    let t0 = driver.t0;
    let requests = Arc::new(workload.requests.clone());
    let mut handles = Vec::new();
    for chain in chains(&workload.requests) {
        let (records, sent, requests) =
            (Arc::clone(records), Arc::clone(sent), Arc::clone(&requests));
        let (driver, progress) = (driver.clone(), progress.clone());
        handles.push(tokio::spawn(async move {
            // A chain is one user's conversation when its requests are turns.
            let mut conversation: Vec<Value> = Vec::new();
            for i in chain {
                let request = &requests[i];
                match request.start {
                    Start::At(at) => {
                        tokio::time::sleep_until(t0 + Duration::from_secs_f64(at)).await;
                    }
                    Start::After { think, .. } => {
                        tokio::time::sleep(Duration::from_secs_f64(think)).await;
                    }
                }
                let order = sent.fetch_add(1, Ordering::Relaxed);
                let mut record = send(&driver, request, &mut conversation, order).await;
                record.index = i;
                record.sent_order = order;
                record.warmup = request.warmup;
                records.lock().unwrap_or_else(PoisonError::into_inner).push(record);
                progress.inc(1);
            }
        }));
    }
    handles
}

/// The path and body of a request; a conversation turn appends its messages to
/// `conversation` (the answer follows once it is known).
fn request_body(
    request: &BenchRequest,
    model: Option<&str>,
    conversation: &mut Vec<Value>,
    api: TargetApi,
) -> (&'static str, Value) {
    if api == TargetApi::SglangGenerate {
        return sglang_body(request);
    }
    let (path, mut body) = match &request.prompt {
        Prompt::Tokens(tokens) => (paths::COMPLETIONS, json!({"prompt": tokens})),
        Prompt::Text(text) => (paths::COMPLETIONS, json!({"prompt": text})),
        Prompt::Chat(messages) => (paths::CHAT_COMPLETIONS, json!({"messages": messages.as_ref()})),
        Prompt::Turn { context, text } => {
            if let Some(context) = context {
                conversation.push(json!({"role": "system", "content": context.as_ref()}));
            }
            conversation.push(json!({"role": "user", "content": text}));
            (paths::CHAT_COMPLETIONS, json!({"messages": conversation}))
        }
    };
    body["max_tokens"] = json!(request.max_tokens);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["ignore_eos"] = json!(true);
    if let Some(model) = request.adapter.as_deref().or(model) {
        body["model"] = json!(model);
    }
    if let Some(session) = &request.session {
        body["prompt_cache_key"] = json!(session.as_ref());
    }
    (path, body)
}

/// SGLang's `/generate` body: the prompt's token ids or text, streamed (a chat has no such
/// body: `--target-api` refuses workloads of chats).
fn sglang_body(request: &BenchRequest) -> (&'static str, Value) {
    let mut body = match &request.prompt {
        Prompt::Text(text) => json!({"text": text}),
        _ => json!({"input_ids": request.prompt_ids.as_ref()}),
    };
    body["stream"] = json!(true);
    body["sampling_params"] = json!({"max_new_tokens": request.max_tokens, "ignore_eos": true});
    (kvroute_http::sglang_generate::PATH, body)
}

/// The prompt's token ids and full blocks: precomputed, or (a conversation turn) derived from
/// the messages with the engines' preprocessor.
fn prompt_of(driver: &Driver, request: &BenchRequest, body: &Value) -> (Arc<Vec<u32>>, Vec<u64>) {
    if !matches!(request.prompt, Prompt::Turn { .. }) {
        return (Arc::clone(&request.prompt_ids), request.blocks.clone());
    }
    let messages: Vec<ChatMessage> =
        serde_json::from_value(body["messages"].clone()).unwrap_or_default();
    let tokens = driver
        .preprocessor
        .prepare_chat(&messages, true, Vec::new())
        .map(|p| p.tokens)
        .unwrap_or_default();
    let blocks = token_blocks(&tokens, driver.block_size, request.adapter.as_deref());
    (Arc::new(tokens), blocks)
}

async fn send(
    driver: &Driver,
    request: &BenchRequest,
    conversation: &mut Vec<Value>,
    order: usize,
) -> RequestRecord {
    let start = tokio::time::Instant::now();
    let (path, body) = request_body(request, driver.model.as_deref(), conversation, driver.api);
    let (prompt_ids, prompt_blocks) = prompt_of(driver, request, &body);
    let mut record = RequestRecord {
        sent_at: micros(start.saturating_duration_since(driver.t0)) / 1e6,
        prompt_len: prompt_ids.len(),
        adapter: request.adapter.as_deref().map(str::to_owned),
        class: request.class.as_ref().map(|c| c.class.to_owned()),
        tenant: request.class.as_ref().map(|c| c.tenant.to_string()),
        ..RequestRecord::default()
    };
    // Round-robin over the front doors; one that refuses the connection is skipped, as a
    // load balancer skips a backend that is down.
    let n = driver.bases.len().max(1);
    let mut outcome = Ok(Err(anyhow::anyhow!("no front door")));
    for k in 0..n {
        let url = format!("{}{path}", driver.bases[(order + k) % n]);
        outcome = tokio::time::timeout(
            REQUEST_TIMEOUT,
            stream_one(
                &driver.client,
                &url,
                &body,
                request.class.as_deref(),
                start,
                &mut record,
                driver.api,
            ),
        )
        .await;
        let refused = matches!(&outcome, Ok(Err(e)) if refused(e));
        if !refused {
            break;
        }
    }
    match outcome {
        Ok(Ok(())) => record.e2e_ms = Some(micros(start.elapsed()) / 1e3),
        Ok(Err(e)) => record.error = Some(format!("{e:#}")),
        Err(_) => record.error = Some(format!("no answer in {} s", REQUEST_TIMEOUT.as_secs())),
    }
    // What the request left computed: its prompt and, but for the last, its answer's tokens
    // (the answer's text tokenizes back to the engine's token ids).
    record.computed_blocks = match record.error {
        Some(_) => prompt_blocks.clone(),
        None => {
            let answer = driver.preprocessor.encode(&record.answer).unwrap_or_default();
            let kept = answer.len().min(record.output_tokens).saturating_sub(1);
            let (bs, lora) = (driver.block_size, request.adapter.as_deref());
            extended_blocks(&prompt_blocks, &prompt_ids, &answer[..kept], bs, lora)
        }
    };
    record.prompt_blocks = prompt_blocks;
    if matches!(request.prompt, Prompt::Turn { .. }) && record.error.is_none() {
        conversation.push(json!({"role": "assistant", "content": record.answer}));
    }
    record
}

/// Whole microseconds (what a loopback clock can tell apart; keeps results.json short).
fn micros(d: Duration) -> f64 {
    d.as_micros() as f64
}

fn header(response: &hyper::Response<hyper::body::Incoming>, name: &str) -> Option<String> {
    response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

/// Whether the connection was refused (nothing was sent).
fn refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<kvroute_http::ClientError>(),
            Some(kvroute_http::ClientError::Connect(_))
        )
    })
}

/// `host,disk,external` tokens, as the front door writes them.
fn tier_tokens(v: &str) -> Option<[u64; 3]> {
    let mut parts = v.split(',').map(|p| p.trim().parse::<u64>().ok());
    let tiers = [parts.next()??, parts.next()??, parts.next()??];
    parts.next().is_none().then_some(tiers)
}

async fn stream_one(
    client: &HttpClient,
    url: &str,
    body: &Value,
    class: Option<&crate::workload::RequestTag>,
    start: tokio::time::Instant,
    record: &mut RequestRecord,
    api: TargetApi,
) -> anyhow::Result<()> {
    let mut request = hyper::Request::post(url).header("content-type", "application/json");
    if let Some(c) = class {
        request = request
            .header(kvroute_frontend::PRIORITY_HEADER, c.priority.to_string())
            .header(kvroute_frontend::TENANT_HEADER, c.tenant.as_ref());
        if let Some(ms) = c.slo_ms {
            request = request.header(kvroute_frontend::SLO_HEADER, ms.to_string());
        }
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(serde_json::to_vec(body)?)))
        .context("a request")?;
    let response = client.send(request).await.context("sending")?;
    record.worker = header(&response, kvroute_frontend::WORKER_HEADER);
    record.prefill_worker = header(&response, kvroute_frontend::PREFILL_WORKER_HEADER);
    record.predicted_tokens =
        header(&response, kvroute_frontend::OVERLAP_HEADER).and_then(|v| v.parse().ok());
    record.predicted_tier_tokens =
        header(&response, kvroute_frontend::OVERLAP_TIER_HEADER).and_then(|v| tier_tokens(&v));
    let status = response.status();
    let response_retry_after = header(&response, "retry-after").and_then(|v| v.parse().ok());
    let mut body = response.into_body();
    if !status.is_success() {
        record.status = Some(status.as_u16());
        record.retry_after = response_retry_after;
        let bytes = kvroute_http::client::read_body(body, 1 << 20).await.unwrap_or_default();
        let message = kvroute_http::client::error_message(&bytes);
        anyhow::bail!("HTTP {}: {message}", status.as_u16());
    }
    let mut sse = SseReader::default();
    let mut last_token: Option<tokio::time::Instant> = None;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.context("reading the stream")?;
        let Some(data) = frame.data_ref() else { continue };
        for event in sse.push(data) {
            let chunk = match event {
                SseEvent::Done => {
                    done = true;
                    continue;
                }
                SseEvent::Data(text) => text,
            };
            if let Ok(error) = serde_json::from_str::<kvroute_http::error::ErrorBody>(&chunk) {
                anyhow::bail!("error in the stream: {}", error.error.message);
            }
            if api == TargetApi::SglangGenerate {
                sglang_chunk(&chunk, start, &mut last_token, record)?;
                continue;
            }
            let chunk: Completion = serde_json::from_str(&chunk)
                .with_context(|| format!("an undecodable chunk: {chunk:.80}"))?;
            for text in chunk.choices.iter().filter_map(|c| c.new_text()) {
                record.answer.push_str(text);
            }
            if chunk.has_text() {
                let now = tokio::time::Instant::now();
                match last_token {
                    None => record.ttft_ms = Some(micros(now - start) / 1e3),
                    Some(prev) => record.itl_ms.push(micros(now - prev) / 1e3),
                }
                last_token = Some(now);
                record.output_tokens += 1;
            }
            if let Some(usage) = chunk.usage {
                record.prompt_tokens = Some(usage.prompt_tokens);
                record.cached_tokens = Some(usage.cached_tokens());
                record.output_tokens = usage.completion_tokens as usize;
            }
        }
    }
    anyhow::ensure!(done, "the stream ended without [DONE]");
    anyhow::ensure!(record.ttft_ms.is_some(), "no token was streamed");
    Ok(())
}

/// One chunk of SGLang's stream, which carries the whole answer so far: its new tokens
/// timed, its text and (on the last) its counts recorded.
fn sglang_chunk(
    chunk: &str,
    start: tokio::time::Instant,
    last_token: &mut Option<tokio::time::Instant>,
    record: &mut RequestRecord,
) -> anyhow::Result<()> {
    let chunk: kvroute_http::sglang_generate::GenerateResponse = serde_json::from_str(chunk)
        .with_context(|| format!("an undecodable chunk: {chunk:.80}"))?;
    let now = tokio::time::Instant::now();
    for _ in record.output_tokens..chunk.output_ids.len() {
        match last_token {
            None => record.ttft_ms = Some(micros(now - start) / 1e3),
            Some(prev) => record.itl_ms.push(micros(now - *prev) / 1e3),
        }
        *last_token = Some(now);
    }
    record.output_tokens = record.output_tokens.max(chunk.output_ids.len());
    if let Some(text) = chunk.text {
        record.answer = text;
    }
    let meta = chunk.meta_info;
    if meta.finish_reason.is_some() {
        record.prompt_tokens = Some(meta.prompt_tokens);
        record.cached_tokens = Some(meta.cached_tokens);
        record.output_tokens = meta.completion_tokens as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_follow_previous_requests() {
        let mk = |start| BenchRequest {
            adapter: None,
            session: None,
            class: None,
            start,
            prompt: Prompt::Tokens(vec![1]),
            max_tokens: 1,
            prompt_ids: Arc::new(vec![1]),
            blocks: vec![],
            group: 0,
            warmup: false,
        };
        let reqs = vec![
            mk(Start::At(0.0)),
            mk(Start::At(1.0)),
            mk(Start::After { prev: 0, think: 0.1 }),
            mk(Start::After { prev: 2, think: 0.1 }),
            mk(Start::After { prev: 1, think: 0.1 }),
        ];
        assert_eq!(chains(&reqs), vec![vec![0, 2, 3], vec![1, 4]]);
    }
}

//! Workers' load, two ways (a worker's `metrics` key):
//!
//! - `tcp://...`: a ZMQ stream of JSON load reports (docs/mocker.md, as the simulated engine
//!   publishes them): `{"num_waiting_reqs", "kv_cache_usage", "num_running_reqs",
//!   "kv_total_blocks", "dp_rank"}`, unknown keys ignored;
//! - `http://.../metrics`: the engine's Prometheus endpoint, polled every
//!   [`POLL_EVERY`] for the gauges vLLM serves (`vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` or the older
//!   `vllm:gpu_cache_usage_perc`, and `num_gpu_blocks` of `vllm:cache_config_info`) or SGLang's
//!   (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`). vLLM's
//!   `engine` label names the data-parallel rank.
//!
//! Both carry the worker's adapters when it serves some: vLLM's `vllm:lora_requests_info`
//! (its labels `max_lora` and `running_lora_adapters`, comma-joined; of the label sets vLLM
//! keeps, the one with the newest time), and the same keys in a load report (with
//! `resident_lora_adapters`, the simulated engine's slots).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::schedule::WorkerLoad;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::HttpClient;
use kvroute_wire::transport::SocketRole;
use serde::Deserialize;
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::error::RouterError;
use crate::state::RouterState;
use crate::subscriber::MAX_BACKOFF;

/// How often a Prometheus endpoint is read.
pub const POLL_EVERY: Duration = Duration::from_millis(500);

/// The load report (docs/mocker.md).
#[derive(Debug, Deserialize)]
struct LoadReport {
    #[serde(flatten)]
    load: WorkerLoad,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default)]
    max_lora: Option<usize>,
    #[serde(default)]
    running_lora_adapters: Option<String>,
    #[serde(default)]
    resident_lora_adapters: Option<String>,
}

/// A worker's adapters as it reports them: its slots and the adapters in them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterReport {
    pub max_loras: Option<usize>,
    pub in_slots: Vec<String>,
}

impl AdapterReport {
    /// From comma-joined names (names past the adapter name limit are not taken).
    /// Hands the report to the scheduler's adapter table.
    pub fn report(&self, state: &crate::RouterState, worker: WorkerWithDpRank) {
        let names: Vec<&str> = self.in_slots.iter().map(String::as_str).collect();
        state.scheduling.report_adapters(worker, self.max_loras, &names);
    }

    fn new(max_loras: Option<usize>, names: &str) -> Self {
        let max = kvroute_http::models::MAX_ADAPTER_NAME;
        let in_slots = names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty() && n.len() <= max)
            .take(64)
            .map(str::to_owned)
            .collect();
        Self { max_loras, in_slots }
    }
}

/// One JSON load report: its rank, its load and its adapters; `None` for what is no report.
pub fn decode_report(payload: &[u8]) -> Option<(u32, WorkerLoad, Option<AdapterReport>)> {
    let r: LoadReport = serde_json::from_slice(payload).ok()?;
    Some((r.dp_rank, r.load, r.adapters()))
}

impl LoadReport {
    fn adapters(&self) -> Option<AdapterReport> {
        let names = self.resident_lora_adapters.as_ref().or(self.running_lora_adapters.as_ref());
        (self.max_lora.is_some() || names.is_some())
            .then(|| AdapterReport::new(self.max_lora, names.map_or("", String::as_str)))
    }
}

/// Follows a worker's load source forever, reconnecting with capped backoff.
pub(crate) async fn run(state: Arc<RouterState>, worker: WorkerId, source: String) {
    if source.starts_with("http://") {
        poll(state, worker, source).await;
    } else {
        subscribe(state, worker, source).await;
    }
}

async fn subscribe(state: Arc<RouterState>, worker: WorkerId, endpoint: String) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let result: Result<(), RouterError> = async {
            let mut socket = SubSocket::with_options(state.zmq.options(SocketRole::Load));
            socket.connect(&endpoint).await?;
            socket.subscribe("").await?;
            backoff = Duration::from_millis(50);
            loop {
                let message = socket.recv().await?;
                let Some(payload) = message.into_vec().pop() else { continue };
                match decode_report(&payload) {
                    Some((r, load, adapters))
                        if state.fleet.check_rank(WorkerWithDpRank::new(worker, r)).is_ok() =>
                    {
                        let rank = WorkerWithDpRank::new(worker, r);
                        if let Some(adapters) = adapters {
                            adapters.report(&state, rank);
                        }
                        state.update_load(rank, load);
                    }
                    _ => {
                        state.metrics.garbage.inc();
                    }
                }
            }
        }
        .await;
        if let Err(err) = result {
            tracing::debug!(%worker, %endpoint, %err, "load stream down");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

async fn poll(state: Arc<RouterState>, worker: WorkerId, url: String) {
    let client = HttpClient::new();
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let text = match tokio::time::timeout(POLL_EVERY * 4, client.get(&url)).await {
            Ok(Ok((status, body))) if status.is_success() => body,
            outcome => {
                if !failing {
                    tracing::warn!(%worker, %url, ?outcome, "cannot read the worker's metrics");
                    failing = true;
                }
                continue;
            }
        };
        failing = false;
        let text = String::from_utf8_lossy(&text);
        let adapters = parse_lora_info(&text);
        for (rank, load) in parse_prometheus(&text) {
            if state.fleet.check_rank(WorkerWithDpRank::new(worker, rank)).is_ok() {
                if let Some(a) = &adapters {
                    a.report(&state, WorkerWithDpRank::new(worker, rank));
                }
                state.update_load(WorkerWithDpRank::new(worker, rank), load);
            }
        }
    }
}

/// The engines run different KV block sizes, each worker's named, and none was given.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the engines run different KV block sizes ({}): give --block-size, and a worker's own block_size where it differs",
    each(.0)
)]
pub struct BlockSizesDiffer(pub Vec<(WorkerId, u32)>);

fn each(sizes: &[(WorkerId, u32)]) -> String {
    let each: Vec<String> = sizes.iter().map(|(id, size)| format!("{id}: {size}")).collect();
    each.join(", ")
}

/// The block size the workers' engines run with, as their metrics report it (vLLM's
/// `cache_config_info`), each worker's metrics URL read until it answers or `timeout` ends:
/// `Ok(None)` when none reports one, an error naming them when they disagree. A worker with
/// its own `block_size` is left out.
pub async fn engines_block_size(
    workers: &[crate::config::WorkerSpec],
    timeout: Duration,
) -> Result<Option<u32>, BlockSizesDiffer> {
    let client = HttpClient::new();
    let urls: Vec<(WorkerId, &str)> = workers
        .iter()
        .filter(|w| w.block_size.is_none())
        .filter_map(|w| Some((w.id, w.metrics.as_deref().filter(|m| m.starts_with("http://"))?)))
        .collect();
    let read = |id: WorkerId, url: &str| {
        let client = &client;
        let url = url.to_owned();
        async move {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if let Ok(Ok((status, body))) = tokio::time::timeout(left, client.get(&url)).await
                    && status.is_success()
                {
                    let text = String::from_utf8_lossy(&body);
                    return (id, parse_prometheus(&text).values().find_map(|l| l.block_size));
                }
                if tokio::time::Instant::now() + POLL_EVERY >= deadline {
                    return (id, None);
                }
                tokio::time::sleep(POLL_EVERY).await;
            }
        }
    };
    let sizes: Vec<(WorkerId, Option<u32>)> =
        futures_util::future::join_all(urls.iter().map(|&(id, url)| read(id, url))).await;
    let known: Vec<(WorkerId, u32)> =
        sizes.into_iter().filter_map(|(id, size)| Some((id, size?))).collect();
    let Some(&(_, first)) = known.first() else { return Ok(None) };
    if known.iter().all(|&(_, size)| size == first) {
        return Ok(Some(first));
    }
    Err(BlockSizesDiffer(known))
}

/// The load gauges of a Prometheus exposition, per data-parallel rank (vLLM's `engine`
/// label; rank 0 without it). Ranks with none of the gauges are absent.
pub fn parse_prometheus(text: &str) -> BTreeMap<u32, WorkerLoad> {
    let mut out: BTreeMap<u32, WorkerLoad> = BTreeMap::new();
    for line in text.lines() {
        let Some((name, labels, value)) = parse_sample(line) else { continue };
        let rank = labels
            .iter()
            .find(|(k, _)| *k == "engine")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut entry = |f: &dyn Fn(&mut WorkerLoad)| f(out.entry(rank).or_default());
        let count = (value.is_finite() && value >= 0.0).then_some(value as u64);
        match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                entry(&|l| l.num_running_reqs = count);
            }
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                entry(&|l| l.num_waiting_reqs = count);
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                entry(&|l| l.kv_cache_usage = value.is_finite().then_some(value));
            }
            "vllm:cache_config_info" => {
                let label =
                    |key: &str| labels.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str());
                let blocks = label("num_gpu_blocks").and_then(|v| v.parse().ok());
                if blocks.is_some() {
                    entry(&|l| l.kv_total_blocks = blocks);
                }
                let size = label("block_size").and_then(|v| v.parse().ok());
                if size.is_some() {
                    entry(&|l| l.block_size = size);
                }
            }
            _ => {}
        }
    }
    out
}

/// vLLM's `vllm:lora_requests_info`: of its label sets, the one whose value (the time it was
/// set) is newest. `None` when the exposition has none (LoRA off).
pub fn parse_lora_info(text: &str) -> Option<AdapterReport> {
    let mut newest: Option<(f64, AdapterReport)> = None;
    for line in text.lines().filter(|l| l.starts_with("vllm:lora_requests_info")) {
        let Some((_, labels, value)) = parse_sample(line) else { continue };
        if newest.as_ref().is_some_and(|(t, _)| *t >= value) {
            continue;
        }
        let label = |k: &str| labels.iter().find(|(name, _)| *name == k).map(|(_, v)| v.as_str());
        let max_loras = label("max_lora").and_then(|v| v.parse().ok());
        newest = Some((value, AdapterReport::new(max_loras, label("running_lora_adapters")?)));
    }
    newest.map(|(_, report)| report)
}

/// A sample's labels, as (name, value).
type Labels<'a> = Vec<(&'a str, String)>;

/// `name{k="v",...} value [timestamp]` -> (name, labels, value); comments and junk: `None`.
fn parse_sample(line: &str) -> Option<(&str, Labels<'_>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t'])?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut s = body;
        loop {
            s = s.trim_start_matches([',', ' ']);
            if let Some(after) = s.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = s.find('=')?;
            let key = s[..eq].trim();
            s = s[eq + 1..].strip_prefix('"')?;
            let mut value = String::new();
            let mut chars = s.char_indices();
            let end = loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (i, '"') => break i,
                    (_, c) => value.push(c),
                }
            };
            labels.push((key, value));
            s = &s[end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// What vLLM 0.11 serves (trimmed), two data-parallel engines.
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2-VL-2B-Instruct"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2-VL-2B-Instruct"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen2-VL-2B-Instruct"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 1234.0
"#;

    #[test]
    fn vllm_gauges_per_engine() {
        let loads = parse_prometheus(VLLM);
        assert_eq!(loads.len(), 2);
        let l0 = loads[&0];
        assert_eq!(
            (l0.num_running_reqs, l0.num_waiting_reqs, l0.kv_cache_usage, l0.kv_total_blocks),
            (Some(3), Some(2), Some(0.25), Some(27_000))
        );
        let l1 = loads[&1];
        assert_eq!(
            (l1.num_running_reqs, l1.kv_cache_usage, l1.kv_total_blocks),
            (Some(1), Some(0.5), None)
        );
    }

    #[test]
    fn lora_info_takes_the_newest_label_set() {
        let text = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7000000005e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters="sql"} 1.7e+09
"#;
        let report = parse_lora_info(text).unwrap();
        assert_eq!(report.max_loras, Some(4));
        assert_eq!(report.in_slots, ["sql", "chat"]);
        assert_eq!(parse_lora_info(VLLM), None);
        let long = format!(
            "vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"{}\"}} 1",
            "x".repeat(300)
        );
        assert!(parse_lora_info(&long).unwrap().in_slots.is_empty(), "names past the limit");
    }

    #[test]
    fn older_and_sglang_names_and_junk() {
        let text = "vllm:gpu_cache_usage_perc 0.75\nsglang:num_queue_reqs{tp_rank=\"0\"} 4\nnot a sample\nx{a=\"unterminated 1\n";
        let l = parse_prometheus(text)[&0];
        assert_eq!((l.kv_cache_usage, l.num_waiting_reqs), (Some(0.75), Some(4)));
        assert_eq!(
            parse_sample("a{k=\"x\\\"y\",j=\"2\"} 5 1700000000"),
            Some(("a", vec![("k", "x\"y".to_owned()), ("j", "2".to_owned())], 5.0))
        );
        assert!(parse_sample("# TYPE a gauge").is_none());
        assert!(
            parse_prometheus("vllm:num_requests_running{engine=\"0\"} NaN")
                .get(&0)
                .is_some_and(|l| l.num_running_reqs.is_none())
        );
    }
}

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
                match serde_json::from_slice::<LoadReport>(&payload) {
                    Ok(r) if state.check_rank(WorkerWithDpRank::new(worker, r.dp_rank)).is_ok() => {
                        state.update_load(WorkerWithDpRank::new(worker, r.dp_rank), r.load);
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
        for (rank, load) in parse_prometheus(&String::from_utf8_lossy(&text)) {
            if state.check_rank(WorkerWithDpRank::new(worker, rank)).is_ok() {
                state.update_load(WorkerWithDpRank::new(worker, rank), load);
            }
        }
    }
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
                let blocks = labels
                    .iter()
                    .find(|(k, _)| *k == "num_gpu_blocks")
                    .and_then(|(_, v)| v.parse().ok());
                if blocks.is_some() {
                    entry(&|l| l.kv_total_blocks = blocks);
                }
            }
            _ => {}
        }
    }
    out
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

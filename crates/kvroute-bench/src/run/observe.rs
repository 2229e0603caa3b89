//! What a run reads of the fleet besides the answers: the workers' stats (sampled while it runs,
//! settled at its end) and what the routers say of it (drifts, prediction error, flow control).

use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_http::HttpClient;
use serde_json::Value;

use super::types::{Sample, WorkerStats};

pub(super) const SAMPLE_EVERY: Duration = Duration::from_millis(250);

pub(super) async fn get(client: &HttpClient, url: &str) -> anyhow::Result<(u16, bytes::Bytes)> {
    let (status, body) = tokio::time::timeout(Duration::from_secs(5), client.get(url))
        .await
        .context("timed out")??;
    Ok((status.as_u16(), body))
}

pub(super) async fn read_stats(client: &HttpClient, urls: &[String]) -> Vec<WorkerStats> {
    let reads = urls.iter().map(|u| async move {
        match get(client, &stats_url(u)).await {
            Ok((200, body)) => serde_json::from_slice(&body).unwrap_or_default(),
            _ => WorkerStats::default(),
        }
    });
    futures_util::future::join_all(reads).await
}

/// Samples the workers' stats every `SAMPLE_EVERY` until told to stop.
pub(super) fn spawn_sampler(
    client: HttpClient,
    urls: Vec<String>,
    t0: tokio::time::Instant,
    mut stop_rx: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Vec<Sample>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop_rx.changed() => break,
            }
            let workers = read_stats(&client, &urls).await;
            let t = tokio::time::Instant::now().saturating_duration_since(t0).as_secs_f64();
            samples.push(Sample { t, workers });
        }
        samples
    })
}

/// The workers' stats at the end. The workers count a request when it finishes, which the
/// client may see a moment before: wait (briefly, boundedly) until every answered request is
/// counted.
pub(super) async fn settled_stats(
    client: &HttpClient,
    stats_urls: &[String],
    stats_start: &[WorkerStats],
    answered: u64,
) -> Vec<WorkerStats> {
    let started: u64 = stats_start.iter().map(|s| s.requests_finished).sum();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let now = read_stats(client, stats_urls).await;
        let done: u64 =
            now.iter().map(|s| s.requests_finished).sum::<u64>().saturating_sub(started);
        if stats_urls.is_empty() || done >= answered || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the routers said of the run: drifts, the first-token prediction error (one router),
/// flow control's outcomes.
pub(super) async fn router_figures(
    client: &HttpClient,
    bases: &[String],
) -> (Option<u64>, Option<(u64, f64, f64)>, std::collections::BTreeMap<String, f64>) {
    let mut drifts_seen = None;
    for base in bases {
        if let Some(d) = drifts(client, base).await {
            drifts_seen = Some(drifts_seen.unwrap_or(0) + d);
        }
    }
    let drifts = drifts_seen;
    let ttft_error = match bases {
        [base] => ttft_error(client, base).await,
        _ => None,
    };
    let mut flow = std::collections::BTreeMap::new();
    for base in bases {
        for (outcome, n) in flow_outcomes(client, base).await {
            *flow.entry(outcome).or_insert(0.0) += n;
        }
    }
    (drifts, ttft_error, flow)
}

/// What a kvroute front door's flow control did, by outcome (its `/metrics`).
pub(super) async fn flow_outcomes(client: &HttpClient, base: &str) -> Vec<(String, f64)> {
    let url = format!("{}/metrics", base.trim_end_matches('/'));
    let Ok(Ok((status, body))) =
        tokio::time::timeout(Duration::from_secs(5), client.get(&url)).await
    else {
        return Vec::new();
    };
    let text = std::str::from_utf8(&body).ok().filter(|_| status.is_success()).unwrap_or("");
    let prefix = "kvroute_router_flow_requests_total{";
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|l| {
            let outcome = l.split("outcome=\"").nth(1)?.split('"').next()?;
            Some((outcome.to_owned(), l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// The first-token predictions of a kvroute front door's embedded router, from its
/// `/metrics`: how many, and their median and 90th percentile relative error.
pub(super) async fn ttft_error(client: &HttpClient, base: &str) -> Option<(u64, f64, f64)> {
    let url = format!("{}/metrics", base.trim_end_matches('/'));
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), client.get(&url)).await.ok()?.ok()?;
    let text = std::str::from_utf8(&body).ok().filter(|_| status.is_success())?;
    let name = "kvroute_router_ttft_prediction_error_ratio";
    let (n, q) = kvroute_http::metrics::histogram_quantiles(text, name, &[0.5, 0.9])?;
    Some((n, q[0], q[1]))
}

/// The drifts a kvroute front door's embedded router counted (its `/workers`).
pub(super) async fn drifts(client: &HttpClient, base: &str) -> Option<u64> {
    let url = format!("{}/workers", base.trim_end_matches('/'));
    let workers: Value =
        tokio::time::timeout(Duration::from_secs(5), client.get_json(&url)).await.ok()?.ok()?;
    let list = workers.get("workers")?.as_array()?;
    Some(list.iter().filter_map(|w| w.pointer("/checks/drifts")?.as_u64()).sum())
}

fn stats_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/stats") { base.to_owned() } else { format!("{base}/stats") }
}

//! A real Prometheus (Debian's `prometheus`, which the test command installs) on loopback,
//! scraping a running `kvroute serve --ext-proc-port` under load, through its front door and
//! through the test gateway over ext_proc, with `deploy/monitoring`'s rules loaded (their
//! groups evaluated every second instead of 15): every rule evaluates without error, every
//! recorded series returns data, and so does every query of the Grafana dashboard. (An
//! alert's expression holds only while it fires; each alert reads recorded series, which
//! are checked.)

#![allow(clippy::unwrap_used)]

mod common;

use common::Killed;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_http::HttpClient;
use serde_json::{Value, json};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn prometheus() -> PathBuf {
    let found = kvroute_stack::tools::on_path("prometheus");
    // scripts/test installs it (Debian's `prometheus`); a developer without it is told how.
    found.unwrap_or_else(|| panic!("a Prometheus server is needed: `apt-get install prometheus`"))
}

/// Starts `kvroute serve` and returns it with its front door's and its picker's addresses.
fn serve() -> (Killed, String, String) {
    let mut command = common::kvroute();
    command
        .args(["serve", "--simulated-workers", "2", "--port", "0", "--ext-proc-port", "0"])
        .args(["--flow-control", "--speedup", "20"])
        .stderr(Stdio::null());
    let (child, front, before) = common::spawned(command, "kvroute serve ready on ");
    let picker_line = "kvroute endpoint picker (Envoy ext_proc, gRPC health) on ";
    let picker =
        before.iter().find_map(|l| l.strip_prefix(picker_line)).expect("the picker's line");
    (child, front, picker.trim().to_owned())
}

/// A port for a child that takes a number, not a socket (below the ephemeral range, where the
/// suite's own sockets and connections never are).
fn free_port() -> u16 {
    kvroute_stack::tools::child_port().unwrap()
}

fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus' answer to an instant query.
async fn query(base: &str, expr: &str) -> Value {
    let body = format!("query={}", percent_encoded(expr));
    let request = hyper::Request::post(format!("{base}/api/v1/query"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let bytes = kvroute_http::client::read_body(response.into_body(), 1 << 20).await.unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

/// Chats sent until `stop`: shared prefixes, through the gateway and the front door in turn.
async fn load(gateway: String, front: String, stop: Arc<AtomicBool>) {
    let client = HttpClient::new();
    let mut k = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let topic = k % 4;
        let text = format!(
            "{} question {k}",
            "a long shared system prompt about topic ".repeat(6) + &topic.to_string()
        );
        let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4,
            "ignore_eos": true, "stream": k.is_multiple_of(3)});
        let base = if k.is_multiple_of(2) { &gateway } else { &front };
        let url = format!("{base}/v1/chat/completions");
        if let Ok(response) = client.call(hyper::Method::POST, &url, Some(&body)).await {
            let _ = kvroute_http::client::read_body(response.into_body(), 1 << 20).await;
        }
        k += 1;
    }
}

fn expressions() -> (Vec<String>, Vec<String>) {
    let rules =
        std::fs::read_to_string(root().join("deploy/monitoring/kvroute-rules.yaml")).unwrap();
    let recorded = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(str::to_owned)
        .collect();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/monitoring/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let exprs = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().replace("$__rate_interval", "1m"))
        .collect();
    (recorded, exprs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_kvroute_and_every_rule_and_panel_returns_data() {
    let prometheus = prometheus();
    let (_serve, front, picker) = serve();
    let gateway = kvroute_test_gateway::Gateway::new(
        kvroute_test_gateway::GatewayConfig::ext_proc(format!("http://{picker}")),
    )
    .unwrap();
    let gateway = kvroute_stack::serve_on_loopback(gateway.app()).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let loader = tokio::spawn(load(gateway, front.clone(), Arc::clone(&stop)));

    let dir = std::env::temp_dir().join(format!("kvroute-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rules =
        std::fs::read_to_string(root().join("deploy/monitoring/kvroute-rules.yaml")).unwrap();
    std::fs::write(dir.join("rules.yaml"), rules.replace("interval: 15s", "interval: 1s")).unwrap();
    let target = front.trim_start_matches("http://");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - rules.yaml\n\
         scrape_configs:\n  - job_name: kvroute\n    static_configs:\n      - targets: ['{target}']\n"
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let port = free_port();
    let _prometheus = Killed(
        std::process::Command::new(prometheus)
            .current_dir(&dir)
            .arg("--config.file=prometheus.yml")
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");

    let (recorded, panels) = expressions();
    assert!(recorded.len() >= 15 && panels.len() >= 15, "{} {}", recorded.len(), panels.len());
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut missing: Vec<String>;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        missing = Vec::new();
        let (status, _) =
            HttpClient::new().get(&format!("{base}/-/ready")).await.unwrap_or_default();
        if status != 200 {
            missing.push("prometheus ready".to_owned());
        } else {
            for expr in recorded.iter().chain(&panels) {
                let answer = query(&base, expr).await;
                assert_eq!(answer["status"], "success", "{expr}: {answer}");
                if answer["data"]["result"].as_array().is_none_or(Vec::is_empty) {
                    missing.push(expr.clone());
                }
            }
        }
        if missing.is_empty() || Instant::now() > deadline {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    loader.await.unwrap();
    assert!(missing.is_empty(), "no data for {missing:#?}");
    // Every rule, recording and alerting, evaluated without an error.
    let (_, rules) = HttpClient::new().get(&format!("{base}/api/v1/rules")).await.unwrap();
    let rules: Value = serde_json::from_slice(&rules).unwrap();
    let all: Vec<&Value> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert_eq!(all.len(), 23);
    for rule in all {
        assert_eq!(rule["health"], "ok", "{rule}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

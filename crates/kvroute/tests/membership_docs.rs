//! The membership commands of the README and docs/membership.md, run as written with the real
//! binary (ports chosen free instead of the docs' fixed ones): a worker added through the admin
//! API with the admin token and drained, refused without it; and a fleet whose only source is a
//! NATS bucket (`kvroute register` beside an engine, `kvroute serve --simulated-workers 0`), on
//! a real nats-server, answering a chat through the registered engine.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Killed, kvroute};
use kvroute_http::HttpClient;
use serde_json::{Value, json};

/// Starts `command` and reads its stdout to the line starting with `ready`: that line's rest.
fn started(mut command: Command, ready: &str) -> (Killed, String) {
    let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let child = Killed(child);
    let mut lines = std::io::BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix(ready) {
            // Keep draining its stdout so that it never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return (child, rest.to_owned());
        }
    }
    panic!("{command:?} ended before {ready:?}")
}

/// A `kvroute mocker` on free ports: its URL, events and load endpoints.
fn mocker() -> (Killed, String, String, String) {
    let mut command = kvroute();
    command.args(["mocker", "--port", "0", "--speedup", "20"]);
    command.args(["--events", "tcp://127.0.0.1:0", "--load-metrics", "tcp://127.0.0.1:0"]);
    let (child, line) = started(command, "kvroute mocker listening on ");
    // "http://127.0.0.1:P (model m); events tcp://... replay - load tcp://..."
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |w: &str| words[words.iter().position(|x| *x == w).unwrap() + 1].to_owned();
    (child, words[0].to_owned(), after("events"), after("load"))
}

async fn call(token: Option<&str>, method: hyper::Method, url: &str, body: Option<&Value>) -> u16 {
    let origin = url.splitn(4, '/').take(3).collect::<Vec<_>>().join("/");
    let client = match token {
        Some(t) => HttpClient::new().with_bearer_for(&origin, t),
        None => HttpClient::new(),
    };
    client.call(method, url, body).await.unwrap().status().as_u16()
}

async fn chat_worker(base: &str) -> (u16, Option<String>) {
    let body = json!({"model": "kvroute-tiny", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello! What is a KV cache?"}]});
    let url = format!("{base}/v1/chat/completions");
    let response = HttpClient::new().call(hyper::Method::POST, &url, Some(&body)).await.unwrap();
    let worker = response.headers().get("x-kvroute-worker").map(|v| v.to_str().unwrap().to_owned());
    (response.status().as_u16(), worker)
}

/// The README's "A fleet that changes": `KVROUTE_ADMIN_TOKEN=change-me kvroute serve`, a mocker
/// added with `curl ... -H 'authorization: Bearer change-me'`, then drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_fleet_that_changes_runs_as_written() {
    let mut command = kvroute();
    command.env("KVROUTE_ADMIN_TOKEN", "change-me").args([
        "serve",
        "--port",
        "0",
        "--speedup",
        "20",
    ]);
    let (_serve, line) = started(command, "kvroute serve ready on ");
    let base = line.split_whitespace().next().unwrap().to_owned();
    let (_mocker, url, events, metrics) = mocker();
    let spec = json!({"url": url, "events": events, "metrics": metrics});
    let workers = format!("{base}/workers");
    assert_eq!(call(None, hyper::Method::POST, &workers, Some(&spec)).await, 401);
    let client = HttpClient::new().with_bearer_for(&base, "change-me");
    let response = client.call(hyper::Method::POST, &workers, Some(&spec)).await.unwrap();
    assert_eq!(response.status(), 201);
    use http_body_util::BodyExt as _;
    let joined: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let id = joined["worker_id"].as_u64().unwrap();
    let drain = format!("{base}/workers/{id}/drain");
    assert_eq!(call(None, hyper::Method::POST, &drain, None).await, 401);
    assert_eq!(call(Some("change-me"), hyper::Method::POST, &drain, None).await, 202);
}

/// docs/membership.md's bucket example: every router follows the bucket, each engine's sidecar
/// registers it, signed with the fleet's key; `serve` starts with the bucket as its only source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_membership_docs_bucket_example_runs_as_written() {
    let dir = std::env::temp_dir().join(format!("kvroute-members-doc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let nats = match kvroute_bench::fixtures::nats_server::NatsServer::start(&dir.join("store"), 0)
        .await
    {
        Ok(nats) => nats,
        Err(err) => panic!("{err} (scripts/test installs nats-server into .venv)"),
    };
    let key_file = dir.join("members.key");
    std::fs::write(&key_file, "a registration key of at least sixteen bytes\n").unwrap();
    let (_engine, url, events, _) = mocker();
    let key = key_file.to_str().unwrap();
    // beside each engine
    let mut register = kvroute();
    register
        .args(["register", "--nats-url", &nats.url(), "--members-bucket", "fleet"])
        .args(["--members-key-file", key])
        .args(["--worker", &format!("url={url},events={events}")])
        .stdout(Stdio::null());
    let _sidecar = Killed(register.spawn().unwrap());
    // every router and picker
    let mut serve = kvroute();
    serve.args(["serve", "--simulated-workers", "0", "--nats-url", &nats.url()]).args([
        "--members-bucket",
        "fleet",
        "--members-key-file",
        key,
        "--port",
        "0",
    ]);
    let (_serve, line) = started(serve, "kvroute serve ready on ");
    let base = line.split_whitespace().next().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    let want = kvroute_router::members::id_for(&url).0.to_string();
    loop {
        let (status, worker) = chat_worker(&base).await;
        if status == 200 {
            assert_eq!(worker.as_deref(), Some(want.as_str()), "the registered engine answers");
            break;
        }
        assert!(Instant::now() < deadline, "no answer through the registered engine: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Without the key, the router does not start on a bucket.
    let out = kvroute()
        .args(["serve", "--simulated-workers", "0", "--nats-url", &nats.url()])
        .args(["--members-bucket", "fleet", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--members-key-file"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The fault suite: real `kvroute mocker` processes behind a real `kvroute frontend`, killed
//! (SIGKILL), stopped (SIGSTOP) and restarted on the same ports under streaming load, and what
//! the clients saw. `scripts/faults` runs it with the report printed.
//!
//! - SIGKILL under 8 requests/s of streams: none fails. The streams in flight on the killed
//!   worker go on on the other (#80): each complete, with all its tokens and `[DONE]`, its text
//!   the text an unbroken run of the same prompt gives; none reaches the dead worker 2 s after.
//! - Restart on the same ports: its old blocks are forgotten (the router's predictions match
//!   what the engine then serves from cache).
//! - SIGSTOP: no request waits longer than the first-byte timeout (plus its own generation).
//! - The wire under attack (`wire`): oversized ZMQ frames to every port of each process.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
use common::kvroute;
#[path = "faults/wire.rs"]
mod wire;

const FIRST_BYTE_TIMEOUT_SECS: f64 = 2.0;

struct Process {
    child: Child,
    line: String,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = signal(&self.child, "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(child: &Child, name: &str) -> bool {
    Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Starts `cmd` and waits for its ready line (`None` if it exits first).
fn start(cmd: &mut Command) -> Option<Process> {
    // `KVROUTE_FAULTS_LOG=dir` keeps each process's log there.
    let stderr = match std::env::var_os("KVROUTE_FAULTS_LOG") {
        Some(dir) => {
            let name = format!("{}.log", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            Stdio::from(std::fs::File::create(std::path::Path::new(&dir).join(name)).unwrap())
        }
        None => Stdio::null(),
    };
    let mut child = cmd.stdout(Stdio::piped()).stderr(stderr).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    if line.is_empty() {
        let _ = child.wait();
        return None;
    }
    Some(Process { child, line })
}

/// A mocker's URL and ZMQ endpoints, from its ready line.
#[derive(Clone, Debug)]
struct Mocker {
    url: String,
    events: String,
    replay: String,
    load: String,
}

fn word_after<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len();
    line[at..].split_whitespace().next().unwrap().trim_end_matches(';')
}

fn mocker_args(m: Option<&Mocker>) -> Vec<String> {
    let mut args: Vec<String> = ["mocker", "--speedup", "1", "--num-blocks", "4096"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    match m {
        None => args.extend(["--port".to_owned(), "0".to_owned()]),
        Some(m) => {
            let port = m.url.rsplit(':').next().unwrap().to_owned();
            args.extend(["--port".to_owned(), port]);
            args.extend(["--events".to_owned(), m.events.clone()]);
            args.extend(["--replay".to_owned(), m.replay.clone()]);
            args.extend(["--load-metrics".to_owned(), m.load.clone()]);
        }
    }
    args
}

fn start_mocker(same_as: Option<&Mocker>) -> (Process, Mocker) {
    // The same ports again right after a kill may take a moment to be free.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(p) = start(kvroute().args(mocker_args(same_as))) {
            let m = Mocker {
                url: word_after(&p.line, "listening on ").to_owned(),
                events: word_after(&p.line, "events ").to_owned(),
                replay: word_after(&p.line, "replay ").to_owned(),
                load: word_after(&p.line, "load ").to_owned(),
            };
            return (p, m);
        }
        assert!(Instant::now() < deadline, "the mocker did not start again on its ports");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn worker_flag(id: u64, m: &Mocker) -> String {
    format!("id={id},url={},events={},replay={},metrics={}", m.url, m.events, m.replay, m.load)
}

/// What one client saw.
#[derive(Clone, Debug)]
struct Seen {
    started: Duration,
    took: Duration,
    status: u16,
    worker: Option<u64>,
    outcome: Outcome,
    predicted: Option<u64>,
    cached: Option<u64>,
    /// The answer's text and its usage's completion tokens.
    text: String,
    completion: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Done,
    ErrorEvent,
    Truncated,
    Refused,
}

async fn chat(client: &kvroute_http::HttpClient, base: &str, prompt: &str, t0: Instant) -> Seen {
    // 128 tokens: ~0.8 s of decoding at a GPU's pace, so several streams are in flight.
    stream(client, base, prompt, (128, true), t0).await
}

/// A chat stream of `max_tokens`, asking for its usage or not.
async fn stream(
    client: &kvroute_http::HttpClient,
    base: &str,
    prompt: &str,
    (max_tokens, usage): (u64, bool),
    t0: Instant,
) -> Seen {
    let mut body = json!({"messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "ignore_eos": true, "stream": true});
    if usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    let started = t0.elapsed();
    let url = format!("{base}/v1/chat/completions");
    let response = client.call(hyper::Method::POST, &url, Some(&body)).await;
    let mut seen = Seen {
        started,
        took: Duration::ZERO,
        status: 0,
        worker: None,
        outcome: Outcome::Refused,
        predicted: None,
        cached: None,
        text: String::new(),
        completion: None,
    };
    let Ok(response) = response else {
        seen.took = t0.elapsed() - started;
        return seen;
    };
    seen.status = response.status().as_u16();
    let header = |name: &str| {
        response.headers().get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
    };
    seen.worker = header("x-kvroute-worker");
    seen.predicted = header("x-kvroute-overlap-tokens");
    let body = kvroute_http::client::read_body(response.into_body(), 16 << 20).await;
    seen.took = t0.elapsed() - started;
    let Ok(bytes) = body else {
        seen.outcome = Outcome::Truncated;
        return seen;
    };
    let text = String::from_utf8_lossy(&bytes);
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    seen.outcome = if events.iter().any(|e| e.starts_with("{\"error\"")) {
        Outcome::ErrorEvent
    } else if events.last() == Some(&"[DONE]") {
        Outcome::Done
    } else {
        Outcome::Truncated
    };
    let chunks: Vec<Value> =
        events.iter().filter_map(|e| serde_json::from_str::<Value>(e).ok()).collect();
    seen.cached =
        chunks.iter().find_map(|v| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
    seen.completion = chunks.iter().find_map(|v| v["usage"]["completion_tokens"].as_u64());
    seen.text =
        chunks.iter().filter_map(|v| v["choices"][0]["delta"]["content"].as_str()).collect();
    seen
}

fn prompt(k: usize) -> String {
    format!("Conversation {k}: tell me everything about the number {k} and its friends. ").repeat(8)
}

fn report(title: &str, seen: &[Seen]) {
    eprintln!("\n{title}");
    eprintln!("  start_ms  took_ms  status  worker  outcome     predicted  cached");
    for s in seen {
        eprintln!(
            "  {:>8} {:>8} {:>7} {:>7}  {:<11} {:>9} {:>7}",
            s.started.as_millis(),
            s.took.as_millis(),
            s.status,
            s.worker.map_or("-".to_owned(), |w| w.to_string()),
            format!("{:?}", s.outcome),
            s.predicted.map_or("-".to_owned(), |w| w.to_string()),
            s.cached.map_or("-".to_owned(), |w| w.to_string()),
        );
    }
}

async fn get_json(client: &kvroute_http::HttpClient, url: &str) -> Value {
    client.get_json(url).await.unwrap()
}

#[test]
fn workers_killed_stopped_and_restarted_under_load() {
    let (mut a, ma) = start_mocker(None);
    let (b, mb) = start_mocker(None);
    let front = start(kvroute().args([
        "frontend",
        "--port",
        "0",
        "--expose-overlap",
        "--first-byte-timeout",
        &FIRST_BYTE_TIMEOUT_SECS.to_string(),
        "--worker",
        &worker_flag(1, &ma),
        "--worker",
        &worker_flag(2, &mb),
    ]))
    .expect("the front door starts");
    let base = word_after(&front.line, "ready on ").to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let client = Arc::new(kvroute_http::HttpClient::new());

    // 1. SIGKILL worker 1 under 8 streams a second.
    let t0 = Instant::now();
    let kill_at = Duration::from_millis(1500);
    let seen: (Vec<Seen>, Duration) = runtime.block_on(async {
        let mut tasks = Vec::new();
        for k in 0..40 {
            let (client, base) = (Arc::clone(&client), base.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((t0 + Duration::from_millis(125 * k as u64)).into()).await;
                chat(&client, &base, &prompt(k % 10), t0).await
            }));
        }
        tokio::time::sleep_until((t0 + kill_at).into()).await;
        a.child.kill().unwrap();
        let _ = a.child.wait();
        // Gone from here: a request sent before this (the one sent at the kill's own
        // instant, too) may have reached it.
        let gone = t0.elapsed();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        (out, gone)
    });
    let (seen, gone) = seen;
    report("SIGKILL of worker 1 at 1500 ms, 8 streams/s", &seen);
    for s in &seen {
        assert_eq!((s.status, s.outcome), (200, Outcome::Done), "every stream completes: {s:?}");
        assert_eq!(s.completion, Some(128), "with every token of its bound: {s:?}");
    }
    // Those on worker 1 that ended after it died went on on worker 2: each with the text of
    // an unbroken run of the same prompt.
    let moved: Vec<(usize, &Seen)> = seen
        .iter()
        .enumerate()
        .filter(|(_, s)| s.worker == Some(1) && s.started + s.took > gone)
        .collect();
    for &(k, s) in &moved {
        let unbroken = seen
            .iter()
            .enumerate()
            .find(|(j, _)| j % 10 == k % 10 && moved.iter().all(|(m, _)| m != j));
        let (_, unbroken) = unbroken.expect("an unbroken run of the same prompt");
        assert_eq!(s.text, unbroken.text, "a moved stream's text is the unbroken one's");
    }
    for s in seen.iter().filter(|s| s.started >= kill_at + Duration::from_secs(2)) {
        assert_eq!(s.worker, Some(2), "nothing reaches the dead worker 2 s on: {s:?}");
    }
    let (_, metrics) = runtime.block_on(client.get(&format!("{base}/metrics"))).unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    let migrated = kvroute_http::metrics::sample(
        &metrics,
        "kvroute_frontend_migrations_total{reason=\"broken\"}",
    );
    eprintln!("  moved to worker 2: {} (migrations {migrated:?})", moved.len());
    assert!(!moved.is_empty(), "streams were in flight on worker 1 at the kill");
    assert!(migrated.is_some_and(|m| m >= moved.len() as f64), "{metrics}");

    // 2. Restart it on the same ports: back in rotation, its old blocks gone.
    let (a2, _) = start_mocker(Some(&ma));
    let deadline = Instant::now() + Duration::from_secs(15);
    runtime.block_on(async {
        loop {
            let workers = get_json(&client, &format!("{base}/workers")).await;
            let ejected = workers["health"]["1"]["ejected"].as_bool();
            let tree = workers["workers"][0]["tree_size"][0].as_u64();
            if ejected == Some(false) {
                // Its old blocks (about a hundred) are forgotten; what it may hold already is
                // the parity probe it gets on coming back (a few blocks).
                assert!(tree.is_some_and(|t| t < 16), "old blocks remain: {tree:?}");
                break;
            }
            assert!(Instant::now() < deadline, "worker 1 not back in rotation: {workers}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let t1 = Instant::now();
    let again: Vec<Seen> = runtime.block_on(async {
        let mut out = Vec::new();
        for k in 0..10 {
            out.push(chat(&client, &base, &prompt(k), t1).await);
        }
        out
    });
    report("after the restart on the same ports: the same prompts again", &again);
    for s in &again {
        assert_eq!((s.status, s.outcome), (200, Outcome::Done), "{s:?}");
        assert_eq!(s.predicted, s.cached, "the router predicts what the engine serves: {s:?}");
    }

    // 3. SIGSTOP worker 2: nobody waits longer than the first-byte timeout.
    assert!(signal(&b.child, "STOP"));
    let t2 = Instant::now();
    let stopped: Vec<Seen> = runtime.block_on(async {
        let mut tasks = Vec::new();
        for k in 0..12 {
            let (client, base) = (Arc::clone(&client), base.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((t2 + Duration::from_millis(250 * k as u64)).into()).await;
                chat(&client, &base, &prompt(100 + k as usize), t2).await
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    assert!(signal(&b.child, "CONT"));
    report("SIGSTOP of worker 2, 4 streams/s", &stopped);
    // A 128-token answer takes about a second here: the rest is waiting.
    let bound = Duration::from_secs_f64(FIRST_BYTE_TIMEOUT_SECS) + Duration::from_secs(2);
    for s in &stopped {
        assert_eq!((s.status, s.outcome, s.worker), (200, Outcome::Done, Some(1)), "{s:?}");
        assert!(s.took < bound, "waited {:?}, more than the first-byte timeout: {s:?}", s.took);
    }
    drop((a2, b, front));
}

/// #80's must-show: three engines, long streams, one engine SIGKILLed mid-stream and another
/// stopped (SIGSTOP) mid-stream: every stream completes as one stream, with all its tokens and
/// `[DONE]`, its text the text of the same request run unbroken.
#[test]
fn streams_whose_engines_die_or_stop_go_on_as_one_stream() {
    let engines: Vec<(Process, Mocker)> = (0..3).map(|_| start_mocker(None)).collect();
    // Two engines go at once: a stream moved from the killed one to the stopped one moves
    // again (a continuation's continuation), hence two migrations.
    let flags = ["frontend", "--port", "0", "--inter-token-timeout", "1", "--first-byte-timeout"];
    let mut args: Vec<String> = flags.into_iter().map(str::to_owned).collect();
    args.extend(["2", "--max-migrations", "2"].map(str::to_owned));
    for (i, (_, m)) in engines.iter().enumerate() {
        args.extend(["--worker".to_owned(), worker_flag(i as u64 + 1, m)]);
    }
    let front = start(kvroute().args(&args)).expect("the front door starts");
    let base = word_after(&front.line, "ready on ").to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let client = Arc::new(kvroute_http::HttpClient::new());
    const TOKENS: u64 = 300; // about 2 s of decoding each
    let ask = |k: usize| {
        (format!("Story {k}: once upon a time, in a land far away. "), k.is_multiple_of(2))
    };

    let mut engines = engines;
    let t0 = Instant::now();
    // The nine streams at once, each task's answer in order.
    let streams = || {
        let tasks: Vec<_> = (0..9)
            .map(|k| {
                let (client, base) = (Arc::clone(&client), base.clone());
                let (prompt, usage) = ask(k);
                tokio::spawn(
                    async move { stream(&client, &base, &prompt, (TOKENS, usage), t0).await },
                )
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        }
    };
    let seen: Vec<Seen> = runtime.block_on(async {
        let answers = streams();
        tokio::time::sleep(Duration::from_millis(700)).await;
        engines[0].0.child.kill().unwrap();
        let _ = engines[0].0.child.wait();
        assert!(signal(&engines[1].0.child, "STOP"));
        answers.await
    });
    assert!(signal(&engines[1].0.child, "CONT"));
    report("worker 1 SIGKILLed and worker 2 stopped at 700 ms, 9 streams of 300 tokens", &seen);
    // The same requests again, unbroken (on worker 3, and worker 2 once back).
    let again: Vec<Seen> = runtime.block_on(async { streams().await });
    let mut moved = [0, 0];
    for (k, (s, unbroken)) in seen.iter().zip(&again).enumerate() {
        assert_eq!((s.status, s.outcome), (200, Outcome::Done), "every stream completes: {s:?}");
        assert_eq!(unbroken.outcome, Outcome::Done, "{unbroken:?}");
        assert!(!s.text.is_empty() && s.text == unbroken.text, "stream {k}: {s:?} / {unbroken:?}");
        if ask(k).1 {
            assert_eq!(s.completion, Some(TOKENS), "the usage counts the whole answer: {s:?}");
        }
        if let Some(w @ 1..=2) = s.worker {
            moved[w as usize - 1] += 1;
        }
    }
    let (_, metrics) = runtime.block_on(client.get(&format!("{base}/metrics"))).unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    let migrated = kvroute_http::metrics::sample(
        &metrics,
        "kvroute_frontend_migrations_total{reason=\"broken\"}",
    );
    eprintln!("  moved from the killed worker {}, from the stopped one {}", moved[0], moved[1]);
    assert!(moved[0] > 0 && moved[1] > 0, "streams ran on both at 700 ms: {moved:?}");
    assert!(migrated.is_some_and(|m| m >= f64::from(moved[0] + moved[1])), "{metrics}");
    drop((engines, front));
}

/// `kvroute bench --faults` as docs/bench.md gives it: with streams allowed to move, the kill
/// loses none of the requests it caught; without, it loses every one.
#[test]
fn the_fault_bench_runs_as_documented() {
    let out = std::env::temp_dir().join(format!("kvroute-faults-bench-{}", std::process::id()));
    let status = kvroute()
        .args(["bench", "--faults", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "kvroute bench --faults: {status}");
    let runs: Value =
        serde_json::from_slice(&std::fs::read(out.join("faults.json")).unwrap()).unwrap();
    let (moving, not) = (&runs[0], &runs[1]);
    assert_eq!(
        (moving["max_migrations"].as_u64(), not["max_migrations"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(moving["caught"].as_u64() > Some(0) && not["caught"].as_u64() > Some(0), "{runs}");
    assert_eq!(moving["lost"], 0, "{runs}");
    assert!(moving["migrations"].as_u64() >= moving["caught"].as_u64(), "{runs}");
    assert_eq!(not["lost"], not["caught"], "{runs}");
    assert!(std::fs::read_to_string(out.join("faults.md")).unwrap().contains("| 1 | "));
    let _ = std::fs::remove_dir_all(&out);
}

/// `kvroute router --state-dir`: stopped with SIGTERM it writes its state; started again it
/// has the blocks it knew at once, and what the engine cached while it was down, from the
/// engine's replay after the batch it had seen last.
#[test]
fn a_router_restarted_with_its_state_dir_remembers() {
    let (_engine, m) = start_mocker(None);
    let dir = std::env::temp_dir().join(format!("kvroute-state-{}", std::process::id()));
    let router = || {
        let (worker, dir) = (worker_flag(1, &m), dir.display().to_string());
        let args = ["router", "--port", "0", "--worker", &worker, "--state-dir", &dir];
        start(kvroute().args(args)).expect("the router starts")
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let client = kvroute_http::HttpClient::new();
    let ask = |k: usize| {
        let body = json!({"messages": [{"role": "user", "content": prompt(k)}], "max_tokens": 4});
        let url = format!("{}/v1/chat/completions", m.url);
        let answer = runtime.block_on(client.call(hyper::Method::POST, &url, Some(&body)));
        assert_eq!(answer.unwrap().status(), 200);
    };
    let held = |base: &str| {
        let workers = runtime.block_on(get_json(&client, &format!("{base}/workers")));
        workers["workers"][0]["tree_size"][0].as_u64().unwrap_or(0)
    };
    let until = |base: &str, done: &dyn Fn(u64) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = held(base);
            if done(n) {
                return n;
            }
            assert!(Instant::now() < deadline, "the router holds {n} blocks");
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    let mut first = router();
    let base = word_after(&first.line, "listening on ").to_owned();
    for k in 0..3 {
        ask(k);
    }
    let before = until(&base, &|n| n >= 40);
    let last_seq = |base: &str| {
        let workers = runtime.block_on(get_json(&client, &format!("{base}/workers")));
        workers["workers"][0]["last_seq"][0].as_u64().expect("a last batch")
    };
    let seen = last_seq(&base);
    assert!(signal(&first.child, "TERM"));
    let _ = first.child.wait();
    assert!(dir.join("router-state.json").is_file(), "written at shutdown");

    ask(3); // cached while no router listens
    let second = router();
    let base = word_after(&second.line, "listening on ").to_owned();
    // Ready means caught up: the saved blocks and the replay of what followed are in.
    let after = held(&base);
    assert!(after > before, "the saved {before} blocks and the new prompt's: {after}");
    // Only what followed the saved batch was asked of the engine (a router without the state
    // asks for everything the engine still keeps, from batch 0).
    let (_, metrics) = runtime.block_on(client.get(&format!("{base}/metrics"))).unwrap();
    let replayed = kvroute_http::metrics::sample(
        &String::from_utf8_lossy(&metrics),
        "kvroute_router_replayed_batches_total",
    );
    let now = last_seq(&base);
    assert!(now > seen, "batches followed: {seen} then {now}");
    assert_eq!(replayed, Some((now - seen) as f64), "replayed from batch {} on", seen + 1);
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}

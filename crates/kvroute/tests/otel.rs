//! kvroute's spans in a real OTLP receiver: rotel (an OpenTelemetry collector, the PyPI
//! package `rotel`, whose wheel carries its binary; `scripts/test` installs it into .venv)
//! receives OTLP/gRPC from a running `kvroute serve --otlp-endpoint` and writes every span it
//! gets to its debug log, which the tests read back: one trace per request, from the front
//! door and from the picker (through the test gateway over ext_proc), on an aggregated and on
//! a prefill/decode request, each span under the right parent, and the engine called in the
//! engine span's context. Skipped, saying so, where rotel is not installed.
//!
//! Jaeger's all-in-one and the OpenTelemetry Collector were the first choices; neither can be
//! built here (their Go modules come from a proxy this machine does not reach, and Debian's
//! Go is older than they need).

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use common::Killed;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use kvroute_http::HttpClient;
use serde_json::{Value, json};

/// rotel's binary: `KVROUTE_ROTEL`, else the `rotel` package in the Python environment on
/// PATH or in the repository's .venv (where scripts/test installs it).
fn rotel() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KVROUTE_ROTEL") {
        return Some(PathBuf::from(path));
    }
    let paths = std::env::var_os("PATH").unwrap_or_default();
    let venv = kvroute_stack::tools::in_venv("bin");
    std::env::split_paths(&paths).chain(venv).find_map(|bin| {
        let lib = bin.parent()?.join("lib");
        std::fs::read_dir(lib).ok()?.flatten().find_map(|python| {
            let agent = python.path().join("site-packages/rotel/rotel-agent");
            agent.is_file().then_some(agent)
        })
    })
}

/// A running receiver: its OTLP/gRPC endpoint and the file its spans are written to.
struct Receiver {
    _child: Killed,
    endpoint: String,
    log: PathBuf,
}

/// A port for a child that takes a number, not a socket (below the ephemeral range, where the
/// suite's own sockets and connections never are).
fn free_port() -> u16 {
    kvroute_stack::tools::child_port().unwrap()
}

/// Starts rotel on loopback, once its gRPC port takes connections; `None` (the test says
/// it is skipped) without it.
fn receiver(name: &str) -> Option<Receiver> {
    let Some(agent) = rotel() else {
        eprintln!(
            "SKIPPED: no OTLP receiver (pip install rotel==0.0.1a15, as scripts/test does, or set KVROUTE_ROTEL)"
        );
        return None;
    };
    let dir = std::env::temp_dir().join(format!("kvroute-otel-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("spans.log");
    let (grpc, http) = (free_port(), free_port());
    let child = std::process::Command::new(agent)
        .arg("start")
        .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{grpc}")])
        .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http}")])
        .args(["--exporter", "blackhole", "--debug-log", "traces"])
        .args(["--debug-log-verbosity", "detailed"])
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = Killed(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], grpc));
    while std::net::TcpStream::connect_timeout(&address, Duration::from_millis(100)).is_err() {
        assert!(Instant::now() < deadline, "rotel did not listen on {address}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(Receiver { _child: child, endpoint: format!("http://127.0.0.1:{grpc}"), log })
}

/// One span as the receiver printed it.
#[derive(Clone, Debug, Default)]
struct Span {
    trace: String,
    parent: String,
    id: String,
    name: String,
    kind: String,
    attributes: BTreeMap<String, String>,
    events: Vec<String>,
}

/// Every span in the receiver's log (its debug exporter's "detailed" form).
fn received(log: &PathBuf) -> Vec<Span> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out: Vec<Span> = Vec::new();
    let mut in_events = false;
    for line in text.lines() {
        if line.starts_with("Span #") {
            out.push(Span::default());
            in_events = false;
            continue;
        }
        if line.starts_with("ResourceSpans #") {
            in_events = true; // the resource's attributes are not the span's
            continue;
        }
        let Some(span) = out.last_mut() else { continue };
        let field = |name: &str| line.strip_prefix(name).map(|v| v.trim().to_owned());
        if let Some(v) = field("    Trace ID       :") {
            span.trace = v;
        } else if let Some(v) = field("    Parent ID      :") {
            span.parent = v;
        } else if let Some(v) = field("    ID             :") {
            span.id = v;
        } else if let Some(v) = field("    Name           :") {
            span.name = v;
        } else if let Some(v) = field("    Kind           :") {
            span.kind = v;
        } else if line.starts_with("Events:") {
            in_events = true;
        } else if let Some(v) = field("     -> Name:") {
            span.events.push(v);
        } else if let Some((key, value)) =
            line.strip_prefix("     -> ").and_then(|kv| kv.split_once(": "))
            && !in_events
        {
            // `Str(x)`, `Int(3)`, `Double(0.5)`, `Bool(true)`: the value inside.
            let value = value.split_once('(').map_or(value, |(_, v)| v.trim_end_matches(')'));
            span.attributes.insert(key.to_owned(), value.to_owned());
        }
    }
    out
}

/// The spans of `trace`, once it holds `names` (each name as many times as it is listed):
/// the exporter sends them in batches, as they end.
fn trace_of(receiver: &Receiver, trace: &str, names: &[&str]) -> Vec<Span> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found: Vec<Span> =
            received(&receiver.log).into_iter().filter(|s| s.trace == trace).collect();
        let count = |name: &str, of: &[Span]| of.iter().filter(|s| s.name == name).count();
        if names.iter().all(|n| count(n, &found) >= count_listed(n, names)) {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "trace {trace}: {names:?} not all received; got {:?}",
            found.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn count_listed(name: &str, names: &[&str]) -> usize {
    names.iter().filter(|n| **n == name).count()
}

fn one<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    let named: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(named.len(), 1, "one {name}: {spans:#?}");
    named[0]
}

/// A `kvroute` command exporting every span to `receiver`, once it printed its `ready` line:
/// the first address of that line, and the lines before it.
fn started(receiver: &Receiver, args: &[&str], ready: &str) -> (Killed, String, Vec<String>) {
    started_at(receiver, args, ready, "1")
}

/// [`started`] at a trace ratio of `ratio`.
fn started_at(
    receiver: &Receiver,
    args: &[&str],
    ready: &str,
    ratio: &str,
) -> (Killed, String, Vec<String>) {
    let mut command = common::kvroute();
    command
        .args(args)
        .args(["--otlp-endpoint", &receiver.endpoint, "--trace-ratio", ratio])
        // Spans leave in batches every 100 ms instead of 5 s (the SDK's own variable).
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stderr(Stdio::null());
    common::spawned(command, ready)
}

/// `kvroute serve` exporting every span to `receiver`, with its picker (whose simulated
/// workers then answer `/stats` without a token): its front door's and its picker's
/// addresses.
fn serve(receiver: &Receiver, fleet: &[&str]) -> (Killed, String, String) {
    let mut args = vec!["serve", "--port", "0", "--speedup", "50", "--flow-control"];
    args.extend(["--no-parity-probe", "--ext-proc-port", "0"]);
    args.extend(fleet);
    let (child, front, before) = started(receiver, &args, "kvroute serve ready on ");
    let picker_line = "kvroute endpoint picker (Envoy ext_proc, gRPC health) on ";
    let picker = before.iter().find_map(|l| l.strip_prefix(picker_line)).expect("its line");
    (child, front, picker.trim().to_owned())
}

/// A chat with `traceparent`: its status.
async fn chat(base: &str, traceparent: &str, text: &str) -> u16 {
    let body = json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": text}],
        "max_tokens": 3, "stream": true});
    let request = hyper::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("traceparent", traceparent)
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body.to_string())))
        .unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let status = response.status().as_u16();
    kvroute_http::client::read_body(response.into_body(), 1 << 20).await.unwrap();
    status
}

/// The `traceparent` each worker was last called with (`/stats`'s `trace`).
async fn engine_parents(front: &str) -> Vec<String> {
    let client = HttpClient::new();
    let fleet: Value = client.get_json(&format!("{front}/workers")).await.unwrap();
    let mut out = Vec::new();
    for w in fleet["workers"].as_array().unwrap() {
        let url = w["url"].as_str().unwrap();
        let stats: Value = client.get_json(&format!("{url}/stats")).await.unwrap();
        if let Some(parent) = stats["trace"]["traceparent"].as_str() {
            out.push(parent.to_owned());
        }
    }
    out
}

const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent(trace: &str) -> String {
    format!("00-{trace}-{CLIENT_SPAN}-01")
}

/// The spans every request of the front door has, parented as a trace of it should be: the
/// request under the client's span; preprocess, hash, admit and the engine call under the
/// request; the decision under its admission; the self-check under the engine call.
fn assert_request_tree(spans: &[Span], legs: &[&str]) {
    let request = one(spans, "kvroute.request");
    assert_eq!(request.parent, CLIENT_SPAN, "{request:?}");
    assert_eq!(request.kind, "SPAN_KIND_SERVER");
    assert_eq!(request.attributes["gen_ai.operation.name"], "chat");
    assert_eq!(request.attributes["gen_ai.request.model"], "kvroute-tiny");
    assert!(request.attributes.contains_key("gen_ai.usage.output_tokens"), "{request:?}");
    for name in ["kvroute.preprocess", "kvroute.hash", "kvroute.admit"] {
        assert_eq!(one(spans, name).parent, request.id, "{name}");
    }
    let admit = one(spans, "kvroute.admit");
    assert_eq!(admit.attributes["kvroute.outcome"], "placed", "{admit:?}");
    let decide = one(spans, "kvroute.decide");
    assert_eq!(decide.parent, admit.id);
    if legs == ["aggregated"] {
        // The chosen candidate and the others by their cost terms (a pair's legs are priced
        // by the pair cost, which a decision's record does not keep).
        for key in ["kvroute.candidate.0.ttft_ms", "kvroute.candidate.1.cost"] {
            assert!(decide.attributes.contains_key(key), "{key}: {decide:?}");
        }
        assert!(decide.attributes.contains_key("kvroute.runner_up.reason"), "{decide:?}");
    }
    let engines: Vec<&Span> = spans.iter().filter(|s| s.name == "kvroute.engine").collect();
    let mut seen: Vec<&str> =
        engines.iter().map(|e| e.attributes["kvroute.leg"].as_str()).collect();
    seen.sort_unstable();
    assert_eq!(seen, legs, "{engines:#?}");
    for engine in &engines {
        assert_eq!(engine.parent, request.id, "{engine:?}");
        assert_eq!(engine.kind, "SPAN_KIND_CLIENT");
        assert_eq!(engine.attributes["http.response.status_code"], "200", "{engine:?}");
    }
}

/// The front door and the picker each make one trace per request, continuing the client's,
/// its spans parented right; the engine is called in the engine span's context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregated_request_is_one_trace_from_the_front_door_and_from_the_picker() {
    let Some(receiver) = receiver("aggregated") else { return };
    let (_serve, front, picker) = serve(&receiver, &["--simulated-workers", "2"]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    assert_eq!(chat(&front, &traceparent(trace), "the front door's question").await, 200);
    let spans = trace_of(&receiver, trace, &["kvroute.request", "kvroute.self_check"]);
    assert_request_tree(&spans, &["aggregated"]);
    let engine = one(&spans, "kvroute.engine");
    assert_eq!(engine.events, ["first byte"], "{engine:?}");
    let check = one(&spans, "kvroute.self_check");
    assert_eq!(check.parent, engine.id);
    assert_eq!(check.attributes["kvroute.agrees"], "true", "{check:?}");
    let called = format!("00-{trace}-{}-01", engine.id);
    assert!(engine_parents(&front).await.contains(&called), "the engine got {called}");

    // Through a gateway: the picker's trace, its engine span's context in the header mutation.
    let gateway = kvroute_test_gateway::Gateway::new(
        kvroute_test_gateway::GatewayConfig::ext_proc(format!("http://{picker}")),
    )
    .unwrap();
    let gateway = kvroute_stack::serve_on_loopback(gateway.app()).await.unwrap();
    let trace = "0af7651916cd43dd8448eb211c80319c";
    assert_eq!(chat(&gateway, &traceparent(trace), "the gateway's question").await, 200);
    let spans = trace_of(&receiver, trace, &["kvroute.request", "kvroute.self_check"]);
    assert_request_tree(&spans, &["aggregated"]);
    let engine = one(&spans, "kvroute.engine");
    let called = format!("00-{trace}-{}-01", engine.id);
    assert!(engine_parents(&front).await.contains(&called), "the engine got {called}");

    // A malformed traceparent is ignored: the request starts a trace of its own.
    assert_eq!(chat(&front, "00-NOT-A-TRACE-01", "a hostile question").await, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    let root = loop {
        let roots: Vec<Span> = received(&receiver.log)
            .into_iter()
            .filter(|s| s.name == "kvroute.request" && s.parent.is_empty())
            .collect();
        if let Some(root) = roots.into_iter().next() {
            break root;
        }
        assert!(Instant::now() < deadline, "no trace of kvroute's own was received");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(root.trace.len(), 32, "{root:?}");
}

/// Sampling is decided once, at the request's start: at ratio 0 a request the caller did not
/// sample, or that came without a (valid) `traceparent`, makes no span at all, and its
/// caller's context goes on to the engine unsampled; a request its caller sampled is traced
/// whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_request_makes_no_spans_and_a_sampled_one_its_whole_tree() {
    let Some(receiver) = receiver("ratio-0") else { return };
    let args = ["serve", "--port", "0", "--speedup", "50", "--flow-control", "--no-parity-probe"];
    // With its picker, whose simulated workers answer /stats without a token.
    let args = [&args[..], &["--ext-proc-port", "0"]].concat();
    let args = [&args[..], &["--simulated-workers", "2"]].concat();
    let (_serve, front, _) = started_at(&receiver, &args, "kvroute serve ready on ", "0");
    let unsampled = "11111111111111111111111111111111";
    let header = format!("00-{unsampled}-{CLIENT_SPAN}-00");
    assert_eq!(chat(&front, &header, "a question nobody traces").await, 200);
    let parents = engine_parents(&front).await;
    assert!(
        parents.iter().any(|p| p.starts_with(&format!("00-{unsampled}-")) && p.ends_with("-00")),
        "the caller's unsampled context goes on: {parents:?}"
    );
    assert_eq!(chat(&front, "00-NOT-A-TRACE-01", "a question of its own").await, 200);
    let trace = "22222222222222222222222222222222";
    assert_eq!(chat(&front, &traceparent(trace), "a traced question").await, 200);
    let spans = trace_of(&receiver, trace, &["kvroute.request", "kvroute.self_check"]);
    assert_request_tree(&spans, &["aggregated"]);
    // The exporter sends spans in the order they end: the traced request's came after the
    // others', so nothing else was made.
    let all = received(&receiver.log);
    let others: Vec<_> = all.iter().filter(|s| s.trace != trace).collect();
    assert!(others.is_empty(), "spans of unsampled requests: {others:#?}");
}

/// A prefill/decode request is one trace: an engine span per leg, both under the request,
/// each leg's engine called in its own span's context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_decode_request_is_one_trace_with_a_span_per_leg() {
    let Some(receiver) = receiver("pair") else { return };
    // Never prefilled in place: the test is of the split.
    let fleet = ["--prefill-workers", "1", "--decode-workers", "1", "--pd-cost", "in_place=0"];
    let (_serve, front, _) = serve(&receiver, &fleet);
    let trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    let question = "a question long enough to be prefilled on its own worker ".repeat(4);
    assert_eq!(chat(&front, &traceparent(trace), &question).await, 200);
    let spans =
        trace_of(&receiver, trace, &["kvroute.request", "kvroute.engine", "kvroute.engine"]);
    assert_request_tree(&spans, &["decode", "prefill"]);
    let decide = one(&spans, "kvroute.decide");
    assert!(decide.attributes.contains_key("kvroute.prefill_worker"), "{decide:?}");
    let parents = engine_parents(&front).await;
    for engine in spans.iter().filter(|s| s.name == "kvroute.engine") {
        let called = format!("00-{trace}-{}-01", engine.id);
        assert!(
            parents.contains(&called),
            "the {:?} leg's engine got {called}: {parents:?}",
            engine.attributes["kvroute.leg"]
        );
    }
}

/// A decision is heard by the other replicas in its trace, and the remote router API continues
/// the caller's: a `kvroute serve` and a `kvroute router` sharing decisions over a real
/// nats-server, both exporting; the router's span of a peer's decision hangs under the
/// decision's span, and a `find_best_worker` call with a `traceparent` is a trace of the
/// router's spans under the caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_and_the_router_api_carry_the_trace() {
    let Some(receiver) = receiver("replicas") else { return };
    let store = std::env::temp_dir().join(format!("kvroute-otel-nats-{}", std::process::id()));
    let nats = kvroute_bench::fixtures::nats_server::NatsServer::start(&store, 0).await.unwrap();
    let url = nats.url();
    let (_serve, front, _) = serve(&receiver, &["--simulated-workers", "2", "--nats-url", &url]);
    let fleet: Value = HttpClient::new().get_json(&format!("{front}/workers")).await.unwrap();
    let workers: Vec<String> = fleet["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| format!("id={},url={}", w["id"], w["url"].as_str().unwrap()))
        .collect();
    let mut args = vec!["router", "--port", "0", "--nats-url", &url, "--nats-replica", "b"];
    for w in &workers {
        args.extend(["--worker", w.as_str()]);
    }
    let (_router, router, _) = started(&receiver, &args, "kvroute router listening on ");
    // The router hears the serve's decisions once it subscribed: ask until one is heard.
    let trace = "6bf92f3577b34da6a3ce929d0e0e4738";
    let heard = |spans: &[Span]| spans.iter().any(|s| s.name == "kvroute.replica.routed");
    let deadline = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        assert_eq!(chat(&front, &traceparent(trace), "a question for two replicas").await, 200);
        let spans: Vec<Span> =
            received(&receiver.log).into_iter().filter(|s| s.trace == trace).collect();
        if heard(&spans) {
            break spans;
        }
        assert!(Instant::now() < deadline, "no replica heard a decision: {spans:#?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let routed = spans.iter().find(|s| s.name == "kvroute.replica.routed").unwrap().clone();
    // Heard by the router (replica b) from the serve, the replica that decided.
    assert_ne!(routed.attributes["kvroute.replica"], "b", "{routed:?}");
    // The two processes export in batches of their own: the decision's span may come after
    // the replica's.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans: Vec<Span> =
            received(&receiver.log).into_iter().filter(|s| s.trace == trace).collect();
        let decided: Vec<&Span> = spans.iter().filter(|s| s.name == "kvroute.decide").collect();
        if decided.iter().any(|d| d.id == routed.parent) {
            break;
        }
        assert!(Instant::now() < deadline, "{routed:?} under a decision: {decided:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }

    // The router's API continues a caller's trace.
    let trace = "7bf92f3577b34da6a3ce929d0e0e4739";
    let body = json!({"local_hashes": [1, 2, 3], "num_tokens": 48, "request_id": "api-1"});
    let request = hyper::Request::post(format!("{router}/find_best_worker"))
        .header("content-type", "application/json")
        .header("traceparent", traceparent(trace))
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body.to_string())))
        .unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let spans = trace_of(&receiver, trace, &["kvroute.request", "kvroute.decide"]);
    let request = one(&spans, "kvroute.request");
    assert_eq!(request.parent, CLIENT_SPAN);
    assert_eq!(request.attributes["gen_ai.operation.name"], "find_best_worker");
    assert_eq!(request.attributes["kvroute.request_id"], "api-1");
    assert_eq!(one(&spans, "kvroute.decide").parent, request.id);
}

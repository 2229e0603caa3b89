//! The picker's rows of `scripts/hostile` (issue #64): each finding tried against a running
//! release `kvroute serve --ext-proc-port` as an attacker would, over real gRPC and HTTP on
//! loopback, with what the server did and whether that is what the fix promises. Prints a
//! markdown table; exits 1 when a row misses.
//!
//! ```text
//! hostile_picker GRPC_URL FRONT_DOOR_URL SERVER_PID API_KEY ADMIN_TOKEN DEADLINE_SECS
//! ```
//!
//! The server must run with `--api-keys-file` holding `API_KEY max-priority=0` (the
//! attacker's) and `API_KEY-honest` (an honest client's), an admin token, `--flow-control
//! --max-num-seqs 8` and `--first-byte-timeout DEADLINE_SECS`.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request,
};
use http_body_util::BodyExt;
use kvroute_http::HttpClient;
use kvroute_test_gateway::{Gateway, GatewayConfig};
use serde_json::{Value, json};
use tokio::sync::mpsc;

struct Args {
    grpc: String,
    door: String,
    pid: u32,
    key: String,
    admin: String,
    deadline: Duration,
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }
}

fn headers(path: &str, extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut all = vec![
        header(":method", "POST"),
        header(":path", path),
        header("content-type", "application/json"),
    ];
    all.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers: all }),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn body(bytes: Vec<u8>, end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes,
            end_of_stream: end,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

struct Raw {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

async fn raw(grpc: &str) -> Raw {
    let mut client = ExternalProcessorClient::connect(grpc.to_owned()).await.unwrap();
    let (tx, rx) = mpsc::channel(4);
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let rx = client.process(stream).await.unwrap().into_inner();
    Raw { tx, rx }
}

async fn post(url: &str, body: &Value, extra: &[(&str, &str)]) -> (u16, Duration) {
    let started = Instant::now();
    let mut request = hyper::Request::post(url).header("content-type", "application/json");
    for (k, v) in extra {
        request = request.header(*k, *v);
    }
    let bytes = serde_json::to_vec(body).unwrap();
    let request = request.body(http_body_util::Full::new(hyper::body::Bytes::from(bytes))).unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    (status, started.elapsed())
}

/// A counter or gauge of the front door's `/metrics`.
async fn metric(args: &Args, name: &str) -> f64 {
    let request = hyper::Request::get(format!("{}/metrics", args.door))
        .header("authorization", format!("Bearer {}", args.admin))
        .body(http_body_util::Full::new(hyper::body::Bytes::new()))
        .unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let text = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text).into_owned();
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn status_line(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn chat(text: &str, stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": stream})
}

fn prompt(topic: &str) -> String {
    (0..200).map(|i| format!("{topic} word{i}")).collect::<Vec<_>>().join(" ")
}

type Row = (&'static str, String, String, bool);

async fn transfer_off_the_placed_paths(gateway: &str, bearer: &str) -> Row {
    let tokens: Vec<u32> = (1..=2_000).collect();
    let generate = json!({"token_ids": tokens, "sampling_params": {"max_tokens": 2},
        "kv_transfer_params": {"do_remote_decode": true}});
    let sglang = json!({"input_ids": tokens, "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 7});
    let xargs = json!({"prompt": "hi", "vllm_xargs": {"kv_transfer_params": {}}});
    let auth = [("authorization", bearer)];
    let a = post(&format!("{gateway}/inference/v1/generate"), &generate, &auth).await.0;
    let b = post(&format!("{gateway}/generate"), &sglang, &auth).await.0;
    let c = post(&format!("{gateway}/v1/completions"), &xargs, &auth).await.0;
    let ok = [a, b, c].iter().all(|s| *s == 400);
    let tried = "vLLM generate + kv_transfer_params, SGLang /generate + bootstrap, vllm_xargs";
    ("1 transfer fields off the placed paths", tried.to_owned(), format!("{a}, {b}, {c}"), ok)
}

async fn quiet_streams(args: &Args, gateway: &str, bearer: &str) -> Row {
    let mut quiet = Vec::new();
    for n in 0..60 {
        let grpc = args.grpc.clone();
        let auth = bearer.to_owned();
        quiet.push(tokio::spawn(async move {
            let mut r = raw(&grpc).await;
            let text = serde_json::to_vec(&chat(&prompt(&format!("quiet {n}")), true)).unwrap();
            r.tx.send(headers("/v1/chat/completions", &[("authorization", &auth)])).await.ok()?;
            r.tx.send(body(text, true)).await.ok()?;
            let _ = r.rx.message().await;
            // Never a response header: the stream just stays open.
            tokio::time::sleep(Duration::from_secs(60)).await;
            Some(r)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let honest = format!("Bearer {}-honest", args.key);
    let auth = [("authorization", honest.as_str()), ("x-kvroute-tenant", "ignored")];
    let mut worst = Duration::ZERO;
    let mut statuses = Vec::new();
    for i in 0..6 {
        let entry = if i % 2 == 0 { gateway.to_owned() } else { args.door.clone() };
        let url = format!("{entry}/v1/chat/completions");
        let (status, took) = post(&url, &chat(&prompt(&format!("honest {i}")), false), &auth).await;
        statuses.push(status);
        worst = worst.max(took);
    }
    // The quiet picks flow control held back are placed as the first ones are freed, each
    // then freed at its own deadline: wait (bounded) until none is left in flight.
    let drain = Instant::now();
    let mut in_flight = metric(args, "kvroute_frontend_in_flight").await;
    while in_flight > 0.0 && drain.elapsed() < Duration::from_secs(90) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        in_flight = metric(args, "kvroute_frontend_in_flight").await;
    }
    let drained = drain.elapsed();
    let freed = metric(args, "kvroute_epp_deadlines_total{stage=\"response\"}").await;
    for q in quiet {
        q.abort();
    }
    let ok = statuses.iter().all(|s| *s == 200)
        && worst < args.deadline + Duration::from_secs(5)
        && in_flight == 0.0;
    let did = format!(
        "honest answers {statuses:?}, worst {:.2} s; in flight: {in_flight} {:.1} s after the \
         honest ones; placements freed at the deadline: {freed} (the rest refused by flow \
         control's queue after its 30 s wait)",
        worst.as_secs_f64(),
        drained.as_secs_f64()
    );
    (
        "2 60 quiet streams, flow control, 2 workers x 8 seqs",
        "60 picks never answered (one key); 6 honest requests beside (another key)".to_owned(),
        did,
        ok,
    )
}

async fn who_is_asking(args: &Args, gateway: &str, bearer: &str) -> Row {
    let url = format!("{gateway}/v1/chat/completions");
    let none = post(&url, &chat("no key", false), &[]).await.0;
    let before = metric(args, "kvroute_frontend_priority_clamped_total").await;
    let high = [("authorization", bearer), ("x-kvroute-priority", "100")];
    let clamped = post(&url, &chat("priority 100", false), &high).await.0;
    let after = metric(args, "kvroute_frontend_priority_clamped_total").await;
    let ok = none == 401 && clamped == 200 && after - before == 1.0;
    let did = format!("no key: {none}; priority 100 with a key capped at 0: {clamped}, lowered");
    ("3 any tenant at any priority", "no key; x-kvroute-priority: 100".to_owned(), did, ok)
}

async fn never_ending_bodies(args: &Args, gateway: &str, bearer: &str) -> Row {
    std::fs::write(format!("/proc/{}/clear_refs", args.pid), "5").unwrap();
    let idle = status_line(args.pid, "VmRSS:");
    let mut streams = Vec::new();
    let mut refused = 0;
    for _ in 0..12 {
        let mut r = raw(&args.grpc).await;
        let from = [("authorization", bearer), ("x-forwarded-for", "10.9.9.9")];
        r.tx.send(headers("/v1/chat/completions", &from)).await.unwrap();
        let mut sent = 0usize;
        let mut answered = false;
        while sent < 60 << 20 {
            let chunk = vec![b' '; 1 << 20];
            tokio::select! {
                s = r.tx.send(body(chunk, false)) => {
                    if s.is_err() {
                        break;
                    }
                    sent += 1 << 20;
                }
                m = r.rx.message() => {
                    answered = m.is_ok();
                    break;
                }
            }
        }
        refused += usize::from(answered || sent < 60 << 20);
        streams.push(r);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let peak = status_line(args.pid, "VmHWM:");
    let url = format!("{gateway}/v1/chat/completions");
    let honest = post(&url, &chat("small", false), &[("authorization", bearer)]).await.0;
    drop(streams);
    let above = peak.saturating_sub(idle) as f64 / f64::from(1 << 20);
    let bound = 128.0 + 64.0;
    let ok = above <= bound && honest == 200;
    let did = format!(
        "peak RSS {above:.0} MiB above idle; {refused} of 12 refused (503) past the client's \
         128 MiB; the honest request: {honest}"
    );
    ("4 12 never-ending 60 MiB bodies, one client", format!("bound {bound:.0} MiB"), did, ok)
}

#[tokio::main]
async fn main() {
    let a: Vec<String> = std::env::args().collect();
    let args = Args {
        grpc: a[1].clone(),
        door: a[2].clone(),
        pid: a[3].parse().unwrap(),
        key: a[4].clone(),
        admin: a[5].clone(),
        deadline: Duration::from_secs_f64(a[6].parse().unwrap()),
    };
    let bearer = format!("Bearer {}", args.key);
    let gateway = Gateway::new(GatewayConfig::ext_proc(&args.grpc)).unwrap();
    let gateway = kvroute_stack::serve_on_loopback(gateway.app()).await.unwrap();
    let rows = vec![
        transfer_off_the_placed_paths(&gateway, &bearer).await,
        quiet_streams(&args, &gateway, &bearer).await,
        who_is_asking(&args, &gateway, &bearer).await,
        never_ending_bodies(&args, &gateway, &bearer).await,
    ];
    println!("| #64 finding | tried | the server did | as promised |");
    println!("|---|---|---|---|");
    for (name, tried, did, ok) in &rows {
        println!("| {name} | {tried} | {did} | {} |", if *ok { "yes" } else { "**no**" });
    }
    std::process::exit(i32::from(!rows.iter().all(|r| r.3)));
}

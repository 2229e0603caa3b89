//! Decisions per second through the Endpoint Picker (ext_proc over gRPC on loopback) beside
//! the same fleet's router API (`POST /find_best_worker`), with 256-block prompts (4,096
//! tokens), 16 clients at once, on the machine's cores (the numbers in #53's note come from
//! 2). An ext_proc decision is one stream as a gateway drives it: the request headers, the
//! body (a completion whose prompt is token ids, so the picker parses and hashes 4,096
//! tokens; or a chat in text, which it tokenizes first), the picker's headers and body back,
//! then the response's headers ending the stream (the request freed). A `/find_best_worker`
//! decision takes the 256 block hashes already made (binary form) and tracks nothing.
//!
//! `cargo bench -p kvroute-stack --bench picker` (without `--bench`: a quick pass).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, processing_request, processing_response,
};
use kvroute_http::HttpClient;
use kvroute_http::router_api::FindBestWorker;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_stack::{Simulated, Stack, StackConfig};
use tokio::sync::mpsc;

const BLOCKS: usize = 256;
const CLIENTS: usize = 16;

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }
}

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest { request: Some(request), ..ProcessingRequest::default() }
}

/// One decision over ext_proc: a stream from headers to the response's end.
async fn ext_proc_decision(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    path: &str,
    body: &[u8],
) {
    let (tx, rx) = mpsc::channel(4);
    let headers = vec![header(":method", "POST"), header(":path", path)];
    let headers = HttpHeaders { headers: Some(HeaderMap { headers }), ..HttpHeaders::default() };
    tx.send(message(processing_request::Request::RequestHeaders(headers))).await.unwrap();
    let body = HttpBody { body: body.to_vec(), end_of_stream: true, ..HttpBody::default() };
    tx.send(message(processing_request::Request::RequestBody(body))).await.unwrap();
    let mut answers =
        client.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    let first = answers.message().await.unwrap().unwrap();
    match first.response {
        Some(processing_response::Response::RequestHeaders(_)) => {}
        other => panic!("{other:?}"),
    }
    // The body back, its last chunk ending it.
    loop {
        let m = answers.message().await.unwrap().unwrap();
        let Some(processing_response::Response::RequestBody(b)) = m.response else { panic!() };
        let mutation = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
        use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
        let Mutation::StreamedResponse(s) = mutation else { panic!() };
        if s.end_of_stream {
            break;
        }
    }
    let done = vec![header(":status", "200")];
    let done = HttpHeaders {
        headers: Some(HeaderMap { headers: done }),
        end_of_stream: true,
        ..HttpHeaders::default()
    };
    tx.send(message(processing_request::Request::ResponseHeaders(done))).await.unwrap();
    let _ = answers.message().await.unwrap().unwrap();
}

/// Decisions per second of `CLIENTS` loops of `decide` for `seconds`.
async fn rate<F, Fut>(seconds: f64, decide: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (done, decide) = (Arc::clone(&done), decide.clone());
        tasks.push(tokio::spawn(async move {
            let mut k = 0u64;
            while Instant::now() < until {
                decide(c, k).await;
                done.fetch_add(1, Ordering::Relaxed);
                k += 1;
            }
        }));
    }
    let start = Instant::now();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let seconds = if quick { 1.0 } else { 15.0 };
    let stack = Stack::start(StackConfig {
        simulated: Simulated {
            count: 4,
            engine: EngineConfig { timing: Timing { speedup: 1000.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        ..StackConfig::default()
    })
    .await
    .unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
    let picker = stack.picker(kvroute_epp::EppOptions::default(), None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(kvroute_epp::serve(listener, picker, async {}, std::future::pending()));
    let router = kvroute_stack::serve_on_loopback(stack.router_app().unwrap()).await.unwrap();
    let tokens = BLOCKS * 16;
    // Each client's prompts: 8 prefixes of its own, the last block varied, in turn.
    let completion = move |c: usize, k: u64| {
        let prompt: Vec<u64> =
            (0..tokens as u64).map(|t| 100 + (c as u64 * 8 + k % 8) * 7 + t % 1000).collect();
        let mut prompt = prompt;
        prompt[tokens - 1] = k;
        serde_json::to_vec(&serde_json::json!({"prompt": prompt, "max_tokens": 1})).unwrap()
    };
    let words = move |c: usize, k: u64| {
        // ~4,096 tokens of text: the built-in model's words, one token each or so.
        let text: Vec<String> =
            (0..tokens).map(|t| format!("w{}", (c * 8 + (k % 8) as usize) * 3 + t % 500)).collect();
        let body = serde_json::json!({"messages": [{"role": "user", "content": text.join(" ") + &k.to_string()}], "max_tokens": 1});
        serde_json::to_vec(&body).unwrap()
    };
    println!("| {BLOCKS}-block prompts, {CLIENTS} clients | decisions/s |");
    println!("|---|---|");
    let channel = tonic::transport::Endpoint::from_shared(grpc).unwrap().connect().await.unwrap();
    let client = ExternalProcessorClient::new(channel).max_decoding_message_size(64 << 20);
    let c = client.clone();
    let r = rate(seconds, move |i, k| {
        let mut c = c.clone();
        let body = completion(i, k);
        async move { ext_proc_decision(&mut c, "/v1/completions", &body).await }
    })
    .await;
    println!("| ext_proc, completion of token ids (parse, hash, place, free) | {r:.0} |");
    let c = client.clone();
    let r = rate(seconds, move |i, k| {
        let mut c = c.clone();
        let body = words(i, k);
        async move { ext_proc_decision(&mut c, "/v1/chat/completions", &body).await }
    })
    .await;
    println!("| ext_proc, chat in text (tokenize, hash, place, free) | {r:.0} |");
    let http = HttpClient::new();
    let r = rate(seconds, move |c, k| {
        let (http, router) = (http.clone(), router.clone());
        let hashes: Vec<u64> =
            (0..BLOCKS as u64).map(|b| (c as u64 * 8 + k % 8) << 20 | b).collect();
        let request = FindBestWorker::query(hashes, tokens as i64);
        async move {
            http.find_best_worker(&router, &request).await.unwrap();
        }
    })
    .await;
    println!("| /find_best_worker, 256 hashes made (binary form) | {r:.0} |");
}

//! kvroute as an Endpoint Picker over real sockets on 127.0.0.1 (docs/kubernetes.md): the
//! ext_proc gRPC server, the test gateway that plays Envoy's side, simulated workers. Each
//! rule of the Endpoint Picker protocol as a test: the destination in the header and in
//! `envoy.lb` alike, with fallbacks; the subset hint obeyed; 503 when nothing is ready; 429
//! when shedding; the endpoint that served read back; gRPC health; a stream dropped by the
//! gateway freeing its request; bytes that are no message answered with a gRPC error.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::eventually;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request,
    processing_response,
};
use envoy_types::pb::google::protobuf::Struct;
use http_body_util::BodyExt;
use kvroute_core::schedule::flow::FlowConfig;
use kvroute_epp::metadata;
use kvroute_epp::{EppOptions, Picker};
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::RouterConfig;
use kvroute_stack::{Simulated, Stack, StackConfig};
use kvroute_test_gateway::{Gateway, GatewayConfig};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Simulated workers, the front door's stages, and the picker serving ext_proc on loopback.
struct Pool {
    stack: Stack,
    picker: Arc<Picker>,
    /// The picker's gRPC URL.
    grpc: String,
    /// The workers' `host:port`, in the order of their ids.
    endpoints: Vec<String>,
    /// Fires the picker's readiness (already fired unless the pool was started unready).
    ready: Option<oneshot::Sender<()>>,
}

async fn pool_with(workers: usize, router: RouterConfig, options: EppOptions, ready: bool) -> Pool {
    let config = StackConfig {
        simulated: Simulated {
            count: workers,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        router,
        ..StackConfig::default()
    };
    pool_of(config, options, Served::default(), ready).await
}

/// How the picker's port is served: its gateway token and TLS.
#[derive(Default)]
struct Served {
    token: Option<&'static str>,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Health in plain text on a port of its own.
    health: Option<tokio::net::TcpListener>,
}

async fn pool_of(config: StackConfig, options: EppOptions, served: Served, ready: bool) -> Pool {
    let stack = Stack::start(config).await.unwrap();
    let token = served.token.map(|t| kvroute_http::Credentials::new([t], "test").unwrap());
    let picker = stack.picker(options, token).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = format!("http://{}", listener.local_addr().unwrap());
    let (ready_tx, ready_rx) = oneshot::channel::<()>();
    let to_serve = Arc::clone(&picker);
    tokio::spawn(async move {
        let ready = async move {
            let _ = ready_rx.await;
        };
        let never = std::future::pending();
        kvroute_epp::serve_tls(listener, to_serve, served.tls, served.health, ready, never)
            .await
            .unwrap();
    });
    let mut ready_tx = Some(ready_tx);
    if ready {
        assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
        let _ = ready_tx.take().unwrap().send(());
    }
    let front = stack.frontend.as_ref().unwrap();
    let endpoints =
        front.worker_urls().into_iter().map(|(_, u)| kvroute_epp::host_port(&u).unwrap()).collect();
    Pool { stack, picker, grpc, endpoints, ready: ready_tx }
}

async fn pool(workers: usize) -> Pool {
    pool_with(workers, RouterConfig::default(), EppOptions::default(), true).await
}

impl Pool {
    async fn gateway(&self, configure: impl FnOnce(&mut GatewayConfig)) -> (Arc<Gateway>, String) {
        let mut config = GatewayConfig::ext_proc(&self.grpc);
        configure(&mut config);
        let gateway = Gateway::new(config).unwrap();
        let base = kvroute_stack::serve_on_loopback(gateway.app()).await.unwrap();
        (gateway, base)
    }

    fn in_flight(&self) -> i64 {
        self.stack.frontend.as_ref().unwrap().in_flight()
    }

    async fn metrics(&self) -> String {
        let base = self.stack.serve_frontend_on_loopback().await.unwrap();
        let (_, body) = HttpClient::new().get(&format!("{base}/metrics")).await.unwrap();
        String::from_utf8(body.to_vec()).unwrap()
    }
}

/// A prompt of several blocks, different per `topic`.
fn prompt(topic: &str) -> String {
    (0..120).map(|i| format!("{topic} word{i}")).collect::<Vec<_>>().join(" ")
}

fn chat(text: &str, stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4,
        "ignore_eos": true, "stream": stream})
}

/// Status, headers and body of a POST through the gateway.
async fn post(
    base: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, hyper::HeaderMap, Vec<u8>) {
    let mut request =
        hyper::Request::post(format!("{base}{path}")).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = serde_json::to_vec(body).unwrap();
    let request = request.body(http_body_util::Full::new(hyper::body::Bytes::from(body))).unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, headers, bytes)
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into()))
}

fn cached(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_routes_by_cached_prefix_with_the_destination_in_header_and_metadata() {
    let p = pool(4).await;
    for mode in [BodySendMode::FullDuplexStreamed, BodySendMode::Buffered] {
        let (gateway, base) = p
            .gateway(|c| {
                c.request_mode = mode;
                c.response_mode = mode;
                c.chunk_bytes = 512;
            })
            .await;
        let text = prompt(&format!("{mode:?}"));
        let router = p.stack.router.as_ref().unwrap();
        let held = || router.view().index_stats().blocks;
        let before = held();
        let (status, headers, first) =
            post(&base, "/v1/chat/completions", &chat(&text, false), &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
        assert!(
            headers.contains_key(kvroute_frontend::WORKER_HEADER),
            "the picker set the worker header"
        );
        // The engine's KV events of the first answer reach the index (at most 10 s), then the
        // second request can follow them.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while held() <= before {
            assert!(std::time::Instant::now() < deadline, "the first answer's blocks never came");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (status, _, second) =
            post(&base, "/v1/chat/completions", &chat(&text, false), &[]).await;
        assert_eq!(status, 200);
        let routed = gateway.routed();
        assert_eq!(routed.len(), 2);
        for r in &routed {
            // The same value in the header and in envoy.lb, the picked endpoint first and
            // two fallbacks after it, all endpoints of the pool, none twice.
            assert_eq!(r.header, r.metadata, "{mode:?}");
            let listed: Vec<&str> = r.header.as_deref().unwrap().split(',').collect();
            assert_eq!(listed.len(), 3, "{listed:?}");
            assert!(listed.iter().all(|e| p.endpoints.iter().any(|x| x == e)));
            assert_eq!(listed.iter().collect::<std::collections::BTreeSet<_>>().len(), 3);
            assert_eq!(r.served.as_deref(), Some(listed[0]));
        }
        assert_eq!(
            routed[0].served, routed[1].served,
            "the second request follows its cached prefix"
        );
        assert!(cached(&json_of(&second)) > cached(&json_of(&first)), "{}", json_of(&second));
        // Streamed: the answer passes through the picker chunk by chunk, without the usage
        // chunk the client did not ask for.
        let (status, _, streamed) =
            post(&base, "/v1/chat/completions", &chat(&text, true), &[]).await;
        assert_eq!(status, 200);
        let streamed = String::from_utf8(streamed).unwrap();
        assert!(streamed.trim_end().ends_with("data: [DONE]"), "{streamed}");
        assert!(!streamed.contains("\"usage\""), "{streamed}");
        assert_eq!(gateway.routed()[2].served, routed[0].served);
        assert!(
            eventually(Duration::from_secs(5), || p.in_flight() == 0).await,
            "nothing left in flight"
        );
    }
    let metrics = p.metrics().await;
    for name in [
        "inference_objective_request_total{",
        "inference_objective_request_duration_seconds_bucket{",
        "inference_extension_scheduler_e2e_duration_seconds_count",
        "kvroute_epp_streams_total",
    ] {
        assert!(metrics.contains(name), "{name} on /metrics");
    }
    assert!(metrics.contains("inference_objective_running_requests{model_name=\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_other_routes_pass_through_the_picker() {
    let p = pool(2).await;
    let (gateway, base) = p.gateway(|_| {}).await;
    let body = json!({"prompt": prompt("completion"), "max_tokens": 3, "ignore_eos": true});
    let (status, _, answer) = post(&base, "/v1/completions", &body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    // A GET has no body: the next ready endpoint in turn.
    let (status, models) = HttpClient::new().get(&format!("{base}/v1/models")).await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&models));
    let routed = gateway.routed();
    assert_eq!(routed.len(), 2);
    assert_eq!(routed[1].header, routed[1].metadata);
    assert!(eventually(Duration::from_secs(5), || p.in_flight() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_is_obeyed_and_an_empty_or_foreign_subset_is_a_503() {
    let p = pool(4).await;
    let only = p.endpoints[2].clone();
    let (gateway, base) = p.gateway(|c| c.subset = Some(vec![only.clone()])).await;
    for k in 0..4 {
        let (status, _, body) =
            post(&base, "/v1/chat/completions", &chat(&prompt(&format!("s{k}")), false), &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    for r in gateway.routed() {
        assert_eq!(
            r.header.as_deref(),
            Some(only.as_str()),
            "only the subset, no fallback outside it"
        );
    }
    // An address without a port allows every endpoint there.
    let (gateway, base) = p.gateway(|c| c.subset = Some(vec!["127.0.0.1".to_owned()])).await;
    let (status, _, _) = post(&base, "/v1/chat/completions", &chat("any", false), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(gateway.routed()[0].header.as_deref().unwrap().split(',').count(), 3);
    for subset in [vec![], vec!["10.9.9.9:8000".to_owned()]] {
        let (gateway, base) = p.gateway(|c| c.subset = Some(subset.clone())).await;
        let (status, headers, body) =
            post(&base, "/v1/chat/completions", &chat("x", false), &[]).await;
        assert_eq!(status, 503, "{subset:?}");
        assert_eq!(headers["content-type"], "application/json");
        assert!(
            json_of(&body)["error"]["message"].as_str().unwrap().contains("subset"),
            "{}",
            json_of(&body)
        );
        assert!(gateway.routed().is_empty());
    }
    assert!(eventually(Duration::from_secs(5), || p.in_flight() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_file_is_reread_and_an_empty_pool_is_a_503() {
    let p = pool(2).await;
    let dir = std::env::temp_dir().join(format!("kvroute-epp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("endpoints");
    std::fs::write(&file, "# nothing yet\n").unwrap();
    let _watch = p.picker.watch(file.clone(), Duration::from_millis(20));
    let (gateway, base) = p.gateway(|_| {}).await;
    let refused =
        || async { post(&base, "/v1/chat/completions", &chat("pool", false), &[]).await.0 };
    assert!(
        eventually_async(|| async { refused().await == 503 }).await,
        "no endpoint in the pool: 503"
    );
    // A ConfigMap's file is swapped whole.
    let tmp = dir.join("endpoints.new");
    std::fs::write(&tmp, format!("{}  # the second worker\n", p.endpoints[1])).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    assert!(eventually_async(|| async { refused().await == 200 }).await);
    let routed = gateway.routed();
    assert!(
        routed.iter().all(|r| r.header.as_deref() == Some(p.endpoints[1].as_str())),
        "{routed:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

async fn eventually_async<F: std::future::Future<Output = bool>>(mut f: impl FnMut() -> F) -> bool {
    for _ in 0..250 {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_request_is_a_429_with_retry_after() {
    let mut router = RouterConfig::default();
    router.scheduler.flow = FlowConfig {
        enabled: true,
        max_engine_wait_ms: 0.001,
        max_wait_ms: 30_000,
        ..FlowConfig::default()
    };
    let p = pool_with(1, router, EppOptions::default(), true).await;
    let (_gateway, base) = p.gateway(|_| {}).await;
    // A long answer holds the only worker: the fleet is saturated.
    let mut hold = chat("hold the worker", true);
    hold["max_tokens"] = json!(30_000);
    let body = serde_json::to_vec(&hold).unwrap();
    let request = hyper::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .unwrap();
    let client = HttpClient::new();
    let response = client.send(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut held = response.into_body();
    assert!(held.frame().await.unwrap().unwrap().data_ref().is_some());
    let (status, headers, body) = post(
        &base,
        "/v1/chat/completions",
        &chat("shed me", false),
        &[("x-kvroute-priority", "-1")],
    )
    .await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    assert!(headers.get("retry-after").is_some(), "Retry-After");
    assert_eq!(json_of(&body)["error"]["type"], "rate_limit_error");
    // The client leaves: the gateway drops the stream, the held request is freed.
    drop(held);
    assert!(eventually(Duration::from_secs(10), || p.in_flight() == 0).await, "{}", p.in_flight());
    let metrics = p.metrics().await;
    assert!(
        metrics.contains("inference_objective_request_error_total{")
            && metrics.contains("error_code=\"429\"")
    );
    assert!(metrics.contains("kvroute_epp_broken_streams_total 1"), "the dropped stream counted");
}

async fn channel(grpc: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(grpc.to_owned()).unwrap().connect().await.unwrap()
}

async fn health(grpc: &str, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel(grpc).await);
    let request = tonic_health::pb::HealthCheckRequest { service: service.to_owned() };
    let status = client.check(request).await.unwrap().into_inner().status;
    ServingStatus::try_from(status).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_live_at_once_and_ready_once_the_workers_are() {
    let mut p = pool_with(1, RouterConfig::default(), EppOptions::default(), false).await;
    assert!(
        eventually_async(|| async { health(&p.grpc, "liveness").await == ServingStatus::Serving })
            .await
    );
    for service in kvroute_epp::READY_SERVICES {
        assert_eq!(health(&p.grpc, service).await, ServingStatus::NotServing, "{service}");
    }
    assert!(p.stack.ready(Duration::from_secs(10)).await.is_empty());
    let _ = p.ready.take().unwrap().send(());
    for service in kvroute_epp::READY_SERVICES {
        let serving = || async { health(&p.grpc, service).await == ServingStatus::Serving };
        assert!(eventually_async(serving).await, "{service}");
    }
    let mut client = HealthClient::new(channel(&p.grpc).await);
    let unknown = tonic_health::pb::HealthCheckRequest { service: "nope".to_owned() };
    assert_eq!(client.check(unknown).await.unwrap_err().code(), tonic::Code::NotFound);
}

/// One ext_proc stream driven by hand, as a gateway would.
struct Raw {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

async fn raw(grpc: &str) -> Raw {
    let mut client = ExternalProcessorClient::connect(grpc.to_owned()).await.unwrap();
    let (tx, rx) = mpsc::channel(16);
    let rx =
        client.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    Raw { tx, rx }
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }
}

fn request_headers(path: &str) -> ProcessingRequest {
    let headers = vec![
        header(":method", "POST"),
        header(":path", path),
        header("content-type", "application/json"),
    ];
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn request_body(body: &[u8], end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: end,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// Sends a whole chat request; the destination the picker answered.
async fn picked(raw: &mut Raw, text: &str) -> String {
    picked_as(raw, text, true).await.expect("a pick")
}

/// [`picked`] with the chat streamed or not; `None` when the picker answered it itself (a
/// refusal) instead of picking.
async fn picked_as(raw: &mut Raw, text: &str, stream: bool) -> Option<String> {
    raw.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    let body = serde_json::to_vec(&chat(text, stream)).unwrap();
    raw.tx.send(request_body(&body, true)).await.unwrap();
    let answer = raw.rx.message().await.unwrap().unwrap();
    let dynamic = answer.dynamic_metadata.as_ref()?;
    let destination = metadata::dynamic_string(dynamic, "envoy.lb", metadata::DESTINATION_KEY)
        .unwrap()
        .to_owned();
    // The body comes back, its last chunk ending the stream.
    loop {
        let m = raw.rx.message().await.unwrap().unwrap();
        let Some(processing_response::Response::RequestBody(b)) = m.response else {
            panic!("{m:?}")
        };
        let mutation = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
        let envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::StreamedResponse(s) = mutation else {
            panic!("a streamed body")
        };
        if s.end_of_stream {
            break;
        }
    }
    Some(destination)
}

fn response_headers(served: Option<&str>) -> ProcessingRequest {
    let headers = vec![header(":status", "200"), header("content-type", "text/event-stream")];
    let metadata_context = served.map(|s| Metadata {
        filter_metadata: [(
            "envoy.lb".to_owned(),
            Struct { fields: [(metadata::SERVED_KEY.to_owned(), metadata::string(s))].into() },
        )]
        .into(),
        ..Metadata::default()
    });
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..HttpHeaders::default()
        })),
        metadata_context,
        ..ProcessingRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_dropped_mid_body_frees_its_request_and_the_served_endpoint_is_read() {
    let p = pool(3).await;
    // Dropped while the request body comes: nothing was placed, nothing is left.
    let partial = raw(&p.grpc).await;
    partial.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    partial.tx.send(request_body(b"{\"messages\": [", false)).await.unwrap();
    drop(partial);
    // Placed, then dropped while the response passes: freed.
    let mut placed = raw(&p.grpc).await;
    let destination = picked(&mut placed, &prompt("dropped")).await;
    assert_eq!(p.in_flight(), 1);
    placed.tx.send(response_headers(Some(destination.split(',').next().unwrap()))).await.unwrap();
    let _ = placed.rx.message().await.unwrap().unwrap();
    drop(placed);
    assert!(
        eventually(Duration::from_secs(5), || p.in_flight() == 0).await,
        "freed when the gateway dropped it"
    );
    // Served by a fallback: the endpoint picked is out of rotation for a while, as when
    // the front door cannot reach a worker.
    let mut fell_back = raw(&p.grpc).await;
    let destination = picked(&mut fell_back, &prompt("fallback")).await;
    let listed: Vec<&str> = destination.split(',').collect();
    fell_back.tx.send(response_headers(Some(listed[1]))).await.unwrap();
    let _ = fell_back.rx.message().await.unwrap().unwrap();
    // Ejected (a probe may bring it back at once: the counter tells).
    let metrics = p.metrics().await;
    assert!(
        metrics.contains("kvroute_frontend_worker_ejections_total 1"),
        "the unreachable endpoint is ejected"
    );
    drop(fell_back);
    assert!(eventually(Duration::from_secs(5), || p.in_flight() == 0).await);
    assert!(p.metrics().await.contains("kvroute_epp_fallbacks_served_total 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_oversized_and_malformed_messages_are_errors_never_a_panic() {
    let options = EppOptions { max_body_bytes: 64 << 10, ..EppOptions::default() };
    let p = pool_with(1, RouterConfig::default(), options, true).await;
    // A body before the headers.
    let mut r = raw(&p.grpc).await;
    r.tx.send(request_body(b"{}", true)).await.unwrap();
    assert_eq!(r.rx.message().await.unwrap_err().code(), tonic::Code::FailedPrecondition);
    // A message with no request in it.
    let mut r = raw(&p.grpc).await;
    r.tx.send(ProcessingRequest::default()).await.unwrap();
    assert_eq!(r.rx.message().await.unwrap_err().code(), tonic::Code::InvalidArgument);
    // A body past the limit: 413 in OpenAI's shape.
    let mut r = raw(&p.grpc).await;
    r.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    r.tx.send(request_body(&vec![b' '; 40 << 10], false)).await.unwrap();
    r.tx.send(request_body(&vec![b' '; 40 << 10], true)).await.unwrap();
    let m = r.rx.message().await.unwrap().unwrap();
    let Some(processing_response::Response::ImmediateResponse(i)) = m.response else {
        panic!("{m:?}")
    };
    assert_eq!(i.status.unwrap().code, 413);
    // A body that is no JSON: 400.
    let mut r = raw(&p.grpc).await;
    r.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    r.tx.send(request_body(b"{\"messages\": [}", true)).await.unwrap();
    let m = r.rx.message().await.unwrap().unwrap();
    let Some(processing_response::Response::ImmediateResponse(i)) = m.response else {
        panic!("{m:?}")
    };
    assert_eq!(i.status.unwrap().code, 400);
    assert!(json_of(&i.body)["error"]["message"].is_string());
    // A gRPC message past the decoder's limit: refused before it is held.
    let mut r = raw(&p.grpc).await;
    r.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    r.tx.send(request_body(&vec![b' '; 2 << 20], true)).await.unwrap();
    let code = r.rx.message().await.unwrap_err().code();
    assert!(
        matches!(
            code,
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted | tonic::Code::Internal
        ),
        "{code:?}"
    );
    // Bytes that are no protobuf, and a message with a field no version of the protocol has.
    let garbage = grpc_call(&p.grpc, &[0xff, 0xff, 0xff, 0xff, 0x0f, 0x12]).await;
    assert_ne!(garbage, "0", "undecodable bytes are a gRPC error");
    let mut unknown = prost::Message::encode_to_vec(&request_headers("/v1/models"));
    unknown.extend_from_slice(&[0xf8, 0x3e, 0x01]); // field 999, varint 1
    unknown.extend_from_slice(&prost::Message::encode_to_vec(&ProcessingRequest {
        protocol_config: Some(Default::default()),
        ..ProcessingRequest::default()
    }));
    assert_eq!(
        grpc_call(&p.grpc, &unknown).await,
        "0",
        "unknown fields are skipped, as protobuf says"
    );
    // The picker still serves.
    let (_gateway, base) = p.gateway(|_| {}).await;
    assert_eq!(post(&base, "/v1/chat/completions", &chat("still here", false), &[]).await.0, 200);
    assert!(eventually(Duration::from_secs(5), || p.in_flight() == 0).await);
}

/// Sends one length-prefixed gRPC message of raw `payload` bytes on a real HTTP/2 stream and
/// ends it; the `grpc-status` the picker answers with.
async fn grpc_call(grpc: &str, payload: &[u8]) -> String {
    let address = grpc.trim_start_matches("http://");
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let request = hyper::Request::post(format!("{grpc}/{}/Process", kvroute_epp::EXT_PROC_SERVICE))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(payload);
    send.send_data(frame.into(), true).unwrap();
    let response = response.await.unwrap();
    if let Some(status) = response.headers().get("grpc-status") {
        return status.to_str().unwrap().to_owned();
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    trailers["grpc-status"].to_str().unwrap().to_owned()
}

/// Two pickers behind one gateway (the pods of the picker's Service), each a router replica
/// sharing decisions and events over a real NATS JetStream: both serve, no leader. Each
/// prompt is sent four times, its streams alternating between the pickers: every repeat
/// finds the whole prefix cached where the first went (the hit rate of the repeats is 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pickers_over_nats_keep_every_repeat_on_its_cached_prefix() {
    use kvroute_bench::fixtures::nats_server::NatsServer;
    use kvroute_router::nats::{EventsVia, NatsConfig};
    let dir = std::env::temp_dir().join(format!("kvroute-epp-nats-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = NatsServer::start(&dir, 0).await.unwrap();
    let nats = |name: &str| {
        let mut n = NatsConfig::new(server.url());
        n.replica = name.into();
        n.events = EventsVia::Zmq;
        n
    };
    let a = Stack::start(StackConfig {
        simulated: Simulated {
            count: 4,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        router: RouterConfig { nats: Some(nats("a")), ..RouterConfig::default() },
        ..StackConfig::default()
    })
    .await
    .unwrap();
    assert!(a.ready(Duration::from_secs(10)).await.is_empty());
    let b = Stack::start(StackConfig {
        router: RouterConfig {
            workers: a.workers.clone(),
            nats: Some(nats("b")),
            ..RouterConfig::default()
        },
        ..StackConfig::default()
    })
    .await
    .unwrap();
    assert!(b.ready(Duration::from_secs(10)).await.is_empty());
    let peers = |s: &Stack| {
        s.router.as_ref().unwrap().view().nats_links().unwrap().summary()["peers"].as_u64()
    };
    assert!(
        eventually(Duration::from_secs(10), || peers(&a) == Some(1) && peers(&b) == Some(1)).await
    );
    let mut urls = Vec::new();
    for stack in [&a, &b] {
        let picker = stack.picker(EppOptions::default(), None).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(format!("http://{}", listener.local_addr().unwrap()));
        tokio::spawn(kvroute_epp::serve(listener, picker, async {}, std::future::pending()));
    }
    let mut config = GatewayConfig::ext_proc("");
    config.picking = kvroute_test_gateway::Picking::ExtProc(urls);
    let gateway = Gateway::new(config).unwrap();
    let base = kvroute_stack::serve_on_loopback(gateway.app()).await.unwrap();
    let (mut repeats, mut hits) = (0, 0);
    for topic in 0..6 {
        let text = prompt(&format!("replicated {topic}"));
        let mut first_cached = None;
        for k in 0..4 {
            let (status, _, body) =
                post(&base, "/v1/chat/completions", &chat(&text, false), &[]).await;
            assert_eq!(status, 200);
            let body = json_of(&body);
            let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
            if k == 0 {
                first_cached = Some(cached(&body));
                continue;
            }
            repeats += 1;
            // The whole prompt but its last, partial block (and what the first found).
            if cached(&body) + 16 > prompt_tokens {
                hits += 1;
            }
        }
        // A new prompt: at most the chat template's first block was cached anywhere.
        assert!(first_cached.is_some_and(|c| c <= 16), "{first_cached:?}");
    }
    let routed = gateway.routed();
    for pair in routed.chunks(4) {
        let first = &pair[0].served;
        assert!(pair.iter().all(|r| &r.served == first), "{pair:?}");
    }
    assert_eq!((hits, repeats), (18, 18), "every repeat on its cached prefix");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pool with a prefill and a decode worker: the picker places a pair as the front door
/// does, the gateway is sent to the decode worker, and the prefill worker is named in
/// llm-d's `x-prefiller-host-port`; no fallback is listed (another decode worker would not
/// know the prefill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_prefill_decode_pool_the_decode_endpoint_is_picked_and_the_prefill_named() {
    let stack = Stack::start(StackConfig {
        simulated: Simulated {
            prefill: 1,
            decode: 1,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        // Always split (never in place), so the prefill is named.
        router: RouterConfig {
            scheduler: kvroute_core::schedule::SchedulerConfig {
                pairs: kvroute_core::schedule::PairConfig { in_place: 0.0, ..Default::default() },
                ..Default::default()
            },
            ..RouterConfig::default()
        },
        ..StackConfig::default()
    })
    .await
    .unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
    let picker = stack.picker(EppOptions::default(), None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(kvroute_epp::serve(listener, picker, async {}, std::future::pending()));
    let role = |r: kvroute_core::schedule::Role| {
        let w = stack.workers.iter().find(|w| w.role == r).unwrap();
        kvroute_epp::host_port(w.url.as_deref().unwrap()).unwrap()
    };
    let (prefill, decode) =
        (role(kvroute_core::schedule::Role::Prefill), role(kvroute_core::schedule::Role::Decode));
    let mut r = raw(&grpc).await;
    r.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    let body =
        serde_json::to_vec(&chat(&prompt("a long new prompt to prefill elsewhere"), true)).unwrap();
    r.tx.send(request_body(&body, true)).await.unwrap();
    let answer = r.rx.message().await.unwrap().unwrap();
    let dynamic = answer.dynamic_metadata.as_ref().unwrap();
    let destination =
        metadata::dynamic_string(dynamic, "envoy.lb", metadata::DESTINATION_KEY).unwrap();
    assert_eq!(destination, decode, "the decode endpoint alone, no fallback");
    let Some(processing_response::Response::RequestHeaders(h)) = answer.response else { panic!() };
    let set = h.response.unwrap().header_mutation.unwrap().set_headers;
    let named =
        set.iter().filter_map(|o| o.header.as_ref()).find(|h| h.key == metadata::PREFILLER_HEADER);
    assert_eq!(named.map(|h| String::from_utf8_lossy(&h.raw_value).into_owned()), Some(prefill));
}

/// The scores a pick returns with `endpoint_scores` (llm-d's `--emit-endpoint-scores`): every
/// worker in a struct of `ip:port` to score beside the destination in `envoy.lb`, the one
/// picked (the cheapest) scored 1 and the other below it, its cached prefix gone elsewhere;
/// without the option, no scores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_candidates_scores_ride_beside_the_destination_when_asked() {
    let scores_of = |answer: &ProcessingResponse| -> Option<Vec<(String, f64)>> {
        let dynamic = answer.dynamic_metadata.as_ref()?;
        let Some(envoy_types::pb::google::protobuf::value::Kind::StructValue(lb)) =
            &dynamic.fields.get("envoy.lb")?.kind
        else {
            return None;
        };
        let scores = match &lb.fields.get(metadata::SCORES_KEY)?.kind {
            Some(envoy_types::pb::google::protobuf::value::Kind::StructValue(s)) => s,
            other => panic!("{other:?}"),
        };
        let number = |v: &envoy_types::pb::google::protobuf::Value| match v.kind {
            Some(envoy_types::pb::google::protobuf::value::Kind::NumberValue(n)) => n,
            _ => panic!("{v:?}"),
        };
        let mut out: Vec<(String, f64)> =
            scores.fields.iter().map(|(k, v)| (k.clone(), number(v))).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Some(out)
    };
    for asked in [true, false] {
        let options = EppOptions { endpoint_scores: asked, ..EppOptions::default() };
        let pool = pool_with(2, RouterConfig::default(), options, true).await;
        let mut r = raw(&pool.grpc).await;
        let text = prompt("scores");
        // The first is held in flight on its worker (its answer never comes), so the two
        // workers differ for the second.
        picked(&mut r, &text).await;
        let mut r = raw(&pool.grpc).await;
        r.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
        let body = serde_json::to_vec(&chat(&text, true)).unwrap();
        r.tx.send(request_body(&body, true)).await.unwrap();
        let answer = r.rx.message().await.unwrap().unwrap();
        let scores = scores_of(&answer);
        if !asked {
            assert_eq!(scores, None, "no scores unless asked");
            continue;
        }
        let scores = scores.expect("scores beside the destination");
        let mut endpoints = pool.endpoints.clone();
        endpoints.sort();
        assert_eq!(scores.iter().map(|s| s.0.clone()).collect::<Vec<_>>(), endpoints);
        let dynamic = answer.dynamic_metadata.as_ref().unwrap();
        let destination =
            metadata::dynamic_string(dynamic, "envoy.lb", metadata::DESTINATION_KEY).unwrap();
        let chosen = destination.split(',').next().unwrap();
        for (endpoint, score) in &scores {
            match endpoint == chosen {
                true => assert!((score - 1.0).abs() < 1e-9, "the cheapest: {scores:?}"),
                false => assert!(*score <= 1.0 && *score > 0.0, "{scores:?}"),
            }
        }
    }
}

// ---- #64: the picker's port as hard as the front door ----

/// Status and body of a POST of raw bytes through the gateway.
async fn post_bytes(base: &str, path: &str, body: Vec<u8>, content_type: &str) -> (u16, Vec<u8>) {
    let request = hyper::Request::post(format!("{base}{path}"))
        .header("content-type", content_type)
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let status = response.status().as_u16();
    (status, response.into_body().collect().await.unwrap().to_bytes().to_vec())
}

/// Blocks the simulated engines hold for KV transfers.
fn held_blocks(stack: &Stack) -> u64 {
    stack.simulated.iter().map(|e| e.engine.snapshot().stats.held_blocks).sum()
}

/// Finding 1: a body on any path, not only the two the picker places, is refused when it
/// carries a field that steers a KV transfer (vLLM's generate API with `kv_transfer_params`,
/// SGLang's `/generate` with bootstrap fields, `vllm_xargs`, a UTF-16 body, a form), and no
/// prefill engine holds a block for it; a native body without them still goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_fields_are_refused_on_every_path_and_nothing_is_held() {
    let config = StackConfig {
        simulated: Simulated {
            prefill: 1,
            decode: 1,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        ..StackConfig::default()
    };
    let p = pool_of(config, EppOptions::default(), Served::default(), true).await;
    let (_gateway, base) = p.gateway(|_| {}).await;
    let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = trap.local_addr().unwrap().port();
    let tokens: Vec<u32> = (1..=300).collect();
    let kv = json!({"do_remote_decode": true});
    let cases = [
        (
            "/inference/v1/generate",
            json!({"token_ids": tokens, "sampling_params": {"max_tokens": 2}, "kv_transfer_params": kv}),
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": tokens, "sampling_params": {"max_tokens": 2}, "ec_transfer_params": kv}),
        ),
        (
            "/generate",
            json!({"input_ids": tokens, "sampling_params": {"max_new_tokens": 2},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 7}),
        ),
        ("/v1/responses", json!({"input": "hi", "vllm_xargs": {"kv_transfer_params": kv}})),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2, "kv_transfer_params": kv})),
    ];
    for (path, body) in &cases {
        let (status, _, text) = post(&base, path, body, &[]).await;
        assert_eq!(status, 400, "{path} {body}: {}", String::from_utf8_lossy(&text));
        assert!(
            json_of(&text)["error"]["message"].as_str().unwrap().contains("transfer_params")
                || json_of(&text)["error"]["message"].as_str().unwrap().contains("bootstrap")
        );
    }
    let utf16: Vec<u8> = serde_json::to_string(&cases[0].1)
        .unwrap()
        .encode_utf16()
        .flat_map(u16::to_be_bytes)
        .collect();
    assert_eq!(post_bytes(&base, "/inference/v1/generate", utf16, "application/json").await.0, 400);
    let form = "--b\r\nContent-Disposition: form-data; name=\"vllm_xargs\"\r\n\r\n\
                {\"kv_transfer_params\": {\"do_remote_decode\": true}}\r\n--b--\r\n";
    let multipart = "multipart/form-data; boundary=b";
    let refused = post_bytes(&base, "/v1/audio/transcriptions", form.into(), multipart).await;
    assert_eq!(refused.0, 400);
    // Without them a native body goes on: placed by its ids, or (a prompt as text) in turn.
    let plain = json!({"token_ids": tokens, "sampling_params": {"max_tokens": 2}});
    let (status, _, text) = post(&base, "/inference/v1/generate", &plain, &[]).await;
    assert_ne!(status, 400, "{}", String::from_utf8_lossy(&text));
    let text_prompt = json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}});
    let (status, _, text) = post(&base, "/generate", &text_prompt, &[]).await;
    assert_ne!(status, 400, "{}", String::from_utf8_lossy(&text));
    assert!(p.metrics().await.contains("kvroute_epp_unplaced_requests_total 1"));
    assert_eq!(held_blocks(&p.stack), 0, "no prefill engine holds a block for a client");
    let called = tokio::time::timeout(Duration::from_millis(300), trap.accept()).await;
    assert!(called.is_err(), "an engine called the address a client named");
}

/// A stream that sends a chat request, reads its pick and then never sends the response's
/// headers (a gateway whose upstream hangs): kept open until dropped.
async fn quiet_stream(grpc: String, n: usize) -> Raw {
    let mut r = raw(&grpc).await;
    let _ = picked(&mut r, &prompt(&format!("quiet {n}"))).await;
    r
}

/// Two simulated workers of 8 sequences each (10x speed) under `router` with flow control on.
fn two_by_eight_with_flow_control(mut router: RouterConfig) -> StackConfig {
    router.scheduler.flow = FlowConfig { enabled: true, ..FlowConfig::default() };
    StackConfig {
        simulated: Simulated {
            count: 2,
            engine: EngineConfig {
                timing: Timing { speedup: 10.0 },
                max_num_seqs: 8,
                ..EngineConfig::default()
            },
            tokenless: true,
            ..Simulated::default()
        },
        router,
        ..StackConfig::default()
    }
}

/// Finding 2: 60 quiet streams on a fleet with flow control (2 workers of 8 sequences)
/// hold their placements only until the first-byte timeout: honest requests through the
/// front door and through the picker beside them are answered within their normal time
/// plus the deadline, and nothing is in flight once the deadlines have passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_streams_are_freed_at_the_deadline_and_honest_requests_pass() {
    let deadline = Duration::from_secs(1);
    let config = StackConfig {
        front_door: kvroute_frontend::FrontDoorOptions {
            first_byte_timeout: deadline,
            ..Default::default()
        },
        ..two_by_eight_with_flow_control(RouterConfig::default())
    };
    let p = pool_of(config, EppOptions::default(), Served::default(), true).await;
    let (_gateway, base) = p.gateway(|_| {}).await;
    let door = p.stack.serve_frontend_on_loopback().await.unwrap();
    let quiet: Vec<_> = (0..60).map(|n| tokio::spawn(quiet_stream(p.grpc.clone(), n))).collect();
    // Honest requests beside them, one after another, both ways in.
    for i in 0..6 {
        let started = std::time::Instant::now();
        let entry = if i % 2 == 0 { &base } else { &door };
        let honest = chat(&prompt(&format!("honest {i}")), false);
        let tenant = [("x-kvroute-tenant", "honest")];
        let (status, _, body) = post(entry, "/v1/chat/completions", &honest, &tenant).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let took = started.elapsed();
        assert!(took < deadline + Duration::from_secs(8), "honest request {i} took {took:?}");
    }
    // Every quiet stream was picked (none waited past flow control's queue) and is freed.
    let mut streams = Vec::new();
    for q in quiet {
        streams.push(q.await.unwrap());
    }
    assert!(
        eventually(Duration::from_secs(10), || p.in_flight() == 0).await,
        "in flight after the deadline: {}",
        p.in_flight()
    );
    let response = kvroute_epp::metrics::Stage::Response;
    assert_eq!(p.picker.metrics.deadlines(response), 60, "each quiet stream's placement freed");
    // Each quiet stream was ended with DEADLINE_EXCEEDED.
    for mut r in streams.drain(..3) {
        let status = loop {
            match r.rx.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("ended without a status"),
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    }
}

/// #77 finding 5: 60 quiet streams of non-streamed chats (whose deadline is the response's,
/// 600 s) on a fleet with flow control (2 workers of 8 sequences). The engines' load reports
/// never show them, so once the reconcile window passes kvroute gives their capacity back,
/// oldest first, counted: honest requests beside them, through the gateway and the front
/// door, are answered within the window plus their normal time, and kvroute's in-flight count
/// comes back to what the engines report (nothing) while the quiet streams are still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_the_engines_never_saw_are_given_back_within_the_window() {
    let window = Duration::from_secs(2);
    let mut router = RouterConfig::default();
    router.scheduler.reconcile_after = window;
    let config = two_by_eight_with_flow_control(router);
    let p = pool_of(config, EppOptions::default(), Served::default(), true).await;
    let (_gateway, base) = p.gateway(|_| {}).await;
    let door = p.stack.serve_frontend_on_loopback().await.unwrap();
    let quiet: Vec<_> = (0..60)
        .map(|n| {
            let grpc = p.grpc.clone();
            tokio::spawn(async move {
                let mut r = raw(&grpc).await;
                let placed = picked_as(&mut r, &prompt(&format!("quiet {n}")), false).await;
                (r, placed.is_some())
            })
        })
        .collect();
    for i in 0..4 {
        let started = std::time::Instant::now();
        let entry = if i % 2 == 0 { &base } else { &door };
        let honest = chat(&prompt(&format!("honest {i}")), false);
        let tenant = [("x-kvroute-tenant", "honest")];
        let (status, _, body) = post(entry, "/v1/chat/completions", &honest, &tenant).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let took = started.elapsed();
        eprintln!("honest request {i} beside the quiet streams: {took:?}");
        assert!(took < window + Duration::from_secs(8), "honest request {i} took {took:?}");
    }
    // The quiet streams stay open (600 s from their deadline); those flow control could not
    // place within its queue's wait were refused.
    let mut streams = Vec::new();
    let mut placed = 0;
    for q in quiet {
        let (stream, was_placed) = q.await.unwrap();
        placed += usize::from(was_placed);
        streams.push(stream);
    }
    eprintln!("quiet streams placed: {placed} of 60");
    assert!(placed >= 16, "at least the fleet's capacity was taken by quiet streams: {placed}");
    let router = Arc::clone(p.stack.router.as_ref().unwrap());
    assert!(
        eventually(Duration::from_secs(10), || router.view().in_flight() == 0).await,
        "kvroute's in-flight count comes back to the engines' word: {}",
        router.view().in_flight()
    );
    let metrics = router.view().render_metrics();
    assert!(
        metrics.contains(&format!("kvroute_router_reconciled_requests_total {placed}")),
        "each of the {placed} quiet placements freed once: {}",
        metrics.lines().filter(|l| l.contains("reconciled")).collect::<Vec<_>>().join("\n")
    );
    let response = kvroute_epp::metrics::Stage::Response;
    assert_eq!(p.picker.metrics.deadlines(response), 0, "none waited for its deadline");
    drop(streams);
}

/// Finding 2, the request side: a stream whose body never ends is answered 408 at the body
/// deadline and holds nothing after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_ends_is_a_408_at_the_body_deadline() {
    let options = EppOptions { body_timeout: Duration::from_millis(500), ..EppOptions::default() };
    let p = pool_with(1, RouterConfig::default(), options, true).await;
    let mut r = raw(&p.grpc).await;
    r.tx.send(request_headers("/v1/chat/completions")).await.unwrap();
    r.tx.send(request_body(&vec![b' '; 100 << 10], false)).await.unwrap();
    let m = r.rx.message().await.unwrap().unwrap();
    let Some(processing_response::Response::ImmediateResponse(i)) = m.response else {
        panic!("{m:?}")
    };
    assert_eq!(i.status.unwrap().code, 408);
    assert_eq!(p.picker.budget.held(), 0, "the body's bytes are given back");
    assert_eq!(p.picker.metrics.deadlines(kvroute_epp::metrics::Stage::Request), 1);
}

/// Finding 4: bodies held at once are bounded per client and in all: a client's streams past
/// its share get a 503 to retry, another client is still served, and everything is given
/// back when the streams go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_are_bounded_per_client_and_in_all() {
    let options = EppOptions {
        max_body_bytes_in_flight: 3 << 20,
        max_body_bytes_per_client: 1 << 20,
        ..EppOptions::default()
    };
    let p = pool_with(1, RouterConfig::default(), options, true).await;
    let from = |ip: &str| {
        let mut h = request_headers("/v1/chat/completions");
        let Some(processing_request::Request::RequestHeaders(headers)) = &mut h.request else {
            unreachable!()
        };
        // Envoy appends the address it saw last; earlier entries are the client's to forge.
        let xff = format!("6.6.6.6, {ip}");
        headers.headers.as_mut().unwrap().headers.push(header("x-forwarded-for", &xff));
        h
    };
    let chunk = vec![b' '; 600 << 10];
    // One client: the first stream takes 600 KiB of its 1 MiB, the second is refused.
    let first = raw(&p.grpc).await;
    first.tx.send(from("10.0.0.1")).await.unwrap();
    first.tx.send(request_body(&chunk, false)).await.unwrap();
    // Sent is not yet held: the second stream comes once the picker holds the first's bytes.
    let held = || p.picker.budget.held() >= chunk.len();
    assert!(eventually(Duration::from_secs(10), held).await, "the first body is held");
    let mut second = raw(&p.grpc).await;
    second.tx.send(from("10.0.0.1")).await.unwrap();
    second.tx.send(request_body(&chunk, false)).await.unwrap();
    let m = second.rx.message().await.unwrap().unwrap();
    let Some(processing_response::Response::ImmediateResponse(i)) = m.response else {
        panic!("{m:?}")
    };
    assert_eq!(i.status.unwrap().code, 503);
    // Others: two more clients fill the total, a third is refused.
    let mut others = Vec::new();
    for ip in ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"] {
        let r = raw(&p.grpc).await;
        r.tx.send(from(ip)).await.unwrap();
        r.tx.send(request_body(&chunk, false)).await.unwrap();
        others.push(r);
    }
    assert!(
        eventually(Duration::from_secs(5), || p.picker.budget.held() == 5 * chunk.len()).await,
        "held {}",
        p.picker.budget.held()
    );
    assert!(p.picker.budget.held() <= 3 << 20, "within the total");
    // An honest client with a small body is still served.
    let (_gateway, base) = p.gateway(|_| {}).await;
    let (status, _, _) = post(&base, "/v1/chat/completions", &chat("small", false), &[]).await;
    assert_eq!(status, 200);
    drop((first, second, others));
    assert!(eventually(Duration::from_secs(5), || p.picker.budget.held() == 0).await);
}

/// Finding 3: with API keys the picker authenticates the client's key the gateway
/// forwards, takes the tenant from it (a tenant header is ignored), lowers a priority above
/// the key's ceiling, and shows tenants only as keyed ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_authenticates_keys_and_caps_their_priority() {
    let keys = kvroute_http::Credentials::new(
        ["sk-tenant-a-0123456789 max-priority=0", "sk-tenant-b-0123456789"],
        "test",
    )
    .unwrap();
    let mut router = RouterConfig::default();
    router.scheduler.flow = FlowConfig { enabled: true, ..FlowConfig::default() };
    let config = StackConfig {
        simulated: Simulated {
            count: 2,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        router,
        access: kvroute_stack::Access {
            api_keys: keys,
            admin: kvroute_http::Credentials::new(["admin-token-0123"], "test").unwrap(),
            ..Default::default()
        },
        ..StackConfig::default()
    };
    let p = pool_of(config, EppOptions::default(), Served::default(), true).await;
    let (_gateway, base) = p.gateway(|_| {}).await;
    let body = chat("who am I", false);
    let (status, _, text) = post(&base, "/v1/chat/completions", &body, &[]).await;
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&text));
    let wrong = [("authorization", "Bearer sk-nobody-0123456789")];
    assert_eq!(post(&base, "/v1/chat/completions", &body, &wrong).await.0, 401);
    let a = [
        ("authorization", "Bearer sk-tenant-a-0123456789"),
        ("x-kvroute-priority", "100"),
        ("x-kvroute-tenant", "someone-else"),
    ];
    let (status, _, text) = post(&base, "/v1/chat/completions", &body, &a).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&text));
    // The front door's /metrics needs the admin token while keys are on.
    let door = p.stack.serve_frontend_on_loopback().await.unwrap();
    assert_eq!(HttpClient::new().get(&format!("{door}/metrics")).await.unwrap().0, 401);
    let request = hyper::Request::get(format!("{door}/metrics"))
        .header("authorization", "Bearer admin-token-0123")
        .body(http_body_util::Full::new(hyper::body::Bytes::new()))
        .unwrap();
    let response = HttpClient::new().send(request).await.unwrap();
    let metrics = response.into_body().collect().await.unwrap().to_bytes();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvroute_frontend_priority_clamped_total 1"), "lowered to 0");
    let unkeyed = blake3::hash(b"sk-tenant-a-0123456789").to_hex();
    assert!(!metrics.contains(&unkeyed[..16]), "no prefix of the key's hash is shown");
    assert!(!metrics.contains("someone-else"), "the tenant header is not the tenant");
}

/// Finding 3, the port: over TLS with a gateway token, a gateway without the token is
/// refused, one with it is served; a plain-text client gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_port_serves_tls_and_asks_for_the_gateways_token() {
    let (tls, pem) = kvroute_http::tls::self_signed(&[], &[b"h2"]).unwrap();
    let config = StackConfig {
        simulated: Simulated {
            count: 1,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        ..StackConfig::default()
    };
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health_url = format!("http://{}", plain.local_addr().unwrap());
    let served = Served { token: Some("gateway-token-0123"), tls: Some(tls), health: Some(plain) };
    let p = pool_of(config, EppOptions::default(), served, true).await;
    // Health in plain text beside the TLS port, for the kubelet's probes.
    assert_eq!(health(&health_url, "readiness").await, ServingStatus::Serving);
    let grpc = p.grpc.replace("http://127.0.0.1", "https://localhost");
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject as _;
    roots.add(rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"h2".to_vec()];
    let client = Arc::new(client);
    let body = chat("over tls", false);
    let with = |token: Option<&str>| {
        let (grpc, client, token) = (grpc.clone(), Arc::clone(&client), token.map(str::to_owned));
        move |c: &mut GatewayConfig| {
            c.picking = kvroute_test_gateway::Picking::ExtProc(vec![grpc]);
            c.tls = Some(client);
            c.token = token;
        }
    };
    let (_g, no_token) = p.gateway(with(None)).await;
    let (status, _, text) = post(&no_token, "/v1/chat/completions", &body, &[]).await;
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&text));
    assert!(String::from_utf8_lossy(&text).contains("token"));
    let (_g, wrong) = p.gateway(with(Some("gateway-token-9999"))).await;
    assert_eq!(post(&wrong, "/v1/chat/completions", &body, &[]).await.0, 500);
    let (_g, good) = p.gateway(with(Some("gateway-token-0123"))).await;
    let (status, _, text) = post(&good, "/v1/chat/completions", &body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&text));
    assert!(p.metrics().await.contains("kvroute_epp_unauthenticated_streams_total 2"));
    // Plain text on the TLS port: no gRPC answer.
    let plain = tonic::transport::Endpoint::from_shared(p.grpc.clone()).unwrap();
    let channel = tokio::time::timeout(Duration::from_secs(5), plain.connect()).await;
    if let Ok(Ok(channel)) = channel {
        let health = HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await;
        assert!(health.is_err(), "a plain-text client got an answer");
    }
}

/// The engines' native token bodies through the picker are placed by their token ids: a
/// vLLM generate body and a SGLang `/generate` body with `input_ids` that share a long
/// prefix with an earlier one go where it went, and find it cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_token_bodies_are_placed_by_their_ids() {
    let p = pool(4).await;
    let (gateway, base) = p.gateway(|_| {}).await;
    for (k, path) in ["/inference/v1/generate", "/generate"].into_iter().enumerate() {
        let prefix: Vec<u32> = (0..600).map(|t| 1 + (t * 7 + 301 * k as u32) % 900).collect();
        let mut longer = prefix.clone();
        longer.extend(50..90);
        let body = |ids: &[u32]| match path {
            "/generate" => json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}),
            _ => json!({"token_ids": ids, "sampling_params": {"max_tokens": 2}}),
        };
        let (status, _, text) = post(&base, path, &body(&prefix), &[]).await;
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&text));
        let first = gateway.routed().last().unwrap().served.clone();
        for _ in 0..3 {
            let (status, _, _) = post(&base, path, &body(&longer), &[]).await;
            assert_eq!(status, 200);
            assert_eq!(gateway.routed().last().unwrap().served, first, "{path}: with its prefix");
        }
    }
    let metrics = p.metrics().await;
    assert!(metrics.contains("kvroute_epp_unplaced_requests_total 0"), "every one placed");
    assert!(eventually(Duration::from_secs(5), || p.in_flight() == 0).await);
}

const ROTATION_ADMIN: &str = "rotation-test-admin";

/// The workers the front door's router considered for a request (its explained decision).
async fn front_door_candidates(base: &str, topic: &str) -> std::collections::BTreeSet<u64> {
    let explain = [("x-kvroute-explain", "true"), ("x-kvroute-admin-token", ROTATION_ADMIN)];
    let (status, headers, body) =
        post(base, "/v1/chat/completions", &chat(&prompt(topic), false), &explain).await;
    assert_eq!(status, 200, "{}", json_of(&body));
    let decision: Value = serde_json::from_slice(headers["x-kvroute-decision"].as_bytes()).unwrap();
    let candidates = decision["candidates"].as_array().unwrap();
    candidates.iter().map(|c| c["worker"]["worker_id"].as_u64().unwrap()).collect()
}

/// The workers the picker offers the gateway for a request: the one picked and its fallbacks.
async fn picker_offers(p: &Pool, subset: Option<Vec<String>>, topic: &str) -> Vec<u64> {
    let (gateway, base) = p.gateway(|c| c.subset = subset).await;
    let (status, _, body) =
        post(&base, "/v1/chat/completions", &chat(&prompt(topic), false), &[]).await;
    assert_eq!(status, 200, "{topic}: {} {:?}", json_of(&body), gateway.routed());
    let header = gateway.routed()[0].header.clone().unwrap();
    let ids = p.stack.frontend.as_ref().unwrap().worker_urls();
    let id = |endpoint: &str| {
        let at = p.endpoints.iter().position(|e| e == endpoint).unwrap();
        ids[at].0.0
    };
    let mut offered: Vec<u64> = header.split(',').map(id).collect();
    offered.sort_unstable();
    offered
}

/// The front door and the picker take the same workers out of rotation for the same fleet
/// state, by one rule: an ejected worker (here one whose port refuses connections, ejected by
/// the health checks), a draining one (held by a request the picker placed there); the
/// picker's subset hint on top; and when every worker left is ejected, those are tried all
/// the same rather than none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_door_and_the_picker_take_the_same_workers_out_of_rotation() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let mut dead = kvroute_router::WorkerSpec::new(100);
    dead.url = Some(format!("http://{closed}"));
    let admin = kvroute_http::Credentials::new([ROTATION_ADMIN], "test").unwrap();
    let config = StackConfig {
        simulated: Simulated {
            count: 3,
            engine: EngineConfig { timing: Timing { speedup: 10.0 }, ..EngineConfig::default() },
            tokenless: true,
            ..Simulated::default()
        },
        router: RouterConfig { workers: vec![dead], ..RouterConfig::default() },
        access: kvroute_stack::Access { admin, ..Default::default() },
        front_door: kvroute_frontend::FrontDoorOptions {
            explain_decisions: true,
            ..Default::default()
        },
        ..StackConfig::default()
    };
    let p = pool_of(config, EppOptions::default(), Served::default(), true).await;
    let front = p.stack.frontend.as_ref().unwrap();
    let base = p.stack.serve_frontend_on_loopback().await.unwrap();
    let all: Vec<u64> = front.worker_urls().iter().map(|(w, _)| w.0).collect();
    let live: Vec<u64> = all.iter().copied().filter(|&w| w != 100).collect();
    assert_eq!(live.len(), 3);
    let ejected = || !front.in_rotation(None).contains(&kvroute_core::WorkerId(100));
    assert!(eventually(Duration::from_secs(10), ejected).await, "the dead worker ejected");

    // Ejected: out for both.
    let considered: Vec<u64> = front_door_candidates(&base, "ejected").await.into_iter().collect();
    assert_eq!(considered, live, "the front door's router considered");
    assert_eq!(picker_offers(&p, None, "ejected").await, live, "the picker offered");
    // A subset: the picker keeps to it, the ejected still out; a subset of only ejected
    // workers has them tried.
    let endpoint = |id: u64| p.endpoints[all.iter().position(|&w| w == id).unwrap()].clone();
    let subset = Some(vec![endpoint(live[0]), endpoint(100)]);
    assert_eq!(picker_offers(&p, subset, "subset").await, [live[0]]);
    let (gateway, gateway_base) = p.gateway(|c| c.subset = Some(vec![endpoint(100)])).await;
    let (status, _, _) =
        post(&gateway_base, "/v1/chat/completions", &chat("only the dead", false), &[]).await;
    assert_eq!(status, 503, "the gateway could not reach the one it was offered");
    let offered = gateway.routed().first().and_then(|r| r.header.clone());
    assert_eq!(offered, Some(endpoint(100)), "the ejected tried when no other is left");

    // Draining: a request the picker placed holds it while it drains; out for both.
    let mut holding = raw(&p.grpc).await;
    let destination = picked(&mut holding, &prompt("held")).await;
    let at = p.endpoints.iter().position(|e| *e == destination.split(',').next().unwrap());
    let draining = all[at.unwrap()];
    let client = HttpClient::new().with_bearer_for(&base, ROTATION_ADMIN);
    let drain = format!("{base}/workers/{draining}/drain");
    let response = client.call(hyper::Method::POST, &drain, None::<&Value>).await.unwrap();
    assert_eq!(response.status(), 202);
    let out = || !front.in_rotation(None).contains(&kvroute_core::WorkerId(draining));
    assert!(eventually(Duration::from_secs(5), out).await, "the front door sees it draining");
    let rest: Vec<u64> = live.iter().copied().filter(|&w| w != draining).collect();
    let considered: Vec<u64> = front_door_candidates(&base, "drained").await.into_iter().collect();
    assert_eq!(considered, rest, "the front door's router considered");
    assert_eq!(picker_offers(&p, None, "drained").await, rest, "the picker offered");
    drop(holding);
    assert!(eventually(Duration::from_secs(5), || p.in_flight() == 0).await);
}

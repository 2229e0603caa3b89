//! A small gateway that plays Envoy's side of the Endpoint Picker protocol, for the tests and
//! the bench (no Envoy binary can be installed here). Per HTTP request, as Envoy's ext_proc
//! filter does with the Gateway API Inference Extension's configuration:
//!
//! - opens one ext_proc stream; sends the request headers (`:method`, `:path`,
//!   `:authority`, the client's headers) with the processing modes and, when configured, the
//!   subset hint in filter metadata `envoy.lb.subset_hint`;
//! - sends the request body in chunks (full duplex; at most `chunk_bytes` each, the last
//!   one ending the stream), or whole (buffered); applies the header and body mutations answered, or answers the client
//!   with an `ImmediateResponse` as given;
//! - reads the destination from dynamic metadata `envoy.lb` (as Envoy's original-destination
//!   cluster does), tries its endpoints in order until one accepts a connection, and
//!   forwards the request there;
//! - sends the response headers with the endpoint that served in `envoy.lb`, each response
//!   body chunk as it comes (and an empty last one), the response trailers when there are
//!   any, and passes on what the picker answers;
//! - drops the stream when the client goes away (Envoy resets it).
//!
//! Not reproduced: Envoy's timeouts and retries, its `failure_mode_allow` (a broken picker
//! is a 500 here, Envoy's default), HTTP/2 downstream, and the other filters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::Struct;
use http_body_util::{BodyExt, Full};
use kvroute_http::HttpClient;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use kvroute_epp::metadata::{self, DESTINATION_KEY, DESTINATION_NAMESPACE, SERVED_KEY};

/// Why the gateway could not start (a picker address), or carry a request through the picker
/// (answered as a 500, Envoy's default for a broken external processor).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// The picker's stream broke or answered what the protocol does not allow.
    #[error("{0}")]
    Protocol(&'static str),
    #[error("the picker failed the stream: {0}")]
    StreamFailed(tonic::Status),
    #[error("the picker refused the stream: {0}")]
    Refused(tonic::Status),
    #[error("the picker answered {what} with {answer}")]
    Unexpected { what: &'static str, answer: String },
    #[error("reading the client's body: {0}")]
    ClientBody(#[source] axum::Error),
    #[error("upstream {endpoint}: {source}")]
    Upstream { endpoint: String, source: kvroute_http::ClientError },
    /// A picker URL the gateway cannot connect to.
    #[error("picker address: {0}")]
    Address(#[from] tonic::transport::Error),
}

impl From<&'static str> for GatewayError {
    fn from(why: &'static str) -> Self {
        Self::Protocol(why)
    }
}

/// How the gateway picks an endpoint.
#[derive(Clone, Debug)]
pub enum Picking {
    /// Ask the picker at this gRPC URL (`http://127.0.0.1:9002`); several (the pods of the
    /// picker's Service): each request's stream goes to the next in turn.
    ExtProc(Vec<String>),
    /// Each endpoint in turn, no picker (the baseline a pool without one gets).
    RoundRobin(Vec<String>),
}

/// The gateway's configuration, as Envoy's ext_proc filter and the pool configure it.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub picking: Picking,
    /// `FULL_DUPLEX_STREAMED` (what the protocol asks) or `BUFFERED`.
    pub request_mode: BodySendMode,
    pub response_mode: BodySendMode,
    /// The subset hint sent with every request (absent: none).
    pub subset: Option<Vec<String>>,
    /// Largest request body chunk sent to the picker (Envoy sends chunks as they come).
    pub chunk_bytes: usize,
    /// The token sent in each stream's gRPC metadata (`authorization: Bearer`), as Envoy's
    /// `grpc_service.initial_metadata` sends it.
    pub token: Option<String>,
    /// Speak TLS to the picker with this client configuration (its ALPN should offer `h2`).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl GatewayConfig {
    pub fn ext_proc(url: impl Into<String>) -> Self {
        Self {
            picking: Picking::ExtProc(vec![url.into()]),
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            subset: None,
            chunk_bytes: 16 << 10,
            token: None,
            tls: None,
        }
    }
}

/// What the picker answered for one request, as the gateway saw it (for the tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routed {
    /// The `x-gateway-destination-endpoint` header the picker set.
    pub header: Option<String>,
    /// `envoy.lb` / `x-gateway-destination-endpoint` in the dynamic metadata.
    pub metadata: Option<String>,
    /// The endpoint the request went to (none when no endpoint offered accepted a connection).
    pub served: Option<String>,
    /// Headers the picker set on the upstream request, by name.
    pub set: Vec<(String, String)>,
}

/// The gateway: one per listener.
#[derive(Debug)]
pub struct Gateway {
    config: GatewayConfig,
    ext_proc: Vec<ExternalProcessorClient<Channel>>,
    /// The picker the next stream goes to.
    next_picker: AtomicUsize,
    http: HttpClient,
    turn: AtomicUsize,
    /// The last requests' routing, newest last (at most [`ROUTED_KEPT`]).
    pub routed: std::sync::Mutex<std::collections::VecDeque<Routed>>,
}

/// Requests' routing kept for the tests.
pub const ROUTED_KEPT: usize = 4096;

/// Largest body the gateway reads or takes back.
const MAX_BODY: usize = 64 << 20;

impl Gateway {
    pub fn new(config: GatewayConfig) -> Result<Arc<Self>, GatewayError> {
        let urls = match &config.picking {
            Picking::ExtProc(urls) => urls.as_slice(),
            Picking::RoundRobin(_) => &[],
        };
        let mut ext_proc = Vec::new();
        for url in urls {
            let endpoint = tonic::transport::Endpoint::from_shared(url.clone())?.tcp_nodelay(true);
            let channel = match &config.tls {
                None => endpoint.connect_lazy(),
                Some(tls) => endpoint.connect_with_connector_lazy(tls_connector(Arc::clone(tls))),
            };
            let limit = 2 * MAX_BODY;
            ext_proc.push(
                ExternalProcessorClient::new(channel)
                    .max_decoding_message_size(limit)
                    .max_encoding_message_size(limit),
            );
        }
        Ok(Arc::new(Self {
            config,
            ext_proc,
            next_picker: AtomicUsize::new(0),
            http: HttpClient::new(),
            turn: AtomicUsize::new(0),
            routed: std::sync::Mutex::default(),
        }))
    }

    /// The gateway as an HTTP app: every route goes through the picker.
    pub fn app(self: &Arc<Self>) -> axum::Router {
        axum::Router::new().fallback(handle).with_state(Arc::clone(self))
    }

    /// The routing of the requests so far, oldest first.
    pub fn routed(&self) -> Vec<Routed> {
        self.routed.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }

    fn record(&self, routed: Routed) {
        let mut kept = self.routed.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == ROUTED_KEPT {
            kept.pop_front();
        }
        kept.push_back(routed);
    }
}

async fn handle(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let n = gateway.ext_proc.len();
    if n == 0 {
        return round_robin(&gateway, request).await;
    }
    let client = gateway.ext_proc[gateway.next_picker.fetch_add(1, Ordering::Relaxed) % n].clone();
    match through_picker(&gateway, client, request).await {
        Ok(response) => response,
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The baseline: the next endpoint in turn, the request as it came.
async fn round_robin(gateway: &Gateway, request: Request) -> Response {
    let Picking::RoundRobin(endpoints) = &gateway.config.picking else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let Some(endpoint) =
        endpoints.get(gateway.turn.fetch_add(1, Ordering::Relaxed) % endpoints.len().max(1))
    else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no endpoint").into_response();
    };
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let upstream = upstream_request(&parts.method, endpoint, path, &parts.headers, body);
    match gateway.http.send(upstream).await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            Response::from_parts(parts, Body::new(body))
        }
        Err(_) => StatusCode::BAD_GATEWAY.into_response(),
    }
}

/// One ext_proc stream's two ends, as the gateway holds them.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn send(
        &self,
        request: processing_request::Request,
        metadata: Option<Metadata>,
    ) -> Result<(), GatewayError> {
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            ..ProcessingRequest::default()
        };
        self.tx
            .send(message)
            .await
            .map_err(|_| GatewayError::Protocol("the picker closed the stream"))
    }

    async fn next(&mut self) -> Result<processing_response::Response, GatewayError> {
        match self.rx.message().await {
            Ok(Some(ProcessingResponse { response: Some(r), .. })) => Ok(r),
            Ok(Some(_)) => Err("the picker answered an empty message".into()),
            Ok(None) => Err("the picker ended the stream".into()),
            Err(status) => Err(GatewayError::StreamFailed(status)),
        }
    }

    /// The next message with its dynamic metadata.
    async fn next_full(&mut self) -> Result<ProcessingResponse, GatewayError> {
        match self.rx.message().await {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err("the picker ended the stream".into()),
            Err(status) => Err(GatewayError::StreamFailed(status)),
        }
    }
}

/// The request as the picker leaves it: headers, body and destination.
struct Outgoing {
    headers: HeaderMap,
    body: Vec<u8>,
    routed: Routed,
}

async fn through_picker(
    gateway: &Arc<Gateway>,
    client: ExternalProcessorClient<Channel>,
    request: Request,
) -> Result<Response, GatewayError> {
    let (parts, mut body) = request.into_parts();
    let has_body = !hyper::body::Body::is_end_stream(&body);
    let mut stream = open(client, &gateway.config, &parts, has_body).await?;
    // The client's body, whole (sent to the picker in chunks below).
    let mut whole = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(GatewayError::ClientBody)?.into_data() else { continue };
        whole.extend_from_slice(&data);
        if whole.len() > MAX_BODY {
            return Ok(StatusCode::PAYLOAD_TOO_LARGE.into_response());
        }
    }
    let out =
        Outgoing { headers: parts.headers.clone(), body: Vec::new(), routed: Routed::default() };
    let mut out = match decide(&mut stream, &gateway.config, out, whole, has_body).await? {
        Decided::Answered(response) => return Ok(response),
        Decided::Routed(out) => out,
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Some((served, response)) = forward(gateway, &parts.method, path, &mut out).await? else {
        // Routed all the same: what the picker offered is recorded, nothing served.
        gateway.record(out.routed);
        let refused = "no destination endpoint accepted a connection";
        return Ok((StatusCode::SERVICE_UNAVAILABLE, refused).into_response());
    };
    out.routed.served = Some(served.clone());
    gateway.record(out.routed);
    respond(stream, &served, response, gateway.config.response_mode).await
}

/// Opens the stream with the request's headers, the processing modes and the subset hint.
async fn open(
    mut client: ExternalProcessorClient<Channel>,
    config: &GatewayConfig,
    parts: &axum::http::request::Parts,
    has_body: bool,
) -> Result<Stream, GatewayError> {
    let (tx, requests) = mpsc::channel::<ProcessingRequest>(16);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(requests);
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut headers = vec![
        envoy_header(":method", parts.method.as_str()),
        envoy_header(":path", path),
        envoy_header(":scheme", "http"),
    ];
    for (name, value) in &parts.headers {
        let key = if name == axum::http::header::HOST { ":authority" } else { name.as_str() };
        headers.push(EnvoyHeader {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        });
    }
    let subset = config.subset.as_ref().map(|s| {
        let hint = metadata::list(s.iter().map(String::as_str));
        let hint = Struct { fields: [(metadata::SUBSET_KEY.to_owned(), hint)].into() };
        Metadata {
            filter_metadata: [(metadata::SUBSET_NAMESPACE.to_owned(), hint)].into(),
            ..Metadata::default()
        }
    });
    let first = ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(EnvoyHeaders { headers }),
            end_of_stream: !has_body,
            ..HttpHeaders::default()
        })),
        metadata_context: subset,
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: config.request_mode as i32,
            response_body_mode: config.response_mode as i32,
            ..ProtocolConfiguration::default()
        }),
        ..ProcessingRequest::default()
    };
    tx.send(first).await.map_err(|_| "the picker stream closed")?;
    let mut request = tonic::Request::new(outbound);
    if let Some(token) = &config.token {
        let value = format!("Bearer {token}").parse().map_err(|_| "a token that is no header")?;
        request.metadata_mut().insert("authorization", value);
    }
    let rx = client.process(request).await.map_err(GatewayError::Refused)?.into_inner();
    Ok(Stream { tx, rx })
}

/// What the picker decided for a request.
enum Decided {
    /// An immediate response, for the client as it is.
    Answered(Response),
    /// The request as the picker left it, with its destination.
    Routed(Outgoing),
}

/// Sends the body as the mode says and applies the picker's answers to the request.
async fn decide(
    stream: &mut Stream,
    config: &GatewayConfig,
    mut out: Outgoing,
    whole: Vec<u8>,
    has_body: bool,
) -> Result<Decided, GatewayError> {
    // Answers until one completes what is asked (`until_body`: the body's last chunk).
    async fn take(
        stream: &mut Stream,
        out: &mut Outgoing,
        until_body: bool,
    ) -> Result<Option<Response>, GatewayError> {
        loop {
            let answer = stream.next_full().await?;
            if let Some(r) = immediate(&answer) {
                return Ok(Some(r));
            }
            if apply_mutations(out, &answer)? || !until_body {
                return Ok(None);
            }
        }
    }
    let answered = if !has_body {
        take(stream, &mut out, false).await?
    } else if config.request_mode == BodySendMode::FullDuplexStreamed {
        let chunks: Vec<&[u8]> = whole.chunks(config.chunk_bytes.max(1)).collect();
        let n = chunks.len();
        for (i, chunk) in chunks.into_iter().enumerate() {
            let b = body_chunk(chunk.to_vec(), i + 1 == n);
            // A picker that answered at the headers (an immediate response) has closed its
            // side: its answer is read below.
            if stream.send(processing_request::Request::RequestBody(b), None).await.is_err() {
                break;
            }
        }
        // The headers answered once the whole body came, then the body in chunks.
        match take(stream, &mut out, false).await? {
            Some(r) => Some(r),
            None => take(stream, &mut out, true).await?,
        }
    } else {
        match take(stream, &mut out, false).await? {
            Some(r) => Some(r),
            None => {
                out.body.clone_from(&whole);
                let b = body_chunk(whole, true);
                stream.send(processing_request::Request::RequestBody(b), None).await?;
                take(stream, &mut out, false).await?
            }
        }
    };
    Ok(match answered {
        Some(r) => Decided::Answered(r),
        None => Decided::Routed(out),
    })
}

/// Sends the request to the first endpoint of its destination that accepts a connection;
/// that endpoint and its response, or none.
async fn forward(
    gateway: &Gateway,
    method: &axum::http::Method,
    path: &str,
    out: &mut Outgoing,
) -> Result<Option<(String, hyper::Response<hyper::body::Incoming>)>, GatewayError> {
    let destination = out
        .routed
        .metadata
        .clone()
        .or_else(|| out.routed.header.clone())
        .ok_or("the picker named no destination")?;
    let body = Bytes::from(std::mem::take(&mut out.body));
    for endpoint in destination.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let request = upstream_request(method, endpoint, path, &out.headers, body.clone());
        match gateway.http.send(request).await {
            Ok(response) => return Ok(Some((endpoint.to_owned(), response))),
            Err(e) if e.is_connect() => continue,
            Err(source) => {
                return Err(GatewayError::Upstream { endpoint: endpoint.to_owned(), source });
            }
        }
    }
    Ok(None)
}

/// Passes the response's headers (with the endpoint that served) through the picker, then
/// its body, chunk by chunk, in a task of its own.
async fn respond(
    mut stream: Stream,
    served: &str,
    response: hyper::Response<hyper::body::Incoming>,
    mode: BodySendMode,
) -> Result<Response, GatewayError> {
    let (mut head, upstream_body) = response.into_parts();
    let mut headers = vec![envoy_header(":status", head.status.as_str())];
    for (name, value) in &head.headers {
        headers.push(EnvoyHeader {
            key: name.as_str().to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        });
    }
    let end = hyper::body::Body::is_end_stream(&upstream_body);
    let served = Metadata {
        filter_metadata: [(
            DESTINATION_NAMESPACE.to_owned(),
            Struct { fields: [(SERVED_KEY.to_owned(), metadata::string(served))].into() },
        )]
        .into(),
        ..Metadata::default()
    };
    let h = HttpHeaders {
        headers: Some(EnvoyHeaders { headers }),
        end_of_stream: end,
        ..HttpHeaders::default()
    };
    stream.send(processing_request::Request::ResponseHeaders(h), Some(served)).await?;
    match stream.next().await? {
        processing_response::Response::ResponseHeaders(r) => {
            apply_headers(&mut head.headers, r.response.as_ref());
        }
        other => {
            let answer = format!("{other:?}");
            return Err(GatewayError::Unexpected { what: "the response headers", answer });
        }
    }
    if end {
        return Ok(Response::from_parts(head, Body::empty()));
    }
    let (to_client, from_gateway) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(pump(stream, upstream_body, to_client, mode));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(from_gateway));
    Ok(Response::from_parts(head, body))
}

/// Passes the response body through the picker to the client, chunk by chunk; stops (and
/// drops the stream, as Envoy resets it) when the client goes away.
async fn pump(
    mut stream: Stream,
    mut upstream: hyper::body::Incoming,
    to_client: mpsc::Sender<Result<Bytes, std::io::Error>>,
    mode: BodySendMode,
) {
    let mut ended = false;
    let mut buffered = Vec::new();
    loop {
        let frame = tokio::select! {
            f = upstream.frame() => f,
            () = to_client.closed() => return,
        };
        let (request, last) = match frame {
            None if ended => return,
            None => (
                processing_request::Request::ResponseBody(body_chunk(
                    std::mem::take(&mut buffered),
                    true,
                )),
                true,
            ),
            Some(Err(e)) => {
                let _ = to_client.send(Err(std::io::Error::other(e))).await;
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if mode == BodySendMode::Buffered => {
                    buffered.extend_from_slice(&data);
                    continue;
                }
                Ok(data) => (
                    processing_request::Request::ResponseBody(body_chunk(data.to_vec(), false)),
                    false,
                ),
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => {
                        let headers = trailers
                            .iter()
                            .map(|(k, v)| EnvoyHeader {
                                key: k.as_str().to_owned(),
                                value: String::new(),
                                raw_value: v.as_bytes().to_vec(),
                            })
                            .collect();
                        ended = true;
                        (
                            processing_request::Request::ResponseTrailers(HttpTrailers {
                                trailers: Some(EnvoyHeaders { headers }),
                            }),
                            true,
                        )
                    }
                    Err(_) => continue,
                },
            },
        };
        if stream.send(request, None).await.is_err() {
            return;
        }
        let Ok(answer) = stream.next().await else {
            let _ = to_client.send(Err(std::io::Error::other("the picker broke the stream"))).await;
            return;
        };
        if let processing_response::Response::ResponseBody(r) = answer {
            let passed = match r.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation) {
                Some(body_mutation::Mutation::StreamedResponse(s)) => Bytes::from(s.body),
                Some(body_mutation::Mutation::Body(b)) => Bytes::from(b),
                _ => Bytes::new(),
            };
            if !passed.is_empty() && to_client.send(Ok(passed)).await.is_err() {
                return;
            }
        }
        if last {
            return;
        }
    }
}

/// An `ImmediateResponse` as the client gets it.
fn immediate(answer: &ProcessingResponse) -> Option<Response> {
    let Some(processing_response::Response::ImmediateResponse(i)) = &answer.response else {
        return None;
    };
    let status = i
        .status
        .as_ref()
        .and_then(|s| u16::try_from(s.code).ok())
        .and_then(|c| StatusCode::from_u16(c).ok());
    let mut response = Response::new(Body::from(i.body.clone()));
    *response.status_mut() = status.unwrap_or(StatusCode::OK);
    let common = CommonResponse { header_mutation: i.headers.clone(), ..CommonResponse::default() };
    apply_headers(response.headers_mut(), Some(&common));
    Some(response)
}

/// Applies one answer to the request; true when the request body is complete.
fn apply_mutations(out: &mut Outgoing, answer: &ProcessingResponse) -> Result<bool, GatewayError> {
    if let Some(dynamic) = &answer.dynamic_metadata
        && let Some(d) = metadata::dynamic_string(dynamic, DESTINATION_NAMESPACE, DESTINATION_KEY)
    {
        out.routed.metadata = Some(d.to_owned());
    }
    let common = match &answer.response {
        Some(processing_response::Response::RequestHeaders(h)) => h.response.as_ref(),
        Some(processing_response::Response::RequestBody(b)) => b.response.as_ref(),
        Some(processing_response::Response::RequestTrailers(_)) => return Ok(false),
        other => {
            let answer = format!("{other:?}");
            return Err(GatewayError::Unexpected { what: "out of order", answer });
        }
    };
    apply_headers(&mut out.headers, common);
    if let Some(m) = common.and_then(|c| c.header_mutation.as_ref()) {
        for h in m.set_headers.iter().filter_map(|o| o.header.as_ref()) {
            let value = String::from_utf8_lossy(metadata::header_value(h)).into_owned();
            if h.key == DESTINATION_KEY {
                out.routed.header = Some(value.clone());
            }
            out.routed.set.push((h.key.clone(), value));
        }
    }
    match common.and_then(|c| c.body_mutation.as_ref()).and_then(|m| m.mutation.as_ref()) {
        Some(body_mutation::Mutation::StreamedResponse(s)) => {
            out.body.extend_from_slice(&s.body);
            Ok(s.end_of_stream)
        }
        Some(body_mutation::Mutation::Body(b)) => {
            out.body = b.clone();
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Applies a header mutation (`:`-pseudo-headers left out).
fn apply_headers(headers: &mut HeaderMap, common: Option<&CommonResponse>) {
    let Some(m) = common.and_then(|c| c.header_mutation.as_ref()) else { return };
    for name in &m.remove_headers {
        headers.remove(name.as_str());
    }
    for h in m.set_headers.iter().filter_map(|o| o.header.as_ref()) {
        if h.key.starts_with(':') {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(h.key.as_str()),
            HeaderValue::from_bytes(metadata::header_value(h)),
        ) {
            headers.insert(name, value);
        }
    }
}

/// Connects to the picker over TLS: TCP, then a handshake naming the URL's host (an address
/// is named as one).
fn tls_connector(
    config: Arc<rustls::ClientConfig>,
) -> impl tower::Service<
    axum::http::Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send {
    tower::service_fn(move |uri: axum::http::Uri| {
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&config));
        async move {
            let host = uri.host().unwrap_or("localhost").trim_matches(['[', ']']).to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let name = rustls::pki_types::ServerName::try_from(host)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            let tls = connector.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        }
    })
}

fn envoy_header(key: &str, value: &str) -> EnvoyHeader {
    EnvoyHeader { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }
}

fn upstream_request(
    method: &axum::http::Method,
    endpoint: &str,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> hyper::Request<Full<Bytes>> {
    let mut request = hyper::Request::new(Full::new(body));
    *request.method_mut() = method.clone();
    *request.uri_mut() = format!("http://{endpoint}{path}").parse().unwrap_or_default();
    for (name, value) in headers {
        if name != axum::http::header::HOST && name != axum::http::header::TRANSFER_ENCODING {
            request.headers_mut().append(name.clone(), value.clone());
        }
    }
    request
}

fn body_chunk(body: Vec<u8>, end_of_stream: bool) -> HttpBody {
    HttpBody { body, end_of_stream, ..HttpBody::default() }
}

//! One request's ext_proc stream, as Envoy's filter sends it, message by message: request
//! headers, body (buffered whole, or streamed in chunks with full duplex), trailers, then the
//! response's headers, body and trailers. No I/O here: [`Exchange::on`] takes a message and
//! returns the messages to answer with, so the server, the tests and the fuzz target drive
//! the same machine.
//!
//! Body modes (`ProtocolConfiguration`, sent with the first message; absent, the
//! `FULL_DUPLEX_STREAMED` the Endpoint Picker protocol asks gateways to configure):
//! - `FULL_DUPLEX_STREAMED`: the request headers are answered only once the whole body has
//!   come (the pick needs it), then the body is sent back in chunks; each response chunk is
//!   answered with itself (less the usage chunk only kvroute asked for).
//! - `BUFFERED` (and `BUFFERED_PARTIAL` that fits): the headers are answered at once, the
//!   whole body with the destination and the body as the engine gets it.
//! - `STREAMED` for the request is refused (500): the headers would go upstream before the
//!   body that decides where. For the response it is served chunk by chunk.
//! - `NONE`: a request with no body is placed in turn among the ready endpoints.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::HeaderMap as EnvoyHeaders;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, body_mutation, processing_request,
    processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use kvroute_core::WorkerId;
use kvroute_frontend::pick::{self, Pick};
use kvroute_http::ApiError;
use kvroute_http::auth::KeyId;
use tonic::Status;

use crate::budget::Share;
use crate::frames::{
    body_response, header, headers_response, kind, mode, routed, streamed_body, trailers,
};
use crate::hold::{Freed, Hold};
use crate::metadata::{self, DESTINATION_KEY, PREFILLER_HEADER};
use crate::metrics::Stage;
use crate::picker::Picker;

pub use crate::frames::CHUNK_BYTES;

/// The most header bytes (names and values) of a request read.
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// Where the stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing yet.
    Start,
    /// The request's headers came; its body is coming.
    Body,
    /// Picked (or answered immediately): the response is next.
    Picked,
    /// The response's body is passing.
    Answering,
    /// The response ended (or an immediate response was sent).
    Done,
}

/// One request's stream.
#[derive(Debug)]
pub struct Exchange {
    picker: Arc<Picker>,
    phase: Phase,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    path: String,
    method: String,
    headers: HeaderMap,
    allowed: Option<BTreeSet<WorkerId>>,
    body: Vec<u8>,
    /// What the body holds of the picker's budget.
    share: Option<Share>,
    hold: Hold,
    model: String,
    started: Instant,
    /// When the stream's current wait ends: the request's headers and body, or the
    /// response's beginning once placed.
    deadline: Option<Instant>,
    /// The gateway's own address (the client when it names none).
    peer: Option<IpAddr>,
    /// The API key the client's `authorization` header carried, when keys are configured.
    key: Option<KeyId>,
}

impl Exchange {
    /// A stream opened by `peer` (the gateway).
    pub fn new(picker: Arc<Picker>, peer: Option<IpAddr>) -> Self {
        picker.metrics.streams.inc();
        let deadline = Some(Instant::now() + picker.options.body_timeout);
        Self {
            picker,
            phase: Phase::Start,
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            path: String::new(),
            method: String::new(),
            headers: HeaderMap::new(),
            allowed: None,
            body: Vec::new(),
            share: None,
            hold: Hold::default(),
            model: String::new(),
            started: Instant::now(),
            deadline,
            peer,
            key: None,
        }
    }

    /// Frees the placement held, once ([`crate::hold::Hold::free`]): true for the call that freed it.
    fn release(&self, why: Freed) -> bool {
        self.hold.free(&self.picker, &self.model, self.started, why)
    }

    /// When the stream's current wait ends ([`Exchange::expired`] is then due).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The deadline passed: a request not yet whole is a 408; a placement whose response has
    /// not begun is freed, and the stream ends with `DEADLINE_EXCEEDED` (the gateway fails
    /// the request: its upstream did not answer in time).
    pub fn expired(&mut self) -> Result<Vec<ProcessingResponse>, Status> {
        self.deadline = None;
        match self.phase {
            Phase::Start | Phase::Body => {
                self.picker.metrics.deadline(Stage::Request);
                self.body = Vec::new();
                self.share = None;
                let secs = self.picker.options.body_timeout.as_secs_f64();
                let e = ApiError::new(
                    axum::http::StatusCode::REQUEST_TIMEOUT,
                    format!("the request's headers and body did not arrive within {secs} s"),
                );
                Ok(vec![self.refuse(&e)])
            }
            Phase::Picked => {
                self.release(Freed::Deadline);
                self.hold.begun();
                self.phase = Phase::Done;
                Err(Status::deadline_exceeded(
                    "the response did not begin in time; the placement is freed",
                ))
            }
            Phase::Answering | Phase::Done => Ok(Vec::new()),
        }
    }

    /// Whether the response has ended: nothing more is expected.
    pub fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Takes one message of the gateway's and returns the messages to answer with; a gRPC
    /// error for a message out of the protocol's order (the gateway then fails the request).
    pub async fn on(&mut self, m: ProcessingRequest) -> Result<Vec<ProcessingResponse>, Status> {
        if let Some(config) = &m.protocol_config {
            self.request_mode = mode(config.request_body_mode)?;
            self.response_mode = mode(config.response_body_mode)?;
        }
        let Some(request) = m.request else {
            return Err(Status::invalid_argument("a ProcessingRequest with no request"));
        };
        use processing_request::Request as R;
        match (self.phase, request) {
            (Phase::Start, R::RequestHeaders(h)) => {
                self.request_headers(&h, m.metadata_context.as_ref()).await
            }
            (Phase::Body, R::RequestBody(b)) => self.request_body(b).await,
            (Phase::Picked | Phase::Body, R::RequestTrailers(_)) => Ok(vec![trailers(true)]),
            (Phase::Picked, R::ResponseHeaders(h)) => {
                Ok(vec![self.response_headers(&h, m.metadata_context.as_ref())])
            }
            (Phase::Answering, R::ResponseBody(b)) => Ok(vec![self.response_body(b)]),
            (Phase::Answering | Phase::Picked, R::ResponseTrailers(_)) => {
                self.end();
                Ok(vec![trailers(false)])
            }
            (phase, request) => Err(Status::failed_precondition(format!(
                "{} while {}",
                kind(&request),
                match phase {
                    Phase::Start => "waiting for the request headers",
                    Phase::Body => "reading the request body",
                    Phase::Picked => "waiting for the response headers",
                    Phase::Answering => "passing the response body",
                    Phase::Done => "done",
                }
            ))),
        }
    }

    async fn request_headers(
        &mut self,
        h: &HttpHeaders,
        metadata: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
    ) -> Result<Vec<ProcessingResponse>, Status> {
        self.picker.metrics.requests.inc();
        if let Err(e) = self.read_headers(h.headers.as_ref()) {
            return Ok(vec![self.refuse(&e)]);
        }
        match self.picker.front.caller(&self.headers) {
            Ok(key) => self.key = key,
            Err(e) => return Ok(vec![self.refuse(&e)]),
        }
        self.share = Some(self.picker.budget.share(self.client()));
        match metadata::subset(metadata) {
            Ok(subset) => {
                let subset = subset.map(|s| self.picker.endpoints().allowed(&s));
                self.allowed = self.picker.eligible(subset);
            }
            Err(n) => {
                let max = metadata::MAX_SUBSET;
                let e = ApiError::bad_request(format!(
                    "the subset hint lists {n} endpoints, past {max}"
                ));
                return Ok(vec![self.refuse(&e)]);
            }
        }
        if h.end_of_stream || self.request_mode == BodySendMode::None {
            return Ok(self.in_turn(Side::Headers));
        }
        match self.request_mode {
            BodySendMode::Streamed => {
                let e = ApiError::internal(
                    "the gateway streams request bodies half-duplex (STREAMED); the picker \
                     needs the whole body before the headers go upstream: configure \
                     FULL_DUPLEX_STREAMED (or BUFFERED)",
                );
                Ok(vec![self.refuse(&e)])
            }
            BodySendMode::FullDuplexStreamed => {
                self.phase = Phase::Body;
                Ok(Vec::new())
            }
            _ => {
                self.phase = Phase::Body;
                Ok(vec![headers_response(CommonResponse::default(), true)])
            }
        }
    }

    /// Who the request is from, for the body budget: the API key's tenant, else the address
    /// the gateway appended last to `x-forwarded-for`, else the gateway itself.
    fn client(&self) -> Arc<str> {
        if let Some(key) = &self.key {
            return Arc::from(format!("key:{}", key.id));
        }
        let forwarded = self.headers.get_all("x-forwarded-for").iter().next_back();
        let last = forwarded.and_then(|v| v.to_str().ok()).and_then(|v| v.rsplit(',').next());
        let ip = last.and_then(|a| a.trim().parse::<IpAddr>().ok()).or(self.peer);
        Arc::from(ip.map_or_else(|| "unknown".to_owned(), |ip| ip.to_string()))
    }

    fn read_headers(&mut self, headers: Option<&EnvoyHeaders>) -> Result<(), ApiError> {
        let mut bytes = 0;
        for h in headers.map_or(&[][..], |h| &h.headers[..]) {
            let value = metadata::header_value(h);
            bytes += h.key.len() + value.len();
            if bytes > MAX_HEADER_BYTES {
                return Err(ApiError::new(
                    axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    format!("the request's headers are past {MAX_HEADER_BYTES} bytes"),
                ));
            }
            match h.key.as_str() {
                ":path" => {
                    let path = String::from_utf8_lossy(value);
                    self.path = path.split('?').next().unwrap_or_default().to_owned();
                }
                ":method" => self.method = String::from_utf8_lossy(value).into_owned(),
                key => {
                    if let (Ok(name), Ok(value)) =
                        (HeaderName::try_from(key), HeaderValue::from_bytes(value))
                    {
                        self.headers.append(name, value);
                    }
                }
            }
        }
        Ok(())
    }

    async fn request_body(&mut self, b: HttpBody) -> Result<Vec<ProcessingResponse>, Status> {
        if let Some(refused) = self.gather(&b) {
            return Ok(refused);
        }
        if !pick::places(&self.path) {
            let content_type = self.headers.get("content-type").and_then(|v| v.to_str().ok());
            if let Err(e) = self.picker.front.check_transfer_fields(&self.body, content_type) {
                return Ok(vec![self.refuse(&e)]);
            }
            self.picker.metrics.unplaced.inc();
            return Ok(self.in_turn(Side::Body));
        }
        let body = Bytes::from(std::mem::take(&mut self.body));
        let started = Instant::now();
        let (front, key, allowed) = (&self.picker.front, self.key.as_ref(), self.allowed.as_ref());
        let picked = front.pick(&self.path, &self.headers, body, allowed, key).await;
        self.share = None;
        self.picker.metrics.pick_seconds.observe(started.elapsed().as_secs_f64());
        Ok(match picked {
            Ok(Pick::Placed(p)) => self.send_to(*p),
            Ok(Pick::InTurn(body)) => {
                self.body = body.to_vec();
                self.picker.metrics.unplaced.inc();
                self.in_turn(Side::Body)
            }
            Err(e) => vec![self.refuse(&e)],
        })
    }

    /// Takes a chunk of the request body within its bounds: the answers when it is refused, or
    /// (full duplex) while more is to come; `None` once the whole body has come.
    fn gather(&mut self, b: &HttpBody) -> Option<Vec<ProcessingResponse>> {
        let max = self.picker.options.max_body_bytes;
        if self.body.len() + b.body.len() > max {
            let e = ApiError::new(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is past {max} bytes"),
            );
            return Some(vec![self.refuse(&e)]);
        }
        if !self.share.as_mut().is_some_and(|s| s.take(b.body.len())) {
            let e =
                ApiError::unavailable("too many request body bytes in flight; try again shortly")
                    .retry_after(1);
            return Some(vec![self.refuse(&e)]);
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return match self.request_mode {
                BodySendMode::FullDuplexStreamed => Some(Vec::new()),
                // BUFFERED_PARTIAL past Envoy's buffer: the rest would never come here.
                _ => {
                    let e = ApiError::new(
                        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                        "the request body is past the gateway's buffer",
                    );
                    Some(vec![self.refuse(&e)])
                }
            };
        }
        None
    }

    /// The answer to a placed request: its destination (the worker picked, then fallbacks) in
    /// the header and `envoy.lb`, the body as the engine gets it; held until its response ends.
    fn send_to(&mut self, picked: pick::Picked) -> Vec<ProcessingResponse> {
        self.model = picked.model.clone();
        let endpoints = self.picker.endpoints();
        let Some(first) = endpoints.endpoint(picked.worker) else {
            return vec![self.refuse(&ApiError::internal("a placed worker has no endpoint"))];
        };
        let fallbacks = picked.fallbacks.iter().filter_map(|w| endpoints.endpoint(*w));
        let fallbacks = fallbacks.take(self.picker.options.fallbacks);
        let destination: Vec<&str> = std::iter::once(first).chain(fallbacks).collect();
        let destination = destination.join(",");
        let mut set = vec![
            (DESTINATION_KEY, destination.clone()),
            ("content-length", picked.body.len().to_string()),
        ];
        if let Some(p) = picked.prefill.and_then(|p| endpoints.endpoint(p)) {
            set.push((PREFILLER_HEADER, p.to_owned()));
        }
        // The engine continues the trace under the picker's span, not the client's.
        if let Some(trace) = &picked.trace {
            set.push((kvroute_http::trace::TRACEPARENT, trace.traceparent()));
        }
        self.picker.metrics.picked(&self.model);
        let within = match picked.streamed {
            true => self.picker.front.first_byte_timeout(),
            false => self.picker.options.response_timeout,
        };
        let held_id = picked.held.id().to_owned();
        self.hold.hold(picked.held, within, &self.picker, &self.model);
        self.deadline = Some(Instant::now() + within);
        self.phase = Phase::Picked;
        let mut mutation = metadata::set_headers(set);
        if self.key.is_some() {
            // The client's key is kvroute's, not the engine's.
            mutation.remove_headers.push("authorization".to_owned());
        }
        // kvroute's admin token is never the engine's business.
        mutation.remove_headers.push(kvroute_frontend::ADMIN_TOKEN_HEADER.to_owned());
        if picked.trace.as_ref().is_some_and(|t| t.state.is_none()) {
            // A tracestate past its bounds is not passed on.
            mutation.remove_headers.push(kvroute_http::trace::TRACESTATE.to_owned());
        }
        let dynamic = Some(match self.picker.options.endpoint_scores {
            true => {
                let scores = self.picker.front.endpoint_scores(&held_id);
                let scored: Vec<(&str, f64)> = scores
                    .iter()
                    .filter_map(|(w, score)| Some((endpoints.endpoint(*w)?, *score)))
                    .collect();
                metadata::destination_scored(&destination, &scored)
            }
            false => metadata::destination(&destination),
        });
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => {
                let mut out = vec![ProcessingResponse {
                    dynamic_metadata: dynamic,
                    ..headers_response(routed(mutation), true)
                }];
                out.extend(streamed_body(&picked.body, true));
                out
            }
            _ => {
                let common = CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::Body(picked.body.to_vec())),
                    }),
                    ..routed(mutation)
                };
                vec![ProcessingResponse {
                    dynamic_metadata: dynamic,
                    ..body_response(common, true)
                }]
            }
        }
    }

    /// A request kvroute does not place (no body, or a route other than completions): the
    /// next ready endpoint in turn, its body as it came.
    fn in_turn(&mut self, side: Side) -> Vec<ProcessingResponse> {
        let Some(worker) = self.picker.in_turn(self.allowed.as_ref()) else {
            return vec![self.refuse(&unavailable(self.allowed.is_some()))];
        };
        let endpoints = self.picker.endpoints();
        let Some(endpoint) = endpoints.endpoint(worker) else {
            return vec![self.refuse(&ApiError::internal("a worker has no endpoint"))];
        };
        self.phase = Phase::Picked;
        // Nothing is held for the response: no deadline to keep.
        self.deadline = None;
        self.share = None;
        let common = routed(metadata::set_headers([(DESTINATION_KEY, endpoint.to_owned())]));
        let dynamic = Some(metadata::destination(endpoint));
        match (side, self.request_mode) {
            (Side::Headers, _) => {
                vec![ProcessingResponse {
                    dynamic_metadata: dynamic,
                    ..headers_response(common, true)
                }]
            }
            (Side::Body, BodySendMode::FullDuplexStreamed) => {
                let body = std::mem::take(&mut self.body);
                let headers = headers_response(common, true);
                let mut out = vec![ProcessingResponse { dynamic_metadata: dynamic, ..headers }];
                out.extend(streamed_body(&body, true));
                out
            }
            (Side::Body, _) => {
                vec![ProcessingResponse {
                    dynamic_metadata: dynamic,
                    ..body_response(common, true)
                }]
            }
        }
    }

    fn response_headers(
        &mut self,
        h: &HttpHeaders,
        metadata: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
    ) -> ProcessingResponse {
        let status = header(h.headers.as_ref(), ":status").and_then(|s| s.parse::<u16>().ok());
        let content_type = header(h.headers.as_ref(), "content-type");
        let mut set = Vec::new();
        self.deadline = None;
        self.hold.begun();
        let mut slot = self.hold.lock();
        if let Some(held) = slot.as_mut() {
            if let Some(served) = metadata::served(metadata) {
                match self.picker.endpoints().worker(served) {
                    Some(w) => {
                        if w != held.placed().worker_id {
                            self.picker.metrics.fallbacks_served.inc();
                        }
                        held.served_by(w);
                    }
                    None => {
                        tracing::debug!(served, "the gateway names an endpoint not in the pool");
                    }
                }
            }
            held.head(status.unwrap_or(200), content_type.as_deref());
            set.push((kvroute_frontend::WORKER_HEADER, held.placed().worker_id.0.to_string()));
            if self.response_mode == BodySendMode::None {
                held.first_bytes();
            }
        }
        drop(slot);
        if let Some(s) = status.filter(|s| *s >= 400) {
            self.picker.metrics.error(&self.model, s);
        }
        self.phase = Phase::Answering;
        if h.end_of_stream {
            self.end();
        }
        let mutation = (!set.is_empty()).then(|| metadata::set_headers(set));
        headers_response(
            CommonResponse { header_mutation: mutation, ..CommonResponse::default() },
            false,
        )
    }

    fn response_body(&mut self, b: HttpBody) -> ProcessingResponse {
        let passed = match self.hold.lock().as_mut() {
            Some(held) => held.body(Bytes::from(b.body)),
            None => Bytes::from(b.body),
        };
        if b.end_of_stream {
            self.end();
        }
        let mutation = match self.response_mode {
            BodySendMode::FullDuplexStreamed => {
                body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: passed.to_vec(),
                    end_of_stream: b.end_of_stream,
                    ..StreamedBodyResponse::default()
                })
            }
            _ => body_mutation::Mutation::Body(passed.to_vec()),
        };
        let common = CommonResponse {
            body_mutation: Some(BodyMutation { mutation: Some(mutation) }),
            ..CommonResponse::default()
        };
        body_response(common, false)
    }

    /// The response ended: the request is freed now (not when the stream closes).
    fn end(&mut self) {
        self.release(Freed::Answered);
        self.phase = Phase::Done;
    }

    /// An immediate response in OpenAI's error shape, with `Retry-After` when it says one.
    fn refuse(&mut self, e: &ApiError) -> ProcessingResponse {
        self.phase = Phase::Done;
        self.deadline = None;
        self.share = None;
        let status = e.status().as_u16();
        self.picker.metrics.refused(&self.model, status);
        let body = serde_json::to_vec(&e.body()).unwrap_or_default();
        let mut set = vec![("content-type", "application/json".to_owned())];
        if let Some(secs) = e.retry_after_secs() {
            set.push(("retry-after", secs.to_string()));
        }
        ProcessingResponse {
            response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
                status: Some(HttpStatus { code: i32::from(status) }),
                headers: Some(metadata::set_headers(set)),
                body,
                grpc_status: None,
                details: format!("kvroute_epp_{status}"),
            })),
            ..ProcessingResponse::default()
        }
    }
}

/// A stream that ends before its response did (the gateway reset it, or ended it early) is
/// counted as broken; the request still in flight is freed as `held` drops.
impl Drop for Exchange {
    fn drop(&mut self) {
        if self.phase != Phase::Done {
            self.picker.metrics.broken.inc();
            self.release(Freed::Gone);
        }
    }
}

/// Which of the request's messages an answer goes to.
#[derive(Clone, Copy, Debug)]
enum Side {
    Headers,
    Body,
}

fn unavailable(subset: bool) -> ApiError {
    match subset {
        true => ApiError::unavailable("no endpoint of the subset is ready"),
        false => ApiError::unavailable("no endpoint is ready"),
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;
    use kvroute_router::{RouterConfig, RouterState, WorkerSpec};

    use super::*;

    /// A picker over a front door with two workers (their ports closed: nothing is sent).
    fn picker() -> Arc<Picker> {
        let workers = (1..=2u64)
            .map(|k| {
                let mut w = WorkerSpec::new(k);
                w.url = Some(format!("http://127.0.0.1:{k}"));
                w
            })
            .collect();
        let router =
            Arc::new(RouterState::new(RouterConfig { workers, ..RouterConfig::default() }));
        let fetch = kvroute_preprocess::fetch::FetchConfig::default();
        let fetcher = kvroute_preprocess::fetch::Fetcher::new(fetch).unwrap();
        let pre = Arc::new(kvroute_preprocess::Preprocessor::builtin());
        let front = Arc::new(kvroute_frontend::FrontendState::new(pre, fetcher, router));
        Arc::new(Picker::new(front, crate::EppOptions::default()))
    }

    fn headers(
        pairs: &[(&str, &str)],
        modes: Option<(BodySendMode, BodySendMode)>,
    ) -> ProcessingRequest {
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect();
        ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers }),
                ..HttpHeaders::default()
            })),
            protocol_config: modes.map(|(q, r)| ProtocolConfiguration {
                request_body_mode: q as i32,
                response_body_mode: r as i32,
                ..ProtocolConfiguration::default()
            }),
            ..ProcessingRequest::default()
        }
    }

    fn body(b: &[u8]) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: b.to_vec(),
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    fn immediate(r: &ProcessingResponse) -> Option<u16> {
        match &r.response {
            Some(processing_response::Response::ImmediateResponse(i)) => {
                i.status.as_ref().map(|s| s.code as u16)
            }
            _ => None,
        }
    }

    const CHAT: &[u8] = br#"{"messages":[{"role":"user","content":"Hello there"}],"max_tokens":2}"#;
    const POST: [(&str, &str); 2] = [(":method", "POST"), (":path", "/v1/chat/completions")];

    #[tokio::test]
    async fn buffered_answers_the_headers_at_once_and_the_destination_with_the_body() {
        let picker = picker();
        let mut x = Exchange::new(Arc::clone(&picker), None);
        let modes = (BodySendMode::Buffered, BodySendMode::Buffered);
        let out = x.on(headers(&POST, Some(modes))).await.unwrap();
        assert!(matches!(out[0].response, Some(processing_response::Response::RequestHeaders(_))));
        let out = x.on(body(CHAT)).await.unwrap();
        assert_eq!(out.len(), 1);
        let Some(processing_response::Response::RequestBody(b)) = &out[0].response else {
            panic!("{out:?}")
        };
        let common = b.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.as_ref().unwrap().set_headers;
        let header =
            set.iter().find_map(|h| h.header.as_ref().filter(|h| h.key == DESTINATION_KEY));
        let header = String::from_utf8(header.unwrap().raw_value.clone()).unwrap();
        let dynamic = out[0].dynamic_metadata.as_ref().unwrap();
        let metadata = metadata::dynamic_string(dynamic, "envoy.lb", DESTINATION_KEY).unwrap();
        assert_eq!(header, metadata);
        assert_eq!(header.split(',').count(), 2, "the picked worker and the other one");
        assert!(matches!(
            common.body_mutation.as_ref().unwrap().mutation,
            Some(body_mutation::Mutation::Body(_))
        ));
        assert_eq!(picker.front.in_flight(), 1);
        drop(x);
        assert_eq!(picker.front.in_flight(), 0, "dropped: freed");
    }

    #[tokio::test]
    async fn half_duplex_streamed_requests_and_unknown_modes_are_refused() {
        let picker = picker();
        let mut x = Exchange::new(Arc::clone(&picker), None);
        let modes = (BodySendMode::Streamed, BodySendMode::Streamed);
        let out = x.on(headers(&POST, Some(modes))).await.unwrap();
        assert_eq!(immediate(&out[0]), Some(500));
        assert!(x.done());
        let mut x = Exchange::new(Arc::clone(&picker), None);
        let mut m = headers(&POST, None);
        m.protocol_config =
            Some(ProtocolConfiguration { request_body_mode: 99, ..Default::default() });
        assert_eq!(x.on(m).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test]
    async fn oversized_headers_are_a_431_and_a_huge_subset_a_400() {
        let picker = picker();
        let mut x = Exchange::new(Arc::clone(&picker), None);
        let big = "x".repeat(MAX_HEADER_BYTES);
        let out = x.on(headers(&[(":path", "/v1/chat/completions"), ("x-big", &big)], None)).await;
        assert_eq!(immediate(&out.unwrap()[0]), Some(431));
        let mut x = Exchange::new(Arc::clone(&picker), None);
        let mut m = headers(&POST, None);
        let hint = metadata::list((0..=metadata::MAX_SUBSET).map(|_| "10.0.0.1:8000"));
        let hint = envoy_types::pb::google::protobuf::Struct {
            fields: [(metadata::SUBSET_KEY.to_owned(), hint)].into(),
        };
        m.metadata_context = Some(envoy_types::pb::envoy::config::core::v3::Metadata {
            filter_metadata: [(metadata::SUBSET_NAMESPACE.to_owned(), hint)].into(),
            ..Default::default()
        });
        assert_eq!(immediate(&x.on(m).await.unwrap()[0]), Some(400));
    }

    #[tokio::test]
    async fn an_unknown_model_is_the_front_doors_404_and_nothing_is_held() {
        let picker = picker();
        let mut x = Exchange::new(Arc::clone(&picker), None);
        x.on(headers(&POST, None)).await.unwrap();
        let out =
            x.on(body(br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#)).await;
        assert_eq!(immediate(&out.unwrap()[0]), Some(404));
        assert_eq!(picker.front.in_flight(), 0);
    }
}

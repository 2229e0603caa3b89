//! kvroute as an Endpoint Picker (EPP) behind a Kubernetes inference gateway: Envoy's
//! external processing protocol (`envoy.service.ext_proc.v3.ExternalProcessor`, a
//! bidirectional gRPC stream per HTTP request) served over the front door's stages, as the
//! Gateway API Inference Extension's Endpoint Picker protocol asks
//! (`docs/kubernetes.md`).
//!
//! ```text
//!  gateway ─▶ request headers (subset hint in filter metadata)  ┐
//!          ─▶ request body, buffered or streamed in chunks       ├ exchange.rs: one stream
//!  picker  ─▶ FrontendState::pick (parse, tokenize, hash, admit, │   per request
//!             place; in flight from now)                         │
//!          ◀─ destination header + envoy.lb metadata, the body   │
//!  gateway ─▶ response headers (the endpoint that served)        │
//!          ─▶ response body: prefill done, cached tokens read,   │
//!             the front door's usage chunk dropped               ┘
//!  stream ends or breaks: the request is freed
//! ```
//!
//! - [`metadata`]: the protocol's keys, read and built from Envoy's protobuf types;
//! - [`exchange`]: one request's stream, as a state machine over messages (no I/O: the fuzz
//!   target drives it);
//! - [`gateway`]: a small gateway that plays Envoy's side, for the tests and the bench.

pub mod endpoints;
pub mod exchange;
pub mod gateway;
pub mod metadata;
pub mod metrics;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use kvroute_core::WorkerId;
use kvroute_frontend::FrontendState;
use tonic::{Request, Response, Status, Streaming};

pub use endpoints::{Endpoints, host_port, parse_endpoints};

/// The gRPC service name of ext_proc, also a health service name.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The health services that say serving once the picker is ready: `readiness`, the
/// ext_proc service, the server as a whole (`""`), and `inference-extension`, the name the
/// reference picker's manifests probe. `liveness` says serving from the start.
pub const READY_SERVICES: [&str; 4] = ["readiness", EXT_PROC_SERVICE, "", "inference-extension"];

/// The picker's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EppOptions {
    /// Fallback endpoints listed after the one picked (the gateway tries them in order when
    /// it cannot reach the first).
    pub fallbacks: usize,
    /// Largest request body read (a larger one is a 413).
    pub max_body_bytes: usize,
}

impl Default for EppOptions {
    fn default() -> Self {
        Self { fallbacks: 2, max_body_bytes: kvroute_frontend::BODY_LIMIT }
    }
}

/// The picker: the front door's stages, the pool's endpoints and the picker's metrics.
#[derive(Debug)]
pub struct Picker {
    pub front: Arc<FrontendState>,
    /// The pool's endpoints, swapped whole when their names resolve anew.
    endpoints: std::sync::RwLock<Arc<Endpoints>>,
    pub options: EppOptions,
    pub metrics: metrics::EppMetrics,
    /// Where the next request without a prompt (a `GET`, another route) goes, in turn.
    turn: AtomicUsize,
    /// The workers the endpoints file lists (absent: every worker), [`Picker::watch`].
    members: std::sync::RwLock<Option<BTreeSet<WorkerId>>>,
}

impl Picker {
    pub fn new(front: Arc<FrontendState>, options: EppOptions) -> Self {
        let endpoints = std::sync::RwLock::new(Arc::new(Endpoints::of(&front)));
        let metrics = metrics::EppMetrics::new();
        let members = std::sync::RwLock::new(None);
        Self { front, endpoints, options, metrics, turn: AtomicUsize::new(0), members }
    }

    /// The pool's endpoints as they stand.
    pub fn endpoints(&self) -> Arc<Endpoints> {
        Arc::clone(&self.endpoints.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Resolves the workers' host names to the addresses the gateway names them by (an
    /// original-destination cluster routes to `ip:port`), now and every `every` until the
    /// picker is dropped. Workers named by address need none of it.
    pub fn spawn_resolver(
        self: &Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(picker) = weak.upgrade() {
                let resolved = picker.endpoints().resolved().await;
                *picker.endpoints.write().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Arc::new(resolved);
                drop(picker);
                tokio::time::sleep(every).await;
            }
        })
    }

    /// The workers a request may go to: those of its subset hint (absent: all) that the
    /// endpoints file lists (absent: all).
    pub(crate) fn eligible(
        &self,
        subset: Option<BTreeSet<WorkerId>>,
    ) -> Option<BTreeSet<WorkerId>> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        match (subset, members.as_ref()) {
            (s, None) => s,
            (None, Some(m)) => Some(m.clone()),
            (Some(s), Some(m)) => Some(s.intersection(m).copied().collect()),
        }
    }

    /// Takes the pool's endpoints (`host:port` as the gateway names them): later requests
    /// go only to the workers among them. Returns those that name no worker of the fleet.
    pub fn set_members(&self, listed: &[String]) -> Vec<String> {
        let endpoints = self.endpoints();
        let members = endpoints.allowed(listed);
        let unknown =
            listed.iter().filter(|e| endpoints.allowed(std::slice::from_ref(e)).is_empty());
        let unknown: Vec<String> = unknown.cloned().collect();
        *self.members.write().unwrap_or_else(|e| e.into_inner()) = Some(members);
        unknown
    }

    /// Rereads `path` every `every` and takes its endpoints when its text changed (one
    /// `host:port` per line, `#` comments), until the picker is dropped. A file that cannot
    /// be read leaves the pool as it was (a ConfigMap's file is swapped, never half written).
    pub fn watch(
        self: &Arc<Self>,
        path: std::path::PathBuf,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut seen: Option<String> = None;
            while let Some(picker) = weak.upgrade() {
                match tokio::fs::read_to_string(&path).await {
                    Ok(text) if seen.as_deref() != Some(text.as_str()) => {
                        picker.reread(&path, &text);
                        seen = Some(text);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let path = path.display();
                        tracing::warn!(%path, error = %e, "endpoints file unreadable: pool kept");
                    }
                }
                drop(picker);
                tokio::time::sleep(every).await;
            }
        })
    }

    fn reread(&self, path: &std::path::Path, text: &str) {
        let listed = parse_endpoints(text);
        let unknown = self.set_members(&listed);
        tracing::info!(path = %path.display(), endpoints = listed.len(), "pool endpoints read");
        if !unknown.is_empty() {
            tracing::warn!(?unknown, "pool endpoints that are no worker of the fleet (--worker)");
        }
    }

    /// The next worker in turn among `allowed` that is in rotation.
    pub(crate) fn in_turn(&self, allowed: Option<&BTreeSet<WorkerId>>) -> Option<WorkerId> {
        let ready: Vec<WorkerId> = self
            .endpoints()
            .workers()
            .filter(|w| allowed.is_none_or(|a| a.contains(w)) && self.front.in_rotation(*w))
            .collect();
        let n = ready.len();
        (n > 0).then(|| ready[self.turn.fetch_add(1, Ordering::Relaxed) % n])
    }
}

/// The ext_proc service over a [`Picker`].
#[derive(Clone, Debug)]
pub struct Service(pub Arc<Picker>);

/// What a stream holds between the messages it answers: the gateway's side, the exchange,
/// answers not yet sent, and whether it is over.
struct Open {
    inbound: Streaming<ProcessingRequest>,
    exchange: exchange::Exchange,
    answers: std::collections::VecDeque<ProcessingResponse>,
    over: bool,
}

/// The next message toward the gateway: the stream is driven by the gateway reading it (no
/// task of its own), so when the gateway goes (its reset drops the stream) the exchange is
/// dropped with it, a pick waiting for room (flow control) included, and its request freed.
async fn next(mut open: Open) -> Option<(Result<ProcessingResponse, Status>, Open)> {
    loop {
        if let Some(answer) = open.answers.pop_front() {
            return Some((Ok(answer), open));
        }
        if open.over {
            return None;
        }
        match open.inbound.message().await {
            Ok(Some(m)) => match open.exchange.on(m).await {
                Ok(answers) => {
                    open.answers.extend(answers);
                    open.over = open.exchange.done();
                }
                Err(status) => {
                    open.over = true;
                    return Some((Err(status), open));
                }
            },
            // The gateway ended its side before the response did: nothing more comes.
            Ok(None) => open.over = true,
            // Bytes that are no message (or past the limit), or a reset: the gateway is
            // told, when it still listens.
            Err(status) => {
                tracing::debug!(code = ?status.code(), message = status.message(), "ext_proc stream broken");
                open.over = true;
                return Some((Err(status), open));
            }
        }
    }
}

type Answers = std::pin::Pin<
    Box<dyn futures_util::Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static>,
>;

#[tonic::async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let open = Open {
            inbound: request.into_inner(),
            exchange: exchange::Exchange::new(Arc::clone(&self.0)),
            answers: std::collections::VecDeque::new(),
            over: false,
        };
        Ok(Response::new(Box::pin(futures_util::stream::unfold(open, next))))
    }
}

/// Largest ext_proc message decoded: a body chunk (Envoy's are at most its buffer, 64 KiB
/// by default in streamed modes; a buffered body, up to [`EppOptions::max_body_bytes`]) with
/// its headers and metadata.
pub fn max_message_bytes(options: &EppOptions) -> usize {
    options.max_body_bytes + (1 << 20)
}

/// Serves ext_proc and gRPC health on `listener` until `shutdown` resolves. Health says
/// `liveness` serving from the start; `readiness` and the ext_proc service serving once
/// `ready` resolves (the workers ready and every subscription up).
pub async fn serve(
    listener: tokio::net::TcpListener,
    picker: Arc<Picker>,
    ready: impl std::future::Future<Output = ()> + Send + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status("liveness", tonic_health::ServingStatus::Serving).await;
    for name in READY_SERVICES {
        reporter.set_service_status(name, tonic_health::ServingStatus::NotServing).await;
    }
    tokio::spawn(async move {
        ready.await;
        for name in READY_SERVICES {
            reporter.set_service_status(name, tonic_health::ServingStatus::Serving).await;
        }
    });
    let limit = max_message_bytes(&picker.options);
    let service = ExternalProcessorServer::new(Service(picker)).max_decoding_message_size(limit);
    // Small frames (a headers answer, a body chunk) go out at once, not after an ACK.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// The address a listener for the picker binds by default.
pub const DEFAULT_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 9002);

//! The ext_proc gRPC service over a [`Picker`], and the server with gRPC health.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tonic::{Request, Response, Status, Streaming};

use crate::exchange;
use crate::picker::{EppOptions, Picker};

/// The gRPC service name of ext_proc, also a health service name.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The health services that say serving once the picker is ready: `readiness`, the
/// ext_proc service, the server as a whole (`""`), and `inference-extension`, the name the
/// reference picker's manifests probe. `liveness` says serving from the start.
pub const READY_SERVICES: [&str; 4] = ["readiness", EXT_PROC_SERVICE, "", "inference-extension"];

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
        let message = match open.exchange.deadline() {
            Some(at) => {
                let at = tokio::time::Instant::from_std(at);
                tokio::select! {
                    m = open.inbound.message() => m,
                    () = tokio::time::sleep_until(at) => {
                        let answered = open.exchange.expired();
                        if let Err(status) = open.take(answered) {
                            return Some((Err(status), open));
                        }
                        continue;
                    }
                }
            }
            None => open.inbound.message().await,
        };
        match message {
            Ok(Some(m)) => {
                let answered = open.exchange.on(m).await;
                if let Err(status) = open.take(answered) {
                    return Some((Err(status), open));
                }
            }
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

impl Open {
    /// Takes what the exchange answered: its messages queued (the stream over once the
    /// exchange is done), or the error that ends the stream.
    fn take(&mut self, answered: Result<Vec<ProcessingResponse>, Status>) -> Result<(), Status> {
        match answered {
            Ok(answers) => {
                self.answers.extend(answers);
                self.over = self.exchange.done();
                Ok(())
            }
            Err(status) => {
                self.over = true;
                Err(status)
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
        if !self.0.admits(request.metadata()) {
            self.0.metrics.unauthenticated.inc();
            return Err(Status::unauthenticated("the ext_proc token is missing or wrong"));
        }
        let peer = request.remote_addr().map(|a| a.ip());
        let open = Open {
            inbound: request.into_inner(),
            exchange: exchange::Exchange::new(Arc::clone(&self.0), peer),
            answers: std::collections::VecDeque::new(),
            over: false,
        };
        Ok(Response::new(Box::pin(futures_util::stream::unfold(open, next))))
    }
}

/// Largest ext_proc message decoded: [`EppOptions::max_message_bytes`] (no more than a whole
/// body), with room for its headers and metadata.
pub fn max_message_bytes(options: &EppOptions) -> usize {
    options.max_message_bytes.min(options.max_body_bytes) + (64 << 10)
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
    serve_tls(listener, picker, None, None, ready, shutdown).await
}

/// [`serve`], over TLS when `tls` is given (its ALPN should offer `h2`): each connection's
/// handshake runs in a task of its own, within [`HANDSHAKE_TIMEOUT`], so a slow one holds
/// up no other. `health`: a listener of its own for gRPC health in plain text, the same
/// statuses (Kubernetes' gRPC probes speak no TLS; GIE's picker serves health on 9003).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    picker: Arc<Picker>,
    tls: Option<Arc<rustls::ServerConfig>>,
    health_listener: Option<tokio::net::TcpListener>,
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
    if let Some(listener) = health_listener {
        let health = health.clone();
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            let served = tonic::transport::Server::builder().add_service(health);
            if let Err(e) = served.serve_with_incoming(incoming).await {
                tracing::error!(error = %e, "the picker's health port stopped");
            }
        });
    }
    let limit = max_message_bytes(&picker.options);
    let service = ExternalProcessorServer::new(Service(picker)).max_decoding_message_size(limit);
    let server = tonic::transport::Server::builder().add_service(health).add_service(service);
    match tls {
        None => {
            // Small frames (a headers answer, a body chunk) go out at once, not after an ACK.
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            server.serve_with_incoming_shutdown(incoming, shutdown).await
        }
        Some(config) => {
            let incoming = crate::tls::incoming(listener, config);
            server.serve_with_incoming_shutdown(incoming, shutdown).await
        }
    }
}

pub use crate::tls::HANDSHAKE_TIMEOUT;

/// The address a listener for the picker binds by default.
pub const DEFAULT_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 9002);

//! How every kvroute listener is served: HTTP/1 over TCP or TLS (rustls), with the limits a
//! server facing untrusted clients needs and axum's own `serve` does not set:
//!
//! - **header timeout**: a request's line and headers must arrive within it, and an idle
//!   keep-alive connection is closed after it (hyper's timer runs while it waits for a head);
//! - **body timeout**: a request's whole body must arrive within it of its headers;
//! - **TLS handshake timeout**, and a **connection limit** (accepting waits when it is reached);
//! - graceful shutdown: stop accepting, let open requests finish (bound that wait outside).
//!
//! Writes go out without Nagle's delay: a streamed chunk otherwise waits for the previous
//! one's ACK, which a delayed ACK holds up to 40 ms.

use std::future::Future;
use std::path::Path;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt as _;

/// A listener's limits and optional TLS.
#[derive(Clone)]
pub struct ServeOptions {
    pub tls: Option<TlsAcceptor>,
    /// Request line and headers, and idle time between keep-alive requests.
    pub header_timeout: Duration,
    /// The whole request body, from its headers.
    pub body_timeout: Duration,
    pub handshake_timeout: Duration,
    /// Open connections at most; more wait to be accepted.
    pub max_connections: usize,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("tls", &self.tls.is_some())
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("max_connections", &self.max_connections)
            .finish_non_exhaustive()
    }
}

pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            tls: None,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            handshake_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("reading the certificate chain {path}")]
    Certs { path: String, source: rustls::pki_types::pem::Error },
    #[error("reading the private key {path}")]
    Key { path: String, source: rustls::pki_types::pem::Error },
    #[error("the certificate and key do not make a TLS configuration")]
    Config(#[from] rustls::Error),
}

/// A TLS acceptor from PEM files: the certificate chain (leaf first) and its private key.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let path = |p: &Path| p.display().to_string();
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Certs { path: path(cert), source })?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|source| TlsError::Key { path: path(key), source })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Serves `app` on `listener` with `options` until `shutdown` resolves, then lets open
/// requests finish.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    options: ServeOptions,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(options.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&slots).acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let options = options.clone();
        let body_timeout = options.body_timeout;
        let service = app.clone().map_request(move |r: hyper::Request<Incoming>| {
            r.map(|b| Body::new(Deadline::new(b, body_timeout)))
        });
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let io: Box<dyn Io> = match &options.tls {
                None => Box::new(tcp),
                Some(tls) => {
                    match tokio::time::timeout(options.handshake_timeout, tls.accept(tcp)).await {
                        Ok(Ok(stream)) => Box::new(stream),
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    }
                }
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(options.header_timeout);
            let conn =
                builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
            if let Err(e) = watcher.watch(conn).await {
                tracing::trace!(error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A request body that fails once its time is up.
struct Deadline {
    inner: Incoming,
    sleep: Pin<Box<Sleep>>,
}

impl Deadline {
    fn new(inner: Incoming, timeout: Duration) -> Self {
        Self { inner, sleep: Box::pin(tokio::time::sleep(timeout)) }
    }
}

/// The request body did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyTimeout;

impl HttpBody for Deadline {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if self.inner.is_end_stream() {
            return Poll::Ready(None);
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyTimeout))));
        }
        Pin::new(&mut self.inner).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

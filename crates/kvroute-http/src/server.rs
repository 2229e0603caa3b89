//! How every kvroute listener is served: HTTP/1 over TCP or TLS (rustls), with the limits a
//! server facing untrusted clients needs and axum's own `serve` does not set:
//!
//! - **header timeout**: a request's line and headers must arrive within it, and an idle
//!   keep-alive connection is closed after it (hyper's timer runs while it waits for a head);
//! - **body timeout**: a request's whole body must arrive within it of its headers;
//! - **TLS handshake timeout**, and a **connection limit** (accepting waits when it is reached);
//! - **per-client shares**: one client (a peer IP address) holds at most
//!   `max_connections_per_client` connections (more are closed as they are accepted) and
//!   `max_body_bytes_per_client` of request bodies being received;
//! - **body bytes in flight**: all connections together receive at most
//!   `max_body_bytes_in_flight` of request bodies at once; a body that would pass either
//!   bound fails with [`BodyBudget`] (a 503 from the handlers), so held-open bodies cannot
//!   pile up memory;
//! - graceful shutdown: stop accepting, let open requests finish (bound that wait outside);
//! - **memory back after a burst**: once bodies of at least [`TRIM_AFTER_BYTES`] have been
//!   released, the allocator's free pages go back to the OS within [`TRIM_TICK`]
//!   (`kvroute_alloc`: glibc otherwise keeps them, 58 MiB above idle for good after 24 held
//!   60 MiB bodies).
//!
//! Writes go out without Nagle's delay: a streamed chunk otherwise waits for the previous
//! one's ACK, which a delayed ACK holds up to 40 ms.

use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
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
    /// Open connections of one client (peer IP address) at most; more are closed at once.
    pub max_connections_per_client: usize,
    /// Request body bytes being received, all connections together, at most.
    pub max_body_bytes_in_flight: usize,
    /// Request body bytes one client may be sending at once.
    pub max_body_bytes_per_client: usize,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("tls", &self.tls.is_some())
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_connections_per_client", &self.max_connections_per_client)
            .field("max_body_bytes_in_flight", &self.max_body_bytes_in_flight)
            .field("max_body_bytes_per_client", &self.max_body_bytes_per_client)
            .finish_non_exhaustive()
    }
}

pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// A quarter of the connections: one client cannot shut the others out.
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: usize = DEFAULT_MAX_CONNECTIONS / 4;
/// Eight of the largest bodies the front door takes (64 MiB) being received at once.
pub const DEFAULT_MAX_BODY_BYTES_IN_FLIGHT: usize = 512 << 20;
/// A quarter of [`DEFAULT_MAX_BODY_BYTES_IN_FLIGHT`]: two of the largest bodies.
pub const DEFAULT_MAX_BODY_BYTES_PER_CLIENT: usize = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT / 4;

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            tls: None,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            handshake_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_client: DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
            max_body_bytes_in_flight: DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
            max_body_bytes_per_client: DEFAULT_MAX_BODY_BYTES_PER_CLIENT,
        }
    }
}

pub use crate::tls::TlsError;

/// A TLS acceptor from PEM files: the certificate chain (leaf first) and its private key.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let certified = crate::tls::read_pem(cert, key)?;
    Ok(TlsAcceptor::from(crate::tls::fixed_config(certified, &[b"http/1.1"])?))
}

/// Body bytes released (received whole or abandoned) since the allocator last gave its free
/// pages back, across every listener of the process.
static RELEASED_BODY_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Counts `n` body bytes let go of outside a listener (the Endpoint Picker's streams), so
/// that the next trimmer tick gives their pages back as it does a listener's.
pub fn note_released_body_bytes(n: usize) {
    RELEASED_BODY_BYTES.fetch_add(n, Ordering::Relaxed);
}

/// Released body bytes worth giving the allocator's free pages back for.
pub const TRIM_AFTER_BYTES: usize = 16 << 20;

/// How often a listener looks at what was released. A released body's buffers may still be
/// held by its handler for a moment; a tick later they are gone.
pub const TRIM_TICK: Duration = Duration::from_secs(2);

/// Gives the allocator's free pages back, off the runtime, whenever [`TRIM_AFTER_BYTES`] of
/// bodies were released since the last time; one per listener, ended with it.
fn spawn_trimmer() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        let mut tick = tokio::time::interval(TRIM_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if RELEASED_BODY_BYTES.load(Ordering::Relaxed) >= TRIM_AFTER_BYTES {
                RELEASED_BODY_BYTES.store(0, Ordering::Relaxed);
                let _ = tokio::task::spawn_blocking(kvroute_alloc::give_back_free_memory).await;
            }
        }
    })
}

/// The trimmer task, ended when its listener's serving ends or is dropped.
struct Trimmer(tokio::task::JoinHandle<()>);

impl Drop for Trimmer {
    fn drop(&mut self) {
        self.0.abort();
    }
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
    let clients = Arc::new(Clients::new(&options));
    let _trimmer = Trimmer(spawn_trimmer());
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
        let (tcp, peer) = tokio::select! {
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
        let Some(client) = clients.connect(peer.ip()) else {
            // Over its share: closed before anything is read from it.
            tracing::debug!(client = %peer.ip(), "connection refused: the client holds its share");
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let options = options.clone();
        let body_timeout = options.body_timeout;
        let body_client = client.clone();
        let service = app.clone().map_request(move |r: hyper::Request<Incoming>| {
            let client = body_client.clone();
            r.map(|b| Body::new(Deadline::new(b, body_timeout, client)))
        });
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let _client = client;
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

/// What each client (peer IP address) holds of a listener: connections, and body bytes being
/// received; and the body bytes of all clients together.
#[derive(Debug)]
struct Clients {
    held: std::sync::Mutex<AllHeld>,
    max_connections: usize,
    max_body_bytes: usize,
    max_client_body_bytes: usize,
}

#[derive(Debug, Default)]
struct AllHeld {
    per_client: std::collections::HashMap<IpAddr, Held>,
    body_bytes: usize,
}

#[derive(Debug, Default)]
struct Held {
    connections: usize,
    body_bytes: usize,
}

impl Clients {
    fn new(options: &ServeOptions) -> Self {
        Self {
            held: std::sync::Mutex::default(),
            max_connections: options.max_connections_per_client.max(1),
            max_body_bytes: options.max_body_bytes_in_flight,
            max_client_body_bytes: options.max_body_bytes_per_client,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AllHeld> {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A connection of `ip`, unless it holds its share already.
    fn connect(self: &Arc<Self>, ip: IpAddr) -> Option<Client> {
        let mut held = self.lock();
        let entry = held.per_client.entry(ip).or_default();
        if entry.connections >= self.max_connections {
            return None;
        }
        entry.connections += 1;
        Some(Client(Arc::new(ClientConnection { clients: Arc::clone(self), ip })))
    }

    /// Takes `n` body bytes for `ip`, if both its share and the total allow them.
    fn take_body(&self, ip: IpAddr, n: usize) -> bool {
        let mut held = self.lock();
        let total = held.body_bytes + n;
        let Some(entry) = held.per_client.get_mut(&ip) else { return false };
        if entry.body_bytes + n > self.max_client_body_bytes || total > self.max_body_bytes {
            return false;
        }
        entry.body_bytes += n;
        held.body_bytes = total;
        true
    }

    fn give_body(&self, ip: IpAddr, n: usize) {
        let mut held = self.lock();
        if let Some(entry) = held.per_client.get_mut(&ip) {
            entry.body_bytes = entry.body_bytes.saturating_sub(n);
        }
        held.body_bytes = held.body_bytes.saturating_sub(n);
        RELEASED_BODY_BYTES.fetch_add(n, Ordering::Relaxed);
    }
}

/// One open connection of a client; the last clone gone, the connection is counted closed.
#[derive(Clone, Debug)]
struct Client(Arc<ClientConnection>);

#[derive(Debug)]
struct ClientConnection {
    clients: Arc<Clients>,
    ip: IpAddr,
}

impl Drop for ClientConnection {
    fn drop(&mut self) {
        let mut held = self.clients.lock();
        if let Some(entry) = held.per_client.get_mut(&self.ip) {
            entry.connections = entry.connections.saturating_sub(1);
            if entry.connections == 0 && entry.body_bytes == 0 {
                held.per_client.remove(&self.ip);
            }
        }
    }
}

/// A request body that fails once its time is up, or once it would take more body bytes
/// than its client's share or the listener's total leave; what it took is given back when
/// it is dropped (received whole or abandoned).
struct Deadline {
    inner: Incoming,
    sleep: Pin<Box<Sleep>>,
    client: Client,
    taken: usize,
}

impl Deadline {
    fn new(inner: Incoming, timeout: Duration, client: Client) -> Self {
        Self { inner, sleep: Box::pin(tokio::time::sleep(timeout)), client, taken: 0 }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        let c = &self.client.0;
        c.clients.give_body(c.ip, self.taken);
    }
}

/// The request body would take more bytes than the listener lets one client, or all of
/// them, receive at once.
#[derive(Debug, thiserror::Error)]
#[error("too many request body bytes in flight; try again shortly")]
pub struct BodyBudget;

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
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
            let n = data.map_or(0, bytes::Bytes::len);
            let c = &self.client.0;
            if !c.clients.take_body(c.ip, n) {
                return Poll::Ready(Some(Err(Box::new(BodyBudget))));
            }
            self.taken += n;
        }
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

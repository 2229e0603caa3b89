//! The listener's limits over real sockets on 127.0.0.1: a client trickling its headers or its
//! body is cut off, connections past the limit wait, and TLS serves with a certificate from
//! PEM files.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::routing::{get, post};
use kvroute_http::{ServeOptions, serve_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn app() -> Router {
    Router::new().route("/health", get(|| async { "ok" })).route(
        "/echo",
        post(|body: Result<Bytes, axum::extract::rejection::BytesRejection>| async move {
            use axum::response::IntoResponse;
            match body {
                Ok(b) => (axum::http::StatusCode::OK, b.len().to_string()).into_response(),
                Err(e) => kvroute_http::ApiError::from(e).into_response(),
            }
        }),
    )
}

async fn serve(options: ServeOptions) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_with(listener, app(), std::future::pending(), options));
    addr
}

/// Reads until the server closes the connection; what it sent and when it closed.
async fn read_to_close(stream: &mut TcpStream, limit: Duration) -> (String, Duration) {
    let start = Instant::now();
    let mut out = Vec::new();
    let read = tokio::time::timeout(limit, stream.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server kept the connection open past {limit:?}");
    (String::from_utf8_lossy(&out).into_owned(), start.elapsed())
}

#[tokio::test]
async fn trickled_headers_and_idle_connections_are_cut_off() {
    let options =
        ServeOptions { header_timeout: Duration::from_millis(300), ..ServeOptions::default() };
    let addr = serve(options).await;
    // Half a request line, then nothing.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let (_, after) = read_to_close(&mut slow, Duration::from_secs(5)).await;
    assert!(after < Duration::from_secs(2), "closed after {after:?}");
    // A kept-alive connection that goes quiet after a request.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let (answer, _) = read_to_close(&mut idle, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_is_refused() {
    let options =
        ServeOptions { body_timeout: Duration::from_millis(300), ..ServeOptions::default() };
    let addr = serve(options).await;
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    let start = Instant::now();
    let mut buf = vec![0u8; 4096];
    let n =
        tokio::time::timeout(Duration::from_secs(5), slow.read(&mut buf)).await.unwrap().unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("did not arrive in time"), "{answer}");
    assert!(start.elapsed() < Duration::from_secs(2));
    // A whole body is fine.
    let mut ok = TcpStream::connect(addr).await.unwrap();
    ok.write_all(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
    )
    .await
    .unwrap();
    let (answer, _) = read_to_close(&mut ok, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with('3'), "{answer}");
}

#[tokio::test]
async fn connections_past_the_limit_wait_for_a_free_slot() {
    let options = ServeOptions { max_connections: 1, ..ServeOptions::default() };
    let addr = serve(options).await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    first.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 1024];
    let n = first.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // The first connection stays open: the second is not served...
    let mut second = TcpStream::connect(addr).await.unwrap();
    second
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let waited = tokio::time::timeout(Duration::from_millis(300), second.read(&mut buf)).await;
    assert!(waited.is_err(), "served past the limit");
    // ...until the first goes away.
    drop(first);
    let (answer, _) = read_to_close(&mut second, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn tls_from_pem_files() {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = std::env::temp_dir().join(format!("kvroute-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let tls = kvroute_http::server::tls_acceptor(&cert_path, &key_path).unwrap();
    let addr = serve(ServeOptions { tls: Some(tls), ..ServeOptions::default() }).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out).await;
    let answer = String::from_utf8_lossy(&out);
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
    // Plain HTTP to the TLS port gets no answer.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("200"));
    std::fs::remove_dir_all(&dir).unwrap();
    // A missing file is a clear error.
    let Err(err) = kvroute_http::server::tls_acceptor(&dir.join("nope.pem"), &key_path) else {
        panic!("a missing certificate file is an error")
    };
    assert!(err.to_string().contains("nope.pem"), "{err}");
}

/// A connection from `source` (another loopback address is another client).
async fn connect_from(source: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

async fn health(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    read_to_close(stream, Duration::from_secs(5)).await.0
}

/// One client holding half-sent requests on every connection it may open cannot take the
/// others' connections: past its share its connections are closed as they come, and another
/// client is served at once; its share comes back as its connections close.
#[tokio::test]
async fn one_client_cannot_hold_more_than_its_share_of_connections() {
    let options = ServeOptions {
        max_connections: 8,
        max_connections_per_client: 3,
        ..ServeOptions::default()
    };
    let addr = serve(options).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        held.push(s);
    }
    let mut over = connect_from("127.0.0.1", addr).await;
    let _ = over.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let (answer, after) = read_to_close(&mut over, Duration::from_secs(2)).await;
    assert!(answer.is_empty() && after < Duration::from_secs(1), "served past its share: {answer}");
    let start = Instant::now();
    let answer = health(&mut connect_from("127.0.0.2", addr).await).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "another client waited {:?}",
        start.elapsed()
    );
    held.clear();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = health(&mut connect_from("127.0.0.1", addr).await).await;
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "its share never came back");
        tokio::task::yield_now().await;
    }
}

/// Request bodies being received are bounded per client and in all: a client whose held
/// bodies pass its share gets a 503 for the next, another client's body still goes through,
/// and the bytes come back when the held bodies go away.
#[tokio::test]
async fn body_bytes_in_flight_are_bounded_per_client_and_in_all() {
    let options = ServeOptions {
        max_body_bytes_in_flight: 3 << 20,
        max_body_bytes_per_client: 2 << 20,
        ..ServeOptions::default()
    };
    let addr = serve(options).await;
    let chunk = vec![b'a'; 1 << 20];
    let post = |n: usize| {
        format!(
            "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
        )
    };
    // Two bodies of 1 MiB + 1 sent but for their last byte: the client's share is used.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(post((1 << 20) + 1).as_bytes()).await.unwrap();
        s.write_all(&chunk).await.unwrap();
        held.push(s);
    }
    // A small body (read whole at once, so the refusal leaves nothing unread to reset the
    // connection) once the held ones are in.
    let deadline = Instant::now() + Duration::from_secs(10);
    let refused = loop {
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(post(4096).as_bytes()).await.unwrap();
        s.write_all(&chunk[..4096]).await.unwrap();
        let (answer, _) = read_to_close(&mut s, Duration::from_secs(5)).await;
        if answer.starts_with("HTTP/1.1 503") {
            break answer;
        }
        assert!(Instant::now() < deadline, "the client's share was never full: {answer}");
    };
    assert!(refused.contains("in flight"), "{refused}");
    // Another client: within the total.
    let mut other = connect_from("127.0.0.2", addr).await;
    other.write_all(post(1 << 19).as_bytes()).await.unwrap();
    other.write_all(&chunk[..1 << 19]).await.unwrap();
    let (answer, _) = read_to_close(&mut other, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The held bodies gone, their bytes are free again.
    held.clear();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(post(1 << 20).as_bytes()).await.unwrap();
        s.write_all(&chunk).await.unwrap();
        let (answer, _) = read_to_close(&mut s, Duration::from_secs(5)).await;
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "the bytes never came back: {answer}");
    }
}

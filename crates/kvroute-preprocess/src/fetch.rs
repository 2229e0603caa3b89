//! Fetching `http://` image URLs, so the server is no relay into private networks (feature
//! `fetch`).
//!
//! The host is resolved first; unless private addresses are allowed, a loopback, private,
//! link-local, unspecified, multicast or otherwise non-global address is refused, and the
//! connection goes to the address that was checked (no second lookup to be rebound). Redirects
//! are not followed; the body is capped in size and the whole fetch in time.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, Uri};
use tokio::net::TcpStream;

use crate::PreprocessError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FetchConfig {
    pub max_bytes: usize,
    pub timeout: Duration,
    /// Allow loopback and private addresses (tests, trusted fleets).
    pub allow_private: bool,
}

impl Default for FetchConfig {
    fn default() -> Self {
        Self { max_bytes: 20 << 20, timeout: Duration::from_secs(10), allow_private: false }
    }
}

fn fetch_err(message: impl Into<String>) -> PreprocessError {
    PreprocessError::Image(message.into())
}

/// Whether an address is on the public internet (what may be fetched by default).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (64..128).contains(&o[1])) // shared address space
                || (o[0] == 198 && (o[1] == 18 || o[1] == 19)) // benchmarking
                || o[0] >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00 // unique local
                || (first & 0xffc0) == 0xfe80) // link local
        }
    }
}

/// Fetches `url` (http only) under `config`'s limits.
pub async fn fetch(url: &str, config: &FetchConfig) -> Result<Vec<u8>, PreprocessError> {
    match tokio::time::timeout(config.timeout, fetch_inner(url, config)).await {
        Ok(result) => result,
        Err(_) => Err(fetch_err(format!("fetching {url}: no answer within {:?}", config.timeout))),
    }
}

async fn fetch_inner(url: &str, config: &FetchConfig) -> Result<Vec<u8>, PreprocessError> {
    let uri: Uri = url.parse().map_err(|e| fetch_err(format!("bad image URL {url:?}: {e}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(fetch_err(
                "https image URLs are not supported by this build; send the image as a data: URL",
            ));
        }
        _ => return Err(fetch_err(format!("unsupported image URL {url:?}: use http:// or data:"))),
    }
    let host = uri.host().ok_or_else(|| fetch_err(format!("image URL {url:?} has no host")))?;
    let port = uri.port_u16().unwrap_or(80);
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((bare, port))
        .await
        .map_err(|e| fetch_err(format!("resolving {host}: {e}")))?
        .collect();
    let addr = addrs
        .iter()
        .copied()
        .find(|a| config.allow_private || is_public(a.ip()))
        .ok_or_else(|| fetch_err(format!("image host {host} resolves only to private or local addresses, which are not fetched")))?;
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| fetch_err(format!("connecting to {host}: {e}")))?;
    let io = hyper_io::TokioIo(stream);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| fetch_err(format!("talking to {host}: {e}")))?;
    tokio::spawn(connection);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let authority = uri.authority().map_or(host, |a| a.as_str());
    let request = Request::get(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::USER_AGENT, "kvroute")
        .body(Empty::<Bytes>::new())
        .map_err(|e| fetch_err(format!("building the request for {url}: {e}")))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| fetch_err(format!("fetching {url}: {e}")))?;
    if !response.status().is_success() {
        return Err(fetch_err(format!(
            "fetching {url}: HTTP {} (redirects are not followed)",
            response.status()
        )));
    }
    let limited = Limited::new(response.into_body(), config.max_bytes);
    match limited.collect().await {
        Ok(body) => Ok(body.to_bytes().to_vec()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(PreprocessError::ImageTooLarge { limit: config.max_bytes })
        }
        Err(e) => Err(fetch_err(format!("reading {url}: {e}"))),
    }
}

/// hyper 1 speaks its own I/O traits; this adapts a tokio stream to them.
mod hyper_io {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    pub(super) struct TokioIo<T>(pub(super) T);

    impl<T: AsyncRead + Unpin> hyper::rt::Read for TokioIo<T> {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            mut buf: hyper::rt::ReadBufCursor<'_>,
        ) -> Poll<std::io::Result<()>> {
            // Read into a stack buffer, then copy: no uninitialised memory is exposed.
            let mut tmp = [0u8; 8192];
            let want = tmp.len().min(buf.remaining());
            let mut read_buf = ReadBuf::new(&mut tmp[..want]);
            match Pin::new(&mut self.get_mut().0).poll_read(cx, &mut read_buf) {
                Poll::Ready(Ok(())) => {
                    buf.put_slice(read_buf.filled());
                    Poll::Ready(Ok(()))
                }
                other => other,
            }
        }
    }

    impl<T: AsyncWrite + Unpin> hyper::rt::Write for TokioIo<T> {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_flush(cx)
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use axum::Router;
    use axum::routing::get;

    use super::*;

    #[test]
    fn private_and_local_addresses_are_not_public() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "192.168.0.1",
            "172.16.5.4",
            "169.254.1.1",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fc00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        assert!(is_public(IpAddr::V4(Ipv4Addr::new(93, 184, 216, 34))));
    }

    #[tokio::test]
    async fn fetches_from_loopback_only_when_allowed() {
        let app = Router::new()
            .route("/img.png", get(|| async { vec![1u8, 2, 3, 4] }))
            .route("/big.png", get(|| async { vec![0u8; 4096] }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(axum::serve(listener, app).into_future());
        let allowed = FetchConfig { allow_private: true, ..FetchConfig::default() };
        assert_eq!(
            fetch(&format!("http://{addr}/img.png"), &allowed).await.unwrap(),
            vec![1, 2, 3, 4]
        );
        let refused =
            fetch(&format!("http://{addr}/img.png"), &FetchConfig::default()).await.unwrap_err();
        assert!(refused.to_string().contains("private or local"), "{refused}");
        let missing = fetch(&format!("http://{addr}/nope.png"), &allowed).await.unwrap_err();
        assert!(missing.to_string().contains("404"), "{missing}");
        let small = FetchConfig { max_bytes: 100, ..allowed };
        assert!(matches!(
            fetch(&format!("http://{addr}/big.png"), &small).await,
            Err(PreprocessError::ImageTooLarge { .. })
        ));
        assert!(
            fetch("https://example.invalid/x.png", &allowed)
                .await
                .unwrap_err()
                .to_string()
                .contains("https")
        );
        assert!(fetch("ftp://x/y", &allowed).await.is_err());
    }
}

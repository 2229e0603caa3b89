//! Fetching `http://` and `https://` image URLs, so the server is no relay into private
//! networks (feature `fetch`). TLS is rustls with the public web roots (webpki-roots), plus
//! any roots configured.
//!
//! The host is resolved first; unless private addresses are allowed, a loopback, private,
//! link-local, unspecified, multicast or otherwise non-global address is refused, and the
//! connection goes to the address that was checked (no second lookup to be rebound). Redirects
//! are not followed; the body is capped in size and the whole fetch in time.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, Uri};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

pub use crate::error::FetchError;

use crate::PreprocessError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchConfig {
    pub max_bytes: usize,
    pub timeout: Duration,
    /// Allow loopback and private addresses (tests, trusted fleets).
    pub allow_private: bool,
    /// DER certificates trusted for https besides the public roots (a private CA).
    pub extra_roots: Vec<Vec<u8>>,
}

impl Default for FetchConfig {
    fn default() -> Self {
        Self {
            max_bytes: 20 << 20,
            timeout: Duration::from_secs(10),
            allow_private: false,
            extra_roots: Vec::new(),
        }
    }
}

/// Fetches images under a [`FetchConfig`]; cheap to clone.
#[derive(Clone, Debug)]
pub struct Fetcher {
    config: FetchConfig,
    tls: Arc<rustls::ClientConfig>,
}

impl Fetcher {
    pub fn new(config: FetchConfig) -> Result<Self, PreprocessError> {
        let mut roots =
            rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for der in &config.extra_roots {
            roots
                .add(CertificateDer::from(der.clone()))
                .map_err(|source| FetchError::RootCertificate { source })?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|source| FetchError::TlsSetup { source })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self { config, tls: Arc::new(tls) })
    }

    pub fn config(&self) -> &FetchConfig {
        &self.config
    }

    /// Fetches `url` (http or https) under the configured limits.
    pub async fn fetch(&self, url: &str) -> Result<Vec<u8>, PreprocessError> {
        match tokio::time::timeout(self.config.timeout, self.fetch_inner(url)).await {
            Ok(result) => result,
            Err(_) => {
                Err(FetchError::Timeout { url: url.to_owned(), after: self.config.timeout }.into())
            }
        }
    }
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
            let s = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                IpAddr::V4(std::net::Ipv4Addr::new(
                    (hi >> 8) as u8,
                    hi as u8,
                    (lo >> 8) as u8,
                    lo as u8,
                ))
            };
            // Addresses that carry an IPv4 address are judged by it: IPv4-compatible
            // (`::a.b.c.d`, which some stacks still route to the IPv4 host), NAT64's
            // well-known prefix (`64:ff9b::/96`) and 6to4 (`2002::/16`).
            if s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified() {
                return is_public(embedded(s[6], s[7]));
            }
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return is_public(embedded(s[6], s[7]));
            }
            if s[0] == 0x2002 {
                return is_public(embedded(s[1], s[2]));
            }
            let first = s[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00 // unique local
                || (first & 0xffc0) == 0xfe80 // link local
                || (first & 0xffc0) == 0xfec0 // site local (deprecated, still routed by some)
                || (s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1) // local-use NAT64, 64:ff9b:1::/48
                || (s[0] == 0x100 && s[1..4] == [0, 0, 0]) // discard-only, 100::/64
                || (s[0] == 0x2001 && s[1] == 0) // Teredo, 2001::/32 (a tunnel to IPv4)
                || (s[0] == 0x2001 && s[1] == 0xdb8)) // documentation
        }
    }
}

impl Fetcher {
    async fn fetch_inner(&self, url: &str) -> Result<Vec<u8>, PreprocessError> {
        let config = &self.config;
        let uri: Uri =
            url.parse().map_err(|source| FetchError::BadUrl { url: url.to_owned(), source })?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(FetchError::Scheme(url.to_owned()).into());
            }
        };
        let host = uri.host().ok_or_else(|| FetchError::NoHost(url.to_owned()))?;
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((bare, port))
            .await
            .map_err(|source| FetchError::Resolve { host: host.to_owned(), source })?
            .collect();
        let addr = addrs
            .iter()
            .copied()
            .find(|a| config.allow_private || is_public(a.ip()))
            .ok_or_else(|| FetchError::Private(host.to_owned()))?;
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| FetchError::Connect { host: host.to_owned(), source })?;
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let authority = uri.authority().map_or(host, |a| a.as_str());
        if tls {
            let name = ServerName::try_from(bare.to_owned())
                .map_err(|source| FetchError::TlsName { name: bare.to_owned(), source })?;
            let stream = tokio_rustls::TlsConnector::from(Arc::clone(&self.tls))
                .connect(name, stream)
                .await
                .map_err(|source| FetchError::Tls { host: host.to_owned(), source })?;
            get(stream, url, authority, path, config.max_bytes).await
        } else {
            get(stream, url, authority, path, config.max_bytes).await
        }
    }
}

/// One GET over an established connection, the body capped at `max_bytes`.
async fn get<S>(
    io: S,
    url: &str,
    authority: &str,
    path: &str,
    max_bytes: usize,
) -> Result<Vec<u8>, PreprocessError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|source| FetchError::Handshake { authority: authority.to_owned(), source })?;
    tokio::spawn(connection);
    let request = Request::get(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::USER_AGENT, "kvroute")
        .body(Empty::<Bytes>::new())
        .map_err(|source| FetchError::Request { url: url.to_owned(), source })?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|source| FetchError::Send { url: url.to_owned(), source })?;
    if !response.status().is_success() {
        return Err(FetchError::Status { url: url.to_owned(), status: response.status() }.into());
    }
    match Limited::new(response.into_body(), max_bytes).collect().await {
        Ok(body) => Ok(body.to_bytes().to_vec()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(PreprocessError::ImageTooLarge { limit: max_bytes })
        }
        Err(source) => Err(FetchError::Read { url: url.to_owned(), source }.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use axum::Router;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
            // #51 finding 13: IPv4-compatible, NAT64 and site-local forms.
            "::127.0.0.1",
            "::10.0.0.1",
            "64:ff9b::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "fec0::1",
            "feff::1",
            "2002:7f00:1::1",
            "2002:c0a8:101::1",
            "2001::1",
            "2001:db8::1",
            "100::1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        assert!(is_public(IpAddr::V4(Ipv4Addr::new(93, 184, 216, 34))));
        for ip in ["2606:4700::1111", "64:ff9b::5db8:d822", "::5db8:d822", "2002:5db8:d822::1"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
    }

    fn fetcher(allow_private: bool, max_bytes: usize, extra_roots: Vec<Vec<u8>>) -> Fetcher {
        Fetcher::new(FetchConfig {
            allow_private,
            max_bytes,
            extra_roots,
            ..FetchConfig::default()
        })
        .unwrap()
    }

    #[tokio::test]
    async fn fetches_from_loopback_only_when_allowed() {
        let app = Router::new()
            .route("/img.png", get(|| async { vec![1u8, 2, 3, 4] }))
            .route("/big.png", get(|| async { vec![0u8; 4096] }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(axum::serve(listener, app).into_future());
        let allowed = fetcher(true, 1 << 20, Vec::new());
        assert_eq!(
            allowed.fetch(&format!("http://{addr}/img.png")).await.unwrap(),
            vec![1, 2, 3, 4]
        );
        let refused = fetcher(false, 1 << 20, Vec::new())
            .fetch(&format!("http://{addr}/img.png"))
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("private or local"), "{refused}");
        let missing = allowed.fetch(&format!("http://{addr}/nope.png")).await.unwrap_err();
        assert!(missing.to_string().contains("404"), "{missing}");
        let small = fetcher(true, 100, Vec::new());
        assert!(matches!(
            small.fetch(&format!("http://{addr}/big.png")).await,
            Err(PreprocessError::ImageTooLarge { .. })
        ));
        assert!(allowed.fetch("ftp://x/y").await.is_err());
    }

    #[tokio::test]
    async fn fetches_over_tls_from_a_trusted_server_only() {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let der = cert.cert.der().to_vec();
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![CertificateDer::from(der.clone())], key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            // Bounded: two connections, then the task ends.
            for _ in 0..2 {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let Ok(mut tls) = acceptor.accept(tcp).await else { continue };
                let mut buf = [0u8; 1024];
                let _ = tls.read(&mut buf).await;
                let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc";
                let _ = tls.write_all(reply).await;
                let _ = tls.shutdown().await;
            }
        });
        let url = format!("https://localhost:{port}/img.png");
        assert_eq!(fetcher(true, 1 << 20, vec![der]).fetch(&url).await.unwrap(), b"abc");
        let err = fetcher(true, 1 << 20, Vec::new()).fetch(&url).await.unwrap_err().to_string();
        assert!(err.contains("TLS"), "an unknown certificate is refused: {err}");
    }
}

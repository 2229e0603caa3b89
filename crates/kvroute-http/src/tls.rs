//! TLS configurations for kvroute's listeners (rustls with ring): a certificate and key from
//! PEM files, reread when either file changes (a Kubernetes Secret is swapped in place, and a
//! listener must not be restarted to take a renewed certificate), or a self-signed one drawn
//! at start, as the Gateway API Inference Extension's picker serves when given none (gateways
//! in front of a picker do not verify it by default).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

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
    #[error("drawing a self-signed certificate: {0}")]
    Generate(String),
}

/// How often the files are looked at (their modification times), at most: on a handshake.
pub const RECHECK: Duration = Duration::from_secs(1);

/// A certificate chain and key read from PEM files.
pub fn read_pem(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let path = |p: &Path| p.display().to_string();
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Certs { path: path(cert), source })?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|source| TlsError::Key { path: path(key), source })?;
    let signer = any_supported_type(&key)?;
    let certified = CertifiedKey::new(certs, signer);
    certified.keys_match()?;
    Ok(certified)
}

/// A certificate from files, reread when they change; the last good one is kept when a new
/// one cannot be read (a half-written pair, a key that does not match).
#[derive(Debug)]
pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<Loaded>,
    recheck: Duration,
}

#[derive(Debug)]
struct Loaded {
    certified: Arc<CertifiedKey>,
    seen: (Option<SystemTime>, Option<SystemTime>),
    checked: Instant,
    reloads: u64,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl CertFiles {
    /// Reads the pair now (an error when it cannot be read).
    pub fn new(cert: &Path, key: &Path) -> Result<Arc<Self>, TlsError> {
        Self::rechecked(cert, key, RECHECK)
    }

    /// [`CertFiles::new`], looking at the files at most every `recheck`.
    pub fn rechecked(cert: &Path, key: &Path, recheck: Duration) -> Result<Arc<Self>, TlsError> {
        let seen = (modified(cert), modified(key));
        let certified = Arc::new(read_pem(cert, key)?);
        let state = Mutex::new(Loaded { certified, seen, checked: Instant::now(), reloads: 0 });
        Ok(Arc::new(Self { cert: cert.to_owned(), key: key.to_owned(), state, recheck }))
    }

    /// How many times a changed pair was taken.
    pub fn reloads(&self) -> u64 {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).reloads
    }

    /// The certificate to serve, reread first when the files changed since last looked at
    /// (at most every `recheck`).
    pub fn current(&self) -> Arc<CertifiedKey> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.checked.elapsed() >= self.recheck {
            state.checked = Instant::now();
            let seen = (modified(&self.cert), modified(&self.key));
            if seen != state.seen {
                state.seen = seen;
                match read_pem(&self.cert, &self.key) {
                    Ok(c) => {
                        state.certified = Arc::new(c);
                        state.reloads += 1;
                        tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                    }
                    Err(e) => tracing::warn!(
                        cert = %self.cert.display(), error = ?e,
                        "TLS certificate changed but cannot be read: the last one kept"
                    ),
                }
            }
        }
        Arc::clone(&state.certified)
    }
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A server configuration over `resolver`, offering `alpn` (`h2` for gRPC).
pub fn server_config(
    resolver: Arc<dyn ResolvesServerCert>,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A certificate that always resolves to one [`CertifiedKey`].
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

/// A server configuration serving `certified` always, offering `alpn`.
pub fn fixed_config(
    certified: CertifiedKey,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    server_config(Arc::new(Fixed(Arc::new(certified))), alpn)
}

/// A self-signed certificate for `names` (and `localhost`), drawn now, with its PEM (for a
/// client that wants to pin it), as a server configuration offering `alpn`.
pub fn self_signed(
    names: &[String],
    alpn: &[&[u8]],
) -> Result<(Arc<rustls::ServerConfig>, String), TlsError> {
    let mut names = names.to_vec();
    names.push("localhost".to_owned());
    let generated =
        rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Generate(e.to_string()))?;
    let pem = generated.cert.pem();
    let key = PrivateKeyDer::try_from(generated.signing_key.serialize_der())
        .map_err(|e| TlsError::Generate(e.to_owned()))?;
    let certified =
        CertifiedKey::new(vec![generated.cert.der().clone()], any_supported_type(&key)?);
    Ok((fixed_config(certified, alpn)?, pem))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf, String) {
        let generated = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, generated.cert.pem()).unwrap();
        std::fs::write(&key, generated.signing_key.serialize_pem()).unwrap();
        (cert, key, generated.cert.pem())
    }

    #[test]
    fn a_changed_pair_is_taken_and_a_broken_one_leaves_the_last() {
        let dir = std::env::temp_dir().join(format!("kvroute-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key, _) = write_pair(&dir, "first.example");
        let files = CertFiles::rechecked(&cert, &key, Duration::ZERO).unwrap();
        let first = files.current();
        // Renewed: a new pair, seen at the next handshake.
        write_pair(&dir, "second.example");
        let second = files.current();
        assert_ne!(first.cert[0], second.cert[0]);
        assert_eq!(files.reloads(), 1);
        // Broken: the last good one stays.
        std::fs::write(&key, "not a key").unwrap();
        assert_eq!(files.current().cert[0], second.cert[0]);
        assert_eq!(files.reloads(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_self_signed_certificate_is_drawn_for_its_names() {
        let (config, pem) = self_signed(&["picker.example".to_owned()], &[b"h2"]).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"h2".to_vec()]);
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
    }
}

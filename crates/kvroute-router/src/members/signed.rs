//! A registration in the members' bucket, signed: only who holds the fleet's registration key
//! can make one that a router takes (docs/security.md, "The control plane").
//!
//! The value is JSON: `{"v": 1, "worker": "<the worker, JSON text>", "at_ms": <when it was
//! made, Unix ms>, "mac": "<hex>"}`. The MAC is BLAKE3 in keyed mode, its key derived from
//! the key file's bytes, over the bucket's name, the entry's key, `at_ms` and the worker's
//! text exactly as written. So a value cannot be moved to another key or bucket, changed, or
//! forged without the key; and one older than the time to live (plus [`CLOCK_SKEW`]) is stale:
//! a value copied from the bucket and written again later never joins, and one written again
//! before that names the same worker it named. The worker's id is made from its URL (else its
//! events endpoint), never taken from the value, and its key in the bucket must be `w<id>`:
//! one entry per worker. With allowed ranges, every endpoint of the worker must be an IP
//! address inside one.

use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::template::id_for;
use crate::config::WorkerSpec;

/// Largest registration read (a worker's description is a few hundred bytes).
pub const MAX_ENTRY_BYTES: usize = 16 * 1024;

/// How far a registration's clock may be from a router's.
pub const CLOCK_SKEW: Duration = Duration::from_secs(30);

/// The fleet's registration key (from `--members-key-file`): the routers check with it, the
/// sidecars sign with it.
#[derive(Clone)]
pub struct MembersKey([u8; 32]);

impl std::fmt::Debug for MembersKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MembersKey(..)")
    }
}

impl MembersKey {
    /// The shortest secret taken (a passphrase shorter than this is guessable).
    pub const MIN_SECRET: usize = 16;

    /// The key made from a secret (a key file's bytes, surrounding white space left out).
    pub fn from_secret(secret: &[u8]) -> Result<Self, RegistrationError> {
        let secret = secret.trim_ascii();
        if secret.len() < Self::MIN_SECRET {
            return Err(RegistrationError::ShortKey(secret.len()));
        }
        Ok(Self(blake3::derive_key("kvroute members v1 registration key", secret)))
    }

    fn mac(&self, bucket: &str, key: &str, at_ms: u64, worker: &str) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        for part in [bucket, key, &at_ms.to_string(), worker] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        h.finalize()
    }
}

/// Address ranges a registered worker's endpoints must be in (`--members-allow`), e.g.
/// `10.0.0.0/8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressRange {
    net: IpAddr,
    bits: u8,
}

impl std::str::FromStr for AddressRange {
    type Err = RegistrationError;

    fn from_str(s: &str) -> Result<Self, RegistrationError> {
        let bad = || RegistrationError::Range(s.to_owned());
        let (net, bits) = s.trim().split_once('/').ok_or_else(bad)?;
        let net: IpAddr = net.parse().map_err(|_| bad())?;
        let bits: u8 = bits.parse().map_err(|_| bad())?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        if bits > max {
            return Err(bad());
        }
        Ok(Self { net, bits })
    }
}

impl std::fmt::Display for AddressRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.net, self.bits)
    }
}

impl AddressRange {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let (a, b, width) = match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(i)) => {
                (u128::from(u32::from(n)), u128::from(u32::from(i)), 32)
            }
            (IpAddr::V6(n), IpAddr::V6(i)) => (u128::from(n), u128::from(i), 128),
            _ => return false,
        };
        let bits = u32::from(self.bits);
        if bits == 0 {
            return true;
        }
        let shift = width - bits;
        (a >> shift) == (b >> shift)
    }
}

/// Why a registration is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistrationError {
    #[error("{0} bytes (at most {MAX_ENTRY_BYTES})")]
    TooLarge(usize),
    #[error("not a signed registration (made by `kvroute register --members-key-file`): {0}")]
    Shape(String),
    #[error("its signature is not the fleet's registration key's")]
    Forged,
    #[error("made {0} s from now: stale (a copy written again) or from a clock far off")]
    Stale(i64),
    #[error("its key is {got}, the worker's is {want}")]
    Key { got: String, want: String },
    #[error("the worker: {0}")]
    Worker(String),
    #[error("a worker's token does not belong in the shared bucket")]
    Token,
    #[error("its endpoint {0} is not an address in the allowed ranges")]
    Outside(String),
    #[error("the registration key is {0} bytes: at least 16 are needed")]
    ShortKey(usize),
    #[error("an address range is ADDRESS/BITS, e.g. 10.0.0.0/8: {0}")]
    Range(String),
}

/// A registration as the bucket holds it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Signed {
    v: u32,
    worker: String,
    at_ms: u64,
    mac: String,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The bucket key of a worker: `w<id>`.
pub fn key_of(spec: &WorkerSpec) -> String {
    format!("w{}", spec.id)
}

/// The worker a description names, its id made from its URL (else its events endpoint),
/// whatever id the description carries; never with a token.
pub fn worker_of(description: &[u8]) -> Result<WorkerSpec, RegistrationError> {
    let mut json: serde_json::Value = serde_json::from_slice(description)
        .map_err(|e| RegistrationError::Worker(e.to_string()))?;
    let object =
        json.as_object_mut().ok_or_else(|| RegistrationError::Worker("not an object".into()))?;
    let address = ["url", "events"].iter().find_map(|k| object.get(*k)?.as_str());
    let address = address.ok_or_else(|| RegistrationError::Worker("no url or events".into()))?;
    let id = id_for(address);
    object.insert("id".into(), serde_json::json!(id.0));
    if object.contains_key("api_key") {
        return Err(RegistrationError::Token);
    }
    serde_json::from_value(json).map_err(|e| RegistrationError::Worker(e.to_string()))
}

/// `spec`'s registration under `bucket`, signed with `key` now; its bucket key is
/// [`key_of`] the worker (its id made from its URL).
pub fn sign(
    key: &MembersKey,
    bucket: &str,
    spec: &serde_json::Value,
) -> Result<(String, Vec<u8>), RegistrationError> {
    sign_at(key, bucket, spec, now_ms())
}

/// [`sign`] as made at `at_ms` (Unix ms): what a copy of an old registration is.
pub fn sign_at(
    key: &MembersKey,
    bucket: &str,
    spec: &serde_json::Value,
    at_ms: u64,
) -> Result<(String, Vec<u8>), RegistrationError> {
    let mut spec = spec.clone();
    if let Some(o) = spec.as_object_mut() {
        o.remove("id");
    }
    let worker = spec.to_string();
    let parsed = worker_of(worker.as_bytes())?;
    let entry = key_of(&parsed);
    let mac = key.mac(bucket, &entry, at_ms, &worker).to_hex().to_string();
    let value = serde_json::to_vec(&Signed { v: 1, worker, at_ms, mac })
        .map_err(|e| RegistrationError::Shape(e.to_string()))?;
    if value.len() > MAX_ENTRY_BYTES {
        return Err(RegistrationError::TooLarge(value.len()));
    }
    Ok((entry, value))
}

/// What a router checks a registration against.
#[derive(Clone, Debug)]
pub struct Verifier {
    pub key: MembersKey,
    pub bucket: String,
    /// The registrations' time to live: an older one is stale.
    pub ttl: Duration,
    /// When not empty, every endpoint must be an address in one of these.
    pub allow: Vec<AddressRange>,
}

impl Verifier {
    /// The worker the registration under `entry` names, when the fleet's key signed it, it is
    /// fresh, its key is its worker's, and its endpoints are allowed.
    pub fn verify(&self, entry: &str, value: &[u8]) -> Result<WorkerSpec, RegistrationError> {
        self.verify_at(entry, value, now_ms())
    }

    fn verify_at(
        &self,
        entry: &str,
        value: &[u8],
        now_ms: u64,
    ) -> Result<WorkerSpec, RegistrationError> {
        if value.len() > MAX_ENTRY_BYTES {
            return Err(RegistrationError::TooLarge(value.len()));
        }
        let signed: Signed =
            serde_json::from_slice(value).map_err(|e| RegistrationError::Shape(e.to_string()))?;
        if signed.v != 1 {
            return Err(RegistrationError::Shape(format!("version {}", signed.v)));
        }
        let mac = blake3::Hash::from_hex(signed.mac.as_bytes())
            .map_err(|_| RegistrationError::Shape("mac is not 64 hex digits".into()))?;
        // blake3::Hash compares in constant time.
        if mac != self.key.mac(&self.bucket, entry, signed.at_ms, &signed.worker) {
            return Err(RegistrationError::Forged);
        }
        let age_ms = i128::from(now_ms) - i128::from(signed.at_ms);
        let oldest = self.ttl.saturating_add(CLOCK_SKEW).as_millis() as i128;
        if age_ms > oldest || -age_ms > CLOCK_SKEW.as_millis() as i128 {
            return Err(RegistrationError::Stale((-age_ms / 1000) as i64));
        }
        let spec = worker_of(signed.worker.as_bytes())?;
        let want = key_of(&spec);
        if entry != want {
            return Err(RegistrationError::Key { got: entry.to_owned(), want });
        }
        self.allowed(&spec)?;
        Ok(spec)
    }

    /// Every endpoint of `spec` inside the allowed ranges (when there are any).
    fn allowed(&self, spec: &WorkerSpec) -> Result<(), RegistrationError> {
        if self.allow.is_empty() {
            return Ok(());
        }
        let endpoints = [&spec.url, &spec.events, &spec.replay, &spec.metrics];
        for endpoint in endpoints.into_iter().flatten() {
            let inside =
                host_ip(endpoint).is_some_and(|ip| self.allow.iter().any(|r| r.contains(ip)));
            if !inside {
                return Err(RegistrationError::Outside(endpoint.clone()));
            }
        }
        Ok(())
    }
}

/// The IP address an endpoint (`scheme://host:port/...`) names, when its host is one.
fn host_ip(endpoint: &str) -> Option<IpAddr> {
    let rest = endpoint.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next()?;
    if authority.contains('@') {
        return None;
    }
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split_once(']')?.0.parse().ok();
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h).parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key() -> MembersKey {
        MembersKey::from_secret(b"a fleet's registration key\n").unwrap()
    }

    fn verifier(allow: &[&str]) -> Verifier {
        Verifier {
            key: key(),
            bucket: "fleet".into(),
            ttl: Duration::from_secs(10),
            allow: allow.iter().map(|r| r.parse().unwrap()).collect(),
        }
    }

    fn worker() -> serde_json::Value {
        json!({"url": "http://10.1.2.3:8000", "events": "tcp://10.1.2.3:5557"})
    }

    #[test]
    fn a_signed_registration_joins_under_its_urls_id() {
        let (entry, value) = sign(&key(), "fleet", &worker()).unwrap();
        let spec = verifier(&[]).verify(&entry, &value).unwrap();
        assert_eq!(spec.id, id_for("http://10.1.2.3:8000"));
        assert_eq!(entry, format!("w{}", spec.id));
    }

    #[test]
    fn forged_unsigned_moved_changed_and_stale_registrations_are_refused() {
        let v = verifier(&[]);
        let (entry, value) = sign(&key(), "fleet", &worker()).unwrap();
        // Unsigned: the worker as POST /workers takes it.
        let plain = serde_json::to_vec(&worker()).unwrap();
        assert!(matches!(v.verify(&entry, &plain), Err(RegistrationError::Shape(_))));
        // Signed with another key.
        let other = MembersKey::from_secret(b"not the fleet's key at all").unwrap();
        let (_, forged) = sign(&other, "fleet", &worker()).unwrap();
        assert_eq!(v.verify(&entry, &forged).unwrap_err(), RegistrationError::Forged);
        // The worker changed (another URL) under the same signature.
        let mut signed: serde_json::Value = serde_json::from_slice(&value).unwrap();
        signed["worker"] = json!(json!({"url": "http://10.9.9.9:8000"}).to_string());
        let changed = serde_json::to_vec(&signed).unwrap();
        assert_eq!(v.verify(&entry, &changed).unwrap_err(), RegistrationError::Forged);
        // Moved to another key or bucket.
        assert_eq!(v.verify("w1", &value).unwrap_err(), RegistrationError::Forged);
        let elsewhere = Verifier { bucket: "other".into(), ..verifier(&[]) };
        assert_eq!(elsewhere.verify(&entry, &value).unwrap_err(), RegistrationError::Forged);
        // A copy written again after the time to live and the skew.
        let later = now_ms() + 41_000;
        assert!(matches!(v.verify_at(&entry, &value, later), Err(RegistrationError::Stale(_))));
        assert!(v.verify_at(&entry, &value, now_ms() + 39_000).is_ok());
        // From a clock far ahead.
        let earlier = now_ms() - 31_000;
        assert!(matches!(v.verify_at(&entry, &value, earlier), Err(RegistrationError::Stale(_))));
    }

    #[test]
    fn an_id_in_the_value_is_ignored_and_a_token_refused() {
        let mut w = worker();
        w["id"] = json!(7);
        let (entry, value) = sign(&key(), "fleet", &w).unwrap();
        assert_eq!(
            verifier(&[]).verify(&entry, &value).unwrap().id,
            id_for("http://10.1.2.3:8000")
        );
        assert_eq!(
            worker_of(br#"{"id": 7, "url": "http://a:1"}"#).unwrap().id,
            id_for("http://a:1")
        );
        let token = br#"{"url": "http://a:1", "api_key": "x"}"#;
        assert_eq!(worker_of(token).unwrap_err(), RegistrationError::Token);
    }

    #[test]
    fn endpoints_outside_the_allowed_ranges_are_refused() {
        let (entry, value) = sign(&key(), "fleet", &worker()).unwrap();
        assert!(verifier(&["10.0.0.0/8"]).verify(&entry, &value).is_ok());
        let refused = verifier(&["10.1.3.0/24", "fd00::/8"]).verify(&entry, &value);
        assert_eq!(refused.unwrap_err(), RegistrationError::Outside("http://10.1.2.3:8000".into()));
        let named =
            json!({"url": "http://10.1.2.3:8000", "metrics": "http://metadata.internal/x?y=1"});
        let (entry, value) = sign(&key(), "fleet", &named).unwrap();
        assert!(matches!(
            verifier(&["10.0.0.0/8"]).verify(&entry, &value),
            Err(RegistrationError::Outside(_))
        ));
    }

    #[test]
    fn ranges_parse_and_contain_as_written() {
        let r: AddressRange = "127.0.0.0/8".parse().unwrap();
        assert!(r.contains("127.9.9.9".parse().unwrap()));
        assert!(!r.contains("128.0.0.1".parse().unwrap()));
        assert!(!r.contains("::1".parse().unwrap()));
        assert!("0.0.0.0/0".parse::<AddressRange>().unwrap().contains("8.8.8.8".parse().unwrap()));
        let v6: AddressRange = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "::/129"] {
            assert!(bad.parse::<AddressRange>().is_err(), "{bad}");
        }
        assert_eq!(host_ip("http://[fd00::1]:80/x"), "fd00::1".parse().ok());
        assert_eq!(host_ip("http://user@10.0.0.1:80"), None);
        assert_eq!(MembersKey::from_secret(b"short").unwrap_err(), RegistrationError::ShortKey(5));
    }
}

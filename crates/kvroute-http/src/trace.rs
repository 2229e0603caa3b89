//! W3C trace context (<https://www.w3.org/TR/trace-context/>): a request's `traceparent` and
//! `tracestate` read from the client or the gateway, and the context passed on to an engine as
//! the child of kvroute's own span, so that the engine's spans (vLLM continues a
//! `traceparent` it receives) join the client's trace.
//!
//! Untrusted bytes: a `traceparent` that is not exactly the format (version `00`, or a later
//! version's first four fields), an all-zero trace or parent id, or upper-case hex is ignored
//! whole, and kvroute neither continues nor starts a trace for it. A `tracestate` is kept only
//! beside a valid `traceparent`, and only when it is at most [`MAX_TRACESTATE_BYTES`] long,
//! holds at most [`MAX_TRACESTATE_MEMBERS`] members, and each member is a `key=value` of the
//! allowed characters; otherwise it is dropped and the `traceparent` alone goes on.

use std::hash::BuildHasher;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderMap, HeaderValue};

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// The most list members a `tracestate` may hold (the specification's bound).
pub const MAX_TRACESTATE_MEMBERS: usize = 32;
/// The longest `tracestate` kept, bytes (the specification asks that at least 512 be passed on;
/// a longer one is dropped rather than cut inside a member).
pub const MAX_TRACESTATE_BYTES: usize = 512;
/// The longest `traceparent` read (a later version may append fields).
const MAX_TRACEPARENT_BYTES: usize = 256;

/// A request's place in a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    /// The span this one is a child of (the caller's).
    pub parent_id: [u8; 8],
    /// `sampled` is bit 0.
    pub flags: u8,
    pub state: Option<HeaderValue>,
}

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != N * 2 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `state` is a `tracestate` to keep (see the module docs).
fn valid_state(state: &str) -> bool {
    if state.len() > MAX_TRACESTATE_BYTES {
        return false;
    }
    let members: Vec<&str> =
        state.split(',').map(|m| m.trim_matches([' ', '\t'])).filter(|m| !m.is_empty()).collect();
    if members.is_empty() || members.len() > MAX_TRACESTATE_MEMBERS {
        return false;
    }
    members.iter().all(|m| {
        let Some((key, value)) = m.split_once('=') else { return false };
        let key_ok = !key.is_empty()
            && key.len() <= 256
            && key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/@".contains(&b));
        let value_ok = !value.is_empty()
            && value.len() <= 256
            && value.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
            && !value.ends_with(' ');
        key_ok && value_ok
    })
}

impl TraceContext {
    /// The context a `traceparent` value names (untrusted bytes: see the module docs), with
    /// no `tracestate`; `None` when it is not exactly the format.
    pub fn from_traceparent(parent: &str) -> Option<Self> {
        if parent.len() > MAX_TRACEPARENT_BYTES {
            return None;
        }
        let mut fields = parent.split('-');
        let version = hex::<1>(fields.next()?)?[0];
        let trace_id = hex::<16>(fields.next()?)?;
        let parent_id = hex::<8>(fields.next()?)?;
        let flags = hex::<1>(fields.next()?)?[0];
        let rest_ok = match version {
            0xff => false,
            0x00 => fields.next().is_none(),
            // A later version may add fields after these four.
            _ => true,
        };
        if !rest_ok || trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(Self { trace_id, parent_id, flags, state: None })
    }

    /// The context of a request's headers; `None` without a valid `traceparent`.
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let mut parents = headers.get_all(TRACEPARENT).iter();
        let parent = parents.next()?;
        if parents.next().is_some() {
            return None;
        }
        let parsed = Self::from_traceparent(parent.to_str().ok()?)?;
        let mut states = headers.get_all(TRACESTATE).iter();
        let state = match (states.next(), states.next()) {
            (Some(s), None) => s.to_str().ok().filter(|s| valid_state(s)).map(|_| s.clone()),
            _ => None,
        };
        Some(Self { state, ..parsed })
    }

    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The same trace, as the child of `span_id` (kvroute's span).
    pub fn child(&self, span_id: [u8; 8]) -> Self {
        Self { parent_id: span_id, ..self.clone() }
    }

    /// Its `traceparent` header value.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-{:02x}", to_hex(&self.trace_id), to_hex(&self.parent_id), self.flags)
    }

    /// Adds its headers to `headers` (replacing any there).
    pub fn write(&self, headers: &mut HeaderMap) {
        if let Ok(v) = HeaderValue::from_str(&self.traceparent()) {
            headers.insert(TRACEPARENT, v);
        }
        match &self.state {
            Some(state) => {
                headers.insert(TRACESTATE, state.clone());
            }
            None => {
                headers.remove(TRACESTATE);
            }
        }
    }
}

/// A new span id: never zero, unlikely to repeat (a per-process random hash of a counter).
pub fn new_span_id() -> [u8; 8] {
    static SEED: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let id = SEED.get_or_init(Default::default).hash_one(n);
    (if id == 0 { 1 } else { id }).to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            let name = axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap();
            h.append(name, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_traceparent_is_continued_as_the_child_of_kvroutes_span() {
        let t = TraceContext::from_headers(&headers(&[
            (TRACEPARENT, PARENT),
            (TRACESTATE, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        ]))
        .unwrap();
        assert!(t.sampled());
        let span = [1, 2, 3, 4, 5, 6, 7, 8];
        let child = t.child(span);
        assert_eq!(child.traceparent(), "00-4bf92f3577b34da6a3ce929d0e0e4736-0102030405060708-01");
        let mut out = HeaderMap::new();
        child.write(&mut out);
        assert_eq!(out[TRACESTATE], "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7");
        // A later version's extra fields are read past.
        let v1 = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra";
        let later = TraceContext::from_headers(&headers(&[(TRACEPARENT, v1)])).unwrap();
        assert!(!later.sampled());
        assert!(later.traceparent().starts_with("00-"));
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        let long = format!("{PARENT}{}", "-x".repeat(200));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            long.as_str(),
        ] {
            assert_eq!(TraceContext::from_headers(&headers(&[(TRACEPARENT, bad)])), None, "{bad}");
        }
        // Two traceparents: which is meant cannot be told.
        assert_eq!(
            TraceContext::from_headers(&headers(&[(TRACEPARENT, PARENT), (TRACEPARENT, PARENT)])),
            None
        );
        // Not UTF-8.
        let mut h = HeaderMap::new();
        h.insert(TRACEPARENT, HeaderValue::from_bytes(b"00-\xff").unwrap());
        assert_eq!(TraceContext::from_headers(&h), None);
    }

    #[test]
    fn hostile_tracestates_are_dropped_and_the_traceparent_kept() {
        let thousand: String = (0..1000).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join(",");
        let oversized = format!("k={}", "v".repeat(600));
        for bad in [
            thousand.as_str(),
            oversized.as_str(),
            "novalue",
            "UPPER=x",
            "k=va,lue=",
            "=v",
            "k=v=w",
            ",,,",
        ] {
            let t =
                TraceContext::from_headers(&headers(&[(TRACEPARENT, PARENT), (TRACESTATE, bad)]))
                    .unwrap();
            assert_eq!(t.state, None, "{}", &bad[..bad.len().min(40)]);
        }
        let at_bound: String = (0..32).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join(",");
        let t = TraceContext::from_headers(&headers(&[
            (TRACEPARENT, PARENT),
            (TRACESTATE, at_bound.as_str()),
        ]))
        .unwrap();
        assert!(t.state.is_some(), "32 members are allowed");
        // A tracestate without a traceparent starts nothing.
        assert_eq!(TraceContext::from_headers(&headers(&[(TRACESTATE, "k=v")])), None);
    }

    #[test]
    fn span_ids_differ_and_are_never_zero() {
        let ids: std::collections::BTreeSet<[u8; 8]> = (0..10_000).map(|_| new_span_id()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(!ids.contains(&[0; 8]));
    }
}

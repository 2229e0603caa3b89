//! What a request's body says of its leg in a disaggregated request (vLLM's
//! `kv_transfer_params`, SGLang's `bootstrap_*`), checked against the engine's role, and the
//! keys its blocks are held under: parsing only, no state ([`crate::handoff`] acts on it).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use kvroute_http::ApiError;
use serde::Deserialize;
use serde_json::Value;

use crate::disagg::Role;

/// What a request's body says of its leg.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Leg {
    Aggregated,
    /// Prefill here and hold under `key` (vLLM: the request's id; SGLang: its room).
    Prefill {
        key: String,
        sglang: bool,
    },
    /// Pull the prompt's KV held under `key` at the prefill engine's side channel `addr`.
    Decode {
        addr: SocketAddr,
        key: String,
        sglang: bool,
    },
}

/// The fields of a body that name a leg (vLLM's and SGLang's).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LegFields {
    #[serde(default)]
    kv_transfer_params: Option<Value>,
    #[serde(default)]
    bootstrap_host: Option<Value>,
    #[serde(default)]
    bootstrap_port: Option<Value>,
    #[serde(default)]
    bootstrap_room: Option<Value>,
}

/// The longest hold key a body may name (a vLLM `remote_request_id`, an SGLang room given
/// as a string): longer ones are refused, never kept or logged whole.
pub const MAX_KEY_BYTES: usize = 128;

pub(crate) fn bad_key(param: &'static str) -> ApiError {
    ApiError::bad_request(format!(
        "{param}: a transfer key must be 1 to {MAX_KEY_BYTES} bytes of visible ASCII"
    ))
    .param(param)
}

/// A key named by a body, bounded: 1 to [`MAX_KEY_BYTES`] visible ASCII bytes.
pub(crate) fn bounded_key(key: &str, param: &'static str) -> Result<String, ApiError> {
    let ok = (1..=MAX_KEY_BYTES).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| key.to_owned()).ok_or_else(|| bad_key(param))
}

/// The key of an SGLang room (SGLang's room is an integer; a short string is taken too).
pub(crate) fn room_key(room: &Value) -> Result<Option<String>, ApiError> {
    match room {
        Value::Null => Ok(None),
        Value::Number(n) if n.is_u64() || n.is_i64() => Ok(Some(format!("room-{n}"))),
        Value::String(s) => bounded_key(s, "bootstrap_room").map(|k| Some(format!("room-{k}"))),
        _ => Err(bad_key("bootstrap_room")),
    }
}

/// A side channel's address, for a host that is an IP address or `localhost` (never a name
/// to resolve: the address comes from the request).
pub(crate) fn side_channel_addr(host: &Value, port: &Value) -> Result<SocketAddr, ApiError> {
    let host = host.as_str().unwrap_or_default();
    let port = port.as_u64().or_else(|| port.as_str().and_then(|p| p.parse().ok()));
    let port = port.and_then(|p| u16::try_from(p).ok()).filter(|&p| p > 0);
    let ip = match host {
        "localhost" => Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        _ => host.parse::<IpAddr>().ok(),
    };
    match (ip, port) {
        (Some(ip), Some(port)) => Ok(SocketAddr::new(ip, port)),
        _ => Err(ApiError::bad_request(
            "the prefill engine's side channel must be an IP address or localhost and a port",
        )
        .param("kv_transfer_params")),
    }
}

/// The leg a body asks for on an engine of `role`. The transfer fields are obeyed only in
/// the engine's role: an aggregated engine ignores them all, a prefill engine only what asks
/// it to prefill and hold (`do_remote_decode`, a room), a decode engine only what names a
/// prefill engine to pull from. A vLLM prefill leg's key is drawn by the engine later (its
/// `key` here is empty).
pub(crate) fn leg(body: &[u8], role: Role) -> Result<Leg, ApiError> {
    if role == Role::Both {
        return Ok(Leg::Aggregated);
    }
    let fields: LegFields = serde_json::from_slice(body).unwrap_or_default();
    if let Some(Value::Object(p)) = &fields.kv_transfer_params {
        let flag = |name: &str| p.get(name).and_then(Value::as_bool) == Some(true);
        if role == Role::Prefill && flag("do_remote_decode") {
            return Ok(Leg::Prefill { key: String::new(), sglang: false });
        }
        if role == Role::Decode && flag("do_remote_prefill") {
            let (host, port) = (p.get("remote_host"), p.get("remote_port"));
            let key = p.get("remote_request_id").and_then(Value::as_str);
            // vLLM takes a remote prefill without its coordinates as an ordinary request.
            if let (Some(host), Some(port), Some(key)) = (host, port, key) {
                let key = bounded_key(key, "kv_transfer_params")?;
                let addr = side_channel_addr(host, port)?;
                return Ok(Leg::Decode { addr, key, sglang: false });
            }
        }
    }
    let Some(key) = fields.bootstrap_room.as_ref().map(room_key).transpose()?.flatten() else {
        return Ok(Leg::Aggregated);
    };
    match role {
        Role::Both => Ok(Leg::Aggregated),
        Role::Prefill => Ok(Leg::Prefill { key, sglang: true }),
        Role::Decode => {
            let host = fields.bootstrap_host.unwrap_or(Value::Null);
            let port = fields.bootstrap_port.unwrap_or(Value::Null);
            Ok(Leg::Decode { addr: side_channel_addr(&host, &port)?, key, sglang: true })
        }
    }
}

/// A fresh hold key for a vLLM prefill leg: 128 random bits, so that nobody can name
/// another request's hold by guessing.
pub(crate) fn fresh_key() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // The OS generator failed (it does not on Linux): hash what this process has.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        bytes[..8].copy_from_slice(&h.finish().to_le_bytes());
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("kv-{hex}")
}

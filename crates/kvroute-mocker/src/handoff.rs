//! Disaggregated prefill and decode (docs/mocker.md, "Prefill and decode"): an engine's role,
//! the two engines' legs of one request, and the side channel over which a decode engine
//! takes a prefill engine's KV.
//!
//! Both engine protocols routers speak are served, each as its engine defines it:
//!
//! - **vLLM's NixlConnector** (`kv_transfer_params`, vllm 0.33 `nixl/pull_scheduler.py`). A
//!   request with `do_remote_decode: true` is prefilled (the router asks one token), its
//!   blocks are held at its end, and the answer carries `kv_transfer_params` naming this
//!   engine, its request, its blocks and its side channel (`do_remote_prefill: true`,
//!   `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`,
//!   `remote_port`, `tp_size`, ...). The router sends those to a decode engine, which matches
//!   its own prefix cache, pulls only the blocks it lacks, releases the prefill engine's hold
//!   and decodes. A hold nobody pulls is freed after the lease (`kv_lease_duration`, 30 s).
//! - **SGLang's bootstrap** (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`). Prefill and
//!   decode engines get the same request. The prefill engine prefills and holds under the
//!   room; the decode engine waits on the prefill engine's bootstrap server until the room is
//!   held, then pulls as above.
//!
//! The pull takes `bytes / --kv-transfer-bandwidth` (bytes: the blocks pulled x block size x
//! `--kv-bytes-per-token`; between engines of different `--node`s, the bandwidth is
//! `--kv-transfer-bandwidth-across-nodes`) on the simulated clock, after the pulls into the
//! same engine over the same link that were asked for before it (one inbound link within
//! the node and one across, each moving one pull at a time at its bandwidth), then the decode engine
//! computes the rest of the prompt (its last block) at no prefill cost, as Dynamo's decode
//! mocker prices it. A pull that fails (the prefill engine gone, its hold expired) fails the
//! request with a 500, as vLLM 0.33 does by default (`kv_load_failure_policy = "fail"`) and
//! SGLang's decode engine always does (its `KVPoll.Failed` abort); with
//! `--kv-load-failure-policy recompute` a vLLM-protocol decode engine prefills the prompt
//! itself instead. Both are counted.
//!
//! The side channel is plain HTTP on loopback, kvroute's own: `POST /kv/wait` (until a key is
//! held, or a deadline; it answers the held prompt's tokens and the prefill engine's node)
//! and `POST /kv/release`. vLLM's real one is a ZMQ handshake with RDMA reads, SGLang's a
//! bootstrap server with Mooncake or NIXL transfers; neither has bytes a
//! router sees, so only their timing and their effect on both caches are simulated.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use kvroute_http::ApiError;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::{AppState, Submission};
pub use crate::holds::{HandoffCounts, HoldRefused, Holds, Peers};
pub use crate::legs::MAX_KEY_BYTES;
pub(crate) use crate::legs::{Leg, bounded_key, fresh_key, leg};

pub(crate) use crate::disagg::shown;
pub use crate::disagg::{DisaggConfig, Handoff, LoadFailurePolicy, Role, TransferTiming};

/// Why a decode engine could not pull a prompt's KV.
#[derive(Debug, thiserror::Error)]
enum PullError {
    #[error("the side channel named is not one of this decode engine's prefill peers")]
    NotAPeer,
    #[error("waiting for the prefill engine's hold")]
    Wait(#[source] kvroute_http::ClientError),
    #[error("releasing the prefill engine's hold")]
    Release(#[source] kvroute_http::ClientError),
}
impl AppState {
    /// The `kv_transfer_params` a prefill leg answers with (vLLM's pull scheduler's
    /// `request_finished`): what a decode engine needs to pull its blocks from here.
    pub(crate) fn produced_params(&self, key: &str, prompt_tokens: usize) -> Value {
        let bs = self.engine.config.block_size.tokens();
        let blocks: Vec<usize> = (0..prompt_tokens.div_ceil(bs)).collect();
        let (host, port) = match self.side_channel {
            Some(a) => (a.ip().to_string(), a.port()),
            None => (String::new(), 0),
        };
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": key,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": Value::Null,
            "transfer_mode": "pull",
        })
    }

    /// Gets a submission ready for its leg: a prefill is held at its end under its key; a
    /// decode pulls its prompt's KV first. A pull that fails fails the request (a 500, as
    /// vLLM and SGLang answer), or with vLLM's `recompute` policy is prefilled here.
    pub(crate) async fn arrange(&self, leg: &Leg, s: &mut Submission) -> Result<(), ApiError> {
        match leg {
            Leg::Aggregated => {
                if let Some(store) = &self.store {
                    let req = self.engine_request(s);
                    let hashes = req.prompt_hashes(self.engine.config.block_size);
                    let hashes: Vec<u64> = hashes.into_iter().map(|h| h.0).collect();
                    s.in_store = store.lookup(&hashes).await;
                }
            }
            Leg::Prefill { key, sglang } => {
                let config = self.engine.config;
                let blocks = s.tokens.len().div_ceil(config.block_size.tokens());
                let bound = config.num_blocks / 2;
                let param = if *sglang { "bootstrap_room" } else { "kv_transfer_params" };
                let patience = config.disagg.hold_timeout;
                let claim = self.holds.reserve_within(key, blocks, bound, patience).await;
                let claim = claim.map_err(|e| ApiError::from(e).param(param))?;
                s.handoff = crate::disagg::Handoff::Hold;
                s.hold = Some(claim);
            }
            Leg::Decode { addr, key, sglang } => match self.pull(*addr, key, s).await {
                // A request that named a side channel which is no prefill peer gets the same
                // answer as a failed pull, and nothing was sent to the address.
                Ok(bytes) => {
                    self.holds.counts.received.fetch_add(1, Ordering::Relaxed);
                    self.holds.counts.received_bytes.fetch_add(bytes, Ordering::Relaxed);
                    s.handoff = Handoff::Remote;
                }
                Err(why) => {
                    let why = kvroute_http::error::chain(&why);
                    self.holds.counts.pull_failures.fetch_add(1, Ordering::Relaxed);
                    let policy = self.engine.config.disagg.load_failure;
                    let key = shown(key);
                    if *sglang || policy == LoadFailurePolicy::Fail {
                        tracing::warn!(%addr, %key, %why, "KV pull failed; the request fails");
                        // The details stay in the log: the answer does not tell what was
                        // listening at the address.
                        return Err(ApiError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "the KV transfer from the prefill engine failed",
                        )
                        .kind("InternalServerError"));
                    }
                    tracing::warn!(%addr, %key, %why, "KV pull failed; prefilling here");
                    s.handoff = Handoff::None;
                }
            },
        }
        Ok(())
    }

    /// Pulls the KV of `s`'s prompt held under `key` at `addr`: waits until it is held,
    /// moves the blocks this engine lacks over the link (simulated time), releases the hold.
    /// The bytes moved.
    async fn pull(&self, addr: SocketAddr, key: &str, s: &Submission) -> Result<u64, PullError> {
        if !self.peers.allows(addr) {
            self.holds.counts.refused_peers.fetch_add(1, Ordering::Relaxed);
            return Err(PullError::NotAPeer);
        }
        let client = self.peers.client();
        let config = self.engine.config;
        let wait_ms = config.disagg.hold_timeout.as_millis() as u64;
        let url = format!("http://{addr}/kv/wait");
        // The prefill engine answers by its deadline; one that does not is given up on.
        let patience = config.disagg.hold_timeout + Duration::from_secs(5);
        let ask = json!({"key": key, "wait_ms": wait_ms});
        let waited = client.post_json(&url, &ask);
        let held: Value = match tokio::time::timeout(patience, waited).await {
            Ok(held) => held.map_err(PullError::Wait)?,
            Err(_) => return Err(PullError::Wait(kvroute_http::ClientError::Timeout(patience))),
        };
        let held_tokens = held.get("tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
        let from_node = held.get("node").and_then(Value::as_u64).unwrap_or(0) as u32;
        let bs = config.block_size.tokens();
        let pullable = (s.tokens.len().saturating_sub(1) / bs).min(held_tokens / bs);
        let have = match config.disagg.timing {
            TransferTiming::FullPrompt => 0,
            TransferTiming::DestinationMissing => {
                self.engine.cached_prompt_blocks(self.engine_request(s)).await
            }
        };
        let bytes = (pullable.saturating_sub(have) * bs) as f64 * config.host.kv_bytes_per_token;
        let gbps = config.disagg.link_gbps(from_node);
        if from_node != config.disagg.node {
            self.holds.counts.received_across_nodes.fetch_add(1, Ordering::Relaxed);
        }
        if gbps > 0.0 && bytes > 0.0 {
            let took = config.timing.scale(Duration::from_secs_f64(bytes / (gbps * 1e9)));
            let across = usize::from(from_node != config.disagg.node);
            let now = tokio::time::Instant::now();
            let end = self.holds.links.lock().unwrap_or_else(PoisonError::into_inner)[across]
                .book(now, took);
            tokio::time::sleep_until(end).await;
        }
        let url = format!("http://{addr}/kv/release");
        let _: Value =
            client.post_json(&url, &json!({"key": key})).await.map_err(PullError::Release)?;
        Ok(bytes as u64)
    }
}

/// Bytes through every decoder of the hand-off, as the engine meets them (the fuzz target
/// `handoff`): a request body's leg in each role, a side channel call's body and its key
/// check, and a prefill answer's `kv_transfer_params` read back as a decode leg (what a
/// router hands the decode engine). Returns, never panics.
pub fn fuzz(data: &[u8]) {
    for role in [Role::Both, Role::Prefill, Role::Decode] {
        let _ = leg(data, role);
    }
    if let Ok(b) = serde_json::from_slice::<WaitBody>(data) {
        let _ = (bounded_key(&b.key, "key"), shown(&b.key), Duration::from_millis(b.wait_ms));
    }
    if let Ok(b) = serde_json::from_slice::<ReleaseBody>(data) {
        let _ = (bounded_key(&b.key, "key"), shown(&b.key));
    }
    if let Ok(Value::Object(answer)) = serde_json::from_slice::<Value>(data)
        && let Some(params) = answer.get("kv_transfer_params")
    {
        let body = json!({ "kv_transfer_params": params });
        let _ = leg(body.to_string().as_bytes(), Role::Decode);
    }
    let holds = Arc::new(Holds::default());
    if let Some(key) = data.split(|&b| b == 0).next().and_then(|k| std::str::from_utf8(k).ok()) {
        let first = holds.reserve(key, data.len(), 1 << 20);
        let again = holds.reserve(key, 1, 1 << 20);
        assert!(first.is_err() || again.is_err(), "a key is claimed once");
        drop((first, again));
        assert_eq!(holds.claimed(), (0, 0), "dropped claims free their keys and blocks");
    }
}

#[derive(Debug, Deserialize)]
struct WaitBody {
    key: String,
    #[serde(default)]
    wait_ms: u64,
}

#[derive(Debug, Deserialize)]
struct ReleaseBody {
    key: String,
}

/// The side channel a prefill engine serves its decode engines (vLLM's side-channel port,
/// SGLang's bootstrap port).
/// Both need the fleet's token when the engine has one ([`Peers`]).
pub fn side_channel(state: Arc<AppState>) -> Router {
    let routes = Router::new().route("/kv/wait", post(wait)).route("/kv/release", post(release));
    kvroute_http::auth::require(routes, state.peers.credentials()).with_state(state)
}

/// The longest a decode engine may wait on one call.
const MAX_WAIT: Duration = Duration::from_secs(600);

async fn wait(
    State(state): State<Arc<AppState>>,
    Json(body): Json<WaitBody>,
) -> Result<Json<Value>, ApiError> {
    let wait = Duration::from_millis(body.wait_ms).min(MAX_WAIT);
    let key = bounded_key(&body.key, "key")?;
    match state.holds.wait(&key, wait).await {
        Some(tokens) => {
            Ok(Json(json!({"tokens": tokens, "node": state.engine.config.disagg.node})))
        }
        None => Err(ApiError::not_found(format!("nothing is held under {:?}", shown(&key)))),
    }
}

async fn release(
    State(state): State<Arc<AppState>>,
    Json(body): Json<ReleaseBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let key = bounded_key(&body.key, "key")?;
    let Some(held) = state.holds.take(&key) else {
        return Err(ApiError::not_found(format!("nothing is held under {:?}", shown(&key))));
    };
    state.engine.release_held(&held.engine_id);
    state.holds.counts.pulled.fetch_add(1, Ordering::Relaxed);
    Ok((StatusCode::OK, Json(json!({"tokens": held.tokens}))))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::holds::{Held, Link, Reservation, lock};

    #[test]
    fn a_pull_across_nodes_takes_the_across_link() {
        let within = DisaggConfig { node: 7, ..DisaggConfig::default() };
        assert_eq!(within.link_gbps(7), 25.0);
        assert_eq!(within.link_gbps(8), 25.0, "no across link set: one bandwidth");
        let two = DisaggConfig { kv_transfer_bandwidth_across_nodes_gbps: Some(3.0), ..within };
        assert_eq!(two.link_gbps(7), 25.0);
        assert_eq!(two.link_gbps(8), 3.0);
    }

    /// Pulls into one engine over one link go one after another: two asked at once end one
    /// and two transfers later; one asked after the link went idle starts at once.
    #[test]
    fn pulls_into_an_engine_share_its_link() {
        let mut link = Link::default();
        let t0 = tokio::time::Instant::now();
        let took = Duration::from_millis(10);
        assert_eq!(link.book(t0, took), t0 + took);
        assert_eq!(link.book(t0, took), t0 + 2 * took, "waits for the first");
        let later = t0 + Duration::from_secs(1);
        assert_eq!(link.book(later, took), later + took, "an idle link starts at once");
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn legs_follow_vllm_and_sglang_fields() {
        let prefill = br#"{"kv_transfer_params": {"do_remote_decode": true, "remote_host": null}}"#;
        assert_eq!(
            leg(prefill, Role::Prefill).unwrap(),
            Leg::Prefill { key: String::new(), sglang: false }
        );
        let decode = br#"{"kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "r1"}}"#;
        assert_eq!(
            leg(decode, Role::Decode).unwrap(),
            Leg::Decode { addr: addr("127.0.0.1:5600"), key: "r1".into(), sglang: false }
        );
        let bare = br#"{"kv_transfer_params": {"do_remote_prefill": true}}"#;
        assert_eq!(leg(bare, Role::Decode).unwrap(), Leg::Aggregated);
        let named = br#"{"kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "evil.example", "remote_port": 80, "remote_request_id": "r"}}"#;
        assert_eq!(leg(named, Role::Decode).unwrap_err().status().as_u16(), 400);

        let room = br#"{"bootstrap_host": "::1", "bootstrap_port": 8998, "bootstrap_room": 7}"#;
        assert_eq!(
            leg(room, Role::Prefill).unwrap(),
            Leg::Prefill { key: "room-7".into(), sglang: true }
        );
        assert_eq!(
            leg(room, Role::Decode).unwrap(),
            Leg::Decode { addr: addr("[::1]:8998"), key: "room-7".into(), sglang: true }
        );
        assert_eq!(leg(b"{}", Role::Decode).unwrap(), Leg::Aggregated);
        assert_eq!(leg(b"not json", Role::Decode).unwrap(), Leg::Aggregated);
    }

    /// Finding 3 of #51: the transfer fields are obeyed only in the engine's role. An
    /// aggregated engine ignores them all; a prefill engine ignores a remote prefill (it would
    /// call out); a decode engine ignores `do_remote_decode` (it would hold KV).
    #[test]
    fn transfer_fields_are_obeyed_only_in_the_engines_role() {
        let hold = br#"{"kv_transfer_params": {"do_remote_decode": true}}"#;
        let pull = br#"{"kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "r1"}}"#;
        let room =
            br#"{"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}"#;
        for body in [&hold[..], pull, room] {
            assert_eq!(leg(body, Role::Both).unwrap(), Leg::Aggregated);
        }
        assert_eq!(leg(pull, Role::Prefill).unwrap(), Leg::Aggregated);
        assert_eq!(leg(hold, Role::Decode).unwrap(), Leg::Aggregated);
    }

    /// Finding 6 of #51: keys are bounded before anything keeps or logs them.
    #[test]
    fn keys_of_any_length_are_refused() {
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        let room =
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": long});
        let e = leg(room.to_string().as_bytes(), Role::Prefill).unwrap_err();
        assert_eq!((e.status().as_u16(), e.message().len() < 200), (400, true));
        let pull = json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": long}});
        assert_eq!(
            leg(pull.to_string().as_bytes(), Role::Decode).unwrap_err().status().as_u16(),
            400
        );
        let ok = "k".repeat(MAX_KEY_BYTES);
        let room =
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": ok});
        assert!(leg(room.to_string().as_bytes(), Role::Prefill).is_ok());
        for bad in [json!(1.5), json!(""), json!([1]), json!("a b")] {
            let room =
                json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": bad});
            assert!(leg(room.to_string().as_bytes(), Role::Prefill).is_err(), "{bad}");
        }
        assert!(shown(&"x".repeat(10_000)).len() <= 67);
    }

    /// Finding 4 of #51: a vLLM hold's key is 128 random bits, not a sequence.
    #[test]
    fn hold_keys_are_unguessable() {
        let (a, b) = (fresh_key(), fresh_key());
        assert_ne!(a, b);
        assert_eq!(a.len(), 3 + 32);
        assert!(a.starts_with("kv-") && a[3..].bytes().all(|c| c.is_ascii_hexdigit()));
    }

    /// Marks `claim` held, as [`Holds::hold`] does without its lease task.
    fn held(holds: &Holds, claim: Reservation, tokens: usize) {
        let mut table = lock(&holds.table);
        let entry = table.entry(&claim.key, claim.generation).unwrap();
        entry.held = Some(Held { engine_id: "e".into(), tokens });
        let blocks = entry.blocks;
        table.held_blocks += blocks;
        drop(table);
        drop(claim);
    }

    /// Finding 2 of #51: a key is held once; a second leg naming it is refused (not
    /// overwriting the first, whose blocks would then never be freed); the blocks held are
    /// bounded; a key freed is free again, and a stale lease cannot take a newer use of it.
    #[test]
    fn holds_are_owned_and_bounded() {
        let holds = Arc::new(Holds::default());
        let first = holds.reserve("room-777", 10, 30).unwrap();
        let g = first.generation;
        assert_eq!(holds.reserve("room-777", 10, 30).unwrap_err(), HoldRefused::Duplicate);
        // Under way, legs do not count against the bound: it is the engine's load.
        let second = holds.reserve("room-778", 25, 30).unwrap();
        drop(second);
        assert_eq!(holds.claimed(), (1, 0), "a leg that ended without a hold frees its key");
        held(&holds, first, 160);
        assert_eq!(holds.claimed(), (1, 10));
        assert_eq!(
            holds.reserve("room-779", 21, 30).unwrap_err(),
            HoldRefused::Full { held: 10, bound: 30, asked: 21 }
        );
        assert_eq!(holds.reserve("room-777", 1, 30).unwrap_err(), HoldRefused::Duplicate);
        assert_eq!(holds.tokens("room-777"), Some(160));
        assert_eq!(holds.take("room-777").map(|h| h.tokens), Some(160));
        assert_eq!(holds.claimed(), (0, 0));
        // The key used again: the old lease (generation g) cannot remove the new use.
        let again = holds.reserve("room-777", 5, 30).unwrap();
        assert!(lock(&holds.table).remove("room-777", Some(g)).is_none());
        assert_eq!(holds.claimed(), (1, 0));
        drop(again);
        assert_eq!(holds.claimed(), (0, 0));
    }

    /// A leg past the bound waits for a hold to end, and is refused when none ends in time.
    #[tokio::test]
    async fn a_leg_past_the_bound_waits_for_room() {
        let holds = Arc::new(Holds::default());
        held(&holds, holds.reserve("a", 20, 30).unwrap(), 320);
        let patience = Duration::from_millis(50);
        let refused = holds.reserve_within("b", 20, 30, patience).await.unwrap_err();
        assert_eq!(refused, HoldRefused::Full { held: 20, bound: 30, asked: 20 });
        let waiting = {
            let holds = Arc::clone(&holds);
            tokio::spawn(async move {
                holds
                    .reserve_within("b", 20, 30, Duration::from_secs(30))
                    .await
                    .map(|c| c.key.clone())
            })
        };
        tokio::task::yield_now().await;
        assert!(holds.take("a").is_some(), "the pull frees the room");
        assert_eq!(waiting.await.unwrap().as_deref(), Ok("b"));
    }

    /// Finding 1 of #51: a decode engine pulls only from its configured prefill peers.
    #[test]
    fn only_prefill_peers_are_pulled_from() {
        let peers = Peers { token: None, prefill: vec![addr("127.0.0.1:7000")] };
        assert!(peers.allows(addr("127.0.0.1:7000")));
        assert!(!peers.allows(addr("127.0.0.1:7001")));
        assert!(!peers.allows(addr("10.0.0.1:7000")));
        assert!(!Peers::default().allows(addr("127.0.0.1:7000")));
    }
}

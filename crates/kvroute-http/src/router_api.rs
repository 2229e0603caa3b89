//! The router's HTTP API (docs/router-api.md), one definition for the server (`kvroute router`)
//! and its clients (a front door with `--router-url`).
//!
//! | route | body | answer |
//! |---|---|---|
//! | `POST /find_best_worker` | [`FindBestWorker`] | [`BestWorker`] |
//! | `POST /requests/{id}/prefill_done`, `DELETE /requests/{id}` | - | 204 |
//! | `POST /answers` | [`Answered`] | 204 |
//! | `POST /events` | `[RouterEvent]` | [`EventsReply`] |
//! | `POST /debug/inject_event` | [`InjectEvent`] | `{"status":"ok"}` |
//! | `POST /overlaps` | [`Overlaps`] | [`OverlapsReply`] |
//! | `PUT /workers/{id}/parity` | the router's `Parity` (`{"state": .., "cause": ..}`) | 204 |
//! | `PUT /workers/{id}/adapters` | [`ServedAdapters`] | 204 |
//! | `POST /workers/{id}/forget` | - | 204 |
//!
//! The last four are what a front door tells a remote router of its workers: what their
//! parity probes found, which adapters each lists, and that one's engine refused a connection.
//!
//! Answers carry no defaulted fields: a field renamed on one side fails to decode on the other
//! instead of silently reading as zero.

use kvroute_core::{BlockExtraInfo, DpRank, WorkerId, WorkerWithDpRank};
use serde::{Deserialize, Serialize};

pub const FIND_BEST_WORKER: &str = "/find_best_worker";
pub const EVENTS: &str = "/events";
pub const INJECT_EVENT: &str = "/debug/inject_event";
pub const TREE_INFO: &str = "/debug/tree_info";
pub const WORKERS: &str = "/workers";
pub const ANSWERS: &str = "/answers";
pub const OVERLAPS: &str = "/overlaps";

/// `PUT /workers/{id}/parity`.
pub fn parity_path(worker: WorkerId) -> String {
    format!("/workers/{}/parity", worker.0)
}

/// `PUT /workers/{id}/adapters`.
pub fn adapters_path(worker: WorkerId) -> String {
    format!("/workers/{}/adapters", worker.0)
}

/// `POST /workers/{id}/forget`.
pub fn forget_path(worker: WorkerId) -> String {
    format!("/workers/{}/forget", worker.0)
}

/// Longest request id the router keeps (it is held while the request is in flight).
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Most block hashes in one `find_best_worker` request (the body limit bounds it too).
pub const MAX_LOCAL_HASHES: usize = 1 << 20;

/// `POST /requests/{id}/prefill_done`: the request's first token arrived.
pub fn prefill_done_path(request_id: &str) -> String {
    format!("/requests/{}/prefill_done", segment(request_id))
}

/// [`prefill_done_path`] of an answer not streamed: its first bytes are the whole answer, and
/// when they came says nothing of its first token (`?timed=false`).
pub fn prefill_done_untimed_path(request_id: &str) -> String {
    format!("{}?timed=false", prefill_done_path(request_id))
}

/// `DELETE /requests/{id}`: the request ended.
pub fn request_path(request_id: &str) -> String {
    format!("/requests/{}", segment(request_id))
}

/// `id` as one path segment: every byte but RFC 3986's unreserved ones percent-encoded (a
/// prefill leg's id has a `/`; the router decodes it back).
fn segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(char::from(b));
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Which worker should take a request with these block hashes?
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FindBestWorker {
    pub local_hashes: Vec<u64>,
    pub num_tokens: i64,
    /// With an id the router tracks the request in flight until its end is reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_score_weight: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Caches not to choose (e.g. ones that just refused a connection).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<WorkerWithDpRank>,
    /// The LoRA adapter the request runs with (its `local_hashes` salted with it): only
    /// workers that serve it are chosen, and loading it is priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// The request's session (at most [`MAX_SESSION_KEY`] bytes): it stays on the session's
    /// worker unless another is cheaper by the margin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Tokens the answer may run to (the request's `max_tokens`): a tracked request's answer
    /// holds blocks on its worker as its prompt does, which the cost's memory term counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Its class for flow control (docs/routing.md, "Overload"; the default class when absent):
    /// with flow control on, the router may hold a tracked request until a worker can take it
    /// (the answer then comes later) or refuse it (429 or 503 with `Retry-After`). Higher
    /// priorities go first; below 0 a request is sheddable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Whose request it is: tenants take turns within a priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The time to first token it should meet, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_slo_ms: Option<u32>,
}

/// The content type of `find_best_worker`'s binary form: the body is the request's
/// `local_hashes`, each 8 bytes little-endian, and the other fields are query parameters
/// ([`BinaryQuery`]). Nothing of the body is parsed but its length: a thousand hashes are
/// 8,000 bytes read in place, where JSON's are ~20,000 characters parsed digit by digit.
pub const BINARY_HASHES: &str = "application/octet-stream";

/// The query parameters of `find_best_worker`'s binary form: the fields of
/// [`FindBestWorker`] but `local_hashes` (the body) and `exclude` (JSON only).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BinaryQuery {
    pub num_tokens: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_score_weight: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_slo_ms: Option<u32>,
}

/// A binary body that is not whole hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the body must be 8-byte little-endian hashes; {len} bytes is not a multiple of 8")]
pub struct PartialHash {
    pub len: usize,
}

/// The hashes of a binary body.
pub fn hashes_from_le(body: &[u8]) -> Result<Vec<u64>, PartialHash> {
    let (chunks, rest) = body.as_chunks::<8>();
    if !rest.is_empty() {
        return Err(PartialHash { len: body.len() });
    }
    Ok(chunks.iter().map(|c| u64::from_le_bytes(*c)).collect())
}

impl FindBestWorker {
    /// The request of a binary form's query and body.
    pub fn from_binary(query: BinaryQuery, body: &[u8]) -> Result<Self, PartialHash> {
        Ok(Self {
            local_hashes: hashes_from_le(body)?,
            num_tokens: query.num_tokens,
            request_id: query.request_id,
            overlap_score_weight: query.overlap_score_weight,
            temperature: query.temperature,
            exclude: Vec::new(),
            lora_name: query.lora_name,
            session_id: query.session_id,
            max_tokens: query.max_tokens,
            priority: query.priority,
            tenant: query.tenant,
            ttft_slo_ms: query.ttft_slo_ms,
        })
    }

    /// Its binary form: the query string and the body (`None` when it excludes workers,
    /// which only the JSON form says).
    pub fn to_binary(&self) -> Option<(String, Vec<u8>)> {
        if !self.exclude.is_empty() {
            return None;
        }
        let query = BinaryQuery {
            num_tokens: self.num_tokens,
            request_id: self.request_id.clone(),
            overlap_score_weight: self.overlap_score_weight,
            temperature: self.temperature,
            lora_name: self.lora_name.clone(),
            session_id: self.session_id.clone(),
            max_tokens: self.max_tokens,
            priority: self.priority,
            tenant: self.tenant.clone(),
            ttft_slo_ms: self.ttft_slo_ms,
        };
        let query = serde_urlencoded::to_string(&query).ok()?;
        let body = self.local_hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
        Some((query, body))
    }

    /// A plain query: these hashes, this many tokens, nothing tracked or overridden.
    pub fn query(local_hashes: Vec<u64>, num_tokens: i64) -> Self {
        Self {
            local_hashes,
            num_tokens,
            request_id: None,
            overlap_score_weight: None,
            temperature: None,
            exclude: Vec::new(),
            lora_name: None,
            session_id: None,
            max_tokens: None,
            priority: None,
            tenant: None,
            ttft_slo_ms: None,
        }
    }

    /// Whether it names a class for flow control.
    pub fn classed(&self) -> bool {
        self.priority.is_some() || self.tenant.is_some() || self.ttft_slo_ms.is_some()
    }
}

/// The longest tenant name taken (`x-kvroute-tenant`, `tenant`).
pub const MAX_TENANT: usize = 64;
/// The longest time-to-first-token objective taken, ms.
pub const MAX_TTFT_SLO_MS: u32 = 600_000;

/// A request's class for flow control from what it names (`param`s name the fields for its
/// errors): a priority within [`kvroute_core::schedule::flow::MIN_PRIORITY`] and `MAX_PRIORITY`
/// (0 by default), a tenant of at most [`MAX_TENANT`] visible ASCII bytes (`default`), an
/// objective of 1 to [`MAX_TTFT_SLO_MS`] ms.
pub fn request_class(
    priority: Option<i32>,
    tenant: Option<&str>,
    ttft_slo_ms: Option<u32>,
    params: [&'static str; 3],
) -> Result<kvroute_core::schedule::flow::RequestClass, crate::ApiError> {
    use kvroute_core::schedule::flow::{MAX_PRIORITY, MIN_PRIORITY, RequestClass};
    let priority = priority.unwrap_or(0);
    if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&priority) {
        return Err(crate::ApiError::bad_request(format!(
            "{} must be from {MIN_PRIORITY} to {MAX_PRIORITY}, not {priority}",
            params[0]
        ))
        .param(params[0]));
    }
    let tenant = tenant.unwrap_or("default");
    if tenant.is_empty()
        || tenant.len() > MAX_TENANT
        || !tenant.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(crate::ApiError::bad_request(format!(
            "{} must be 1 to {MAX_TENANT} visible ASCII characters",
            params[1]
        ))
        .param(params[1]));
    }
    if let Some(ms) = ttft_slo_ms.filter(|ms| !(1..=MAX_TTFT_SLO_MS).contains(ms)) {
        return Err(crate::ApiError::bad_request(format!(
            "{} must be from 1 to {MAX_TTFT_SLO_MS} ms, not {ms}",
            params[2]
        ))
        .param(params[2]));
    }
    Ok(RequestClass { priority, tenant: std::sync::Arc::from(tenant), ttft_slo_ms })
}

/// The longest session key taken (`prompt_cache_key`, `x-session-id`, `session_id`).
pub const MAX_SESSION_KEY: usize = 256;

/// The router's choice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BestWorker {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// Leading blocks of the request the worker holds.
    pub overlap_blocks: u32,
    /// Fraction of the prompt's tokens cached there.
    pub overlap: f64,
    /// Prompt tokens the router expects the worker to compute.
    pub predicted_prefill_tokens: usize,
    /// Blocks after `overlap_blocks` the worker is expected to load from host memory, disk
    /// and a shared store (absent: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lower_tier_blocks: u32,
    /// The same by tier: host memory, disk, the shared store (absent: none, or a router
    /// that tells only their sum).
    #[serde(default, skip_serializing_if = "none_of_three")]
    pub tier_blocks: [u32; 3],
    /// In a disaggregated fleet, the worker that prefills the request for this one, which
    /// decodes it (absent: it runs where it decodes). Its leg is tracked in flight as
    /// `{request_id}/prefill` (docs/routing.md, "Prefill and decode").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillWorker>,
}

/// The prefill half of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillWorker {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// Leading blocks of the request it holds.
    pub overlap_blocks: u32,
    /// Prompt tokens the router expects it to compute.
    pub predicted_prefill_tokens: usize,
    /// Blocks the decode worker is expected to pull from it.
    pub transfer_blocks: u32,
}

impl PrefillWorker {
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank { worker_id: self.worker_id, dp_rank: self.dp_rank }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn none_of_three<T: Default + PartialEq>(n: &[T; 3]) -> bool {
    n.iter().all(|v| *v == T::default())
}

impl BestWorker {
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank { worker_id: self.worker_id, dp_rank: self.dp_rank }
    }
}

/// `POST /answers`: what a front door saw of an answered request, for the router's checks of
/// itself: the cached tokens it predicted on the worker against those the engine reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answered {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub prompt_tokens: u64,
    /// Cached tokens the router's decision predicted.
    pub predicted_cached_tokens: u64,
    /// Of those, the tokens predicted from host memory, disk and the shared store (absent:
    /// none), the self-checks' count per tier.
    #[serde(default, skip_serializing_if = "none_of_three")]
    pub predicted_tier_tokens: [u64; 3],
    /// Cached tokens the engine reported (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
}

impl Answered {
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank { worker_id: self.worker_id, dp_rank: self.dp_rank }
    }
}

/// `POST /events`: how many of the posted events were applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsReply {
    pub received: usize,
    pub applied: usize,
}

/// `POST /overlaps`: how many of these leading blocks each worker rank holds, by its events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overlaps {
    pub local_hashes: Vec<u64>,
}

/// The answer to [`Overlaps`]: the ranks holding any of the blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlapsReply {
    pub overlaps: Vec<Overlap>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overlap {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub blocks: u32,
}

/// `PUT /workers/{id}/adapters`: the adapters a rank lists (`None`: it serves any).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedAdapters {
    pub dp_rank: DpRank,
    pub adapters: Option<Vec<String>>,
}

/// `POST /debug/inject_event`: one Stored block, as the seed's example posts it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectEvent {
    pub worker_id: WorkerId,
    pub tokens_hash: u64,
    #[serde(default)]
    pub block_hash: Option<u64>,
    #[serde(default)]
    pub parent_hash: Option<u64>,
    #[serde(default)]
    pub mm_extra_info: Option<BlockExtraInfo>,
    #[serde(default)]
    pub dp_rank: DpRank,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use serde_json::json;

    #[test]
    fn the_binary_form_round_trips() {
        let mut r = FindBestWorker::query(vec![0, 1, u64::MAX, 0x0102_0304_0506_0708], 64);
        r.request_id = Some("a b&c=d".into());
        r.lora_name = Some("sql".into());
        r.temperature = Some(0.5);
        r.max_tokens = Some(64);
        let (query, body) = r.to_binary().unwrap();
        assert_eq!(body.len(), 32);
        assert_eq!(&body[24..], &[8, 7, 6, 5, 4, 3, 2, 1], "little-endian");
        let parsed: BinaryQuery = serde_urlencoded::from_str(&query).unwrap();
        assert_eq!(FindBestWorker::from_binary(parsed, &body).unwrap(), r);
        assert_eq!(hashes_from_le(&body[..31]), Err(PartialHash { len: 31 }));
        assert_eq!(hashes_from_le(&[]), Ok(vec![]));
        r.exclude = vec![WorkerWithDpRank::new(1u64, 0u32)];
        assert_eq!(r.to_binary(), None, "only JSON excludes");
    }

    #[test]
    fn a_renamed_field_fails_instead_of_reading_zero() {
        let ok = json!({"worker_id": 1, "dp_rank": 0, "overlap_blocks": 3, "overlap": 0.5, "predicted_prefill_tokens": 16});
        let best: BestWorker = serde_json::from_value(ok).unwrap();
        assert_eq!(best.worker(), WorkerWithDpRank::new(1u64, 0u32));
        let renamed = json!({"worker_id": 1, "dp_rank": 0, "overlap_block_count": 3, "overlap": 0.5, "predicted_prefill_tokens": 16});
        assert!(serde_json::from_value::<BestWorker>(renamed).is_err());
    }

    /// A prefill leg's id (`kvr-1/prefill`) stays one path segment.
    #[test]
    fn request_ids_are_one_path_segment() {
        assert_eq!(request_path("kvr-1/prefill"), "/requests/kvr-1%2Fprefill");
        assert_eq!(prefill_done_path("a b~c"), "/requests/a%20b~c/prefill_done");
        assert_eq!(request_path("é"), "/requests/%C3%A9");
    }

    #[test]
    fn exclusions_round_trip() {
        let req = FindBestWorker {
            local_hashes: vec![1, 2],
            num_tokens: 32,
            request_id: Some("r".into()),
            overlap_score_weight: None,
            temperature: None,
            exclude: vec![WorkerWithDpRank::new(3u64, 1u32)],
            lora_name: Some("sql".into()),
            session_id: Some("s".into()),
            max_tokens: Some(64),
            priority: Some(-1),
            tenant: Some("team-a".into()),
            ttft_slo_ms: Some(250),
        };
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(serde_json::from_str::<FindBestWorker>(&text).unwrap(), req);
        let binary = FindBestWorker { exclude: Vec::new(), ..req };
        let (query, body) = binary.to_binary().unwrap();
        let query: BinaryQuery = serde_urlencoded::from_str(&query).unwrap();
        assert_eq!(FindBestWorker::from_binary(query, &body).unwrap(), binary);
        let minimal: FindBestWorker =
            serde_json::from_value(json!({"local_hashes": [1], "num_tokens": 16})).unwrap();
        assert!(minimal.exclude.is_empty() && !minimal.classed());
    }

    #[test]
    fn a_class_is_checked_field_by_field() {
        let params = ["p", "t", "s"];
        let class = request_class(Some(-3), Some("team-a"), Some(250), params).unwrap();
        assert!(class.sheddable() && &*class.tenant == "team-a");
        assert_eq!(request_class(None, None, None, params).unwrap(), Default::default());
        let refused = |p, t, s| request_class(p, t, s, params).unwrap_err().body().error.param;
        assert_eq!(refused(Some(101), None, None).as_deref(), Some("p"));
        assert_eq!(refused(None, Some("a b"), None).as_deref(), Some("t"));
        assert_eq!(refused(None, Some(""), None).as_deref(), Some("t"));
        let long = "x".repeat(65);
        assert_eq!(refused(None, Some(&long), None).as_deref(), Some("t"));
        assert_eq!(refused(None, None, Some(0)).as_deref(), Some("s"));
    }
}

//! The router's HTTP API (SPEC section 8; the seed's standalone router API):
//!
//! | route | what |
//! |---|---|
//! | `POST /find_best_worker` | `{"local_hashes":[u64], "num_tokens":n, "request_id"?}` -> worker, overlap |
//! | `POST /requests/{id}/prefill_done`, `DELETE /requests/{id}` | in-flight accounting |
//! | `POST /events` | a JSON array of `RouterEvent`s |
//! | `POST /debug/inject_event` | one Stored block: `{worker_id, tokens_hash, block_hash?, mm_extra_info?}` |
//! | `GET /debug/tree_info` | `{"num_blocks", "events": first 20 dumped events}` |
//! | `GET /workers`, `GET /metrics`, `GET /health` | status, Prometheus text, liveness |
//!
//! Errors are OpenAI-shaped: `{"error":{"message","type","param","code"}}`.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use kvroute_core::{
    BlockExtraInfo, DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerId,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::state::{Placement, RouterState};

/// An error as an OpenAI-compatible client expects it.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
}

impl ApiError {
    /// An error whose OpenAI `type` follows from its status.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = match status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        Self { status, message: message.into(), kind, param: None }
    }

    /// Names the request field at fault.
    #[must_use]
    pub fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: None,
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = rejection.status();
        let mut e = Self::bad_request(rejection.body_text(), None);
        if status == StatusCode::UNSUPPORTED_MEDIA_TYPE || status == StatusCode::PAYLOAD_TOO_LARGE {
            e.status = status;
        }
        e
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        (self.status, Json(body)).into_response()
    }
}

pub fn app(state: Arc<RouterState>) -> Router {
    Router::new()
        .route("/find_best_worker", post(find_best_worker))
        .route("/requests/{id}/prefill_done", post(prefill_done))
        .route("/requests/{id}", delete(finish))
        .route("/events", post(events))
        .route("/debug/inject_event", post(inject_event))
        .route("/debug/tree_info", get(tree_info))
        .route("/workers", get(workers))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .fallback(|| async { ApiError::not_found("no such route") })
        .with_state(state)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FindBestWorker {
    local_hashes: Vec<u64>,
    num_tokens: i64,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    overlap_score_weight: Option<f64>,
    #[serde(default)]
    temperature: Option<f64>,
}

#[derive(Debug, Serialize)]
struct BestWorker {
    worker_id: WorkerId,
    dp_rank: DpRank,
    overlap_blocks: u32,
    /// Fraction of the prompt's tokens cached there.
    overlap: f64,
    predicted_prefill_tokens: usize,
}

async fn find_best_worker(
    State(state): State<Arc<RouterState>>,
    body: Result<Json<FindBestWorker>, JsonRejection>,
) -> Result<Json<BestWorker>, ApiError> {
    let Json(req) = body?;
    if req.num_tokens <= 0 {
        return Err(ApiError::bad_request("num_tokens must be greater than 0", Some("num_tokens")));
    }
    if let Some(t) = req.temperature.filter(|t| !t.is_finite() || *t < 0.0) {
        return Err(ApiError::bad_request(
            format!("temperature must be >= 0, not {t}"),
            Some("temperature"),
        ));
    }
    let local: Vec<LocalBlockHash> = req.local_hashes.iter().copied().map(LocalBlockHash).collect();
    let placement = Placement {
        local_hashes: &local,
        num_tokens: req.num_tokens as usize,
        request_id: req.request_id.as_deref(),
        overlap_weight: req.overlap_score_weight,
        temperature: req.temperature,
        exclude: &[],
    };
    let (decision, _) =
        state.place(&placement).ok_or_else(|| ApiError::unavailable("no workers are known"))?;
    let bs = state.config.block_size.tokens();
    Ok(Json(BestWorker {
        worker_id: decision.worker.worker_id,
        dp_rank: decision.worker.dp_rank,
        overlap_blocks: decision.overlap_blocks,
        overlap: (decision.overlap_blocks as usize * bs).min(placement.num_tokens) as f64
            / placement.num_tokens as f64,
        predicted_prefill_tokens: decision.predicted_prefill_tokens,
    }))
}

async fn prefill_done(State(state): State<Arc<RouterState>>, Path(id): Path<String>) -> StatusCode {
    state.prefill_done(&id);
    StatusCode::NO_CONTENT
}

async fn finish(
    State(state): State<Arc<RouterState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    match state.finish(&id) {
        true => Ok(StatusCode::NO_CONTENT),
        false => Err(ApiError::not_found(format!("request {id:?} is not in flight"))),
    }
}

async fn events(
    State(state): State<Arc<RouterState>>,
    body: Result<Json<Vec<RouterEvent>>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Json(events) = body?;
    let applied = state.apply(&events);
    Ok(Json(json!({"received": events.len(), "applied": applied})))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InjectEvent {
    worker_id: WorkerId,
    tokens_hash: u64,
    #[serde(default)]
    block_hash: Option<u64>,
    #[serde(default)]
    parent_hash: Option<u64>,
    #[serde(default)]
    mm_extra_info: Option<BlockExtraInfo>,
    #[serde(default)]
    dp_rank: DpRank,
}

async fn inject_event(
    State(state): State<Arc<RouterState>>,
    body: Result<Json<InjectEvent>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Json(req) = body?;
    if !state.valid_dp_rank(req.dp_rank) {
        return Err(ApiError::bad_request(
            format!("dp_rank must be below {}", state.config.max_dp_size),
            Some("dp_rank"),
        ));
    }
    let block = KvCacheStoredBlockData {
        block_hash: ExternalBlockHash(req.block_hash.unwrap_or(req.tokens_hash)),
        tokens_hash: LocalBlockHash(req.tokens_hash),
        mm_extra_info: req.mm_extra_info,
    };
    let data = KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: req.parent_hash.map(ExternalBlockHash),
        blocks: vec![block],
    });
    let event =
        RouterEvent::new(req.worker_id, KvCacheEvent { event_id: 0, data, dp_rank: req.dp_rank });
    if state.apply(&[event]) == 0 {
        return Err(ApiError::bad_request(
            "the worker does not hold the parent block",
            Some("parent_hash"),
        ));
    }
    Ok(Json(json!({"status": "ok"})))
}

async fn tree_info(State(state): State<Arc<RouterState>>) -> Json<serde_json::Value> {
    let mut events = state.index.dump_as_events();
    events.truncate(20);
    Json(json!({"num_blocks": state.index.stats().blocks, "events": events}))
}

async fn workers(State(state): State<Arc<RouterState>>) -> Json<serde_json::Value> {
    Json(json!({"workers": state.workers(), "in_flight": state.in_flight()}))
}

async fn metrics(State(state): State<Arc<RouterState>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.render_metrics())
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

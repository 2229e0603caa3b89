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
//! Errors are OpenAI-shaped: `{"error":{"message","type","param","code"}}`. The request
//! and answer types are [`kvroute_http::router_api`]'s, shared with the front door's client.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use kvroute_core::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent,
};
use kvroute_http::ApiError;
use kvroute_http::router_api::{self, BestWorker, EventsReply, FindBestWorker, InjectEvent};
use serde_json::json;

use crate::state::{Placement, RouterState};

pub fn app(state: Arc<RouterState>) -> Router {
    let routes = Router::new()
        .route(router_api::FIND_BEST_WORKER, post(find_best_worker))
        .route("/requests/{id}/prefill_done", post(prefill_done))
        .route("/requests/{id}", delete(finish))
        .route(router_api::EVENTS, post(events))
        .route(router_api::INJECT_EVENT, post(inject_event))
        .route(router_api::TREE_INFO, get(tree_info))
        .route(router_api::WORKERS, get(workers))
        .route("/metrics", get(metrics))
        .route("/health", get(health));
    kvroute_http::fallbacks(routes).with_state(state)
}

async fn find_best_worker(
    State(state): State<Arc<RouterState>>,
    body: Result<Json<FindBestWorker>, JsonRejection>,
) -> Result<Json<BestWorker>, ApiError> {
    let Json(req) = body?;
    if req.num_tokens <= 0 {
        return Err(ApiError::bad_request("num_tokens must be greater than 0").param("num_tokens"));
    }
    if let Some(t) = req.temperature.filter(|t| !t.is_finite() || *t < 0.0) {
        return Err(ApiError::bad_request(format!("temperature must be >= 0, not {t}"))
            .param("temperature"));
    }
    let local: Vec<LocalBlockHash> = req.local_hashes.iter().copied().map(LocalBlockHash).collect();
    let placement = Placement {
        local_hashes: &local,
        num_tokens: req.num_tokens as usize,
        request_id: req.request_id.as_deref(),
        overlap_weight: req.overlap_score_weight,
        temperature: req.temperature,
        exclude: &req.exclude,
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
) -> Result<Json<EventsReply>, ApiError> {
    let Json(events) = body?;
    let applied = state.apply(&events);
    Ok(Json(EventsReply { received: events.len(), applied }))
}

async fn inject_event(
    State(state): State<Arc<RouterState>>,
    body: Result<Json<InjectEvent>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Json(req) = body?;
    if !state.valid_dp_rank(req.dp_rank) {
        return Err(ApiError::bad_request(format!(
            "dp_rank must be below {}",
            state.config.max_dp_size
        ))
        .param("dp_rank"));
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
        return Err(
            ApiError::bad_request("the worker does not hold the parent block").param("parent_hash")
        );
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

async fn metrics(State(state): State<Arc<RouterState>>) -> Response {
    kvroute_http::metrics::response(&[state.registry()])
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

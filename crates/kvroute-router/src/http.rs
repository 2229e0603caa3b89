//! The router's HTTP API (docs/router-api.md; the seed's standalone router API):
//!
//! | route | what |
//! |---|---|
//! | `POST /find_best_worker` | `{"local_hashes":[u64], "num_tokens":n, "request_id"?}` -> worker, overlap (and its `prefill` worker in a disaggregated fleet); or the binary form: `Content-Type: application/octet-stream`, the hashes as 8-byte little-endian integers, the other fields as query parameters (`?num_tokens=n&request_id=...`) |
//! | `POST /requests/{id}/prefill_done`, `DELETE /requests/{id}` | in-flight accounting |
//! | `POST /answers` | an answered request's predicted and served cached tokens (self-checks) |
//! | `POST /events` | a JSON array of `RouterEvent`s |
//! | `POST /debug/inject_event` | one Stored block: `{worker_id, tokens_hash, block_hash?, mm_extra_info?}` |
//! | `GET /debug/tree_info` | `{"num_blocks", "events": first 20 dumped events}` |
//! | `GET /workers`, `GET /metrics`, `GET /health` | status, Prometheus text, liveness |
//! | `POST /workers`, `POST /workers/{id}/drain`, `DELETE /workers/{id}` | membership: a worker joins, drains, leaves ([`crate::members::api`]) |
//!
//! With an admin token, every route but `/health` needs it (`Authorization: Bearer`): the
//! index, the in-flight accounting and the fleet's status are the router's to change and to
//! show. Posted events for workers the router does not know are refused when any worker is
//! configured (see [`RouterState::apply_posted`]). The tree dump is rebuilt at most once per
//! [`TREE_INFO_TTL`] (it walks the whole index).
//!
//! Errors are OpenAI-shaped: `{"error":{"message","type","param","code"}}`. The request
//! and answer types are [`kvroute_http::router_api`]'s, shared with the front door's client.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use kvroute_core::{
    ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent, WorkerId, WorkerWithDpRank,
};
use kvroute_http::fast_json::FastJson;
use kvroute_http::paths;
use kvroute_http::router_api::{
    self, Answered, BestWorker, BinaryQuery, EventsReply, FindBestWorker, InjectEvent, Overlap,
    Overlaps, OverlapsReply, PrefillWorker, ServedAdapters,
};
use kvroute_http::{ApiError, Credentials};
use serde_json::json;

use crate::state::{Decision, Parity, PlaceRequest, Refusal, RouterState};

/// Most adapters one rank may be said to list (`PUT /workers/{id}/adapters`).
pub const MAX_LISTED_ADAPTERS: usize = 4096;

/// How long a tree dump is served before it is rebuilt.
pub const TREE_INFO_TTL: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Api {
    state: Arc<RouterState>,
    tree_info: Mutex<Option<(Instant, serde_json::Value)>>,
    /// What the status page's chart draws, sampled while the app lives.
    history: Arc<kvroute_http::status::History>,
}

/// The router's API; with `admin` keys, every route but `/health` needs one of them.
pub fn app(state: Arc<RouterState>, admin: Credentials) -> Router {
    let api = Arc::new(Api { state, tree_info: Mutex::new(None), history: Arc::default() });
    // The page's history, sampled until the app is dropped (outside a runtime: none).
    if tokio::runtime::Handle::try_current().is_ok() {
        let weak = Arc::downgrade(&api);
        api.history.spawn(kvroute_http::status::SAMPLE_EVERY, move || {
            let api = weak.upgrade()?;
            Some(kvroute_http::status::Counters::read(&[api.state.view().registry()]))
        });
    }
    let routes = Router::new()
        .route(router_api::FIND_BEST_WORKER, post(find_best_worker))
        .route("/requests/{id}/prefill_done", post(prefill_done))
        .route("/requests/{id}", delete(finish))
        .route(router_api::ANSWERS, post(answers))
        .route(router_api::EVENTS, post(events))
        .route(router_api::INJECT_EVENT, post(inject_event))
        .route(router_api::TREE_INFO, get(tree_info))
        .route(paths::METRICS, get(metrics))
        .route(router_api::OVERLAPS, post(overlaps))
        .route("/workers/{id}/parity", axum::routing::put(parity))
        .route("/workers/{id}/adapters", axum::routing::put(adapters))
        .route("/workers/{id}/forget", post(forget))
        .route(router_api::WORKERS, get(workers))
        .route("/decisions/{id}", get(decision))
        .route("/ui/history", get(history));
    // Membership changes need the admin token always (the others only when one is set).
    let mutations = Router::new()
        .route(router_api::WORKERS, post(add_worker))
        .route("/workers/{id}/drain", post(drain_worker))
        .route("/workers/{id}", delete(remove_worker));
    let routes = kvroute_http::auth::require_admin(routes, admin.clone())
        .merge(kvroute_http::auth::mutations(mutations, admin))
        .route(paths::HEALTH, get(health))
        .route("/ui", get(kvroute_http::status_page));
    kvroute_http::fallbacks(routes).with_state(api)
}

type ApiState = State<Arc<Api>>;

/// `GET /ui/history`: the status page's chart, from the router's own samples.
async fn history(
    State(api): ApiState,
    query: axum::extract::Query<kvroute_http::status::After>,
) -> axum::Json<serde_json::Value> {
    kvroute_http::status::history_response(
        &api.history,
        kvroute_http::status::SAMPLE_EVERY,
        query.after,
    )
}

fn check_request_id(id: &str) -> Result<(), ApiError> {
    match id.len() {
        0 => Err(ApiError::bad_request("request_id must not be empty").param("request_id")),
        n if n > router_api::MAX_REQUEST_ID_BYTES => Err(ApiError::bad_request(format!(
            "request_id must be at most {} bytes",
            router_api::MAX_REQUEST_ID_BYTES
        ))
        .param("request_id")),
        _ => Ok(()),
    }
}

/// `find_best_worker`'s request in either form: JSON, or the binary one
/// ([`router_api::BINARY_HASHES`]: the hashes as the body, the rest in the query).
struct EitherForm(FindBestWorker);

impl<S: Send + Sync> FromRequest<S> for EitherForm {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let binary = req.headers().get(axum::http::header::CONTENT_TYPE).is_some_and(|v| {
            let essence = v.to_str().unwrap_or("").split(';').next().unwrap_or("").trim();
            essence.eq_ignore_ascii_case(router_api::BINARY_HASHES)
        });
        if !binary {
            let FastJson(req) = FastJson::<FindBestWorker>::from_request(req, state).await?;
            return Ok(Self(req));
        }
        let Query(query) = Query::<BinaryQuery>::try_from_uri(req.uri()).map_err(|e| {
            ApiError::bad_request(format!("the binary form's query: {}", e.body_text()))
        })?;
        let body = Bytes::from_request(req, state).await?;
        let req = FindBestWorker::from_binary(query, &body)
            .map_err(|e| ApiError::bad_request(e.to_string()).param("local_hashes"))?;
        Ok(Self(req))
    }
}

/// The largest `overlap_score_weight` taken (Dynamo's default is 1).
pub const MAX_OVERLAP_WEIGHT: f64 = 1_000.0;

/// A `find_best_worker` request's fields, checked before anything is placed, whether flow
/// control is on or not (its class fields too: a request that names one is told at once).
fn check_find(req: &FindBestWorker) -> Result<(), ApiError> {
    if req.classed() {
        router_api::request_class(
            req.priority,
            req.tenant.as_deref(),
            req.ttft_slo_ms,
            ["priority", "tenant", "ttft_slo_ms"],
        )?;
    }
    if let Some(w) = req
        .overlap_score_weight
        .filter(|w| !w.is_finite() || !(0.0..=MAX_OVERLAP_WEIGHT).contains(w))
    {
        return Err(ApiError::bad_request(format!(
            "overlap_score_weight must be from 0 to {MAX_OVERLAP_WEIGHT}, not {w}"
        ))
        .param("overlap_score_weight"));
    }
    if let Some(id) = &req.request_id {
        check_request_id(id)?;
    }
    if req.local_hashes.len() > router_api::MAX_LOCAL_HASHES {
        return Err(ApiError::bad_request(format!(
            "at most {} local_hashes",
            router_api::MAX_LOCAL_HASHES
        ))
        .param("local_hashes"));
    }
    if req.num_tokens <= 0 {
        return Err(ApiError::bad_request("num_tokens must be greater than 0").param("num_tokens"));
    }
    if let Some(t) = req.temperature.filter(|t| !t.is_finite() || *t < 0.0) {
        return Err(ApiError::bad_request(format!("temperature must be >= 0, not {t}"))
            .param("temperature"));
    }
    if req.session_id.as_ref().is_some_and(|k| k.len() > router_api::MAX_SESSION_KEY) {
        return Err(ApiError::bad_request(format!(
            "session_id must be at most {} bytes",
            router_api::MAX_SESSION_KEY
        ))
        .param("session_id"));
    }
    if req.lora_name.as_ref().is_some_and(|n| n.len() > kvroute_http::models::MAX_ADAPTER_NAME) {
        return Err(ApiError::bad_request(format!(
            "lora_name must be at most {} bytes",
            kvroute_http::models::MAX_ADAPTER_NAME
        ))
        .param("lora_name"));
    }
    Ok(())
}

async fn find_best_worker(
    State(api): ApiState,
    headers: axum::http::HeaderMap,
    EitherForm(req): EitherForm,
) -> Result<Json<BestWorker>, ApiError> {
    // A front door's or client's trace goes on here: the decision's spans hang under it.
    let trace = kvroute_http::trace::TraceContext::from_headers(&headers);
    let span = kvroute_http::otel::request_span("find_best_worker", trace.as_ref());
    if let Some(id) = req.request_id.as_deref() {
        span.record("kvroute.request_id", id);
    }
    kvroute_http::otel::in_span(span, find_best_worker_in_span(&api, req, trace)).await
}

/// [`find_best_worker`] in the request's span.
async fn find_best_worker_in_span(
    api: &Api,
    req: FindBestWorker,
    trace: Option<kvroute_http::trace::TraceContext>,
) -> Result<Json<BestWorker>, ApiError> {
    let state = &api.state;
    check_find(&req)?;
    // A tracked request goes through flow control when it is on (its class the default
    // unless it names one).
    let class = match &req.request_id {
        Some(_) if state.config.scheduler.flow.enabled => Some(router_api::request_class(
            req.priority,
            req.tenant.as_deref(),
            req.ttft_slo_ms,
            ["priority", "tenant", "ttft_slo_ms"],
        )?),
        _ => None,
    };
    // Every field the API carries, and the defaults for any the API does not (a new field of
    // the request is set where it is known and read where it is used, not here).
    #[allow(clippy::needless_update)]
    let placement = PlaceRequest {
        id: req.request_id.clone(),
        local_hashes: req.local_hashes.iter().copied().map(LocalBlockHash).collect(),
        num_tokens: req.num_tokens as usize,
        output_tokens: req.max_tokens.map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX)),
        adapter: req.lora_name.clone().filter(|n| !n.is_empty()),
        session: req.session_id.clone().filter(|k| !k.is_empty()),
        exclude: req.exclude.clone(),
        overlap_weight: req.overlap_score_weight,
        temperature: req.temperature,
        class,
        trace,
        ..PlaceRequest::default()
    };
    let decision = state.decide(&placement).await.map_err(Refusal::into_api_error)?;
    let Decision { prefill, decode: decision, transfer_blocks } =
        decision.ok_or_else(|| ApiError::unavailable("no workers are known"))?;
    let prefill = prefill.map(|p| PrefillWorker {
        worker_id: p.worker.worker_id,
        dp_rank: p.worker.dp_rank,
        overlap_blocks: p.overlap_blocks,
        predicted_prefill_tokens: p.predicted_prefill_tokens,
        transfer_blocks,
    });
    let bs = state.config.block_size.tokens();
    Ok(Json(BestWorker {
        worker_id: decision.worker.worker_id,
        dp_rank: decision.worker.dp_rank,
        overlap_blocks: decision.overlap_blocks,
        overlap: (decision.overlap_blocks as usize * bs).min(placement.num_tokens) as f64
            / placement.num_tokens as f64,
        predicted_prefill_tokens: decision.predicted_prefill_tokens,
        lower_tier_blocks: decision.tier_blocks.iter().sum(),
        tier_blocks: decision.tier_blocks,
        prefill,
    }))
}

/// `?timed=false`: the answer was not streamed, its first bytes are not its first token.
#[derive(serde::Deserialize)]
struct PrefillDoneQuery {
    timed: Option<bool>,
}

async fn prefill_done(
    State(api): ApiState,
    Path(id): Path<String>,
    Query(q): Query<PrefillDoneQuery>,
) -> StatusCode {
    api.state.prefill_done(&id, q.timed.unwrap_or(true));
    StatusCode::NO_CONTENT
}

async fn finish(State(api): ApiState, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    check_request_id(&id)?;
    match api.state.finish(&id) {
        true => Ok(StatusCode::NO_CONTENT),
        false => Err(ApiError::not_found(format!("request {id:?} is not in flight"))),
    }
}

/// Most prompt tokens an answer may claim (beyond any model's context).
const MAX_ANSWER_TOKENS: u64 = 1 << 32;

async fn answers(
    State(api): ApiState,
    body: Result<Json<Answered>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let Json(a) = body?;
    if a.prompt_tokens > MAX_ANSWER_TOKENS {
        return Err(ApiError::bad_request(format!(
            "prompt_tokens must be at most {MAX_ANSWER_TOKENS}"
        ))
        .param("prompt_tokens"));
    }
    for (name, value) in
        [("predicted_cached_tokens", a.predicted_cached_tokens), ("cached_tokens", a.cached_tokens)]
    {
        if value > a.prompt_tokens {
            return Err(
                ApiError::bad_request(format!("{name} must not exceed prompt_tokens")).param(name)
            );
        }
    }
    if let Err(why) = api.state.fleet.check_rank(a.worker()) {
        return Err(ApiError::bad_request(why.to_string()).param("dp_rank"));
    }
    if !api.state.record_answer(&a) {
        return Err(ApiError::bad_request(format!(
            "worker {} is not one of the router's workers",
            a.worker_id
        ))
        .param("worker_id"));
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn events(
    State(api): ApiState,
    body: Result<Json<Vec<RouterEvent>>, JsonRejection>,
) -> Result<Json<EventsReply>, ApiError> {
    let Json(events) = body?;
    let applied = api.state.apply_posted(&events);
    Ok(Json(EventsReply { received: events.len(), applied }))
}

async fn inject_event(
    State(api): ApiState,
    body: Result<Json<InjectEvent>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let state = &api.state;
    let Json(req) = body?;
    if let Err(why) =
        state.fleet.check_rank(WorkerWithDpRank { worker_id: req.worker_id, dp_rank: req.dp_rank })
    {
        return Err(ApiError::bad_request(why.to_string()).param("dp_rank"));
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
    let event = RouterEvent::new(req.worker_id, KvCacheEvent::new(0, data, req.dp_rank));
    let worker = event.worker();
    if state.apply_posted(&[event]) == 0 {
        if !state.fleet.knows_worker(worker.worker_id) {
            return Err(ApiError::bad_request(format!(
                "worker {} is not one of the router's workers",
                worker.worker_id
            ))
            .param("worker_id"));
        }
        return Err(
            ApiError::bad_request("the worker does not hold the parent block").param("parent_hash")
        );
    }
    Ok(Json(json!({"status": "ok"})))
}

/// The index's size and its first 20 events as a dump, rebuilt at most once per
/// [`TREE_INFO_TTL`] (callers in between, and while it is rebuilt, get the last one).
async fn tree_info(State(api): ApiState) -> Result<Json<serde_json::Value>, ApiError> {
    let api2 = Arc::clone(&api);
    let value = tokio::task::spawn_blocking(move || {
        let mut cached = api2.tree_info.lock().unwrap_or_else(PoisonError::into_inner);
        match &*cached {
            Some((at, value)) if at.elapsed() < TREE_INFO_TTL => value.clone(),
            _ => {
                let state = &api2.state;
                let mut events = state.index.dump_as_events();
                events.truncate(20);
                let value = json!({"num_blocks": state.index.stats().blocks, "events": events});
                *cached = Some((Instant::now(), value.clone()));
                value
            }
        }
    })
    .await
    .map_err(ApiError::internal)?;
    Ok(Json(value))
}

async fn workers(State(api): ApiState) -> Json<serde_json::Value> {
    let state = &api.state;
    Json(json!({"workers": state.view().workers(), "in_flight": state.view().in_flight(),
        "recent_decisions": state.scheduling.recent_decisions(),
        "ttft_predictions": state.scheduling.prediction_stats(), "nats": state.nats.get().map(|n| n.summary())}))
}

/// Request `id`'s decision: its line of the decision log, or its record among the recent
/// decisions; 404 when neither holds it.
async fn decision(
    State(api): ApiState,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let state = &api.state;
    crate::state::decision_of(state.decision_log.as_ref(), &state.scheduling, &id)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no decision of request {id} is kept")))
}

async fn metrics(State(api): ApiState) -> Response {
    kvroute_http::metrics::response(&[api.state.view().registry()])
}

async fn health(State(api): ApiState) -> Json<serde_json::Value> {
    Json(api.state.view().health())
}

/// `POST /overlaps`: the leading blocks each rank holds of these, by its events.
async fn overlaps(
    State(api): ApiState,
    body: Result<Json<Overlaps>, JsonRejection>,
) -> Result<Json<OverlapsReply>, ApiError> {
    let Json(o) = body?;
    if o.local_hashes.len() > router_api::MAX_LOCAL_HASHES {
        let most = router_api::MAX_LOCAL_HASHES;
        return Err(
            ApiError::bad_request(format!("at most {most} local_hashes")).param("local_hashes")
        );
    }
    let hashes: Vec<LocalBlockHash> = o.local_hashes.into_iter().map(LocalBlockHash).collect();
    let scores = api.state.index.find_matches(&hashes);
    let overlaps = scores
        .scores
        .iter()
        .map(|&(w, blocks)| Overlap { worker_id: w.worker_id, dp_rank: w.dp_rank, blocks })
        .collect();
    Ok(Json(OverlapsReply { overlaps }))
}

/// A worker named in a path, known to the router; 404 otherwise.
fn known_worker(api: &Api, id: u64) -> Result<WorkerId, ApiError> {
    let worker = WorkerId(id);
    match api.state.view().workers().iter().any(|w| w.id == worker) {
        true => Ok(worker),
        false => {
            Err(ApiError::not_found(format!("worker {id} is not one of the router's workers")))
        }
    }
}

/// `PUT /workers/{id}/parity`: what a front door's parity probe found.
async fn parity(
    State(api): ApiState,
    Path(id): Path<u64>,
    body: Result<Json<Parity>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let Json(parity) = body?;
    let worker = known_worker(&api, id)?;
    api.state.set_parity(worker, parity);
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /workers/{id}/adapters`: the adapters one rank lists.
async fn adapters(
    State(api): ApiState,
    Path(id): Path<u64>,
    body: Result<Json<ServedAdapters>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let Json(served) = body?;
    let names = served.adapters.as_deref().unwrap_or_default();
    if names.len() > MAX_LISTED_ADAPTERS
        || names.iter().any(|n| n.is_empty() || n.len() > router_api::MAX_SESSION_KEY)
    {
        return Err(ApiError::bad_request(format!(
            "adapters: at most {MAX_LISTED_ADAPTERS} names of 1 to {} bytes",
            router_api::MAX_SESSION_KEY
        ))
        .param("adapters"));
    }
    let worker = known_worker(&api, id)?;
    let rank = WorkerWithDpRank { worker_id: worker, dp_rank: served.dp_rank };
    if let Err(why) = api.state.fleet.check_rank(rank) {
        return Err(ApiError::bad_request(why.to_string()).param("dp_rank"));
    }
    let names = served.adapters.map(|a| a.into_iter().collect());
    api.state.scheduling.set_served_adapters(rank, names);
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /workers/{id}/forget`: the worker's engine refused a connection; its blocks are gone.
async fn forget(State(api): ApiState, Path(id): Path<u64>) -> Result<StatusCode, ApiError> {
    let worker = known_worker(&api, id)?;
    api.state.forget_blocks(worker);
    Ok(StatusCode::NO_CONTENT)
}

type Answer = Result<(StatusCode, Json<serde_json::Value>), ApiError>;

/// `POST /workers`: a worker joins (see [`crate::members::api::add`]).
async fn add_worker(State(api): ApiState, body: Bytes) -> Answer {
    crate::members::api::add(&api.state, &body).map(|(s, v)| (s, Json(v)))
}

/// `POST /workers/{id}/drain`.
async fn drain_worker(State(api): ApiState, Path(id): Path<u64>) -> Answer {
    crate::members::api::drain_one(&api.state, id).map(|(s, v)| (s, Json(v)))
}

/// `DELETE /workers/{id}`.
async fn remove_worker(State(api): ApiState, Path(id): Path<u64>) -> Answer {
    crate::members::api::remove_one(&api.state, id).map(|(s, v)| (s, Json(v)))
}

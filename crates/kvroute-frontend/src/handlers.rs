//! The OpenAI routes and the front door's own views, as stages: the body parsed and checked
//! ([`parse`]), preprocessed into tokens and images (`kvroute_preprocess`), made an
//! [`Outbound`] request (hashed, namespaced), then placed and dispatched ([`dispatch`]).
//! Auth and limits come before all of them (`kvroute_http::auth`, the listener's bounds).

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use base64::Engine as _;
use kvroute_http::ApiError;
use kvroute_http::auth::KeyId;
use kvroute_http::openai::{ChatCompletionRequest, CompletionRequest, ModelList};
use kvroute_http::paths;
use kvroute_http::trace::TraceContext;
use kvroute_preprocess::chat_request::LoadedImage;
use serde_json::{Value, json};

use crate::FrontendState;
use crate::dispatch::{Keys, dispatch};
use crate::outbound::Outbound;

/// The header that names a request's session, when its body has no `prompt_cache_key`.
pub(crate) const SESSION_HEADER: &str = "x-session-id";

/// A request's session: its `prompt_cache_key`, else its `x-session-id` header; a key past
/// [`kvroute_http::router_api::MAX_SESSION_KEY`] bytes is a 400 naming where it came from.
pub(crate) fn session(
    headers: &HeaderMap,
    body_key: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let max = kvroute_http::router_api::MAX_SESSION_KEY;
    let too_long = |param: &'static str| {
        ApiError::bad_request(format!("{param} must be at most {max} bytes")).param(param)
    };
    if let Some(key) = body_key.filter(|k| !k.is_empty()) {
        return match key.len() > max {
            true => Err(too_long("prompt_cache_key")),
            false => Ok(Some(key.to_owned())),
        };
    }
    let Some(value) = headers.get(SESSION_HEADER) else { return Ok(None) };
    if value.len() > max {
        return Err(too_long(SESSION_HEADER));
    }
    let key = value.to_str().map_err(|_| {
        ApiError::bad_request(format!("{SESSION_HEADER} must be visible ASCII"))
            .param(SESSION_HEADER)
    })?;
    Ok(Some(key.to_owned()).filter(|k| !k.is_empty()))
}

use crate::{PRIORITY_HEADER, SLO_HEADER, TENANT_HEADER};

/// A request's class for flow control, and whether its priority was named (by the client,
/// its key or its model): the priority from its header, else the key's default, else the
/// configured one of its model (`adapter`, else the base model), lowered to the key's ceiling when above it
/// (counted); the objective from its header; the tenant from the API key that let it in (a
/// client cannot pose as another key's tenant), else from its header, else `default`.
pub(crate) fn class(
    state: &FrontendState,
    headers: &HeaderMap,
    key: Option<&KeyId>,
    adapter: Option<&str>,
) -> Result<(kvroute_core::schedule::flow::RequestClass, bool), ApiError> {
    fn header<'h>(headers: &'h HeaderMap, name: &'static str) -> Result<Option<&'h str>, ApiError> {
        headers
            .get(name)
            .map(|v| {
                v.to_str().map_err(|_| {
                    ApiError::bad_request(format!("{name} must be visible ASCII")).param(name)
                })
            })
            .transpose()
    }
    fn number<T: std::str::FromStr>(
        v: Option<&str>,
        name: &'static str,
    ) -> Result<Option<T>, ApiError> {
        v.map(|v| {
            v.trim().parse().map_err(|_| {
                ApiError::bad_request(format!("{name} must be an integer")).param(name)
            })
        })
        .transpose()
    }
    let named = number::<i32>(header(headers, PRIORITY_HEADER)?, PRIORITY_HEADER)?;
    let grant = key.map(|k| k.grant).unwrap_or_default();
    let mut priority = named.or(grant.priority).or_else(|| state.model_priority(adapter));
    if let (Some(p), Some(max)) = (priority, grant.max_priority)
        && p > max
    {
        priority = Some(max);
        state.metrics.priority_clamped.inc();
    }
    let slo = number::<u32>(header(headers, SLO_HEADER)?, SLO_HEADER)?;
    let tenant = match key {
        Some(KeyId { id, .. }) => Some(id.as_str()),
        None => header(headers, TENANT_HEADER)?,
    };
    let class = kvroute_http::router_api::request_class(
        priority,
        tenant,
        slo,
        [PRIORITY_HEADER, TENANT_HEADER, SLO_HEADER],
    )?;
    Ok((class, priority.is_some()))
}

/// The body parsed once ([`kvroute_http::openai::parse_body`]): the whole of it as a JSON
/// value, to pass on, and `T` (the fields kvroute reads), checked as an engine checks it. A
/// field that steers a KV transfer ([`crate::TRANSFER_FIELDS`]) is a 400 naming it, unless the
/// upstream is trusted.
fn parse<T: serde::de::DeserializeOwned>(
    state: &FrontendState,
    body: Result<Bytes, BytesRejection>,
    param: &'static str,
) -> Result<(Value, T), ApiError> {
    let (value, fields) = kvroute_http::openai::parse_body(&body?, param, None)?;
    if !state.options.trust_transfer_fields {
        crate::transfer::refuse(&value)?;
    }
    Ok((value, fields))
}

pub(crate) async fn chat(
    State(state): State<Arc<FrontendState>>,
    key: Option<Extension<KeyId>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let trace = TraceContext::from_headers(&headers);
    let span = kvroute_http::otel::request_span("chat", trace.as_ref());
    kvroute_http::otel::in_span(span, async {
        let key = key.as_ref().map(|k| &k.0);
        let out = chat_outbound(&state, key, &headers, trace, body).await?;
        dispatch(&state, &out).await
    })
    .await
}

/// A chat request made an [`Outbound`]: parsed and checked, its class, model, session and
/// namespace read, its images fetched and its prompt rendered and tokenized.
pub(crate) async fn chat_outbound(
    state: &FrontendState,
    key: Option<&KeyId>,
    headers: &HeaderMap,
    trace: Option<TraceContext>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Outbound, ApiError> {
    let (mut raw, req) = parse::<ChatCompletionRequest>(state, body, "messages")?;
    let adapter = state.models.resolve(req.model.as_deref())?;
    let (class, priority_named) = class(state, headers, key, adapter.as_deref())?;
    let session = session(headers, req.prompt_cache_key.as_deref())?;
    let session = state.session_key(key, session);
    let namespace = state.namespace(key, req.cache_salt.as_deref());
    // Images: fetched once here, forwarded inline, named by their identifier.
    model_named(req.model.as_deref());
    let preprocess = kvroute_http::span!(
        "kvroute.preprocess",
        kvroute.prompt_tokens = tracing::field::Empty,
        kvroute.images = tracing::field::Empty,
    );
    let prepare =
        state.preprocessor.prepare_chat_request(&req, &state.fetcher, state.max_model_len);
    let (prepared, images) = tracing::Instrument::instrument(prepare, preprocess.clone()).await?;
    preprocess.record("kvroute.prompt_tokens", prepared.tokens.len() as i64);
    preprocess.record("kvroute.images", images.len() as i64);
    drop(req);
    rewrite_image_parts(&mut raw, &images);
    let dialects = state.workers().tokens_dialects();
    let keys = Keys {
        namespace: namespace.as_deref(),
        adapter: adapter.as_deref(),
        session: session.as_deref(),
        class: Some(&class),
        priority_named: priority_named && state.options.engine_priority,
        migrations: state.options.max_migrations,
    };
    let out =
        Outbound::new(paths::CHAT_COMPLETIONS, raw, &prepared, &keys, state.block_size, &dialects)?;
    Ok(Outbound { trace, explain: explain(state, headers), ..out })
}

/// The request's span names the model the client asked for (when spans are exported).
fn model_named(model: Option<&str>) {
    if let Some(model) = model.filter(|_| kvroute_http::otel::on()) {
        tracing::Span::current().record("gen_ai.request.model", model);
    }
}

/// Whether the request asks for its decision ([`crate::EXPLAIN_HEADER`]) of a front door that
/// explains them, and shows the admin token ([`crate::ADMIN_TOKEN_HEADER`]): a decision tells
/// what other workers hold and run, and so whether another tenant's prompt is cached, which
/// is no client's business. Without an admin token set, nothing is explained.
pub(crate) fn explain(state: &FrontendState, headers: &HeaderMap) -> bool {
    state.options.explain_decisions
        && headers
            .get(crate::EXPLAIN_HEADER)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true") || v.as_bytes() == b"1")
        && !state.admin.is_empty()
        && headers
            .get(crate::ADMIN_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|token| state.admin.accepts(token.trim()))
}

/// Each `image_url` part, in order, gets its image inline (a fetched one as a `data:` URL)
/// and its identifier as `uuid`.
fn rewrite_image_parts(raw: &mut Value, images: &[LoadedImage]) {
    let mut next = images.iter();
    let Some(messages) = raw.get_mut("messages").and_then(Value::as_array_mut) else { return };
    let parts = messages
        .iter_mut()
        .filter_map(|m| m.get_mut("content").and_then(Value::as_array_mut))
        .flatten()
        .filter(|p| p.get("type").and_then(Value::as_str) == Some("image_url"));
    for part in parts {
        let Some(loaded) = next.next() else { return };
        let Some(image_url) = part.get_mut("image_url").and_then(Value::as_object_mut) else {
            continue;
        };
        if let Some(bytes) = &loaded.fetched {
            let inline = base64::engine::general_purpose::STANDARD.encode(bytes);
            image_url.insert("url".into(), Value::String(format!("data:image;base64,{inline}")));
        }
        image_url.insert("uuid".into(), Value::String(loaded.image.identifier.clone()));
    }
}

pub(crate) async fn completions(
    State(state): State<Arc<FrontendState>>,
    key: Option<Extension<KeyId>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let trace = TraceContext::from_headers(&headers);
    let span = kvroute_http::otel::request_span("text_completion", trace.as_ref());
    kvroute_http::otel::in_span(span, async {
        let key = key.as_ref().map(|k| &k.0);
        let out = completion_outbound(&state, key, &headers, trace, body)?;
        dispatch(&state, &out).await
    })
    .await
}

/// A completion request made an [`Outbound`], as [`chat_outbound`] makes a chat request.
pub(crate) fn completion_outbound(
    state: &FrontendState,
    key: Option<&KeyId>,
    headers: &HeaderMap,
    trace: Option<TraceContext>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Outbound, ApiError> {
    let (raw, req) = parse::<CompletionRequest>(state, body, "prompt")?;
    let adapter = state.models.resolve(req.model.as_deref())?;
    let (class, priority_named) = class(state, headers, key, adapter.as_deref())?;
    let session = session(headers, req.prompt_cache_key.as_deref())?;
    let session = state.session_key(key, session);
    let namespace = state.namespace(key, req.cache_salt.as_deref());
    model_named(req.model.as_deref());
    let preprocess =
        kvroute_http::span!("kvroute.preprocess", kvroute.prompt_tokens = tracing::field::Empty,);
    let prepared = preprocess
        .in_scope(|| state.preprocessor.prepare_completion_request(&req, state.max_model_len))?;
    preprocess.record("kvroute.prompt_tokens", prepared.tokens.len() as i64);
    let dialects = state.workers().tokens_dialects();
    let keys = Keys {
        namespace: namespace.as_deref(),
        adapter: adapter.as_deref(),
        session: session.as_deref(),
        class: Some(&class),
        priority_named: priority_named && state.options.engine_priority,
        migrations: state.options.max_migrations,
    };
    let out =
        Outbound::new(paths::COMPLETIONS, raw, &prepared, &keys, state.block_size, &dialects)?;
    Ok(Outbound { trace, explain: explain(state, headers), ..out })
}

/// The base model and every adapter the fleet serves (from the settings and the workers'
/// own lists).
pub(crate) async fn models(State(state): State<Arc<FrontendState>>) -> Json<ModelList> {
    Json(state.models.list())
}

/// The workers as the front door sees them (their health), and the router's view of them
/// (embedded, or a remote router's `/workers`).
pub(crate) async fn workers(State(state): State<Arc<FrontendState>>) -> Json<Value> {
    let health = state.health.snapshot(Instant::now());
    let view = state.decider.view().await;
    Json(json!({"health": health, "workers": view["workers"],
        "recent_decisions": view["recent_decisions"], "ttft_predictions": view["ttft_predictions"],
        "nats": view["nats"]}))
}

type Membership = Result<(StatusCode, Json<Value>), ApiError>;

/// The embedded router, whose membership the front door's API changes.
fn membership(state: &FrontendState) -> Result<&Arc<kvroute_router::RouterState>, ApiError> {
    match &state.decider {
        crate::decider::Decider::Embedded(router) => Ok(router),
        crate::decider::Decider::Remote(_) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "the fleet's membership is the remote router's: change it there (POST /workers)",
        )),
    }
}

/// `POST /workers`: a worker joins (`kvroute_router::members::api::add`).
pub(crate) async fn add_worker(
    State(state): State<Arc<FrontendState>>,
    body: axum::body::Bytes,
) -> Membership {
    let (status, body) = kvroute_router::members::api::add(membership(&state)?, &body)?;
    Ok((status, Json(body)))
}

/// `POST /workers/{id}/drain`.
pub(crate) async fn drain_worker(
    State(state): State<Arc<FrontendState>>,
    axum::extract::Path(id): axum::extract::Path<u64>,
) -> Membership {
    let (status, body) = kvroute_router::members::api::drain_one(membership(&state)?, id)?;
    Ok((status, Json(body)))
}

/// `DELETE /workers/{id}`.
pub(crate) async fn remove_worker(
    State(state): State<Arc<FrontendState>>,
    axum::extract::Path(id): axum::extract::Path<u64>,
) -> Membership {
    let (status, body) = kvroute_router::members::api::remove_one(membership(&state)?, id)?;
    Ok((status, Json(body)))
}

/// Request `id`'s decision (the embedded router's decision log or recent decisions; a remote
/// router answers on its own `/decisions/{id}`); 404 when none is kept.
pub(crate) async fn decision(
    State(state): State<Arc<FrontendState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    let crate::decider::Decider::Embedded(router) = &state.decider else {
        let message = "the decisions are the remote router's: ask its /decisions/{id}";
        return Err(ApiError::not_found(message));
    };
    router
        .view()
        .explained(&id)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no decision of request {id} is kept")))
}

/// Liveness; with an embedded router, its state (NATS away is degraded, not down).
pub(crate) async fn health(State(state): State<Arc<FrontendState>>) -> Json<Value> {
    Json(state.decider.health())
}

/// `GET /ui/history`: the status page's chart, from the front door's own samples.
pub(crate) async fn history(
    State(state): State<Arc<FrontendState>>,
    query: axum::extract::Query<kvroute_http::status::After>,
) -> Json<serde_json::Value> {
    kvroute_http::status::history_response(&state.history, state.options.status_every, query.after)
}

pub(crate) async fn metrics(State(state): State<Arc<FrontendState>>) -> Response {
    state.metrics.ejected.set(state.health.ejected_count() as i64);
    let registries =
        [Some(&state.metrics.registry), state.decider.registry(), state.beside.get().map(|r| &**r)];
    let registries: Vec<&kvroute_http::metrics::Registry> =
        registries.into_iter().flatten().collect();
    kvroute_http::metrics::response(&registries)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kvroute_http::auth::Grant;
    use kvroute_router::{RouterConfig, RouterState};

    use super::*;

    fn state() -> FrontendState {
        let router = Arc::new(RouterState::new(RouterConfig::default()));
        let fetch = kvroute_preprocess::fetch::FetchConfig::default();
        let fetcher = kvroute_preprocess::fetch::Fetcher::new(fetch).unwrap();
        let pre = Arc::new(kvroute_preprocess::Preprocessor::builtin());
        let state = FrontendState::new(pre, fetcher, router);
        let model = state.preprocessor.model_name().to_owned();
        state.with_model_priorities(BTreeMap::from([(model, 7)]))
    }

    fn priority(state: &FrontendState, header: Option<&str>, grant: Option<Grant>) -> i32 {
        let mut headers = HeaderMap::new();
        if let Some(h) = header {
            headers.insert(crate::PRIORITY_HEADER, h.parse().unwrap());
        }
        let key = grant.map(|grant| KeyId { id: "t-0123".into(), grant });
        let (class, _) = class(state, &headers, key.as_ref(), None).unwrap();
        assert_eq!(class.tenant.as_ref(), if key.is_some() { "t-0123" } else { "default" });
        class.priority
    }

    /// #64 finding 3: the header, else the key's default, else the model's; a key's ceiling
    /// caps each of them (counted).
    #[test]
    fn priority_comes_from_the_header_the_key_or_the_model_and_a_key_caps_it() {
        let state = state();
        let capped = Grant { priority: None, max_priority: Some(2) };
        let low = Grant { priority: Some(-3), max_priority: None };
        assert_eq!(priority(&state, Some("50"), None), 50, "no key: as named");
        assert_eq!(priority(&state, None, None), 7, "the model's");
        assert_eq!(priority(&state, None, Some(low)), -3, "the key's default before the model's");
        assert_eq!(priority(&state, Some("1"), Some(low)), 1, "a named one first");
        assert_eq!(state.metrics.priority_clamped.get(), 0);
        assert_eq!(priority(&state, Some("100"), Some(capped)), 2, "lowered to the ceiling");
        assert_eq!(priority(&state, None, Some(capped)), 2, "the model's too");
        assert_eq!(priority(&state, Some("-5"), Some(capped)), -5, "below it: as named");
        assert_eq!(state.metrics.priority_clamped.get(), 2);
    }
}

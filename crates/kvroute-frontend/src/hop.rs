//! One hop: how a placed request reaches an engine and its answer the client. Everything
//! about a hop is here: the request as the engine gets it ([`Outbound`], made in
//! [`crate::outbound`]), the in-flight
//! accounting ([`InFlight`], from placement to the answer's end), the timeouts and ejection of
//! a failing worker, and the answer passed back with its cached tokens read on the way
//! ([`crate::usage`]). [`crate::dispatch`] places a request and retries its hop on another
//! worker; [`crate::pair`] sends a disaggregated request's two legs over the same hops. This
//! module imports neither.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::StreamExt;
use http_body_util::Full;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::trace::TraceContext;
use kvroute_http::{ApiError, ClientError};
use kvroute_router::Dialect;
use serde_json::Value;

use crate::decider::Placement;
use crate::dialect;
use crate::health::Failure;
use crate::observer::{AnswerObserver, InFlight};
use crate::outbound::Outbound;
use crate::translate::Translator;
use crate::usage::stream_error_event;
use crate::{FrontendState, OVERLAP_HEADER, OVERLAP_TIER_HEADER, WORKER_HEADER};

/// The span of one engine call (`leg`: `aggregated`, `prefill` or `decode`): its context is
/// the `traceparent` the engine gets; it ends with the answer.
pub(crate) fn engine_span(worker: WorkerWithDpRank, leg: &'static str, id: &str) -> tracing::Span {
    kvroute_http::span!(
        "kvroute.engine",
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        kvroute.leg = leg,
        kvroute.request_id = id,
        kvroute.worker_id = worker.worker_id.0 as i64,
        kvroute.dp_rank = i64::from(worker.dp_rank.0),
        http.response.status_code = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.usage.cache_read.input_tokens = tracing::field::Empty,
        kvroute.predicted_cached_tokens = tracing::field::Empty,
    )
}

/// Why a hop failed before any answer came.
pub(crate) type HopFailure = (Failure, ClientError);

/// A body as one worker takes it, with an edit (a leg's fields) applied.
pub(crate) type Edit<'a> = &'a (dyn Fn(&mut Value) + Sync);

/// Sends `out` to the placed worker (its body in the worker's dialect, changed by `edit`)
/// and answers the client with what it says; the failure when no answer came.
pub(crate) async fn send(
    state: &Arc<FrontendState>,
    out: &Outbound,
    placement: Placement,
    guard: InFlight,
    edit: Option<Edit<'_>>,
    timeout: std::time::Duration,
) -> Result<Result<Response, HopFailure>, ApiError> {
    let worker = placement.worker.worker_id;
    Ok(match post(state, out, (worker, &guard.span), edit, timeout).await? {
        Ok((r, from)) => Ok(respond(state, out, placement, guard, r, from)?),
        Err(failure) => Err(failure),
    })
}

/// How a request goes to one worker: the path and body in the worker's dialect.
pub(crate) struct Hop {
    pub path: &'static str,
    pub body: Bytes,
    /// The tokens dialect it went in (its answer then comes back in that dialect's shape, to
    /// be turned into the client's); `None`: the client's own API.
    pub tokens: Option<Dialect>,
}

/// A worker's answer as it starts: its head, its body still to come.
pub(crate) type Head = hyper::Response<hyper::body::Incoming>;

/// Posts `out` to `worker` in its engine call's `span` (its body in the worker's dialect,
/// changed by `edit`): the answer's head and the tokens dialect it went in, or the failure
/// when no head came.
pub(crate) async fn post(
    state: &Arc<FrontendState>,
    out: &Outbound,
    (worker, span): (WorkerId, &tracing::Span),
    edit: Option<Edit<'_>>,
    timeout: std::time::Duration,
) -> Result<Result<(Head, Option<Dialect>), HopFailure>, ApiError> {
    let Some(base) = state.workers().url(worker).map(str::to_owned) else {
        return Err(ApiError::internal("a placed worker has no URL"));
    };
    let Hop { path, body, tokens: from } = state.hop(worker, out);
    let body = match edit {
        Some(edit) => edited(&body, edit)?,
        None => body,
    };
    let mut request = hyper::Request::post(format!("{base}{path}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(ApiError::internal)?;
    traced(request.headers_mut(), span, out.trace.as_ref());
    let sent = tokio::time::timeout(timeout, state.workers().client.send(request)).await;
    Ok(match sent {
        Ok(Ok(r)) => Ok((r, from)),
        Ok(Err(e)) if e.is_connect() => Err(failed(span, Failure::Connect, e)),
        Ok(Err(e)) => Err(failed(span, Failure::Broken, e)),
        Err(_) => Err(failed(span, Failure::Timeout, ClientError::Timeout(timeout))),
    })
}

/// A hop that failed before its answer, marked so on its span.
pub(crate) fn failed(span: &tracing::Span, why: Failure, error: ClientError) -> HopFailure {
    if kvroute_http::otel::on() {
        kvroute_http::otel::failed(span, why.as_str());
    }
    (why, error)
}

/// An engine call's headers carry the request's trace: the engine call's `span` when kvroute
/// exports spans, else the caller's context as the child of a span id of its own.
pub(crate) fn traced(
    headers: &mut axum::http::HeaderMap,
    span: &tracing::Span,
    trace: Option<&TraceContext>,
) {
    if let Some(trace) = kvroute_http::otel::outbound(span, trace) {
        trace.write(headers);
    }
}

/// `body` (a JSON object) with `edit` applied.
pub(crate) fn edited(body: &Bytes, edit: Edit<'_>) -> Result<Bytes, ApiError> {
    let mut value: Value = serde_json::from_slice(body).map_err(ApiError::internal)?;
    edit(&mut value);
    Ok(Bytes::from(serde_json::to_vec(&value).map_err(ApiError::internal)?))
}

impl FrontendState {
    /// A fresh request id.
    pub(crate) fn request_id(&self) -> String {
        format!("kvr-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

impl FrontendState {
    /// How `out` goes to `worker`, in the worker's dialect.
    pub(crate) fn hop(&self, worker: WorkerId, out: &Outbound) -> Hop {
        let dialect = match self.workers().dialect(worker) {
            // A continuation's prompt is token ids: OpenAI's completions take them.
            Dialect::OpenaiChat if out.continued => Dialect::OpenaiCompletionsTokens,
            dialect => dialect,
        };
        let as_sent = || Hop { path: out.path, body: out.body.clone(), tokens: None };
        if !dialect.sends_tokens() {
            return as_sent();
        }
        match out.tokens.iter().find(|(d, _)| *d == dialect) {
            Some((_, tokens)) => {
                self.metrics.as_tokens.inc();
                Hop { path: dialect::path(dialect), body: tokens.clone(), tokens: Some(dialect) }
            }
            None => {
                self.metrics.fallbacks.inc();
                as_sent()
            }
        }
    }
}

/// The worker's answer to the client: its status and content headers, which worker it was
/// (and, when asked for, the cached tokens predicted there), its body passed on as it comes
/// (turned into OpenAI's shape on the way when it went in the tokens dialect `from` and
/// succeeded).
pub(crate) fn respond<B>(
    state: &Arc<FrontendState>,
    out: &Outbound,
    placement: Placement,
    guard: InFlight,
    response: hyper::Response<B>,
    from: Option<Dialect>,
) -> Result<Response, ApiError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let worker = placement.worker;
    let (parts, incoming) = response.into_parts();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let prompt_tokens = out.place.num_tokens as u64;
    let observer_id = guard.id.clone();
    let mut observer = AnswerObserver::new(guard, None, placement, prompt_tokens, out.strip_usage);
    // Any head shows the worker answers: it is the front door's own hop.
    observer.head(parts.status.is_success(), true, sse);
    observer.guard.status(parts.status.as_u16());
    let translator = match (from, parts.status.is_success()) {
        (Some(from), true) => {
            // An adapter's answer names the adapter, as vLLM's does.
            let model = out.place.adapter.clone();
            let model = model.unwrap_or_else(|| state.preprocessor.model_name().to_owned());
            let translator = Translator::new(from, out.kind, &observer.guard.id, model, sse);
            Some(match from {
                Dialect::VllmGenerateTokens => {
                    translator.detokenizing(Arc::clone(&state.preprocessor), &out.prompt_tail)
                }
                _ => translator,
            })
        }
        (Some(from), false) => Translator::failed(from, parts.status.as_u16()),
        (None, _) => None,
    };
    let mut data = translated(incoming, translator);
    if sse {
        data = silent_after(data, state.options.inter_token_timeout);
    }
    let pieces = proxy_body(data, observer, worker.worker_id);
    let movable = out.resume.is_some() && sse && parts.status.is_success();
    let stream = ended_by_error(pieces, sse, movable);
    let mut answer = Response::builder().status(parts.status);
    for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
        if let Some(v) = parts.headers.get(&name) {
            answer = answer.header(name, v.clone());
        }
    }
    answer = answer.header(WORKER_HEADER, HeaderValue::from(worker.worker_id.0));
    if let Some(decision) = out.explain.then(|| explained(state, &observer_id)).flatten() {
        answer = answer.header(crate::DECISION_HEADER, decision);
    }
    if state.options.expose_overlap {
        let [host, disk, external] = placement.predicted_tier_tokens;
        answer = answer
            .header(OVERLAP_HEADER, HeaderValue::from(placement.predicted_cached_tokens))
            .header(OVERLAP_TIER_HEADER, format!("{host},{disk},{external}"));
    }
    answer.body(Body::from_stream(stream)).map_err(ApiError::internal)
}

/// Request `id`'s decision as [`crate::DECISION_HEADER`]'s value, while the embedded router
/// still holds it among its recent ones (a remote router's are on its `/workers`).
fn explained(state: &FrontendState, id: &str) -> Option<HeaderValue> {
    let crate::decider::Decider::Embedded(router) = &state.decider else { return None };
    let record = router.view().decision_of(id)?;
    let json = serde_json::json!({
        "considered": record.considered,
        "cost_unit": record.cost_unit,
        "isl_tokens": record.isl_tokens,
        "candidates": record.candidates,
    });
    HeaderValue::from_str(&json.to_string()).ok()
}

/// The worker's answer, passed on as it arrives through its observer (first bytes, usage,
/// end). A worker that breaks off mid-answer is ejected, and the answer ends with
/// [`Piece::Broken`]: its stream then moves to another worker ([`crate::migrate`]) or ends
/// ([`ended_by_error`]).
fn proxy_body(
    chunks: impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
    observer: AnswerObserver,
    worker: WorkerId,
) -> impl futures_util::Stream<Item = Result<Piece, std::io::Error>> + Send + 'static {
    chunks.scan((observer, false), move |(observer, done), chunk| {
        if *done {
            return std::future::ready(None);
        }
        observer.first_bytes();
        let item = match chunk {
            Ok(bytes) => Ok(Piece::Bytes(observer.piece(bytes))),
            Err(e) => {
                *done = true;
                let state = &observer.guard.state;
                state.metrics.broken.inc();
                let why = match e.kind() {
                    std::io::ErrorKind::TimedOut => Failure::Timeout,
                    _ => Failure::Broken,
                };
                state.worker_failed(worker, why);
                tracing::warn!(%worker, error = %e, "the worker broke off its answer");
                Ok(Piece::Broken(worker, e))
            }
        };
        std::future::ready(Some(item))
    })
}

/// A piece of an answer as it passes: its bytes, or the worker broke it off.
pub(crate) enum Piece {
    Bytes(Bytes),
    Broken(WorkerId, std::io::Error),
}

/// The error that ends the body of a stream its worker broke off when the stream may move to
/// another worker: [`crate::dispatch`] continues it there.
#[derive(Debug, thiserror::Error)]
#[error("worker {0} broke off the answer")]
pub(crate) struct Broken(pub(crate) WorkerId);

/// The answer's bytes: a stream its worker broke off ends with [`Broken`] when it may move
/// (`movable`), else with an error event in OpenAI's shape and `[DONE]` rather than a
/// truncated body; another body ends with the error.
fn ended_by_error(
    pieces: impl futures_util::Stream<Item = Result<Piece, std::io::Error>> + Send + 'static,
    sse: bool,
    movable: bool,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    pieces.map(move |piece| match piece? {
        Piece::Bytes(bytes) => Ok(bytes),
        Piece::Broken(worker, _) if movable => Err(std::io::Error::other(Broken(worker))),
        Piece::Broken(worker, _) if sse => Ok(Bytes::from(stream_error_event(worker))),
        Piece::Broken(_, e) => Err(e),
    })
}

/// Largest whole answer of a tokens dialect read to be turned into OpenAI's.
const WHOLE_ANSWER_LIMIT: usize = 64 << 20;

/// A stream whose worker sends nothing for `timeout` (its engine stopped, its node gone
/// without a reset) ends with a timeout error: as if it broke off, it is ejected and the
/// stream moves on.
fn silent_after(
    data: futures_util::stream::BoxStream<'static, Result<Bytes, std::io::Error>>,
    timeout: std::time::Duration,
) -> futures_util::stream::BoxStream<'static, Result<Bytes, std::io::Error>> {
    futures_util::stream::unfold(Some(data), move |data| async move {
        let mut data = data?;
        match tokio::time::timeout(timeout, data.next()).await {
            Ok(item) => Some((item?, Some(data))),
            Err(_) => {
                let silent = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no token for {timeout:?}"),
                );
                Some((Err(silent), None))
            }
        }
    })
    .boxed()
}

/// The answer's bytes, through `translator` when there is one: a stream event by event, a
/// whole answer once it has all come.
fn translated<B>(
    incoming: B,
    translator: Option<Translator>,
) -> futures_util::stream::BoxStream<'static, Result<Bytes, std::io::Error>>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use http_body_util::BodyExt as _;
    match translator {
        None => incoming.into_data_stream().map(|c| c.map_err(std::io::Error::other)).boxed(),
        Some(mut t) if t.sse() => incoming
            .into_data_stream()
            .map(move |c| c.map(|b| t.stream(&b)).map_err(std::io::Error::other))
            .boxed(),
        Some(mut t) => futures_util::stream::once(async move {
            let whole = http_body_util::Limited::new(incoming, WHOLE_ANSWER_LIMIT).collect().await;
            whole.map(|w| t.whole(&w.to_bytes())).map_err(std::io::Error::other)
        })
        .boxed(),
    }
}

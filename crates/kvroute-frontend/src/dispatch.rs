//! Dispatch: places a request and sends it over one hop ([`crate::hop`]), trying another
//! worker while none has answered ([`crate::attempts`]); a pair's two legs are sent by
//! [`crate::pair`]. A stream whose worker breaks it off after its first bytes goes on on
//! another worker ([`relayed`], [`crate::migrate`]).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::Response;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use kvroute_core::WorkerId;
use kvroute_http::ApiError;

use crate::attempts::{Attempt, Attempts};
use crate::hop::{Broken, send};
use crate::migrate::{Resume, Splice, Transcript, ended};
use crate::outbound::Outbound;
use crate::pair::split;
use crate::usage::stream_error_event;
use crate::{FrontendState, RESPONSE_TIMEOUT};

pub(crate) use crate::dialect::Keys;

/// Places the request and sends it, trying another worker while none has answered: until an
/// answer's head arrives nothing has reached the client, so a worker that refuses the
/// connection, breaks it or stays silent past the timeout is ejected and the request placed
/// again without it (the first one drops the request when we hang up).
pub(crate) async fn dispatch(
    state: &Arc<FrontendState>,
    out: &Outbound,
) -> Result<Response, ApiError> {
    let mut attempts = Attempts::new(state, out, None);
    // An engine's 404 for the request's adapter, kept for when no other worker is left.
    let mut unserved: Option<Response> = None;
    loop {
        let attempt = match attempts.next().await {
            Ok(attempt) => attempt,
            Err(e) => return unserved.ok_or(e),
        };
        let answer = match attempt.legs.prefill {
            Some(prefill) => split(state, out, prefill, attempt, &mut attempts).await?,
            None => one(state, out, attempt, &mut attempts).await?,
        };
        let Some(answer) = answer else { continue };
        // The engine no longer serves the adapter (unloaded since its list was read, or the
        // router not told yet): another worker may.
        if let (StatusCode::NOT_FOUND, Some(_)) = (answer.status(), &out.place.adapter)
            && let Some(worker) = answered_by(&answer)
        {
            tracing::info!(%worker, adapter = ?out.place.adapter, "the worker does not serve the adapter now: trying another");
            attempts.skip(worker);
            unserved = Some(answer);
            continue;
        }
        return Ok(relayed(state, out, answer));
    }
}

/// The worker an answer came from (its [`crate::WORKER_HEADER`]).
fn answered_by(answer: &Response) -> Option<WorkerId> {
    let header = answer.headers().get(crate::WORKER_HEADER)?;
    header.to_str().ok()?.parse().ok().map(WorkerId)
}

/// One attempt on one worker (prefilled where it decodes): its answer, or `None` when the
/// worker could not take it or failed it (left out of the next attempts).
async fn one(
    state: &Arc<FrontendState>,
    out: &Outbound,
    attempt: Attempt,
    attempts: &mut Attempts<'_>,
) -> Result<Option<Response>, ApiError> {
    let Attempt { legs, guard } = attempt;
    let timeout = if out.streamed { state.options.first_byte_timeout } else { RESPONSE_TIMEOUT };
    if attempts.paired() {
        state.metrics.pd_in_place.inc();
    }
    let placement = legs.decode;
    let worker = placement.worker.worker_id;
    let Some(base) = state.workers().url(worker).map(str::to_owned) else {
        attempts.skip(worker);
        return Ok(None);
    };
    if let Some(adapter) = out.place.adapter.as_deref()
        && !state.ensure_adapter(worker, &base, adapter).await
    {
        attempts.skip(worker);
        return Ok(None);
    }
    // A tenant over its share gets a lower engine priority than its class's, once placed: its
    // work fills the engines without standing ahead of the others' (#78).
    let lowered = attempts.lowered();
    let dialect = Some(state.workers().dialect(worker))
        .filter(|d| out.tokens.iter().any(|(sent, _)| sent == d));
    let lower = move |v: &mut serde_json::Value| crate::dialect::lower_priority(v, dialect);
    let edit: Option<crate::hop::Edit<'_>> = lowered.then_some(&lower);
    if lowered {
        state.metrics.lowered_priority.inc();
    }
    match send(state, out, placement, guard, edit, timeout).await? {
        Ok(answer) => Ok(Some(answer)),
        Err(failure) => {
            attempts.failed(worker, failure);
            Ok(None)
        }
    }
}

type Bytestream = BoxStream<'static, Result<Bytes, std::io::Error>>;

/// The answer to the client: as it came, or, for a stream that may move, relayed: the text the
/// client is sent recorded and, when its worker breaks it off, the continuation spliced on.
fn relayed(state: &Arc<FrontendState>, out: &Outbound, answer: Response) -> Response {
    let Some(resume) = out.resume.clone() else { return answer };
    let (parts, body) = answer.into_parts();
    let first = body.into_data_stream().map(|c| c.map_err(std::io::Error::other)).boxed();
    let start = Relay::First(first, Transcript::default());
    let (state, trace) = (Arc::clone(state), out.trace.clone());
    // The continuation's engine call is a span of the request's own, as its first leg was.
    let span = tracing::Span::current();
    let stream = futures_util::stream::unfold(start, move |relay| {
        let (state, resume, trace) = (Arc::clone(&state), Arc::clone(&resume), trace.clone());
        let span = span.clone();
        async move {
            match relay {
                Relay::First(mut first, mut transcript) => match first.next().await? {
                    Ok(bytes) => {
                        transcript.record(&bytes);
                        Some((Ok(bytes), Relay::First(first, transcript)))
                    }
                    Err(e) => {
                        let Some(worker) = broken(&e) else {
                            return Some((Err(e), Relay::Done));
                        };
                        drop(first);
                        let to = (trace.as_ref(), worker);
                        let moving = moved(&state, &resume, to, transcript);
                        match tracing::Instrument::instrument(moving, span).await {
                            Moved::On(rest, splice) => spliced(rest, splice).await,
                            Moved::Complete(end) => Some((Ok(end), Relay::Done)),
                            Moved::Not => {
                                let error = Bytes::from(stream_error_event(worker));
                                Some((Ok(error), Relay::Done))
                            }
                        }
                    }
                },
                Relay::Then(rest, splice) => spliced(rest, splice).await,
                Relay::Done => None,
            }
        }
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// The worker that broke off a movable stream, when `e` (through the body's own wrapping) is
/// [`Broken`].
fn broken(e: &std::io::Error) -> Option<WorkerId> {
    let mut at: Option<&(dyn std::error::Error + 'static)> = e.get_ref().map(|e| e as _);
    while let Some(error) = at {
        if let Some(Broken(worker)) = error.downcast_ref::<Broken>() {
            return Some(*worker);
        }
        // An I/O error's source is its inner error's source, not the inner error.
        at = match error.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref().map(|e| e as _),
            None => error.source(),
        };
    }
    None
}

/// Where the client's stream is: on its first worker, on the continuation, or ended.
enum Relay {
    First(Bytestream, Transcript),
    Then(Bytestream, Splice),
    Done,
}

/// The continuation's next bytes, spliced.
async fn spliced(
    mut rest: Bytestream,
    mut splice: Splice,
) -> Option<(Result<Bytes, std::io::Error>, Relay)> {
    let item = rest.next().await?;
    Some((item.map(|b| splice.pass(&b)), Relay::Then(rest, splice)))
}

/// What became of a broken stream.
enum Moved {
    /// It goes on: the continuation's answer and its splice.
    On(Bytestream, Splice),
    /// Every token of its bound had gone out: only its end was missing (these bytes).
    Complete(Bytes),
    /// It cannot go on (nothing to continue, no worker, an error): the error event ends it.
    Not,
}

/// Places the continuation of what `transcript` holds without `worker` (ejected when it broke
/// the stream) and starts it.
async fn moved(
    state: &Arc<FrontendState>,
    resume: &Resume,
    (trace, worker): (Option<&kvroute_http::trace::TraceContext>, WorkerId),
    transcript: Transcript,
) -> Moved {
    if transcript.ended {
        return Moved::Not;
    }
    let Ok(generated) = state.preprocessor.encode(&transcript.text) else { return Moved::Not };
    if resume.complete(generated.len()) {
        return Moved::Complete(ended(resume.kind, transcript.head.as_ref()));
    }
    let Some(out) = Outbound::continuation(resume, &generated, trace) else { return Moved::Not };
    tracing::info!(%worker, generated = generated.len(), "the worker broke off a stream: it goes on on another worker");
    state.metrics.migrated("broken");
    let answer = match Box::pin(dispatch(state, &out)).await {
        Ok(a) if a.status().is_success() => a,
        Ok(a) => {
            tracing::warn!(status = %a.status(), "the continuation was refused");
            return Moved::Not;
        }
        Err(e) => {
            tracing::warn!(error = %e.message(), "the continuation could not be placed");
            return Moved::Not;
        }
    };
    let splice = Splice::after(resume, transcript, generated.len());
    let rest = answer.into_body().into_data_stream().map(|c| c.map_err(std::io::Error::other));
    Moved::On(rest.boxed(), splice)
}

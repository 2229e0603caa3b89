//! A request's two legs in a disaggregated fleet (docs/routing.md, "Prefill and decode"):
//! the router chooses a prefill and a decode worker, or one decode worker alone
//! ([`crate::decider::Decider::decide_pair`]); the front door then speaks the engines' own protocol:
//!
//! - **vLLM** (`kv_transfer_params`, as vllm-router's P/D mode and vLLM's proxy send it):
//!   the prefill worker gets the request with `do_remote_decode: true`, one token and no
//!   stream; its answer's `kv_transfer_params` go to the decode worker with the request as
//!   the client sent it.
//! - **SGLang** (a prefill worker that speaks `sglang-generate`): both get the request with
//!   `bootstrap_host`, `bootstrap_port` and `bootstrap_room`, at once; the decode worker waits
//!   for the prefill's KV itself.
//!
//! The client sees the decode worker's answer, streamed as it comes. A prefill worker that
//! fails before answering is ejected and the request placed again (in place, or with another
//! prefill worker); under SGLang's protocol the decode leg waiting for it is dropped at once.
//! A decode worker that answers that it could not take the prefill's KV (a 5xx, or a stream
//! whose first event is an error: vLLM's `kv_load_failure_policy = "fail"`, SGLang's failed
//! handshake) is not to blame: the request is placed again without that prefill worker. Both
//! legs are in flight in the router from placement: the prefill leg until its answer, the
//! decode leg until the client's answer ends.

use kvroute_http::trace::TraceContext;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::header;
use axum::response::Response;
use futures_util::StreamExt as _;
use futures_util::stream::BoxStream;
use http_body_util::{BodyExt as _, Full, Limited, StreamBody};
use hyper::body::Frame;
use kvroute_core::WorkerId;
use kvroute_core::schedule::pairs::prefill_leg_id;
use kvroute_http::router_api::Answered;
use kvroute_http::{ApiError, ClientError};
use kvroute_router::Dialect;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::attempts::{Attempt, Attempts};
use crate::decider::Placement;
use crate::health::Failure;
use crate::hop::{Edit, Head, Hop, HopFailure, edited, post, respond};
use crate::observer::InFlight;
use crate::outbound::Outbound;
use crate::{FrontendState, RESPONSE_TIMEOUT};

/// The largest prefill answer read (one token and its envelope).
const PREFILL_ANSWER_LIMIT: usize = 1 << 20;

/// A split's two legs: the `prefill` leg, then (vLLM) or beside it (SGLang) the decode leg, whose
/// answer the client gets; `None` when a worker failed or refused before that answer began
/// (left out of the next attempts).
pub(crate) async fn split(
    state: &Arc<FrontendState>,
    out: &Outbound,
    prefill: Placement,
    attempt: Attempt,
    attempts: &mut Attempts<'_>,
) -> Result<Option<Response>, ApiError> {
    let Attempt { legs, mut guard } = attempt;
    let timeout = match out.streamed {
        true => state.options.first_byte_timeout,
        false => RESPONSE_TIMEOUT,
    };
    // A prefill leg answers with its one token: it gets the first byte's bound whether the
    // client streams or not, so a stalled prefill engine is given up on (ejected, the
    // request placed again) in that time, not the whole answer's.
    let prefill_timeout = state.options.first_byte_timeout;
    let decode = legs.decode;
    state.metrics.pd_split.inc();
    guard.checked = false;
    let id = guard.id.clone();
    let p = prefill.worker.worker_id;
    let (edit, prefill_leg): (LegFields, _) = match state.workers().dialect(p) {
        Dialect::SglangGenerate => {
            let Some((host, port)) = state.workers().bootstrap(p) else {
                return Err(ApiError::internal("a prefill worker has no bootstrap port"));
            };
            let room = bootstrap_room(state);
            let fields = move |v: &mut Value| {
                v["bootstrap_host"] = json!(host);
                v["bootstrap_port"] = json!(port);
                v["bootstrap_room"] = json!(room);
            };
            let leg = Leg { state: Arc::clone(state), id, placed: prefill };
            let outcome = leg.spawn_sglang(out, fields.clone(), prefill_timeout);
            (Box::new(fields), Some(outcome))
        }
        _ => match vllm_prefill(state, out, &prefill, &id, prefill_timeout).await? {
            Ok(params) => {
                (Box::new(move |v: &mut Value| v["kv_transfer_params"] = params.clone()), None)
            }
            Err(f) => {
                state.metrics.pd_prefill_failed.inc();
                attempts.failed(p, f);
                return Ok(None);
            }
        },
    };
    match decode_leg(state, out, decode, guard, &*edit, timeout, prefill_leg).await? {
        Decoded::Answer(mut answer) => {
            let named = axum::http::HeaderValue::from(p.0);
            answer.headers_mut().insert(crate::PREFILL_WORKER_HEADER, named);
            return Ok(Some(answer));
        }
        Decoded::Failed(f) => attempts.failed(decode.worker.worker_id, f),
        Decoded::Handoff(why) => {
            state.metrics.pd_handoff_failed.inc();
            let d = decode.worker.worker_id;
            tracing::warn!(prefill = %p, decode = %d, %why, "KV handoff failed; placing again");
            attempts.skip(p);
        }
        Decoded::Prefill(PrefillOutcome::Refused(e)) => return Err(e),
        Decoded::Prefill(_) => attempts.skip(p),
    }
    Ok(None)
}

/// The fields a decode leg's body gets: where its prefill's KV is.
type LegFields = Box<dyn Fn(&mut Value) + Send + Sync>;

/// How a split's decode leg ended before the client's answer started.
enum Decoded {
    Answer(Response),
    /// The decode worker did not answer: it is to blame.
    Failed(HopFailure),
    /// The decode worker answered that it could not take the prefill's KV.
    Handoff(HandoffRefused),
    /// SGLang's prefill leg, sent beside it, failed or was refused first.
    Prefill(PrefillOutcome),
}

/// How SGLang's prefill leg ended.
enum PrefillOutcome {
    Done,
    /// The request's own fault, as the worker said it.
    Refused(ApiError),
    /// The worker failed (it was ejected).
    Failed,
}

/// A split's decode leg: sent with `edit` (the prefill's coordinates), its answer passed on
/// unless it says the handoff failed; dropped when `prefill` (SGLang's leg beside it) fails
/// first, as its engine would wait for KV that never comes.
async fn decode_leg(
    state: &Arc<FrontendState>,
    out: &Outbound,
    decode: Placement,
    guard: InFlight,
    edit: Edit<'_>,
    timeout: Duration,
    prefill: Option<oneshot::Receiver<PrefillOutcome>>,
) -> Result<Decoded, ApiError> {
    let worker = decode.worker.worker_id;
    let span = guard.span.clone();
    let head = async {
        let started = Instant::now();
        let (head, from) = match post(state, out, (worker, &span), Some(edit), timeout).await? {
            Ok(h) => h,
            Err(f) => return Ok(Err(Decoded::Failed(f))),
        };
        let left = timeout.saturating_sub(started.elapsed());
        Ok::<_, ApiError>(match peek(head, out.streamed, left).await {
            Ok(Ok(head)) => Ok((head, from)),
            Ok(Err(why)) => Err(Decoded::Handoff(why)),
            Err(f) => Err(Decoded::Failed(f)),
        })
    };
    let prefill_failed = async move {
        match prefill {
            Some(rx) => match rx.await {
                Ok(PrefillOutcome::Done) | Err(_) => std::future::pending().await,
                Ok(failed) => failed,
            },
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        head = head => match head? {
            Ok((head, from)) => Ok(Decoded::Answer(respond(state, out, decode, guard, head, from)?)),
            Err(ended) => Ok(ended),
        },
        failed = prefill_failed => Ok(Decoded::Prefill(failed)),
    }
}

/// Why a decode worker said it could not take the prefill's KV (its message).
#[derive(Debug)]
struct HandoffRefused(String);

impl std::fmt::Display for HandoffRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A decode answer's body, its first frame read ahead.
type Peeked = StreamBody<BoxStream<'static, Result<Frame<Bytes>, hyper::Error>>>;

/// A decode answer's head as it may go to the client, or why the handoff failed: a 5xx (its
/// message), or an event stream whose first event is an error. The failure when the stream
/// broke or stayed silent past `timeout` before its first event.
async fn peek(
    head: Head,
    streamed: bool,
    timeout: Duration,
) -> Result<Result<hyper::Response<Peeked>, HandoffRefused>, HopFailure> {
    let (parts, mut body) = head.into_parts();
    if parts.status.is_server_error() {
        let read = Limited::new(body, PREFILL_ANSWER_LIMIT).collect();
        let bytes = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(w)) => w.to_bytes(),
            _ => Bytes::new(),
        };
        let message = kvroute_http::client::error_message(&bytes);
        return Ok(Err(HandoffRefused(format!("HTTP {}: {message}", parts.status))));
    }
    let first = match streamed && parts.status.is_success() {
        true => match tokio::time::timeout(timeout, body.frame()).await {
            Ok(Some(Ok(frame))) => Some(frame),
            Ok(Some(Err(e))) => return Err((Failure::Broken, ClientError::Body(Box::new(e)))),
            Ok(None) => None,
            Err(_) => return Err((Failure::Timeout, ClientError::Timeout(timeout))),
        },
        false => None,
    };
    if let Some(why) = first.as_ref().and_then(Frame::data_ref).and_then(|d| stream_error(d)) {
        return Ok(Err(HandoffRefused(why)));
    }
    let rest = http_body_util::BodyStream::new(body);
    let stream = futures_util::stream::iter(first.map(Ok)).chain(rest).boxed();
    Ok(Ok(hyper::Response::from_parts(parts, StreamBody::new(stream))))
}

/// The message of an event stream's first event when it is an error (OpenAI's and vLLM's
/// `{"error": {...}}`, or `{"object": "error", ...}`).
fn stream_error(chunk: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(chunk).ok()?;
    let data = text.lines().find_map(|l| l.strip_prefix("data:"))?.trim();
    let v: Value = serde_json::from_str(data).ok()?;
    let error = match v.get("error") {
        Some(e) => e,
        None if v.get("object").and_then(Value::as_str) == Some("error") => &v,
        None => return None,
    };
    let message = error.get("message").and_then(Value::as_str);
    Some(message.unwrap_or("an error event").to_owned())
}

/// A fresh SGLang bootstrap room: unique within this front door, unlikely across doors.
fn bootstrap_room(state: &FrontendState) -> u64 {
    let n = state.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (state.room_salt ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 1
}

/// A prefill leg in flight: its id in the router and its placement.
struct Leg {
    state: Arc<FrontendState>,
    id: String,
    placed: Placement,
}

impl Leg {
    /// The prefill answered (`cached`: the prompt tokens it served from its cache, when it
    /// said): the router's prediction is checked against it and the leg is freed.
    fn ended(&self, prompt_tokens: usize, cached: Option<u64>) {
        let decider = &self.state.decider;
        if let Some(cached_tokens) = cached {
            let d = &self.placed;
            decider.answered(Answered {
                worker_id: d.worker.worker_id,
                dp_rank: d.worker.dp_rank,
                prompt_tokens: prompt_tokens as u64,
                predicted_cached_tokens: d.predicted_cached_tokens,
                predicted_tier_tokens: d.predicted_tier_tokens,
                cached_tokens,
            });
        }
        decider.finish(&prefill_leg_id(&self.id));
    }

    /// SGLang's prefill leg, beside the decode leg: sent at once, its answer read and
    /// dropped (a failure ejects the worker); how it ended, to the decode leg.
    fn spawn_sglang(
        self,
        out: &Outbound,
        fields: impl Fn(&mut Value) + Sync + Send + 'static,
        timeout: Duration,
    ) -> oneshot::Receiver<PrefillOutcome> {
        let worker = self.placed.worker.worker_id;
        let Hop { path, body, .. } = self.state.hop(worker, out);
        let prompt_tokens = out.place.num_tokens;
        let trace = out.trace.clone();
        let span =
            crate::hop::engine_span(self.placed.worker, "prefill", &prefill_leg_id(&self.id));
        let (tell, outcome) = oneshot::channel();
        tokio::spawn(async move {
            let whole = |v: &mut Value| {
                fields(v);
                v["stream"] = json!(false);
            };
            let answer = match edited(&body, &whole) {
                Ok(body) => {
                    let to = (worker, trace.as_ref(), &span);
                    prefill_answer(&self.state, to, path, body, timeout).await
                }
                Err(e) => Ok(Err(e)),
            };
            let ended = match answer {
                Ok(Ok(v)) => {
                    self.ended(prompt_tokens, cached_tokens(&v));
                    PrefillOutcome::Done
                }
                Ok(Err(e)) => {
                    tracing::warn!(%worker, error = %e.message(), "the prefill leg was refused");
                    self.ended(prompt_tokens, None);
                    PrefillOutcome::Refused(e)
                }
                Err(f) => {
                    self.state.metrics.pd_prefill_failed.inc();
                    self.state.worker_failed(worker, f.0);
                    self.ended(prompt_tokens, None);
                    PrefillOutcome::Failed
                }
            };
            let _ = tell.send(ended);
        });
        outcome
    }
}

/// The prompt tokens an answer says it served from the cache (OpenAI's usage, SGLang's
/// `meta_info`).
fn cached_tokens(v: &Value) -> Option<u64> {
    v.pointer("/usage/prompt_tokens_details/cached_tokens")
        .or_else(|| v.pointer("/meta_info/cached_tokens"))
        .and_then(Value::as_u64)
}

/// vLLM's prefill leg: the request with `do_remote_decode`, one token, no stream; the
/// `kv_transfer_params` its answer names for the decode worker. A refusal (4xx, 5xx) or an
/// answer without them is the client's error; a worker that does not answer is a failure.
async fn vllm_prefill(
    state: &Arc<FrontendState>,
    out: &Outbound,
    prefill: &Placement,
    id: &str,
    timeout: Duration,
) -> Result<Result<Value, HopFailure>, ApiError> {
    let worker = prefill.worker.worker_id;
    let Hop { path, body, .. } = state.hop(worker, out);
    let one_token: Edit<'_> = &|v: &mut Value| {
        v["kv_transfer_params"] = json!({
            "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null,
        });
        v["stream"] = json!(false);
        if let Some(o) = v.as_object_mut() {
            o.remove("stream_options");
        }
        match v.get_mut("sampling_params") {
            // vLLM's generate API.
            Some(sampling) => sampling["max_tokens"] = json!(1),
            None => {
                v["max_tokens"] = json!(1);
                if v.get("max_completion_tokens").is_some() {
                    v["max_completion_tokens"] = json!(1);
                }
            }
        }
    };
    let leg = Leg { state: Arc::clone(state), id: id.to_owned(), placed: *prefill };
    let span = crate::hop::engine_span(prefill.worker, "prefill", &prefill_leg_id(id));
    let leg_to = (worker, out.trace.as_ref(), &span);
    let answer = match prefill_answer(state, leg_to, path, edited(&body, one_token)?, timeout).await
    {
        Ok(a) => a,
        Err(f) => {
            leg.ended(out.place.num_tokens, None);
            return Ok(Err(f));
        }
    };
    let answer = answer.inspect_err(|_| leg.ended(out.place.num_tokens, None))?;
    leg.ended(out.place.num_tokens, cached_tokens(&answer));
    match answer.get("kv_transfer_params") {
        Some(params) if params.is_object() => Ok(Ok(params.clone())),
        _ => Err(ApiError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "the prefill worker's answer has no kv_transfer_params (is it a KV producer?)",
        )),
    }
}

/// A prefill leg's whole answer as JSON, or its refusal as the client's error (a 4xx as the
/// worker said it); the failure when no answer came or the worker failed (5xx). `span`: the
/// leg's engine call.
async fn prefill_answer(
    state: &Arc<FrontendState>,
    (worker, trace, span): (WorkerId, Option<&TraceContext>, &tracing::Span),
    path: &str,
    body: Bytes,
    timeout: Duration,
) -> Result<Result<Value, ApiError>, HopFailure> {
    let Some(base) = state.workers().url(worker).map(str::to_owned) else {
        return Ok(Err(ApiError::internal("a placed worker has no URL")));
    };
    let request = hyper::Request::post(format!("{base}{path}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body));
    let mut request = match request {
        Ok(r) => r,
        Err(e) => return Ok(Err(ApiError::internal(e))),
    };
    crate::hop::traced(request.headers_mut(), span, trace);
    let started = Instant::now();
    let failed = |why, e| crate::hop::failed(span, why, e);
    let response = match tokio::time::timeout(timeout, state.workers().client.send(request)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) if e.is_connect() => return Err(failed(Failure::Connect, e)),
        Ok(Err(e)) => return Err(failed(Failure::Broken, e)),
        Err(_) => return Err(failed(Failure::Timeout, ClientError::Timeout(timeout))),
    };
    let status = response.status();
    if kvroute_http::otel::on() {
        span.record("http.response.status_code", i64::from(status.as_u16()));
    }
    let left = timeout.saturating_sub(started.elapsed());
    let whole = Limited::new(response.into_body(), PREFILL_ANSWER_LIMIT).collect();
    let bytes = match tokio::time::timeout(left, whole).await {
        Ok(Ok(w)) => w.to_bytes(),
        Ok(Err(e)) => return Err((Failure::Broken, ClientError::Body(e))),
        Err(_) => return Err((Failure::Timeout, ClientError::Timeout(timeout))),
    };
    if state.health.succeeded(worker) {
        tracing::info!(%worker, "worker answers again: back in rotation");
    }
    let message = kvroute_http::client::error_message(&bytes);
    match (status.is_success(), status.is_client_error()) {
        (true, _) => Ok(serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_gateway("the prefill worker's answer is not JSON", e))),
        // The request's own fault: the client hears it as the engine said it.
        (false, true) => Ok(Err(ApiError::new(status, message))),
        // The worker's: another prefill worker, or the decode worker itself, takes it.
        (false, false) => {
            Err((Failure::Broken, ClientError::Status { status, message, retry_after: None }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's first event is an error in OpenAI's and vLLM's shapes; a token, a partial
    /// event or bytes that are not JSON are not.
    #[test]
    fn a_stream_opening_with_an_error_is_told_apart() {
        let vllm = br#"data: {"error": {"message": "Internal server error", "code": 500}}

"#;
        assert_eq!(stream_error(vllm).as_deref(), Some("Internal server error"));
        let object = br#"data: {"object": "error", "message": "KV load failed"}"#;
        assert_eq!(stream_error(object).as_deref(), Some("KV load failed"));
        let token = br#"data: {"id": "x", "choices": [{"index": 0, "text": "hi"}]}"#;
        assert_eq!(stream_error(token), None);
        for other in [&b"data: {\"error\": {\"mess"[..], b"data: [DONE]", b"\xff\xfe", b""] {
            assert_eq!(stream_error(other), None, "{other:?}");
        }
    }
}

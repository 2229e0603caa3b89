//! One answer observed as it passes, whoever carries it: the front door's own hop
//! ([`crate::hop::respond`]) or a gateway, through the picker ([`crate::pick::Held`]). Its head
//! (the worker back in rotation, the prediction kept for the self-check), its first bytes (the
//! prefill done, once; a split's prefill leg freed), each piece (the engine's cached tokens
//! read, the usage chunk only kvroute asked for dropped) and its end: the request is freed
//! once, when the observer (its [`InFlight`]) is dropped, at the end of the answer, on an
//! error, or when the client or the gateway goes away.

use axum::body::Bytes;

use std::sync::Arc;

use kvroute_http::router_api::Answered;

use crate::decider::Placement;
use crate::state::FrontendState;
use crate::usage::Usage;

#[derive(Debug)]
pub(crate) struct AnswerObserver {
    pub(crate) guard: InFlight,
    /// The prefill leg of a split request, freed with the first bytes of the answer.
    prefill: Option<InFlight>,
    pub(crate) placement: Placement,
    prompt_tokens: u64,
    /// The front door asked a stream for its usage, which the client did not.
    strip_usage: bool,
    usage: Option<Usage>,
}

impl AnswerObserver {
    pub(crate) fn new(
        guard: InFlight,
        prefill: Option<InFlight>,
        placement: Placement,
        prompt_tokens: u64,
        strip_usage: bool,
    ) -> Self {
        Self { guard, prefill, placement, prompt_tokens, strip_usage, usage: None }
    }

    /// The answer's head came. `success`: a 2xx, whose cached tokens will be compared with the
    /// prediction. `reachable`: the head shows the worker answers (any head on the front
    /// door's own hop; through a gateway only a success, since the gateway may answer itself).
    /// `sse`: an event stream.
    pub(crate) fn head(&mut self, success: bool, reachable: bool, sse: bool) {
        let state = &self.guard.state;
        let worker = self.placement.worker.worker_id;
        if reachable && state.health.succeeded(worker) {
            tracing::info!(%worker, "worker answers again: back in rotation");
        }
        state.metrics.proxied.inc();
        if success && self.guard.checked {
            self.guard.predicted = Some((self.placement, self.prompt_tokens));
        }
        self.usage = Some(Usage::new(sse, self.strip_usage && sse));
    }

    /// The answer's first bytes (or its end, with none): the prefill is done, once; it
    /// teaches the router's predictions only when the answer streams (its first bytes are
    /// then its first token).
    pub(crate) fn first_bytes(&mut self) {
        if !self.guard.prefilled {
            self.guard.prefilled = true;
            if kvroute_http::otel::on() {
                self.guard.span.in_scope(|| kvroute_http::span_event!("first byte"));
            }
            let sse = self.usage.as_ref().is_some_and(|u| u.sse);
            self.guard.state.decider.prefill_done(&self.guard.id, sse);
            self.prefill = None;
        }
    }

    /// A piece of the answer as it passes: the first marks the prefill done; the engine's
    /// cached tokens are read, and the usage chunk only the front door asked for is dropped.
    /// Returns the bytes to pass on (an event stream is passed on event by event, whole).
    pub(crate) fn piece(&mut self, bytes: Bytes) -> Bytes {
        self.first_bytes();
        let usage = self.usage.get_or_insert_with(Usage::default);
        let (bytes, served) = usage.pass(bytes);
        if served.is_some() {
            self.guard.served = served;
        }
        if let Some((input, output)) = usage.counts.take()
            && kvroute_http::otel::on()
        {
            self.guard.span.record("gen_ai.usage.input_tokens", input as i64);
            self.guard.span.record("gen_ai.usage.output_tokens", output as i64);
            if let Some(request) = &self.guard.request_span {
                request.record("gen_ai.usage.input_tokens", input as i64);
                request.record("gen_ai.usage.output_tokens", output as i64);
            }
        }
        bytes
    }
}

/// Frees the request's in-flight accounting when dropped: at the end of the response body,
/// on an error, or when the client goes away.
pub(crate) struct InFlight {
    pub(crate) state: Arc<FrontendState>,
    pub(crate) id: String,
    pub(crate) prefilled: bool,
    /// Its answer's cached tokens check the router's prediction (not a decode leg's, whose
    /// prompt KV came from its prefill engine).
    pub(crate) checked: bool,
    /// What the router predicted (where, and the cached tokens) with the prompt's length, and
    /// what the engine reported it served, compared when the request ends.
    pub(crate) predicted: Option<(Placement, u64)>,
    pub(crate) served: Option<u64>,
    /// Its engine call's span ([`crate::hop::engine_span`]), ended with the answer; disabled
    /// unless spans are exported.
    pub(crate) span: tracing::Span,
    /// The request's own span, kept open until its answer ends (when spans are exported).
    pub(crate) request_span: Option<tracing::Span>,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").field("id", &self.id).finish_non_exhaustive()
    }
}

impl InFlight {
    pub(crate) fn new(state: &Arc<FrontendState>, id: String) -> Self {
        state.metrics.in_flight.inc();
        let state = Arc::clone(state);
        let request_span = kvroute_http::otel::on().then(|| {
            let request = tracing::Span::current();
            // A split's prefill leg is tracked under `{id}/prefill`: the request keeps its id.
            if !id.ends_with("/prefill") {
                request.record("kvroute.request_id", id.as_str());
            }
            request
        });
        Self {
            state,
            id,
            prefilled: false,
            checked: true,
            predicted: None,
            served: None,
            span: tracing::Span::none(),
            request_span,
        }
    }

    /// The engine answered with HTTP `status`.
    pub(crate) fn status(&self, status: u16) {
        if kvroute_http::otel::on() {
            self.span.record("http.response.status_code", i64::from(status));
            if status >= 500 {
                kvroute_http::otel::failed(&self.span, "http");
            }
        }
    }

    /// The self-check of the answer, as a span under its engine call's: the cached tokens
    /// predicted and served.
    fn checked_span(&self, predicted: u64, served: u64) {
        if kvroute_http::otel::on() && !self.span.is_disabled() {
            let _check = tracing::info_span!(
                target: kvroute_http::otel::TARGET,
                parent: &self.span,
                "kvroute.self_check",
                kvroute.predicted_cached_tokens = predicted as i64,
                kvroute.served_cached_tokens = served as i64,
                kvroute.agrees = predicted == served,
            );
            self.span.record("gen_ai.usage.cache_read.input_tokens", served as i64);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.metrics.in_flight.dec();
        self.state.decider.finish(&self.id);
        if let (Some((placement, prompt_tokens)), Some(served)) = (self.predicted, self.served) {
            self.checked_span(placement.predicted_cached_tokens, served);
            self.state.decider.answered(Answered {
                worker_id: placement.worker.worker_id,
                dp_rank: placement.worker.dp_rank,
                prompt_tokens,
                predicted_cached_tokens: placement.predicted_cached_tokens,
                predicted_tier_tokens: placement.predicted_tier_tokens,
                cached_tokens: served,
            });
        }
    }
}

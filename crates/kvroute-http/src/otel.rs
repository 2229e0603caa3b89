//! kvroute's own spans, exported over OTLP when the process is started with an endpoint
//! (docs/tracing.md). The services make them with [`crate::span!`] (tracing's spans under
//! [`TARGET`], which only the OpenTelemetry layer takes: they never reach the logs); the
//! process that starts installs the exporter and turns them [`on`].
//!
//! Off (the default), a span is a disabled callsite: no span is made, nothing is recorded,
//! and a request's trace context goes on to the engine as before ([`outbound`]: the caller's,
//! as the child of a fresh span id).
//!
//! On, whether a request is traced is decided once, at its start ([`request_span`]): by its
//! caller's sampled flag when it sent a `traceparent`, else by the ratio. An unsampled
//! request gets no spans at all: its request span is [`Span::none`], and [`crate::span!`] makes a
//! span only inside an enabled one (spans built and then dropped by the exporter's sampler
//! cost an unsampled request three quarters of a sampled one's: #78).

use std::str::FromStr as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::trace::{TraceContext, new_span_id};

/// The target of kvroute's spans: the OpenTelemetry layer takes it, the log leaves it out.
pub const TARGET: &str = "kvroute_otel";

static ON: AtomicBool = AtomicBool::new(false);
/// The share of requests without a caller's decision that are traced, of `u64::MAX`.
static RATIO: AtomicU64 = AtomicU64::new(u64::MAX);

/// Whether spans are exported (the process installed the OpenTelemetry layer).
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Called once the OpenTelemetry layer is installed: `ratio` (0..=1) of the requests whose
/// caller did not decide are traced.
pub fn turn_on(ratio: f64) {
    let share = (ratio.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
    RATIO.store(share, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
}

/// Whether a request whose caller sent `trace` is traced: the caller's sampled flag, else
/// a coin at the ratio.
pub fn sample(trace: Option<&TraceContext>) -> bool {
    match trace {
        Some(t) => t.flags & 1 == 1,
        None => {
            let share = RATIO.load(Ordering::Relaxed);
            share == u64::MAX || u64::from_be_bytes(new_span_id()) < share
        }
    }
}

/// One of kvroute's spans: `info_span!` under [`TARGET`], made only when spans are exported
/// and inside an enabled span (a sampled request's); else [`tracing::Span::none`], so that an
/// unsampled request makes none.
#[macro_export]
macro_rules! span {
    ($name:expr $(, $($fields:tt)*)?) => {
        match $crate::otel::on() && !::tracing::Span::current().is_disabled() {
            true => ::tracing::info_span!(target: $crate::otel::TARGET, $name $(, $($fields)*)?),
            false => ::tracing::Span::none(),
        }
    };
}

/// An event on the current span (a span event in the trace, never a log line).
#[macro_export]
macro_rules! span_event {
    ($($args:tt)*) => {
        ::tracing::info!(target: $crate::otel::TARGET, $($args)*)
    };
}

/// A request's span as a server sees it: `operation` (`chat`, `text_completion`,
/// `find_best_worker`, `pick`), continuing the caller's `trace` when it sent one. Its fields
/// are recorded as the request goes: the model, the request id, the usage, the status.
/// [`Span::none`] when spans are off or the request is not sampled ([`sample`]).
pub fn request_span(operation: &'static str, trace: Option<&TraceContext>) -> Span {
    if !on() || !sample(trace) {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "kvroute.request",
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = operation,
        gen_ai.request.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        kvroute.request_id = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    continue_trace(&span, trace);
    span
}

/// A request's handling in its span (when spans are exported), the span marked failed with
/// the error's status when the handling fails.
pub async fn in_span<T>(
    span: Span,
    handling: impl Future<Output = Result<T, crate::ApiError>>,
) -> Result<T, crate::ApiError> {
    if span.is_disabled() {
        return handling.await;
    }
    let result = tracing::Instrument::instrument(handling, span.clone()).await;
    if let Err(e) = &result {
        failed(&span, e.status().as_str());
    }
    result
}

/// `span` continues `trace` (the caller's): its parent is the caller's span.
pub fn continue_trace(span: &Span, trace: Option<&TraceContext>) {
    let Some(trace) = trace else { return };
    if !on() || span.is_disabled() {
        return;
    }
    let state = trace
        .state
        .as_ref()
        .and_then(|s| s.to_str().ok())
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let parent = SpanContext::new(
        TraceId::from_bytes(trace.trace_id),
        SpanId::from_bytes(trace.parent_id),
        TraceFlags::new(trace.flags),
        true,
        state,
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
}

/// The trace context a call made in `span` passes on: `span`'s own when spans are exported
/// (the callee's spans hang under it, in the caller's trace or in the one kvroute started),
/// else the caller's `trace` as the child of a fresh span id; none without either.
pub fn outbound(span: &Span, trace: Option<&TraceContext>) -> Option<TraceContext> {
    if on() && !span.is_disabled() {
        let context = span.context();
        let own = context.span().span_context().clone();
        if own.is_valid() {
            return Some(TraceContext {
                trace_id: own.trace_id().to_bytes(),
                parent_id: own.span_id().to_bytes(),
                flags: own.trace_flags().to_u8(),
                state: trace.and_then(|t| t.state.clone()),
            });
        }
    }
    trace.map(|t| t.child(new_span_id()))
}

/// A decision's candidates on its span: the chosen one first, then the cheapest others, each
/// as `kvroute.candidate.{k}.*` (its worker, the blocks it holds, its cost and, for `kv`, the
/// cost's terms), and the runner-up with why it lost (`kvroute.runner_up.reason`).
pub fn decision_attributes(span: &Span, record: &kvroute_core::schedule::DecisionRecord) {
    if !sampled(span) {
        return;
    }
    span.set_attribute("kvroute.candidates", record.considered as i64);
    if let Some(unit) = record.cost_unit {
        span.set_attribute("kvroute.cost_unit", unit);
    }
    for (k, c) in record.candidates.iter().enumerate() {
        let key = |name: &str| format!("kvroute.candidate.{k}.{name}");
        span.set_attribute(key("worker"), c.worker.to_string());
        span.set_attribute(key("overlap_blocks"), i64::from(c.overlap_blocks));
        span.set_attribute(key("running"), c.running as i64);
        if let Some(cost) = c.cost {
            span.set_attribute(key("cost"), cost);
        }
        if let Some(t) = &c.terms {
            for (name, ms) in terms(t) {
                span.set_attribute(key(name), ms);
            }
        }
    }
    if let [chosen, runner_up, ..] = record.candidates.as_slice() {
        span.set_attribute("kvroute.runner_up.worker", runner_up.worker.to_string());
        span.set_attribute(
            "kvroute.runner_up.reason",
            why_lost(chosen, runner_up, record.cost_unit),
        );
    }
    if let Some(ttft) = record.candidates.first().and_then(|c| c.terms).map(|t| t.ttft_ms) {
        span.set_attribute("kvroute.predicted_ttft_ms", ttft);
    }
}

/// A `kv` cost by its named terms, ms.
fn terms(t: &kvroute_core::schedule::CostTerms) -> [(&'static str, f64); 5] {
    [
        ("ttft_ms", t.ttft_ms),
        ("running_ms", t.running_ms),
        ("evict_ms", t.evict_ms),
        ("wait_ms", t.wait_ms),
        ("lora_ms", t.lora_ms),
    ]
}

/// Why `runner_up` lost to `chosen`: by how much its cost was higher and, for `kv`, the terms
/// that made it so (largest first); for a policy without costs, what it held.
pub fn why_lost(
    chosen: &kvroute_core::schedule::ScoredCandidate,
    runner_up: &kvroute_core::schedule::ScoredCandidate,
    unit: Option<&str>,
) -> String {
    let (Some(a), Some(b)) = (chosen.cost, runner_up.cost) else {
        return format!(
            "no cost: it held {} blocks, the chosen {}",
            runner_up.overlap_blocks, chosen.overlap_blocks
        );
    };
    let unit = unit.unwrap_or("");
    let mut why = format!("cost {:+.4} {unit} over the chosen", b - a);
    if let (Some(ta), Some(tb)) = (chosen.terms, runner_up.terms) {
        let mut gaps: Vec<(&str, f64)> = terms(&tb)
            .iter()
            .zip(terms(&ta))
            .map(|((name, b), (_, a))| (*name, b - a))
            .filter(|(_, d)| d.abs() >= 0.005)
            .collect();
        gaps.sort_by(|x, y| y.1.abs().partial_cmp(&x.1.abs()).unwrap_or(std::cmp::Ordering::Equal));
        let listed: Vec<String> = gaps.iter().map(|(n, d)| format!("{n} {d:+.2}")).collect();
        if !listed.is_empty() {
            why.push_str(": ");
            why.push_str(&listed.join(", "));
        }
    }
    why
}

/// Whether `span` is exported: spans are on, it is enabled, and its trace is sampled (a span
/// of an unsampled trace is still made in-process; what only it would carry is not computed).
pub fn sampled(span: &Span) -> bool {
    on() && !span.is_disabled() && span.context().span().span_context().is_sampled()
}

/// Marks `span` failed, with the error's kind (`error.type`).
pub fn failed(span: &Span, kind: &str) {
    span.record("otel.status_code", "error");
    span.record("error.type", kind);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off, nothing changes: the caller's context goes on as the child of a fresh span.
    #[test]
    fn off_the_callers_context_goes_on_under_a_fresh_span() {
        let caller = TraceContext { trace_id: [7; 16], parent_id: [1; 8], flags: 1, state: None };
        let span = request_span("chat", Some(&caller));
        assert!(span.is_disabled(), "no subscriber takes kvroute's spans here");
        let out = outbound(&span, Some(&caller)).expect("the caller's trace goes on");
        assert_eq!(out.trace_id, caller.trace_id);
        assert_ne!(out.parent_id, caller.parent_id);
        assert!(outbound(&span, None).is_none());
    }
}

//! A placement without a hop: what an Endpoint Picker behind a gateway asks of the front door
//! (`kvroute-epp`). The request goes through the same stages as one the front door proxies
//! (parsed, checked, preprocessed, hashed, admitted and placed, [`crate::handlers`]), but the
//! gateway sends it: the picker answers with the worker and the body to send it, and holds the
//! request in flight ([`Held`]) while the gateway passes the answer through it, which marks the
//! prefill done, reads the engine's cached tokens and frees the request at the end (or when
//! the held request is dropped: the gateway gone).

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvroute_core::schedule::pairs::prefill_leg_id;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_http::ApiError;
use kvroute_http::auth::KeyId;
use kvroute_http::paths;

use crate::FrontendState;
use crate::attempts::{Attempt, Attempts, out_of_rotation};
use crate::health::Failure;
use crate::observer::AnswerObserver;
use crate::observer::InFlight;
use crate::outbound::Outbound;

/// The OpenAI routes a picker places (any other path is the gateway's to route).
pub const PICKED_PATHS: [&str; 2] = [paths::CHAT_COMPLETIONS, paths::COMPLETIONS];

/// Whether kvroute places a request at `path` (else it goes on in turn).
pub fn places(path: &str) -> bool {
    PICKED_PATHS.contains(&path) || crate::native::NATIVE_PATHS.contains(&path)
}

/// What [`FrontendState::pick`] made of a request.
#[derive(Debug)]
pub enum Pick {
    /// Placed.
    Placed(Box<Picked>),
    /// Not one kvroute places: its body, to send on in turn.
    InTurn(Bytes),
}

/// Where a request goes, and what goes there.
#[derive(Debug)]
pub struct Picked {
    /// The worker that decodes it (the one the gateway sends it to).
    pub worker: WorkerId,
    /// The other workers in rotation, in order after `worker` (fallbacks, when the gateway
    /// cannot reach it).
    pub fallbacks: Vec<WorkerId>,
    /// In a disaggregated fleet, the worker that prefills it, when another one does.
    pub prefill: Option<WorkerId>,
    /// The body as the engine gets it (the client's, with the fields the front door sets:
    /// `cache_salt`, a stream's usage, image identifiers, priority).
    pub body: Bytes,
    /// The model it asked for (the base model's name, or its adapter's).
    pub model: String,
    /// Its answer is streamed (its response begins with the first token, not the last).
    pub streamed: bool,
    /// The request's trace context as the engine gets it: the child of the picker's span
    /// (its engine call's, when spans are exported).
    pub trace: Option<kvroute_http::trace::TraceContext>,
    /// The request in flight until the answer ends.
    pub held: Held,
}

/// A placed request in flight while the gateway passes its answer through the picker: the
/// front door's own answer observer, fed by the gateway's messages.
#[derive(Debug)]
pub struct Held {
    observer: AnswerObserver,
}

impl Held {
    /// The answer's head came: its status and content type. A success's cached tokens will be
    /// compared with the prediction; only a success shows the worker answers (the gateway
    /// may answer an error itself).
    pub fn head(&mut self, status: u16, content_type: Option<&str>) {
        let sse = content_type.is_some_and(|c| c.starts_with("text/event-stream"));
        let success = (200..300).contains(&status);
        self.observer.head(success, success, sse);
        self.observer.guard.status(status);
    }

    /// A piece of the answer as it passes: the first marks the prefill done; the engine's
    /// cached tokens are read, and the usage chunk only the front door asked for is dropped.
    /// Returns the bytes to pass on (an event stream is passed on event by event, whole).
    pub fn body(&mut self, bytes: Bytes) -> Bytes {
        self.observer.piece(bytes)
    }

    /// The answer's first bytes (or its end, with none): the prefill is done.
    pub fn first_bytes(&mut self) {
        self.observer.first_bytes();
    }

    /// The gateway says `served` answered. When that is not the worker placed, the placed one
    /// could not be reached: it is out of rotation for a while (as when the front door's hop
    /// fails), and the answer is not compared with a prediction made for another worker.
    pub fn served_by(&mut self, served: WorkerId) {
        let placed = self.observer.placement.worker.worker_id;
        if served != placed {
            tracing::warn!(%placed, %served, "the gateway fell back to another worker");
            let guard = &mut self.observer.guard;
            guard.state.worker_failed(placed, Failure::Connect);
            guard.checked = false;
            guard.predicted = None;
        }
    }

    /// The worker placed, with its rank.
    pub fn placed(&self) -> WorkerWithDpRank {
        self.observer.placement.worker
    }

    /// The cached prompt tokens predicted where it was placed.
    pub fn predicted_cached_tokens(&self) -> u64 {
        self.observer.placement.predicted_cached_tokens
    }

    /// The request's id at the router.
    pub fn id(&self) -> &str {
        &self.observer.guard.id
    }
}

impl FrontendState {
    /// The scores of request `id`'s candidates, by worker, as llm-d's picker returns them
    /// (`x-gateway-destination-endpoint-scores`: higher is better), from the embedded router's
    /// record of the decision (the chosen candidate and the cheapest others; none when the
    /// router is remote or no longer holds it). See [`endpoint_scores`].
    pub fn endpoint_scores(&self, id: &str) -> Vec<(WorkerId, f64)> {
        let crate::decider::Decider::Embedded(router) = &self.decider else { return Vec::new() };
        router.view().decision_of(id).map(|r| endpoint_scores(&r)).unwrap_or_default()
    }
}

/// A decision's candidates scored from 0 to 1, higher better, one per worker (its best rank):
/// the cheapest cost over the candidate's (1 for the cheapest; a cost at or below zero is
/// scored `1 / (1 + its excess over the cheapest)`), or, for a policy without costs, the
/// prompt blocks it holds over the most any holds.
pub fn endpoint_scores(record: &kvroute_core::schedule::DecisionRecord) -> Vec<(WorkerId, f64)> {
    let costs: Option<Vec<f64>> = record.candidates.iter().map(|c| c.cost).collect();
    let scores: Vec<f64> = match costs {
        Some(costs) if !costs.is_empty() => {
            let least = costs.iter().copied().fold(f64::INFINITY, f64::min);
            costs
                .iter()
                .map(|&c| match least > 0.0 {
                    true => least / c,
                    false => 1.0 / (1.0 + (c - least)),
                })
                .collect()
        }
        _ => {
            let most = record.candidates.iter().map(|c| c.overlap_blocks).max().unwrap_or(0);
            let held = |c: &kvroute_core::schedule::ScoredCandidate| match most {
                0 => 1.0,
                m => f64::from(c.overlap_blocks) / f64::from(m),
            };
            record.candidates.iter().map(held).collect()
        }
    };
    let mut by_worker: Vec<(WorkerId, f64)> = Vec::new();
    for (c, score) in record.candidates.iter().zip(scores) {
        match by_worker.iter_mut().find(|(w, _)| *w == c.worker.worker_id) {
            Some((_, best)) => *best = best.max(score),
            None => by_worker.push((c.worker.worker_id, score)),
        }
    }
    by_worker
}

impl FrontendState {
    /// Places the request at `path` (one of [`PICKED_PATHS`], or an engine's native token
    /// route, [`crate::native::NATIVE_PATHS`], placed by its token ids) among `allowed`
    /// workers (all when `None`) that are in rotation, as the front door would, without
    /// sending it. A native body kvroute does not place (a SGLang prompt as text, a batch) is
    /// handed back for the caller to send on in turn. A 503 when no worker can take it; flow
    /// control's refusals as they are (429, 503).
    pub async fn pick(
        self: &Arc<Self>,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
        allowed: Option<&BTreeSet<WorkerId>>,
        key: Option<&KeyId>,
    ) -> Result<Pick, ApiError> {
        let trace = kvroute_http::trace::TraceContext::from_headers(headers);
        let operation = match path {
            paths::COMPLETIONS => "text_completion",
            paths::CHAT_COMPLETIONS => "chat",
            _ => "generate",
        };
        let span = kvroute_http::otel::request_span(operation, trace.as_ref());
        kvroute_http::otel::in_span(span, async {
            let out = match path {
                paths::CHAT_COMPLETIONS => {
                    crate::handlers::chat_outbound(self, key, headers, trace, Ok(body)).await?
                }
                paths::COMPLETIONS => {
                    crate::handlers::completion_outbound(self, key, headers, trace, Ok(body))?
                }
                other => match crate::native::NATIVE_PATHS.into_iter().find(|p| *p == other) {
                    Some(native) => {
                        match self.native_outbound(native, key, (headers, trace), &body)? {
                            // The body is not held while the request waits to be placed.
                            Some(out) => {
                                drop(body);
                                out
                            }
                            None => return Ok(Pick::InTurn(body)),
                        }
                    }
                    None => {
                        let e = format!("{other} is not a route kvroute places");
                        return Err(ApiError::not_found(e));
                    }
                },
            };
            self.decide_picked(&out, allowed).await.map(|p| Pick::Placed(Box::new(p)))
        })
        .await
    }

    /// Places `out` among `allowed` workers in rotation (a pair in a P/D fleet): the first
    /// attempt the worker can take, with the rest of the order as the gateway's fallbacks.
    async fn decide_picked(
        self: &Arc<Self>,
        out: &Outbound,
        allowed: Option<&BTreeSet<WorkerId>>,
    ) -> Result<Picked, ApiError> {
        let mut attempts = Attempts::new(self, out, allowed);
        loop {
            let attempt = attempts.next().await?;
            let worker = attempt.legs.decode.worker.worker_id;
            if let (Some(adapter), Some(base)) =
                (out.place.adapter.as_deref(), self.workers().url(worker))
                && !self.ensure_adapter(worker, base, adapter).await
            {
                attempts.skip(worker);
                continue;
            }
            return Ok(self.picked(out, attempt, &attempts));
        }
    }

    /// What the gateway gets of an attempt: the decode worker it sends the request to, the
    /// prefill worker named when another one, and the fallbacks (none for a pair: another
    /// decode worker would not know the prefill named for this one).
    fn picked(
        self: &Arc<Self>,
        out: &Outbound,
        attempt: Attempt,
        attempts: &Attempts<'_>,
    ) -> Picked {
        let Attempt { legs, mut guard } = attempt;
        let worker = legs.decode.worker.worker_id;
        let leg = legs.prefill.map(|_| {
            guard.checked = false;
            self.metrics.pd_split.inc();
            InFlight::new(self, prefill_leg_id(&guard.id))
        });
        if attempts.paired() && leg.is_none() {
            self.metrics.pd_in_place.inc();
        }
        let fallbacks = match attempts.paired() {
            true => Vec::new(),
            false => attempts.rest(worker),
        };
        let trace = kvroute_http::otel::outbound(&guard.span, out.trace.as_ref());
        Picked {
            worker,
            fallbacks,
            prefill: legs.prefill.map(|p| p.worker.worker_id),
            body: out.body.clone(),
            model: out
                .place
                .adapter
                .clone()
                .unwrap_or_else(|| self.preprocessor.model_name().to_owned()),
            streamed: out.streamed,
            trace,
            held: Held {
                observer: AnswerObserver::new(
                    guard,
                    leg,
                    legs.decode,
                    out.place.num_tokens as u64,
                    out.strip_usage,
                ),
            },
        }
    }

    /// Each worker's base URL (`http://host:port`), the gateway's endpoints.
    pub fn worker_urls(&self) -> Vec<(WorkerId, String)> {
        self.workers().urls.iter().map(|(w, u)| (*w, u.clone())).collect()
    }

    /// Who sent a request, by the API key in its `authorization` header (as the front door's
    /// `auth::require` checks it): `None` when no keys are configured, a 401 when keys are and
    /// it carries none of them.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Option<KeyId>, ApiError> {
        self.api_keys.check(headers)
    }

    /// Whether API keys are configured.
    pub fn keys_required(&self) -> bool {
        !self.api_keys.is_empty()
    }

    /// A 400 naming a transfer field a body on any route carries
    /// ([`crate::transfer::refuse_bytes`]), unless a trusted upstream pairs engines itself.
    pub fn check_transfer_fields(
        &self,
        body: &[u8],
        content_type: Option<&str>,
    ) -> Result<(), ApiError> {
        match self.options.trust_transfer_fields {
            true => Ok(()),
            false => crate::transfer::refuse_bytes(body, content_type),
        }
    }

    /// How long a streamed answer has to begin.
    pub fn first_byte_timeout(&self) -> std::time::Duration {
        self.options.first_byte_timeout
    }

    /// The workers in rotation among `allowed` now ([`crate::attempts::out_of_rotation`]'s
    /// rule), in order of their ids.
    pub fn in_rotation(&self, allowed: Option<&BTreeSet<WorkerId>>) -> Vec<WorkerId> {
        let workers = self.workers();
        let out = out_of_rotation(self, &workers, allowed);
        workers.urls.keys().copied().filter(|w| !out.contains(w)).collect()
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::schedule::{DecisionRecord, ScoredCandidate};
    use kvroute_core::{WorkerId, WorkerWithDpRank};

    use super::endpoint_scores;

    fn record(candidates: &[(u64, u32, u32, Option<f64>)]) -> DecisionRecord {
        let scored = |&(w, r, blocks, cost): &(u64, u32, u32, Option<f64>)| ScoredCandidate {
            worker: WorkerWithDpRank::new(w, r),
            overlap_blocks: blocks,
            inflight_prefix_blocks: 0,
            running: 0,
            cost,
            terms: None,
        };
        DecisionRecord {
            request: "r".to_owned(),
            at_ms: 0,
            isl_tokens: 64,
            considered: candidates.len(),
            candidates: candidates.iter().map(scored).collect(),
            cost_unit: None,
        }
    }

    /// Scores are the cheapest cost over each one's, one per worker (its best rank); without
    /// costs, the blocks held over the most held; costs at or below zero stay within 0 to 1.
    #[test]
    fn scores_are_the_cheapest_cost_over_each_and_one_per_worker() {
        let w = WorkerId;
        let priced = record(&[(1, 0, 4, Some(0.02)), (2, 0, 0, Some(0.04)), (2, 1, 0, Some(0.08))]);
        assert_eq!(endpoint_scores(&priced), vec![(w(1), 1.0), (w(2), 0.5)]);
        let blind = record(&[(3, 0, 2, None), (1, 0, 8, None)]);
        assert_eq!(endpoint_scores(&blind), vec![(w(3), 0.25), (w(1), 1.0)]);
        let signed = record(&[(1, 0, 0, Some(-2.0)), (2, 0, 0, Some(-1.0))]);
        assert_eq!(endpoint_scores(&signed), vec![(w(1), 1.0), (w(2), 0.5)]);
        assert!(endpoint_scores(&record(&[])).is_empty());
    }
}

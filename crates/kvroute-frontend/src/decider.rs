//! Where routing decisions come from: the router embedded in this process, or a `kvroute
//! router` reached over HTTP (its `/find_best_worker` with a request id, then
//! `/requests/{id}/prefill_done`, `DELETE /requests/{id}` and `/answers`), both with the same
//! exclusions; in a disaggregated fleet, both place pairs ([`Decider::decide_pair`]).

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use kvroute_core::schedule::{RouteDecision, reusable_by_tier};
use kvroute_core::{BlockSize, WorkerWithDpRank};
use kvroute_http::router_api::{self, Answered, BestWorker, FindBestWorker};
use kvroute_http::trace::TraceContext;
use kvroute_http::{ApiError, ClientError, HttpClient};
use kvroute_router::{Decision, PlaceRequest, Refusal, RouterState};

// One per front door: the remote variant's size (its HTTP client's, larger when a crate in
// the build turns on hyper's HTTP/2) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Decider {
    Embedded(Arc<RouterState>),
    Remote(RemoteRouter),
}

/// A `kvroute router` at `base`, called with its admin token when it has one.
#[derive(Clone)]
pub struct RemoteRouter {
    base: String,
    client: HttpClient,
}

impl std::fmt::Debug for RemoteRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteRouter").field("base", &self.base).finish_non_exhaustive()
    }
}

impl RemoteRouter {
    pub fn new(base: &str, token: Option<&str>) -> Self {
        let client = HttpClient::bearing(token);
        Self { base: base.trim_end_matches('/').to_owned(), client }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub(crate) fn client(&self) -> &HttpClient {
        &self.client
    }
}

/// What the router knew when it placed a request: where it goes, how many of its leading
/// blocks that worker holds by its KV events, and the prompt tokens it should therefore
/// serve from its cache (those blocks and the ones after them it loads from a lower tier, in
/// tokens, less the last block of a fully cached prompt, which engines recompute:
/// [`kvroute_core::schedule::reusable_tokens`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub worker: WorkerWithDpRank,
    pub overlap_blocks: u32,
    pub predicted_cached_tokens: u64,
    /// Of those, the tokens expected from host memory, disk and the shared store.
    pub predicted_tier_tokens: [u64; 3],
}

impl Placement {
    fn new(
        worker: WorkerWithDpRank,
        (overlap_blocks, tier_blocks): (u32, [u32; 3]),
        num_tokens: usize,
        bs: BlockSize,
    ) -> Self {
        let (device, tiers) =
            reusable_by_tier(overlap_blocks, tier_blocks, num_tokens, bs.tokens());
        Self {
            worker,
            overlap_blocks,
            predicted_cached_tokens: (device + tiers.iter().sum::<usize>()) as u64,
            predicted_tier_tokens: tiers.map(|t| t as u64),
        }
    }

    /// A leg of a pair: its cached tokens (tiers are not told apart).
    fn leg(worker: WorkerWithDpRank, overlap_blocks: u32, predicted_cached_tokens: u64) -> Self {
        Self { worker, overlap_blocks, predicted_cached_tokens, predicted_tier_tokens: [0; 3] }
    }
}

/// Where a placed request goes: the worker that decodes it, and in a disaggregated fleet the
/// one that prefills it first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Legs {
    /// None: it is prefilled where it decodes (always, outside a disaggregated fleet).
    pub prefill: Option<Placement>,
    pub decode: Placement,
}

/// `request` tracked as `id` in the caller's `trace`, other than `exclude`: the one owned copy
/// the router gets (the hashes are shared, not copied).
fn tracked(
    request: &PlaceRequest,
    (id, trace): (&str, Option<&TraceContext>),
    exclude: &[WorkerWithDpRank],
) -> PlaceRequest {
    let (id, trace) = (Some(id.to_owned()), trace.cloned());
    PlaceRequest { id, trace, exclude: exclude.to_vec(), ..request.clone() }
}

impl Decider {
    /// Chooses a cache for the request, other than `exclude`; `None` when there is none. The
    /// request is in flight from now on.
    pub(crate) async fn decide(
        &self,
        request: &PlaceRequest,
        block_size: BlockSize,
        (id, trace): (&str, Option<&TraceContext>),
        exclude: &[WorkerWithDpRank],
    ) -> Result<Option<Placement>, ApiError> {
        let num_tokens = request.num_tokens;
        match self {
            Self::Embedded(router) => {
                let decision = router.decide(&tracked(request, (id, trace), exclude)).await;
                Ok(decision.map_err(Refusal::into_api_error)?.map(
                    |Decision { decode: d, .. }| {
                        let blocks = (d.overlap_blocks, d.tier_blocks);
                        Placement::new(d.worker, blocks, num_tokens, block_size)
                    },
                ))
            }
            Self::Remote(remote) => {
                Ok(remote.find(request, (id, trace), exclude).await?.map(|best| {
                    // A router that tells only the sum: taken as host memory's.
                    let tiers = match best.tier_blocks.iter().sum::<u32>() {
                        0 => [best.lower_tier_blocks, 0, 0],
                        _ => best.tier_blocks,
                    };
                    Placement::new(
                        best.worker(),
                        (best.overlap_blocks, tiers),
                        num_tokens,
                        block_size,
                    )
                }))
            }
        }
    }

    /// Whether the tenant of `class` is over its share of the fleet by this router's flow
    /// control (the embedded router's; a remote router's shares are its own, and not asked).
    pub(crate) fn over_share(&self, class: &kvroute_core::schedule::flow::RequestClass) -> bool {
        match self {
            Self::Embedded(router) => router.view().over_share(&class.tenant),
            Self::Remote(_) => false,
        }
    }

    /// Chooses where a request runs in a disaggregated fleet, other than `exclude`: a
    /// prefill and a decode worker, or (no prefill) one worker alone; `None` when there is
    /// none. Both legs are in flight from now on (the prefill's as `{id}/prefill`).
    pub(crate) async fn decide_pair(
        &self,
        request: &PlaceRequest,
        (id, trace): (&str, Option<&TraceContext>),
        exclude: &[WorkerWithDpRank],
    ) -> Result<Option<Legs>, ApiError> {
        let num_tokens = request.num_tokens;
        let cached = |predicted_prefill: usize| num_tokens.saturating_sub(predicted_prefill) as u64;
        match self {
            Self::Embedded(router) => {
                let leg = |d: &RouteDecision| {
                    Placement::leg(d.worker, d.overlap_blocks, cached(d.predicted_prefill_tokens))
                };
                let pair = router.decide(&tracked(request, (id, trace), exclude)).await;
                Ok(pair.map_err(Refusal::into_api_error)?.map(|pair| Legs {
                    prefill: pair.prefill.as_ref().map(leg),
                    decode: leg(&pair.decode),
                }))
            }
            Self::Remote(remote) => {
                Ok(remote.find(request, (id, trace), exclude).await?.map(|best| {
                    let prefill = best.prefill.map(|p| {
                        Placement::leg(
                            p.worker(),
                            p.overlap_blocks,
                            cached(p.predicted_prefill_tokens),
                        )
                    });
                    let decode = Placement::leg(
                        best.worker(),
                        best.overlap_blocks,
                        cached(best.predicted_prefill_tokens),
                    );
                    Legs { prefill, decode }
                }))
            }
        }
    }

    /// Whether requests are placed in pairs: the embedded router's fleet has prefill
    /// workers, or (a remote router) the front door's own list of workers does.
    pub(crate) fn disaggregated(&self, listed_prefill_workers: bool) -> bool {
        match self {
            Self::Embedded(router) => router.view().disaggregated(),
            Self::Remote(_) => listed_prefill_workers,
        }
    }

    /// The request's first bytes came back; `timed`: they were its first token (a streamed
    /// answer), so the router learns from when they came.
    pub(crate) fn prefill_done(&self, id: &str, timed: bool) {
        match self {
            Self::Embedded(router) => router.prefill_done(id, timed),
            Self::Remote(remote) => {
                let path = match timed {
                    true => router_api::prefill_done_path(id),
                    false => router_api::prefill_done_untimed_path(id),
                };
                remote.notify(Method::POST, path, None);
            }
        }
    }

    pub(crate) fn finish(&self, id: &str) {
        match self {
            Self::Embedded(router) => {
                router.finish(id);
            }
            Self::Remote(remote) => {
                remote.notify(Method::DELETE, router_api::request_path(id), None);
            }
        }
    }

    /// Reports an answered request's predicted and served cached tokens to the router's
    /// checks of itself.
    pub(crate) fn answered(&self, answer: Answered) {
        match self {
            Self::Embedded(router) => {
                router.record_answer(&answer);
            }
            Self::Remote(remote) => {
                let body = serde_json::to_value(answer).unwrap_or(serde_json::Value::Null);
                remote.notify(Method::POST, router_api::ANSWERS.to_owned(), Some(body));
            }
        }
    }
}

impl RemoteRouter {
    /// The router's choice for a request tracked as `id`; `None` when it knows no worker
    /// to choose (503).
    async fn find(
        &self,
        ask: &PlaceRequest,
        (id, trace): (&str, Option<&TraceContext>),
        exclude: &[WorkerWithDpRank],
    ) -> Result<Option<BestWorker>, ApiError> {
        let request = FindBestWorker {
            local_hashes: ask.local_hashes.iter().map(|l| l.0).collect(),
            num_tokens: i64::try_from(ask.num_tokens).unwrap_or(i64::MAX),
            request_id: Some(id.to_owned()),
            overlap_score_weight: None,
            temperature: None,
            exclude: exclude.to_vec(),
            lora_name: ask.adapter.clone(),
            session_id: ask.session.clone(),
            max_tokens: Some(ask.output_tokens as u64).filter(|&m| m > 0),
            // Only what differs from the default class (a router older than flow control
            // refuses the fields; a newer one admits every tracked request anyway).
            priority: ask.class.as_ref().map(|c| c.priority).filter(|&p| p != 0),
            tenant: ask.class.as_ref().map(|c| c.tenant.to_string()).filter(|t| t != "default"),
            ttft_slo_ms: ask.class.as_ref().and_then(|c| c.ttft_slo_ms),
        };
        // The router continues the request's trace (kvroute's request span when spans are
        // exported, else the caller's).
        let trace = kvroute_http::otel::outbound(&tracing::Span::current(), trace);
        match self.client.find_best_worker_in(&self.base, &request, trace.as_ref()).await {
            Ok(best) => Ok(Some(best)),
            Err(ClientError::Status {
                status: status @ (StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS),
                message,
                retry_after: Some(secs),
            }) => Err(ApiError::new(status, message).retry_after(secs)),
            Err(ClientError::Status { status: StatusCode::SERVICE_UNAVAILABLE, .. }) => Ok(None),
            Err(e @ (ClientError::Connect(_) | ClientError::Send(_))) => {
                Err(ApiError::unavailable("the router is unreachable").with_source(e))
            }
            Err(e) => Err(ApiError::bad_gateway("the router failed", e)),
        }
    }

    /// Tells the router something in the background (the lifecycle calls, and what the
    /// front door learns of its workers).
    pub(crate) fn notify(&self, method: Method, path: String, body: Option<serde_json::Value>) {
        let remote = self.clone();
        tokio::spawn(async move {
            let url = format!("{}{path}", remote.base);
            match remote.client.call(method, &url, body.as_ref()).await {
                Ok(r) if r.status().is_success() || r.status() == StatusCode::NOT_FOUND => {}
                Ok(r) => tracing::warn!(%path, status = %r.status(), "router notification refused"),
                Err(e) => tracing::warn!(%path, error = %e, "router notification failed"),
            }
        });
    }
}

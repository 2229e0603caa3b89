//! Where routing decisions come from: the router embedded in this process, or a `kvroute
//! router` reached over HTTP (its `/find_best_worker` with a request id, then
//! `/requests/{id}/prefill_done` and `DELETE /requests/{id}`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kvroute_core::{LocalBlockHash, WorkerWithDpRank};
use kvroute_router::{Placement, RouterState};
use serde::Deserialize;

use kvroute_router::http::ApiError;

#[derive(Clone, Debug)]
pub enum Placer {
    Embedded(Arc<RouterState>),
    Remote(RemoteRouter),
}

impl std::fmt::Debug for RemoteRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteRouter").field("base", &self.base).finish_non_exhaustive()
    }
}

#[derive(Clone)]
pub struct RemoteRouter {
    pub(crate) base: String,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
}

#[derive(Deserialize)]
struct Decision {
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default)]
    overlap_blocks: u32,
}

impl Placer {
    /// The chosen cache and how many leading blocks of the request it holds by its events,
    /// `None` when there is none; the request is in flight from now on.
    pub(crate) async fn place(
        &self,
        local: &[LocalBlockHash],
        num_tokens: usize,
        id: &str,
        exclude: &[WorkerWithDpRank],
    ) -> Result<Option<(WorkerWithDpRank, u32)>, ApiError> {
        match self {
            Self::Embedded(router) => {
                let placement = Placement {
                    local_hashes: local,
                    num_tokens,
                    request_id: Some(id),
                    overlap_weight: None,
                    temperature: None,
                    exclude,
                };
                Ok(router.place(&placement).map(|(d, _)| (d.worker, d.overlap_blocks)))
            }
            Self::Remote(remote) => {
                let body = serde_json::json!({
                    "local_hashes": local.iter().map(|l| l.0).collect::<Vec<_>>(),
                    "num_tokens": num_tokens,
                    "request_id": id,
                });
                let (status, bytes) =
                    remote.call("POST", "/find_best_worker", body.to_string()).await?;
                if status == StatusCode::SERVICE_UNAVAILABLE {
                    return Ok(None);
                }
                if !status.is_success() {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        format!("the router answered HTTP {status}"),
                    ));
                }
                let d: Decision = serde_json::from_slice(&bytes).map_err(|e| {
                    ApiError::new(StatusCode::BAD_GATEWAY, format!("the router's answer: {e}"))
                })?;
                Ok(Some((WorkerWithDpRank::new(d.worker_id, d.dp_rank), d.overlap_blocks)))
            }
        }
    }

    pub(crate) fn prefill_done(&self, id: &str) {
        match self {
            Self::Embedded(router) => router.prefill_done(id),
            Self::Remote(remote) => remote.notify("POST", format!("/requests/{id}/prefill_done")),
        }
    }

    pub(crate) fn finish(&self, id: &str) {
        match self {
            Self::Embedded(router) => {
                router.finish(id);
            }
            Self::Remote(remote) => remote.notify("DELETE", format!("/requests/{id}")),
        }
    }

    /// Requests in flight (known for the embedded router only).
    pub(crate) fn in_flight(&self) -> Option<usize> {
        match self {
            Self::Embedded(router) => Some(router.in_flight()),
            Self::Remote(_) => None,
        }
    }

    pub(crate) fn metrics(&self) -> String {
        match self {
            Self::Embedded(router) => router.render_metrics(),
            Self::Remote(_) => String::new(),
        }
    }
}

impl RemoteRouter {
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: String,
    ) -> Result<(StatusCode, Bytes), ApiError> {
        let request = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let response = self.client.request(request).await.map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the router is unreachable: {e}"),
            )
        })?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| {
                ApiError::new(StatusCode::BAD_GATEWAY, format!("reading the router's answer: {e}"))
            })?
            .to_bytes();
        Ok((status, bytes))
    }

    /// Tells the router something in the background (the lifecycle calls).
    fn notify(&self, method: &'static str, path: String) {
        let remote = self.clone();
        tokio::spawn(async move {
            if let Err(e) = remote.call(method, &path, String::new()).await {
                tracing::warn!(%path, error = %e.message, "router notification failed");
            }
        });
    }
}

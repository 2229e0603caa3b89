//! What the front door tells and asks the router of its workers, through the [`Decider`]: the
//! same for the router embedded in this process and for a remote `kvroute router`, so parity
//! probes, served adapters, forgetting a dead engine's blocks and `/workers` work with both.
//!
//! | the front door | embedded | remote |
//! |---|---|---|
//! | a worker's state, for its parity probe | `View::workers` (`RouterState::view`) | `GET /workers` |
//! | blocks a worker holds of the probe | the index | `POST /overlaps` |
//! | the probe's outcome | `set_parity` | `PUT /workers/{id}/parity` |
//! | the adapters a worker lists | `set_served_adapters` | `PUT /workers/{id}/adapters` |
//! | its engine refused a connection | `forget_blocks` | `POST /workers/{id}/forget` |
//! | `/workers`, `/health` | the router's own | `GET /workers`; the front door's own health |

use std::collections::BTreeSet;

use axum::http::Method;
use kvroute_core::{LocalBlockHash, WorkerId, WorkerWithDpRank};
use kvroute_http::ClientError;
use kvroute_http::metrics::Registry;
use kvroute_http::router_api::{self, Overlaps, OverlapsReply, ServedAdapters};
use kvroute_router::{ConvertStats, Parity};

use serde::Deserialize;
use serde_json::{Value, json};

use crate::decider::{Decider, RemoteRouter};

/// What a parity probe reads of a worker (fields of the router's `/workers` entry).
#[derive(Clone, Debug, Deserialize)]
pub struct WorkerView {
    pub id: WorkerId,
    pub events: Option<String>,
    pub dp_size: u32,
    pub connected: Vec<bool>,
    pub caught_up: Vec<bool>,
    pub conversion: ConvertStats,
    pub parity: Parity,
}

impl Decider {
    /// The router's view of `worker`: `Ok(None)` when it does not know it, `Err` when a
    /// remote router did not answer.
    pub async fn worker(&self, worker: WorkerId) -> Result<Option<WorkerView>, ClientError> {
        match self {
            Self::Embedded(router) => {
                Ok(router.view().workers().into_iter().find(|w| w.id == worker).map(|w| {
                    WorkerView {
                        id: w.id,
                        events: w.events,
                        dp_size: w.dp_size,
                        connected: w.connected,
                        caught_up: w.caught_up,
                        conversion: w.conversion,
                        parity: w.parity,
                    }
                }))
            }
            Self::Remote(remote) => {
                let all = remote.get(router_api::WORKERS).await?;
                let entry = all["workers"]
                    .as_array()
                    .and_then(|ws| ws.iter().find(|w| w["id"].as_u64() == Some(worker.0)).cloned());
                match entry {
                    None => Ok(None),
                    Some(v) => Ok(Some(serde_json::from_value(v)?)),
                }
            }
        }
    }

    /// The most leading blocks of `hashes` any rank of `worker` holds, by its events.
    pub async fn held(
        &self,
        worker: WorkerId,
        hashes: &[LocalBlockHash],
    ) -> Result<usize, ClientError> {
        let of_worker = |scores: &mut dyn Iterator<Item = (WorkerWithDpRank, u32)>| {
            scores
                .filter(|(w, _)| w.worker_id == worker)
                .map(|(_, b)| b as usize)
                .max()
                .unwrap_or(0)
        };
        match self {
            Self::Embedded(router) => {
                let scores = router.view().find_matches(hashes);
                Ok(of_worker(&mut scores.scores.iter().copied()))
            }
            Self::Remote(remote) => {
                let ask = Overlaps { local_hashes: hashes.iter().map(|h| h.0).collect() };
                let url = remote.url(router_api::OVERLAPS);
                let reply: OverlapsReply = remote.client().post_json(&url, &ask).await?;
                let mut scores = reply.overlaps.iter().map(|o| {
                    (WorkerWithDpRank { worker_id: o.worker_id, dp_rank: o.dp_rank }, o.blocks)
                });
                Ok(of_worker(&mut scores))
            }
        }
    }

    /// Records a parity probe's outcome (a `Retrying` does not undo a failure).
    pub fn set_parity(&self, worker: WorkerId, parity: Parity) {
        match self {
            Self::Embedded(router) => router.set_parity(worker, parity),
            Self::Remote(remote) => {
                let body = serde_json::to_value(&parity).unwrap_or(Value::Null);
                remote.notify(Method::PUT, router_api::parity_path(worker), Some(body));
            }
        }
    }

    /// The adapters `rank` lists (`None`: it serves any).
    pub fn set_served_adapters(&self, rank: WorkerWithDpRank, served: Option<BTreeSet<String>>) {
        match self {
            Self::Embedded(router) => router.set_served_adapters(rank, served),
            Self::Remote(remote) => {
                let body = ServedAdapters {
                    dp_rank: rank.dp_rank,
                    adapters: served.map(|s| s.into_iter().collect()),
                };
                let body = serde_json::to_value(&body).unwrap_or(Value::Null);
                remote.notify(Method::PUT, router_api::adapters_path(rank.worker_id), Some(body));
            }
        }
    }

    /// `worker`'s engine refused a connection: what it held is gone.
    pub fn forget_blocks(&self, worker: WorkerId) {
        match self {
            Self::Embedded(router) => router.forget_blocks(worker),
            Self::Remote(remote) => {
                remote.notify(Method::POST, router_api::forget_path(worker), None);
            }
        }
    }

    /// The router's `/workers`: its workers, recent decisions and replicas (a remote router's
    /// as it answers; `null` when it does not).
    pub async fn view(&self) -> Value {
        match self {
            Self::Embedded(router) => json!({"workers": router.view().workers(),
                "recent_decisions": router.view().recent_decisions(),
                "ttft_predictions": router.view().prediction_stats(),
                "nats": router.view().nats()}),
            Self::Remote(remote) => remote.get(router_api::WORKERS).await.unwrap_or(Value::Null),
        }
    }

    /// Liveness: the embedded router's state (NATS away is degraded, not down); a remote
    /// router answers for itself.
    pub fn health(&self) -> Value {
        match self {
            Self::Embedded(router) => router.view().health(),
            Self::Remote(_) => json!({"status": "ok", "degraded": false}),
        }
    }

    /// The embedded router's metrics, served beside the front door's (a remote router serves
    /// its own).
    pub fn registry(&self) -> Option<&Registry> {
        match self {
            Self::Embedded(router) => Some(router.view().registry()),
            Self::Remote(_) => None,
        }
    }
}

impl RemoteRouter {
    /// `GET path` as JSON.
    async fn get(&self, path: &str) -> Result<Value, ClientError> {
        self.client().get_json::<Value>(&self.url(path)).await
    }
}

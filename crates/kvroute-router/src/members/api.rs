//! The router API's membership verbs, shared by the router's and the front door's HTTP APIs
//! (docs/membership.md): `POST /workers` (a worker joins), `POST /workers/{id}/drain` and
//! `DELETE /workers/{id}`. Both APIs keep them behind their admin token.

use std::sync::Arc;

use axum::http::StatusCode;
use kvroute_core::WorkerId;
use kvroute_http::ApiError;
use serde_json::{Value, json};

use super::bucket::parse_entry;
use super::change::{DRAIN_TIMEOUT, JoinError, drain, join, remove};
use crate::state::RouterState;

/// The source of members added through the API.
pub const API_SOURCE: &str = "api";

/// `POST /workers`: `body` is a worker as the configuration's `[[workers]]` writes it, in
/// JSON; without an `id`, one is made from its `url` (else `events`), as for discovered
/// workers. 201 with the worker's id; 409 when the id is a member already.
pub fn add(state: &Arc<RouterState>, body: &[u8]) -> Result<(StatusCode, Value), ApiError> {
    // The same description a bucket's registration is, read the same way.
    let spec = parse_entry(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    match join(state, &spec, API_SOURCE) {
        Ok(()) => {
            state.metrics.membership(API_SOURCE, "joined", 1);
            Ok((StatusCode::CREATED, json!({"worker_id": spec.id.0, "joined": true})))
        }
        Err(JoinError::Known(id)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("worker {id} is a member already (DELETE /workers/{id} first)"),
        )
        .param("id")),
        Err(err @ JoinError::Full(_)) => {
            Err(ApiError::new(StatusCode::CONFLICT, err.to_string()).code("too_many_workers"))
        }
        Err(err @ JoinError::Plane(_)) => {
            Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, err.to_string()))
        }
        Err(err) => Err(ApiError::bad_request(err.to_string())),
    }
}

/// `POST /workers/{id}/drain`: 202; it leaves once its requests end.
pub fn drain_one(state: &Arc<RouterState>, id: u64) -> Result<(StatusCode, Value), ApiError> {
    if !drain(state, WorkerId(id), DRAIN_TIMEOUT) {
        return Err(unknown(id));
    }
    state.metrics.membership(API_SOURCE, "drained", 1);
    let after = DRAIN_TIMEOUT.as_secs();
    Ok((StatusCode::ACCEPTED, json!({"worker_id": id, "draining": true, "drain_timeout_s": after})))
}

/// `DELETE /workers/{id}`: it leaves now (its in-flight requests are no longer accounted).
pub fn remove_one(state: &Arc<RouterState>, id: u64) -> Result<(StatusCode, Value), ApiError> {
    if !remove(state, WorkerId(id)) {
        return Err(unknown(id));
    }
    state.metrics.membership(API_SOURCE, "removed", 1);
    Ok((StatusCode::OK, json!({"worker_id": id, "removed": true})))
}

fn unknown(id: u64) -> ApiError {
    ApiError::not_found(format!("worker {id} is not a member")).param("id")
}

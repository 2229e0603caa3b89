//! The router API's membership verbs, shared by the router's and the front door's HTTP APIs
//! (docs/membership.md): `POST /workers` (a worker joins), `POST /workers/{id}/drain` and
//! `DELETE /workers/{id}`. Both APIs keep them behind their admin token.

use std::sync::Arc;

use axum::http::StatusCode;
use kvroute_core::WorkerId;
use kvroute_http::ApiError;
use serde_json::{Value, json};

use super::change::{DRAIN_TIMEOUT, JoinError, drain, join, remove};
use super::template::id_for;
use crate::config::WorkerSpec;
use crate::state::RouterState;

/// The source of members added through the API.
pub const API_SOURCE: &str = "api";

/// `POST /workers`: `body` is a worker as the configuration's `[[workers]]` writes it, in
/// JSON; without an `id`, one is made from its `url` (else `events`), as for discovered
/// workers. 201 with the worker's id; 409 when the id is a member already.
pub fn add(state: &Arc<RouterState>, body: &[u8]) -> Result<(StatusCode, Value), ApiError> {
    let bad = |e: &dyn std::fmt::Display| ApiError::bad_request(format!("a worker: {e}"));
    let mut value: Value = serde_json::from_slice(body).map_err(|e| bad(&e))?;
    let object = value.as_object_mut().ok_or_else(|| bad(&"not a JSON object"))?;
    if !object.contains_key("id") {
        let address = ["url", "events"].iter().find_map(|k| object.get(*k)?.as_str());
        let address = address.ok_or_else(|| bad(&"neither an id nor a url or events"))?;
        object.insert("id".into(), json!(id_for(address).0));
    }
    let spec: WorkerSpec = serde_json::from_value(value).map_err(|e| bad(&e))?;
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

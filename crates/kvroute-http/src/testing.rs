//! Calling an axum app in-process, as tests do (`app(state).oneshot(request)`): no socket, the
//! same routing, extractors and error answers as a served app.

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

/// `method uri` with an optional JSON body; the status and the body as JSON (a body that is not
/// JSON comes back as a JSON string).
pub async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let mut request = Request::builder().method(method).uri(uri);
    if body.is_some() {
        request = request.header(header::CONTENT_TYPE, "application/json");
    }
    let body = body.map_or_else(Body::empty, |b| Body::from(b.to_string()));
    let request = request.body(body).unwrap_or_else(|e| unreachable!("a test request: {e}"));
    call_raw(app, request).await
}

/// Sends a prepared request; the status and the body as JSON (or a JSON string).
pub async fn call_raw(app: &Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = match app.clone().oneshot(request).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    let status = response.status();
    let bytes = match response.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return (status, Value::String(format!("body error: {e}"))),
    };
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, value)
}

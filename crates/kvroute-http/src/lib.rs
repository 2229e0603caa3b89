//! What every kvroute HTTP service shares, so the router, the front door, the simulated engine
//! and the bench speak one dialect:
//!
//! - [`ApiError`]: the one error answer (OpenAI's shape, sources kept for the log, 5xx logged);
//! - [`openai`]: the OpenAI request, answer and chunk types, the model list;
//! - [`router_api`]: the router's API, for its server and its clients alike;
//! - [`client`]: the one HTTP client, and [`sse`]: the one reader of event streams;
//! - [`metrics`]: the Prometheus registry and its `/metrics` answer;
//! - [`serve`] and [`fallbacks`]: how every listener is served; [`testing`]: calling an app
//!   in-process.
//!
//! ```text
//!  kvroute-router ─┐                         ┌─ server: axum Router + fallbacks, serve()
//!  kvroute-frontend┼─▶ kvroute-http ─────────┼─ types: openai, router_api, ApiError
//!  kvroute-mocker ─┤                         └─ client: HttpClient, SseReader, metrics
//!  kvroute-bench ──┘
//! ```

pub mod client;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod router_api;
pub mod sse;
pub mod testing;

use std::future::Future;

use axum::Router;
use axum::serve::ListenerExt as _;

pub use client::{ClientError, HttpClient};
pub use error::ApiError;
pub use sse::{SseEvent, SseReader};

/// Answers unknown routes (404) and methods (405) with an [`ApiError`] body.
pub fn fallbacks<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router.fallback(|| async { ApiError::not_found("no such route") }).method_not_allowed_fallback(
        || async {
            ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        },
    )
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open responses finish (bound
/// that wait outside). Writes go out without Nagle's delay: a streamed chunk otherwise waits
/// for the previous one's ACK, which a delayed ACK holds up to 40 ms.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

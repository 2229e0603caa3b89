//! What every kvroute HTTP service shares, so the router, the front door, the simulated engine
//! and the bench speak one dialect:
//!
//! - [`ApiError`]: the one error answer (OpenAI's shape, sources kept for the log, 5xx logged);
//! - [`openai`]: the OpenAI request, answer and chunk types; [`models`]: the served models
//!   (a base model and its LoRA adapters);
//! - [`router_api`]: the router's API, for its server and its clients alike;
//! - [`client`]: the one HTTP client, and [`sse`]: the one reader of event streams;
//! - [`metrics`]: the Prometheus registry and its `/metrics` answer;
//! - [`server`]: how every listener is served (TLS, timeouts, a connection limit), and
//!   [`fallbacks`]; [`auth`]: bearer keys (API keys, the admin token); [`tls`]: certificates
//!   reread when their files change, or self-signed;
//! - [`vllm_generate`]: vLLM's token-in, token-out API; [`sglang_generate`]: SGLang's native
//!   `/generate`;
//! - [`testing`]: calling an app in-process.
//!
//! ```text
//!  kvroute-router ─┐                         ┌─ server: axum Router + fallbacks, serve()
//!  kvroute-frontend┼─▶ kvroute-http ─────────┼─ types: openai, router_api, ApiError
//!  kvroute-mocker ─┤                         └─ client: HttpClient, SseReader, metrics
//!  kvroute-bench ──┘
//! ```

pub mod auth;
pub mod client;
pub mod error;
pub mod fast_json;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod otel;
pub mod paths;
pub mod router_api;
pub mod server;
pub mod sglang_generate;
pub mod sse;
pub mod status;
pub mod testing;
pub mod tls;
pub mod trace;
pub mod vllm_generate;

use std::future::Future;

use axum::Router;

pub use auth::Credentials;
pub use client::{ClientError, HttpClient};
pub use error::ApiError;

pub use server::{ServeOptions, serve_with};
pub use sse::{SseEvent, SseReader};
pub use status::{STATUS_PAGE, status_page};

/// Answers unknown routes (404) and methods (405) with an [`ApiError`] body.
pub fn fallbacks<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router.fallback(|| async { ApiError::not_found("no such route") }).method_not_allowed_fallback(
        || async {
            ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        },
    )
}

/// Serves `app` on `listener` with the default limits ([`ServeOptions`]) until `shutdown`
/// resolves, then lets open responses finish (bound that wait outside).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, app, shutdown, ServeOptions::default()).await
}

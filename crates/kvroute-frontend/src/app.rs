//! The front door's HTTP API: its routes, and serving them.

use kvroute_http::paths;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

use crate::handlers;
use crate::names::*;
use crate::state::FrontendState;

/// Serves [`app`] on `listener` until `shutdown` resolves, then waits for open responses (bound
/// that wait outside).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<FrontendState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    kvroute_http::serve(listener, app(state), shutdown).await
}

pub fn app(state: Arc<FrontendState>) -> Router {
    use kvroute_http::auth::require;
    let openai = Router::new()
        .route(paths::CHAT_COMPLETIONS, post(handlers::chat))
        .route(paths::COMPLETIONS, post(handlers::completions))
        .route(paths::MODELS, get(handlers::models));
    let routes = require(openai, state.api_keys.clone())
        .merge(kvroute_http::auth::mutations(
            Router::new()
                .route("/workers", post(handlers::add_worker))
                .route("/workers/{id}/drain", post(handlers::drain_worker))
                .route("/workers/{id}", axum::routing::delete(handlers::remove_worker)),
            state.admin.clone(),
        ))
        .merge(kvroute_http::auth::admin(
            Router::new()
                .route(paths::METRICS, get(handlers::metrics))
                .route("/workers", get(handlers::workers))
                .route("/decisions/{id}", get(handlers::decision))
                .route("/ui/history", get(handlers::history)),
            state.admin.clone(),
            &state.api_keys,
        ))
        .route(paths::HEALTH, get(handlers::health))
        .route("/ui", get(kvroute_http::status_page))
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    kvroute_http::fallbacks(routes).with_state(state)
}

//! The route table: which path goes to which handler, and the layers every request passes through.
//!
//! Layers, outermost first: `x-request-id` (kept when the client sent one, else a fresh UUID)
//! set on the request and copied onto the response, error responses included; a tracing span
//! per request carrying that id; [`metrics::track`], which counts every answer, refusals
//! included; [`auth::authenticate`] (401 without a valid key, when keys are configured);
//! [`limits::admit`] (rate limits and the admission queue, for work requests); the body limit,
//! which [`crate::http::json::ApiJson`] turns into a 413 envelope, and the body's read deadline,
//! which it turns into a 408. Unknown paths and wrong
//! methods answer with the envelope too, so a client never sees a bare status or a plain-text
//! body from this server.

use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post};
use axum::{Extension, Router};
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::auth;
use crate::http;
use crate::http::json::BodyReadTimeout;
use crate::limits;
use crate::metrics;
use crate::openapi;
use crate::service::AppState;

/// The whole HTTP API.
pub fn app(state: AppState) -> Router {
    let layers = ServiceBuilder::new()
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(
            TraceLayer::new_for_http().make_span_with(|request: &Request| {
                let id = request
                    .headers()
                    .get("x-request-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                tracing::info_span!(
                    "request",
                    method = %request.method(),
                    path = %request.uri().path(),
                    request_id = id,
                )
            }),
        );
    Router::new()
        .route("/v1/chat/completions", post(http::chat::create))
        .route("/v1/completions", post(http::completions::create))
        .route("/v1/responses", post(http::responses::create))
        .route(
            "/v1/responses/{id}",
            get(http::responses::get).delete(http::responses::delete),
        )
        .route("/v1/embeddings", post(http::embeddings::create))
        .route("/v1/swarm/verify", post(http::verify::verify))
        .route("/v1/models", get(http::models::list))
        .route("/v1/swarm/route", post(http::swarm::route))
        .route(
            "/v1/agents",
            get(http::agents::list).post(http::agents::create),
        )
        .route(
            "/v1/agents/{name}",
            get(http::agents::get).delete(http::agents::delete),
        )
        .route("/health", get(http::health::health))
        .route("/ready", get(http::health::ready))
        .route("/metrics", get(http::health::scrape))
        .route("/openapi.json", get(openapi::serve_spec))
        .route("/docs", get(openapi::docs))
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.max_body_bytes()))
        .layer(Extension(BodyReadTimeout(state.body_read_timeout())))
        .layer(from_fn_with_state(state.limits().clone(), limits::admit))
        .layer(from_fn_with_state(state.auth().clone(), auth::authenticate))
        .layer(from_fn_with_state(state.metrics().clone(), metrics::track))
        .layer(layers)
        .with_state(state)
}

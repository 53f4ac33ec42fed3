//! `GET /health` (live) and `GET /ready` (able to serve), for load balancers and orchestrators,
//! and `GET /metrics` for Prometheus.
//!
//! Both must stay cheap and never touch the engine's queue: a probe that waits behind
//! generation would mark a busy server dead. `/health` fails (503 `engine_unavailable`) only
//! when this process's own engine has failed: such a server cannot recover by itself (it also
//! exits, so that its supervisor restarts it). `/ready` checks that the models are loaded and the
//! engine loop is running, and that the shared state store (Redis, when configured) answers; a
//! server that is not ready answers 503 with the envelope (`engine_unavailable` or
//! `state_store_unavailable`).

use axum::extract::State;
use axum::Json;

use axum::response::Response;

use crate::api::{ErrorResponse, Health, Readiness};
use crate::error::{ApiError, AuthErrors};
use crate::metrics;
use crate::service::AppState;

/// Whether the server is up.
#[utoipa::path(get, path = "/health", tag = "probes", responses(
    (status = 200, description = "The server is up.", body = Health),
    (status = 503, description = "The server's own engine has failed.", body = ErrorResponse),
))]
pub async fn health(State(state): State<AppState>) -> Result<Json<Health>, ApiError> {
    match state.transport().local_engine() {
        Some(engine) if !engine.is_running() => Err(ApiError::Unavailable),
        _ => Ok(Json(Health { status: "ok" })),
    }
}

/// Whether the server can serve: models loaded, engine running, state store answering.
#[utoipa::path(get, path = "/ready", tag = "probes", responses(
    (status = 200, description = "Ready to serve.", body = Readiness),
    (status = 503, description = "The engine is not running, or the state store does not answer.", body = ErrorResponse),
))]
pub async fn ready(State(state): State<AppState>) -> Result<Json<Readiness>, ApiError> {
    if !state.transport().is_ready() {
        return Err(ApiError::Unavailable);
    }
    state.limits().ready().await?;
    let served = state.transport().models().iter().map(|m| m.id.as_str());
    let models = served
        .chain(state.embedding_model_id())
        .map(str::to_owned)
        .collect();
    Ok(Json(Readiness {
        status: "ready",
        models,
    }))
}

/// `GET /metrics`: every series in Prometheus' text format.
#[utoipa::path(get, path = "/metrics", tag = "probes", responses(
    (status = 200, description = "Prometheus' text exposition format.", body = String,
        content_type = "text/plain; version=0.0.4"),
    AuthErrors,
))]
pub async fn scrape(State(state): State<AppState>) -> Response {
    metrics::exposition(
        state
            .metrics()
            .render(state.transport().local_engine().map(|e| e.stats())),
    )
}

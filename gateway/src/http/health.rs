//! `GET /health` (live) and `GET /ready` (able to serve), for load balancers and orchestrators.
//!
//! Both must stay cheap and never touch the engine's queue: a probe that waits behind
//! generation would mark a busy server dead. `/ready` checks that the models are loaded and the
//! engine loop is running; a server that is not ready answers 503 with the envelope, naming what
//! is missing.

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::app::AppState;
use crate::error::ApiError;

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn ready(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    if !state.engine().is_running() {
        return Err(ApiError::Unavailable);
    }
    let mut models = vec![state.model_id()];
    models.extend(state.embedding_model_id());
    Ok(Json(json!({"status": "ready", "models": models})))
}

//! `GET /health`: answers 200 while the server is up, for load balancers and orchestrators.
//!
//! It must stay cheap and never touch the engine's queue: a probe that waits behind generation
//! would mark a busy server dead.

use axum::Json;
use serde_json::{json, Value};

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

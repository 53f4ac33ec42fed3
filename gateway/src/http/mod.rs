//! The HTTP endpoints, one module per family, plus the JSON body extractor they share.
//!
//! Handlers stay thin: extract, validate, call the engine, shape the answer. They return
//! [`ApiError`] for every failure and never build an error response themselves.

pub mod agents;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod health;
pub mod json;
pub mod models;
pub mod responses;
pub mod swarm;
pub mod swarm_chat;
pub mod verify;

use axum::http::{Method, Uri};

use crate::error::ApiError;

/// Any path no route matches.
pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::UnknownRoute {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// A known path asked with the wrong method (e.g. `GET /v1/chat/completions`).
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

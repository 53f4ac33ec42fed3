//! The gateway's one error type, and the only place that turns an error into an HTTP status and
//! OpenAI's error envelope `{"error": {"message", "type", "param", "code"}}`.
//!
//! Handlers and extractors return [`ApiError`]; nothing else builds an error response. The
//! status table:
//!
//! | variant | status | `type` | `code` |
//! |---|---|---|---|
//! | `InvalidRequest` | 400 | `invalid_request_error` | — |
//! | `ModelNotFound` | 404 | `invalid_request_error` | `model_not_found` |
//! | `UnknownRoute` | 404 | `invalid_request_error` | `unknown_url` |
//! | `MethodNotAllowed` | 405 | `invalid_request_error` | `method_not_allowed` |
//! | `PayloadTooLarge` | 413 | `invalid_request_error` | `request_too_large` |
//! | `Overloaded` | 503 + `Retry-After` | `server_error` | `overloaded` |
//! | `Unavailable` | 503 | `server_error` | `engine_unavailable` |
//! | `Generation` | 500 | `server_error` | — |
//! | `Internal` | 500, generic message | `server_error` | — |
//!
//! `Internal` hides its detail from the client (it may name files or kernels) and logs it
//! instead. Errors are classified by variant, never by their message text.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::EngineError;
use thiserror::Error;

use crate::api::{ErrorBody, ErrorResponse};

#[derive(Debug, Error)]
pub enum ApiError {
    /// The request is malformed or asks for something this server does not do.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        /// The request field at fault, as OpenAI names it (`temperature`, `messages[1].role`).
        param: Option<String>,
    },
    /// The request named a model this server does not serve.
    #[error("The model `{0}` does not exist or you do not have access to it.")]
    ModelNotFound(String),
    /// No route matches the path.
    #[error("Invalid URL ({method} {path})")]
    UnknownRoute { method: String, path: String },
    /// The path exists, but not for this method.
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed { method: String, path: String },
    /// The body is over the configured limit.
    #[error("The request body is larger than this server accepts.")]
    PayloadTooLarge,
    /// The engine's queue is full; retrying later may succeed.
    #[error("The server is overloaded ({0}); please retry shortly.")]
    Overloaded(String),
    /// The engine has stopped.
    #[error("The model is not available: the engine is not running.")]
    Unavailable,
    /// Generation started but failed (deadline passed, model error); the engine's message is
    /// meant for clients.
    #[error("Generation failed: {0}")]
    Generation(String),
    /// A fault on our side; the message stays in the logs.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What clients see instead of an internal error's detail.
const INTERNAL_MESSAGE: &str = "The server had an error while processing your request.";

/// Seconds an overloaded client is asked to wait: the queue drains at generation speed, so
/// a short wait is usually enough.
const RETRY_AFTER_SECS: &str = "1";

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// A 400 about the request as a whole.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::UnknownRoute { .. } => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Overloaded(_) | Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Generation(_) | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The envelope's inner object; streams send it inside a chunk once headers are gone.
    pub fn body(&self) -> ErrorBody {
        let (kind, code) = match self {
            Self::InvalidRequest { .. } => ("invalid_request_error", None),
            Self::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            Self::UnknownRoute { .. } => ("invalid_request_error", Some("unknown_url")),
            Self::MethodNotAllowed { .. } => ("invalid_request_error", Some("method_not_allowed")),
            Self::PayloadTooLarge => ("invalid_request_error", Some("request_too_large")),
            Self::Overloaded(_) => ("server_error", Some("overloaded")),
            Self::Unavailable => ("server_error", Some("engine_unavailable")),
            Self::Generation(_) | Self::Internal(_) => ("server_error", None),
        };
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::ModelNotFound(_) => Some("model".into()),
            _ => None,
        };
        let message = match self {
            Self::Internal(_) => INTERNAL_MESSAGE.to_owned(),
            other => other.to_string(),
        };
        ErrorBody {
            message,
            kind,
            param,
            code,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match &self {
            Self::Internal(detail) => tracing::error!(detail, "internal error"),
            Self::Generation(detail) => tracing::warn!(detail, "generation failed"),
            Self::Overloaded(detail) => tracing::warn!(detail, "overloaded"),
            Self::Unavailable => tracing::error!("request refused: the engine is not running"),
            _ => tracing::debug!(error = %self, "request refused"),
        }
        let status = self.status();
        let body = Json(ErrorResponse { error: self.body() });
        match self {
            Self::Overloaded(_) => {
                (status, [(header::RETRY_AFTER, RETRY_AFTER_SECS)], body).into_response()
            }
            _ => (status, body).into_response(),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(message) => Self::invalid_request(message),
            EngineError::Overloaded(message) => Self::Overloaded(message),
            EngineError::Stopped => Self::Unavailable,
            other @ (EngineError::Model(_)
            | EngineError::Tensor(_)
            | EngineError::Tokenizer(_)
            | EngineError::ChatTemplate(_)) => Self::Internal(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parts(error: ApiError) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
        let response = error.into_response();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, headers, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn invalid_request_names_its_param() {
        let (status, headers, body) = parts(ApiError::invalid("temperature", "too hot")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body,
            serde_json::json!({"error": {
                "message": "too hot", "type": "invalid_request_error",
                "param": "temperature", "code": null
            }})
        );
    }

    #[tokio::test]
    async fn internal_errors_hide_their_detail() {
        let (status, _, body) = parts(ApiError::Internal("/secret/path.gguf".into())).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body["error"]["message"], INTERNAL_MESSAGE);
        assert_eq!(body["error"]["type"], "server_error");
    }

    #[tokio::test]
    async fn overload_asks_to_retry() {
        let (status, headers, body) = parts(ApiError::Overloaded("512 queued".into())).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert_eq!(body["error"]["code"], "overloaded");
    }

    #[test]
    fn engine_errors_map_by_kind() {
        let status = |e: EngineError| ApiError::from(e).status();
        assert_eq!(
            status(EngineError::InvalidRequest("x".into())),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(EngineError::Overloaded("x".into())),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            status(EngineError::Stopped),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            status(EngineError::Model("x".into())),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            status(EngineError::Tokenizer("x".into())),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn not_found_kinds_carry_codes() {
        let body = ApiError::ModelNotFound("gpt-4".into()).body();
        assert_eq!(
            (body.code, body.param.as_deref()),
            (Some("model_not_found"), Some("model"))
        );
        assert!(body.message.contains("`gpt-4`"));
        assert_eq!(
            ApiError::PayloadTooLarge.status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
    }
}

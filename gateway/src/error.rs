//! The gateway's one error type, and the only place that turns an error into an HTTP status and
//! OpenAI's error envelope `{"error": {"message", "type", "param", "code"}}`.
//!
//! Handlers and extractors return [`ApiError`]; nothing else builds an error response. The
//! status table:
//!
//! | variant | status | `type` | `code` | rejection |
//! |---|---|---|---|---|
//! | `InvalidRequest` | 400 | `invalid_request_error` | — | `invalid` |
//! | `MissingApiKey`, `InvalidApiKey` | 401 | `invalid_request_error` | `invalid_api_key` | `auth` |
//! | `Forbidden` | 403 | `permission_error` | its own (`admin_disabled`, ...) | `auth` |
//! | `ModelNotFound` | 404 | `invalid_request_error` | `model_not_found` | `invalid` |
//! | `AgentNotFound` | 404 | `invalid_request_error` | `agent_not_found` | `invalid` |
//! | `ResponseNotFound` | 404 | `invalid_request_error` | — (as OpenAI) | `invalid` |
//! | `Conflict` | 409 | `invalid_request_error` | its own (`agent_exists`, ...) | `invalid` |
//! | `UnknownRoute` | 404 | `invalid_request_error` | `unknown_url` | `invalid` |
//! | `MethodNotAllowed` | 405 | `invalid_request_error` | `method_not_allowed` | `invalid` |
//! | `BodyTimeout` | 408 | `invalid_request_error` | `request_timeout` | `slow_client` |
//! | `PayloadTooLarge` | 413 | `invalid_request_error` | `request_too_large` | `body_too_large` |
//! | `RateLimited` | 429 + `Retry-After` | `rate_limit_error` | `rate_limit_exceeded` | `rate_limit` |
//! | `Overloaded` | 503 + `Retry-After` | `server_error` | `overloaded` | `overloaded` |
//! | `Unavailable` | 503 | `server_error` | `engine_unavailable` | — |
//! | `StoreUnavailable` | 503 | `server_error` | `state_store_unavailable` | — |
//! | `Timeout` | 504 | `server_error` | `timeout` | `timeout` |
//! | `Generation` | 500 | `server_error` | — | — |
//! | `Internal` | 500, generic message | `server_error` | — | — |
//!
//! `Internal` hides its detail from the client (it may name files or kernels) and logs it
//! instead. Errors are classified by variant, never by their message text.
//!
//! The rejection column is the `reason` label of `swarmgate_rejections_total`: every error
//! response carries it as a [`Rejection`] extension, which the metrics layer counts, so the
//! reasons are decided here and nowhere else.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::EngineError;
use thiserror::Error;
use utoipa::IntoResponses;

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
    /// Keys are configured and the request has no `Authorization: Bearer` header.
    #[error(
        "You didn't provide an API key. Send it in an Authorization header: \
         `Authorization: Bearer YOUR_KEY`."
    )]
    MissingApiKey,
    /// The request's key is not one of the configured keys.
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    /// The key is valid but may not do this (an administrative call without an admin key).
    #[error("{message}")]
    Forbidden { message: String, code: &'static str },
    /// No agent of the swarm has this name.
    #[error("No agent named `{0}`.")]
    AgentNotFound(String),
    /// No response stored for this caller has this id (never stored, deleted, expired, or
    /// stored with another API key).
    #[error("Response with id '{id}' not found.")]
    ResponseNotFound {
        id: String,
        /// The request field that named it (`previous_response_id`), if any.
        param: Option<&'static str>,
    },
    /// The request contradicts what the server holds (a name taken, an agent the swarm needs).
    #[error("{message}")]
    Conflict { message: String, code: &'static str },
    /// The caller is over its requests or tokens per minute.
    #[error("{message}")]
    RateLimited {
        message: String,
        /// When the request would succeed, were it sent again.
        retry_after: Duration,
    },
    /// The client did not send its request body within the server's body read timeout.
    #[error("The request body did not arrive within {0} s.")]
    BodyTimeout(f64),
    /// The engine's queue is full; retrying later may succeed.
    #[error("The server is overloaded ({0}); please retry shortly.")]
    Overloaded(String),
    /// The engine has stopped.
    #[error("The model is not available: the engine is not running.")]
    Unavailable,
    /// The shared state store (Redis, or the agents' PostgreSQL) does not answer; the detail
    /// stays in the logs.
    #[error("The shared state store is not answering; please retry shortly.")]
    StoreUnavailable(String),
    /// The request ran past its first-token or total deadline; its sequence is cancelled.
    #[error("{0}")]
    Timeout(&'static str),
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

/// Why a request was refused, as the `reason` label of `swarmgate_rejections_total`. Error
/// responses carry it as an extension for the metrics layer to count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection(pub &'static str);

impl From<crate::state::StoreError> for ApiError {
    fn from(error: crate::state::StoreError) -> Self {
        Self::StoreUnavailable(error.0)
    }
}

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
            Self::ModelNotFound(_)
            | Self::AgentNotFound(_)
            | Self::ResponseNotFound { .. }
            | Self::UnknownRoute { .. } => StatusCode::NOT_FOUND,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::MissingApiKey | Self::InvalidApiKey => StatusCode::UNAUTHORIZED,
            Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Overloaded(_) | Self::Unavailable | Self::StoreUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Generation(_) | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The envelope's inner object; streams send it inside a chunk once headers are gone.
    pub fn body(&self) -> ErrorBody {
        let (kind, code) = match self {
            Self::InvalidRequest { .. } => ("invalid_request_error", None),
            Self::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            Self::AgentNotFound(_) => ("invalid_request_error", Some("agent_not_found")),
            Self::ResponseNotFound { .. } => ("invalid_request_error", None),
            Self::Forbidden { code, .. } => ("permission_error", Some(*code)),
            Self::Conflict { code, .. } => ("invalid_request_error", Some(*code)),
            Self::UnknownRoute { .. } => ("invalid_request_error", Some("unknown_url")),
            Self::MethodNotAllowed { .. } => ("invalid_request_error", Some("method_not_allowed")),
            Self::PayloadTooLarge => ("invalid_request_error", Some("request_too_large")),
            Self::BodyTimeout(_) => ("invalid_request_error", Some("request_timeout")),
            Self::MissingApiKey | Self::InvalidApiKey => {
                ("invalid_request_error", Some("invalid_api_key"))
            }
            Self::RateLimited { .. } => ("rate_limit_error", Some("rate_limit_exceeded")),
            Self::Overloaded(_) => ("server_error", Some("overloaded")),
            Self::Unavailable => ("server_error", Some("engine_unavailable")),
            Self::StoreUnavailable(_) => ("server_error", Some("state_store_unavailable")),
            Self::Timeout(_) => ("server_error", Some("timeout")),
            Self::Generation(_) | Self::Internal(_) => ("server_error", None),
        };
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::ModelNotFound(_) => Some("model".into()),
            Self::AgentNotFound(_) => Some("name".into()),
            Self::ResponseNotFound { param, .. } => param.map(str::to_owned),
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

    /// Why the request was refused, for the metrics; `None` for failures on our side.
    pub fn rejection(&self) -> Option<Rejection> {
        let reason = match self {
            Self::InvalidRequest { .. }
            | Self::ModelNotFound(_)
            | Self::AgentNotFound(_)
            | Self::ResponseNotFound { .. }
            | Self::Conflict { .. }
            | Self::UnknownRoute { .. }
            | Self::MethodNotAllowed { .. } => "invalid",
            Self::MissingApiKey | Self::InvalidApiKey | Self::Forbidden { .. } => "auth",
            Self::PayloadTooLarge => "body_too_large",
            Self::BodyTimeout(_) => "slow_client",
            Self::RateLimited { .. } => "rate_limit",
            Self::Overloaded(_) => "overloaded",
            Self::Timeout(_) => "timeout",
            Self::Unavailable
            | Self::StoreUnavailable(_)
            | Self::Generation(_)
            | Self::Internal(_) => return None,
        };
        Some(Rejection(reason))
    }
}

/// Whole seconds, rounded up and at least 1: a client that waits that long will not be
/// refused again for the same reason.
fn retry_after_secs(wait: Duration) -> HeaderValue {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    HeaderValue::from(secs.max(1))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match &self {
            Self::Internal(detail) => tracing::error!(detail, "internal error"),
            Self::StoreUnavailable(detail) => tracing::error!(detail, "state store unavailable"),
            Self::Generation(detail) => tracing::warn!(detail, "generation failed"),
            Self::Overloaded(detail) => tracing::warn!(detail, "overloaded"),
            Self::Timeout(detail) => tracing::warn!(detail, "timed out"),
            Self::Unavailable => tracing::error!("request refused: the engine is not running"),
            _ => tracing::debug!(error = %self, "request refused"),
        }
        let status = self.status();
        let rejection = self.rejection();
        let body = Json(ErrorResponse { error: self.body() });
        let mut response = match self {
            Self::Overloaded(_) => {
                (status, [(header::RETRY_AFTER, RETRY_AFTER_SECS)], body).into_response()
            }
            Self::RateLimited { retry_after, .. } => (
                status,
                [(header::RETRY_AFTER, retry_after_secs(retry_after))],
                body,
            )
                .into_response(),
            _ => (status, body).into_response(),
        };
        if let Some(rejection) = rejection {
            response.extensions_mut().insert(rejection);
        }
        response
    }
}

/// The agent store's errors: a broken rule or a full swarm is the client's to fix; a database
/// that does not answer is a 503; stored agents that do not load are ours.
impl From<crate::agent_store::AgentStoreError> for ApiError {
    fn from(e: crate::agent_store::AgentStoreError) -> Self {
        use crate::agent_store::AgentStoreError as E;
        match e {
            E::Rules(e) => Self::from(e),
            E::Full { .. } => Self::invalid_request(e.to_string()),
            E::Database(_) | E::Pool(_) => Self::StoreUnavailable(e.to_string()),
            E::Stored { .. } | E::Corrupt(_) => Self::Internal(e.to_string()),
        }
    }
}

/// The swarm's errors: edits of the registry are the client's to fix (a field, a name, a rule
/// of the swarm); anything else while serving is ours, the swarm having been checked at start.
impl From<router::RouterError> for ApiError {
    fn from(e: router::RouterError) -> Self {
        use router::RouterError as E;
        let message = e.to_string();
        match e {
            E::Engine(e) => Self::from(e),
            E::InvalidAgent { field, .. } => Self::invalid(field, message),
            E::InvalidName { .. } => Self::invalid("name", message),
            E::UnknownAgent(name) => Self::AgentNotFound(name.to_string()),
            E::DuplicateAgent(_) => Self::Conflict {
                message,
                code: "agent_exists",
            },
            E::Protected { .. } => Self::Conflict {
                message,
                code: "agent_protected",
            },
            E::Invariant(_) => Self::Conflict {
                message,
                code: "swarm_invariant",
            },
            other => Self::Internal(other.to_string()),
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
            | EngineError::Device(_)
            | EngineError::Tensor(_)
            | EngineError::Tokenizer(_)
            | EngineError::ChatTemplate(_)) => Self::Internal(other.to_string()),
        }
    }
}

// What each kind of route may fail with, as the OpenAPI document tells clients (the
// responses themselves are built from `ApiError`).

/// What a generation or embedding request may fail with.
#[derive(IntoResponses)]
#[allow(dead_code)] // A description for the spec; responses are built by `ApiError`.
pub enum GenerationErrors {
    /// The request is invalid; `param` names the field at fault.
    #[response(status = 400)]
    BadRequest(ErrorResponse),
    /// No API key, or a wrong one.
    #[response(status = 401)]
    Unauthorized(ErrorResponse),
    /// The model named does not exist here.
    #[response(status = 404)]
    NotFound(ErrorResponse),
    /// The body is larger than the server accepts.
    #[response(status = 413)]
    TooLarge(ErrorResponse),
    /// The caller is over its requests or tokens per minute; see `Retry-After`.
    #[response(status = 429, headers(("retry-after" = String, description = "Seconds to wait.")))]
    RateLimited(ErrorResponse),
    /// Generation failed.
    #[response(status = 500)]
    Internal(ErrorResponse),
    /// The server is overloaded or its engine is not running (see `Retry-After`), or the
    /// state store (Redis) the request needs does not answer (`state_store_unavailable`).
    #[response(status = 503)]
    Unavailable(ErrorResponse),
    /// The request ran past its deadline.
    #[response(status = 504)]
    Timeout(ErrorResponse),
}

/// What a request that needs no engine may fail with.
#[derive(IntoResponses)]
#[allow(dead_code)] // A description for the spec; responses are built by `ApiError`.
pub enum AuthErrors {
    /// No API key, or a wrong one.
    #[response(status = 401)]
    Unauthorized(ErrorResponse),
}

/// What reading or deleting a stored response may fail with.
#[derive(IntoResponses)]
#[allow(dead_code)] // A description for the spec; responses are built by `ApiError`.
pub enum StoredErrors {
    /// No API key, or a wrong one.
    #[response(status = 401)]
    Unauthorized(ErrorResponse),
    /// No response with this id is stored for this API key.
    #[response(status = 404)]
    NotFound(ErrorResponse),
    /// The state store (Redis) does not answer (`state_store_unavailable`).
    #[response(status = 503)]
    Unavailable(ErrorResponse),
}

/// What the agent administration may fail with.
#[derive(IntoResponses)]
#[allow(dead_code)] // A description for the spec; responses are built by `ApiError`.
pub enum AdminErrors {
    /// The definition is invalid; `param` names the field at fault.
    #[response(status = 400)]
    BadRequest(ErrorResponse),
    /// No API key, or a wrong one.
    #[response(status = 401)]
    Unauthorized(ErrorResponse),
    /// Editing agents needs an admin key (`admin_key_required`), or is turned off
    /// (`admin_disabled`).
    #[response(status = 403)]
    Forbidden(ErrorResponse),
    /// No such agent (`agent_not_found`), or the server has no swarm (`model_not_found`).
    #[response(status = 404)]
    NotFound(ErrorResponse),
    /// The name is taken (`agent_exists`), the agent is one the swarm needs
    /// (`agent_protected`), or the swarm would break a rule (`swarm_invariant`).
    #[response(status = 409)]
    Conflict(ErrorResponse),
    /// The body is larger than the server accepts.
    #[response(status = 413)]
    TooLarge(ErrorResponse),
    /// A fault on the server's side.
    #[response(status = 500)]
    Internal(ErrorResponse),
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

    #[tokio::test]
    async fn auth_failures_are_401_invalid_api_key() {
        for error in [ApiError::MissingApiKey, ApiError::InvalidApiKey] {
            let (status, _, body) = parts(error).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
            assert_eq!(body["error"]["type"], "invalid_request_error");
            assert_eq!(body["error"]["code"], "invalid_api_key");
        }
    }

    #[tokio::test]
    async fn rate_limits_round_retry_after_up() {
        let limited = |millis| ApiError::RateLimited {
            message: "slow down".into(),
            retry_after: Duration::from_millis(millis),
        };
        let (status, headers, body) = parts(limited(2_100)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers[header::RETRY_AFTER], "3");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        let (_, headers, _) = parts(limited(0)).await;
        assert_eq!(
            headers[header::RETRY_AFTER],
            "1",
            "never 0: that invites a hot loop"
        );
    }

    #[tokio::test]
    async fn error_responses_say_why_they_were_refused() {
        let reason = |error: ApiError| {
            error
                .into_response()
                .extensions()
                .get::<Rejection>()
                .map(|r| r.0)
        };
        assert_eq!(reason(ApiError::InvalidApiKey), Some("auth"));
        assert_eq!(reason(ApiError::Timeout("late")), Some("timeout"));
        assert_eq!(reason(ApiError::PayloadTooLarge), Some("body_too_large"));
        assert_eq!(reason(ApiError::Overloaded("x".into())), Some("overloaded"));
        assert_eq!(reason(ApiError::Internal("x".into())), None);
        assert_eq!(
            ApiError::Timeout("late").status(),
            StatusCode::GATEWAY_TIMEOUT
        );
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

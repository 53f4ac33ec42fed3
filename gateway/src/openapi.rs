//! The OpenAPI document of the HTTP API, generated from the wire types ([`crate::api`]) and the
//! handlers' `#[utoipa::path]` annotations, so the spec cannot drift from what is served.
//!
//! Served at `GET /openapi.json`, rendered for people at `GET /docs` (a page of our own: no
//! assets fetched from anywhere), and committed at `openapi/openapi.json`, which a test keeps
//! equal to [`spec_json`]; `swarmgate openapi` rewrites it.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoResponses, Modify, OpenApi};

use crate::api::completions::CompletionChunk;
use crate::api::responses::SequencedEvent;
use crate::api::{ChatCompletionChunk, ErrorResponse};
use crate::http;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Swarmgate",
        description = "An OpenAI-compatible inference gateway for agent swarms. Errors use \
            OpenAI's envelope `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`; \
            when API keys are configured, every path but `/health` and `/ready` (and, by \
            default, `/metrics`) needs `Authorization: Bearer KEY`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        http::chat::create,
        http::completions::create,
        http::responses::create,
        http::responses::get,
        http::responses::delete,
        http::embeddings::create,
        http::verify::verify,
        http::models::list,
        http::swarm::route,
        http::agents::list,
        http::agents::get,
        http::agents::create,
        http::agents::delete,
        http::health::health,
        http::health::ready,
        crate::metrics::scrape,
    ),
    // The chunks travel inside stream events, where the spec cannot reference them.
    components(schemas(ChatCompletionChunk, CompletionChunk, SequencedEvent)),
    modifiers(&BearerKeys),
    tags(
        (name = "generation", description = "Text generation on the served model."),
        (name = "embeddings", description = "Sentence embeddings."),
        (name = "models", description = "What this server serves."),
        (name = "swarm", description = "The agent swarm: its agents, routing, and verification of answers."),
        (name = "probes", description = "Liveness, readiness and metrics."),
    )
)]
pub struct ApiDoc;

/// The API keys, as a bearer-token security scheme.
struct BearerKeys;

impl Modify for BearerKeys {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

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

/// The spec as pretty JSON with a final newline: what `openapi/openapi.json` holds.
pub fn spec_json() -> String {
    let mut json = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the spec serializes to JSON");
    json.push('\n');
    json
}

/// `GET /openapi.json`.
pub async fn serve_spec() -> Response {
    static SPEC: LazyLock<String> = LazyLock::new(spec_json);
    ([(header::CONTENT_TYPE, "application/json")], SPEC.as_str()).into_response()
}

/// `GET /docs`: a readable page of the API, drawn in the browser from `/openapi.json`.
pub async fn docs() -> Html<&'static str> {
    Html(include_str!("../../openapi/docs.html"))
}

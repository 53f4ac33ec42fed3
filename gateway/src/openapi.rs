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
use utoipa::{Modify, OpenApi};

use crate::api::completions::CompletionChunk;
use crate::api::responses::SequencedEvent;
use crate::api::ChatCompletionChunk;
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
        http::health::scrape,
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

//! `POST /v1/swarm/route`: which agent of the swarm would answer a conversation, and why (every
//! answering agent's score), without generating.
//!
//! Without a swarm file the endpoint answers 404 for the model `swarm`, as for any model this
//! server does not serve; without an embedding model, the embedding strategy is a 400 naming
//! `strategy` (the `llm` one still works).

use axum::extract::State;
use axum::Json;

use crate::api::swarm::{RouteRequest, RouteResponse};
use crate::error::{ApiError, GenerationErrors};
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::service::swarm::{route_response, SWARM_MODEL};
use crate::service::AppState;
use crate::validate::swarm::{validate_route, ValidRouteRequest};

/// Chooses the agent that would answer a conversation, without generating.
#[utoipa::path(post, path = "/v1/swarm/route", tag = "swarm",
    request_body = RouteRequest,
    responses(
        (status = 200, description = "The routing decision.", body = RouteResponse),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn route(
    State(state): State<AppState>,
    admission: Admission,
    ApiJson(request): ApiJson<RouteRequest>,
) -> Result<Json<RouteResponse>, ApiError> {
    let Some(swarm) = state.swarm() else {
        return Err(ApiError::ModelNotFound(SWARM_MODEL.into()));
    };
    let ValidRouteRequest { text, strategy } = validate_route(request)?;
    let seats = admission.reserve(&state, 1).await?;
    let engine = admission.engine(&state, &seats, swarm.router_agent());
    let route = swarm
        .route(&engine, text, strategy)
        .await
        .map_err(|e| engine.explain(e))?;
    Ok(Json(route_response(route)))
}

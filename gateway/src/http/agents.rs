//! `/v1/agents`: the swarm's agents, listed and described, added and removed at run time by an
//! admin ([`crate::auth`]). Definitions (system prompts, sampling, verifier policies) are shown
//! to admin keys, and to everyone on a server without keys; other callers see each agent's name
//! and description ([`AgentView`]).
//!
//! An agent is validated before the swarm is touched ([`validate_agent`]): the operator's bounds
//! on definitions, and whether it could serve a request on the served model, each a 400 naming
//! the field; a swarm already holding `--max-agents` agents refuses it with a 400.
//!
//! An added agent answers (as `model: "<name>"`, and through routing) from the next request on:
//! the registry publishes a new snapshot, its system prompt is pinned and pre-warmed, and the
//! routing index embeds its description and examples before the `201` goes out. A removed
//! agent's pin is released. The registry's rules decide what may change (one general fallback,
//! the system agents stay, names are unique); a refused edit changes nothing and says why:
//! 400 naming the field, 409 `agent_exists`, `agent_protected` or `swarm_invariant`, 404
//! `agent_not_found`.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use router::{AgentId, AgentSpec};

use crate::api::agents::{Agent, AgentList, AgentSummary, AgentView, DeletedAgent};
use crate::error::{AdminErrors, ApiError};
use crate::http::json::ApiJson;
use crate::service::swarm::{Swarm, SWARM_MODEL};
use crate::service::AppState;
use crate::validate::agent_definition::validate_agent;

/// Lists the swarm's agents: definitions for an admin key, else names and descriptions.
#[utoipa::path(get, path = "/v1/agents", tag = "swarm",
    responses(
        (status = 200, description = "Every agent, by name: each an `Agent` for an admin key \
            (or on a server without keys), an `AgentSummary` for other callers.", body = AgentList),
        AdminErrors,
    ),
    security(("api_key" = [])))]
pub async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<AgentList>, ApiError> {
    let swarm = swarm(&state)?;
    let definitions = state.auth().reads_definitions(&headers);
    let mut data = Vec::new();
    for agent in swarm.registry().snapshot().agents() {
        data.push(view(swarm, agent.clone(), definitions).await);
    }
    Ok(Json(AgentList {
        object: "list",
        data,
    }))
}

/// Describes one agent: its definition for an admin key, else its name and description.
#[utoipa::path(get, path = "/v1/agents/{name}", tag = "swarm",
    params(("name" = String, Path, description = "The agent's name.")),
    responses(
        (status = 200, description = "The agent: an `Agent` for an admin key (or on a server \
            without keys), an `AgentSummary` for other callers.", body = AgentView),
        AdminErrors,
    ),
    security(("api_key" = [])))]
pub async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Json<AgentView>, ApiError> {
    let swarm = swarm(&state)?;
    let agent = swarm
        .registry()
        .snapshot()
        .get(&name)
        .cloned()
        .ok_or(ApiError::AgentNotFound(name))?;
    let definitions = state.auth().reads_definitions(&headers);
    Ok(Json(view(swarm, agent, definitions).await))
}

/// Adds an agent (admin key).
#[utoipa::path(post, path = "/v1/agents", tag = "swarm",
    request_body = AgentSpec,
    responses(
        (status = 201, description = "The agent, now serving.", body = Agent),
        AdminErrors,
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(agent): ApiJson<AgentSpec>,
) -> Result<(StatusCode, Json<Agent>), ApiError> {
    state.auth().admin(&headers)?;
    let swarm = swarm(&state)?;
    let limits = state.agent_limits();
    let valid = validate_agent(agent, limits, state.transport().clone()).await?;
    let agent = valid.spec().clone();
    swarm.add_agent(valid, limits.max_agents).await?;
    tracing::info!(agent = %agent.name, "agent added");
    Ok((StatusCode::CREATED, Json(shown(swarm, agent).await)))
}

/// Removes a specialist (admin key); the general and system agents stay.
#[utoipa::path(delete, path = "/v1/agents/{name}", tag = "swarm",
    params(("name" = String, Path, description = "The agent's name.")),
    responses(
        (status = 200, description = "The agent is gone.", body = DeletedAgent),
        AdminErrors,
    ),
    security(("api_key" = [])))]
pub async fn delete(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Json<DeletedAgent>, ApiError> {
    state.auth().admin(&headers)?;
    let swarm = swarm(&state)?;
    let id = AgentId::new(name.as_str()).map_err(|_| ApiError::AgentNotFound(name))?;
    swarm.remove_agent(&id).await?;
    tracing::info!(agent = %id, "agent removed");
    Ok(Json(DeletedAgent {
        id: id.to_string(),
        object: "agent",
        deleted: true,
    }))
}

/// The swarm, or the 404 of a server that has none.
fn swarm(state: &AppState) -> Result<&Swarm, ApiError> {
    state
        .swarm()
        .ok_or_else(|| ApiError::ModelNotFound(SWARM_MODEL.into()))
}

/// `agent` in the view its reader may see.
async fn view(swarm: &Swarm, agent: AgentSpec, definitions: bool) -> AgentView {
    if definitions {
        AgentView::Definition(Box::new(shown(swarm, agent).await))
    } else {
        AgentView::Summary(AgentSummary {
            id: agent.name.to_string(),
            object: "agent",
            description: agent.description,
        })
    }
}

async fn shown(swarm: &Swarm, definition: AgentSpec) -> Agent {
    Agent {
        id: definition.name.to_string(),
        object: "agent",
        pinned_prompt_tokens: swarm.pinned_tokens(definition.name.as_str()).await,
        definition,
    }
}

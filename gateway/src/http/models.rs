//! `GET /v1/models`: the ids this server answers to, as OpenAI lists them: the served models (the
//! default first), the embedding model, and with a swarm, `swarm` and every agent that answers users (system agents
//! are internal: they never take a request themselves). Only what some engine serves now is
//! listed: with the engines in worker processes, the model once a worker is live, and the
//! agents some live worker hosts; never an agent on a model no engine serves.

use axum::extract::State;
use axum::Json;

use crate::api::models::{Model, ModelList};
use crate::error::AuthErrors;
use crate::service::swarm::SWARM_MODEL;
use crate::service::AppState;

/// Lists the models this server answers to.
#[utoipa::path(get, path = "/v1/models", tag = "models",
    responses(
        (status = 200, description = "The served models.", body = ModelList),
        AuthErrors,
    ),
    security(("api_key" = [])))]
pub async fn list(State(state): State<AppState>) -> Json<ModelList> {
    let model = |id: String| Model {
        id,
        object: "model",
        created: state.started(),
        owned_by: "swarmgate".into(),
    };
    let transport = state.transport();
    let served = transport.is_ready();
    let models = transport.models().iter().filter(|_| served);
    let mut ids: Vec<String> = models
        .map(|m| m.id.as_str())
        .chain(state.embedding_model_id())
        .map(str::to_owned)
        .collect();
    if let (Some(swarm), true) = (state.swarm(), served) {
        ids.push(SWARM_MODEL.into());
        let registry = swarm.registry().snapshot();
        ids.extend(
            registry
                .agents()
                .filter(|agent| !agent.kind.is_system() && transport.serves(agent.name.as_str()))
                // An agent on a model no engine here serves is answered with a 404.
                .filter(|agent| state.agent_model(agent).is_some())
                .map(|agent| agent.name.to_string()),
        );
    }
    let data = ids.into_iter().map(model).collect();
    Json(ModelList {
        object: "list",
        data,
    })
}

//! `GET /v1/models`: the ids this server answers to, as OpenAI lists them.

use axum::extract::State;
use axum::Json;

use crate::api::models::{Model, ModelList};
use crate::app::AppState;
use crate::openapi::AuthErrors;

/// Lists the models this server answers to.
#[utoipa::path(get, path = "/v1/models", tag = "models",
    responses(
        (status = 200, description = "The served models.", body = ModelList),
        AuthErrors,
    ),
    security(("api_key" = [])))]
pub async fn list(State(state): State<AppState>) -> Json<ModelList> {
    let model = |id: &str| Model {
        id: id.to_owned(),
        object: "model",
        created: state.started(),
        owned_by: "swarmgate".into(),
    };
    let data = std::iter::once(state.model_id())
        .chain(state.embedding_model_id())
        .map(model)
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
}

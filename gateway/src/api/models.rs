//! OpenAI's wire format for `GET /v1/models`: serde types and nothing else.

use serde::Serialize;
use utoipa::ToSchema;

/// The models this server answers to.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ModelList {
    /// Always `"list"`.
    pub object: &'static str,
    pub data: Vec<Model>,
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Model {
    /// What requests put in `model`.
    pub id: String,
    /// Always `"model"`.
    pub object: &'static str,
    /// Unix seconds: when this server loaded it.
    pub created: u64,
    pub owned_by: String,
}

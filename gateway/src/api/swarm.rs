//! The wire format of `POST /v1/swarm/route`: serde types and nothing else.
//!
//! The request takes a chat request's `messages` (any other chat field is ignored, so a client
//! can send the request it is about to send to `/v1/chat/completions`) and an optional
//! `strategy` overriding the swarm file's; the answer is the decision without the generation.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ChatMessage;

/// `POST /v1/swarm/route`.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[schema(example = json!({
    "messages": [{"role": "user", "content": "Why does my Python script raise a KeyError?"}]
}))]
pub struct RouteRequest {
    pub messages: Vec<ChatMessage>,
    /// `"embedding"` or `"llm"`; absent means the swarm file's `[routing] strategy`. Kept as a
    /// string so that validation names the field when the value is unknown.
    pub strategy: Option<String>,
}

/// The routing decision.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct RouteResponse {
    /// The agent that would answer.
    pub agent: String,
    /// The strategy that decided: `"embedding"` or `"llm"`.
    pub strategy: String,
    /// Every answering agent's score, in `0..=1`.
    pub scores: BTreeMap<String, f32>,
}

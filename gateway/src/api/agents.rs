//! The wire format of `/v1/agents`: serde types and nothing else. An agent is shown, and added,
//! as the swarm file writes it ([`AgentSpec`], whose fields and rules the router crate defines).

use router::AgentSpec;
use serde::Serialize;
use utoipa::ToSchema;

/// One agent of the swarm: its definition (what `POST /v1/agents` takes) and its state.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Agent {
    /// The agent's name: what chat requests put in `model` to talk to it.
    pub id: String,
    /// Always `"agent"`.
    pub object: &'static str,
    pub definition: AgentSpec,
    /// Tokens of the agent's system prompt kept warm in the prefix cache (0: not pinned).
    pub pinned_prompt_tokens: usize,
}

/// Every agent, by name.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct AgentList {
    /// Always `"list"`.
    pub object: &'static str,
    pub data: Vec<Agent>,
}

/// The answer to a deletion.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct DeletedAgent {
    /// The removed agent's name.
    pub id: String,
    /// Always `"agent"`.
    pub object: &'static str,
    /// Always `true`.
    pub deleted: bool,
}

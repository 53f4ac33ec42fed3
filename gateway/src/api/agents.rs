//! The wire format of `/v1/agents`: serde types and nothing else. An agent is shown, and added,
//! as the swarm file writes it ([`AgentSpec`], whose fields and rules the router crate defines).
//! Reading shows one of two views ([`AgentView`]): the whole [`Agent`] to an admin key (or to
//! anyone on a server without keys), an [`AgentSummary`] to other callers.

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

/// One agent as a caller without an admin key sees it: what it is for, not how it works.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct AgentSummary {
    /// The agent's name: what chat requests put in `model` to talk to it.
    pub id: String,
    /// Always `"agent"`.
    pub object: &'static str,
    /// What the agent handles (empty for agents that have none).
    pub description: String,
}

/// An agent as its reader may see it: [`Agent`] for an admin key, or on a server without
/// keys; [`AgentSummary`] for any other caller.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum AgentView {
    Definition(Box<Agent>),
    Summary(AgentSummary),
}

/// Every agent, by name, all in the same view.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct AgentList {
    /// Always `"list"`.
    pub object: &'static str,
    pub data: Vec<AgentView>,
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

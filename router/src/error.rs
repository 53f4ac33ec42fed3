//! The router crate's one error type: what failed, never how to present it (the gateway decides
//! statuses and exit codes). Variants carry the ids involved as typed fields, so callers match on
//! structure, never on message text; the messages name the agent, field or model at fault so a
//! person reading them knows what to edit.

use thiserror::Error;

use crate::agent::{AgentId, ModelId};
use crate::placement::{ByteSize, DeviceName};

#[derive(Debug, Error)]
pub enum RouterError {
    /// A name (of an agent, model or device) that breaks its type's rules.
    #[error("invalid {what} {name:?}: {reason}")]
    InvalidName {
        what: &'static str,
        name: String,
        reason: &'static str,
    },
    /// One field of one agent's definition is out of range or contradicts another.
    #[error("agent `{agent}`: {field}: {reason}")]
    InvalidAgent {
        agent: AgentId,
        field: &'static str,
        reason: String,
    },
    /// The swarm file could not be read, or is not valid TOML of the expected shape.
    #[error("swarm file {origin}: {message}")]
    Config { origin: String, message: String },
    /// An agent with this name is already registered.
    #[error("agent `{0}` is already registered")]
    DuplicateAgent(AgentId),
    /// No agent with this name is registered.
    #[error("no agent named `{0}`")]
    UnknownAgent(AgentId),
    /// The agent holds a role the swarm cannot run without.
    #[error("agent `{agent}` cannot be removed: {reason}")]
    Protected {
        agent: AgentId,
        reason: &'static str,
    },
    /// The agents together break a rule of the swarm (one fallback, one router, ...).
    #[error("swarm invariant: {0}")]
    Invariant(String),
    /// The embedding model or the engine failed a request of the router's or the judge's.
    #[error("engine: {0}")]
    Engine(#[from] engine::EngineError),
    /// An agent runs on a model the placement's model catalog does not size.
    #[error("agent `{agent}` runs on model `{model}`, which the model catalog does not know")]
    UnknownModel { agent: AgentId, model: ModelId },
    /// A byte size that does not parse (`80GiB`, `16GB`, `512MiB` do).
    #[error("invalid size {text:?}: {reason}")]
    InvalidSize { text: String, reason: &'static str },
    /// A device list that is empty, names a device twice, or is not `NAME=SIZE,...`.
    #[error("devices: {0}")]
    InvalidDevices(String),
    /// No device has room for this agent's KV reserve next to a replica of its model.
    #[error(
        "infeasible placement: agent `{agent}` (model `{model}`) does not fit: it needs {} of \
         KV reserve beside the model's {} replica (its weights; on a GPU, their GPU form and \
         the activation reserve), but the largest free budget is {}, on \
         `{largest_free_device}`",
        ByteSize(*.kv_bytes), ByteSize(*.weight_bytes), ByteSize(*.largest_free_bytes)
    )]
    Infeasible {
        agent: AgentId,
        model: ModelId,
        /// The replica's bytes on the device with the largest free budget.
        weight_bytes: u64,
        kv_bytes: u64,
        largest_free_bytes: u64,
        largest_free_device: DeviceName,
    },
    /// The judge ran but gave no verdict.
    #[error("judge: {0}")]
    Judge(String),
}

pub type Result<T, E = RouterError> = std::result::Result<T, E>;

//! Swarmgate's agents and routing: agent definitions, the registry, the routing agent, placement
//! of agents on devices, and the verifier. Uses the engine; knows nothing of HTTP.
//!
//! The pieces, in the order a swarm is brought up:
//! - [`config`] reads the swarm file (`swarm.toml`): a `[routing]` table and `[[agents]]`.
//! - [`agent`] is one agent's definition, [`AgentSpec`], and the rules for its fields.
//! - [`registry`] holds the agents by name and keeps the swarm's rules (one general fallback, at
//!   most one router and one verifier); [`SharedRegistry`] shares it between request handlers as
//!   immutable snapshots.
//! - [`route`] is the routing agent: it picks the agent for a request sent to the `swarm`
//!   model, by embeddings or by asking the generative model.
//! - [`placement`] decides which device hosts which model replica and which agents, within each
//!   device's memory budget.
//! - [`pins`] keeps the agents' system prompts warm in an engine's prefix cache.
//! - [`verifier`] decides whether an answer may reach the user: deterministic checks on the
//!   text, relevance by embeddings, and the verifier agent as judge.
//!
//! Every failure is a [`RouterError`].

/// Declares a string newtype whose constructor runs `$check` (returning why a value is refused),
/// so that a value of the type is always a valid name; serde goes through the same constructor.
macro_rules! validated_name {
    ($(#[$meta:meta])* $name:ident, $what:literal, $check:path) => {
        $(#[$meta])*
        #[derive(
            Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
        )]
        #[serde(try_from = "String", into = "String")]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        pub struct $name(String);

        impl $name {
            pub fn new(value: impl Into<String>) -> $crate::Result<Self> {
                let value = value.into();
                match $check(&value) {
                    Ok(()) => Ok(Self(value)),
                    Err(reason) => Err($crate::RouterError::InvalidName {
                        what: $what,
                        name: value,
                        reason,
                    }),
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl TryFrom<String> for $name {
            type Error = $crate::RouterError;

            fn try_from(value: String) -> $crate::Result<Self> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        /// Lets maps keyed by this type be queried with a plain `&str`.
        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

pub mod agent;
pub mod config;
pub mod error;
pub mod pins;
pub mod placement;
pub mod registry;
pub mod route;
pub mod verifier;

pub use agent::{
    AgentId, AgentKind, AgentSpec, ModelId, OnFailure, SamplingDefaults, StreamMode,
    VerifierChecks, VerifierPolicy,
};
pub use config::{RoutingConfig, RoutingStrategy, SwarmConfig};
pub use error::{Result, RouterError};
pub use pins::Pins;
pub use placement::{
    plan, AgentPlacement, ByteSize, DeviceLoad, DeviceName, DeviceSpec, ModelCatalog,
    ModelFootprint, Placement, GPU_HEADROOM,
};
pub use registry::{Registry, SharedRegistry};
pub use route::{EmbeddingRouter, LlmRouter, Route};
pub use verifier::{Candidate, Judgement, Verdict, Verifier, VerifierConfig};

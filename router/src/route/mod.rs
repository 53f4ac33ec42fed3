//! The routing agent: which agent answers a request sent to the `swarm` model.
//!
//! Two strategies, chosen by `[routing] strategy` in the swarm file:
//! - [`embedding`]: the last user turn's MiniLM embedding against each answering agent's
//!   description and routing examples (one small encoder pass, no generation);
//! - [`llm`]: the generative model reads a prompt that lists the agents and scores the first
//!   token of each agent's name in one prefill (no sampling).
//!
//! Both produce one score in `0..=1` per answering agent (the specialists and the general
//! agent) and then apply the same rule, [`decide`]: the best-scoring specialist takes the
//! request only if it leads the runner-up by at least the margin; otherwise, and whenever the
//! general agent scores best, the request goes to the general agent. A route never names a
//! system agent (router, verifier), and its scores cover every answering agent.

pub mod embedding;
pub mod lexical;
pub mod llm;
pub mod ridge;

use std::collections::BTreeMap;

use engine::ChatMessage;

use crate::{AgentId, AgentKind, Registry, RoutingStrategy};

pub use embedding::EmbeddingRouter;
pub use llm::LlmRouter;

/// A routing decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// The agent that answers.
    pub agent: AgentId,
    pub strategy: RoutingStrategy,
    /// Every answering agent's score, in `0..=1`; higher fits better.
    pub scores: BTreeMap<AgentId, f32>,
    /// The tokens the decision read: the encoder's word pieces, or the routing prompt and the
    /// one scored step of the generative model.
    pub usage: engine::Usage,
}

/// The agents a request can be routed to: every specialist and the general agent, by name.
pub fn answering_agents(registry: &Registry) -> impl Iterator<Item = &crate::AgentSpec> + '_ {
    registry
        .agents()
        .filter(|a| matches!(a.kind, AgentKind::Specialist | AgentKind::General))
}

/// The text a request is routed on: its last user turn, or `None` when it has none.
pub fn last_user_turn(messages: &[ChatMessage]) -> Option<&str> {
    messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.as_str())
}

/// The margin rule of the module header: the agent for `scores` in `registry`.
pub fn decide(registry: &Registry, scores: &BTreeMap<AgentId, f32>, margin: f32) -> AgentId {
    let general = registry.general().name.clone();
    let mut ranked: Vec<(&AgentId, f32)> = scores.iter().map(|(a, s)| (a, *s)).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    match ranked.as_slice() {
        [] => general,
        [(best, _)] => (*best).clone(),
        [(best, first), (_, second), ..] => {
            if **best != general && first - second >= margin {
                (*best).clone()
            } else {
                general
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use std::path::PathBuf;
    use std::sync::{Arc, OnceLock};

    use engine::{Embedder, EmbedderConfig};

    use crate::{Registry, SwarmConfig};

    /// The workspace's default swarm, as a registry.
    pub fn default_registry() -> Registry {
        let config = SwarmConfig::parse(include_str!("../../../swarm.toml"), "swarm.toml").unwrap();
        Registry::new(config.agents).unwrap()
    }

    /// The real all-MiniLM-L6-v2, loaded once per test binary.
    pub fn minilm() -> Arc<Embedder> {
        static EMBEDDER: OnceLock<Arc<Embedder>> = OnceLock::new();
        EMBEDDER
            .get_or_init(|| {
                let model =
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2");
                let config = EmbedderConfig {
                    model,
                    threads: Some(2),
                    ..EmbedderConfig::default()
                };
                Arc::new(Embedder::load(&config).expect("run `make models` first"))
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(pairs: &[(&str, f32)]) -> BTreeMap<AgentId, f32> {
        pairs
            .iter()
            .map(|(a, s)| (AgentId::new(*a).unwrap(), *s))
            .collect()
    }

    #[test]
    fn the_margin_decides_between_a_specialist_and_general() {
        let registry = test_support::default_registry();
        let clear = scores(&[("coder", 0.70), ("math", 0.60), ("general", 0.2)]);
        assert_eq!(decide(&registry, &clear, 0.05).as_str(), "coder");
        assert_eq!(decide(&registry, &clear, 0.15).as_str(), "general");
        let general_best = scores(&[("coder", 0.3), ("general", 0.9)]);
        assert_eq!(decide(&registry, &general_best, 0.05).as_str(), "general");
        assert_eq!(
            decide(&registry, &BTreeMap::new(), 0.05).as_str(),
            "general"
        );
    }

    #[test]
    fn routing_reads_the_last_user_turn() {
        let messages = [
            ChatMessage::new("system", "be brief"),
            ChatMessage::new("user", "first"),
            ChatMessage::new("assistant", "ok"),
            ChatMessage::new("user", "second"),
            ChatMessage::new("assistant", "ok"),
        ];
        assert_eq!(last_user_turn(&messages), Some("second"));
        assert_eq!(last_user_turn(&messages[..1]), None);
    }

    #[test]
    fn answering_agents_leave_out_system_agents() {
        let registry = test_support::default_registry();
        let names: Vec<_> = answering_agents(&registry)
            .map(|a| a.name.as_str())
            .collect();
        assert_eq!(
            names,
            ["analyst", "coder", "general", "math", "support", "writer"]
        );
    }
}

//! The swarm file (`swarm.toml`): how requests are routed, and the agents.
//!
//! ```toml
//! [routing]
//! strategy = "embedding"   # or "llm"
//! margin = 0.05
//!
//! [[agents]]
//! name = "coder"
//! description = "..."
//! # see AgentSpec for every field
//! ```
//!
//! Loading checks the file's shape (unknown keys anywhere are errors, so a misspelt setting is
//! never silently ignored) and the routing settings' values; the agents' values and the rules
//! between agents are checked when they enter a [`crate::Registry`].

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{AgentSpec, Result, RouterError};

/// The contents of a swarm file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwarmConfig {
    #[serde(default)]
    pub routing: RoutingConfig,
    pub agents: Vec<AgentSpec>,
}

/// How the agent for a request is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingStrategy {
    /// Compare the request's embedding with each specialist's description and examples: one
    /// small encoder pass, no generation.
    #[default]
    Embedding,
    /// Ask the router agent which specialist fits, scoring each agent's name as the answer.
    Llm,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    pub strategy: RoutingStrategy,
    /// The least lead, in score, the best specialist must have over the runner-up to take the
    /// request; closer calls go to the general agent, because a coin-flip route is worse than
    /// a competent generalist. Scores lie in 0..=1 for both strategies.
    pub margin: f32,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            strategy: RoutingStrategy::Embedding,
            margin: 0.05,
        }
    }
}

impl RoutingConfig {
    fn validate(&self) -> Result<(), String> {
        if !(0.0..1.0).contains(&self.margin) {
            return Err(format!(
                "routing.margin: {} is outside 0..1 (scores lie in 0..=1)",
                self.margin
            ));
        }
        Ok(())
    }
}

impl SwarmConfig {
    /// Parses a swarm file's text; `origin` names it in errors (a path, or `<inline>`).
    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        let error = |message: String| RouterError::Config {
            origin: origin.to_owned(),
            message,
        };
        let config: Self = toml::from_str(text).map_err(|e| error(e.to_string()))?;
        config.routing.validate().map_err(error)?;
        Ok(config)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| RouterError::Config {
            origin: origin.clone(),
            message: e.to_string(),
        })?;
        Self::parse(&text, &origin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AgentKind, Registry};

    const DEFAULT_SWARM: &str = include_str!("../../swarm.toml");

    #[test]
    fn the_default_swarm_loads_and_keeps_every_rule() {
        let config = SwarmConfig::parse(DEFAULT_SWARM, "swarm.toml").unwrap();
        let registry = Registry::new(config.agents).unwrap();
        let names = |kind| {
            registry
                .list(kind)
                .map(|a| a.name.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(AgentKind::Specialist),
            ["analyst", "coder", "math", "support", "writer"]
        );
        assert_eq!(names(AgentKind::General), ["general"]);
        assert_eq!(names(AgentKind::Router), ["router"]);
        assert_eq!(names(AgentKind::Verifier), ["verifier"]);
        for agent in registry.list(AgentKind::Specialist) {
            let n = agent.routing_examples.len();
            assert!(n >= 40, "{}: {n} examples", agent.name);
            assert!(agent.system_prompt.len() > 200, "{}", agent.name);
        }
        for agent in registry.agents() {
            assert!(agent.model.is_default(), "{}", agent.name);
        }
    }

    #[test]
    fn the_router_prompt_names_every_answering_agent() {
        let config = SwarmConfig::parse(DEFAULT_SWARM, "swarm.toml").unwrap();
        let registry = Registry::new(config.agents).unwrap();
        let router = registry.list(AgentKind::Router).next().unwrap();
        for agent in registry.agents().filter(|a| !a.kind.is_system()) {
            assert!(
                router.system_prompt.contains(agent.name.as_str()),
                "the router's prompt does not offer `{}`",
                agent.name
            );
        }
    }

    #[test]
    fn routing_settings_are_optional_and_checked() {
        let config = SwarmConfig::parse("agents = []", "<inline>").unwrap();
        assert_eq!(config.routing, RoutingConfig::default());
        let config =
            SwarmConfig::parse("agents = []\n[routing]\nstrategy = \"llm\"", "<inline>").unwrap();
        assert_eq!(config.routing.strategy, RoutingStrategy::Llm);
        let err = SwarmConfig::parse("agents = []\n[routing]\nmargin = 1.5", "<inline>")
            .unwrap_err()
            .to_string();
        assert!(err.contains("routing.margin"), "{err}");
    }

    #[test]
    fn errors_name_the_file_and_the_misspelt_key() {
        let err = SwarmConfig::parse("agents = []\n[routing]\nmargn = 0.1", "team.toml")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("swarm file team.toml:"), "{err}");
        assert!(err.contains("margn"), "{err}");
        let err = SwarmConfig::load(Path::new("/nonexistent/swarm.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/swarm.toml"), "{err}");
    }
}

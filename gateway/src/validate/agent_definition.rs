//! `POST /v1/agents`: a definition to an agent this server can serve, or a 400 naming the field.
//!
//! The router crate judges an agent's fields and the rules between agents
//! ([`AgentSpec::validate`], [`router::Registry`]). This adds what depends on the server:
//! - the operator's bounds on a definition ([`AgentLimits`]): the system prompt's bytes, the
//!   description's and each routing example's bytes, the number of routing examples;
//! - whether the agent could ever serve a request here: it runs on the served model, its stop
//!   strings are within a request's bound ([`MAX_STOP_SEQUENCES`], so its defaults never make
//!   its own requests invalid), its system prompt, rendered by the model's chat template, leaves
//!   room in the context for a turn, and its default `max_tokens` fits beside that prompt.
//!
//! The number of agents ([`AgentLimits::max_agents`]) is checked where the swarm is edited,
//! against the swarm as it is then ([`crate::http::swarm::Swarm::add_agent`]). Tokenizing a long
//! prompt is CPU work, so it runs on tokio's blocking threads.

use std::sync::Arc;

use router::AgentSpec;

use crate::error::ApiError;
use crate::transport::Transport;
use crate::validate::MAX_STOP_SEQUENCES;

/// The operator's bounds on agents added at run time (`--max-agents`, `--max-agent-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentLimits {
    /// Most agents the swarm may hold.
    pub max_agents: usize,
    pub max_prompt_bytes: usize,
    /// Bounds the description and each routing example alike: both are short texts that
    /// routing embeds.
    pub max_description_bytes: usize,
    pub max_routing_examples: usize,
}

impl AgentLimits {
    /// The defaults of `--max-agents` and the `--max-agent-*` flags.
    pub const DEFAULT: Self = Self {
        max_agents: 64,
        max_prompt_bytes: 32768,
        max_description_bytes: 2048,
        max_routing_examples: 64,
    };
}

impl Default for AgentLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// An agent that passed [`validate_agent`]; only such an agent is added to a swarm.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidAgent(AgentSpec);

impl ValidAgent {
    pub fn spec(&self) -> &AgentSpec {
        &self.0
    }

    pub fn into_spec(self) -> AgentSpec {
        self.0
    }
}

/// `spec`, if it keeps the router's rules and `limits`, and could serve a request on the model
/// `transport` reaches.
pub async fn validate_agent(
    spec: AgentSpec,
    limits: AgentLimits,
    transport: Arc<dyn Transport>,
) -> Result<ValidAgent, ApiError> {
    tokio::task::spawn_blocking(move || validate(spec, &limits, transport.models()))
        .await
        .map_err(|e| ApiError::Internal(format!("agent validation task: {e}")))?
}

/// `models`: those served, the default first.
fn validate(
    spec: AgentSpec,
    limits: &AgentLimits,
    models: &[engine::ModelInfo],
) -> Result<ValidAgent, ApiError> {
    spec.validate()?;
    within_limits(&spec, limits)?;
    let Some(model) = spec.model_among(models) else {
        let served: Vec<String> = models.iter().map(|m| format!("`{}`", m.id)).collect();
        return Err(ApiError::invalid(
            "model",
            format!(
                "agent `{}` runs on model `{}`, which this server does not serve (it serves {}; \
                 `default` names the first)",
                spec.name,
                spec.model,
                served.join(", ")
            ),
        ));
    };
    let stops = spec.sampling.stop.as_ref().map_or(0, Vec::len);
    if stops > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid(
            "sampling.stop",
            format!(
                "a request takes at most {MAX_STOP_SEQUENCES} stop strings, so an agent's \
                 defaults may not have more; this one has {stops}"
            ),
        ));
    }
    fits_the_context(&spec, model)?;
    Ok(ValidAgent(spec))
}

fn within_limits(spec: &AgentSpec, limits: &AgentLimits) -> Result<(), ApiError> {
    let too_long = |field: &str, what: &str, bytes: usize, max: usize| {
        ApiError::invalid(
            field,
            format!("{what} has {bytes} bytes; this server takes at most {max}"),
        )
    };
    if spec.system_prompt.len() > limits.max_prompt_bytes {
        return Err(too_long(
            "system_prompt",
            "the system prompt",
            spec.system_prompt.len(),
            limits.max_prompt_bytes,
        ));
    }
    if spec.description.len() > limits.max_description_bytes {
        return Err(too_long(
            "description",
            "the description",
            spec.description.len(),
            limits.max_description_bytes,
        ));
    }
    if spec.routing_examples.len() > limits.max_routing_examples {
        return Err(ApiError::invalid(
            "routing_examples",
            format!(
                "an agent has at most {} routing examples; this one has {}",
                limits.max_routing_examples,
                spec.routing_examples.len()
            ),
        ));
    }
    if let Some((i, example)) = spec
        .routing_examples
        .iter()
        .enumerate()
        .find(|(_, e)| e.len() > limits.max_description_bytes)
    {
        return Err(too_long(
            "routing_examples",
            &format!("routing example {i}"),
            example.len(),
            limits.max_description_bytes,
        ));
    }
    Ok(())
}

/// Whether a request answered by `spec` can fit `model`'s context: the agent's prompt starts
/// with its rendered system prompt, and needs room after it for at least a turn and a token.
fn fits_the_context(spec: &AgentSpec, model: &engine::ModelInfo) -> Result<(), ApiError> {
    // The engine's own bound, as for every request: the model's positions and the KV cache.
    let limit = model.context_length.min(model.kv_capacity_tokens);
    let prompt_tokens = match spec.system_prefix(model) {
        None => 0,
        Some(prefix) => prefix?.len(),
    };
    if prompt_tokens >= limit {
        return Err(ApiError::invalid(
            "system_prompt",
            format!(
                "the system prompt takes {prompt_tokens} tokens, and this model's context holds \
                 {limit}: no request to the agent would fit"
            ),
        ));
    }
    if let Some(max_tokens) = spec.sampling.max_tokens {
        let room = limit - prompt_tokens;
        if max_tokens >= room {
            return Err(ApiError::invalid(
                "sampling.max_tokens",
                format!(
                    "this model's context holds {limit} tokens, the system prompt takes \
                     {prompt_tokens}, so a request relying on the agent's default of \
                     {max_tokens} would never fit; at most {} leaves room for a turn",
                    room - 1
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use router::{AgentId, AgentKind};

    use super::*;
    use crate::test_support::model_info;

    /// The served model's metadata with a small KV cache, which bounds every sequence: prompts
    /// that overflow it stay short.
    const CAPACITY: usize = 256;

    fn specialist() -> AgentSpec {
        AgentSpec {
            description: "Answers questions about birds.".into(),
            routing_examples: vec![
                "what do robins eat".into(),
                "how far do swallows migrate".into(),
                "identify this bird call".into(),
            ],
            system_prompt: "You know birds.".into(),
            ..AgentSpec::new(AgentId::new("birds").unwrap(), AgentKind::Specialist)
        }
    }

    /// The refused field, asserting a 400.
    fn refused(spec: AgentSpec, limits: &AgentLimits) -> String {
        match validate(spec, limits, &[model_info(CAPACITY)]) {
            Err(ApiError::InvalidRequest {
                param: Some(param), ..
            }) => param,
            other => panic!("expected a 400 naming a field, got {other:?}"),
        }
    }

    fn accepted(spec: AgentSpec, limits: &AgentLimits) -> ValidAgent {
        validate(spec, limits, &[model_info(CAPACITY)]).unwrap()
    }

    #[test]
    fn a_sound_agent_passes_unchanged() {
        let valid = accepted(specialist(), &AgentLimits::default());
        assert_eq!(valid.spec(), &specialist());
    }

    #[test]
    fn each_bound_names_its_field() {
        let limits = AgentLimits {
            max_agents: 8,
            max_prompt_bytes: 64,
            max_description_bytes: 40,
            max_routing_examples: 4,
        };
        let mut long_prompt = specialist();
        long_prompt.system_prompt = "x".repeat(65);
        let mut long_description = specialist();
        long_description.description = "d".repeat(41);
        let mut many_examples = specialist();
        many_examples.routing_examples = (0..5).map(|i| format!("example {i}")).collect();
        let mut long_example = specialist();
        long_example.routing_examples[1] = "e".repeat(41);
        for (spec, field) in [
            (long_prompt, "system_prompt"),
            (long_description, "description"),
            (many_examples, "routing_examples"),
            (long_example, "routing_examples"),
        ] {
            assert_eq!(refused(spec, &limits), field);
        }
        // At the bounds exactly, nothing is refused.
        let mut at_bounds = specialist();
        at_bounds.system_prompt = "x".repeat(64);
        at_bounds.description = "d".repeat(40);
        at_bounds.routing_examples = (0..4).map(|i| format!("{i}{}", "e".repeat(39))).collect();
        accepted(at_bounds, &limits);
    }

    #[test]
    fn an_agent_that_could_never_serve_is_refused() {
        let limits = AgentLimits::default();

        let mut stops = specialist();
        stops.sampling.stop = Some((0..=MAX_STOP_SEQUENCES).map(|i| format!("<{i}>")).collect());
        assert_eq!(refused(stops, &limits), "sampling.stop");

        // Every word is at least one token: this prompt alone overflows the context.
        let mut huge = specialist();
        huge.system_prompt = "word ".repeat(CAPACITY);
        assert_eq!(refused(huge, &limits), "system_prompt");

        let mut greedy = specialist();
        greedy.sampling.max_tokens = Some(CAPACITY);
        assert_eq!(refused(greedy, &limits), "sampling.max_tokens");

        let mut elsewhere = specialist();
        elsewhere.model = router::ModelId::new("llama-70b").unwrap();
        assert_eq!(refused(elsewhere, &limits), "model");

        let mut modest = specialist();
        modest.sampling.max_tokens = Some(CAPACITY / 2);
        modest.sampling.stop = Some(vec!["<end>".into(); MAX_STOP_SEQUENCES]);
        accepted(modest, &limits);
    }

    #[test]
    fn the_router_rules_come_first() {
        let mut spec = specialist();
        spec.routing_examples.truncate(2);
        assert_eq!(refused(spec, &AgentLimits::default()), "routing_examples");
    }
}

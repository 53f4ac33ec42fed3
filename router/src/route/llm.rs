//! The `llm` strategy: the generative model chooses, in one prefill and without sampling.
//!
//! The prompt is the router agent's system prompt (or, when the swarm has no router agent or
//! its prompt does not name every answering agent, one generated from the agents'
//! descriptions) followed by the request's last user turn, rendered with the model's chat
//! template. The engine prefills it and generates one greedy token, reporting the
//! log-probabilities of the first token of each answering agent's name at that position
//! (`score_tokens`). The scores are the softmax over those log-probabilities: the model's
//! preference among the agents, summing to one. Agents whose names start with the same token
//! share its probability equally, since one position cannot tell them apart.
//!
//! Cost: one prefill of the prompt (the router's system prompt is the same for every request,
//! so the engine's prefix cache serves it after the first) and one decode step.

use std::collections::BTreeMap;

use engine::{ChatMessage, Event, Generate, GenerateRequest, Prompt, SamplingParams};

use super::{answering_agents, decide, Route};
use crate::{AgentId, AgentKind, Registry, Result, RouterError, RoutingStrategy};

/// Routes by asking the generative model; see the module header. The prefill runs on the
/// engine each call names: the caller's own, under the limits of the request it serves.
#[derive(Clone)]
pub struct LlmRouter {
    margin: f32,
}

/// One answering agent and the token its name starts with.
struct Label {
    agent: AgentId,
    token: u32,
}

impl LlmRouter {
    pub fn new(margin: f32) -> Self {
        Self { margin }
    }

    /// Routes `text` (a request's last user turn) among `registry`'s answering agents, asking
    /// `engine`.
    pub async fn route(
        &self,
        engine: &dyn Generate,
        registry: &Registry,
        text: &str,
    ) -> Result<Route> {
        let (request, labels) = request(engine, registry, text)?;
        let mut stream = engine.submit(request).await?;
        let mut scored = None;
        let mut usage = engine::Usage::default();
        while let Some(event) = stream.next().await {
            match event {
                Event::Delta { logprobs, .. } => {
                    if let Some(first) = logprobs.into_iter().next() {
                        scored.get_or_insert(first.scored);
                    }
                }
                Event::Finished { error: Some(e), .. } => {
                    return Err(RouterError::Engine(engine::EngineError::Model(e)))
                }
                Event::Finished { usage: used, .. } => {
                    usage = used;
                    break;
                }
                // Routing never asks for the prompt's log-probabilities.
                Event::PromptLogprobs(_) => {}
            }
        }
        let scored = scored.ok_or_else(|| {
            RouterError::Engine(engine::EngineError::Model(
                "the routing prefill reported no scores".into(),
            ))
        })?;
        let scores = softmax_scores(&labels, &scored);
        Ok(Route {
            agent: decide(registry, &scores, self.margin),
            strategy: RoutingStrategy::Llm,
            scores,
            usage,
        })
    }
}

/// The one-token, greedy, scoring request for `text`, and the labels it scores.
fn request(
    engine: &dyn Generate,
    registry: &Registry,
    text: &str,
) -> Result<(GenerateRequest, Vec<Label>)> {
    let tokenizer = &engine.model().tokenizer;
    let labels = answering_agents(registry)
        .map(|spec| {
            let encoding = tokenizer
                .encode(spec.name.as_str(), false)
                .map_err(|e| engine::EngineError::Tokenizer(e.to_string()))?;
            let token = *encoding.get_ids().first().ok_or_else(|| {
                engine::EngineError::Tokenizer(format!("`{}` has no tokens", spec.name))
            })?;
            Ok(Label {
                agent: spec.name.clone(),
                token,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let messages = [
        ChatMessage::new("system", system_prompt(registry)),
        ChatMessage::new("user", text),
    ];
    // The user's text is content: a control token typed in it stays text.
    let prompt = engine.model().encode_chat(&messages, true)?;
    let mut request = GenerateRequest::new(Prompt::Tokens(prompt.tokens));
    request.max_tokens = 1;
    request.sampling = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    request.score_tokens = labels.iter().map(|l| l.token).collect();
    Ok((request, labels))
}

/// The router agent's prompt when it offers every answering agent, else one listing them.
fn system_prompt(registry: &Registry) -> String {
    if let Some(router) = registry.list(AgentKind::Router).next() {
        let offers_all =
            answering_agents(registry).all(|a| router.system_prompt.contains(a.name.as_str()));
        if offers_all {
            return router.system_prompt.clone();
        }
    }
    let mut prompt = String::from("You route requests to the right specialist. They are:\n");
    let mut names = Vec::new();
    for agent in answering_agents(registry) {
        let summary = agent
            .description
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        prompt.push_str(&format!("- {}: {summary}\n", agent.name));
        names.push(agent.name.as_str());
    }
    prompt.push_str(&format!(
        "Which specialist should handle this request? Answer with one word: {}.",
        names.join(", ")
    ));
    prompt
}

/// The softmax of each label's log-probability among the labels; agents sharing a first token
/// split its share.
fn softmax_scores(labels: &[Label], scored: &[(u32, f32)]) -> BTreeMap<AgentId, f32> {
    let logprob = |token| {
        scored
            .iter()
            .find(|(t, _)| *t == token)
            .map_or(f32::NEG_INFINITY, |(_, lp)| *lp)
    };
    let mut distinct: Vec<u32> = labels.iter().map(|l| l.token).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let max = distinct
        .iter()
        .map(|&t| logprob(t))
        .fold(f32::NEG_INFINITY, f32::max);
    let weight = |t| {
        if max.is_finite() {
            (logprob(t) - max).exp()
        } else {
            1.0
        }
    };
    let total: f32 = distinct.iter().map(|&t| weight(t)).sum();
    labels
        .iter()
        .map(|label| {
            let sharing = labels.iter().filter(|l| l.token == label.token).count();
            let score = weight(label.token) / total / sharing as f32;
            (label.agent.clone(), score)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use engine::{EngineConfig, EngineHandle};

    use super::*;
    use crate::route::test_support::default_registry;

    fn label(agent: &str, token: u32) -> Label {
        Label {
            agent: AgentId::new(agent).unwrap(),
            token,
        }
    }

    #[test]
    fn scores_are_a_softmax_over_the_labels() {
        let labels = [label("coder", 1), label("math", 2), label("maths", 2)];
        let scored = [(1, (0.6f32).ln()), (2, (0.2f32).ln())];
        let scores = softmax_scores(&labels, &scored);
        assert!((scores["coder"] - 0.75).abs() < 1e-6, "{scores:?}");
        assert!((scores["math"] - 0.125).abs() < 1e-6);
        assert!((scores["maths"] - 0.125).abs() < 1e-6);
        // Nothing scored: no preference.
        let flat = softmax_scores(&labels[..2], &[]);
        assert_eq!(flat["coder"], 0.5);
    }

    #[test]
    fn the_default_router_prompt_is_used_and_a_new_agent_gets_a_generated_one() {
        let mut registry = default_registry();
        let prompt = system_prompt(&registry);
        assert!(prompt.starts_with("You route requests"));
        assert!(prompt.contains("- coder: programming"));
        let mut poet = crate::AgentSpec::new(AgentId::new("poet").unwrap(), AgentKind::Specialist);
        poet.description = "Poems on request.".into();
        poet.routing_examples = vec!["a".into(), "b".into(), "c".into()];
        registry.add(poet).unwrap();
        let prompt = system_prompt(&registry);
        assert!(prompt.contains("- poet: Poems on request.\n"), "{prompt}");
        assert!(prompt.ends_with("coder, general, math, poet, support, writer."));
    }

    #[test]
    fn the_real_model_names_a_valid_agent_with_scores_for_all() {
        let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let engine = EngineHandle::start(&EngineConfig {
            model,
            kv_cache_mb: 64,
            ..EngineConfig::default()
        })
        .expect("run `make models` first");
        let registry = default_registry();
        let router = LlmRouter::new(0.05);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let route = runtime
            .block_on(router.route(
                &engine,
                &registry,
                "Write a Python function that reverses a list.",
            ))
            .unwrap();
        assert_eq!(route.strategy, RoutingStrategy::Llm);
        let names: Vec<_> = route.scores.keys().map(AgentId::as_str).collect();
        assert_eq!(
            names,
            ["analyst", "coder", "general", "math", "support", "writer"]
        );
        let total: f32 = route.scores.values().sum();
        assert!((total - 1.0).abs() < 1e-4, "{route:?}");
        assert!(route.scores.values().all(|s| s.is_finite() && *s >= 0.0));
        assert!(registry.get(route.agent.as_str()).is_some());
        // The scores are the model's: not all equal.
        let max = route.scores.values().cloned().fold(0.0, f32::max);
        assert!(max > 1.0 / 6.0 + 0.01, "{route:?}");
    }
}

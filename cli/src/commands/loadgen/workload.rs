//! What the load generator sends: each scenario's prompts, and the chat completion bodies
//! built from them once, before the run, so that building them costs nothing while it is timed.
//!
//! Request `i` of a level sends prompt `i` modulo the set, so every level sends the same mix in
//! the same order.

use clap::ValueEnum;
use serde_json::json;

use crate::commands::CHAT_QUESTIONS;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Short, varied chat turns to one model (`--model`, default `default`).
    Chat,
    /// Questions for different specialists through `model: "swarm"`, which routes each one.
    Agents,
    /// Agent runs of several turns each: tool call, tool pause, follow-up with the result
    /// (`--runs`, `--turns`, `--pause-median-secs`); see `tool_agents`.
    ToolAgents,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Agents => "agents",
            Self::ToolAgents => "tool-agents",
        }
    }

    /// The model requests name unless `--model` says otherwise.
    pub fn default_model(self) -> &'static str {
        match self {
            Self::Chat | Self::ToolAgents => "default",
            Self::Agents => "swarm",
        }
    }

    fn prompts(self) -> &'static [&'static str] {
        match self {
            Self::Chat | Self::ToolAgents => &CHAT_QUESTIONS,
            Self::Agents => &AGENT_QUESTIONS,
        }
    }
}

/// One question for each specialist in turn (code, maths, writing, customer support, data
/// analysis), so that any run of five or more requests reaches all of them.
const AGENT_QUESTIONS: [&str; 15] = [
    "Write a Rust function that merges two sorted vectors into one sorted vector.",
    "Solve for x: 3x + 7 = 2x - 5, then check the answer.",
    "Write a four-line poem about a lighthouse keeper's last night on duty.",
    "My parcel shows as delivered but it is not at my door. What should I do?",
    "Weekly active users fell 12% after our redesign. How would you find out why?",
    "Why does my Go program deadlock when two goroutines send on the same unbuffered channel?",
    "What is the probability of rolling at least one six in four throws of a fair die?",
    "Rewrite this to sound warmer: 'Your request has been received and will be processed.'",
    "I forgot my password and the reset email never arrives. Can you help?",
    "Which chart best compares monthly revenue across five regions over two years?",
    "Explain what this shell line does: find . -name '*.log' -mtime +7 -delete",
    "Integrate x times e to the x with respect to x.",
    "Draft a short toast for a colleague who retires after thirty years.",
    "How do I cancel my subscription before the next billing date?",
    "Variant B converted 4.1% of 20,000 visitors and A 3.8% of 20,000. Is B really better?",
];

/// The request bodies of a run, serialized.
pub struct Workload {
    bodies: Vec<String>,
}

impl Workload {
    pub fn new(scenario: Scenario, model: &str, max_tokens: usize, stream: bool) -> Self {
        let bodies = scenario
            .prompts()
            .iter()
            .map(|prompt| {
                let mut body = json!({
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": stream,
                });
                if stream {
                    // Without it a stream carries no token counts.
                    body["stream_options"] = json!({"include_usage": true});
                }
                body.to_string()
            })
            .collect();
        Self { bodies }
    }

    /// The body of request `i`.
    pub fn body(&self, i: usize) -> &str {
        &self.bodies[i % self.bodies.len()]
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::{Scenario, Workload};

    fn body(workload: &Workload, i: usize) -> Value {
        serde_json::from_str(workload.body(i)).unwrap()
    }

    #[test]
    fn a_stream_asks_for_usage() {
        let workload = Workload::new(Scenario::Chat, "default", 16, true);
        let first = body(&workload, 0);
        assert_eq!(first["model"], "default");
        assert_eq!(first["max_tokens"], 16);
        assert_eq!(first["stream"], true);
        assert_eq!(first["stream_options"]["include_usage"], true);
        let plain = body(&Workload::new(Scenario::Chat, "m", 16, false), 0);
        assert_eq!(plain["stream"], false);
        assert!(plain.get("stream_options").is_none());
    }

    #[test]
    fn requests_cycle_through_the_prompts() {
        let workload = Workload::new(Scenario::Agents, Scenario::Agents.default_model(), 8, false);
        let n = super::AGENT_QUESTIONS.len();
        assert_eq!(body(&workload, 0)["model"], "swarm");
        assert_eq!(body(&workload, 1), body(&workload, n + 1));
        assert_ne!(body(&workload, 0), body(&workload, 1));
    }
}

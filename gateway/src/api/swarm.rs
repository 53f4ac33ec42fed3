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

/// The `swarm` field of a chat request to the swarm.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[schema(example = json!({"consensus": {"n": 3, "strategy": "majority"}}))]
pub struct SwarmOptions {
    /// Answer with several samples and keep one.
    pub consensus: Option<ConsensusOptions>,
}

/// `swarm.consensus`: `n` samples of the routed agent, or one sample of each named agent, run
/// together; the answer is the majority's or the one the verifier scores best.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct ConsensusOptions {
    /// Samples, 2 to 8; with `agents`, their number (the default).
    #[schema(minimum = 2, maximum = 8)]
    pub n: Option<i64>,
    /// `"majority"` (the default) or `"best_of_verifier"`.
    pub strategy: Option<String>,
    /// Answering agents to ask, one sample each, instead of `n` samples of one agent.
    pub agents: Option<Vec<String>>,
}

/// The `swarm` object of a response: who answered, how the answer was checked, what it cost.
#[derive(Clone, Debug, Default, Serialize, Deserialize, ToSchema)]
pub struct SwarmReport {
    /// The agent whose answer is returned.
    pub agent: String,
    /// The routing decision, when the request named `swarm` (or `auto`) rather than an agent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteResponse>,
    /// Absent only on the first chunk of a `provisional` stream, whose verdict comes last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict: Option<VerdictReport>,
    /// Set when the request asked for consensus.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus: Option<ConsensusReport>,
    /// Every hop's tokens, in the order they ran; `usage` is their sum. Absent where `verdict`
    /// is.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub usage: Vec<HopUsage>,
}

/// The verifier's verdict on the returned answer.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct VerdictReport {
    /// `"passed"`, `"failed"` (released after the last retry, marked), or `"skipped"` (the
    /// agent's policy does not verify).
    pub status: String,
    /// 0 to 1, higher is better: the judge's when it ran, else 1 for a pass and 0 for a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<f32>,
    /// Why the returned answer failed; empty when it passed.
    pub reasons: Vec<String>,
    /// Answers generated, the returned one included: 1 plus retries and escalations.
    pub attempts: u32,
    /// Set when a failed answer was handed to the general agent.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub escalated: bool,
}

/// How the consensus answer was chosen.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct ConsensusReport {
    /// `"majority"` or `"best_of_verifier"`.
    pub strategy: String,
    /// Index in `samples` of the returned answer.
    pub chosen: usize,
    pub samples: Vec<ConsensusSample>,
}

/// One consensus sample.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct ConsensusSample {
    pub agent: String,
    pub content: String,
    /// Samples whose normalised answer equals this one's, this one included.
    pub votes: usize,
    /// The verifier's score (`best_of_verifier` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<f32>,
}

/// The tokens one hop of a swarm request read and wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HopUsage {
    /// `"route"`, `"generate"` or `"verify"`.
    pub hop: String,
    /// The agent that ran the hop (`router` and `verifier` for the system hops).
    pub agent: String,
    /// Which answer the hop belongs to: 1 for the first, higher for retries, escalations and
    /// consensus samples; 0 for routing.
    pub attempt: u32,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

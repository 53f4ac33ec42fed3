//! One agent's definition: who it is, what it handles, which model runs it, how it samples, what
//! it may spend, and how its answers are checked.
//!
//! [`AgentSpec`] is what one `[[agents]]` table of the swarm file deserializes into. Parsing
//! checks the shape (types, unknown fields, the name's alphabet); [`AgentSpec::validate`] checks
//! the values, and the registry refuses an agent that fails it, so every agent a registry holds is
//! valid. Errors name the agent and the field.
//!
//! Invariants: an [`AgentId`] is 1 to 32 characters of `[a-z0-9_-]`; a [`ModelId`] is non-empty
//! and has no whitespace. This module judges one agent at a time: rules that involve several
//! agents (one fallback, a verifier for judged answers) belong to the registry.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::{Result, RouterError};

/// Names appear in URLs, metric labels and as the one-word labels the routing model scores, so
/// they stay short, lowercase and free of spaces and punctuation.
fn check_agent_id(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > AgentId::MAX_LEN {
        return Err("an agent name has 1 to 32 characters");
    }
    if !name
        .bytes()
        .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'))
    {
        return Err("an agent name has only lowercase letters, digits, `_` and `-`");
    }
    Ok(())
}

validated_name!(
    /// An agent's name, unique in the swarm.
    AgentId,
    "agent name",
    check_agent_id
);

impl AgentId {
    pub const MAX_LEN: usize = 32;
}

fn check_model_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() || id.chars().any(char::is_whitespace) {
        return Err("a model id is non-empty and has no whitespace");
    }
    Ok(())
}

validated_name!(
    /// A model as the engine names it: the model file's name without extension
    /// (`SmolLM2-135M-Instruct.Q4_1`), or [`ModelId::DEFAULT`] for whichever model is served.
    ModelId,
    "model id",
    check_model_id
);

impl ModelId {
    /// The alias for the served model, so a swarm file need not change when the model does.
    pub const DEFAULT: &'static str = "default";

    pub fn is_default(&self) -> bool {
        self.0 == Self::DEFAULT
    }
}

impl Default for ModelId {
    fn default() -> Self {
        Self(Self::DEFAULT.to_owned())
    }
}

/// What part an agent plays in the swarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AgentKind {
    /// Answers the requests routed to it for its domain.
    Specialist,
    /// Answers whatever no specialist claims; the swarm has exactly one.
    General,
    /// System agent: scores which agent should take a request; never answers users.
    Router,
    /// System agent: judges whether an answer answers the question; never answers users.
    Verifier,
}

impl AgentKind {
    /// System agents serve the swarm itself: they are never routed to and their outputs are
    /// labels and verdicts, not answers.
    pub fn is_system(self) -> bool {
        matches!(self, Self::Router | Self::Verifier)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Specialist => "specialist",
            Self::General => "general",
            Self::Router => "router",
            Self::Verifier => "verifier",
        }
    }
}

impl std::fmt::Display for AgentKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An agent's default sampling parameters; a request's own values win, and a field left out
/// here falls back to the engine's default. Ranges follow the OpenAI API, so whatever an agent
/// sets, a request could have set too.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct SamplingDefaults {
    /// 0 to 2; 0 is greedy.
    pub temperature: Option<f32>,
    /// Above 0, at most 1.
    pub top_p: Option<f32>,
    /// At least 1.
    pub top_k: Option<usize>,
    /// 0 to 1.
    pub min_p: Option<f32>,
    /// At least 1.
    pub max_tokens: Option<usize>,
    /// Above 0; 1 is off.
    pub repetition_penalty: Option<f32>,
    /// -2 to 2.
    pub presence_penalty: Option<f32>,
    /// -2 to 2.
    pub frequency_penalty: Option<f32>,
    /// Strings that end the answer.
    pub stop: Option<Vec<String>>,
}

/// Why one field of an agent is refused, before the agent's name is attached.
struct Invalid {
    field: &'static str,
    reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Invalid {
    Invalid {
        field,
        reason: reason.into(),
    }
}

/// `Ok` when `value` is absent or `within` accepts it; NaN is never accepted because every
/// comparison with it is false.
fn check_f32(
    field: &'static str,
    value: Option<f32>,
    within: impl Fn(f32) -> bool,
    range: &str,
) -> Result<(), Invalid> {
    match value {
        Some(v) if !within(v) => Err(invalid(field, format!("{v} is outside {range}"))),
        _ => Ok(()),
    }
}

impl SamplingDefaults {
    fn validate(&self) -> Result<(), Invalid> {
        check_f32(
            "sampling.temperature",
            self.temperature,
            |v| (0.0..=2.0).contains(&v),
            "0..=2",
        )?;
        check_f32(
            "sampling.top_p",
            self.top_p,
            |v| v > 0.0 && v <= 1.0,
            "(0, 1]",
        )?;
        check_f32(
            "sampling.min_p",
            self.min_p,
            |v| (0.0..=1.0).contains(&v),
            "0..=1",
        )?;
        check_f32(
            "sampling.repetition_penalty",
            self.repetition_penalty,
            |v| v > 0.0 && v.is_finite(),
            "(0, inf)",
        )?;
        check_f32(
            "sampling.presence_penalty",
            self.presence_penalty,
            |v| (-2.0..=2.0).contains(&v),
            "-2..=2",
        )?;
        check_f32(
            "sampling.frequency_penalty",
            self.frequency_penalty,
            |v| (-2.0..=2.0).contains(&v),
            "-2..=2",
        )?;
        if self.top_k == Some(0) {
            return Err(invalid(
                "sampling.top_k",
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if self.max_tokens == Some(0) {
            return Err(invalid("sampling.max_tokens", "must be at least 1"));
        }
        if let Some(stop) = &self.stop {
            if stop.iter().any(String::is_empty) {
                return Err(invalid("sampling.stop", "a stop string is never empty"));
            }
        }
        Ok(())
    }
}

/// What to do with an answer that fails its checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// Generate again, up to `max_retries` times, then release the last answer marked.
    #[default]
    Retry,
    /// Hand the request to the general fallback agent.
    EscalateToGeneral,
    /// Release the answer as it is, marked as having failed verification.
    ReleaseMarked,
}

/// How a streamed answer meets verification.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum StreamMode {
    /// Hold the stream until the answer has passed: the client never sees a rejected answer,
    /// at the cost of time to first token.
    #[default]
    Buffer,
    /// Stream as generated and send the verdict at the end: fast, but a rejected answer has
    /// already been shown.
    Provisional,
}

/// The checks run on an answer. The first three are cheap and on by default; `judge` asks the
/// verifier agent and costs a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct VerifierChecks {
    /// The answer has visible text.
    pub non_empty: bool,
    /// The answer ended on its own, not by hitting `max_tokens`.
    pub not_truncated: bool,
    /// The answer does not loop on the same phrase.
    pub no_degenerate_repetition: bool,
    /// The answer parses as JSON.
    pub json: bool,
    /// The answer is in this language (ISO 639 code, e.g. `en`); absent, in the question's
    /// language, when the verifier can tell both.
    pub language: Option<String>,
    /// The answer matches this regular expression.
    pub regex: Option<String>,
    /// The verifier agent judges that the answer answers the question.
    pub judge: bool,
    /// The answer is about what the question asked.
    pub relevance: bool,
}

impl Default for VerifierChecks {
    fn default() -> Self {
        Self {
            non_empty: true,
            not_truncated: true,
            no_degenerate_repetition: true,
            json: false,
            language: None,
            regex: None,
            judge: false,
            relevance: false,
        }
    }
}

/// How an agent's answers are verified before they reach the user.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct VerifierPolicy {
    pub enabled: bool,
    pub checks: VerifierChecks,
    /// Generations after the first when `on_failure` is `retry`.
    pub max_retries: u8,
    pub on_failure: OnFailure,
    pub stream_mode: StreamMode,
}

impl Default for VerifierPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            checks: VerifierChecks::default(),
            max_retries: 1,
            on_failure: OnFailure::Retry,
            stream_mode: StreamMode::Buffer,
        }
    }
}

impl VerifierPolicy {
    /// Each retry is a whole generation, so more than a few multiply cost and latency for
    /// little gain.
    pub const MAX_RETRIES: u8 = 5;

    fn validate(&self, kind: AgentKind) -> Result<(), Invalid> {
        if self.on_failure == OnFailure::Retry && self.max_retries == 0 {
            return Err(invalid(
                "verifier.max_retries",
                "on_failure = \"retry\" needs at least 1 retry",
            ));
        }
        if self.max_retries > Self::MAX_RETRIES {
            return Err(invalid(
                "verifier.max_retries",
                format!("{} is more than {}", self.max_retries, Self::MAX_RETRIES),
            ));
        }
        if kind == AgentKind::General && self.on_failure == OnFailure::EscalateToGeneral {
            return Err(invalid(
                "verifier.on_failure",
                "the general agent is the fallback: it cannot escalate to itself",
            ));
        }
        if let Some(language) = &self.checks.language {
            let is_code = (2..=3).contains(&language.len())
                && language.bytes().all(|b| b.is_ascii_lowercase());
            if !is_code {
                return Err(invalid(
                    "verifier.checks.language",
                    format!("{language:?} is not an ISO 639 code such as \"en\" or \"fr\""),
                ));
            }
        }
        if let Some(pattern) = &self.checks.regex {
            regex::Regex::new(pattern)
                .map_err(|e| invalid("verifier.checks.regex", e.to_string()))?;
        }
        Ok(())
    }
}

/// One agent of the swarm, as written in the swarm file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AgentSpec {
    pub name: AgentId,
    #[serde(default = "default_kind")]
    pub kind: AgentKind,
    /// What the agent handles, in a sentence or two; routing compares requests with it.
    #[serde(default)]
    pub description: String,
    /// Requests this agent should receive, as users write them.
    #[serde(default)]
    pub routing_examples: Vec<String>,
    #[serde(default)]
    pub model: ModelId,
    #[serde(default)]
    pub system_prompt: String,
    #[serde(default)]
    pub sampling: SamplingDefaults,
    /// Scheduling class: higher is served first under load.
    #[serde(default)]
    pub priority: i32,
    /// Most tokens (prompt and completion) the agent may spend per minute; absent is unlimited.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Tokens of KV cache set aside for this agent on the device that hosts its model.
    #[serde(default = "default_kv_reserve_tokens")]
    pub kv_reserve_tokens: u64,
    /// How answers are checked; absent means [`VerifierPolicy::default`] for agents that answer
    /// users, and must be absent for system agents (see [`AgentSpec::verifier_policy`]).
    #[serde(default)]
    pub verifier: Option<VerifierPolicy>,
    /// Functions the agent may call when a request brings none: OpenAI `tools` entries
    /// (`{"type": "function", "function": {...}}`), checked like a request's.
    #[serde(default)]
    pub tools: Vec<serde_json::Value>,
    /// The answer's shape when a request sets none: an OpenAI `response_format` object.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
}

fn default_kind() -> AgentKind {
    AgentKind::Specialist
}

fn default_kv_reserve_tokens() -> u64 {
    AgentSpec::DEFAULT_KV_RESERVE_TOKENS
}

impl AgentSpec {
    /// Routing by similarity needs a few phrasings to triangulate a domain; one or two examples
    /// make the route hinge on their wording.
    pub const MIN_ROUTING_EXAMPLES: usize = 3;

    /// What every prompt of this agent starts with: its system prompt alone, rendered by
    /// `model`'s chat template (no generation header) and encoded as chat requests are. Chat
    /// requests answered by the agent put this system message first, so their token ids begin
    /// with these, and a pin of them keeps that prefix warm ([`crate::pins`]). `None` for an
    /// agent without a system prompt.
    pub fn system_prefix(&self, model: &engine::ModelInfo) -> Option<engine::Result<Vec<u32>>> {
        if self.system_prompt.trim().is_empty() {
            return None;
        }
        let system = [engine::ChatMessage::new(
            "system",
            self.system_prompt.as_str(),
        )];
        Some(
            model
                .encode_chat(&system, false)
                .map(|prompt| prompt.tokens),
        )
    }
    /// Room for a long system prompt, a few turns of conversation and an answer.
    pub const DEFAULT_KV_RESERVE_TOKENS: u64 = 4096;

    /// An agent with every optional field at its default; the swarm file is the usual way to
    /// make agents, this is for code that builds them.
    pub fn new(name: AgentId, kind: AgentKind) -> Self {
        Self {
            name,
            kind,
            description: String::new(),
            routing_examples: Vec::new(),
            model: ModelId::default(),
            system_prompt: String::new(),
            sampling: SamplingDefaults::default(),
            priority: 0,
            tokens_per_minute: None,
            kv_reserve_tokens: Self::DEFAULT_KV_RESERVE_TOKENS,
            verifier: None,
            tools: Vec::new(),
            response_format: None,
        }
    }

    /// Whether this agent runs on the model served as `model_id` (an agent on the `default`
    /// model runs on whichever model is served).
    pub fn runs_on(&self, model_id: &str) -> bool {
        self.model.is_default() || self.model.as_str() == model_id
    }

    /// The model among `served` (an engine's, the default first) this agent runs on: the
    /// default for an agent on `default`; `None` when its model is not among them.
    pub fn model_among<'a>(
        &self,
        served: &'a [engine::ModelInfo],
    ) -> Option<&'a engine::ModelInfo> {
        served.iter().find(|m| self.runs_on(&m.id))
    }

    /// The policy the verifier applies to this agent's answers: none for system agents, the
    /// default when the swarm file gives none.
    pub fn verifier_policy(&self) -> Option<VerifierPolicy> {
        if self.kind.is_system() {
            return None;
        }
        Some(self.verifier.clone().unwrap_or_default())
    }

    /// Checks every field's value and the rules between fields of this agent.
    pub fn validate(&self) -> Result<()> {
        self.check()
            .map_err(|Invalid { field, reason }| RouterError::InvalidAgent {
                agent: self.name.clone(),
                field,
                reason,
            })
    }

    fn check(&self) -> Result<(), Invalid> {
        match self.kind {
            AgentKind::Specialist => {
                if self.description.trim().is_empty() {
                    return Err(invalid(
                        "description",
                        "a specialist needs one: routing compares requests with it",
                    ));
                }
                if self.routing_examples.len() < Self::MIN_ROUTING_EXAMPLES {
                    return Err(invalid(
                        "routing_examples",
                        format!(
                            "a specialist needs at least {}, it has {}",
                            Self::MIN_ROUTING_EXAMPLES,
                            self.routing_examples.len()
                        ),
                    ));
                }
            }
            AgentKind::General => {}
            AgentKind::Router | AgentKind::Verifier => {
                if !self.routing_examples.is_empty() {
                    return Err(invalid(
                        "routing_examples",
                        "system agents are never routed to",
                    ));
                }
                if self.system_prompt.trim().is_empty() {
                    return Err(invalid(
                        "system_prompt",
                        format!("the {} agent's prompt defines its task", self.kind),
                    ));
                }
                if self.verifier.is_some() {
                    return Err(invalid(
                        "verifier",
                        "system agents answer with labels and verdicts that are parsed, not \
                         verified: remove this table",
                    ));
                }
            }
        }
        let mut seen = BTreeSet::new();
        for example in &self.routing_examples {
            let normalized = example.trim().to_lowercase();
            if normalized.is_empty() {
                return Err(invalid("routing_examples", "an example is never blank"));
            }
            if !seen.insert(normalized) {
                return Err(invalid(
                    "routing_examples",
                    format!("{example:?} is listed twice"),
                ));
            }
        }
        self.sampling.validate()?;
        if self.tokens_per_minute == Some(0) {
            return Err(invalid(
                "tokens_per_minute",
                "0 would refuse every request (leave it out for no limit)",
            ));
        }
        if self.kv_reserve_tokens == 0 {
            return Err(invalid(
                "kv_reserve_tokens",
                "an agent needs KV room for at least one token",
            ));
        }
        if let Some(policy) = &self.verifier {
            policy.validate(self.kind)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id(name: &str) -> AgentId {
        AgentId::new(name).unwrap()
    }

    /// A specialist that passes validation, to break one field at a time.
    fn specialist() -> AgentSpec {
        AgentSpec {
            description: "Answers questions about birds.".into(),
            routing_examples: vec![
                "what do robins eat".into(),
                "how far do swallows migrate".into(),
                "identify this bird call".into(),
            ],
            ..AgentSpec::new(id("birds"), AgentKind::Specialist)
        }
    }

    fn field_of(spec: &AgentSpec) -> &'static str {
        match spec.validate() {
            Err(RouterError::InvalidAgent { agent, field, .. }) => {
                assert_eq!(agent, spec.name);
                field
            }
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    proptest! {
        #[test]
        fn agent_ids_of_the_allowed_alphabet_are_accepted(name in "[a-z0-9_-]{1,32}") {
            let id = AgentId::new(name.clone()).unwrap();
            prop_assert_eq!(id.as_str(), name.as_str());
        }

        #[test]
        fn agent_ids_with_any_other_character_are_refused(
            prefix in "[a-z0-9_-]{0,10}",
            bad in "[^a-z0-9_-]",
            suffix in "[a-z0-9_-]{0,10}",
        ) {
            let refused = AgentId::new(format!("{prefix}{bad}{suffix}")).is_err();
            prop_assert!(refused);
        }
    }

    #[test]
    fn agent_ids_are_1_to_32_characters() {
        assert!(AgentId::new("").is_err());
        assert!(AgentId::new("a".repeat(32)).is_ok());
        let err = AgentId::new("a".repeat(33)).unwrap_err().to_string();
        assert!(err.contains("agent name"), "{err}");
    }

    #[test]
    fn model_ids_refuse_blank_and_whitespace() {
        assert!(ModelId::new("SmolLM2-135M-Instruct.Q4_1").is_ok());
        assert!(ModelId::new("").is_err());
        assert!(ModelId::new("two words").is_err());
        assert!(ModelId::default().is_default());
    }

    #[test]
    fn a_minimal_agent_gets_the_documented_defaults() {
        let spec: AgentSpec = toml::from_str(
            r#"
            name = "birds"
            description = "Answers questions about birds."
            routing_examples = ["a", "b", "c"]
            "#,
        )
        .unwrap();
        assert_eq!(spec.kind, AgentKind::Specialist);
        assert!(spec.model.is_default());
        assert_eq!(spec.kv_reserve_tokens, 4096);
        assert_eq!(spec.priority, 0);
        assert_eq!(spec.verifier_policy(), Some(VerifierPolicy::default()));
        let policy = VerifierPolicy::default();
        assert!(policy.enabled && policy.checks.non_empty && !policy.checks.judge);
        assert_eq!(policy.max_retries, 1);
        spec.validate().unwrap();
    }

    #[test]
    fn every_field_parses_from_toml() {
        let spec: AgentSpec = toml::from_str(
            r#"
            name = "coder"
            kind = "specialist"
            description = "Writes and fixes code."
            routing_examples = ["fix this loop", "write a sql join", "explain this stack trace"]
            model = "SmolLM2-135M-Instruct.Q4_1"
            system_prompt = "You are a careful programmer."
            priority = 5
            tokens_per_minute = 60000
            kv_reserve_tokens = 8192

            [sampling]
            temperature = 0.2
            top_p = 0.9
            top_k = 40
            min_p = 0.05
            max_tokens = 1024
            repetition_penalty = 1.1
            presence_penalty = 0.5
            frequency_penalty = -0.5
            stop = ["</code>"]

            [verifier]
            enabled = true
            max_retries = 2
            on_failure = "escalate_to_general"
            stream_mode = "provisional"

            [verifier.checks]
            non_empty = true
            not_truncated = false
            no_degenerate_repetition = true
            json = true
            language = "en"
            regex = "^\\{"
            judge = true
            relevance = true
            "#,
        )
        .unwrap();
        spec.validate().unwrap();
        assert_eq!(spec.sampling.top_k, Some(40));
        assert_eq!(spec.tokens_per_minute, Some(60000));
        let policy = spec.verifier_policy().unwrap();
        assert_eq!(policy.on_failure, OnFailure::EscalateToGeneral);
        assert_eq!(policy.stream_mode, StreamMode::Provisional);
        assert_eq!(policy.checks.language.as_deref(), Some("en"));
        assert!(policy.checks.judge && !policy.checks.not_truncated);
        // What serializes parses back to the same agent.
        let again: AgentSpec = toml::from_str(&toml::to_string(&spec).unwrap()).unwrap();
        assert_eq!(again, spec);
    }

    #[test]
    fn unknown_fields_are_refused_at_every_level() {
        for text in [
            "name = \"a\"\ntemprature = 0.1",
            "name = \"a\"\n[sampling]\ntemprature = 0.1",
            "name = \"a\"\n[verifier]\nretries = 2",
            "name = \"a\"\n[verifier.checks]\nspelling = true",
        ] {
            let err = toml::from_str::<AgentSpec>(text).unwrap_err().to_string();
            assert!(err.contains("unknown field"), "{text}: {err}");
        }
    }

    #[test]
    fn an_invalid_name_is_refused_while_parsing() {
        let err = toml::from_str::<AgentSpec>("name = \"Coder\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("lowercase"), "{err}");
    }

    #[test]
    fn specialists_need_a_description_and_three_examples() {
        let mut spec = specialist();
        spec.description = "  ".into();
        assert_eq!(field_of(&spec), "description");
        let mut spec = specialist();
        spec.routing_examples.pop();
        assert_eq!(field_of(&spec), "routing_examples");
        let err = spec.validate().unwrap_err().to_string();
        assert!(err.starts_with("agent `birds`: routing_examples:"), "{err}");
    }

    #[test]
    fn routing_examples_are_neither_blank_nor_repeated() {
        let mut spec = specialist();
        spec.routing_examples.push(" ".into());
        assert_eq!(field_of(&spec), "routing_examples");
        let mut spec = specialist();
        spec.routing_examples.push("What do robins eat ".into());
        assert_eq!(field_of(&spec), "routing_examples");
    }

    #[test]
    fn system_agents_need_a_prompt_and_take_no_examples_or_verifier() {
        let system = || AgentSpec {
            system_prompt: "Answer yes or no.".into(),
            ..AgentSpec::new(id("verifier"), AgentKind::Verifier)
        };
        system().validate().unwrap();
        assert_eq!(system().verifier_policy(), None);
        let mut spec = system();
        spec.system_prompt.clear();
        assert_eq!(field_of(&spec), "system_prompt");
        let mut spec = system();
        spec.routing_examples = vec!["x".into()];
        assert_eq!(field_of(&spec), "routing_examples");
        let mut spec = system();
        spec.verifier = Some(VerifierPolicy::default());
        assert_eq!(field_of(&spec), "verifier");
    }

    #[test]
    fn sampling_values_outside_their_ranges_name_their_field() {
        type BreakIt = fn(&mut SamplingDefaults);
        let cases: [(BreakIt, &str); 9] = [
            (|s| s.temperature = Some(2.5), "sampling.temperature"),
            (|s| s.temperature = Some(f32::NAN), "sampling.temperature"),
            (|s| s.top_p = Some(0.0), "sampling.top_p"),
            (|s| s.min_p = Some(1.5), "sampling.min_p"),
            (
                |s| s.repetition_penalty = Some(0.0),
                "sampling.repetition_penalty",
            ),
            (
                |s| s.presence_penalty = Some(-3.0),
                "sampling.presence_penalty",
            ),
            (
                |s| s.frequency_penalty = Some(2.1),
                "sampling.frequency_penalty",
            ),
            (|s| s.top_k = Some(0), "sampling.top_k"),
            (|s| s.max_tokens = Some(0), "sampling.max_tokens"),
        ];
        for (break_it, field) in cases {
            let mut spec = specialist();
            break_it(&mut spec.sampling);
            assert_eq!(field_of(&spec), field);
        }
    }

    #[test]
    fn budgets_are_positive() {
        let mut spec = specialist();
        spec.tokens_per_minute = Some(0);
        assert_eq!(field_of(&spec), "tokens_per_minute");
        let mut spec = specialist();
        spec.kv_reserve_tokens = 0;
        assert_eq!(field_of(&spec), "kv_reserve_tokens");
    }

    #[test]
    fn verifier_policies_are_consistent() {
        let with = |policy: VerifierPolicy| AgentSpec {
            verifier: Some(policy),
            ..specialist()
        };
        let retry_none = with(VerifierPolicy {
            max_retries: 0,
            ..VerifierPolicy::default()
        });
        assert_eq!(field_of(&retry_none), "verifier.max_retries");
        let release_none = with(VerifierPolicy {
            max_retries: 0,
            on_failure: OnFailure::ReleaseMarked,
            ..VerifierPolicy::default()
        });
        release_none.validate().unwrap();
        let too_many = with(VerifierPolicy {
            max_retries: VerifierPolicy::MAX_RETRIES + 1,
            ..VerifierPolicy::default()
        });
        assert_eq!(field_of(&too_many), "verifier.max_retries");
        let checks = |checks: VerifierChecks| {
            with(VerifierPolicy {
                checks,
                ..VerifierPolicy::default()
            })
        };
        let bad_regex = checks(VerifierChecks {
            regex: Some("(unclosed".into()),
            ..VerifierChecks::default()
        });
        assert_eq!(field_of(&bad_regex), "verifier.checks.regex");
        let bad_language = checks(VerifierChecks {
            language: Some("English".into()),
            ..VerifierChecks::default()
        });
        assert_eq!(field_of(&bad_language), "verifier.checks.language");
    }

    #[test]
    fn the_general_agent_cannot_escalate_to_itself() {
        let spec = AgentSpec {
            verifier: Some(VerifierPolicy {
                on_failure: OnFailure::EscalateToGeneral,
                ..VerifierPolicy::default()
            }),
            ..AgentSpec::new(id("general"), AgentKind::General)
        };
        assert_eq!(field_of(&spec), "verifier.on_failure");
    }
}

//! Scheduling fields and agent hints: `priority` (vLLM's: lower runs first) and the hints object
//! (`swarmgate`, or `agent_hints` as NVIDIA Dynamo names it), checked against the server's and
//! the API key's bounds, and what they make of the engine request: its priority, expected output,
//! and how long its KV blocks stay held after it ends.

use engine::{GenerateRequest, Retention};

use crate::api::{AgentHints, GenerationOptions};
use crate::error::ApiError;

/// The most extreme `priority` a request may give, either way.
pub const MAX_PRIORITY: i64 = 1_000_000;

/// What a caller may ask of scheduling and caching.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HintLimits {
    /// The most urgent (lowest) `priority` the caller may ask for; `None`: any.
    pub min_priority: Option<i64>,
    /// The longest `cache_ttl_secs`.
    pub max_cache_ttl_secs: f64,
    /// The longest a turn that ended in tool calls is held for its follow-up (the engine picks
    /// the time within it); 0: not held.
    pub tool_kv_ttl_max_secs: f64,
}

impl Default for HintLimits {
    fn default() -> Self {
        Self {
            min_priority: None,
            max_cache_ttl_secs: 300.0,
            tool_kv_ttl_max_secs: 30.0,
        }
    }
}

/// A request's hints, checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hints {
    /// Lower runs first.
    pub priority: i64,
    pub osl: Option<usize>,
    pub speculative_prefill: bool,
    pub cache_ttl_secs: Option<f64>,
    /// The bound on holding a tool-call turn (the caller's allowance).
    pub tool_kv_ttl_max_secs: f64,
}

impl Hints {
    /// Checks `options`' `priority` and hints against `limits`.
    pub fn new(options: &GenerationOptions, limits: &HintLimits) -> Result<Self, ApiError> {
        let (field, given) = match (&options.swarmgate, &options.agent_hints) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "agent_hints",
                    "give the hints once: as swarmgate or as agent_hints, not both",
                ))
            }
            (Some(h), None) => ("swarmgate", h.clone()),
            (None, Some(h)) => ("agent_hints", h.clone()),
            (None, None) => ("swarmgate", AgentHints::default()),
        };
        let priority = match (options.priority, given.priority) {
            (Some(a), Some(b)) if a != b => {
                return Err(ApiError::invalid(
                    format!("{field}.priority"),
                    format!("{field}.priority ({b}) contradicts priority ({a})"),
                ))
            }
            (Some(p), _) => ("priority".to_owned(), p),
            (None, Some(p)) => (format!("{field}.priority"), p),
            (None, None) => ("priority".to_owned(), 0),
        };
        let (param, priority) = priority;
        if !(-MAX_PRIORITY..=MAX_PRIORITY).contains(&priority) {
            return Err(ApiError::invalid(
                &param,
                format!(
                    "{param} must be between -{MAX_PRIORITY} and {MAX_PRIORITY}; got {priority}"
                ),
            ));
        }
        if let Some(min) = limits.min_priority.filter(|&min| priority < min) {
            return Err(ApiError::invalid(
                &param,
                format!(
                    "{param} {priority} is more urgent than this API key may ask for: its \
                     requests run at priority {min} or later"
                ),
            ));
        }
        let osl = match given.osl {
            Some(n) if !(1..=i64::from(u32::MAX)).contains(&n) => {
                return Err(ApiError::invalid(
                    format!("{field}.osl"),
                    format!("{field}.osl must be a positive number of tokens; got {n}"),
                ))
            }
            n => n.map(|n| n as usize),
        };
        let max_ttl = limits.max_cache_ttl_secs;
        let cache_ttl_secs = match given.cache_ttl_secs {
            Some(t) if !(t.is_finite() && (0.0..=max_ttl).contains(&t)) => {
                return Err(ApiError::invalid(
                    format!("{field}.cache_ttl_secs"),
                    format!(
                        "{field}.cache_ttl_secs must be between 0 and {max_ttl} seconds for this \
                         API key; got {t}"
                    ),
                ))
            }
            t => t,
        };
        Ok(Self {
            priority,
            osl,
            speculative_prefill: given.speculative_prefill.unwrap_or(false),
            cache_ttl_secs,
            tool_kv_ttl_max_secs: limits.tool_kv_ttl_max_secs,
        })
    }

    /// Sets what the hints decide of `request`: its priority (the engine's classes run higher
    /// first), its expected output, and the hold its prompt and answer get when it ends: for
    /// `cache_ttl_secs`, or, when it answers with tool calls (`tool_calls_open` is the envelope's
    /// opening), for as long as the engine finds it worth it within the tool bound.
    pub fn apply(&self, request: &mut GenerateRequest, tool_calls_open: Option<&str>) {
        // Within ±MAX_PRIORITY: no overflow, whatever class it is added to.
        request.priority = -(self.priority as i32);
        request.expected_output_tokens = self.osl;
        request.retention = match (self.cache_ttl_secs, tool_calls_open) {
            (Some(secs), _) => (secs > 0.0).then_some(Retention {
                if_answer_starts_with: None,
                max_secs: secs,
                adaptive: false,
            }),
            (None, Some(open)) if self.tool_kv_ttl_max_secs > 0.0 => Some(Retention {
                if_answer_starts_with: Some(open.to_owned()),
                max_secs: self.tool_kv_ttl_max_secs,
                adaptive: true,
            }),
            (None, _) => None,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hints(body: serde_json::Value, limits: &HintLimits) -> Result<Hints, ApiError> {
        let options: GenerationOptions = serde_json::from_value(body).unwrap();
        Hints::new(&options, limits)
    }

    fn param(e: ApiError) -> String {
        match e {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("not a 400: {other:?}"),
        }
    }

    #[test]
    fn hints_are_read_under_either_name_and_unknown_ones_are_ignored() {
        let limits = HintLimits::default();
        let body = json!({"swarmgate": {"priority": -2, "osl": 40, "speculative_prefill": true,
            "cache_ttl_secs": 12.5, "future_hint": [1]}});
        let h = hints(body, &limits).unwrap();
        assert_eq!(
            (h.priority, h.osl, h.speculative_prefill),
            (-2, Some(40), true)
        );
        assert_eq!(h.cache_ttl_secs, Some(12.5));
        let h = hints(json!({"agent_hints": {"osl": 7}, "priority": 3}), &limits).unwrap();
        assert_eq!((h.priority, h.osl), (3, Some(7)));
        assert_eq!(
            hints(json!({}), &limits).unwrap(),
            Hints {
                tool_kv_ttl_max_secs: 30.0,
                ..Hints::default()
            }
        );
    }

    #[test]
    fn bad_values_are_400s_naming_the_field() {
        let limits = HintLimits {
            min_priority: Some(0),
            max_cache_ttl_secs: 60.0,
            ..HintLimits::default()
        };
        for (body, field) in [
            (json!({"priority": 2_000_000}), "priority"),
            (json!({"priority": -1}), "priority"),
            (
                json!({"agent_hints": {"priority": -5}}),
                "agent_hints.priority",
            ),
            (
                json!({"priority": 1, "swarmgate": {"priority": 2}}),
                "swarmgate.priority",
            ),
            (json!({"swarmgate": {"osl": 0}}), "swarmgate.osl"),
            (json!({"swarmgate": {"osl": -3}}), "swarmgate.osl"),
            (
                json!({"swarmgate": {"cache_ttl_secs": -1.0}}),
                "swarmgate.cache_ttl_secs",
            ),
            (
                json!({"swarmgate": {"cache_ttl_secs": 61}}),
                "swarmgate.cache_ttl_secs",
            ),
            (json!({"swarmgate": {}, "agent_hints": {}}), "agent_hints"),
        ] {
            let e = hints(body.clone(), &limits).expect_err(&body.to_string());
            assert_eq!(param(e), field, "{body}");
        }
        assert!(hints(json!({"priority": 5}), &limits).is_ok());
    }

    #[test]
    fn hints_shape_the_engine_request() {
        let limits = HintLimits::default();
        let mut request = GenerateRequest::new(engine::Prompt::Tokens(vec![1]));
        let h = hints(json!({"priority": 4, "swarmgate": {"osl": 9}}), &limits).unwrap();
        h.apply(&mut request, Some("{\"tool_calls\""));
        assert_eq!(
            request.priority, -4,
            "lower runs first: the engine's higher"
        );
        assert_eq!(request.expected_output_tokens, Some(9));
        let retention = request.retention.clone().unwrap();
        assert!(retention.adaptive);
        assert_eq!(retention.max_secs, 30.0);
        h.apply(&mut request, None);
        assert_eq!(request.retention, None, "no tools: nothing to wait for");
        let h = hints(json!({"swarmgate": {"cache_ttl_secs": 5}}), &limits).unwrap();
        h.apply(&mut request, Some("{\"tool_calls\""));
        let retention = request.retention.unwrap();
        assert_eq!((retention.max_secs, retention.adaptive), (5.0, false));
        assert_eq!(retention.if_answer_starts_with, None);
    }
}

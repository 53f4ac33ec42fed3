//! The wire format of `POST /v1/swarm/verify`: serde types and nothing else.
//!
//! As for the OpenAI endpoints, the request is lenient (every field optional to serde, unknown
//! fields ignored) so that validation can answer a 400 naming the field at fault.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/swarm/verify`: an answer to check against its question.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[schema(example = json!({
    "question": "What is the capital of France?",
    "answer": "The capital of France is Paris.",
    "requires_json": false
}))]
pub struct VerifyRequest {
    /// The user's question.
    #[schema(required = true)]
    pub question: Option<String>,
    /// The answer to check; an empty answer fails, it is not an invalid request.
    #[schema(required = true)]
    pub answer: Option<String>,
    /// The answer must be one JSON value (the request asked for `response_format` JSON).
    pub requires_json: Option<bool>,
    /// Why generation ended, when known: `"length"` marks the answer as cut.
    pub finish_reason: Option<String>,
    /// The language the answer must be in (ISO 639 code such as `"en"`); absent, the
    /// question's.
    pub language: Option<String>,
}

/// The verifier's decision.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct VerifyResponse {
    /// `"passed"` or `"failed"`.
    pub verdict: &'static str,
    /// 0 to 1, higher is better: the judge's P(yes) when it ran, else 1 for a pass and 0 for a
    /// failure.
    pub score: f32,
    /// Why the answer failed, each starting with its check's code (`empty`, `truncated`,
    /// `repetition`, `refusal`, `invalid_json`, `wrong_language`, `off_topic`, `judge`).
    pub reasons: Vec<String>,
    /// Cosine similarity of the question's and the answer's embeddings, when measured.
    pub relevance: Option<f32>,
    /// How much more likely the generative model finds the answer after this question than
    /// after a neutral one, in nats per answer token, when measured (answers the embeddings
    /// do not place clearly on topic).
    pub grounding: Option<f32>,
}

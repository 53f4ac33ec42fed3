//! `POST /v1/swarm/verify`: runs the verifier alone on a question and an answer and returns its
//! verdict.
//!
//! The checks are [`crate::service::verify`]'s. The request takes one seat in the admission
//! queue, and the judge runs in it, charged to the caller ([`Admission::engine`]).

use axum::extract::State;
use axum::Json;
use router::Candidate;

use crate::api::verify::{VerifyRequest, VerifyResponse};
use crate::error::{ApiError, GenerationErrors};
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::service::verify::{deterministic, similarity};
use crate::service::AppState;
use crate::validate::verify::{validate_verify, ValidVerifyRequest};

/// Checks an answer: deterministic checks, relevance by embeddings and by the answer's grounding
/// in the question, and the verifier agent's judgement read from its log-probabilities.
#[utoipa::path(post, path = "/v1/swarm/verify", tag = "swarm",
    request_body = VerifyRequest,
    responses(
        (status = 200, description = "The verdict; a failed answer is still a 200.",
            body = VerifyResponse),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn verify(
    State(state): State<AppState>,
    admission: Admission,
    ApiJson(request): ApiJson<VerifyRequest>,
) -> Result<Json<VerifyResponse>, ApiError> {
    let ValidVerifyRequest {
        question,
        answer,
        finish_reason,
        checks,
    } = validate_verify(request)?;
    let (question, answer, failures) =
        deterministic(&state, question, answer, finish_reason, &checks).await?;
    let candidate = Candidate {
        question: &question,
        answer: &answer,
        finish_reason,
    };
    let verifier = state.verifier();
    let seats = admission.reserve(&state, 1).await?;
    let engine = admission.engine(&state, &seats, verifier.agent());
    let relevance = match state.embeddings() {
        Some(embeddings) if checks.relevance && failures.is_empty() => {
            Some(similarity(embeddings, &question, &answer).await?.0)
        }
        _ => None,
    };
    let verdict = verifier
        .verify(&engine, &candidate, &checks, failures, relevance)
        .await
        .map_err(|e| engine.explain(e))?;
    Ok(Json(VerifyResponse {
        verdict: if verdict.passed { "passed" } else { "failed" },
        score: verdict.score,
        reasons: verdict.reasons,
        relevance,
        grounding: verdict.grounding,
    }))
}

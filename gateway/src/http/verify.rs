//! `POST /v1/swarm/verify`: runs the verifier alone on a question and an answer and returns its
//! verdict.
//!
//! Relevance is the question's best cosine similarity with the whole answer or one of its first
//! sentences; a JSON answer is also read as its keys and values. The embeddings for it go through [`Embeddings::embed`], so they take their
//! turn with `/v1/embeddings` requests instead of blocking a runtime thread; without an
//! embedding model the relevance check is skipped, not failed. The deterministic checks run
//! first and a failure skips the embedding and the judge. The request takes one seat in the
//! admission queue, and the judge runs in it, charged to the caller ([`Admission::engine`]).

use axum::extract::State;
use axum::Json;
use router::{Candidate, VerifierChecks};

use crate::api::verify::{VerifyRequest, VerifyResponse};
use crate::app::AppState;
use crate::error::{ApiError, GenerationErrors};
use crate::http::embeddings::Embeddings;
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::validate::off_io;
use crate::validate::verify::{validate_verify, ValidVerifyRequest};

/// Checks an answer: deterministic checks, relevance by embeddings, and the verifier agent's
/// judgement read from its log-probabilities.
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
    }))
}

/// The verifier's deterministic checks of `answer` (repetition, JSON, language, regex), on the
/// blocking pool: they read the whole answer, which a client may make megabytes long. Hands the
/// texts back with the failures' reasons. Relevance is measured only when these pass.
pub(crate) async fn deterministic(
    state: &AppState,
    question: String,
    answer: String,
    finish_reason: Option<engine::FinishReason>,
    checks: &VerifierChecks,
) -> Result<(String, String, Vec<String>), ApiError> {
    let state = state.clone();
    let checks = checks.clone();
    off_io(move || {
        let candidate = Candidate {
            question: &question,
            answer: &answer,
            finish_reason,
        };
        let failures = state.verifier().check(&candidate, &checks);
        Ok((question, answer, failures))
    })
    .await
}

/// Sentences of the answer compared with the question, besides the whole answer.
const MAX_PASSAGES: usize = 8;

/// The highest cosine similarity between the question's sentence embedding and the whole
/// answer's (as written, and as prose when it is JSON) or one of its first sentences', and the
/// word pieces the encoder read for it.
pub(crate) async fn similarity(
    embeddings: &Embeddings,
    question: &str,
    answer: &str,
) -> Result<(f32, usize), ApiError> {
    let prose = router::verifier::prose(answer);
    let mut inputs = vec![question.to_owned(), answer.to_owned()];
    if prose != answer {
        inputs.push(prose.clone());
    }
    inputs.extend(
        router::verifier::passages(&prose, MAX_PASSAGES)
            .into_iter()
            .map(str::to_owned),
    );
    let expected = inputs.len();
    let vectors = embeddings.embed(inputs).await?;
    let tokens = vectors.iter().map(|v| v.tokens).sum();
    match vectors.split_first() {
        Some((q, rest)) if vectors.len() == expected => Ok((
            rest.iter()
                .map(|a| router::verifier::cosine(&q.vector, &a.vector))
                .fold(f32::MIN, f32::max),
            tokens,
        )),
        _ => Err(ApiError::Internal(format!(
            "the embedder returned {} vectors for {expected} inputs",
            vectors.len()
        ))),
    }
}

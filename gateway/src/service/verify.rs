//! The verifier's checks as the swarm's pipeline and `POST /v1/swarm/verify` run them.
//!
//! Relevance is the question's best cosine similarity with the whole answer or one of its first
//! sentences; a JSON answer is also read as its keys and values. The embeddings for it go
//! through [`Embeddings::embed`], so they take their turn with `/v1/embeddings` requests
//! instead of blocking a runtime thread; without an embedding model the relevance check is
//! skipped, not failed. The deterministic checks run first and a failure skips the embedding
//! and the judge.

use router::{Candidate, VerifierChecks};

use crate::error::ApiError;
use crate::service::embeddings::Embeddings;
use crate::service::AppState;
use crate::validate::off_io;

/// The verifier's deterministic checks of `answer` (repetition, JSON, language, regex), on the
/// blocking pool: they read the whole answer, which a client may make megabytes long. Hands the
/// texts back with the failures' reasons. Relevance is measured only when these pass.
pub async fn deterministic(
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
pub async fn similarity(
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

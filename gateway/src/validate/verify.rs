//! `POST /v1/swarm/verify`: the wire request to the answer and checks the verifier runs.
//!
//! Rules: `question` is present and has visible text (there is nothing to check an answer
//! against otherwise); `answer` is present but may be empty (an empty answer is a failed
//! verdict, not a bad request); `finish_reason` is `stop` or `length`; `language` is an ISO 639
//! code of 2 or 3 lowercase letters. Every check runs: the deterministic ones, JSON when
//! `requires_json`, relevance and the judge.

use engine::FinishReason;
use router::VerifierChecks;

use crate::api::verify::VerifyRequest;
use crate::error::ApiError;

/// A verify request every rule held for.
#[derive(Clone, Debug)]
pub struct ValidVerifyRequest {
    pub question: String,
    pub answer: String,
    pub finish_reason: Option<FinishReason>,
    pub checks: VerifierChecks,
}

pub fn validate_verify(request: VerifyRequest) -> Result<ValidVerifyRequest, ApiError> {
    let question = request
        .question
        .ok_or_else(|| ApiError::invalid("question", "`question` is required."))?;
    if question.trim().is_empty() {
        return Err(ApiError::invalid(
            "question",
            "`question` must have visible text.",
        ));
    }
    let answer = request
        .answer
        .ok_or_else(|| ApiError::invalid("answer", "`answer` is required (it may be empty)."))?;
    let finish_reason = match request.finish_reason.as_deref() {
        None => None,
        Some("stop") => Some(FinishReason::Stop),
        Some("length") => Some(FinishReason::Length),
        Some(other) => {
            return Err(ApiError::invalid(
                "finish_reason",
                format!("`finish_reason` is \"stop\" or \"length\", not {other:?}."),
            ))
        }
    };
    if let Some(language) = &request.language {
        let is_code =
            (2..=3).contains(&language.len()) && language.bytes().all(|b| b.is_ascii_lowercase());
        if !is_code {
            return Err(ApiError::invalid(
                "language",
                format!("{language:?} is not an ISO 639 code such as \"en\" or \"fr\"."),
            ));
        }
    }
    Ok(ValidVerifyRequest {
        question,
        answer,
        finish_reason,
        checks: VerifierChecks {
            json: request.requires_json.unwrap_or(false),
            language: request.language,
            judge: true,
            relevance: true,
            ..VerifierChecks::default()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(question: Option<&str>, answer: Option<&str>) -> VerifyRequest {
        VerifyRequest {
            question: question.map(Into::into),
            answer: answer.map(Into::into),
            ..VerifyRequest::default()
        }
    }

    fn param(error: ApiError) -> Option<String> {
        error.body().param
    }

    #[test]
    fn question_and_answer_are_required_but_the_answer_may_be_empty() {
        let missing = validate_verify(request(None, Some("a"))).unwrap_err();
        assert_eq!(param(missing).as_deref(), Some("question"));
        let blank = validate_verify(request(Some("  "), Some("a"))).unwrap_err();
        assert_eq!(param(blank).as_deref(), Some("question"));
        let missing = validate_verify(request(Some("q"), None)).unwrap_err();
        assert_eq!(param(missing).as_deref(), Some("answer"));
        let valid = validate_verify(request(Some("q"), Some(""))).unwrap();
        assert!(valid.checks.judge && valid.checks.relevance && !valid.checks.json);
    }

    #[test]
    fn options_are_checked() {
        let bad_reason = VerifyRequest {
            finish_reason: Some("tired".into()),
            ..request(Some("q"), Some("a"))
        };
        assert_eq!(
            param(validate_verify(bad_reason).unwrap_err()).as_deref(),
            Some("finish_reason")
        );
        let bad_language = VerifyRequest {
            language: Some("English".into()),
            ..request(Some("q"), Some("a"))
        };
        assert_eq!(
            param(validate_verify(bad_language).unwrap_err()).as_deref(),
            Some("language")
        );
        let valid = validate_verify(VerifyRequest {
            requires_json: Some(true),
            finish_reason: Some("length".into()),
            language: Some("fr".into()),
            ..request(Some("q"), Some("a"))
        })
        .unwrap();
        assert!(valid.checks.json);
        assert_eq!(valid.finish_reason, Some(FinishReason::Length));
        assert_eq!(valid.checks.language.as_deref(), Some("fr"));
    }
}

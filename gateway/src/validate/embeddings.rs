//! Turns a wire [`EmbeddingRequest`] into a [`ValidEmbeddingRequest`], with the same invariants
//! as chat validation: only a valid request reaches the embedder, every refusal is a 400 naming
//! its field, and only an unknown model is a 404.
//!
//! Rules: the model is the served embedding model's id or the alias `"default"`; `input` is a
//! non-empty string or a list of 1 to [`MAX_EMBEDDING_INPUTS`] non-empty strings (token ids are
//! refused: they would be another tokenizer's ids); `encoding_format` is `float` or `base64`;
//! `dimensions`, when given, is the model's own. An input longer than the model reads is not
//! refused: like sentence-transformers, the embedder keeps its first word pieces.

use crate::api::embeddings::EmbeddingRequest;
use crate::api::TextInput;
use crate::error::ApiError;
use crate::validate::check_model;

/// Most inputs in one request. Far below OpenAI's 2048: every input is computed on the CPU, and
/// a request holds the embedder until all of its inputs are done.
pub const MAX_EMBEDDING_INPUTS: usize = 256;

/// How the vectors are sent back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodingFormat {
    Float,
    Base64,
}

/// An embedding request that passed validation.
#[derive(Clone, Debug)]
pub struct ValidEmbeddingRequest {
    /// The served model's id (what the response reports, even for `"default"`).
    pub model: String,
    /// At least one, none empty.
    pub inputs: Vec<String>,
    pub encoding_format: EncodingFormat,
}

/// Checks `request` against the served model `model_id`, whose vectors have `dimensions`
/// components; see the module docs for the rules.
pub fn validate_embeddings(
    request: EmbeddingRequest,
    model_id: &str,
    dimensions: usize,
) -> Result<ValidEmbeddingRequest, ApiError> {
    let model = check_model(request.model.as_deref(), model_id)?;
    let inputs = match request.input {
        None => return Err(ApiError::invalid("input", "input is required")),
        Some(TextInput::Text(text)) if text.is_empty() => {
            return Err(ApiError::invalid(
                "input",
                "input must not be an empty string",
            ))
        }
        Some(TextInput::Text(text)) => vec![text],
        Some(TextInput::Texts(texts)) => texts,
        Some(TextInput::Tokens(_) | TextInput::TokenLists(_)) => {
            return Err(ApiError::invalid(
                "input",
                "token ids are not supported for embeddings: send the text",
            ))
        }
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid(
            "input",
            "input must not be an empty list",
        ));
    }
    if inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!(
                "input has {} items; at most {MAX_EMBEDDING_INPUTS} are allowed per request",
                inputs.len()
            ),
        ));
    }
    if let Some(i) = inputs.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            "input",
            format!("input[{i}] is empty; every input must be a non-empty string"),
        ));
    }
    let encoding_format = match request.encoding_format.as_deref() {
        None | Some("float") => EncodingFormat::Float,
        Some("base64") => EncodingFormat::Base64,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("encoding_format must be 'float' or 'base64', not '{other}'"),
            ))
        }
    };
    match request.dimensions {
        None => {}
        Some(n) if n == dimensions as i64 => {}
        Some(n) => {
            return Err(ApiError::invalid(
                "dimensions",
                format!("{model_id} only makes {dimensions}-dimensional embeddings, not {n}"),
            ))
        }
    }
    Ok(ValidEmbeddingRequest {
        model,
        inputs,
        encoding_format,
    })
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use serde_json::json;

    use super::*;

    const MODEL: &str = "all-MiniLM-L6-v2";

    fn validate(body: serde_json::Value) -> Result<ValidEmbeddingRequest, ApiError> {
        validate_embeddings(serde_json::from_value(body).unwrap(), MODEL, 384)
    }

    fn rejected_param(body: serde_json::Value) -> String {
        match validate(body.clone()) {
            Err(e @ ApiError::InvalidRequest { .. }) => {
                assert_eq!(e.status(), StatusCode::BAD_REQUEST);
                e.body().param.expect("a 400 names its field")
            }
            other => panic!("{body}: expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn accepts_openai_requests() {
        let valid = validate(json!({"input": "hi", "model": MODEL})).unwrap();
        assert_eq!(valid.model, MODEL);
        assert_eq!(valid.inputs, ["hi"]);
        assert_eq!(valid.encoding_format, EncodingFormat::Float);
        let valid = validate(json!({
            "input": ["a", "b"], "model": "default", "encoding_format": "base64",
            "dimensions": 384, "user": "u"
        }))
        .unwrap();
        assert_eq!((valid.model.as_str(), valid.inputs.len()), (MODEL, 2));
        assert_eq!(valid.encoding_format, EncodingFormat::Base64);
        assert!(validate(json!({"input": "hi"})).is_ok());
        let most = vec!["x"; MAX_EMBEDDING_INPUTS];
        assert!(validate(json!({"input": most})).is_ok());
    }

    #[test]
    fn refusals_name_their_field() {
        let too_many = vec!["x"; MAX_EMBEDDING_INPUTS + 1];
        for (body, param) in [
            (json!({}), "input"),
            (json!({"input": ""}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": ["a", ""]}), "input"),
            (json!({"input": too_many}), "input"),
            (json!({"input": [1, 2, 3]}), "input"),
            (json!({"input": [[1, 2], [3]]}), "input"),
            (
                json!({"input": "a", "encoding_format": "int8"}),
                "encoding_format",
            ),
            (json!({"input": "a", "dimensions": 256}), "dimensions"),
        ] {
            assert_eq!(rejected_param(body.clone()), param, "{body}");
        }
    }

    #[test]
    fn an_unknown_model_is_not_found() {
        let error =
            validate(json!({"input": "hi", "model": "text-embedding-3-small"})).unwrap_err();
        assert!(matches!(&error, ApiError::ModelNotFound(m) if m == "text-embedding-3-small"));
        assert_eq!(error.status(), StatusCode::NOT_FOUND);
    }
}

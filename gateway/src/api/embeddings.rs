//! OpenAI's wire format for `POST /v1/embeddings`: serde types and nothing else.
//!
//! As for chat, the request is lenient (unknown fields ignored, `input` and `encoding_format`
//! read in every shape OpenAI allows) so that [`crate::validate`] can refuse what this server
//! does not do with the field named; the response follows OpenAI's shape field for field.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::TextInput;

/// `POST /v1/embeddings`.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[schema(example = json!({"model": "default", "input": ["The cat sat on the mat.", "A feline rested."]}))]
pub struct EmbeddingRequest {
    /// Required by OpenAI; optional here so that its absence is a 400 naming `input`.
    #[schema(required = true)]
    pub input: Option<TextInput>,
    /// The served embedding model's id or `"default"`; absent means the served model.
    pub model: Option<String>,
    /// `"float"` (the default) or `"base64"`.
    pub encoding_format: Option<String>,
    /// Length of the vectors wanted; only the model's own is served.
    pub dimensions: Option<i64>,
    /// An end-user id for abuse tracking; accepted and unused.
    pub user: Option<String>,
}

/// The answer: one embedding per input, in input order.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct CreateEmbeddingResponse {
    /// Always `"list"`.
    pub object: &'static str,
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Embedding {
    /// Always `"embedding"`.
    pub object: &'static str,
    /// The input's position in the request.
    pub index: usize,
    pub embedding: EmbeddingVector,
}

/// The vector as numbers, or as `encoding_format: "base64"` asks: its little-endian f32 bytes in
/// standard base64.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

/// Embeddings have no completion, so OpenAI's usage has only these two.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn request_reads_every_input_shape() {
        let input = |value| {
            serde_json::from_value::<EmbeddingRequest>(json!({"input": value}))
                .unwrap()
                .input
                .unwrap()
        };
        assert!(matches!(input(json!("hi")), TextInput::Text(t) if t == "hi"));
        assert!(matches!(input(json!(["a", "b"])), TextInput::Texts(t) if t.len() == 2));
        assert!(matches!(input(json!([])), TextInput::Texts(t) if t.is_empty()));
        assert!(matches!(input(json!([1, 2])), TextInput::Tokens(t) if t == [1, 2]));
        assert!(matches!(
            input(json!([[1], [2, 3]])),
            TextInput::TokenLists(t) if t.len() == 2
        ));
        let request: EmbeddingRequest = serde_json::from_value(json!({
            "input": "hi", "model": "m", "encoding_format": "base64", "dimensions": 384,
            "user": "u", "extra": true
        }))
        .unwrap();
        assert_eq!(request.model.as_deref(), Some("m"));
        assert_eq!(request.encoding_format.as_deref(), Some("base64"));
        assert_eq!(request.dimensions, Some(384));
    }

    #[test]
    fn response_has_openai_shape() {
        let response = CreateEmbeddingResponse {
            object: "list",
            data: vec![
                Embedding {
                    object: "embedding",
                    index: 0,
                    embedding: EmbeddingVector::Float(vec![0.5, -0.25]),
                },
                Embedding {
                    object: "embedding",
                    index: 1,
                    embedding: EmbeddingVector::Base64("AAAAPw==".into()),
                },
            ],
            model: "m".into(),
            usage: EmbeddingUsage {
                prompt_tokens: 7,
                total_tokens: 7,
            },
        };
        assert_eq!(
            serde_json::to_value(&response).unwrap(),
            json!({
                "object": "list",
                "data": [
                    {"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
                    {"object": "embedding", "index": 1, "embedding": "AAAAPw=="}
                ],
                "model": "m",
                "usage": {"prompt_tokens": 7, "total_tokens": 7}
            })
        );
    }
}

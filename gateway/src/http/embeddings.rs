//! `POST /v1/embeddings`: validate, embed on the CPU, answer in OpenAI's shape. A request is
//! admitted as a generation is: a seat in the admission queue, its tokens charged to the
//! caller (every input at the model's longest up front, the unused given back), the total
//! deadline.
//!
//! The computation is [`crate::service::embeddings`]'.
//!
//! Without an embedding model (its directory was missing at start) every request is a 404
//! `model_not_found`, as for any model this server does not serve.

use axum::extract::State;
use axum::Json;
use base64::Engine as _;

use crate::api::embeddings::{
    CreateEmbeddingResponse, Embedding, EmbeddingRequest, EmbeddingUsage, EmbeddingVector,
};
use crate::error::{ApiError, GenerationErrors};
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::service::AppState;
use crate::validate::embeddings::{validate_embeddings, EncodingFormat, ValidEmbeddingRequest};
use crate::validate::DEFAULT_MODEL_ALIAS;

/// Embeds one text or several.
#[utoipa::path(post, path = "/v1/embeddings", tag = "embeddings",
    request_body = EmbeddingRequest,
    responses(
        (status = 200, description = "One embedding per input, in input order.",
            body = CreateEmbeddingResponse),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(state): State<AppState>,
    admission: Admission,
    ApiJson(request): ApiJson<EmbeddingRequest>,
) -> Result<Json<CreateEmbeddingResponse>, ApiError> {
    let Some(embeddings) = state.embeddings() else {
        let name = request.model.unwrap_or_else(|| DEFAULT_MODEL_ALIAS.into());
        return Err(ApiError::ModelNotFound(name));
    };
    let ValidEmbeddingRequest {
        model,
        inputs,
        encoding_format,
    } = validate_embeddings(
        request,
        embeddings.model_id(),
        embeddings.embedder().dimensions(),
    )?;
    // At most every input at the model's longest: what a full charge can be.
    let most = (inputs.len() * embeddings.embedder().max_tokens()) as u64;
    let seats = admission.reserve(&state, 1).await?;
    let embedded = async {
        let computed = embeddings.embed(inputs).await?;
        let used = computed.iter().map(|e| e.tokens as u64).sum();
        Ok((computed, used))
    };
    let computed = admission
        .run_outside_engine(&state, &seats, most, embedded)
        .await?;
    Ok(Json(response(model, encoding_format, computed)))
}

/// The answer for `computed`, whose order is the inputs'. Usage counts the word pieces the model
/// read, `[CLS]` and `[SEP]` included, after truncation.
fn response(
    model: String,
    format: EncodingFormat,
    computed: Vec<engine::Embedding>,
) -> CreateEmbeddingResponse {
    let tokens = computed.iter().map(|e| e.tokens).sum();
    let data = computed
        .into_iter()
        .enumerate()
        .map(|(index, e)| Embedding {
            object: "embedding",
            index,
            embedding: encode(format, e.vector),
        })
        .collect();
    CreateEmbeddingResponse {
        object: "list",
        data,
        model,
        usage: EmbeddingUsage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    }
}

fn encode(format: EncodingFormat, vector: Vec<f32>) -> EmbeddingVector {
    match format {
        EncodingFormat::Float => EmbeddingVector::Float(vector),
        EncodingFormat::Base64 => {
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_little_endian_f32() {
        // 1.0f32 is 0x3f800000: bytes 00 00 80 3f.
        assert_eq!(
            encode(EncodingFormat::Base64, vec![1.0, -2.5]),
            EmbeddingVector::Base64("AACAPwAAIMA=".into())
        );
    }

    #[test]
    fn response_keeps_order_and_sums_usage() {
        let computed = vec![
            engine::Embedding {
                vector: vec![1.0],
                tokens: 3,
            },
            engine::Embedding {
                vector: vec![0.0],
                tokens: 5,
            },
        ];
        let response = response("m".into(), EncodingFormat::Float, computed);
        assert_eq!(response.usage.prompt_tokens, 8);
        assert_eq!(response.usage.total_tokens, 8);
        let indices: Vec<usize> = response.data.iter().map(|d| d.index).collect();
        assert_eq!(indices, [0, 1]);
        assert_eq!(
            response.data[1].embedding,
            EmbeddingVector::Float(vec![0.0])
        );
    }
}

//! `POST /v1/embeddings`: validate, embed on the CPU, answer in OpenAI's shape. A request is
//! admitted as a generation is: a seat in the admission queue, its tokens charged to the
//! caller (every input at the model's longest up front, the unused given back), the total
//! deadline.
//!
//! The embedder is blocking CPU work, so [`Embeddings`] runs it on tokio's blocking threads,
//! never on a runtime worker, and lets one request compute at a time: the others wait on a
//! semaphore without holding a thread, and the cores the embedder does not use stay the
//! generation engine's.
//!
//! Invariant: the permit travels into the blocking task and is released only when the
//! computation ends. A client that goes away drops the handler's future but not the computation
//! already started, so releasing the permit with the future would let two batches run at once.
//!
//! Without an embedding model (its directory was missing at start) every request is a 404
//! `model_not_found`, as for any model this server does not serve.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use base64::Engine as _;
use engine::{Embedder, EmbedderConfig, EngineError};
use tokio::sync::Semaphore;

use crate::api::embeddings::{
    CreateEmbeddingResponse, Embedding, EmbeddingRequest, EmbeddingUsage, EmbeddingVector,
};
use crate::app::AppState;
use crate::error::{ApiError, GenerationErrors};
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::validate::embeddings::{validate_embeddings, EncodingFormat, ValidEmbeddingRequest};
use crate::validate::DEFAULT_MODEL_ALIAS;

/// The embedding model as handlers reach it. Cloning is two reference-count increments.
#[derive(Clone)]
pub struct Embeddings {
    embedder: Arc<Embedder>,
    /// One permit: the request computing now holds it.
    running: Arc<Semaphore>,
}

impl Embeddings {
    pub fn new(embedder: Embedder) -> Self {
        Self {
            embedder: Arc::new(embedder),
            running: Arc::new(Semaphore::new(1)),
        }
    }

    /// Loads the model `config` names, or, when its directory does not exist, warns and returns
    /// `None`: the server then runs without embeddings. A directory that exists but does not
    /// load is an error, since it means a configuration mistake.
    pub async fn start(config: &EmbedderConfig) -> Result<Option<Self>, EngineError> {
        if !config.model.exists() {
            tracing::warn!(
                model = %config.model.display(),
                "no embedding model there: /v1/embeddings will answer 404 (run `make models`)"
            );
            return Ok(None);
        }
        let config = config.clone();
        let embedder = tokio::task::spawn_blocking(move || Embedder::load(&config))
            .await
            .map_err(|e| EngineError::Model(format!("loading the embedding model: {e}")))??;
        Ok(Some(Self::new(embedder)))
    }

    /// The model itself, for other users of it (the embedding routing strategy).
    pub fn embedder(&self) -> Arc<Embedder> {
        self.embedder.clone()
    }

    /// The id clients name the model by.
    pub fn model_id(&self) -> &str {
        self.embedder.id()
    }

    /// Embeds `inputs`, in order, once no other request is computing.
    pub async fn embed(&self, inputs: Vec<String>) -> Result<Vec<engine::Embedding>, ApiError> {
        let permit = self
            .running
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| ApiError::Internal(format!("embedding semaphore: {e}")))?;
        let embedder = self.embedder.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            embedder.embed(&inputs)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("embedding task: {e}")))?
        .map_err(ApiError::from)
    }
}

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
        embeddings.embedder.dimensions(),
    )?;
    // At most every input at the model's longest: what a full charge can be.
    let most = (inputs.len() * embeddings.embedder.max_tokens()) as u64;
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

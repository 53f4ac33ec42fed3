//! The embedding model as every entry point reaches it: `/v1/embeddings`, the embedding routing
//! strategy and the verifier's relevance check.
//!
//! The embedder is blocking CPU work, so [`Embeddings`] runs it on tokio's blocking threads,
//! never on a runtime worker, and lets one request compute at a time: the others wait on a
//! semaphore without holding a thread, and the cores the embedder does not use stay the
//! generation engine's.
//!
//! Invariant: the permit travels into the blocking task and is released only when the
//! computation ends. A client that goes away drops the handler's future but not the computation
//! already started, so releasing the permit with the future would let two batches run at once.

use std::sync::Arc;

use engine::{Embedder, EmbedderConfig, EngineError};
use tokio::sync::Semaphore;

use crate::error::ApiError;

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

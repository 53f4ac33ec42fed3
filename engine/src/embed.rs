//! Sentence embeddings: an [`Embedder`] serves a [`SentenceBert`] on a small pool of compute
//! threads of its own, apart from the generation engine's.
//!
//! [`Embedder::embed`] blocks its caller until every input is embedded; the caller decides where
//! to block (the gateway does it on tokio's blocking threads, one request at a time). Inputs are
//! sorted by length and run in forward passes of at most [`MAX_BATCH`] sequences, as
//! sentence-transformers' `encode` does. A pass concatenates its sequences without padding, so
//! the cap bounds its buffers (32 × 256 tokens × the 1536-wide feed-forward in f32 = 50 MiB at
//! worst), not wasted work.
//!
//! Invariant: results come back in input order, whatever order they were computed in; since an
//! embedding does not depend on the other inputs of its pass, neither does the batching.

use std::path::PathBuf;

use crate::model::SentenceBert;
use crate::{DeviceSpec, EngineError, Result};

/// Sequences in one forward pass (sentence-transformers' default batch size).
pub const MAX_BATCH: usize = 32;

/// Where the default embedding model lives, relative to the working directory.
pub const DEFAULT_EMBEDDING_MODEL: &str = "models/all-MiniLM-L6-v2";

/// Embedding settings. Every flag also reads a `SWARMGATE_*` environment variable.
#[derive(Clone, Debug, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EmbedderConfig {
    /// Directory of the sentence-transformers model served at `/v1/embeddings`; its name is the
    /// model's id. When it is missing the server runs without embeddings.
    #[arg(
        id = "embedding_model",
        long = "embedding-model",
        env = "SWARMGATE_EMBEDDING_MODEL",
        default_value = DEFAULT_EMBEDDING_MODEL
    )]
    pub model: PathBuf,
    /// Compute threads for embeddings (default: a quarter of the cores, at least one). Few, so
    /// that embedding never starves generation of cores.
    #[arg(
        id = "embedding_threads",
        long = "embedding-threads",
        env = "SWARMGATE_EMBEDDING_THREADS"
    )]
    pub threads: Option<usize>,
    /// Where the embedding model runs: `cpu` (our encoder), or `cuda:N` (candle's, on that GPU;
    /// a build with the `cuda` feature).
    #[arg(
        id = "embedding_device",
        long = "embedding-device",
        env = "SWARMGATE_EMBEDDING_DEVICE",
        default_value = "cpu"
    )]
    pub device: DeviceSpec,
}

impl Default for EmbedderConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::from(DEFAULT_EMBEDDING_MODEL),
            threads: None,
            device: DeviceSpec::Cpu,
        }
    }
}

impl EmbedderConfig {
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
        })
    }
}

/// One input's embedding.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    /// Unit length, [`Embedder::dimensions`] long.
    pub vector: Vec<f32>,
    /// Word pieces the model read for this input (after truncation, `[CLS]` and `[SEP]`
    /// included).
    pub tokens: usize,
}

/// A loaded embedding model and the threads it computes on. Shared by reference: `embed` takes
/// `&self`, and concurrent calls are safe (they share the pool's threads).
pub struct Embedder {
    id: String,
    model: SentenceBert,
    pool: rayon::ThreadPool,
}

impl Embedder {
    /// Loads the model in `config.model`. Blocking: it reads every weight.
    pub fn load(config: &EmbedderConfig) -> Result<Self> {
        if config.threads == Some(0) {
            return Err(EngineError::InvalidRequest(
                "embedding threads must be positive".into(),
            ));
        }
        let device = match config.device {
            DeviceSpec::Cpu => None,
            gpu => Some(gpu.open()?),
        };
        let model = SentenceBert::load(&config.model, device.as_ref())?;
        let id = config
            .model
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "embeddings".into());
        let threads = config.threads();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("swarmgate-embed-{i}"))
            .build()
            .map_err(|e| EngineError::Model(format!("cannot start embedding threads: {e}")))?;
        tracing::info!(
            model = %config.model.display(),
            id,
            dimensions = model.dimensions(),
            max_tokens = model.max_tokens(),
            threads,
            device = %config.device,
            "embedder loaded"
        );
        Ok(Self { id, model, pool })
    }

    /// The id clients name the model by: its directory's name (`all-MiniLM-L6-v2`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Length of every embedding.
    pub fn dimensions(&self) -> usize {
        self.model.dimensions()
    }

    /// Word pieces an input is truncated to, `[CLS]` and `[SEP]` included.
    pub fn max_tokens(&self) -> usize {
        self.model.max_tokens()
    }

    /// Embeds every text, in order. Blocking; longer inputs are truncated to
    /// [`Self::max_tokens`] word pieces, never refused.
    pub fn embed<S: AsRef<str> + Sync>(&self, texts: &[S]) -> Result<Vec<Embedding>> {
        self.pool.install(|| {
            let tokens = texts
                .iter()
                .map(|t| self.model.tokenize(t.as_ref()))
                .collect::<Result<Vec<_>>>()?;
            let mut order: Vec<usize> = (0..texts.len()).collect();
            order.sort_by_key(|&i| tokens[i].len());
            let mut vectors = vec![Vec::new(); texts.len()];
            for pass in order.chunks(MAX_BATCH) {
                let batch: Vec<&[u32]> = pass.iter().map(|&i| tokens[i].as_slice()).collect();
                for (&i, vector) in pass.iter().zip(self.model.embed(&batch)?) {
                    vectors[i] = vector;
                }
            }
            Ok(tokens
                .iter()
                .zip(vectors)
                .map(|(tokens, vector)| Embedding {
                    vector,
                    tokens: tokens.len(),
                })
                .collect())
        })
    }
}

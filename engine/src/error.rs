//! The engine's one error type: what failed, never how to present it (the gateway maps these
//! to HTTP statuses in its own `error.rs`).

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    /// The model file is missing, unreadable, or not a supported architecture.
    #[error("model: {0}")]
    Model(String),
    /// The device the configuration names cannot be used (no such GPU, a build without it).
    #[error("device {0}")]
    Device(String),
    /// A tensor operation failed inside candle.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The GGUF's tokenizer metadata could not be turned into a tokenizer, or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template did not parse or did not render for these messages.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The request can never be served as asked (prompt too long, bad parameter...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine's queue is full; the caller should shed load.
    #[error("engine overloaded: {0}")]
    Overloaded(String),
    /// The engine loop has stopped (shutdown or a fatal error).
    #[error("engine is not running")]
    Stopped,
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

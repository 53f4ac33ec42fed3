//! Swarmgate's inference engine.
//!
//! Many sequences, each at its own position, decode together in one batch that requests join and
//! leave at every step (iteration-level scheduling).

pub mod error;
pub mod model;
pub mod request;
pub mod stop;

#[cfg(test)]
pub(crate) mod test_support;

pub use error::{EngineError, Result};
pub use request::{
    Event, FinishReason, GenerateRequest, Prompt, RequestId, SamplingParams, TokenLogprob, Usage,
};

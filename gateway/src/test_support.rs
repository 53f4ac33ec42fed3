//! Fixtures for unit tests: the served model's metadata (tokenizer, chat template) read from the
//! SmolLM2 GGUF without its weights, so validation and wire conversions are tested without an
//! engine thread.
//!
//! A missing model file panics with the command that fetches it rather than skipping, so a green
//! run always means the tests ran.

use engine::ModelInfo;
use std::path::PathBuf;

pub(crate) const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The model's metadata, with a KV cache of `kv_capacity_tokens` tokens.
pub(crate) fn model_info(kv_capacity_tokens: usize) -> ModelInfo {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(format!("{MODEL_ID}.gguf"));
    assert!(
        path.is_file(),
        "{} is missing: run `make models`",
        path.display()
    );
    ModelInfo {
        kv_capacity_tokens,
        ..ModelInfo::load(&path).expect("the GGUF's metadata loads")
    }
}

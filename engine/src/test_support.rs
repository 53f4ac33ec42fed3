//! Shared fixtures for unit tests: the SmolLM2 GGUF under the workspace's `models/` directory
//! (and Gemma 3's beside it), its parsed metadata, and the tokenizer built from it.
//!
//! Tests need the real model file; when it is absent they panic with the command that fetches
//! it rather than skipping, so a green run always means the tests actually ran.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use tokenizers::Tokenizer;

/// `len` pseudo-random values in -0.5..0.5, the same for the same seed.
pub(crate) fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// A `[n, k]` weight of `values(n * k, seed)` in `dtype`, through candle's quantizer.
pub(crate) fn quantized(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
    let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
    QTensor::quantize(&w, dtype).unwrap()
}

/// The instruct model every engine unit test uses.
pub(crate) const SMOLLM2_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The second architecture (Gemma 3), for the tests that cover both.
pub(crate) const GEMMA3_GGUF: &str = "gemma-3-270m-q4_k_m.gguf";

/// The workspace's `models/` directory (a sibling of this crate).
pub(crate) fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// Path of a model file, panicking with a fetch hint when it is missing.
pub(crate) fn model_path(name: &str) -> PathBuf {
    let path = models_dir().join(name);
    assert!(
        path.is_file(),
        "test model {} not found; run `make models` from the workspace root first",
        path.display()
    );
    path
}

/// A fresh read of the SmolLM2 GGUF's metadata (tensors are not loaded), for tests that edit it.
pub(crate) fn read_smollm2_content() -> Content {
    let path = model_path(SMOLLM2_GGUF);
    let mut file = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    Content::read(&mut file).unwrap_or_else(|e| panic!("cannot parse {}: {e}", path.display()))
}

/// The SmolLM2 GGUF's metadata, parsed once per test binary.
pub(crate) fn smollm2_content() -> &'static Content {
    static CONTENT: OnceLock<Content> = OnceLock::new();
    CONTENT.get_or_init(read_smollm2_content)
}

/// The tokenizer built from the SmolLM2 GGUF, built once per test binary.
pub(crate) fn smollm2_tokenizer() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let tokenizer = crate::model::tokenizer::tokenizer_from_gguf(smollm2_content())
                .expect("SmolLM2 tokenizer builds from its GGUF");
            Arc::new(tokenizer)
        })
        .clone()
}

/// Token ids of `text` under the SmolLM2 tokenizer (special tokens in the text are recognised).
pub(crate) fn encode(text: &str) -> Vec<u32> {
    smollm2_tokenizer()
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec()
}

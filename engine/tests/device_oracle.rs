//! Oracle for the device path: candle's operations with the weights dequantized to f32 (what a
//! GPU runs, here on the CPU) against candle's reference `quantized_llama` with every weight
//! dequantized to f32 too. Both sides compute in f32 from the same values and differ only in
//! summation order, a few 1e-4 at most over 30 layers on logits of magnitude ~10-30; so every
//! logit must agree within 2e-3 absolute (and so log-probabilities within 4e-3). The GPU's own products are checked on a GPU
//! (`swarmgate device-check`, `scripts/gpu-check.sh`).

mod common;

use candle_core::Device;
use common::reference::{check_against_reference, Tolerance};
use engine::model::{Backend, DeviceWeights};

/// Three prompts and 16 tokens: f32 GEMMs on two cores are slow.
#[test]
fn the_device_path_matches_reference() {
    let backend = Backend::Tensors {
        device: Device::Cpu,
        weights: DeviceWeights::F32,
    };
    let tolerance = Tolerance {
        top_logprobs: 4e-3,
        logits: Some(2e-3),
        tie: 4e-3,
    };
    check_against_reference(backend, 3, 16, tolerance);
}

//! Oracle: our ragged-batch llama, and the engine's prompt log-probabilities, against candle's
//! reference `quantized_llama` on the same GGUF.
//!
//! The reference runs with every weight dequantized to f32 (`CANDLE_DEQUANTIZE_ALL`), which are
//! exactly the values our 8-bit kernel multiplies by (Q4_1/Q8_0 blocks map onto it without
//! loss). Both sides then compute in f32 and differ only in summation order: candle's GEMM
//! blocks the reductions, our kernels run one FMA chain per output. Over 30 layers that drifts
//! by a few 1e-4 at most on logits of magnitude ~10-30, so we require every logit to agree within
//! 2e-3 absolute (about 1e-4 relative): far below the gaps between competing tokens, and far
//! above rounding noise, while a real bug (a wrong rotation, a missed residual, a block-table
//! slip) moves logits by whole units.

mod common;

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use engine::kv_cache::{BlockId, KvStorage};
use engine::model::tokenizer::tokenizer_from_gguf;
use engine::model::{Backend, DeviceWeights, ForwardBatch, Gguf, Llama, Logits};
use engine::{ChatMessage, ChatTemplate, EngineHandle, GenerateRequest, SamplingParams};

const TOLERANCE: f32 = 2e-3;
const BLOCK: usize = 16;

fn model_path() -> PathBuf {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `make models`", p.display());
    p
}

/// Five chat prompts, rendered with the model's own template and tokenizer, from a bare
/// greeting to a paragraph of context.
fn prompts() -> Vec<Vec<u32>> {
    let mut file = std::fs::File::open(model_path()).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let tokenizer = tokenizer_from_gguf(&content).unwrap();
    let template = ChatTemplate::from_gguf(&content).unwrap();
    let conversations: [&[(&str, &str)]; 5] = [
        &[("user", "Hi!")],
        &[("user", "What is the capital of France?")],
        &[
            ("system", "You are a terse assistant. Answer in one line."),
            ("user", "Name three primary colours."),
        ],
        &[
            ("user", "Write a haiku about the sea."),
            (
                "assistant",
                "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time.",
            ),
            ("user", "Now one about mountains."),
        ],
        &[(
            "user",
            "Here is a note from a customer: 'I ordered a blue kettle on Monday, paid for express \
             shipping, and it still has not arrived. The tracking page has said \"label created\" \
             for four days. I would like either a refund of the shipping cost or the kettle by \
             Friday.' Draft a short, polite reply that apologises and offers both options.",
        )],
    ];
    conversations
        .iter()
        .map(|turns| {
            let messages: Vec<ChatMessage> = turns
                .iter()
                .map(|(role, text)| ChatMessage::new(*role, *text))
                .collect();
            let text = template.render(&messages, true).unwrap();
            tokenizer
                .encode(text.as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec()
        })
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

struct Ours {
    model: Llama,
    kv: KvStorage,
}

impl Ours {
    fn new(backend: Backend) -> Self {
        let mut g = Gguf::open(&model_path()).unwrap();
        let model = Llama::load(&mut g, &backend).unwrap();
        let kv = model.kv_storage(BLOCK, 64).unwrap();
        Self { model, kv }
    }

    /// Logits at every position of `tokens`, run as one sequence in blocks `first_block..`.
    fn all_logits(&mut self, tokens: &[u32], first_block: u32) -> Vec<Vec<f32>> {
        let mut batch = ForwardBatch::default();
        batch.push(
            tokens,
            0,
            blocks(first_block, tokens.len() + 40),
            Logits::Every,
        );
        self.model
            .forward(&batch, &mut self.kv)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    fn greedy(&mut self, prompt: &[u32], n: usize, first_block: u32) -> Vec<u32> {
        let table = blocks(first_block, prompt.len() + n);
        let mut batch = ForwardBatch::default();
        batch.push(prompt, 0, table.clone(), Logits::Last);
        let mut logits: Vec<Vec<f32>> = self
            .model
            .forward(&batch, &mut self.kv)
            .unwrap()
            .to_vec2()
            .unwrap();
        let mut out = Vec::new();
        for i in 0..n {
            let tok = argmax(&logits[0]);
            out.push(tok);
            let mut batch = ForwardBatch::default();
            batch.push(&[tok], prompt.len() + i, table.clone(), Logits::Last);
            logits = self
                .model
                .forward(&batch, &mut self.kv)
                .unwrap()
                .to_vec2()
                .unwrap();
        }
        out
    }
}

fn blocks(first: u32, tokens: usize) -> Vec<BlockId> {
    (first..first + tokens.div_ceil(BLOCK) as u32)
        .map(BlockId)
        .collect()
}

fn reference() -> ModelWeights {
    // SAFETY: set before any thread reads it; this test binary runs nothing else concurrently
    // that reads the variable (it is read once per thread, at the first quantized load).
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut file = std::fs::File::open(model_path()).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap()
}

fn reference_step(r: &mut ModelWeights, tok: u32, pos: usize) -> Vec<f32> {
    let x = Tensor::new(&[[tok]], &Device::Cpu).unwrap();
    r.forward(&x, pos)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn logits_and_greedy_continuations_match_reference() {
    check_against_reference(Backend::Kernels, 5, 32);
}

/// The device path with f32 weights (candle matmuls, the cache as tensors written by scatter,
/// attention from candle operations and the decode kernel's CPU twin), run on the CPU: what a
/// GPU runs, checked here to the same tolerance; the GPU's own products are checked on a GPU
/// (`swarmgate device-check`, `scripts/gpu-check.sh`). Three prompts and 16 tokens: f32 GEMMs
/// on two cores are slow.
#[test]
fn the_device_path_matches_reference() {
    let backend = Backend::Tensors {
        device: Device::Cpu,
        weights: DeviceWeights::F32,
    };
    check_against_reference(backend, 3, 16);
}

/// The first `prompts` prompts' logits, and `greedy` tokens of greedy continuation.
fn check_against_reference(backend: Backend, prompts: usize, greedy: usize) {
    let mut reference = reference();
    let mut ours = Ours::new(backend);
    let mut worst = 0f32;
    for prompt in self::prompts().into_iter().take(prompts) {
        reference.clear_kv_cache();
        let ours_logits = ours.all_logits(&prompt, 0);
        let mut logits = Vec::new();
        for (pos, &tok) in prompt.iter().enumerate() {
            logits = reference_step(&mut reference, tok, pos);
            let diff = logits
                .iter()
                .zip(&ours_logits[pos])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst = worst.max(diff);
            assert!(
                diff <= TOLERANCE,
                "prompt len {} pos {pos}: max |diff| {diff}",
                prompt.len()
            );
        }
        // Greedy continuation on both sides.
        let mut expect = Vec::new();
        for i in 0..greedy {
            let tok = argmax(&logits);
            expect.push(tok);
            logits = reference_step(&mut reference, tok, prompt.len() + i);
        }
        assert_eq!(
            ours.greedy(&prompt, greedy, 0),
            expect,
            "prompt len {}",
            prompt.len()
        );
    }
    eprintln!("worst logit difference vs reference: {worst:e}");
}

/// Prompt log-probabilities, through the whole engine, against the log-softmax of the
/// reference's logits at each position (computed here in f64). Log-sum-exp moves by no more than
/// the largest change of its inputs, so an entry can be off by at most twice the logit tolerance,
/// plus the f32 rounding of the engine's log-sum-exp over the vocabulary (relative 1e-7 per term,
/// a few 1e-5 in all): 2 * TOLERANCE bounds it with room to spare.
#[test]
fn prompt_logprobs_match_reference() {
    const TOP: usize = 5;
    let prompt = prompts()
        .into_iter()
        .find(|p| p.len() >= 40)
        .expect("a prompt of 40 tokens or more");
    let engine = EngineHandle::start(&common::config(64)).unwrap();
    let entries = common::collect(
        engine
            .submit(GenerateRequest {
                prompt_logprobs: Some(TOP),
                ..common::request(&prompt, SamplingParams::greedy(), 1)
            })
            .unwrap(),
    )
    .prompt_logprobs
    .expect("asked for");
    assert_eq!(entries.len(), prompt.len() - 1);
    let mut reference = reference();
    let mut worst = 0f32;
    for (pos, entry) in entries.iter().enumerate() {
        let expect = log_softmax_f64(&reference_step(&mut reference, prompt[pos], pos));
        assert_eq!(entry.token, prompt[pos + 1]);
        let mut diff = (entry.logprob - expect[entry.token as usize]).abs();
        for &(t, lp) in &entry.top {
            diff = diff.max((lp - expect[t as usize]).abs());
        }
        // The reference's likeliest token leads, or ties with what does.
        let best = expect.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        diff = diff.max((entry.top[0].1 - best).abs());
        worst = worst.max(diff);
        assert!(diff <= 2.0 * TOLERANCE, "position {pos}: max |diff| {diff}");
    }
    eprintln!(
        "worst prompt log-probability difference vs reference over {} tokens: {worst:e}",
        entries.len()
    );
}

fn log_softmax_f64(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&l| (l as f64 - log_z) as f32).collect()
}

/// The same prompts in one ragged batch give bit-identical logits to each prompt alone.
#[test]
fn ragged_batch_equals_sequences_alone() {
    let mut ours = Ours::new(Backend::Kernels);
    let prompts = prompts();
    let alone: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| ours.all_logits(p, 0)).collect();
    let mut batch = ForwardBatch::default();
    let mut next_block = 10;
    for p in &prompts {
        let table = blocks(next_block, p.len());
        next_block += table.len() as u32;
        batch.push(p, 0, table, Logits::Every);
    }
    let together: Vec<Vec<f32>> = ours
        .model
        .forward(&batch, &mut ours.kv)
        .unwrap()
        .to_vec2()
        .unwrap();
    let mut row = 0;
    for (p, alone) in prompts.iter().zip(&alone) {
        assert_eq!(alone.len(), p.len());
        for (pos, logits) in alone.iter().enumerate() {
            assert!(
                together[row] == *logits,
                "prompt len {} pos {pos} differs",
                p.len()
            );
            row += 1;
        }
    }
}

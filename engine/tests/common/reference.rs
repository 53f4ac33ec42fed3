//! The oracle's two sides: our ragged-batch llama, run one prompt at a time, and candle's
//! reference `quantized_llama` on the same GGUF, with the prompts both run.

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use engine::kv_cache::{BlockId, KvStorage};
use engine::model::tokenizer::tokenizer_from_gguf;
use engine::model::{Backend, ForwardBatch, Gguf, Llama, Logits};
use engine::sampler::argmax;
use engine::{ChatMessage, ChatTemplate};

const BLOCK: usize = 16;

pub fn model_path() -> PathBuf {
    models("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The Gemma 3 GGUF.
pub fn gemma3_path() -> PathBuf {
    models("gemma-3-270m-q4_k_m.gguf")
}

fn models(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(name);
    assert!(p.exists(), "{} is missing: run `make models`", p.display());
    p
}

/// Five chat prompts, rendered with the model's own template and tokenizer, from a bare
/// greeting to a paragraph of context.
pub fn prompts() -> Vec<Vec<u32>> {
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
    let chat = Chat::load();
    conversations
        .iter()
        .map(|turns| {
            let messages: Vec<ChatMessage> = turns
                .iter()
                .map(|(role, text)| ChatMessage::new(*role, *text))
                .collect();
            chat.tokens(&messages)
        })
        .collect()
}

/// The model's own chat template and tokenizer.
pub struct Chat {
    template: ChatTemplate,
    tokenizer: tokenizers::Tokenizer,
}

impl Chat {
    pub fn load() -> Self {
        let mut file = std::fs::File::open(model_path()).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        Self {
            template: ChatTemplate::from_gguf(&content).unwrap(),
            tokenizer: tokenizer_from_gguf(&content).unwrap(),
        }
    }

    /// `messages` rendered with a generation prompt, as token ids.
    pub fn tokens(&self, messages: &[ChatMessage]) -> Vec<u32> {
        let text = self.template.render(messages, true).unwrap();
        self.tokenizer
            .encode(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec()
    }
}

pub struct Ours {
    pub model: Llama,
    pub kv: KvStorage,
}

impl Ours {
    /// SmolLM2 for `backend`.
    pub fn new(backend: Backend) -> Self {
        Self::load(&model_path(), backend)
    }

    pub fn load(path: &std::path::Path, backend: Backend) -> Self {
        let mut g = Gguf::open(path).unwrap();
        let model = Llama::load(&mut g, &backend).unwrap();
        let kv = model.kv_storage(BLOCK, 64).unwrap();
        Self { model, kv }
    }

    /// Logits at every position of `tokens`, run as one sequence in blocks `first_block..`.
    pub fn all_logits(&mut self, tokens: &[u32], first_block: u32) -> Vec<Vec<f32>> {
        let mut batch = ForwardBatch::default();
        batch.push(
            tokens,
            0,
            vec![blocks(first_block, tokens.len() + 40)],
            Logits::Every,
        );
        self.model
            .forward(&batch, &mut self.kv)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    pub fn greedy(&mut self, prompt: &[u32], n: usize, first_block: u32) -> Vec<u32> {
        let table = blocks(first_block, prompt.len() + n);
        let mut batch = ForwardBatch::default();
        batch.push(prompt, 0, vec![table.clone()], Logits::Last);
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
            batch.push(&[tok], prompt.len() + i, vec![table.clone()], Logits::Last);
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

pub fn blocks(first: u32, tokens: usize) -> Vec<BlockId> {
    (first..first + tokens.div_ceil(BLOCK) as u32)
        .map(BlockId)
        .collect()
}

/// candle's `quantized_llama` on the same GGUF with every weight dequantized to f32
/// (`CANDLE_DEQUANTIZE_ALL`, which candle reads once per thread at its first quantized load:
/// every test that loads the reference sets it first, to the same value).
pub fn reference() -> ModelWeights {
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut file = std::fs::File::open(model_path()).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap()
}

pub fn reference_step(r: &mut ModelWeights, tok: u32, pos: usize) -> Vec<f32> {
    let x = Tensor::new(&[[tok]], &Device::Cpu).unwrap();
    r.forward(&x, pos)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// How close our logits must stay to the reference's.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// On the log-probabilities of the reference's five likeliest tokens, at every position.
    pub top_logprobs: f32,
    /// On every raw logit, where the two sides compute the same products.
    pub logits: Option<f32>,
    /// The largest lead of the reference's greedy choice over ours that is a numerical tie.
    pub tie: f32,
}

/// The first `prompts` prompts' logits within `tolerance`, and `greedy` tokens of greedy
/// continuation: the same tokens until the first step where the reference's two candidates are
/// within `tolerance.tie` of each other (a numerical tie), if any.
pub fn check_against_reference(
    backend: Backend,
    prompts: usize,
    greedy: usize,
    tolerance: Tolerance,
) {
    let mut reference = reference();
    let mut ours = Ours::new(backend);
    let (mut worst_top, mut worst_logit) = (0f32, 0f32);
    for prompt in self::prompts().into_iter().take(prompts) {
        reference.clear_kv_cache();
        let ours_logits = ours.all_logits(&prompt, 0);
        let mut logits = Vec::new();
        for (pos, &tok) in prompt.iter().enumerate() {
            logits = reference_step(&mut reference, tok, pos);
            let top = top_logprob_diff(&logits, &ours_logits[pos], 5);
            worst_top = worst_top.max(top);
            assert!(
                top <= tolerance.top_logprobs,
                "prompt len {} pos {pos}: top log-probabilities differ by {top}",
                prompt.len()
            );
            if let Some(limit) = tolerance.logits {
                let diff = logits
                    .iter()
                    .zip(&ours_logits[pos])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst_logit = worst_logit.max(diff);
                assert!(
                    diff <= limit,
                    "prompt len {} pos {pos}: max |diff| {diff}",
                    prompt.len()
                );
            }
        }
        let ours_greedy = ours.greedy(&prompt, greedy, 0);
        for (i, &tok) in ours_greedy.iter().enumerate() {
            let expect = argmax(&logits);
            if expect != tok {
                let lp = log_softmax_f64(&logits);
                let gap = lp[expect as usize] - lp[tok as usize];
                assert!(
                    gap <= tolerance.tie,
                    "prompt len {} greedy step {i}: {tok} where the reference leads with \
                     {expect} by {gap}",
                    prompt.len()
                );
                eprintln!(
                    "prompt len {}: greedy paths part at step {i}, a tie ({gap:e})",
                    prompt.len()
                );
                break;
            }
            logits = reference_step(&mut reference, tok, prompt.len() + i);
        }
    }
    eprintln!(
        "worst difference vs reference: top log-probabilities {worst_top:e}, logits {worst_logit:e}"
    );
}

/// The largest difference of log-probability over the `k` tokens `reference` finds likeliest.
pub fn top_logprob_diff(reference: &[f32], ours: &[f32], k: usize) -> f32 {
    let (r, o) = (log_softmax_f64(reference), log_softmax_f64(ours));
    let mut order: Vec<usize> = (0..r.len()).collect();
    order.sort_by(|&a, &b| r[b].total_cmp(&r[a]));
    order[..k]
        .iter()
        .map(|&t| (r[t] - o[t]).abs())
        .fold(0f32, f32::max)
}

pub fn log_softmax_f64(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&l| (l as f64 - log_z) as f32).collect()
}

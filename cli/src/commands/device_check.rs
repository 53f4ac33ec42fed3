//! `swarmgate device-check`: the device path (candle's quantized matmuls, the KV cache as device
//! tensors, attention from candle operations and the paged decode kernel) against the CPU
//! kernels on the same GGUF, on chat prompts: the logits of every prompt position (prefill) and
//! of decode steps along the CPU's greedy continuation, the greedy continuations themselves, the
//! decode kernel against candle operations on the device, and batch invariance on the device
//! (prompts in one batch against each alone, and one decode step of every prompt together
//! against each alone). Prints one JSON object and fails when a criterion does not hold.
//!
//! How close the paths must be depends on the device's weights (`--gpu-weights`). The CPU
//! kernels compute as llama.cpp does, each product's activations quantized to 8 bits per block
//! of 32; the `f32` and `f16` device paths keep them in floating point, and `quantized` (candle's
//! kernels) quantizes them with other rounding. That moves logits (magnitudes 10-30) by up to ~2
//! over 30 layers (measured on the CPU: 1.9 with `f32`, 2.4 with `quantized`), so the paths must
//! agree within 3.0 (4.0 with `quantized`) and rank the same token first at nine positions in
//! ten or more, prompt and decode steps alike (measured: 95-99%). A real fault (a wrong rotation,
//! a KV slot written to the wrong block, a stale cache read) moves logits by whole units
//! everywhere and breaks that agreement. Greedy continuations are reported, not required: where
//! two tokens are within the numerical difference of each other either path may take either,
//! and the continuations part from there. The device path against itself (a batch against each
//! prompt alone, the decode kernel against candle operations) computes the same products and
//! keeps the tight bounds: 0.01 with `f32`, 0.5 with `f16`, 4.0 with `quantized` (candle
//! dequantizes for batches of several rows and quantizes for one).
//!
//! With `--device cpu` the device path runs on the CPU, which checks it (and this command) on a
//! machine without a GPU.

use anyhow::{bail, Result};
use clap::Args;
use engine::kv_cache::{BlockId, KvStorage};
use engine::model::{Backend, DecodeAttention, DeviceWeights, ForwardBatch, Gguf, Llama, Logits};
use engine::{ChatMessage, DeviceSpec, EngineConfig, EngineHandle};
use serde::Serialize;

use crate::commands::CHAT_QUESTIONS;

#[derive(Args, Debug)]
pub struct DeviceCheckArgs {
    /// The device whose path is checked against the CPU kernels.
    #[arg(long, default_value = "cuda:0")]
    device: DeviceSpec,
    /// The GGUF model.
    #[arg(
        long,
        env = "SWARMGATE_MODEL",
        default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    )]
    model: std::path::PathBuf,
    /// Chat prompts to run (1 to 16).
    #[arg(long, default_value_t = 16)]
    prompts: usize,
    /// Greedy tokens generated after each prompt, on each path.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// The weights' form on the device.
    #[arg(long, value_enum, default_value_t = DeviceWeights::F32)]
    gpu_weights: DeviceWeights,
    /// Largest difference allowed between a logit of the two paths (default: by --gpu-weights,
    /// 3.0, 3.0 or 4.0).
    #[arg(long)]
    tolerance: Option<f32>,
    /// Share of the prompt positions, and of the decode steps, where both paths must rank the
    /// same token first.
    #[arg(long, default_value_t = 0.9)]
    min_top1: f64,
}

const BLOCK: usize = 16;

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    gpu_weights: DeviceWeights,
    prompts: usize,
    prompt_tokens: usize,
    /// Largest |logit difference| between the paths over every prompt position.
    max_logit_diff: f32,
    /// Positions where both paths rank the same token first.
    top1_agreement: f64,
    /// The same for decode steps along the CPU path's greedy continuation.
    decode_max_logit_diff: f32,
    decode_top1_agreement: f64,
    /// Decode steps on the device: the paged decode kernel against candle operations.
    kernel_vs_ops_max_logit_diff: f32,
    greedy_tokens: usize,
    greedy_equal: usize,
    /// Mean share of each continuation the two paths have in common before they differ.
    greedy_common_prefix: f64,
    /// The device path, every prompt in one ragged batch against each alone, and the next decode
    /// step of every prompt in one batch against each alone.
    batch_max_logit_diff: f32,
    batch_top1_agreement: f64,
    batch_decode_max_logit_diff: f32,
    /// Bound on the differences between the two paths.
    tolerance: f32,
    /// Bound on the device path against itself: batch against alone, kernel against operations.
    device_tolerance: f32,
    min_top1: f64,
    pass: bool,
}

pub fn run(args: DeviceCheckArgs) -> Result<()> {
    if !(1..=CHAT_QUESTIONS.len()).contains(&args.prompts) || args.tokens == 0 {
        bail!(
            "--prompts must be 1 to {}, and --tokens positive",
            CHAT_QUESTIONS.len()
        );
    }
    let device = args.device.open()?;
    let prompts = prompts(&args)?;
    let mut cpu = Path::load(&args.model, Backend::Kernels, &prompts)?;
    let backend = Backend::Tensors {
        device,
        weights: args.gpu_weights,
    };
    let (tolerance, device_tolerance) = match args.gpu_weights {
        DeviceWeights::F32 => (3.0, 0.01),
        DeviceWeights::F16 => (3.0, 0.5),
        DeviceWeights::Quantized => (4.0, 4.0),
    };
    let tolerance = args.tolerance.unwrap_or(tolerance);
    let mut dev = Path::load(&args.model, backend.clone(), &prompts)?;
    let mut ops = Path::load(&args.model, backend, &prompts)?;
    ops.model.set_decode_attention(DecodeAttention::Ops);

    let (mut prefill, mut decode, mut kernel_ops) =
        (Agreement::default(), Agreement::default(), 0f32);
    let (mut equal, mut common) = (0usize, 0f64);
    let mut alone = Vec::with_capacity(prompts.len());
    // The CPU path's first greedy token after each prompt.
    let mut next = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let (a, b) = (cpu.all_logits(prompt)?, dev.all_logits(prompt)?);
        prefill.add(&a, &b);
        let (x, y) = (
            cpu.greedy(prompt, args.tokens)?,
            dev.greedy(prompt, args.tokens)?,
        );
        equal += usize::from(x == y);
        next.push(x[0]);
        common += x.iter().zip(&y).take_while(|(p, q)| p == q).count() as f64 / x.len() as f64;
        // Decode steps along the same tokens on every path, so that each compares like with like.
        let steps = dev.decode_logits(prompt, &x)?;
        decode.add(&cpu.decode_logits(prompt, &x)?, &steps);
        kernel_ops = kernel_ops.max(Agreement::of(&steps, &ops.decode_logits(prompt, &x)?).diff);
        alone.push(b);
    }
    let together = dev.batch_logits(&prompts)?;
    let alone: Vec<Vec<f32>> = alone.into_iter().flatten().collect();
    let batch = Agreement::of(&alone, &together);
    let batch_decode = Agreement::of(
        &dev.decode_alone(&prompts, &next)?,
        &dev.decode_together(&prompts, &next)?,
    );

    let n = prompts.len();
    let pass = prefill.diff.max(decode.diff) <= tolerance
        && [kernel_ops, batch.diff, batch_decode.diff]
            .iter()
            .all(|d| *d <= device_tolerance)
        && prefill.share().min(decode.share()) >= args.min_top1;
    let report = Report {
        device: args.device.to_string(),
        gpu_weights: args.gpu_weights,
        prompts: n,
        prompt_tokens: prefill.rows,
        max_logit_diff: prefill.diff,
        top1_agreement: prefill.share(),
        decode_max_logit_diff: decode.diff,
        decode_top1_agreement: decode.share(),
        kernel_vs_ops_max_logit_diff: kernel_ops,
        greedy_tokens: args.tokens,
        greedy_equal: equal,
        greedy_common_prefix: common / n as f64,
        batch_max_logit_diff: batch.diff,
        batch_top1_agreement: batch.share(),
        batch_decode_max_logit_diff: batch_decode.diff,
        tolerance,
        device_tolerance,
        min_top1: args.min_top1,
        pass,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    if !report.pass {
        bail!("the device path disagrees with the CPU kernels beyond the criteria");
    }
    Ok(())
}

/// The first `--prompts` chat questions, rendered with the model's template and tokenized.
fn prompts(args: &DeviceCheckArgs) -> Result<Vec<Vec<u32>>> {
    // The model's text side only: no KV cache to speak of, no request ever submitted.
    let engine = EngineHandle::start(&EngineConfig {
        model: args.model.clone(),
        device_kv_blocks: Some(2),
        host_kv_cache_mb: 0,
        ..EngineConfig::default()
    })?;
    CHAT_QUESTIONS[..args.prompts]
        .iter()
        .map(|q| {
            Ok(engine
                .model()
                .encode_chat(&[ChatMessage::new("user", *q)], true)?
                .tokens)
        })
        .collect()
}

/// How two sets of logit rows agree: the largest |difference|, and the rows ranking the same
/// token first.
#[derive(Default)]
struct Agreement {
    diff: f32,
    same: usize,
    rows: usize,
}

impl Agreement {
    fn of(a: &[Vec<f32>], b: &[Vec<f32>]) -> Self {
        let mut agreement = Self::default();
        agreement.add(a, b);
        agreement
    }

    fn add(&mut self, a: &[Vec<f32>], b: &[Vec<f32>]) {
        for (x, y) in a.iter().zip(b) {
            self.diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(self.diff, f32::max);
            self.same += usize::from(argmax(x) == argmax(y));
            self.rows += 1;
        }
    }

    fn share(&self) -> f64 {
        self.same as f64 / self.rows.max(1) as f64
    }
}

fn argmax(row: &[f32]) -> u32 {
    engine::sampler::argmax(row)
}

/// One path: a model and a KV cache large enough for every prompt of the check at once.
struct Path {
    model: Llama,
    kv: KvStorage,
}

impl Path {
    fn load(model: &std::path::Path, backend: Backend, prompts: &[Vec<u32>]) -> Result<Self> {
        let model = Llama::load(&mut Gguf::open(model)?, &backend)?;
        let blocks = prompts
            .iter()
            .map(|p| (p.len() + 64).div_ceil(BLOCK))
            .sum::<usize>()
            + 64;
        let kv = model.kv_storage(BLOCK, blocks)?;
        Ok(Self { model, kv })
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        Ok(self.model.forward(batch, &mut self.kv)?.to_vec2()?)
    }

    /// Logits at every position of `prompt`, run alone.
    fn all_logits(&mut self, prompt: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut batch = ForwardBatch::default();
        batch.push(prompt, 0, vec![blocks(0, prompt.len())], Logits::Every);
        self.forward(&batch)
    }

    /// Every prompt's logits at every position, all in one ragged batch.
    fn batch_logits(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let mut batch = ForwardBatch::default();
        let mut next = 0;
        for prompt in prompts {
            let table = blocks(next, prompt.len());
            next += table.len() as u32;
            batch.push(prompt, 0, vec![table], Logits::Every);
        }
        self.forward(&batch)
    }

    /// The logits of decoding `tokens` one per step after `prompt`: row `i` follows `tokens[i]`.
    fn decode_logits(&mut self, prompt: &[u32], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let table = blocks(0, prompt.len() + tokens.len());
        let mut batch = ForwardBatch::default();
        batch.push(prompt, 0, vec![table.clone()], Logits::Last);
        self.forward(&batch)?;
        let mut rows = Vec::with_capacity(tokens.len());
        for (i, &token) in tokens.iter().enumerate() {
            let mut batch = ForwardBatch::default();
            batch.push(
                &[token],
                prompt.len() + i,
                vec![table.clone()],
                Logits::Last,
            );
            rows.extend(self.forward(&batch)?);
        }
        Ok(rows)
    }

    /// Prefills every prompt in blocks of its own, then decodes `next[i]` after prompt `i`, each
    /// alone: one row per prompt.
    fn decode_alone(&mut self, prompts: &[Vec<u32>], next: &[u32]) -> Result<Vec<Vec<f32>>> {
        let tables = self.prefill_apart(prompts)?;
        let mut rows = Vec::with_capacity(prompts.len());
        for ((prompt, table), &token) in prompts.iter().zip(tables).zip(next) {
            let mut batch = ForwardBatch::default();
            batch.push(&[token], prompt.len(), vec![table], Logits::Last);
            rows.extend(self.forward(&batch)?);
        }
        Ok(rows)
    }

    /// As [`Self::decode_alone`], with the decode steps in one batch.
    fn decode_together(&mut self, prompts: &[Vec<u32>], next: &[u32]) -> Result<Vec<Vec<f32>>> {
        let tables = self.prefill_apart(prompts)?;
        let mut batch = ForwardBatch::default();
        for ((prompt, table), &token) in prompts.iter().zip(tables).zip(next) {
            batch.push(&[token], prompt.len(), vec![table], Logits::Last);
        }
        self.forward(&batch)
    }

    /// Prefills each prompt alone into blocks of its own (room for one more token); returns the
    /// block tables.
    fn prefill_apart(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<BlockId>>> {
        let mut next = 0;
        let mut tables = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let table = blocks(next, prompt.len() + 1);
            next += table.len() as u32;
            let mut batch = ForwardBatch::default();
            batch.push(prompt, 0, vec![table.clone()], Logits::Last);
            self.forward(&batch)?;
            tables.push(table);
        }
        Ok(tables)
    }

    /// `n` greedy tokens after `prompt`, decoding one token per step.
    fn greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let table = blocks(0, prompt.len() + n);
        let mut batch = ForwardBatch::default();
        batch.push(prompt, 0, vec![table.clone()], Logits::Last);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let token = argmax(&self.forward(&batch)?[0]);
            out.push(token);
            batch = ForwardBatch::default();
            batch.push(
                &[token],
                prompt.len() + i,
                vec![table.clone()],
                Logits::Last,
            );
        }
        Ok(out)
    }
}

fn blocks(first: u32, tokens: usize) -> Vec<BlockId> {
    (first..first + tokens.div_ceil(BLOCK) as u32)
        .map(BlockId)
        .collect()
}

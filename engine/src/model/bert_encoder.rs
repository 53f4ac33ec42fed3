//! BERT's encoder in f32 over a ragged batch: the sequences' tokens concatenated, no padding.
//!
//! The forward is Hugging Face's `BertModel` (post-LayerNorm, absolute positions, exact-erf
//! GELU) written out on plain row-major buffers: embeddings (word + position + token type 0)
//! and LayerNorm, then per layer a fused Q/K/V product, attention within each sequence and each
//! head, the output product, residual and LayerNorm, the feed-forward up product and GELU, the
//! down product, residual and LayerNorm. The products are [`Dense`] layers packed once at load.
//!
//! Invariants:
//! - a token attends to the tokens of its own sequence only, so a sequence's hidden states are
//!   the same alone or in any batch (bit for bit: the products compute each row on its own);
//! - every buffer a pass needs is allocated once per pass, never per layer or per head;
//! - token ids and lengths are checked before any work: an id outside the vocabulary or a
//!   sequence longer than the position table is an error, never an out-of-bounds read.

use std::ops::Range;

use candle_core::safetensors::SliceSafetensors;
use candle_core::{DType, Device};
use candle_transformers::models::bert::{Config, HiddenAct, PositionEmbeddingType};

use super::dense::Dense;
use crate::{EngineError, Result};

/// A LayerNorm over the hidden dimension.
struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    fn load(w: &Weights, prefix: &str, hidden: usize, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: w.get(&format!("{prefix}.weight"), &[hidden])?,
            bias: w.get(&format!("{prefix}.bias"), &[hidden])?,
            eps,
        })
    }

    /// Normalises every row of `x` in place. Mean and variance are accumulated in f64, so that
    /// the sums' rounding never shows in the result.
    fn forward(&self, x: &mut [f32]) {
        let h = self.weight.len();
        for row in x.chunks_exact_mut(h) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (var + self.eps as f64).sqrt();
            for ((v, &g), &b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = ((*v as f64 - mean) * inv) as f32 * g + b;
            }
        }
    }
}

/// One transformer layer.
struct Layer {
    /// Q, K and V stacked: `[3·hidden, hidden]`.
    qkv: Dense,
    attention_out: Dense,
    attention_norm: LayerNorm,
    up: Dense,
    down: Dense,
    output_norm: LayerNorm,
}

impl Layer {
    fn load(w: &Weights, prefix: &str, config: &Config) -> Result<Self> {
        let (h, inter) = (config.hidden_size, config.intermediate_size);
        let eps = config.layer_norm_eps as f32;
        let mut qkv_weight = Vec::with_capacity(3 * h * h);
        let mut qkv_bias = Vec::with_capacity(3 * h);
        for part in ["query", "key", "value"] {
            let name = format!("{prefix}.attention.self.{part}");
            qkv_weight.extend(w.get(&format!("{name}.weight"), &[h, h])?);
            qkv_bias.extend(w.get(&format!("{name}.bias"), &[h])?);
        }
        Ok(Self {
            qkv: Dense::new(&qkv_weight, &qkv_bias, 3 * h, h),
            attention_out: w.dense(&format!("{prefix}.attention.output.dense"), h, h)?,
            attention_norm: LayerNorm::load(
                w,
                &format!("{prefix}.attention.output.LayerNorm"),
                h,
                eps,
            )?,
            up: w.dense(&format!("{prefix}.intermediate.dense"), inter, h)?,
            down: w.dense(&format!("{prefix}.output.dense"), h, inter)?,
            output_norm: LayerNorm::load(w, &format!("{prefix}.output.LayerNorm"), h, eps)?,
        })
    }

    /// Transforms `x` (`[tokens, hidden]`) in place.
    fn forward(&self, x: &mut [f32], seqs: &[Range<usize>], heads: usize, s: &mut Scratch) {
        self.qkv.forward(x, &mut s.qkv);
        let hidden = self.attention_out.out_features();
        attention(&s.qkv, seqs, hidden, heads, &mut s.scores, &mut s.context);
        self.attention_out.forward(&s.context, &mut s.projected);
        add_assign(x, &s.projected);
        self.attention_norm.forward(x);
        self.up.forward(x, &mut s.intermediate);
        s.intermediate.iter_mut().for_each(|v| *v = gelu(*v));
        self.down.forward(&s.intermediate, &mut s.projected);
        add_assign(x, &s.projected);
        self.output_norm.forward(x);
    }
}

/// The buffers of one pass, sized for its token count.
struct Scratch {
    qkv: Vec<f32>,
    context: Vec<f32>,
    projected: Vec<f32>,
    intermediate: Vec<f32>,
    /// One query's attention weights over its sequence.
    scores: Vec<f32>,
}

/// The encoder's weights.
pub struct BertEncoder {
    hidden: usize,
    heads: usize,
    vocab: usize,
    max_positions: usize,
    word: Vec<f32>,
    position: Vec<f32>,
    /// Row 0 of the token-type table: every token is of type 0.
    token_type: Vec<f32>,
    embedding_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl BertEncoder {
    /// Reads the weights from the bytes of a `model.safetensors`, with or without the `bert.`
    /// prefix that `BertFor*` checkpoints put on them.
    pub fn load(safetensors: &[u8], config: &Config) -> Result<Self> {
        if config.hidden_act != HiddenAct::Gelu {
            return Err(EngineError::Model(format!(
                "hidden_act {:?} is not supported, only exact gelu",
                config.hidden_act
            )));
        }
        // Absolute positions are the only kind candle's config can name; should it learn
        // others, this stops compiling rather than embedding them the wrong way.
        let PositionEmbeddingType::Absolute = config.position_embedding_type;
        let (h, heads) = (config.hidden_size, config.num_attention_heads);
        if heads == 0 || h % heads != 0 {
            return Err(EngineError::Model(format!(
                "hidden size {h} is not a multiple of {heads} heads"
            )));
        }
        let tensors = SliceSafetensors::new(safetensors)?;
        let prefix = if tensors
            .get("bert.embeddings.word_embeddings.weight")
            .is_ok()
        {
            "bert."
        } else {
            ""
        };
        let w = Weights { tensors, prefix };
        let eps = config.layer_norm_eps as f32;
        let (vocab, max_positions) = (config.vocab_size, config.max_position_embeddings);
        let token_types = w.get(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?;
        Ok(Self {
            hidden: h,
            heads,
            vocab,
            max_positions,
            word: w.get("embeddings.word_embeddings.weight", &[vocab, h])?,
            position: w.get("embeddings.position_embeddings.weight", &[max_positions, h])?,
            token_type: token_types[..h].to_vec(),
            embedding_norm: LayerNorm::load(&w, "embeddings.LayerNorm", h, eps)?,
            layers: (0..config.num_hidden_layers)
                .map(|i| Layer::load(&w, &format!("encoder.layer.{i}"), config))
                .collect::<Result<_>>()?,
        })
    }

    /// The last hidden states, `[tokens, hidden]` row-major, of the sequences `tokens[seqs[i]]`;
    /// `seqs` must tile `tokens` in order.
    pub fn forward(&self, tokens: &[u32], seqs: &[Range<usize>]) -> Result<Vec<f32>> {
        let h = self.hidden;
        debug_assert_eq!(seqs.last().map_or(0, |s| s.end), tokens.len());
        if let Some(long) = seqs.iter().find(|s| s.len() > self.max_positions) {
            return Err(EngineError::InvalidRequest(format!(
                "{} tokens exceed the model's {} positions",
                long.len(),
                self.max_positions
            )));
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= self.vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {id} is outside the vocabulary of {}",
                self.vocab
            )));
        }
        let n = tokens.len();
        let mut x = vec![0f32; n * h];
        for seq in seqs {
            for (pos, t) in seq.clone().enumerate() {
                let id = tokens[t] as usize;
                let word = &self.word[id * h..(id + 1) * h];
                let position = &self.position[pos * h..(pos + 1) * h];
                for (((v, &a), &b), &c) in x[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(word)
                    .zip(position)
                    .zip(&self.token_type)
                {
                    *v = a + c + b;
                }
            }
        }
        self.embedding_norm.forward(&mut x);
        let longest = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let inter = self.layers.first().map_or(0, |l| l.up.out_features());
        let mut scratch = Scratch {
            qkv: vec![0f32; n * 3 * h],
            context: vec![0f32; n * h],
            projected: vec![0f32; n * h],
            intermediate: vec![0f32; n * inter],
            scores: vec![0f32; longest],
        };
        for layer in &self.layers {
            layer.forward(&mut x, seqs, self.heads, &mut scratch);
        }
        Ok(x)
    }
}

/// Scaled dot-product attention of every head within every sequence. `qkv` rows are
/// `[q | k | v]`, each `hidden` wide and split into `heads` slices of `d`; the context of token
/// `i` in a head is `softmax(q_i kᵀ / √d) v` over its own sequence's tokens, written to that
/// head's slice of `context` row `i`. `scores` holds at least the longest sequence's length.
fn attention(
    qkv: &[f32],
    seqs: &[Range<usize>],
    hidden: usize,
    heads: usize,
    scores: &mut [f32],
    context: &mut [f32],
) {
    let d = hidden / heads;
    let sqrt_d = (d as f32).sqrt();
    let row = 3 * hidden;
    for seq in seqs {
        let scores = &mut scores[..seq.len()];
        for i in seq.clone() {
            for head in 0..heads {
                let q = &qkv[i * row + head * d..][..d];
                for (s, j) in scores.iter_mut().zip(seq.clone()) {
                    *s = dot(q, &qkv[j * row + hidden + head * d..][..d]) / sqrt_d;
                }
                softmax(scores);
                let out = &mut context[i * hidden + head * d..][..d];
                out.fill(0.0);
                for (&p, j) in scores.iter().zip(seq.clone()) {
                    let v = &qkv[j * row + 2 * hidden + head * d..][..d];
                    for (o, &v) in out.iter_mut().zip(v) {
                        *o += p * v;
                    }
                }
            }
        }
    }
}

/// In place, as `torch.softmax`: shifted by the maximum so that no `exp` overflows.
fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// A dot product with eight partial sums, so that it vectorises.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    let mut acc = [0f32; LANES];
    for (x, y) in ac.zip(bc) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x Φ(x)` with the exact normal CDF, as BERT's `gelu`.
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// The checkpoint's tensors, read as f32.
struct Weights<'a> {
    tensors: SliceSafetensors<'a>,
    prefix: &'static str,
}

impl Weights<'_> {
    /// The tensor `name`, which must have `shape`, row-major.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let full = format!("{}{name}", self.prefix);
        let t = self.tensors.load(&full, &Device::Cpu)?;
        if t.dims() != shape {
            return Err(EngineError::Model(format!(
                "{full} has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }

    /// A linear layer's `weight` and `bias`.
    fn dense(&self, prefix: &str, out_features: usize, in_features: usize) -> Result<Dense> {
        let weight = self.get(&format!("{prefix}.weight"), &[out_features, in_features])?;
        let bias = self.get(&format!("{prefix}.bias"), &[out_features])?;
        Ok(Dense::new(&weight, &bias, out_features, in_features))
    }
}

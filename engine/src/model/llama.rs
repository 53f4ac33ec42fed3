//! The llama architecture with a ragged-batch forward over a paged KV cache.
//!
//! Unlike candle's `quantized_llama`, the model holds only weights: the KV cache is passed in, and
//! one forward call takes any mix of sequences, each contributing a prefill chunk or one decode
//! token at its own positions (RoPE per token). Layers are candle building blocks (`rms_norm`,
//! `rope_i`, `silu`) around the batch-invariant [`Linear`] and the paged attention kernel.

use candle_core::{Device, Tensor, D};
use candle_nn::ops::rms_norm;
use candle_nn::rotary_emb::{rope, rope_i};

use super::attention::{paged_attention, SeqSlice};
use super::gguf::Gguf;
use super::linear::Linear;
use super::ForwardBatch;
use crate::kv_cache::{KvLayout, KvStorage};
use crate::{EngineError, Result};

/// Hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub num_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_dim: usize,
    /// NEOX rotation (pairs `i`, `i + d/2`) rather than interleaved pairs (`2i`, `2i + 1`).
    pub rope_neox: bool,
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads the hyper-parameters from metadata alone, without loading any tensor.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.string("general.architecture")?;
        if arch != "llama" {
            return Err(EngineError::Model(format!(
                "architecture {arch:?} is not supported (supported: llama)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = g.u32(&key("embedding_length"))? as usize;
        let n_heads = g.u32(&key("attention.head_count"))? as usize;
        let head_dim = hidden / n_heads;
        Ok(Self {
            hidden,
            intermediate: g.u32(&key("feed_forward_length"))? as usize,
            num_layers: g.u32(&key("block_count"))? as usize,
            n_heads,
            n_kv_heads: g.u32(&key("attention.head_count_kv"))? as usize,
            head_dim,
            vocab_size: g.tensor_dims("token_embd.weight")?[0],
            rms_eps: g.f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: g.f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: g
                .u32(&key("rope.dimension_count"))
                .map(|d| d as usize)
                .unwrap_or(head_dim),
            rope_neox: false,
            context_length: g.u32(&key("context_length"))? as usize,
        })
        .and_then(|c: Self| {
            if c.rope_dim != c.head_dim || !c.n_heads.is_multiple_of(c.n_kv_heads) {
                return Err(EngineError::Model(format!(
                    "unsupported head layout: {c:?}"
                )));
            }
            Ok(c)
        })
    }

    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            num_layers: self.num_layers,
            block_size,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    /// q, k and v fused: one pass over the activations.
    qkv: Linear,
    o: Linear,
    ffn_norm: Tensor,
    /// gate and up fused.
    gate_up: Linear,
    down: Linear,
}

pub struct Llama {
    config: LlamaConfig,
    /// Token embeddings; also the LM head when the GGUF ties them (no `output.weight`).
    embed: Linear,
    lm_head: Option<Linear>,
    layers: Vec<Layer>,
    norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

impl Llama {
    pub fn load(g: &mut Gguf) -> Result<Self> {
        let config = LlamaConfig::from_gguf(g)?;
        let device = Device::Cpu;
        let norm = |g: &mut Gguf, name: &str| -> Result<Tensor> {
            Ok(g.qtensor(name)?.dequantize(&device)?)
        };
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("blk.{i}");
            let (q, k, v) = (
                g.qtensor(&format!("{p}.attn_q.weight"))?,
                g.qtensor(&format!("{p}.attn_k.weight"))?,
                g.qtensor(&format!("{p}.attn_v.weight"))?,
            );
            let (gate, up) = (
                g.qtensor(&format!("{p}.ffn_gate.weight"))?,
                g.qtensor(&format!("{p}.ffn_up.weight"))?,
            );
            layers.push(Layer {
                attn_norm: norm(g, &format!("{p}.attn_norm.weight"))?,
                qkv: Linear::from_qtensors(&[&q, &k, &v])?,
                o: Linear::from_qtensor(&g.qtensor(&format!("{p}.attn_output.weight"))?)?,
                ffn_norm: norm(g, &format!("{p}.ffn_norm.weight"))?,
                gate_up: Linear::from_qtensors(&[&gate, &up])?,
                down: Linear::from_qtensor(&g.qtensor(&format!("{p}.ffn_down.weight"))?)?,
            });
        }
        let embed = Linear::from_qtensor(&g.qtensor("token_embd.weight")?)?;
        let lm_head = match g.has_tensor("output.weight") {
            true => Some(Linear::from_qtensor(&g.qtensor("output.weight")?)?),
            false => None,
        };
        let (cos, sin) = rope_tables(&config, &device)?;
        Ok(Self {
            norm: norm(g, "output_norm.weight")?,
            config,
            embed,
            lm_head,
            layers,
            cos,
            sin,
            device,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Runs the batch: writes every token's keys and values into `kv` and returns the logits of
    /// the rows listed in `batch.logits_rows`, `[rows, vocab]`.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut KvStorage) -> Result<Tensor> {
        let c = &self.config;
        let t = batch.tokens.len();
        let mut emb = Vec::with_capacity(t * c.hidden);
        for &tok in &batch.tokens {
            if tok as usize >= c.vocab_size {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {tok} out of range"
                )));
            }
            emb.extend(self.embed.row(tok as usize));
        }
        let mut x = Tensor::from_vec(emb, (t, c.hidden), &self.device)?;
        let positions = Tensor::new(batch.positions.as_slice(), &self.device)?;
        let cos = self.cos.index_select(&positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(&positions, 0)?.unsqueeze(1)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = self.layer_forward(layer, i, &x, &cos, &sin, &batch.seqs, kv)?;
        }
        let rows = Tensor::new(batch.logits_rows.as_slice(), &self.device)?;
        let x = rms_norm(&x.index_select(&rows, 0)?, &self.norm, c.rms_eps)?;
        Ok(self.lm_head.as_ref().unwrap_or(&self.embed).forward(&x)?)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        layer: &Layer,
        index: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        seqs: &[SeqSlice],
        kv: &mut KvStorage,
    ) -> Result<Tensor> {
        let c = &self.config;
        let t = x.dim(0)?;
        let (q_width, kv_width) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let h = rms_norm(x, &layer.attn_norm, c.rms_eps)?;
        let qkv = layer.qkv.forward(&h)?;
        let heads = |offset: usize, n: usize| -> Result<Tensor> {
            let part = qkv
                .narrow(D::Minus1, offset, n * c.head_dim)?
                .contiguous()?;
            Ok(part.reshape((t, n, 1, c.head_dim))?)
        };
        let q = self.rotate(&heads(0, c.n_heads)?, cos, sin)?;
        let k = self.rotate(&heads(q_width, c.n_kv_heads)?, cos, sin)?;
        let v = qkv.narrow(D::Minus1, q_width + kv_width, kv_width)?;

        let k = k.flatten_all()?.to_vec1::<f32>()?;
        let v = v.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let block_size = kv.layout().block_size;
        for seq in seqs {
            for i in 0..seq.len {
                let (row, pos) = (seq.start + i, seq.pos0 + i);
                let block = seq.blocks[pos / block_size];
                let span = row * kv_width..(row + 1) * kv_width;
                kv.write(index, block, pos % block_size, &k[span.clone()], &v[span]);
            }
        }
        let q = q.flatten_all()?.to_vec1::<f32>()?;
        let mut attn = vec![0f32; t * q_width];
        paged_attention(&q, kv, index, seqs, c.n_heads, &mut attn);
        let attn = Tensor::from_vec(attn, (t, q_width), &self.device)?;
        let x = (x + layer.o.forward(&attn)?)?;

        let h = rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
        let gate_up = layer.gate_up.forward(&h)?;
        let gate = gate_up.narrow(D::Minus1, 0, c.intermediate)?;
        let up = gate_up.narrow(D::Minus1, c.intermediate, c.intermediate)?;
        let act = (candle_nn::ops::silu(&gate)? * up)?;
        Ok((x + layer.down.forward(&act)?)?)
    }

    /// RoPE on `[tokens, heads, 1, head_dim]` with per-token `cos`/`sin` `[tokens, 1, dim/2]`.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        Ok(if self.config.rope_neox {
            rope(x, cos, sin)?
        } else {
            rope_i(x, cos, sin)?
        })
    }
}

/// cos/sin of `position * theta_i`, `[context_length, rope_dim / 2]`, computed as candle's
/// reference model does so positions rotate identically.
fn rope_tables(c: &LlamaConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..c.rope_dim)
        .step_by(2)
        .map(|i| 1f32 / c.rope_theta.powf(i as f32 / c.rope_dim as f32))
        .collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let angles = Tensor::arange(0, c.context_length as u32, device)?
        .to_dtype(candle_core::DType::F32)?
        .reshape((c.context_length, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

//! The llama and Gemma 3 architectures with a ragged-batch forward over a paged KV cache.
//!
//! Gemma 3 is llama with: a head size of its own (`attention.key_length`), RMS-normalised
//! queries and keys, a second norm after attention and after the feed-forward, GELU (tanh) in
//! place of SiLU, embeddings scaled by `sqrt(hidden)`, NEOX RoPE, and five of every six layers
//! attending over a sliding window with their own RoPE base (10,000; the global layers use
//! `rope.freq_base`). Its norms' weights are stored with Gemma's `1 +` already applied, so they
//! are plain RMS norms here.
//!
//! Unlike candle's `quantized_llama`, the model holds only weights: the KV cache is passed in, and
//! one forward call takes any mix of sequences, each contributing a prefill chunk or one decode
//! token at its own positions (RoPE per token). Layers are candle building blocks (`rms_norm`,
//! `rope_i`, `silu`) around the products and attention of one of two [`Backend`]s: on the CPU,
//! the batch-invariant [`Linear`] and the paged attention loop over a cache in RAM; on any device
//! (a GPU), candle's quantized matmul and [`paged_attention_ops`] over a cache of device tensors.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::ops::rms_norm;
use candle_nn::rotary_emb::{rope, rope_i};

use super::attention::{paged_attention, paged_attention_ops, DecodeAttention, SeqSlice};
use super::fused::{Gate, GatedLinear, NormedLinear};
use super::gguf::Gguf;
use super::linear::Linear;
use super::paged_kernel::kernel_fits;
use super::ForwardBatch;
use crate::kv_cache::{KvDtype, KvGroup, KvLayout, KvShape, KvStorage, LayerKv, Slots};
use crate::{EngineError, Result};

/// Which kernels run the model, and where its weights and KV cache live.
#[derive(Clone, Debug)]
pub enum Backend {
    /// The CPU kernels: batch-invariant quantized products, the paged attention loop, the KV
    /// cache as arrays in RAM. The fastest path on a CPU.
    Kernels,
    /// candle's operations on a device: matmuls with the weights in `weights`' form, attention
    /// from gathers and batched matmuls and the paged decode kernel, the KV cache as tensors in
    /// the device's memory. The GPU path; on `Device::Cpu` it is that path's reference.
    Tensors {
        device: Device,
        weights: DeviceWeights,
    },
}

impl Backend {
    pub fn device(&self) -> Device {
        match self {
            Self::Kernels => Device::Cpu,
            Self::Tensors { device, .. } => device.clone(),
        }
    }
}

/// The form of the weights on a device.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceWeights {
    /// Dequantized to f32 once at load, multiplied by cuBLAS GEMMs: the GGUF's values times f32
    /// activations (the CPU kernels quantize the activations first), at 4 bytes a weight.
    #[default]
    F32,
    /// Dequantized to f16, the activations rounded to f16 for each product: half the memory and
    /// bandwidth of f32, tensor-core GEMMs.
    F16,
    /// The GGUF's blocks as they are, candle's quantized kernels (8-bit activations against the
    /// blocks for a few rows, dequantizing for more): the least memory.
    Quantized,
}

impl std::fmt::Display for DeviceWeights {
    /// As `--gpu-weights` names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Quantized => "quantized",
        })
    }
}

/// One weight matrix (or several fused along the output), as the backend multiplies by it.
enum Proj {
    Kernels(Linear),
    /// The device path's matrices: one, or one per part when fused parts of different block
    /// formats are kept as blocks (Gemma's Q5_0 q and k beside its Q8_0 v), their outputs
    /// concatenated.
    Quantized(Vec<QMatMul>),
}

impl Proj {
    /// Fuses `parts`, which share their input size, into one product whose outputs are theirs
    /// concatenated (q/k/v, or gate/up): one pass over the activations instead of several.
    fn load(parts: &[&QTensor], backend: &Backend) -> Result<Self> {
        let (device, weights) = match backend {
            Backend::Kernels => return Ok(Self::Kernels(Linear::from_qtensors(parts)?)),
            Backend::Tensors { device, weights } => (device, weights),
        };
        let in_features = parts[0].shape().dims2()?.1;
        for part in parts {
            if part.shape().dims2()?.1 != in_features {
                return Err(EngineError::Model(
                    "fused weights disagree on input size".into(),
                ));
            }
        }
        // Parts of one block format concatenate byte for byte (GGML blocks never straddle
        // rows); each other format is a matrix of its own.
        let mut groups: Vec<Vec<&QTensor>> = Vec::new();
        for part in parts {
            match groups.last_mut() {
                Some(group) if group[0].dtype() == part.dtype() => group.push(part),
                _ => groups.push(vec![part]),
            }
        }
        let matrices = groups
            .into_iter()
            .map(|group| {
                let dtype = group[0].dtype();
                let mut bytes = Vec::new();
                let mut out_features = 0;
                for part in group {
                    bytes.extend_from_slice(&part.data()?);
                    out_features += part.shape().dims2()?.0;
                }
                let fused =
                    qtensor_from_ggml(dtype, &bytes, vec![out_features, in_features], device)?;
                Ok(match weights {
                    DeviceWeights::F32 => QMatMul::Tensor(fused.dequantize(device)?),
                    DeviceWeights::F16 => QMatMul::TensorF16(fused.dequantize_f16(device)?),
                    DeviceWeights::Quantized => QMatMul::QTensor(std::sync::Arc::new(fused)),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::Quantized(matrices))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Kernels(linear) => linear.forward(x)?,
            Self::Quantized(matrices) => match matrices.as_slice() {
                [one] => one.forward(x)?,
                many => {
                    let outputs = many
                        .iter()
                        .map(|m| m.forward(x))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Tensor::cat(&outputs, D::Minus1)?
                }
            },
        })
    }

    /// `forward(rms_norm(x, weight))`: on the CPU kernels, the norm fused into the activations'
    /// quantization.
    fn forward_normed(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        Ok(match self {
            Self::Kernels(linear) => x.apply_op2_no_bwd(weight, &NormedLinear { linear, eps })?,
            Self::Quantized(_) => self.forward(&rms_norm(x, weight, eps)?)?,
        })
    }

    /// `forward(gate(g)·u)` of rows `[g | u]`: on the CPU kernels, the activation and the
    /// product of the halves fused into the activations' quantization.
    fn forward_gated(&self, gate_up: &Tensor, gate: Gate) -> Result<Tensor> {
        if let Self::Kernels(linear) = self {
            return Ok(gate_up.apply_op1_no_bwd(&GatedLinear { linear, gate })?);
        }
        let width = gate_up.dim(D::Minus1)? / 2;
        let g = gate_up.narrow(D::Minus1, 0, width)?;
        let u = gate_up.narrow(D::Minus1, width, width)?;
        let g = match gate {
            Gate::Silu => candle_nn::ops::silu(&g)?,
            Gate::GeluTanh => g.gelu()?,
        };
        self.forward(&(g * u)?)
    }

    /// Bytes the weights take where they live.
    fn bytes(&self) -> usize {
        match self {
            Self::Kernels(linear) => linear.bytes(),
            Self::Quantized(matrices) => matrices
                .iter()
                .map(|m| match m {
                    QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => tensor_bytes(t),
                })
                .sum(),
        }
    }

    /// The rows of `ids`, dequantized: an embedding lookup. `[ids, in_features]`.
    fn rows(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        Ok(match self {
            Self::Kernels(linear) => {
                let width = linear.in_features();
                let rows = ids.iter().flat_map(|&id| linear.row(id as usize)).collect();
                Tensor::from_vec(rows, (ids.len(), width), device)?
            }
            Self::Quantized(matrices) => match matrices.as_slice() {
                [one] => one
                    .embedding(&Tensor::new(ids, device)?)?
                    .to_dtype(DType::F32)?,
                _ => {
                    return Err(EngineError::Model(
                        "an embedding table is one matrix".into(),
                    ))
                }
            },
        })
    }
}

/// The architectures the forward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Gemma3,
}

/// Gemma 3: every sixth layer attends globally, the others over the sliding window.
const GEMMA3_GLOBAL_EVERY: usize = 6;
/// Gemma 3's RoPE base for its sliding-window layers when the GGUF names none.
const GEMMA3_LOCAL_ROPE_THETA: f32 = 10_000.0;

/// Hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub arch: Arch,
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
    /// The sliding window of the layers that have one (Gemma 3), in positions.
    pub sliding_window: Option<usize>,
    /// The RoPE base of the sliding-window layers.
    pub rope_theta_local: f32,
}

impl LlamaConfig {
    /// An upper bound of the transient tensors of one step of at most `step_tokens` tokens and
    /// `running` sequences (f32): each token's activations through a layer and its logits, and
    /// the decode attention's gathered keys, values and scores at full context.
    pub fn activation_bytes(&self, step_tokens: usize, running: usize) -> usize {
        let c = self;
        let per_token = 4 * c.hidden
            + (c.n_heads + 2 * c.n_kv_heads) * c.head_dim * 2
            + 3 * c.intermediate
            + c.vocab_size;
        let attention =
            running * c.context_length * (2 * c.n_kv_heads * c.head_dim + 2 * c.n_heads);
        4 * (step_tokens * per_token + attention)
    }

    /// Whether the sliding-window layers rotate with RoPE tables of their own (a base of their
    /// own).
    fn has_local_rope(&self) -> bool {
        self.sliding_window.is_some() && self.rope_theta_local != self.rope_theta
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.arch {
            Arch::Gemma3 if !(layer + 1).is_multiple_of(GEMMA3_GLOBAL_EVERY) => self.sliding_window,
            _ => None,
        }
    }

    /// Reads the hyper-parameters from metadata alone, without loading any tensor.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let name = g.string("general.architecture")?;
        let arch = match name.as_str() {
            "llama" => Arch::Llama,
            "gemma3" => Arch::Gemma3,
            _ => {
                return Err(EngineError::Model(format!(
                    "architecture {name:?} is not supported (supported: llama, gemma3)"
                )))
            }
        };
        let key = |k: &str| format!("{name}.{k}");
        let hidden = g.u32(&key("embedding_length"))? as usize;
        let n_heads = g.u32(&key("attention.head_count"))? as usize;
        let head_dim = g
            .u32(&key("attention.key_length"))
            .map_or(hidden / n_heads, |d| d as usize);
        let gemma = arch == Arch::Gemma3;
        Ok(Self {
            arch,
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
            rope_neox: gemma,
            context_length: g.u32(&key("context_length"))? as usize,
            sliding_window: match gemma {
                true => match g.u32(&key("attention.sliding_window"))? {
                    // A window of nothing would leave every token nothing to attend to.
                    0 => return Err(EngineError::Model("attention.sliding_window is 0".into())),
                    w => Some(w as usize),
                },
                false => None,
            },
            rope_theta_local: g
                .f32(&key("rope.local_freq_base"))
                .unwrap_or(GEMMA3_LOCAL_ROPE_THETA),
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

    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> KvLayout {
        KvLayout::new(
            self.num_layers,
            block_size,
            self.n_kv_heads,
            self.head_dim,
            dtype,
        )
    }
}

struct Layer {
    attn_norm: Tensor,
    /// q, k and v fused.
    qkv: Proj,
    o: Proj,
    ffn_norm: Tensor,
    /// gate and up fused.
    gate_up: Proj,
    down: Proj,
    /// Gemma 3's norms of each query and key head, and after attention and the feed-forward.
    gemma: Option<GemmaNorms>,
}

struct GemmaNorms {
    q: Tensor,
    k: Tensor,
    post_attn: Tensor,
    post_ffn: Tensor,
}

pub struct Llama {
    config: LlamaConfig,
    /// Token embeddings; also the LM head when the GGUF ties them (no `output.weight`).
    embed: Proj,
    lm_head: Option<Proj>,
    layers: Vec<Layer>,
    norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// The sliding-window layers' tables, where their RoPE base differs.
    local_rope: Option<(Tensor, Tensor)>,
    device: Device,
    /// How the device path attends for decode tokens.
    decode: DecodeAttention,
    /// Every layer in one group: how a sequence with one block table keeps its cache.
    all_layers: Vec<Vec<usize>>,
    /// The groups of layers the cache keeps apart (see [`Llama::layer_groups`]).
    layer_groups: Vec<Vec<usize>>,
}

impl Llama {
    /// Loads the weights for `backend`, onto its device.
    pub fn load(g: &mut Gguf, backend: &Backend) -> Result<Self> {
        let config = LlamaConfig::from_gguf(g)?;
        let device = backend.device();
        let proj = |g: &mut Gguf, name: &str| -> Result<Proj> {
            Proj::load(&[&g.qtensor(name)?], backend)
        };
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
                qkv: Proj::load(&[&q, &k, &v], backend)?,
                o: proj(g, &format!("{p}.attn_output.weight"))?,
                ffn_norm: norm(g, &format!("{p}.ffn_norm.weight"))?,
                gate_up: Proj::load(&[&gate, &up], backend)?,
                down: proj(g, &format!("{p}.ffn_down.weight"))?,
                gemma: match config.arch {
                    Arch::Llama => None,
                    Arch::Gemma3 => Some(GemmaNorms {
                        q: norm(g, &format!("{p}.attn_q_norm.weight"))?,
                        k: norm(g, &format!("{p}.attn_k_norm.weight"))?,
                        post_attn: norm(g, &format!("{p}.post_attention_norm.weight"))?,
                        post_ffn: norm(g, &format!("{p}.post_ffw_norm.weight"))?,
                    }),
                },
            });
        }
        let embed = proj(g, "token_embd.weight")?;
        let lm_head = match g.has_tensor("output.weight") {
            true => Some(proj(g, "output.weight")?),
            false => None,
        };
        let (cos, sin) = rope_tables(&config, config.rope_theta, &device)?;
        let local_rope = match config.has_local_rope() {
            true => Some(rope_tables(&config, config.rope_theta_local, &device)?),
            false => None,
        };
        let decode = match kernel_fits(config.head_dim) {
            true => DecodeAttention::Kernel,
            false => DecodeAttention::Ops,
        };
        let all_layers = vec![(0..config.num_layers).collect()];
        let layer_groups = match embed {
            Proj::Kernels(_) => windowed_apart(&config),
            Proj::Quantized(_) => all_layers.clone(),
        };
        Ok(Self {
            norm: norm(g, "output_norm.weight")?,
            config,
            embed,
            all_layers,
            layer_groups,
            lm_head,
            layers,
            cos,
            sin,
            local_rope,
            device,
            decode,
        })
    }

    /// Chooses how the device path attends for decode tokens (the kernel where the head
    /// dimension suits it, by default); the CPU kernels ignore it.
    pub fn set_decode_attention(&mut self, decode: DecodeAttention) {
        self.decode = decode;
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Bytes the weights take on the device.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.o, &l.gate_up, &l.down]
                    .iter()
                    .map(|p| p.bytes())
                    .sum::<usize>()
                    + tensor_bytes(&l.attn_norm)
                    + tensor_bytes(&l.ffn_norm)
                    + l.gemma.as_ref().map_or(0, |n| {
                        [&n.q, &n.k, &n.post_attn, &n.post_ffn]
                            .map(tensor_bytes)
                            .iter()
                            .sum()
                    })
            })
            .sum();
        let local_rope = self
            .local_rope
            .as_ref()
            .map_or(0, |(cos, sin)| tensor_bytes(cos) + tensor_bytes(sin));
        layers
            + local_rope
            + self.embed.bytes()
            + self.lm_head.as_ref().map_or(0, Proj::bytes)
            + [&self.norm, &self.cos, &self.sin]
                .map(tensor_bytes)
                .iter()
                .sum::<usize>()
    }

    /// What [`Llama::weight_bytes`] is once the GGUF in `g` is loaded on a device in the form
    /// `weights`, from its tensor list alone: how a device is sized before anything is loaded
    /// (`swarmgate plan`, start-up). Vectors (the norms) are dequantized whatever the form; the
    /// RoPE tables come on top.
    pub fn device_weight_bytes(g: &Gguf, weights: DeviceWeights) -> Result<usize> {
        let c = LlamaConfig::from_gguf(g)?;
        let tables = if c.has_local_rope() { 2 } else { 1 };
        let rope = tables * 2 * c.context_length * (c.rope_dim / 2) * 4;
        let tensors = g.content().tensor_infos.values().map(|t| {
            let elems = t.shape.elem_count();
            match (t.shape.rank(), weights) {
                (1, _) | (_, DeviceWeights::F32) => 4 * elems,
                (_, DeviceWeights::F16) => 2 * elems,
                (_, DeviceWeights::Quantized) => {
                    elems / t.ggml_dtype.block_size() * t.ggml_dtype.type_size()
                }
            }
        });
        Ok(rope + tensors.sum::<usize>())
    }

    /// The shape and type of the cache this model's forward reads: f16 arrays for the CPU
    /// kernels, f32 tensors on the device otherwise.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        let dtype = match self.embed {
            Proj::Kernels(_) => KvDtype::F16,
            Proj::Quantized(_) => KvDtype::F32,
        };
        self.config.kv_layout(block_size, dtype)
    }

    /// The groups of layers whose blocks the cache keeps apart: in the arena the CPU kernels
    /// read, the layers attending over a sliding window (by window) apart from the others, so
    /// that the blocks a window has left behind can go; every layer in one group on a device.
    pub fn layer_groups(&self) -> &[Vec<usize>] {
        &self.layer_groups
    }

    /// How this model keeps its blocks in `kv` (see [`KvShape`]): every layer together, and
    /// when [`Llama::layer_groups`] keeps some apart, those groups with their windows; each with
    /// as many tokens a block as fit.
    pub fn kv_shape(&self, kv: &KvStorage) -> KvShape {
        let token = self.kv_layout(1);
        let whole = KvGroup::whole(kv.block_sizes(&token, &self.all_layers)[0]);
        let groups = &self.layer_groups;
        if groups.len() == 1 {
            return KvShape {
                whole,
                split: Vec::new(),
            };
        }
        let sizes = kv.block_sizes(&token, groups);
        let split = (groups.iter().zip(sizes))
            .map(|(layers, block_size)| KvGroup {
                block_size,
                window: self.config.window(layers[0]),
            })
            .collect();
        KvShape { whole, split }
    }

    /// A KV cache of `num_blocks` blocks of `block_size` tokens, where this model's forward reads
    /// it: arrays in RAM for the CPU kernels, tensors on the device otherwise.
    pub fn kv_storage(&self, block_size: usize, num_blocks: usize) -> Result<KvStorage> {
        let layout = self.kv_layout(block_size);
        Ok(match self.embed {
            Proj::Kernels(_) => KvStorage::new(layout, num_blocks),
            Proj::Quantized(_) => KvStorage::on_device(layout, num_blocks, &self.device)?,
        })
    }

    /// Runs the batch: writes every token's keys and values into `kv` and returns the logits of
    /// the rows listed in `batch.logits_rows`, `[rows, vocab]`.
    pub fn forward(&self, batch: &ForwardBatch, kv: &mut KvStorage) -> Result<Tensor> {
        let c = &self.config;
        if let Some(&tok) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {tok} out of range"
            )));
        }
        // One table a sequence: every layer in one group.
        let groups = match batch.seqs.len() {
            0 | 1 => &self.all_layers,
            _ => &self.layer_groups,
        };
        if batch.seqs.len() > 1 && batch.seqs.len() != groups.len() {
            return Err(EngineError::Model(format!(
                "{} block tables a sequence for {} layer groups",
                batch.seqs.len(),
                groups.len()
            )));
        }
        let sizes = kv.select(self.kv_layout(1), groups)?;
        let places = (batch.seqs.iter().zip(&sizes))
            .map(|(seqs, &bs)| {
                (seqs.iter())
                    .flat_map(|seq| {
                        (seq.pos0..seq.pos0 + seq.len).map(move |p| (seq.blocks[p / bs], p % bs))
                    })
                    .collect()
            })
            .collect();
        let slots = kv.slots(places)?;
        let mut x = self.embed.rows(&batch.tokens, &self.device)?;
        if c.arch == Arch::Gemma3 {
            x = (x * (c.hidden as f64).sqrt())?;
        }
        let positions = Tensor::new(batch.positions.as_slice(), &self.device)?;
        let at = |(cos, sin): (&Tensor, &Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((
                cos.index_select(&positions, 0)?.unsqueeze(1)?,
                sin.index_select(&positions, 0)?.unsqueeze(1)?,
            ))
        };
        let global = at((&self.cos, &self.sin))?;
        let local = match &self.local_rope {
            Some((cos, sin)) => Some(at((cos, sin))?),
            None => None,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let (cos, sin) = match (&local, c.window(i)) {
                (Some(local), Some(_)) => local,
                _ => &global,
            };
            let seqs = batch
                .seqs
                .get(kv.layer_group(i))
                .map_or(&[][..], Vec::as_slice);
            x = self.layer_forward(layer, i, &x, (cos, sin), (seqs, &slots), kv)?;
        }
        if batch.logits_rows.is_empty() {
            // Prefill chunks short of their prompts' ends: no row to run the head on. (On the
            // CPU: a device may refuse an allocation of nothing.)
            return Ok(Tensor::zeros((0, c.vocab_size), DType::F32, &Device::Cpu)?);
        }
        let rows = Tensor::new(batch.logits_rows.as_slice(), &self.device)?;
        let x = rms_norm(&x.index_select(&rows, 0)?, &self.norm, c.rms_eps)?;
        self.lm_head.as_ref().unwrap_or(&self.embed).forward(&x)
    }

    fn layer_forward(
        &self,
        layer: &Layer,
        index: usize,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        (seqs, slots): (&[SeqSlice], &Slots),
        kv: &mut KvStorage,
    ) -> Result<Tensor> {
        let c = &self.config;
        let t = x.dim(0)?;
        let (q_width, kv_width) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let qkv = layer.qkv.forward_normed(x, &layer.attn_norm, c.rms_eps)?;
        let heads = |offset: usize, n: usize| -> Result<Tensor> {
            let part = qkv
                .narrow(D::Minus1, offset, n * c.head_dim)?
                .contiguous()?;
            Ok(part.reshape((t, n, 1, c.head_dim))?)
        };
        let (mut q, mut k) = (heads(0, c.n_heads)?, heads(q_width, c.n_kv_heads)?);
        if let Some(n) = &layer.gemma {
            q = rms_norm(&q, &n.q, c.rms_eps)?;
            k = rms_norm(&k, &n.k, c.rms_eps)?;
        }
        let q = self.rotate(&q, cos, sin)?;
        let k = self.rotate(&k, cos, sin)?;
        let v = qkv.narrow(D::Minus1, q_width + kv_width, kv_width)?;

        kv.write(index, slots, &k.reshape((t, kv_width))?, &v)?;
        let attn = match kv.layer(index) {
            LayerKv::Arrays { keys, values } => {
                let q = q.flatten_all()?.to_vec1::<f32>()?;
                let mut attn = vec![0f32; t * q_width];
                let cache = (keys, values, kv.layer_layout(index));
                paged_attention(&q, cache, seqs, c.n_heads, c.window(index), &mut attn);
                Tensor::from_vec(attn, (t, q_width), &self.device)?
            }
            LayerKv::Tensors { keys, values } => {
                let q = q.reshape((t, q_width))?;
                let window = c.window(index);
                paged_attention_ops(&q, (keys, values), seqs, c.n_heads, window, self.decode)?
            }
        };
        let post = |y: Tensor, norm: fn(&GemmaNorms) -> &Tensor| -> Result<Tensor> {
            Ok(match &layer.gemma {
                Some(n) => rms_norm(&y, norm(n), c.rms_eps)?,
                None => y,
            })
        };
        let x = (x + post(layer.o.forward(&attn)?, |n| &n.post_attn)?)?;

        let gate_up = layer
            .gate_up
            .forward_normed(&x, &layer.ffn_norm, c.rms_eps)?;
        let gate = match c.arch {
            Arch::Llama => Gate::Silu,
            // The tanh approximation, as Gemma and llama.cpp compute it.
            Arch::Gemma3 => Gate::GeluTanh,
        };
        let down = layer.down.forward_gated(&gate_up, gate)?;
        Ok((x + post(down, |n| &n.post_ffn)?)?)
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

/// The layers of `c` by window, those without one first: each group's blocks hold only its
/// layers.
fn windowed_apart(c: &LlamaConfig) -> Vec<Vec<usize>> {
    let mut windows: Vec<Option<usize>> = (0..c.num_layers).map(|l| c.window(l)).collect();
    windows.sort();
    windows.dedup();
    (windows.into_iter())
        .map(|w| (0..c.num_layers).filter(|&l| c.window(l) == w).collect())
        .collect()
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// cos/sin of `position * theta_i` for RoPE base `base`, `[context_length, rope_dim / 2]`,
/// computed as candle's reference model does so positions rotate identically.
fn rope_tables(c: &LlamaConfig, base: f32, device: &Device) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..c.rope_dim)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / c.rope_dim as f32))
        .collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let angles = Tensor::arange(0, c.context_length as u32, device)?
        .to_dtype(candle_core::DType::F32)?
        .reshape((c.context_length, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{model_path, GEMMA3_GGUF, SMOLLM2_GGUF};

    /// The size a device is planned with, from the tensor list, is what loading takes, in every
    /// weight form (Gemma's second RoPE tables included).
    #[test]
    fn planned_weight_bytes_are_what_loading_takes() {
        for (model, weights) in [
            (SMOLLM2_GGUF, DeviceWeights::F32),
            (SMOLLM2_GGUF, DeviceWeights::F16),
            (SMOLLM2_GGUF, DeviceWeights::Quantized),
            (GEMMA3_GGUF, DeviceWeights::Quantized),
        ] {
            let path = model_path(model);
            let mut g = Gguf::open(&path).unwrap();
            let planned = Llama::device_weight_bytes(&g, weights).unwrap();
            let backend = Backend::Tensors {
                device: Device::Cpu,
                weights,
            };
            let loaded = Llama::load(&mut g, &backend).unwrap().weight_bytes();
            assert_eq!(planned, loaded, "{model} {weights:?}");
        }
    }
}

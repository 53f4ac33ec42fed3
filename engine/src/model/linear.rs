//! A quantized linear layer whose every output is computed the same way whatever the batch.
//!
//! Continuous batching mixes one sequence's tokens with everyone else's, so a sequence's logits
//! must not depend on how many rows share its matmul: otherwise a greedy request would answer
//! differently alone and in a crowd. General GEMMs (candle's `gemm`, the quantized `QMatMul`
//! paths) pick blockings, and so summation orders, by matrix shape. This kernel does not: each
//! output element is one fused multiply-add chain over `k` in order, starting from zero, so a
//! row's result is bit-identical for any batch size, tile size or thread count.
//!
//! Weights are kept 8-bit, ~1.25 bytes per weight, as `w = q * d + m` per block of 32 inputs
//! (`q` an i8, `d` and `m` f32). Q8_0, Q4_0 and Q4_1 GGUF blocks map onto this form exactly, so
//! the weights are the GGUF's own values, not an approximation; other formats are dequantized
//! and requantized (lossy, logged). Activations stay f32: unlike `QMatMul`, nothing quantizes
//! them.
//!
//! Layout: output features in panels of [`NR`] (32); for each panel and each block of 32 inputs
//! one [`Tile`] holding the 32 features' scales, offsets and `q[input][feature]`. The kernel
//! walks one panel for up to [`MR`] rows at a time, dequantizing each weight once per row tile
//! and reusing it for every row: batching saves the weight traffic that bounds decode.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};
use half::f16;
use rayon::prelude::*;

/// Output features per panel.
pub const NR: usize = 32;
/// Inputs per quantization block.
pub const QK: usize = 32;
/// Rows per register tile.
pub const MR: usize = 6;

/// One block of 32 inputs for one panel of 32 output features.
#[derive(Clone)]
#[repr(C, align(64))]
pub struct Tile {
    d: [f32; NR],
    m: [f32; NR],
    q: [[i8; NR]; QK],
}

impl Tile {
    const ZERO: Tile = Tile {
        d: [0.0; NR],
        m: [0.0; NR],
        q: [[0; NR]; QK],
    };
}

/// `y = x W^T` for `W` of shape `[out_features, in_features]`.
#[derive(Clone)]
pub struct Linear {
    out_features: usize,
    in_features: usize,
    /// `tiles[panel * k_blocks + block]`.
    tiles: Vec<Tile>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("out_features", &self.out_features)
            .field("in_features", &self.in_features)
            .finish()
    }
}

/// One row of 32 weights in `w = q * d + m` form.
struct BlockRow {
    d: f32,
    m: f32,
    q: [i8; QK],
}

impl Linear {
    /// Packs a GGUF weight of shape `[out_features, in_features]`.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Self> {
        Self::from_qtensors(&[t])
    }

    /// Packs several weights with the same input size as one layer whose outputs are their
    /// outputs concatenated (q/k/v, or gate/up): one pass over the activations instead of several.
    pub fn from_qtensors(parts: &[&QTensor]) -> candle_core::Result<Self> {
        let mut rows: Vec<Vec<BlockRow>> = Vec::new();
        let mut in_features = None;
        for t in parts {
            let (n, k) = t.shape().dims2()?;
            if *in_features.get_or_insert(k) != k {
                candle_core::bail!("fused weights disagree on input size");
            }
            if k % QK != 0 {
                candle_core::bail!("input size {k} is not a multiple of {QK}");
            }
            rows.extend(block_rows(t, n, k)?);
        }
        let in_features = in_features.unwrap_or(0);
        Ok(Self::pack(rows, in_features))
    }

    fn pack(rows: Vec<Vec<BlockRow>>, in_features: usize) -> Self {
        let out_features = rows.len();
        let kb = in_features / QK;
        let panels = out_features.div_ceil(NR);
        let mut tiles = vec![Tile::ZERO; panels * kb];
        for (feature, blocks) in rows.into_iter().enumerate() {
            let (panel, lane) = (feature / NR, feature % NR);
            for (b, block) in blocks.into_iter().enumerate() {
                let tile = &mut tiles[panel * kb + b];
                tile.d[lane] = block.d;
                tile.m[lane] = block.m;
                for (kk, q) in block.q.into_iter().enumerate() {
                    tile.q[kk][lane] = q;
                }
            }
        }
        Self {
            out_features,
            in_features,
            tiles,
        }
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes the packed weights take.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.tiles.as_slice())
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// One output feature's weights (a row of `W`), as f32: the embedding lookup of a tied
    /// embedding / LM head.
    pub fn row(&self, feature: usize) -> Vec<f32> {
        let kb = self.in_features / QK;
        let (panel, lane) = (feature / NR, feature % NR);
        let mut out = Vec::with_capacity(self.in_features);
        for tile in &self.tiles[panel * kb..(panel + 1) * kb] {
            for q in &tile.q {
                out.push((q[lane] as f32).mul_add(tile.d[lane], tile.m[lane]));
            }
        }
        out
    }

    /// `x` is `[rows, in_features]` f32 and contiguous; returns `[rows, out_features]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.apply_op1_no_bwd(self)
    }

    /// The kernel on plain slices: `dst[rows * out_features] = x[rows * in_features] W^T`.
    pub fn matmul(&self, x: &[f32], dst: &mut [f32]) {
        let (k, n) = (self.in_features, self.out_features);
        let rows = x.len() / k;
        assert_eq!(x.len(), rows * k, "input is not a whole number of rows");
        assert_eq!(dst.len(), rows * n, "output size mismatch");
        let kb = k / QK;
        let dst_ptr = SendPtr(dst.as_mut_ptr());
        let panels = n.div_ceil(NR);
        // Enough work per task to amortise scheduling, enough tasks to keep both cores busy.
        let min_len = (64 / rows.max(1)).max(1);
        (0..panels)
            .into_par_iter()
            .with_min_len(min_len)
            .for_each(|panel| {
                let tiles = &self.tiles[panel * kb..(panel + 1) * kb];
                let cols = NR.min(n - panel * NR);
                let mut r0 = 0;
                while r0 < rows {
                    let mr = MR.min(rows - r0);
                    let mut acc = [[0f32; NR]; MR];
                    panel_kernel(tiles, &x[r0 * k..(r0 + mr) * k], k, mr, &mut acc);
                    for (i, acc_row) in acc.iter().enumerate().take(mr) {
                        // SAFETY: each (row, panel) output range is written by exactly one task.
                        unsafe {
                            let p = dst_ptr.get().add((r0 + i) * n + panel * NR);
                            std::ptr::copy_nonoverlapping(acc_row.as_ptr(), p, cols);
                        }
                    }
                    r0 += mr;
                }
            });
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint output ranges to rayon tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

impl CustomOp1 for Linear {
    fn name(&self) -> &'static str {
        "swarmgate-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = s else {
            candle_core::bail!("linear expects f32 activations");
        };
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("linear expects contiguous activations");
        };
        let dims = l.shape().dims();
        let Some((&k, lead)) = dims.split_last() else {
            candle_core::bail!("linear expects at least one dimension");
        };
        if k != self.in_features {
            candle_core::bail!("linear expects {} inputs, got {k}", self.in_features);
        }
        let x = &data[start..end];
        let mut dst = vec![0f32; x.len() / k * self.out_features];
        self.matmul(x, &mut dst);
        let mut shape = lead.to_vec();
        shape.push(self.out_features);
        Ok((CpuStorage::F32(dst), Shape::from(shape)))
    }
}

/// Accumulates `acc[i][j] = sum_k x[i][k] * w[j][k]` for `mr` rows and one panel.
fn panel_kernel(tiles: &[Tile], x: &[f32], k: usize, mr: usize, acc: &mut [[f32; NR]; MR]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was just detected.
        unsafe {
            match mr {
                1 => avx512::panel::<1>(tiles, x, k, acc),
                2 => avx512::panel::<2>(tiles, x, k, acc),
                3 => avx512::panel::<3>(tiles, x, k, acc),
                4 => avx512::panel::<4>(tiles, x, k, acc),
                5 => avx512::panel::<5>(tiles, x, k, acc),
                _ => avx512::panel::<6>(tiles, x, k, acc),
            }
        }
        return;
    }
    portable_panel(tiles, x, k, mr, acc)
}

/// The reference semantics of the kernel; SIMD versions must give bit-identical results.
fn portable_panel(tiles: &[Tile], x: &[f32], k: usize, mr: usize, acc: &mut [[f32; NR]; MR]) {
    for (b, tile) in tiles.iter().enumerate() {
        for (kk, q) in tile.q.iter().enumerate() {
            let mut w = [0f32; NR];
            for j in 0..NR {
                w[j] = (q[j] as f32).mul_add(tile.d[j], tile.m[j]);
            }
            for (i, acc_row) in acc.iter_mut().enumerate().take(mr) {
                let xv = x[i * k + b * QK + kk];
                for j in 0..NR {
                    acc_row[j] = xv.mul_add(w[j], acc_row[j]);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Tile, MR, NR, QK};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel<const R: usize>(
        tiles: &[Tile],
        x: &[f32],
        k: usize,
        acc: &mut [[f32; NR]; MR],
    ) {
        debug_assert!(x.len() >= R * k);
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        let xp = x.as_ptr();
        for (b, tile) in tiles.iter().enumerate() {
            let d_lo = _mm512_loadu_ps(tile.d.as_ptr());
            let d_hi = _mm512_loadu_ps(tile.d.as_ptr().add(16));
            let m_lo = _mm512_loadu_ps(tile.m.as_ptr());
            let m_hi = _mm512_loadu_ps(tile.m.as_ptr().add(16));
            for kk in 0..QK {
                let q = tile.q[kk].as_ptr() as *const __m128i;
                let q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
                let q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(1))));
                let w_lo = _mm512_fmadd_ps(q_lo, d_lo, m_lo);
                let w_hi = _mm512_fmadd_ps(q_hi, d_hi, m_hi);
                let col = b * QK + kk;
                for i in 0..R {
                    let xv = _mm512_set1_ps(*xp.add(i * k + col));
                    lo[i] = _mm512_fmadd_ps(xv, w_lo, lo[i]);
                    hi[i] = _mm512_fmadd_ps(xv, w_hi, hi[i]);
                }
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(acc[i].as_mut_ptr(), lo[i]);
            _mm512_storeu_ps(acc[i].as_mut_ptr().add(16), hi[i]);
        }
    }
}

/// Reads a GGUF weight as rows of `w = q * d + m` blocks.
fn block_rows(t: &QTensor, n: usize, k: usize) -> candle_core::Result<Vec<Vec<BlockRow>>> {
    let kb = k / QK;
    let exact = |bytes_per_block: usize, decode: &dyn Fn(&[u8]) -> BlockRow| {
        let data = t.data()?;
        if data.len() != n * kb * bytes_per_block {
            candle_core::bail!("unexpected {:?} tensor size {}", t.dtype(), data.len());
        }
        Ok(data
            .chunks_exact(kb * bytes_per_block)
            .map(|row| row.chunks_exact(bytes_per_block).map(decode).collect())
            .collect())
    };
    let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    match t.dtype() {
        GgmlDType::Q8_0 => exact(2 + QK, &|b| BlockRow {
            d: half(b),
            m: 0.0,
            q: std::array::from_fn(|j| b[2 + j] as i8),
        }),
        GgmlDType::Q4_0 => exact(2 + QK / 2, &|b| BlockRow {
            d: half(b),
            m: 0.0,
            q: std::array::from_fn(|j| nibble(&b[2..], j) as i8 - 8),
        }),
        GgmlDType::Q4_1 => exact(4 + QK / 2, &|b| BlockRow {
            d: half(b),
            m: half(&b[2..]),
            q: std::array::from_fn(|j| nibble(&b[4..], j) as i8),
        }),
        other => {
            tracing::warn!(dtype = ?other, "weights requantized to 8 bits: not bit-exact");
            let values = t
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok(values
                .chunks_exact(k)
                .map(|row| row.chunks_exact(QK).map(requantize).collect())
                .collect())
        }
    }
}

/// Element `j` of a 32-value block packed as 16 bytes: low nibbles first, then high nibbles.
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < QK / 2 {
        qs[j] & 0x0f
    } else {
        qs[j - QK / 2] >> 4
    }
}

/// Asymmetric 8-bit quantization of 32 values: `v ~= q * d + m`.
fn requantize(values: &[f32]) -> BlockRow {
    let lo = values.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mid = (lo + hi) / 2.0;
    let d = (hi - lo) / 254.0;
    let q = std::array::from_fn(|j| {
        if d == 0.0 {
            0
        } else {
            ((values[j] - mid) / d).round().clamp(-127.0, 127.0) as i8
        }
    });
    BlockRow { d, m: mid, q }
}

/// Used by tests and tools that need a layer without a GGUF.
impl Linear {
    pub fn from_f32(weights: &[f32], out_features: usize, in_features: usize) -> Self {
        assert_eq!(weights.len(), out_features * in_features);
        assert_eq!(in_features % QK, 0);
        let rows = weights
            .chunks_exact(in_features)
            .map(|row| row.chunks_exact(QK).map(requantize).collect())
            .collect();
        Self::pack(rows, in_features)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layer(n: usize, k: usize, seed: u64) -> Linear {
        let mut s = seed;
        let w: Vec<f32> = (0..n * k)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        Linear::from_f32(&w, n, k)
    }

    fn input(rows: usize, k: usize) -> Vec<f32> {
        (0..rows * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect()
    }

    #[test]
    fn matches_dequantized_reference() {
        let (n, k, rows) = (70, 96, 3);
        let lin = layer(n, k, 7);
        let x = input(rows, k);
        let mut y = vec![0f32; rows * n];
        lin.matmul(&x, &mut y);
        for r in 0..rows {
            for j in 0..n {
                let w = lin.row(j);
                let expect: f32 = (0..k).map(|c| x[r * k + c] * w[c]).sum();
                assert!((y[r * n + j] - expect).abs() < 1e-4, "{r},{j}");
            }
        }
    }

    #[test]
    fn simd_matches_portable_bit_for_bit() {
        let (n, k) = (64, 128);
        let lin = layer(n, k, 3);
        let x = input(MR, k);
        for mr in 1..=MR {
            let tiles = &lin.tiles[0..k / QK];
            let mut a = [[0f32; NR]; MR];
            let mut b = [[0f32; NR]; MR];
            panel_kernel(tiles, &x, k, mr, &mut a);
            portable_panel(tiles, &x, k, mr, &mut b);
            assert_eq!(a[..mr], b[..mr]);
        }
    }

    proptest! {
        /// A row's output does not depend on which rows share its batch.
        #[test]
        fn batch_invariant(rows in 1usize..20, pick in 0usize..20) {
            let (n, k) = (96, 64);
            let lin = layer(n, k, 11);
            let x = input(rows, k);
            let mut all = vec![0f32; rows * n];
            lin.matmul(&x, &mut all);
            let r = pick % rows;
            let mut one = vec![0f32; n];
            lin.matmul(&x[r * k..(r + 1) * k], &mut one);
            prop_assert_eq!(&all[r * n..(r + 1) * n], &one[..]);
        }
    }
}

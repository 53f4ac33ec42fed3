//! A quantized linear layer computing ggml's integer dot products, each output the same way
//! whatever the batch.
//!
//! Weights stay as their GGUF blocks hold them: per block of 32 inputs, integer codes `u` with a
//! scale `d` and an offset `m` (f16, as in the file), `w = d·(u − z) + m`, where the zero point
//! `z` is the format's (Q4_1: 0 with its minimum as `m`; Q4_0: 8; Q8_0: 128, its signed codes
//! shifted to unsigned; Q5_0: 16 and Q5_1: 0, their 5-bit codes held as bytes). The K-quants
//! Q4_K, Q5_K and Q6_K keep their super-blocks of 256 ([`super::super_blocks`]); other formats,
//! and K-quants fused with other formats, are dequantized and requantized to 8 bits (lossy,
//! logged).
//!
//! Activations are quantized per row the way ggml quantizes them before its dot products (Q8_1
//! on x86: per block of 32, `q = round_half_even(x · 127/amax)`, `d = amax/127` and `s = d·Σq`,
//! both kept as f16), so each block's product is llama.cpp's: an exact integer dot
//! `Σu·q − z·Σq` (AVX-512 VNNI: 64 byte products summed per instruction), times `d_w·d_x`,
//! plus `m·s`. Our logits follow llama.cpp's, not an f32 reference's.
//!
//! Batch invariance: a row's quantization depends on that row alone, the integer dots are exact,
//! and each output's floating-point part is one fused multiply-add chain over the blocks in
//! order, from zero. So a row's result is bit-identical for any batch size, tile size or thread
//! count, and the SIMD kernel equals the portable one bit for bit (a test holds it so).
//!
//! Layout: output features in panels of [`NR`] (32); per panel and block one [`Tile`] with the
//! 32 features' scales and offsets and their codes as the VNNI instruction reads them: 16
//! features × 4 consecutive inputs per 64-byte vector. 4-bit codes go two to a byte, inputs 0-15
//! in the low nibbles and 16-31 in the high ones, as in the GGUF: 0.625 bytes a weight, the
//! file's own size. The kernel walks one panel for up to [`MR`] rows at a time, each weight
//! vector loaded once for every row of the tile: batching saves the weight traffic that bounds
//! decode.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};
use half::f16;

use super::fused::{Input, Prepared};
use super::super_blocks::{SuperActivations, SuperTiles, QK_K};
use crate::team::{self, SendPtr};

/// Output features per panel.
pub const NR: usize = 32;
/// Inputs per quantization block.
pub const QK: usize = 32;
/// Rows per register tile.
pub const MR: usize = 4;
/// Tiles (one panel's weights for one block of inputs, times the rows) below which a task is
/// not split further.
const MIN_TASK_TILES: usize = 64;
/// Features per vector of sums (16 × i32 in 512 bits).
const LANES: usize = 16;
/// Code bytes of a tile of 4-bit codes.
const FOUR: usize = NR * QK / 2;
/// Code bytes of a tile of 8-bit codes.
const EIGHT: usize = NR * QK;

/// One block of 32 inputs for one panel of 32 output features; `B` bytes of codes.
#[derive(Clone)]
#[repr(C, align(64))]
pub struct Tile<const B: usize> {
    d: [f16; NR],
    m: [f16; NR],
    q: [u8; B],
}

impl<const B: usize> Tile<B> {
    const ZERO: Self = Self {
        d: [f16::ZERO; NR],
        m: [f16::ZERO; NR],
        q: [0; B],
    };
    const MASK: u8 = if B == FOUR { 0x0f } else { 0xff };

    /// The byte holding feature `lane`'s code for input `kk`, and the code's shift in it.
    fn place(lane: usize, kk: usize) -> (usize, u32) {
        let (half, f) = (lane / LANES, lane % LANES);
        if B == FOUR {
            let vector = half * 4 + (kk % 16) / 4;
            (vector * 64 + f * 4 + kk % 4, 4 * (kk / 16) as u32)
        } else {
            let vector = half * 8 + kk / 4;
            (vector * 64 + f * 4 + kk % 4, 0)
        }
    }

    fn code(&self, lane: usize, kk: usize) -> i32 {
        let (byte, shift) = Self::place(lane, kk);
        ((self.q[byte] >> shift) & Self::MASK) as i32
    }

    fn set_code(&mut self, lane: usize, kk: usize, u: u8) {
        let (byte, shift) = Self::place(lane, kk);
        self.q[byte] |= (u & Self::MASK) << shift;
    }
}

/// The packed weights, by code width.
#[derive(Clone)]
enum Tiles {
    Four(Vec<Tile<FOUR>>),
    Eight(Vec<Tile<EIGHT>>),
    /// K-quant super-blocks of 256 inputs.
    Super(SuperTiles),
}

/// `y = x W^T` for `W` of shape `[out_features, in_features]`.
#[derive(Clone)]
pub struct Linear {
    out_features: usize,
    in_features: usize,
    /// The zero point `z` of every block.
    zero: i32,
    /// `tiles[panel * k_blocks + block]`.
    tiles: Tiles,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("out_features", &self.out_features)
            .field("in_features", &self.in_features)
            .field("bits", &self.bits())
            .finish()
    }
}

/// One row of 32 weights, `w = d·(u − z) + m`.
struct BlockRow {
    d: f16,
    m: f16,
    u: [u8; QK],
}

/// A weight matrix as rows of blocks, all of one code width and zero point.
struct Blocks {
    bits: u32,
    zero: i32,
    rows: Vec<Vec<BlockRow>>,
}

impl Blocks {
    /// The same weights as 8-bit codes around zero point `zero`: every code shifted by the
    /// difference, which `d·(u − z) + m` leaves exact. `None` when a code would leave 0..=255
    /// (8-bit codes of another zero point).
    fn rebase(mut self, zero: i32) -> Option<Self> {
        let shift = u8::try_from(zero - self.zero).ok()?;
        for block in self.rows.iter_mut().flatten() {
            for u in &mut block.u {
                *u = u.checked_add(shift)?;
            }
        }
        self.bits = 8;
        self.zero = zero;
        Some(self)
    }
}

impl Linear {
    /// Packs a GGUF weight of shape `[out_features, in_features]`.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Self> {
        Self::from_qtensors(&[t])
    }

    /// Packs several weights with the same input size as one layer whose outputs are their
    /// outputs concatenated (q/k/v, or gate/up): one pass over the activations instead of several.
    /// Parts of different formats are held as 8-bit codes around one zero point where their
    /// codes allow it exactly (Gemma's Q5_0 q and k beside its Q8_0 v: see [`Blocks::rebase`]),
    /// else all requantized to 8 bits.
    pub fn from_qtensors(parts: &[&QTensor]) -> candle_core::Result<Self> {
        let mut in_features = None;
        for t in parts {
            let (_, k) = t.shape().dims2()?;
            if *in_features.get_or_insert(k) != k {
                candle_core::bail!("fused weights disagree on input size");
            }
            if k % QK != 0 {
                candle_core::bail!("input size {k} is not a multiple of {QK}");
            }
        }
        let in_features = in_features.unwrap_or(0);
        if let [one] = parts {
            if let Some(tiles) = SuperTiles::from_qtensor(one)? {
                return Ok(Self {
                    out_features: one.shape().dims2()?.0,
                    in_features,
                    zero: 0,
                    tiles: Tiles::Super(tiles),
                });
            }
        }
        let mut each = parts
            .iter()
            .map(|t| blocks(t))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let form = |b: &Blocks| (b.bits, b.zero);
        if !each.windows(2).all(|w| form(&w[0]) == form(&w[1])) {
            each = match each.into_iter().map(|b| b.rebase(128)).collect() {
                Some(rebased) => rebased,
                None => parts
                    .iter()
                    .map(|t| requantized_blocks(t))
                    .collect::<candle_core::Result<_>>()?,
            };
        }
        let mut each = each.into_iter();
        let mut all = each.next().unwrap_or(Blocks {
            bits: 8,
            zero: 0,
            rows: Vec::new(),
        });
        for blocks in each {
            all.rows.extend(blocks.rows);
        }
        Ok(Self::pack(all, in_features))
    }

    fn pack(blocks: Blocks, in_features: usize) -> Self {
        let out_features = blocks.rows.len();
        let tiles = if blocks.bits == 4 {
            Tiles::Four(pack_tiles(&blocks.rows, in_features))
        } else {
            Tiles::Eight(pack_tiles(&blocks.rows, in_features))
        };
        Self {
            out_features,
            in_features,
            zero: blocks.zero,
            tiles,
        }
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Bits per code.
    pub fn bits(&self) -> u32 {
        match &self.tiles {
            Tiles::Four(_) => 4,
            Tiles::Eight(_) => 8,
            Tiles::Super(t) => t.bits(),
        }
    }

    /// Bytes the packed weights take.
    pub fn bytes(&self) -> usize {
        match &self.tiles {
            Tiles::Four(t) => std::mem::size_of_val(t.as_slice()),
            Tiles::Eight(t) => std::mem::size_of_val(t.as_slice()),
            Tiles::Super(t) => std::mem::size_of_val(t.tiles.as_slice()),
        }
    }

    /// One output feature's weights (a row of `W`), as f32: the embedding lookup of a tied
    /// embedding / LM head.
    pub fn row(&self, feature: usize) -> Vec<f32> {
        match &self.tiles {
            Tiles::Four(t) => self.row_of(t, feature),
            Tiles::Eight(t) => self.row_of(t, feature),
            Tiles::Super(t) => t.row(feature, self.in_features),
        }
    }

    fn row_of<const B: usize>(&self, tiles: &[Tile<B>], feature: usize) -> Vec<f32> {
        let kb = self.in_features / QK;
        let (panel, lane) = (feature / NR, feature % NR);
        let mut out = Vec::with_capacity(self.in_features);
        for tile in &tiles[panel * kb..(panel + 1) * kb] {
            let (d, m) = (tile.d[lane].to_f32(), tile.m[lane].to_f32());
            for kk in 0..QK {
                let u = (tile.code(lane, kk) - self.zero) as f32;
                out.push(u.mul_add(d, m));
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
        self.matmul_input(Input::Rows(x), dst)
    }

    /// The kernel on inputs computed as they are quantized (see [`Input`]):
    /// `dst[rows * out_features] = input[rows * in_features] W^T`.
    pub fn matmul_input(&self, input: Input, dst: &mut [f32]) {
        let (k, n) = (self.in_features, self.out_features);
        let rows = input.rows(k).expect("input is not a whole number of rows");
        assert_eq!(dst.len(), rows * n, "output size mismatch");
        let input = input.prepare(k);
        match &self.tiles {
            Tiles::Four(t) => self.matmul_tiles(t, &input, dst),
            Tiles::Eight(t) => self.matmul_tiles(t, &input, dst),
            Tiles::Super(t) => {
                let acts = SuperActivations::quantize(&input);
                let kb = k / QK_K;
                self.by_panels(k / QK, rows, dst, |panel, r0, mr, acc| {
                    let tiles = &t.tiles[panel * kb..(panel + 1) * kb];
                    t.panel(tiles, acts.rows(r0, mr, k), mr, acc)
                })
            }
        }
    }

    fn matmul_tiles<const B: usize>(&self, tiles: &[Tile<B>], input: &Prepared, dst: &mut [f32]) {
        let (k, zero) = (self.in_features, self.zero);
        let kb = k / QK;
        let acts = Activations::quantize(input);
        self.by_panels(kb, input.rows(), dst, |panel, r0, mr, acc| {
            let tiles = &tiles[panel * kb..(panel + 1) * kb];
            panel_kernel(tiles, zero, acts.rows(r0, mr, k), mr, acc)
        })
    }

    /// Runs `kernel(panel, r0, mr, acc)` for every panel of output features and every tile of
    /// up to [`MR`] rows, in parallel, and writes each tile's sums to `dst`. `kb`: blocks of 32
    /// inputs, the measure of a panel's work.
    fn by_panels(
        &self,
        kb: usize,
        rows: usize,
        dst: &mut [f32],
        kernel: impl Fn(usize, usize, usize, &mut [[f32; NR]; MR]) + Sync,
    ) {
        let n = self.out_features;
        let dst_ptr = SendPtr::new(dst);
        let panels = n.div_ceil(NR);
        // Enough work per task to amortise scheduling (about MIN_TASK_TILES tiles of 32 x 32
        // weights times the rows), enough tasks to keep every core busy: a single row's
        // matrix-vector product splits too, not only the wide ones.
        let min_len = MIN_TASK_TILES.div_ceil(kb * rows.max(1)).max(1);
        team::for_each(panels.div_ceil(min_len), |task| {
            for panel in task * min_len..((task + 1) * min_len).min(panels) {
                let cols = NR.min(n - panel * NR);
                let mut r0 = 0;
                while r0 < rows {
                    let mr = MR.min(rows - r0);
                    let mut acc = [[0f32; NR]; MR];
                    kernel(panel, r0, mr, &mut acc);
                    for (i, acc_row) in acc.iter().enumerate().take(mr) {
                        // SAFETY: each (row, panel) output range is written by exactly one task.
                        unsafe {
                            let p = dst_ptr.get().add((r0 + i) * n + panel * NR);
                            std::ptr::copy_nonoverlapping(acc_row.as_ptr(), p, cols);
                        }
                    }
                    r0 += mr;
                }
            }
        });
    }
}

fn pack_tiles<const B: usize>(rows: &[Vec<BlockRow>], in_features: usize) -> Vec<Tile<B>> {
    let kb = in_features / QK;
    let panels = rows.len().div_ceil(NR);
    let mut tiles = vec![Tile::<B>::ZERO; panels * kb];
    for (feature, blocks) in rows.iter().enumerate() {
        let (panel, lane) = (feature / NR, feature % NR);
        for (b, block) in blocks.iter().enumerate() {
            let tile = &mut tiles[panel * kb + b];
            tile.d[lane] = block.d;
            tile.m[lane] = block.m;
            for (kk, &u) in block.u.iter().enumerate() {
                tile.set_code(lane, kk, u);
            }
        }
    }
    tiles
}

/// A block of 32 activations' scale (`d`, f16-rounded), `s = d·Σq` (f16-rounded) and `Σq`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct BlockScale {
    d: f32,
    s: f32,
    sum: i32,
}

/// Rows of activations quantized to 8 bits per block of 32, as ggml's Q8_1.
struct Activations {
    codes: Vec<i8>,
    scales: Vec<BlockScale>,
}

impl Activations {
    fn quantize(input: &Prepared) -> Self {
        let (rows, k) = (input.rows(), input.k());
        let kb = k / QK;
        let mut codes = vec![0i8; rows * k];
        let mut scales = vec![BlockScale::default(); rows * kb];
        // Parallel only for long prefills: a few hundred blocks take a microsecond.
        const PER_TASK: usize = 1024;
        let mut parts: Vec<_> = (codes.chunks_mut(QK * PER_TASK))
            .zip(scales.chunks_mut(PER_TASK))
            .enumerate()
            .collect();
        team::for_each_mut(&mut parts, |(task, (q, scales))| {
            let mut x = [0f32; QK];
            let blocks = q.chunks_exact_mut(QK).zip(scales.iter_mut());
            for (i, (q, scale)) in blocks.enumerate() {
                let block = *task * PER_TASK + i;
                input.fill(block / kb, block % kb * QK, &mut x);
                *scale = quantize_block(&x, q);
            }
        });
        Self { codes, scales }
    }

    /// Rows `r0..r0 + mr` of rows of `k` inputs.
    fn rows(&self, r0: usize, mr: usize, k: usize) -> RowTile<'_> {
        let kb = k / QK;
        RowTile {
            codes: &self.codes[r0 * k..(r0 + mr) * k],
            scales: &self.scales[r0 * kb..(r0 + mr) * kb],
        }
    }
}

/// ggml's x86 Q8_1 quantization of one block: `q = round_half_even(x · 127/amax)`.
fn quantize_block(x: &[f32], q: &mut [i8]) -> BlockScale {
    // The maximum over eight lanes, then over those: the same value in any order (a maximum is
    // exact), without one long chain of dependent comparisons.
    let mut lanes = [0f32; 8];
    for chunk in x.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(0f32, |a, &m| a.max(m));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
        sum += *q as i32;
    }
    BlockScale {
        d: f16::from_f32(d).to_f32(),
        s: f16::from_f32(d * sum as f32).to_f32(),
        sum,
    }
}

/// Up to [`MR`] rows of quantized activations: `codes[row * k + input]`, `scales[row * kb + b]`.
#[derive(Clone, Copy)]
struct RowTile<'a> {
    codes: &'a [i8],
    scales: &'a [BlockScale],
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

/// Calls a SIMD `panel::<..., R>` kernel (its other const generics in brackets) with its `R`
/// rows (`mr`, 1 to [`MR`]) as a constant.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($($panel:ident)::+, [$($g:expr),*], $mr:expr, ($($arg:expr),+)) => {
        match $mr {
            1 => $($panel)::+::<$({ $g },)* 1>($($arg),+),
            2 => $($panel)::+::<$({ $g },)* 2>($($arg),+),
            3 => $($panel)::+::<$({ $g },)* 3>($($arg),+),
            _ => $($panel)::+::<$({ $g },)* 4>($($arg),+),
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use by_rows;

/// Accumulates `acc[i][j] = Σ_blocks` of row `i`'s product with feature `j` for `mr` rows and one
/// panel.
fn panel_kernel<const B: usize>(
    tiles: &[Tile<B>],
    zero: i32,
    x: RowTile,
    mr: usize,
    acc: &mut [[f32; NR]; MR],
) {
    #[cfg(target_arch = "x86_64")]
    match *x86::LEVEL {
        // SAFETY: the features were detected.
        x86::Level::Avx512 => {
            return unsafe { by_rows!(avx512::panel, [B], mr, (tiles, zero, x, acc)) }
        }
        // SAFETY: the features were detected.
        x86::Level::Avx2 => {
            return unsafe { by_rows!(avx2::panel, [B], mr, (tiles, zero, x, acc)) }
        }
        x86::Level::Portable => {}
    }
    portable_panel(tiles, zero, x, mr, acc)
}

/// The reference semantics of the kernel; SIMD versions must give bit-identical results.
fn portable_panel<const B: usize>(
    tiles: &[Tile<B>],
    zero: i32,
    x: RowTile,
    mr: usize,
    acc: &mut [[f32; NR]; MR],
) {
    let kb = tiles.len();
    let k = kb * QK;
    for acc_row in acc.iter_mut().take(mr) {
        *acc_row = [0.0; NR];
    }
    for (b, tile) in tiles.iter().enumerate() {
        for (i, acc_row) in acc.iter_mut().enumerate().take(mr) {
            let codes = &x.codes[i * k + b * QK..][..QK];
            let scale = x.scales[i * kb + b];
            for (lane, acc) in acc_row.iter_mut().enumerate() {
                let dot: i32 = (0..QK)
                    .map(|kk| tile.code(lane, kk) * codes[kk] as i32)
                    .sum();
                let dot = (dot - zero * scale.sum) as f32;
                let (d, m) = (tile.d[lane].to_f32(), tile.m[lane].to_f32());
                *acc = dot.mul_add(d * scale.d, *acc);
                *acc = m.mul_add(scale.s, *acc);
            }
        }
    }
}

/// Which kernel the CPU runs, detected once.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::is_x86_feature_detected as has;
    use std::sync::LazyLock;

    pub enum Level {
        /// 512-bit registers and VNNI: 64 byte products summed per instruction.
        Avx512,
        /// 256-bit registers: byte products summed in pairs, then in fours (as ggml on AVX2).
        Avx2,
        Portable,
    }

    pub static LEVEL: LazyLock<Level> = LazyLock::new(|| {
        if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
            Level::Avx512
        } else if has!("avx2") && has!("fma") && has!("f16c") {
            Level::Avx2
        } else {
            Level::Portable
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{RowTile, Tile, FOUR, MR, NR, QK};
    use std::arch::x86_64::*;

    /// Features per vector of sums (8 × i32 in 256 bits).
    const LANES: usize = 8;

    /// Four consecutive activation codes broadcast to every lane.
    #[inline(always)]
    unsafe fn quad(p: *const i8) -> __m256i {
        _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
    }

    /// Byte products summed in pairs (`maddubs`, exact while a pair stays within an i16:
    /// codes below 16 times activations within ±127 give at most 3,810), accumulated as
    /// i16 (at most eight pairs: 30,480).
    #[inline(always)]
    unsafe fn pairs(sum: __m256i, codes: __m256i, x: __m256i) -> __m256i {
        _mm256_add_epi16(sum, _mm256_maddubs_epi16(codes, x))
    }

    /// The kernel for 8 features at a time: the panel's four groups one after the other,
    /// each over every block, so its rows' sums stay in registers. 8-bit codes are taken as
    /// two nibbles, `u = lo + 16·hi`, each nibble's products exact in i16 as above.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn panel<const B: usize, const R: usize>(
        tiles: &[Tile<B>],
        zero: i32,
        x: RowTile,
        acc: &mut [[f32; NR]; MR],
    ) {
        let kb = tiles.len();
        let k = kb * QK;
        debug_assert!(x.codes.len() >= R * k && x.scales.len() >= R * kb);
        let xp = x.codes.as_ptr();
        let nibble = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        for g in 0..NR / LANES {
            // Group `g` is half `g / 2` of the tile's 64-byte vectors, their 32-byte part `g % 2`.
            let (half, part) = (g / 2, (g % 2) * 32);
            let mut out = [_mm256_setzero_ps(); R];
            for (b, tile) in tiles.iter().enumerate() {
                let q = tile.q.as_ptr();
                let mut dots = [_mm256_setzero_si256(); R];
                if B == FOUR {
                    let mut sums = [_mm256_setzero_si256(); R];
                    // Vector `l`: inputs 4l..4l+4 in the low nibbles, 16+4l.. in the high.
                    for l in 0..4 {
                        let raw = _mm256_load_si256(q.add((half * 4 + l) * 64 + part).cast());
                        let lo = _mm256_and_si256(raw, nibble);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nibble);
                        for (i, sum) in sums.iter_mut().enumerate() {
                            let row = xp.add(i * k + b * QK);
                            *sum = pairs(*sum, lo, quad(row.add(4 * l)));
                            *sum = pairs(*sum, hi, quad(row.add(16 + 4 * l)));
                        }
                    }
                    for i in 0..R {
                        dots[i] = _mm256_madd_epi16(sums[i], ones);
                    }
                } else {
                    let mut lows = [_mm256_setzero_si256(); R];
                    let mut highs = [_mm256_setzero_si256(); R];
                    for v in 0..QK / 4 {
                        let raw = _mm256_load_si256(q.add((half * 8 + v) * 64 + part).cast());
                        let lo = _mm256_and_si256(raw, nibble);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nibble);
                        for i in 0..R {
                            let xq = quad(xp.add(i * k + b * QK + 4 * v));
                            lows[i] = pairs(lows[i], lo, xq);
                            highs[i] = pairs(highs[i], hi, xq);
                        }
                    }
                    for i in 0..R {
                        let lo = _mm256_madd_epi16(lows[i], ones);
                        let hi = _mm256_madd_epi16(highs[i], ones);
                        dots[i] = _mm256_add_epi32(lo, _mm256_slli_epi32::<4>(hi));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.d.as_ptr().add(g * LANES).cast()));
                let m = _mm256_cvtph_ps(_mm_loadu_si128(tile.m.as_ptr().add(g * LANES).cast()));
                for i in 0..R {
                    let scale = *x.scales.get_unchecked(i * kb + b);
                    let correction = _mm256_set1_epi32(zero * scale.sum);
                    let (dx, sx) = (_mm256_set1_ps(scale.d), _mm256_set1_ps(scale.s));
                    let dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(dots[i], correction));
                    out[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, dx), out[i]);
                    out[i] = _mm256_fmadd_ps(m, sx, out[i]);
                }
            }
            for i in 0..R {
                _mm256_storeu_ps(acc[i].as_mut_ptr().add(g * LANES), out[i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{RowTile, Tile, FOUR, LANES, MR, NR, QK};
    use half::f16;
    use std::arch::x86_64::*;

    /// Four consecutive activation codes broadcast to every lane.
    #[inline(always)]
    unsafe fn quad(p: *const i8) -> __m512i {
        _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
    }

    /// Sixteen f16 values as f32.
    #[inline(always)]
    unsafe fn halves(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn panel<const B: usize, const R: usize>(
        tiles: &[Tile<B>],
        zero: i32,
        x: RowTile,
        acc: &mut [[f32; NR]; MR],
    ) {
        let kb = tiles.len();
        let k = kb * QK;
        debug_assert!(x.codes.len() >= R * k && x.scales.len() >= R * kb);
        let xp = x.codes.as_ptr();
        let nibble = _mm512_set1_epi8(0x0f);
        let mut out = [[_mm512_setzero_ps(); 2]; R];
        for (b, tile) in tiles.iter().enumerate() {
            let mut dots = [[_mm512_setzero_si512(); 2]; R];
            let q = tile.q.as_ptr();
            if B == FOUR {
                // Vector `l` of each half: inputs 4l..4l+4 in the low nibbles, 16+4l.. in the high.
                for l in 0..4 {
                    let raw = [
                        _mm512_load_si512(q.add(l * 64).cast()),
                        _mm512_load_si512(q.add((4 + l) * 64).cast()),
                    ];
                    let lo = [
                        _mm512_and_si512(raw[0], nibble),
                        _mm512_and_si512(raw[1], nibble),
                    ];
                    let hi = [
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw[0]), nibble),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw[1]), nibble),
                    ];
                    for (i, dot) in dots.iter_mut().enumerate() {
                        let row = xp.add(i * k + b * QK);
                        let (xl, xh) = (quad(row.add(4 * l)), quad(row.add(16 + 4 * l)));
                        for h in 0..2 {
                            dot[h] = _mm512_dpbusd_epi32(dot[h], lo[h], xl);
                            dot[h] = _mm512_dpbusd_epi32(dot[h], hi[h], xh);
                        }
                    }
                }
            } else {
                for g in 0..QK / 4 {
                    let w = [
                        _mm512_load_si512(q.add(g * 64).cast()),
                        _mm512_load_si512(q.add((8 + g) * 64).cast()),
                    ];
                    for (i, dot) in dots.iter_mut().enumerate() {
                        let xq = quad(xp.add(i * k + b * QK + 4 * g));
                        for h in 0..2 {
                            dot[h] = _mm512_dpbusd_epi32(dot[h], w[h], xq);
                        }
                    }
                }
            }
            let d = [halves(tile.d.as_ptr()), halves(tile.d.as_ptr().add(LANES))];
            let m = [halves(tile.m.as_ptr()), halves(tile.m.as_ptr().add(LANES))];
            for i in 0..R {
                let scale = *x.scales.get_unchecked(i * kb + b);
                let correction = _mm512_set1_epi32(zero * scale.sum);
                let (dx, sx) = (_mm512_set1_ps(scale.d), _mm512_set1_ps(scale.s));
                for h in 0..2 {
                    let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[i][h], correction));
                    out[i][h] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d[h], dx), out[i][h]);
                    out[i][h] = _mm512_fmadd_ps(m[h], sx, out[i][h]);
                }
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(acc[i].as_mut_ptr(), out[i][0]);
            _mm512_storeu_ps(acc[i].as_mut_ptr().add(LANES), out[i][1]);
        }
    }
}

/// Reads a GGUF weight as blocks, exactly where its format maps onto `w = d·(u − z) + m`.
fn blocks(t: &QTensor) -> candle_core::Result<Blocks> {
    let (n, k) = t.shape().dims2()?;
    let kb = k / QK;
    let exact =
        |bits: u32, zero: i32, bytes_per_block: usize, decode: &dyn Fn(&[u8]) -> BlockRow| {
            let data = t.data()?;
            if data.len() != n * kb * bytes_per_block {
                candle_core::bail!("unexpected {:?} tensor size {}", t.dtype(), data.len());
            }
            let rows = data
                .chunks_exact(kb * bytes_per_block)
                .map(|row| row.chunks_exact(bytes_per_block).map(decode).collect())
                .collect();
            Ok(Blocks { bits, zero, rows })
        };
    let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]);
    match t.dtype() {
        GgmlDType::Q8_0 => exact(8, 128, 2 + QK, &|b| BlockRow {
            d: half(b),
            m: f16::ZERO,
            u: std::array::from_fn(|j| b[2 + j] ^ 0x80),
        }),
        GgmlDType::Q4_0 => exact(4, 8, 2 + QK / 2, &|b| BlockRow {
            d: half(b),
            m: f16::ZERO,
            u: std::array::from_fn(|j| nibble(&b[2..], j)),
        }),
        GgmlDType::Q4_1 => exact(4, 0, 4 + QK / 2, &|b| BlockRow {
            d: half(b),
            m: half(&b[2..]),
            u: std::array::from_fn(|j| nibble(&b[4..], j)),
        }),
        // 5-bit codes (a nibble and one bit of `qh`), held as 8-bit ones.
        GgmlDType::Q5_0 => exact(8, 16, 6 + QK / 2, &|b| BlockRow {
            d: half(b),
            m: f16::ZERO,
            u: std::array::from_fn(|j| five_bits(&b[2..6], &b[6..], j)),
        }),
        GgmlDType::Q5_1 => exact(8, 0, 8 + QK / 2, &|b| BlockRow {
            d: half(b),
            m: half(&b[2..]),
            u: std::array::from_fn(|j| five_bits(&b[4..8], &b[8..], j)),
        }),
        _ => requantized_blocks(t),
    }
}

/// Any weight, dequantized and requantized to 8 bits: not bit-exact.
fn requantized_blocks(t: &QTensor) -> candle_core::Result<Blocks> {
    tracing::warn!(dtype = ?t.dtype(), "weights requantized to 8 bits: not bit-exact");
    let (_, k) = t.shape().dims2()?;
    let values = t
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(requantize(&values, k))
}

/// Element `j` of a 32-value block packed as 16 bytes: low nibbles first, then high nibbles.
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < QK / 2 {
        qs[j] & 0x0f
    } else {
        qs[j - QK / 2] >> 4
    }
}

/// Element `j` of a 32-value block of 5-bit codes: its low four bits as [`nibble`] reads them,
/// its fifth bit `j` of the little-endian `qh`.
fn five_bits(qh: &[u8], qs: &[u8], j: usize) -> u8 {
    let high = (u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]) >> j) & 1;
    nibble(qs, j) | (high as u8) << 4
}

/// Rows of `k` values as asymmetric 8-bit blocks: `v ≈ d·u + m`, `m` the block's minimum.
fn requantize(values: &[f32], k: usize) -> Blocks {
    let block = |v: &[f32]| {
        let lo = v.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m = f16::from_f32(lo);
        let d = f16::from_f32((hi - m.to_f32()) / 255.0);
        let (m, d) = (m.to_f32(), d.to_f32());
        let u = std::array::from_fn(|j| {
            if d > 0.0 {
                ((v[j] - m) / d).round().clamp(0.0, 255.0) as u8
            } else {
                0
            }
        });
        BlockRow {
            d: f16::from_f32(d),
            m: f16::from_f32(m),
            u,
        }
    };
    Blocks {
        bits: 8,
        zero: 0,
        rows: values
            .chunks_exact(k)
            .map(|row| row.chunks_exact(QK).map(block).collect())
            .collect(),
    }
}

/// Used by tests and tools that need a layer without a GGUF.
impl Linear {
    pub fn from_f32(weights: &[f32], out_features: usize, in_features: usize) -> Self {
        assert_eq!(weights.len(), out_features * in_features);
        assert_eq!(in_features % QK, 0);
        Self::pack(requantize(weights, in_features), in_features)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{quantized, values};
    use proptest::prelude::*;

    fn layer(n: usize, k: usize, seed: u64) -> Linear {
        Linear::from_f32(&values(n * k, seed), n, k)
    }

    /// A layer in a GGUF format, through candle's quantizer.
    fn gguf_layer(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> (QTensor, Linear) {
        let q = quantized(dtype, n, k, seed);
        let lin = Linear::from_qtensor(&q).unwrap();
        (q, lin)
    }

    fn input(rows: usize, k: usize) -> Vec<f32> {
        (0..rows * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect()
    }

    #[test]
    fn activations_are_quantized_as_ggml_does() {
        // amax 2.54: 127/amax = 50, so 0.01 → 0.5 → 0 and 0.03 → 1.5 → 2 (ties to even).
        let mut x = [0f32; QK];
        x[..4].copy_from_slice(&[2.54, -2.54, 0.01, 0.03]);
        let mut q = [0i8; QK];
        let scale = quantize_block(&x, &mut q);
        assert_eq!(q[..4], [127, -127, 0, 2]);
        assert_eq!(q[4..], [0; QK - 4]);
        assert_eq!(scale.sum, 2);
        assert_eq!(scale.d, f16::from_f32(0.02).to_f32());
        assert_eq!(scale.s, f16::from_f32(0.04).to_f32());
        let mut zero = [1i8; QK];
        let scale = quantize_block(&[0.0; QK], &mut zero);
        assert_eq!((zero, scale), ([0; QK], BlockScale::default()));
    }

    #[test]
    fn codes_round_trip_through_the_layout() {
        for (dtype, bits) in [
            (GgmlDType::Q4_0, 4),
            (GgmlDType::Q4_1, 4),
            (GgmlDType::Q5_0, 8),
            (GgmlDType::Q5_1, 8),
            (GgmlDType::Q8_0, 8),
            (GgmlDType::Q4K, 4),
            (GgmlDType::Q5K, 5),
            (GgmlDType::Q6K, 6),
        ] {
            // 256 inputs: one K-quant super-block.
            let (q, lin) = gguf_layer(dtype, 40, 256, 5);
            assert_eq!(lin.bits(), bits);
            let expect = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for (j, row) in expect.iter().enumerate() {
                assert_eq!(&lin.row(j), row, "{dtype:?} row {j}");
            }
        }
    }

    /// Fused parts of different exact formats keep their values exactly (8-bit codes around
    /// one zero point), and their products are the parts' own; with a part that has to be
    /// requantized, everything is.
    #[test]
    fn fused_formats_stay_exact_where_they_can() {
        let k = 64;
        let parts: Vec<QTensor> = [GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q4_1]
            .into_iter()
            .enumerate()
            .map(|(i, dtype)| gguf_layer(dtype, 32 + 8 * i, k, i as u64).0)
            .collect();
        let fused = Linear::from_qtensors(&parts.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(fused.bits(), 8);
        let mut j = 0;
        for part in &parts {
            for row in part
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
            {
                assert_eq!(fused.row(j), row, "{:?} row {j}", part.dtype());
                j += 1;
            }
        }
        let x = input(3, k);
        let mut y = vec![0f32; 3 * fused.out_features()];
        fused.matmul(&x, &mut y);
        let mut at = 0;
        for part in &parts {
            let alone = Linear::from_qtensor(part).unwrap();
            let n = alone.out_features();
            let mut z = vec![0f32; 3 * n];
            alone.matmul(&x, &mut z);
            for r in 0..3 {
                let of = |v: &[f32], w: usize, o: usize| v[r * w + o..r * w + o + n].to_vec();
                assert_eq!(of(&y, fused.out_features(), at), of(&z, n, 0));
            }
            at += n;
        }
        let k_quant = gguf_layer(GgmlDType::Q4K, 8, 256, 9).0;
        let q8 = gguf_layer(GgmlDType::Q8_0, 8, 256, 9).0;
        let mixed = Linear::from_qtensors(&[&k_quant, &q8]).unwrap();
        assert_eq!(mixed.zero, 0, "requantized: codes over the whole byte");
    }

    /// Each output within the activations' quantization error of the exact product.
    #[test]
    fn matches_the_exact_product_within_quantization_error() {
        let (n, k, rows) = (70, 96, 5);
        let lin = layer(n, k, 7);
        let x = input(rows, k);
        let mut y = vec![0f32; rows * n];
        lin.matmul(&x, &mut y);
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            for j in 0..n {
                let w = lin.row(j);
                let exact: f64 = (0..k).map(|c| xr[c] as f64 * w[c] as f64).sum();
                // Half a quantum per activation, and f16 rounding of d and s.
                let bound: f64 = xr
                    .chunks_exact(QK)
                    .zip(w.chunks_exact(QK))
                    .map(|(xb, wb)| {
                        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                        let wsum: f64 = wb.iter().map(|v| v.abs() as f64).sum();
                        wsum * (amax / 127.0 * 0.5 + amax * 2e-3)
                    })
                    .sum();
                let err = (y[r * n + j] as f64 - exact).abs();
                assert!(err <= bound + 1e-5, "{r},{j}: {err} > {bound}");
            }
        }
    }

    /// Every kernel this CPU can run (not only the one it picks) equals the portable one.
    #[test]
    fn simd_matches_portable_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                // SAFETY: the features were just detected.
                matches_portable(
                    |t, z, x, mr, acc| unsafe {
                        by_rows!(avx512::panel, [FOUR], mr, (t, z, x, acc))
                    },
                    |t, z, x, mr, acc| unsafe {
                        by_rows!(avx512::panel, [EIGHT], mr, (t, z, x, acc))
                    },
                );
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                // SAFETY: the features were just detected.
                matches_portable(
                    |t, z, x, mr, acc| unsafe { by_rows!(avx2::panel, [FOUR], mr, (t, z, x, acc)) },
                    |t, z, x, mr, acc| unsafe {
                        by_rows!(avx2::panel, [EIGHT], mr, (t, z, x, acc))
                    },
                );
            }
        }
    }

    fn matches_portable(
        four_kernel: impl Fn(&[Tile<FOUR>], i32, RowTile, usize, &mut [[f32; NR]; MR]),
        eight_kernel: impl Fn(&[Tile<EIGHT>], i32, RowTile, usize, &mut [[f32; NR]; MR]),
    ) {
        let k = 128;
        let x = input(MR, k);
        let acts = Activations::quantize(&Input::Rows(&x).prepare(k));
        let rows = |mr: usize| RowTile {
            codes: &acts.codes[..mr * k],
            scales: &acts.scales[..mr * (k / QK)],
        };
        let (_, four) = gguf_layer(GgmlDType::Q4_1, 64, k, 3);
        let (_, eight) = gguf_layer(GgmlDType::Q8_0, 64, k, 3);
        for mr in 1..=MR {
            let mut a = [[0f32; NR]; MR];
            let mut b = [[0f32; NR]; MR];
            let Tiles::Four(t) = &four.tiles else {
                panic!("Q4_1 packs 4-bit codes")
            };
            four_kernel(&t[..k / QK], four.zero, rows(mr), mr, &mut a);
            portable_panel(&t[..k / QK], four.zero, rows(mr), mr, &mut b);
            assert_eq!(a[..mr], b[..mr]);
            let Tiles::Eight(t) = &eight.tiles else {
                panic!("Q8_0 packs 8-bit codes")
            };
            eight_kernel(&t[..k / QK], eight.zero, rows(mr), mr, &mut a);
            portable_panel(&t[..k / QK], eight.zero, rows(mr), mr, &mut b);
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

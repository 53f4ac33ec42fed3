//! The K-quant weight formats (Q4_K, Q5_K, Q6_K) as ggml computes them: super-blocks of 256
//! inputs with integer sub-block scales, against activations quantized per 256 (ggml's Q8_K).
//!
//! A super-block's weights are `w = d·sc·u − dmin·m` (Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit `sc`
//! and `m`) or `w = d·sc·(u − 32)` (Q6_K: 16 sub-blocks of 16, signed 8-bit `sc`). ggml's dot
//! product sums `sc·Σu·q` over the super-block in integers and scales it once: `d_w·d_x·Σ` (and
//! `dmin·d_x·Σm·bsum` for the minimums, Q6_K's `32` folded into the integer sum). Here the same
//! integers and the same scale products, each output one fixed-order fused multiply-add chain
//! over its super-blocks: bit-identical whatever the batch, and the SIMD kernels the portable
//! one bit for bit (integer sums are exact, each float step one rounding in the same order).
//!
//! Layout: per panel of [`NR`] output features and super-block one [`SuperTile`]: scales
//! feature-minor, sub-blocks held as 16 inputs each (a 32-input sub-block's scale twice), codes
//! as bytes in the order the VNNI instruction reads them (16 features × 4 consecutive inputs
//! per 64-byte vector), so a sub-block's dot products are exact integer instructions: AVX-512
//! VNNI, or on AVX2 byte products summed in pairs then in fours.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

#[cfg(target_arch = "x86_64")]
use super::fused::Prepared;
use super::linear::{by_rows, x86};
use super::linear::{MR, NR};

/// Inputs per super-block.
pub const QK_K: usize = 256;
/// Inputs per sub-block as held.
const SUB: usize = 16;
/// Sub-blocks per super-block.
const SUBS: usize = QK_K / SUB;

/// How a format's minimums enter the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `w = d·sc·u − dmin·m` (Q4_K, Q5_K): the minimums scaled apart, by `dmin`.
    Min { bits: u32 },
    /// `w = d·sc·(u − 32)` (Q6_K): `m = 32·sc`, folded into the integer sum.
    Zero32,
}

/// One super-block of 256 inputs for one panel of 32 output features.
#[derive(Clone)]
#[repr(C, align(64))]
pub struct SuperTile {
    d: [f32; NR],
    dmin: [f32; NR],
    sc: [[i16; NR]; SUBS],
    m: [[i16; NR]; SUBS],
    /// Codes, at [`SuperTile::place`].
    q: [u8; QK_K * NR],
}

impl SuperTile {
    const ZERO: Self = Self {
        d: [0.0; NR],
        dmin: [0.0; NR],
        sc: [[0; NR]; SUBS],
        m: [[0; NR]; SUBS],
        q: [0; QK_K * NR],
    };

    /// Where feature `lane`'s code for input `i` lies: inputs in fours, each four as two 64-byte
    /// vectors (features 0-15, then 16-31) of 4 bytes a feature.
    fn place(i: usize, lane: usize) -> usize {
        ((i / 4) * 2 + lane / LANES) * 64 + (lane % LANES) * 4 + i % 4
    }

    fn code(&self, i: usize, lane: usize) -> i32 {
        self.q[Self::place(i, lane)] as i32
    }
}

/// Features per 64-byte vector of codes.
const LANES: usize = 16;

/// One output feature's super-block as read from the file.
struct SuperRow {
    d: f16,
    dmin: f16,
    /// Per 16 inputs.
    sc: [i16; SUBS],
    m: [i16; SUBS],
    u: [u8; QK_K],
}

/// A K-quant weight matrix, packed.
#[derive(Clone)]
pub struct SuperTiles {
    pub format: Format,
    /// `tiles[panel * k_blocks + block]`.
    pub tiles: Vec<SuperTile>,
}

impl SuperTiles {
    /// Packs `t` when its format is one of the K-quants held exactly; `None` otherwise.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Option<Self>> {
        let (format, bytes, read): (_, _, fn(&[u8]) -> SuperRow) = match t.dtype() {
            GgmlDType::Q4K => (Format::Min { bits: 4 }, 144, q4k),
            GgmlDType::Q5K => (Format::Min { bits: 5 }, 176, q5k),
            GgmlDType::Q6K => (Format::Zero32, 210, q6k),
            _ => return Ok(None),
        };
        let (n, k) = t.shape().dims2()?;
        let kb = k / QK_K;
        let data = t.data()?;
        if k == 0 || k % QK_K != 0 || data.len() != n * kb * bytes {
            candle_core::bail!("unexpected {:?} tensor of {n}x{k}", t.dtype());
        }
        let panels = n.div_ceil(NR);
        let mut tiles = vec![SuperTile::ZERO; panels * kb];
        for (feature, row) in data.chunks_exact(kb * bytes).enumerate() {
            let (panel, lane) = (feature / NR, feature % NR);
            for (b, block) in row.chunks_exact(bytes).enumerate() {
                let s = read(block);
                let tile = &mut tiles[panel * kb + b];
                tile.d[lane] = s.d.to_f32();
                tile.dmin[lane] = s.dmin.to_f32();
                for h in 0..SUBS {
                    tile.sc[h][lane] = s.sc[h];
                    tile.m[h][lane] = s.m[h];
                }
                for (i, &u) in s.u.iter().enumerate() {
                    tile.q[SuperTile::place(i, lane)] = u;
                }
            }
        }
        Ok(Some(Self { format, tiles }))
    }

    /// Bits per code.
    pub fn bits(&self) -> u32 {
        match self.format {
            Format::Min { bits } => bits,
            Format::Zero32 => 6,
        }
    }

    /// One output feature's weights as f32, computed as ggml dequantizes them.
    pub fn row(&self, feature: usize, in_features: usize) -> Vec<f32> {
        let kb = in_features / QK_K;
        let (panel, lane) = (feature / NR, feature % NR);
        let mut out = Vec::with_capacity(in_features);
        for t in &self.tiles[panel * kb..(panel + 1) * kb] {
            for i in 0..QK_K {
                let (sc, u) = (t.sc[i / SUB][lane] as f32, t.code(i, lane) as f32);
                out.push(match self.format {
                    Format::Min { .. } => {
                        t.d[lane] * sc * u - t.dmin[lane] * t.m[i / SUB][lane] as f32
                    }
                    Format::Zero32 => t.d[lane] * sc * (u - 32.0),
                });
            }
        }
        out
    }

    /// Accumulates `acc[i][j]` = row `i`'s product with feature `j` of `tiles` (one panel's
    /// super-blocks) for `mr` rows.
    pub fn panel(&self, tiles: &[SuperTile], x: SuperRows, mr: usize, acc: &mut [[f32; NR]; MR]) {
        let fold = self.format == Format::Zero32;
        #[cfg(target_arch = "x86_64")]
        match *x86::LEVEL {
            // SAFETY: the features were detected.
            x86::Level::Avx512 => {
                return unsafe { by_rows!(avx512::panel, [], mr, (tiles, fold, x, acc)) }
            }
            // SAFETY: the features were detected.
            x86::Level::Avx2 => {
                return unsafe { by_rows!(avx2::panel, [], mr, (tiles, fold, x, acc)) }
            }
            x86::Level::Portable => {}
        }
        portable_panel(tiles, fold, x, mr, acc)
    }
}

/// The reference semantics of the kernel; the SIMD versions give its bits. Integer sums are
/// exact (a sub-block's `Σu·q` is at most 16·63·127, times `sc` ≤ 127, sixteen of them: under
/// 2^31).
fn portable_panel(
    tiles: &[SuperTile],
    fold: bool,
    x: SuperRows,
    mr: usize,
    acc: &mut [[f32; NR]; MR],
) {
    let kb = tiles.len();
    let k = kb * QK_K;
    for (i, acc_row) in acc.iter_mut().enumerate().take(mr) {
        let mut out = [0f32; NR];
        for (b, t) in tiles.iter().enumerate() {
            let codes = &x.codes[i * k + b * QK_K..][..QK_K];
            let scale = &x.scales[i * kb + b];
            let mut sumi = [0i32; NR];
            let mut summ = [0i32; NR];
            for h in 0..SUBS {
                let mut dot = [0i32; NR];
                // Wrapping operations: none wraps (see above), and unchecked they vectorize in
                // builds with overflow checks too.
                for (i, &q) in codes.iter().enumerate().skip(h * SUB).take(SUB) {
                    let q = q as i32;
                    for (lane, dot) in dot.iter_mut().enumerate() {
                        *dot = dot.wrapping_add(t.code(i, lane).wrapping_mul(q));
                    }
                }
                let bsum = scale.bsums[h];
                for l in 0..NR {
                    sumi[l] = sumi[l].wrapping_add((t.sc[h][l] as i32).wrapping_mul(dot[l]));
                    summ[l] = summ[l].wrapping_add((t.m[h][l] as i32).wrapping_mul(bsum));
                }
            }
            for l in 0..NR {
                let d = t.d[l] * scale.d;
                if fold {
                    out[l] = (sumi[l].wrapping_sub(summ[l]) as f32).mul_add(d, out[l]);
                } else {
                    out[l] = (sumi[l] as f32).mul_add(d, out[l]);
                    out[l] = (summ[l] as f32).mul_add(-(scale.d * t.dmin[l]), out[l]);
                }
            }
        }
        *acc_row = out;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{SuperRows, SuperTile, MR, NR, QK_K, SUB, SUBS};
    use std::arch::x86_64::*;

    /// Sixteen i16 as i32.
    #[inline(always)]
    unsafe fn wide(p: *const i16) -> __m512i {
        _mm512_cvtepi16_epi32(_mm256_loadu_si256(p.cast()))
    }

    /// `-x`, bit for bit (a zero keeps its sign flipped, as negation does).
    #[inline(always)]
    unsafe fn neg(x: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn panel<const R: usize>(
        tiles: &[SuperTile],
        fold: bool,
        x: SuperRows,
        acc: &mut [[f32; NR]; MR],
    ) {
        let kb = tiles.len();
        let k = kb * QK_K;
        debug_assert!(x.codes.len() >= R * k && x.scales.len() >= R * kb);
        let xp = x.codes.as_ptr();
        let mut out = [[_mm512_setzero_ps(); 2]; R];
        for (b, t) in tiles.iter().enumerate() {
            let q = t.q.as_ptr();
            let mut sumi = [[_mm512_setzero_si512(); 2]; R];
            let mut summ = [[_mm512_setzero_si512(); 2]; R];
            for h in 0..SUBS {
                let mut dot = [[_mm512_setzero_si512(); 2]; R];
                for g in 0..SUB / 4 {
                    let at = q.add((h * 4 + g) * 128);
                    let w = [
                        _mm512_load_si512(at.cast()),
                        _mm512_load_si512(at.add(64).cast()),
                    ];
                    for (i, dot) in dot.iter_mut().enumerate() {
                        let four = xp.add(i * k + b * QK_K + h * SUB + 4 * g);
                        let xq = _mm512_set1_epi32(four.cast::<i32>().read_unaligned());
                        for half in 0..2 {
                            dot[half] = _mm512_dpbusd_epi32(dot[half], w[half], xq);
                        }
                    }
                }
                let sc = [wide(t.sc[h].as_ptr()), wide(t.sc[h].as_ptr().add(16))];
                let m = [wide(t.m[h].as_ptr()), wide(t.m[h].as_ptr().add(16))];
                for i in 0..R {
                    let bsum = _mm512_set1_epi32(x.scales.get_unchecked(i * kb + b).bsums[h]);
                    for half in 0..2 {
                        let scaled = _mm512_mullo_epi32(sc[half], dot[i][half]);
                        sumi[i][half] = _mm512_add_epi32(sumi[i][half], scaled);
                        let mins = _mm512_mullo_epi32(m[half], bsum);
                        summ[i][half] = _mm512_add_epi32(summ[i][half], mins);
                    }
                }
            }
            for i in 0..R {
                let dx = x.scales.get_unchecked(i * kb + b).d;
                for half in 0..2 {
                    let d = _mm512_mul_ps(
                        _mm512_loadu_ps(t.d.as_ptr().add(16 * half)),
                        _mm512_set1_ps(dx),
                    );
                    if fold {
                        let total = _mm512_sub_epi32(sumi[i][half], summ[i][half]);
                        out[i][half] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), d, out[i][half]);
                    } else {
                        let dmin = _mm512_loadu_ps(t.dmin.as_ptr().add(16 * half));
                        let dm = neg(_mm512_mul_ps(_mm512_set1_ps(dx), dmin));
                        out[i][half] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[i][half]), d, out[i][half]);
                        out[i][half] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ[i][half]), dm, out[i][half]);
                    }
                }
            }
        }
        for i in 0..R {
            _mm512_storeu_ps(acc[i].as_mut_ptr(), out[i][0]);
            _mm512_storeu_ps(acc[i].as_mut_ptr().add(16), out[i][1]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{SuperRows, SuperTile, MR, NR, QK_K, SUB, SUBS};
    use std::arch::x86_64::*;

    /// Features per vector of sums (8 × i32 in 256 bits).
    const LANES: usize = 8;

    /// Eight i16 as i32.
    #[inline(always)]
    unsafe fn wide(p: *const i16) -> __m256i {
        _mm256_cvtepi16_epi32(_mm_loadu_si128(p.cast()))
    }

    /// The kernel for 8 features at a time. A code below 64 times an activation within ±127,
    /// summed in pairs (`maddubs`), stays within an i16 (16,002), so the sums of four (`madd`
    /// with ones) are exact.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn panel<const R: usize>(
        tiles: &[SuperTile],
        fold: bool,
        x: SuperRows,
        acc: &mut [[f32; NR]; MR],
    ) {
        let kb = tiles.len();
        let k = kb * QK_K;
        debug_assert!(x.codes.len() >= R * k && x.scales.len() >= R * kb);
        let xp = x.codes.as_ptr();
        let ones = _mm256_set1_epi16(1);
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        for g8 in 0..NR / LANES {
            // Features 8·g8.. are 64-byte half `g8 / 2` of each four inputs, its 32 bytes `g8 % 2`.
            let part = (g8 / 2) * 64 + (g8 % 2) * 32;
            let lanes = g8 * LANES;
            let mut out = [_mm256_setzero_ps(); R];
            for (b, t) in tiles.iter().enumerate() {
                let q = t.q.as_ptr();
                let mut sumi = [_mm256_setzero_si256(); R];
                let mut summ = [_mm256_setzero_si256(); R];
                for h in 0..SUBS {
                    let mut dot = [_mm256_setzero_si256(); R];
                    for g in 0..SUB / 4 {
                        let w = _mm256_load_si256(q.add((h * 4 + g) * 128 + part).cast());
                        for (i, dot) in dot.iter_mut().enumerate() {
                            let four = xp.add(i * k + b * QK_K + h * SUB + 4 * g);
                            let xq = _mm256_set1_epi32(four.cast::<i32>().read_unaligned());
                            let pairs = _mm256_maddubs_epi16(w, xq);
                            *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(pairs, ones));
                        }
                    }
                    let sc = wide(t.sc[h].as_ptr().add(lanes));
                    let m = wide(t.m[h].as_ptr().add(lanes));
                    for i in 0..R {
                        let bsum = _mm256_set1_epi32(x.scales.get_unchecked(i * kb + b).bsums[h]);
                        sumi[i] = _mm256_add_epi32(sumi[i], _mm256_mullo_epi32(sc, dot[i]));
                        summ[i] = _mm256_add_epi32(summ[i], _mm256_mullo_epi32(m, bsum));
                    }
                }
                for i in 0..R {
                    let dx = x.scales.get_unchecked(i * kb + b).d;
                    let d =
                        _mm256_mul_ps(_mm256_loadu_ps(t.d.as_ptr().add(lanes)), _mm256_set1_ps(dx));
                    if fold {
                        let total = _mm256_sub_epi32(sumi[i], summ[i]);
                        out[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), d, out[i]);
                    } else {
                        let dmin = _mm256_loadu_ps(t.dmin.as_ptr().add(lanes));
                        let dm = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dx), dmin), sign);
                        out[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[i]), d, out[i]);
                        out[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ[i]), dm, out[i]);
                    }
                }
            }
            for i in 0..R {
                _mm256_storeu_ps(acc[i].as_mut_ptr().add(lanes), out[i]);
            }
        }
    }
}

/// A super-block of 256 activations' scale and its sums per 16 codes (ggml's Q8_K).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SuperScale {
    d: f32,
    bsums: [i32; SUBS],
}

/// Rows of activations quantized to 8 bits per 256, as ggml's Q8_K.
pub struct SuperActivations {
    pub codes: Vec<i8>,
    pub scales: Vec<SuperScale>,
}

impl SuperActivations {
    pub fn quantize(input: &Prepared) -> Self {
        let (rows, k) = (input.rows(), input.k());
        let kb = k / QK_K;
        let mut codes = vec![0i8; rows * k];
        let mut x = [0f32; QK_K];
        let scales = (codes.chunks_exact_mut(QK_K).enumerate())
            .map(|(block, q)| {
                input.fill(block / kb, block % kb * QK_K, &mut x);
                quantize_super_block(&x, q)
            })
            .collect();
        Self { codes, scales }
    }

    /// Rows `r0..r0 + mr` of rows of `k` inputs.
    pub fn rows(&self, r0: usize, mr: usize, k: usize) -> SuperRows<'_> {
        let kb = k / QK_K;
        SuperRows {
            codes: &self.codes[r0 * k..(r0 + mr) * k],
            scales: &self.scales[r0 * kb..(r0 + mr) * kb],
        }
    }
}

/// ggml's Q8_K quantization of one super-block: `q = min(127, round_half_even(x · −127/max))`
/// with `max` the value of largest magnitude (its sign kept), `d = 1/iscale`.
fn quantize_super_block(x: &[f32], q: &mut [i8]) -> SuperScale {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            (amax, max) = (v.abs(), v);
        }
    }
    if amax == 0.0 {
        q.fill(0);
        return SuperScale::default();
    }
    let iscale = -127.0 / max;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    let mut bsums = [0; SUBS];
    for (sum, q) in bsums.iter_mut().zip(q.chunks_exact(SUB)) {
        *sum = q.iter().map(|&v| v as i32).sum();
    }
    SuperScale {
        d: 1.0 / iscale,
        bsums,
    }
}

/// Up to [`MR`] rows of super-block activations.
#[derive(Clone, Copy)]
pub struct SuperRows<'a> {
    codes: &'a [i8],
    scales: &'a [SuperScale],
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and minimum of sub-block `j` (of 8).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K and Q5_K: `d`, `dmin`, 12 bytes of scales and minimums, (Q5_K: 32 bytes of fifth bits,)
/// 128 bytes of nibbles: per 64 inputs, 32 low nibbles then 32 high ones.
fn min_blocks(b: &[u8], high: Option<&[u8]>, qs: &[u8]) -> SuperRow {
    let half = |i: usize| f16::from_le_bytes([b[i], b[i + 1]]);
    let mut row = SuperRow {
        d: half(0),
        dmin: half(2),
        sc: [0; SUBS],
        m: [0; SUBS],
        u: [0; QK_K],
    };
    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        row.sc[2 * j..2 * j + 2].fill(sc as i16);
        row.m[2 * j..2 * j + 2].fill(m as i16);
    }
    for (i, u) in row.u.iter_mut().enumerate() {
        let (chunk, l) = (i / 64, i % 32);
        let upper = (i % 64) / 32;
        let nibble = (qs[chunk * 32 + l] >> (4 * upper)) & 0x0f;
        let fifth = high.map_or(0, |qh| (qh[l] >> (2 * chunk + upper)) & 1);
        *u = nibble | fifth << 4;
    }
    row
}

fn q4k(b: &[u8]) -> SuperRow {
    min_blocks(b, None, &b[16..144])
}

fn q5k(b: &[u8]) -> SuperRow {
    min_blocks(b, Some(&b[16..48]), &b[48..176])
}

/// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, `d`. Per 128 inputs
/// `l + 32t` (t = 0..4): nibble `t / 2` of `ql[l + 32(t % 2)]`, bits `2t` of `qh[l]`.
fn q6k(b: &[u8]) -> SuperRow {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let mut row = SuperRow {
        d: f16::from_le_bytes([b[208], b[209]]),
        dmin: f16::ZERO,
        sc: std::array::from_fn(|h| scales[h] as i8 as i16),
        m: std::array::from_fn(|h| 32 * scales[h] as i8 as i16),
        u: [0; QK_K],
    };
    for (i, u) in row.u.iter_mut().enumerate() {
        let (chunk, r) = (i / 128, i % 128);
        let (t, l) = (r / 32, r % 32);
        let low = (ql[chunk * 64 + l + 32 * (t % 2)] >> (4 * (t / 2))) & 0x0f;
        let high = (qh[chunk * 32 + l] >> (2 * t)) & 3;
        *u = low | high << 4;
    }
    row
}

#[cfg(test)]
mod tests {
    use super::super::linear::Linear;
    use super::*;
    use crate::model::fused::Input;
    use crate::test_support::{quantized, values};

    const FORMATS: [GgmlDType; 3] = [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];

    /// Each output is `Σ w·d_x·q` over the dequantized weights and activations, up to f32
    /// rounding: the integer sums are exact.
    #[test]
    fn products_are_the_dequantized_sums() {
        let (n, k, rows) = (40, 512, 5);
        let x = values(rows * k, 99);
        let acts = SuperActivations::quantize(&Input::Rows(&x).prepare(k));
        for dtype in FORMATS {
            let lin = Linear::from_qtensor(&quantized(dtype, n, k, 7)).unwrap();
            let mut y = vec![0f32; rows * n];
            lin.matmul(&x, &mut y);
            for r in 0..rows {
                let xq: Vec<f64> = (0..k)
                    .map(|c| {
                        acts.scales[r * k / QK_K + c / QK_K].d as f64 * acts.codes[r * k + c] as f64
                    })
                    .collect();
                for j in 0..n {
                    let w = lin.row(j);
                    let exact: f64 = (0..k).map(|c| xq[c] * w[c] as f64).sum();
                    let size: f64 = (0..k).map(|c| (xq[c] * w[c] as f64).abs()).sum();
                    let err = (y[r * n + j] as f64 - exact).abs();
                    assert!(err <= size * 1e-5, "{dtype:?} {r},{j}: {err} of {size}");
                }
            }
        }
    }

    /// Every instruction set's build of the kernel gives the portable one's bits, and a row's
    /// result does not depend on the rows beside it.
    #[test]
    fn kernels_agree_bit_for_bit_and_rows_stand_alone() {
        let (n, k) = (64, 512);
        let x = values(MR * k, 3);
        let acts = SuperActivations::quantize(&Input::Rows(&x).prepare(k));
        for dtype in FORMATS {
            let q = quantized(dtype, n, k, 11);
            let lin = Linear::from_qtensor(&q).unwrap();
            let t = SuperTiles::from_qtensor(&q).unwrap().unwrap();
            let fold = t.format == Format::Zero32;
            let tiles = &t.tiles[..k / QK_K];
            for mr in 1..=MR {
                let mut a = [[0f32; NR]; MR];
                portable_panel(tiles, fold, acts.rows(0, mr, k), mr, &mut a);
                #[cfg(target_arch = "x86_64")]
                {
                    use std::arch::is_x86_feature_detected as has;
                    let mut b = [[0f32; NR]; MR];
                    if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                        let rows = acts.rows(0, mr, k);
                        // SAFETY: the features were just detected.
                        unsafe { by_rows!(avx512::panel, [], mr, (tiles, fold, rows, &mut b)) };
                        assert_eq!(a[..mr], b[..mr], "{dtype:?} AVX-512, {mr} rows");
                    }
                    if has!("avx2") && has!("fma") {
                        let rows = acts.rows(0, mr, k);
                        // SAFETY: the features were just detected.
                        unsafe { by_rows!(avx2::panel, [], mr, (tiles, fold, rows, &mut b)) };
                        assert_eq!(a[..mr], b[..mr], "{dtype:?} AVX2, {mr} rows");
                    }
                }
            }
            let mut all = vec![0f32; MR * n];
            lin.matmul(&x, &mut all);
            for r in 0..MR {
                let mut one = vec![0f32; n];
                lin.matmul(&x[r * k..(r + 1) * k], &mut one);
                assert_eq!(&all[r * n..(r + 1) * n], &one[..], "{dtype:?} row {r}");
            }
        }
    }

    #[test]
    fn activations_are_quantized_as_ggml_does() {
        // max −2.54 (largest magnitude, negative): iscale = 50, so 0.01 → 0.5 → 0, 0.03 → 1.5
        // → 2 (ties to even), 2.54 → 127.
        let mut x = [0f32; QK_K];
        x[..4].copy_from_slice(&[-2.54, 2.54, 0.01, 0.03]);
        x[16] = -0.05;
        let mut q = [0i8; QK_K];
        let scale = quantize_super_block(&x, &mut q);
        assert_eq!(q[..4], [-127, 127, 0, 2]);
        assert_eq!(q[16], -2);
        assert_eq!(scale.d, 1.0 / (-127.0 / -2.54f32));
        assert_eq!(scale.bsums[..2], [2, -2]);
        // A positive maximum gives a negative scale: the codes flip sign, their product not.
        x[0] = 2.6;
        let scale = quantize_super_block(&x, &mut q);
        assert!(scale.d < 0.0);
        assert_eq!(q[0], -127);
        let mut zero = [1i8; QK_K];
        let scale = quantize_super_block(&[0.0; QK_K], &mut zero);
        assert_eq!((zero, scale), ([0; QK_K], SuperScale::default()));
    }
}

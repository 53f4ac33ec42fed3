//! A dense f32 linear layer, `y = x Wᵀ + b`, for the sentence-embedding encoder.
//!
//! The weights are packed once, at load, into panels of [`NR`] output features: panel `p` holds
//! `W[p·NR + lane][k]` at `k·NR + lane`, zero past the last feature. The activations are packed
//! per call into tiles of [`MR`] rows, `x[t·MR + i][k]` at `k·MR + i`, zero past the last row.
//! The kernel keeps an `MR × NR` block of outputs in registers and, for each `k`, multiplies one
//! panel row by every row of the tile: each weight read serves `MR` tokens, each activation
//! `NR` features. Panels are the outer loop, so a panel stays in cache while every row tile
//! passes over it and the whole matrix is read once per call.
//!
//! Invariants:
//! - every output is one multiply-add chain over `k` in order, from zero, plus the bias: a row's
//!   result does not depend on the other rows, on the tiling, nor on the thread count;
//! - shapes need not be multiples of the tiles: the zero padding only ever meets padded rows or
//!   padded features, which are never written out.
//!
//! One kernel body, generic over its vector type ([`Lanes`]), is instantiated for AVX-512 and
//! for AVX2 with fused multiply-adds (chosen at run time), and on plain arrays with separate
//! multiply and add for other CPUs, where `f32::mul_add` would be a library call. The vector
//! types are explicit because LLVM, left to itself, kept the accumulators in memory.

use std::ops::Range;

use rayon::prelude::*;

/// Output features per weight panel.
pub const NR: usize = 16;
/// Rows (tokens) per register tile.
pub const MR: usize = 6;

/// Below this many multiply-adds a product stays on the calling thread: splitting it costs
/// more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 20;

/// `y = x Wᵀ + b` with `W` of shape `[out_features, in_features]`.
pub struct Dense {
    out_features: usize,
    in_features: usize,
    /// `panels[p][k][lane]`, see the module header.
    panels: Vec<f32>,
    /// Padded with zeros to a whole number of panels.
    bias: Vec<f32>,
}

impl std::fmt::Debug for Dense {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dense")
            .field("out_features", &self.out_features)
            .field("in_features", &self.in_features)
            .finish()
    }
}

impl Dense {
    /// Packs `weight` (row-major `[out_features, in_features]`, PyTorch's layout) and `bias`
    /// (`[out_features]`).
    pub fn new(weight: &[f32], bias: &[f32], out_features: usize, in_features: usize) -> Self {
        assert_eq!(weight.len(), out_features * in_features, "weight shape");
        assert_eq!(bias.len(), out_features, "bias shape");
        let k = in_features;
        let n_panels = out_features.div_ceil(NR);
        let mut panels = vec![0f32; n_panels * k * NR];
        for (feature, row) in weight.chunks_exact(k).enumerate() {
            let (p, lane) = (feature / NR, feature % NR);
            let panel = &mut panels[p * k * NR..(p + 1) * k * NR];
            for (kk, &w) in row.iter().enumerate() {
                panel[kk * NR + lane] = w;
            }
        }
        let mut padded_bias = bias.to_vec();
        padded_bias.resize(n_panels * NR, 0.0);
        Self {
            out_features,
            in_features,
            panels,
            bias: padded_bias,
        }
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// `y[m × out_features] = x[m × in_features] Wᵀ + b`. Splits the output features over the
    /// current rayon pool's threads when there is more than one and the product is large.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        let (k, n) = (self.in_features, self.out_features);
        let m = x.len() / k;
        assert_eq!(x.len(), m * k, "input is not a whole number of rows");
        assert_eq!(y.len(), m * n, "output size mismatch");
        if m == 0 {
            return;
        }
        let xp = pack_rows(x, m, k);
        let n_panels = n.div_ceil(NR);
        let threads = rayon::current_num_threads();
        if threads == 1 || m * n * k < PARALLEL_MIN_MACS {
            self.run(&xp, m, 0..n_panels, y);
            return;
        }
        // Each task computes a contiguous range of features into a buffer of its own; the
        // buffers are then copied into their columns of `y`.
        let per_task = n_panels.div_ceil(threads);
        let parts: Vec<(usize, Vec<f32>)> = (0..n_panels)
            .step_by(per_task)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|first| {
                let panels = first..(first + per_task).min(n_panels);
                let cols = self.cols(&panels);
                let mut out = vec![0f32; m * cols.len()];
                self.run(&xp, m, panels, &mut out);
                (cols.start, out)
            })
            .collect();
        for (col0, out) in parts {
            let width = out.len() / m;
            for (dst, src) in y.chunks_exact_mut(n).zip(out.chunks_exact(width)) {
                dst[col0..col0 + width].copy_from_slice(src);
            }
        }
    }

    /// The output columns that `panels` cover.
    fn cols(&self, panels: &Range<usize>) -> Range<usize> {
        panels.start * NR..(panels.end * NR).min(self.out_features)
    }

    /// Computes the columns of `panels` for every row into `out`, row-major with one row per
    /// input row and as many columns as `panels` cover.
    fn run(&self, xp: &[f32], m: usize, panels: Range<usize>, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
                // SAFETY: the features were just detected.
                return unsafe { x86::run_avx512(self, xp, m, panels, out) };
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the features were just detected.
                return unsafe { x86::run_avx2(self, xp, m, panels, out) };
            }
        }
        run_body::<Portable>(self, xp, m, panels, out)
    }
}

/// Copies `x` (`m × k`, row-major) into tiles of [`MR`] rows, `k`-major inside a tile, the
/// last tile padded with zero rows.
fn pack_rows(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let tiles = m.div_ceil(MR);
    let mut xp = vec![0f32; tiles * k * MR];
    for (row, values) in x.chunks_exact(k).enumerate() {
        let (t, i) = (row / MR, row % MR);
        let tile = &mut xp[t * k * MR..(t + 1) * k * MR];
        for (kk, &v) in values.iter().enumerate() {
            tile[kk * MR + i] = v;
        }
    }
    xp
}

/// [`NR`] f32 lanes and the three operations the kernel needs. Implemented on CPU vector
/// registers where the CPU has them, and on a plain array elsewhere; the kernel is written once
/// against this trait, so every implementation computes the same chains in the same order.
trait Lanes: Copy {
    fn splat(x: f32) -> Self;
    fn load(w: &[f32; NR]) -> Self;
    /// `self * b + c` per lane.
    fn mul_add(self, b: Self, c: Self) -> Self;
    fn store(self, out: &mut [f32; NR]);
}

/// The fallback: separate multiply and add, since without FMA hardware `f32::mul_add` is a
/// library call.
#[derive(Clone, Copy)]
struct Portable([f32; NR]);

impl Lanes for Portable {
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Self([x; NR])
    }
    #[inline(always)]
    fn load(w: &[f32; NR]) -> Self {
        Self(*w)
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        Self(std::array::from_fn(|l| self.0[l] * b.0[l] + c.0[l]))
    }
    #[inline(always)]
    fn store(self, out: &mut [f32; NR]) {
        *out = self.0;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! Vector lanes on AVX-512 (one register) and AVX2 (two). Their methods use intrinsics of
    //! features the crate is not compiled for: they are only called from the `#[target_feature]`
    //! functions that [`super::Dense::run`] enters after detecting those features, into which
    //! they are inlined.

    use super::{Lanes, NR};
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(super) struct Avx512(__m512);

    impl Lanes for Avx512 {
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: see the module header (avx512f is present).
            Self(unsafe { _mm512_set1_ps(x) })
        }
        #[inline(always)]
        fn load(w: &[f32; NR]) -> Self {
            // SAFETY: `w` holds 16 floats; avx512f is present.
            Self(unsafe { _mm512_loadu_ps(w.as_ptr()) })
        }
        #[inline(always)]
        fn mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: avx512f is present.
            Self(unsafe { _mm512_fmadd_ps(self.0, b.0, c.0) })
        }
        #[inline(always)]
        fn store(self, out: &mut [f32; NR]) {
            // SAFETY: `out` holds 16 floats; avx512f is present.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), self.0) }
        }
    }

    #[derive(Clone, Copy)]
    pub(super) struct Avx2([__m256; 2]);

    impl Lanes for Avx2 {
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: avx2 is present.
            let v = unsafe { _mm256_set1_ps(x) };
            Self([v, v])
        }
        #[inline(always)]
        fn load(w: &[f32; NR]) -> Self {
            // SAFETY: `w` holds 16 floats, two loads of 8; avx2 is present.
            unsafe {
                Self([
                    _mm256_loadu_ps(w.as_ptr()),
                    _mm256_loadu_ps(w.as_ptr().add(8)),
                ])
            }
        }
        #[inline(always)]
        fn mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: fma is present.
            unsafe {
                Self([
                    _mm256_fmadd_ps(self.0[0], b.0[0], c.0[0]),
                    _mm256_fmadd_ps(self.0[1], b.0[1], c.0[1]),
                ])
            }
        }
        #[inline(always)]
        fn store(self, out: &mut [f32; NR]) {
            // SAFETY: `out` holds 16 floats, two stores of 8; avx2 is present.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr(), self.0[0]);
                _mm256_storeu_ps(out.as_mut_ptr().add(8), self.0[1]);
            }
        }
    }

    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn run_avx512(
        d: &super::Dense,
        xp: &[f32],
        m: usize,
        panels: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        super::run_body::<Avx512>(d, xp, m, panels, out)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_avx2(
        d: &super::Dense,
        xp: &[f32],
        m: usize,
        panels: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        super::run_body::<Avx2>(d, xp, m, panels, out)
    }
}

/// The kernel: for each panel, for each row tile, an `MR × NR` block of multiply-add chains
/// held in `MR` vectors.
#[inline(always)]
fn run_body<V: Lanes>(d: &Dense, xp: &[f32], m: usize, panels: Range<usize>, out: &mut [f32]) {
    let k = d.in_features;
    let cols = d.cols(&panels);
    let width = cols.len();
    debug_assert_eq!(out.len(), m * width);
    for p in panels {
        let w = &d.panels[p * k * NR..(p + 1) * k * NR];
        let bias: &[f32; NR] = d.bias[p * NR..(p + 1) * NR].try_into().unwrap();
        let col = p * NR - cols.start;
        let live = NR.min(width - col);
        for (t, xt) in xp.chunks_exact(k * MR).enumerate() {
            let mut acc = [V::splat(0.0); MR];
            for (wk, xk) in w.chunks_exact(NR).zip(xt.chunks_exact(MR)) {
                let wv = V::load(wk.try_into().unwrap());
                for (a, &xv) in acc.iter_mut().zip(xk) {
                    *a = V::splat(xv).mul_add(wv, *a);
                }
            }
            let rows = MR.min(m - t * MR);
            let mut block = [0f32; NR];
            for (i, a) in acc.iter().enumerate().take(rows) {
                a.store(&mut block);
                let dst = &mut out[(t * MR + i) * width + col..][..live];
                for ((o, &a), &b) in dst.iter_mut().zip(&block).zip(bias) {
                    *o = a + b;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::values;
    use proptest::prelude::*;

    /// The definition, in f64.
    fn naive(x: &[f32], w: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                    .sum();
                y[i * n + j] = (dot + b[j] as f64) as f32;
            }
        }
        y
    }

    fn check(m: usize, n: usize, k: usize, threads: usize, seed: u64) {
        let (x, w, b) = (
            values(m * k, seed),
            values(n * k, seed + 1),
            values(n, seed + 2),
        );
        let dense = Dense::new(&w, &b, n, k);
        let mut y = vec![f32::NAN; m * n];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| dense.forward(&x, &mut y));
        let expect = naive(&x, &w, &b, m, n, k);
        for (idx, (&got, &want)) in y.iter().zip(&expect).enumerate() {
            // Terms are below 0.25 in magnitude: f32 rounding over k of them stays far below
            // this, a missing or misplaced term far above.
            assert!(
                (got - want).abs() <= 1e-6 * (k + 1) as f32,
                "m={m} n={n} k={k} threads={threads}: y[{}][{}] = {got}, want {want}",
                idx / n,
                idx % n
            );
        }
    }

    #[test]
    fn matches_the_definition_on_odd_shapes() {
        for (m, n, k) in [
            (1, 1, 1),
            (1, 17, 5),
            (7, 15, 3),
            (MR, NR, 8),
            (MR + 1, NR + 1, 33),
            (13, 50, 1),
        ] {
            check(m, n, k, 1, (m * n * k) as u64);
        }
    }

    #[test]
    fn threads_split_large_products_without_changing_them() {
        let (m, n, k) = (25, 300, 200);
        let (x, w, b) = (values(m * k, 1), values(n * k, 2), values(n, 3));
        let dense = Dense::new(&w, &b, n, k);
        assert!(m * n * k >= PARALLEL_MIN_MACS, "large enough to be split");
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut y = vec![0f32; m * n];
            pool.install(|| dense.forward(&x, &mut y));
            y
        };
        let one = run(1);
        assert_eq!(one, run(3), "bit-identical whatever the thread count");
        check(m, n, k, 3, 4);
    }

    #[test]
    fn a_row_does_not_depend_on_its_neighbours() {
        let (m, n, k) = (9, 40, 70);
        let (x, w, b) = (values(m * k, 5), values(n * k, 6), values(n, 7));
        let dense = Dense::new(&w, &b, n, k);
        let mut all = vec![0f32; m * n];
        dense.forward(&x, &mut all);
        for i in 0..m {
            let mut one = vec![0f32; n];
            dense.forward(&x[i * k..(i + 1) * k], &mut one);
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
        }
    }

    #[test]
    fn no_rows_is_no_work() {
        let dense = Dense::new(&[1.0; 6], &[0.0; 2], 2, 3);
        dense.forward(&[], &mut []);
        assert_eq!(dense.out_features(), 2);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn matches_the_definition(
            m in 1usize..20,
            n in 1usize..70,
            k in 1usize..90,
            seed in any::<u64>(),
        ) {
            check(m, n, k, 1, seed);
        }
    }
}

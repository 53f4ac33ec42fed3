//! Causal attention over the paged KV cache, for a ragged batch.
//!
//! Each token of the batch attends to the keys and values of its own sequence at positions
//! `0..=position`, read in place from the sequence's blocks: no gathering into contiguous
//! tensors, no padding, no mask. candle has no paged attention on the CPU, so this is the one
//! hand-written numerical loop of the forward pass; it is written so that a token's result
//! depends only on its own query and its own sequence's cache (fixed summation order), which
//! keeps decoding batch-invariant.
//!
//! Grouped-query attention: the query heads sharing a KV head are processed together. Work is
//! split across threads by tile: up to 16 consecutive tokens of one sequence. The cache holds
//! f16 (as llama.cpp's does); each key and value is widened to f32 as it is read, exactly, and
//! everything after is f32. The portable loop, the reference, takes a token at a time.
//!
//! On x86-64 with AVX-512 and a head size that is a multiple of 16, a tile runs on 16-lane
//! registers, bit for bit the portable loop for each of its tokens (the same fused
//! multiply-adds per lane, the same reduction tree), so a token's result does not depend on its
//! tile: each block of keys is widened once for all of the tile's query rows, each row's 16
//! scores are reduced together, and six rows' outputs accumulate in registers over the
//! positions, each value vector read once for the six and prefetched a few positions ahead,
//! since a sequence's blocks are scattered. The softmax is shared and written to vectorize (a
//! polynomial exponential within 2 ulp of libm's, sums in 16 fixed lanes).
//!
//! [`paged_attention_ops`] is the device path's attention, over a cache held as tensors: built
//! from candle operations (gather the blocks, batched matmuls, a causal mask, softmax, a second
//! matmul), so it runs on any device candle supports, with decode tokens optionally handed to the
//! paged decode kernel ([`super::paged_kernel`]). The tests hold both, the kernel through its CPU
//! reference, against the loop above.

use crate::team;
use candle_core::Tensor;
use half::f16;

use super::paged_kernel::PagedDecode;
use crate::kv_cache::{BlockId, KvLayout};
use crate::Result;

/// The tokens of one sequence inside a batch: rows `start..start + len` of the batch, at
/// positions `pos0..pos0 + len`, with the sequence's block table.
#[derive(Clone, Debug)]
pub struct SeqSlice {
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub blocks: Vec<BlockId>,
}

/// Consecutive tokens of one sequence attended together: each key and value vector read (and
/// widened) once serves all of their query heads.
const TILE: usize = 16;

/// `q` is `[tokens, n_heads * head_dim]`; writes `out` of the same shape. `keys` and `values`
/// are one layer of a cache held as arrays, laid out as `layout` says, with the current tokens'
/// keys and values already in place. `seqs` cover the batch's rows in order. With a `window`
/// (a sliding-window layer), a token at position `p` attends to the last `window` positions,
/// `p + 1 - window ..= p`, as llama.cpp's and Hugging Face's Gemma do; tokens whose window has
/// left position 0 behind are tiles of their own (they share no first position).
pub fn paged_attention(
    q: &[f32],
    (keys, values, layout): (&[f16], &[f16], &KvLayout),
    seqs: &[SeqSlice],
    n_heads: usize,
    window: Option<usize>,
    out: &mut [f32],
) {
    let (hd, bs) = (layout.head_dim, layout.block_size);
    let group = n_heads / layout.n_kv_heads;
    let row = n_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    debug_assert_eq!(seqs.iter().map(|s| s.len).sum::<usize>() * row, q.len());
    // The first position token `t` of `seq` sees.
    let first = |seq: &SeqSlice, t: usize| match window {
        Some(w) => (seq.pos0 + t + 1).saturating_sub(w),
        None => 0,
    };
    // Where each position's vector starts for KV head 0 (head g is `g * bs * hd` on), per
    // sequence, from the first position its first token sees (the blocks before it may have
    // been given back).
    let at: Vec<Vec<usize>> = seqs
        .iter()
        .map(|seq| {
            (first(seq, 0)..seq.pos0 + seq.len)
                .map(|j| layout.offset(seq.blocks[j / bs], 0, j % bs))
                .collect()
        })
        .collect();
    // (sequence, first token, end) of every tile, and its rows of `out`.
    let tiles: Vec<(usize, usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            // Tokens that see position 0 (those before position `window`) go in tiles of up
            // to TILE, the rest one by one.
            let shared = window.map_or(seq.len, |w| w.saturating_sub(seq.pos0).min(seq.len));
            let tiled = (0..shared)
                .step_by(TILE)
                .map(move |t0| (s, t0, (t0 + TILE).min(shared)));
            tiled.chain((shared..seq.len).map(move |t| (s, t, t + 1)))
        })
        .collect();
    let mut parts = Vec::with_capacity(tiles.len());
    let mut rest = out;
    for &(_, t0, t1) in &tiles {
        let (part, tail) = rest.split_at_mut((t1 - t0) * row);
        parts.push(part);
        rest = tail;
    }
    let mut work: Vec<_> = parts.into_iter().zip(&tiles).collect();
    team::for_each_mut(&mut work, |(out, tile)| {
        let (s, t0, t1) = **tile;
        let seq = &seqs[s];
        let q = &q[(seq.start + t0) * row..(seq.start + t1) * row];
        let (lo, base) = (first(seq, t0), first(seq, 0));
        for g in 0..layout.n_kv_heads {
            let head = KvHead {
                keys,
                values,
                at: &at[s][lo - base..seq.pos0 + t1 - base],
                shift: g * bs * hd,
                hd,
            };
            let tile = Tile {
                stride: row,
                offset: g * group * hd,
                group,
                tokens: t1 - t0,
                ctx0: seq.pos0 + t0 + 1 - lo,
            };
            attend(q, out, &tile, &head, scale);
        }
    });
}

/// One KV head of one sequence: its positions' vectors start at `at[j] + shift` in `keys` and
/// `values`.
struct KvHead<'a> {
    keys: &'a [f16],
    values: &'a [f16],
    at: &'a [usize],
    shift: usize,
    hd: usize,
}

/// The query rows of a tile that read one KV head: token `t`'s head `h` (of `group`) is at
/// `t * stride + offset + h * hd` in the query and output arrays, and sees the first `ctx0 + t`
/// positions.
struct Tile {
    stride: usize,
    offset: usize,
    group: usize,
    tokens: usize,
    ctx0: usize,
}

impl Tile {
    /// Where token `t`'s group of query heads starts.
    fn at(&self, t: usize) -> usize {
        t * self.stride + self.offset
    }
}

/// The tile's query rows attend to their positions of `head`, writing theirs of `out`. The
/// AVX-512 path gives bit-identical results to the portable one (the same fused multiply-adds
/// in the same order per lane, the same reduction tree), so a token's result does not depend
/// on the tile it is in.
fn attend(q: &[f32], out: &mut [f32], tile: &Tile, head: &KvHead, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if head.hd.is_multiple_of(LANES) && std::arch::is_x86_feature_detected!("avx512f") {
        SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: the feature was just detected; every position's vector lies in the
            // arrays (the layout's offsets), every row in `q` and `out`.
            unsafe { avx512::attend(q, out, tile, head, scale, scratch) }
        });
        return;
    }
    portable_tile(q, out, tile, head, scale)
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Scores and widened keys of the tile in progress, kept for the thread's next.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The reference semantics of [`attend`], a token at a time.
fn portable_tile(q: &[f32], out: &mut [f32], tile: &Tile, head: &KvHead, scale: f32) {
    let span = tile.group * head.hd;
    let mut scores = Vec::new();
    for t in 0..tile.tokens {
        let ctx = tile.ctx0 + t;
        scores.resize(tile.group * ctx, 0.0);
        let head = KvHead {
            at: &head.at[..ctx],
            ..*head
        };
        let at = tile.at(t);
        portable_attend(
            &q[at..at + span],
            &mut out[at..at + span],
            &head,
            scale,
            &mut scores,
        );
    }
}

/// One token's query heads `qg` (a group sharing `head`) attend to every position of `head`,
/// writing `og`; `scores` is scratch of one row per query head.
fn portable_attend(qg: &[f32], og: &mut [f32], head: &KvHead, scale: f32, scores: &mut [f32]) {
    let (hd, ctx) = (head.hd, head.at.len());
    let group = qg.len() / hd;
    for (j, &at) in head.at.iter().enumerate() {
        let k = &head.keys[at + head.shift..at + head.shift + hd];
        for h in 0..group {
            scores[h * ctx + j] = dot(&qg[h * hd..(h + 1) * hd], k) * scale;
        }
    }
    softmax_rows(&mut scores[..group * ctx], ctx);
    og.fill(0.0);
    for (j, &at) in head.at.iter().enumerate() {
        let v = &head.values[at + head.shift..at + head.shift + hd];
        for h in 0..group {
            axpy(scores[h * ctx + j], v, &mut og[h * hd..(h + 1) * hd]);
        }
    }
}

/// Each row of `ctx` scores in `scores` turned into probabilities. Written to vectorize: the
/// maximum by [`max`], the exponentials by [`exp_le0`], the sum by [`sum`].
fn softmax_rows(scores: &mut [f32], ctx: usize) {
    for s in scores.chunks_exact_mut(ctx) {
        let max = max(s);
        for x in s.iter_mut() {
            *x = exp_le0(*x - max);
        }
        let inv = 1.0 / sum(s);
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
}

/// `e^x` for `x <= 0`, within 2 ulp of `f32::exp`, branch-free so that a loop of it
/// vectorizes: `x = n ln 2 + r`, `e^r` by its Taylor polynomial on `|r| <= ln 2 / 2`, scaled by
/// `2^n` built in the exponent bits. Below -87 (where `e^x` is under `f32`'s normal range) the
/// result is `e^-87`, which no softmax can tell from 0; a NaN counts as below, anything above 0
/// as 0.
#[inline(always)]
fn exp_le0(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Not `clamp`, which keeps a NaN: the conversion below needs a number in range.
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.0).min(0.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p.mul_add(r, c);
    }
    // SAFETY: `x` is in [-87, 0], so `n` is a whole number in [-126, 0]: a plain conversion
    // (`as` would add a saturation check per lane, which stops the loop vectorizing).
    let n = unsafe { n.to_int_unchecked::<i32>() };
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// The largest of `s` (`-inf` if empty), in 16 lanes so that it vectorizes; the maximum is
/// exact, so the order does not matter.
fn max(s: &[f32]) -> f32 {
    let (acc, rest) = lanes(s, f32::NEG_INFINITY, f32::max);
    rest.iter()
        .chain(&acc)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The sum of `s` in a fixed order: 16 partial sums, [`fold_lanes`], then the rest in order.
fn sum(s: &[f32]) -> f32 {
    let (acc, rest) = lanes(s, 0.0, |a, x| a + x);
    rest.iter().fold(fold_lanes(acc), |t, x| t + x)
}

/// `s` folded by `op` into 16 lanes (lane `l` takes elements `l`, `l + 16`, ... in order), and
/// what is left past the last whole 16.
#[inline(always)]
fn lanes(s: &[f32], init: f32, op: impl Fn(f32, f32) -> f32) -> ([f32; LANES], &[f32]) {
    let mut acc = [init; LANES];
    let mut chunks = s.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (a, x) in acc.iter_mut().zip(chunk) {
            *a = op(*a, *x);
        }
    }
    (acc, chunks.remainder())
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{softmax_rows, KvHead, Tile, LANES};
    use half::f16;
    use std::arch::x86_64::*;

    /// Sixteen f16 values at `p`, widened to f32.
    #[inline(always)]
    unsafe fn load(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }

    /// [`super::portable_tile`] for a head size that is a multiple of 16. Scores: each block of
    /// 16 positions' keys is widened once into `scratch`, then every query row of the tile takes
    /// its 16 scores as 16 registers of partial sums, reduced together by [`tree16`] (each lane
    /// the tree of [`super::dot`]). Values: rows six at a time accumulate their outputs in
    /// registers over the positions, each value vector read once for the six.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attend(
        q: &[f32],
        out: &mut [f32],
        tile: &Tile,
        head: &KvHead,
        scale: f32,
        scratch: &mut Vec<f32>,
    ) {
        let (hd, group) = (head.hd, tile.group);
        let rows = tile.tokens * group;
        let ctx_max = tile.ctx0 + tile.tokens - 1;
        debug_assert!(head.at.len() >= ctx_max);
        debug_assert!(tile.at(tile.tokens - 1) + group * hd <= q.len().min(out.len()));
        debug_assert!(head
            .at
            .iter()
            .all(|&at| { at + head.shift + hd <= head.keys.len().min(head.values.len()) }));
        let width = ctx_max.next_multiple_of(LANES);
        scratch.clear();
        scratch.resize(rows * width + LANES * hd, 0.0);
        let (scores, wide) = scratch.split_at_mut(rows * width);
        // Row `r` is token `r / group`'s query head `r % group`.
        let row_at = |r: usize| tile.at(r / group) + (r % group) * hd;
        let ctx = |r: usize| tile.ctx0 + r / group;
        let keys = head.keys.as_ptr().add(head.shift);
        for jb in (0..ctx_max).step_by(LANES) {
            let n = (ctx_max - jb).min(LANES);
            for (i, dst) in wide.chunks_exact_mut(hd).enumerate() {
                let dst = dst.as_mut_ptr();
                for c in 0..hd / LANES {
                    let v = match i < n {
                        true => load(keys.add(head.at[jb + i] + c * LANES)),
                        false => _mm512_setzero_ps(),
                    };
                    _mm512_storeu_ps(dst.add(c * LANES), v);
                }
            }
            // The rows whose context reaches this block.
            let first = (jb + 1).saturating_sub(tile.ctx0) * group;
            for r in first..rows {
                let (q, dst) = (
                    q.as_ptr().add(row_at(r)),
                    scores.as_mut_ptr().add(r * width + jb),
                );
                match hd / LANES {
                    4 => score::<4>(q, wide, hd, scale, dst),
                    _ => score::<0>(q, wide, hd, scale, dst),
                }
            }
        }
        for r in 0..rows {
            softmax_rows(&mut scores[r * width..r * width + ctx(r)], ctx(r));
        }
        let values = head.values.as_ptr().add(head.shift);
        let mut r0 = 0;
        while r0 < rows {
            let take = (rows - r0).min(6);
            let mut c = 0;
            while c < hd / LANES {
                let w = if hd / LANES - c >= 4 { 4 } else { 1 };
                let job = Job {
                    scores: scores.as_ptr(),
                    values: values.add(c * LANES),
                    at: head.at,
                };
                let rows_at = |i: usize| {
                    let r = r0 + i;
                    (
                        r * width,
                        ctx(r),
                        out.as_mut_ptr().add(row_at(r) + c * LANES),
                    )
                };
                match w {
                    4 => job.rows::<4>(take, rows_at),
                    _ => job.rows::<1>(take, rows_at),
                }
                c += w;
            }
            r0 += take;
        }
    }

    /// One query row's scores against 16 positions whose keys are widened in `wide` (a
    /// position every `hd`), scaled, stored at `dst`: `C` chunks of 16 per head (0: the head's
    /// own count, unknown when compiled).
    #[target_feature(enable = "avx512f")]
    unsafe fn score<const C: usize>(
        q: *const f32,
        wide: &[f32],
        hd: usize,
        scale: f32,
        dst: *mut f32,
    ) {
        let chunks = if C == 0 { hd / LANES } else { C };
        let wide = wide.as_ptr();
        let mut acc = [_mm512_setzero_ps(); LANES];
        for c in 0..chunks {
            let a = _mm512_loadu_ps(q.add(c * LANES));
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(a, _mm512_loadu_ps(wide.add(j * hd + c * LANES)), *acc);
            }
        }
        // `dot`'s empty tail (+ 0), then the scale.
        let sums = _mm512_add_ps(tree16(&acc), _mm512_setzero_ps());
        _mm512_storeu_ps(dst, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
    }

    /// Lane `i`: the sum of the 16 lanes of `acc[i]` by [`super::fold_lanes`]'s tree (lane `l`
    /// plus lane `l + 8`, then + 4, + 2, + 1), for the 16 at once: at each level, two registers'
    /// partial sums are packed into one, first halves with first halves, and added to the
    /// second halves.
    #[target_feature(enable = "avx512f")]
    unsafe fn tree16(acc: &[__m512; LANES]) -> __m512 {
        // The inputs in the order that leaves lane `i` with `acc[i]`'s sum.
        let b = [
            fold8(acc[0], acc[4]),
            fold8(acc[8], acc[12]),
            fold8(acc[1], acc[5]),
            fold8(acc[9], acc[13]),
            fold8(acc[2], acc[6]),
            fold8(acc[10], acc[14]),
            fold8(acc[3], acc[7]),
            fold8(acc[11], acc[15]),
        ];
        let c = [
            fold4(b[0], b[1]),
            fold4(b[2], b[3]),
            fold4(b[4], b[5]),
            fold4(b[6], b[7]),
        ];
        let d = [fold2(c[0], c[1]), fold2(c[2], c[3])];
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
        )
    }

    /// 16 sums each of `a` and `b` to 8 (lane `l` plus lane `l + 8`): `a`'s in the low half.
    #[inline(always)]
    unsafe fn fold8(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    }

    /// Two registers of two 8-sums each to four registers' 4-sums (`l` plus `l + 4`), one per
    /// 128-bit lane.
    #[inline(always)]
    unsafe fn fold4(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    }

    /// In each 128-bit lane, the 4-sums of `a` and `b` to 2-sums (`l` plus `l + 2`), `a`'s
    /// first.
    #[inline(always)]
    unsafe fn fold2(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    }

    /// Positions ahead whose vectors are fetched into the cache while this one is used: the
    /// blocks of a sequence are scattered, so the hardware's stride prefetch stops at each.
    const AHEAD: usize = 8;

    /// Brings the `bytes` at `p` into the cache.
    #[inline(always)]
    unsafe fn prefetch(p: *const f16, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>((p as *const i8).add(line));
        }
    }

    /// The values side of a tile: probabilities (rows in `scores`) times value vectors (at
    /// `values + at[j]`, 16 lanes per chunk from there).
    struct Job<'a> {
        scores: *const f32,
        values: *const f16,
        at: &'a [usize],
    }

    impl Job<'_> {
        /// [`Self::run`] for `take` (1 to 6) rows, `rows_at(i)` saying row `i`'s.
        #[target_feature(enable = "avx512f")]
        unsafe fn rows<const W: usize>(
            &self,
            take: usize,
            rows_at: impl FnMut(usize) -> (usize, usize, *mut f32),
        ) {
            use std::array::from_fn;
            match take {
                6 => self.run::<6, W>(from_fn(rows_at)),
                5 => self.run::<5, W>(from_fn(rows_at)),
                4 => self.run::<4, W>(from_fn(rows_at)),
                3 => self.run::<3, W>(from_fn(rows_at)),
                2 => self.run::<2, W>(from_fn(rows_at)),
                _ => self.run::<1, W>(from_fn(rows_at)),
            }
        }

        /// For `R` rows, each `(its scores' start, its context, its output)`: output chunks
        /// `0..W` are `sum_j p[j] * v_j` in position order, each value chunk read once for the
        /// `R` rows.
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const R: usize, const W: usize>(&self, rows: [(usize, usize, *mut f32); R]) {
            let mut acc = [[_mm512_setzero_ps(); W]; R];
            let longest = rows.iter().map(|r| r.1).max().unwrap_or(0);
            for j in 0..longest {
                if let Some(&next) = self.at.get(j + AHEAD) {
                    prefetch(self.values.add(next), W * LANES * 2);
                }
                let at = *self.at.get_unchecked(j);
                let mut v = [_mm512_setzero_ps(); W];
                for (w, v) in v.iter_mut().enumerate() {
                    *v = load(self.values.add(at + w * LANES));
                }
                for (acc, &(p, ctx, _)) in acc.iter_mut().zip(&rows) {
                    // Rows of later tokens see more positions.
                    if j >= ctx {
                        continue;
                    }
                    let pj = _mm512_set1_ps(*self.scores.add(p + j));
                    for (acc, v) in acc.iter_mut().zip(&v) {
                        *acc = _mm512_fmadd_ps(pj, *v, *acc);
                    }
                }
            }
            for (acc, &(_, _, o)) in acc.iter().zip(&rows) {
                for (w, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(o.add(w * LANES), *acc);
                }
            }
        }
    }
}

/// [`paged_attention`] from candle operations: `q` is `[tokens, n_heads * head_dim]`; `keys` and
/// `values` are one layer of the cache, `[num_blocks, n_kv_heads, block_size, head_dim]`, with
/// the current tokens' keys and values already in place. Returns `[tokens, n_heads * head_dim]`,
/// on `q`'s device. `seqs` must cover the batch's rows in order.
///
/// The decode tokens (one-token sequences) run together, a fixed number of operations whatever
/// their count: `decode_with` says how, the paged decode kernel reading the cache in place, or
/// candle operations (their block tables padded to the longest, gathered, one batched matmul, a
/// mask of each one's length, softmax, a second matmul). Prefill chunks run one sequence at a
/// time, from candle operations. With a `window`, a token sees the last `window` positions, as
/// in [`paged_attention`]; its decode steps then run from candle operations whatever
/// `decode_with` says (the kernel attends from position 0).
pub fn paged_attention_ops(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    seqs: &[SeqSlice],
    n_heads: usize,
    window: Option<usize>,
    decode_with: DecodeAttention,
) -> Result<Tensor> {
    let (decode, chunks): (Vec<&SeqSlice>, Vec<&SeqSlice>) = seqs.iter().partition(|s| s.len == 1);
    let mut parts = Vec::with_capacity(chunks.len() + 1);
    let mut order: Vec<u32> = Vec::with_capacity(q.dim(0)?);
    if !decode.is_empty() {
        parts.push(match (decode_with, window) {
            (DecodeAttention::Kernel, None) => decode_kernel(q, (keys, values), &decode, n_heads)?,
            _ => decode_attention(q, (keys, values), &decode, n_heads, window)?,
        });
        order.extend(decode.iter().map(|s| s.start as u32));
    }
    for seq in chunks {
        parts.push(chunk_attention(q, (keys, values), seq, n_heads, window)?);
        order.extend((seq.start..seq.start + seq.len).map(|r| r as u32));
    }
    let out = Tensor::cat(&parts, 0)?;
    // `order[i]` is the batch row that row `i` of `out` answers; put every row back in place.
    let mut inverse = vec![0u32; order.len()];
    for (i, &row) in order.iter().enumerate() {
        inverse[row as usize] = i as u32;
    }
    if inverse.iter().enumerate().all(|(i, &r)| i as u32 == r) {
        return Ok(out);
    }
    Ok(out.index_select(&Tensor::new(inverse.as_slice(), q.device())?, 0)?)
}

/// How the device path attends for decode tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeAttention {
    /// The paged decode kernel, [`PagedDecode`]: one launch, the cache read in place.
    Kernel,
    /// Candle operations: gather, batched matmuls, mask, softmax ([`paged_attention_ops`]).
    Ops,
}

/// The block tables of one-token sequences padded to the longest with its first block, `[n,
/// width]`, and that width: the mask or the lengths hide what the padding holds.
fn padded_tables(decode: &[&SeqSlice], block_size: usize) -> (Vec<u32>, usize) {
    let used = |s: &SeqSlice| (s.pos0 + 1).div_ceil(block_size);
    let width = decode.iter().map(|s| used(s)).max().unwrap_or(1);
    let ids = decode
        .iter()
        .flat_map(|s| {
            let table = &s.blocks[..used(s)];
            (0..width).map(move |i| table.get(i).unwrap_or(&table[0]).index() as u32)
        })
        .collect();
    (ids, width)
}

/// [`decode_attention`] by the paged decode kernel.
fn decode_kernel(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    decode: &[&SeqSlice],
    n_heads: usize,
) -> Result<Tensor> {
    let (tables, width) = padded_tables(decode, keys.dim(2)?);
    let rows: Vec<u32> = decode.iter().map(|s| s.start as u32).collect();
    let q = q.index_select(&Tensor::new(rows.as_slice(), q.device())?, 0)?;
    let op = PagedDecode {
        tables,
        lens: decode.iter().map(|s| s.pos0 as u32 + 1).collect(),
        width,
        n_heads,
    };
    op.run(&q, keys, values)
}

/// Whether a token at `last` sees position `j`: causal, and within `window` when there is one.
fn visible(j: usize, last: usize, window: Option<usize>) -> bool {
    j <= last && window.is_none_or(|w| j + w > last)
}

/// Attention of one-token sequences, batched: `[decode.len(), n_heads * head_dim]`.
fn decode_attention(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    decode: &[&SeqSlice],
    n_heads: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let (_, n_kv_heads, block_size, hd) = keys.dims4()?;
    let (n, group) = (decode.len(), n_heads / n_kv_heads);
    let device = q.device();
    let (ids, width) = padded_tables(decode, block_size);
    let len = width * block_size;
    let ids = Tensor::new(ids.as_slice(), device)?;
    // [n * width, kv heads, block, hd] -> [n * kv heads, width * block, hd]
    let gather = |cache: &Tensor| -> Result<Tensor> {
        Ok(cache
            .index_select(&ids, 0)?
            .reshape((n, width, n_kv_heads, block_size, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((n * n_kv_heads, len, hd))?)
    };
    let (k, v) = (gather(keys)?, gather(values)?);
    let rows: Vec<u32> = decode.iter().map(|s| s.start as u32).collect();
    let q = q
        .index_select(&Tensor::new(rows.as_slice(), device)?, 0)?
        .reshape((n * n_kv_heads, group, hd))?;
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?.reshape((n, n_kv_heads * group, len))?;
    let mask: Vec<f32> = decode
        .iter()
        .flat_map(|s| {
            (0..len).map(move |j| {
                if visible(j, s.pos0, window) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (n, 1, len), device)?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?.reshape((
        n * n_kv_heads,
        group,
        len,
    ))?;
    Ok(p.matmul(&v)?.reshape((n, n_heads * hd))?)
}

/// Attention of one sequence's chunk of tokens: `[seq.len, n_heads * head_dim]`.
fn chunk_attention(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    seq: &SeqSlice,
    n_heads: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let (_, n_kv_heads, block_size, hd) = keys.dims4()?;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    let device = q.device();
    let ctx = seq.pos0 + seq.len;
    let used = ctx.div_ceil(block_size);
    let ids: Vec<u32> = seq.blocks[..used]
        .iter()
        .map(|b| b.index() as u32)
        .collect();
    let ids = Tensor::new(ids.as_slice(), device)?;
    // [used, kv heads, block, hd] -> [kv heads, used * block, hd], the first `ctx` positions.
    let gather = |cache: &Tensor| -> Result<Tensor> {
        Ok(cache
            .index_select(&ids, 0)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n_kv_heads, used * block_size, hd))?
            .narrow(1, 0, ctx)?)
    };
    let (k, v) = (gather(keys)?, gather(values)?);
    // The sequence's query rows, grouped by the KV head they read: [kv heads, group * len, hd].
    let rows = group * seq.len;
    let q = q
        .narrow(0, seq.start, seq.len)?
        .reshape((seq.len, n_kv_heads, group, hd))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((n_kv_heads, rows, hd))?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    // Row `r` is token `r % len`, at position `pos0 + r % len`: it sees keys up to there (and
    // back to its window's start).
    let mask: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let last = seq.pos0 + r % seq.len;
            (0..ctx).map(move |j| {
                if visible(j, last, window) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (1, rows, ctx), device)?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    Ok(p.matmul(&v)?
        .reshape((n_kv_heads, group, seq.len, hd))?
        .permute((2, 0, 1, 3))?
        .contiguous()?
        .reshape((seq.len, n_heads * hd))?)
}

const LANES: usize = 16;

/// Dot product with a fixed summation order (16 partial sums, then a fixed tree).
#[inline]
fn dot(a: &[f32], b: &[f16]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (a, b) = (
            &a[c * LANES..(c + 1) * LANES],
            &b[c * LANES..(c + 1) * LANES],
        );
        for l in 0..LANES {
            acc[l] = a[l].mul_add(b[l].to_f32(), acc[l]);
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..a.len() {
        tail = a[i].mul_add(b[i].to_f32(), tail);
    }
    fold_lanes(acc) + tail
}

/// The sum of 16 partial sums by a fixed tree: lane l plus lane l + 8, then + 4, + 2, + 1.
#[inline]
fn fold_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `y += a * x`.
#[inline]
fn axpy(a: f32, x: &[f16], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x.to_f32(), *y);
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::kv_cache::{KvDtype, KvStorage, LayerKv};

    fn arrays(kv: &KvStorage) -> (&[f16], &[f16], &KvLayout) {
        let LayerKv::Arrays { keys, values } = kv.layer(0) else {
            unreachable!("KvStorage::new holds arrays")
        };
        (keys, values, kv.layout())
    }

    /// Naive attention over contiguous keys/values, for comparison.
    fn naive(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], hd: usize) -> Vec<f32> {
        let scores: Vec<f32> = ks
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt())
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        (0..hd)
            .map(|d| e.iter().zip(vs).map(|(p, v)| p * v[d]).sum::<f32>() / sum)
            .collect()
    }

    #[test]
    fn matches_naive_attention_across_blocks() {
        let layout = KvLayout::new(1, 4, 2, 16, KvDtype::F16);
        // Longer than a tile, so that tiles of several tokens and tokens alone both occur.
        let (n_heads, hd, len) = (4, 16, 21);
        let mut kv = KvStorage::new(layout, 8);
        // Deliberately scattered blocks.
        let blocks = [5, 1, 7, 0, 3, 6].map(BlockId).to_vec();
        let val = |t: usize, i: usize| ((t * 31 + i * 7) % 23) as f32 / 23.0 - 0.5;
        let mut keys = vec![vec![]; 2];
        let mut vals = vec![vec![]; 2];
        for t in 0..len {
            let k: Vec<f32> = (0..2 * hd).map(|i| val(t, i)).collect();
            let v: Vec<f32> = (0..2 * hd).map(|i| val(t + 3, i + 1)).collect();
            kv.write_token(0, blocks[t / 4], t % 4, &k, &v).unwrap();
            for g in 0..2 {
                // What the cache holds: f16.
                let held = |x: &[f32]| -> Vec<f32> {
                    x.iter().map(|v| f16::from_f32(*v).to_f32()).collect()
                };
                keys[g].push(held(&k[g * hd..(g + 1) * hd]));
                vals[g].push(held(&v[g * hd..(g + 1) * hd]));
            }
        }
        let q: Vec<f32> = (0..len * n_heads * hd).map(|i| val(i, 2)).collect();
        let seqs = [SeqSlice {
            start: 0,
            len,
            pos0: 0,
            blocks,
        }];
        // Causal, then sliding windows: narrower than a block, than a tile, and wider than
        // the sequence.
        for window in [None, Some(1), Some(3), Some(6), Some(17), Some(64)] {
            let mut out = vec![0f32; q.len()];
            paged_attention(&q, arrays(&kv), &seqs, n_heads, window, &mut out);
            for t in 0..len {
                let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
                for h in 0..n_heads {
                    let g = h / 2;
                    let at = (t * n_heads + h) * hd;
                    let (ks, vs) = (&keys[g][lo..=t], &vals[g][lo..=t]);
                    let expect = naive(&q[at..at + hd], ks, vs, hd);
                    for d in 0..hd {
                        let diff = (out[at + d] - expect[d]).abs();
                        assert!(diff < 1e-5, "{window:?} t{t} h{h} d{d}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_softmax_exponential_is_within_two_ulp() {
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (ours, libm) = (exp_le0(x), x.exp());
            let ulp = (ours.to_bits() as i64 - libm.to_bits() as i64).abs();
            assert!(ulp <= 2, "e^{x}: {ours} vs {libm} ({ulp} ulp)");
        }
        assert!(exp_le0(-1e30) < 1e-37 && exp_le0(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp_le0(0.0), 1.0);
        let s: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        assert_eq!(sum(&s), s.iter().sum::<f32>());
    }

    /// The AVX-512 path is the portable loop, bit for bit, for every head size it takes and
    /// tiles of one to sixteen tokens (so a token's result does not depend on its tile).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_simd_attention_is_the_portable_loop_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let val = |a: usize, b: usize| ((a * 7919 + b * 104_729) % 1009) as f32 / 500.0 - 1.0;
        for (hd, group, tokens, ctx0) in [
            (16, 1, 1, 1),
            (64, 3, 1, 37),
            (64, 3, 16, 1),
            (64, 3, 16, 300),
            (64, 4, 5, 20),
            (128, 2, 7, 65),
            (48, 3, 3, 20),
            (256, 4, 3, 40),
        ] {
            let ctx = ctx0 + tokens - 1;
            let len = ctx * hd * 3 + 5;
            let keys: Vec<f16> = (0..len).map(|i| f16::from_f32(val(i, 1))).collect();
            let values: Vec<f16> = (0..len).map(|i| f16::from_f32(val(i, 2))).collect();
            // Scattered positions, as blocks put them.
            let at: Vec<usize> = (0..ctx).map(|j| ((j * 5) % ctx) * hd * 2).collect();
            let head = KvHead {
                keys: &keys,
                values: &values,
                at: &at,
                shift: hd,
                hd,
            };
            // The second of two KV heads' groups, in rows of both.
            let tile = Tile {
                stride: 2 * group * hd,
                offset: group * hd,
                group,
                tokens,
                ctx0,
            };
            let q: Vec<f32> = (0..tokens * tile.stride).map(|i| val(i, 3)).collect();
            let (mut simd, mut portable) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            let mut scratch = Vec::new();
            // SAFETY: detected above; every vector lies in the arrays.
            unsafe { avx512::attend(&q, &mut simd, &tile, &head, 0.125, &mut scratch) };
            portable_tile(&q, &mut portable, &tile, &head, 0.125);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&simd),
                bits(&portable),
                "hd {hd} group {group} tokens {tokens} ctx0 {ctx0}"
            );
            assert!(portable[tile.offset..].iter().any(|&x| x != 0.0));
        }
    }

    /// The candle-ops attention agrees with the loop on a ragged batch: a prefill from position
    /// 0, a decode step deep in its context, a chunk in the middle and a decode step with a short
    /// context (the two decode steps batched, their rows put back in place), over scattered
    /// blocks.
    #[test]
    fn the_candle_ops_attention_matches_the_loop() {
        let layout = KvLayout::new(1, 4, 2, 16, KvDtype::F16);
        let (n_heads, num_blocks) = (6, 16);
        let mut kv = KvStorage::new(layout, num_blocks);
        let val = |a: usize, b: usize| ((a * 37 + b * 11) % 29) as f32 / 29.0 - 0.5;
        let width = layout.n_kv_heads * layout.head_dim;
        for block in 0..num_blocks {
            for slot in 0..layout.block_size {
                let k: Vec<f32> = (0..width).map(|i| val(block * 5 + slot, i)).collect();
                let v: Vec<f32> = (0..width).map(|i| val(block + slot * 3, i + 7)).collect();
                kv.write_token(0, BlockId(block as u32), slot, &k, &v)
                    .unwrap();
            }
        }
        let ids = |list: &[u32]| list.iter().map(|&b| BlockId(b)).collect::<Vec<_>>();
        let seqs = [
            SeqSlice {
                start: 0,
                len: 7,
                pos0: 0,
                blocks: ids(&[9, 2]),
            },
            SeqSlice {
                start: 7,
                len: 1,
                pos0: 21,
                blocks: ids(&[3, 15, 0, 8, 11, 6]),
            },
            SeqSlice {
                start: 8,
                len: 5,
                pos0: 6,
                blocks: ids(&[14, 1, 12]),
            },
            SeqSlice {
                start: 13,
                len: 1,
                pos0: 2,
                blocks: ids(&[4]),
            },
        ];
        let tokens = 14;
        let row = n_heads * layout.head_dim;
        let q: Vec<f32> = (0..tokens * row).map(|i| val(i, 3)).collect();
        let shape = (
            num_blocks,
            layout.n_kv_heads,
            layout.block_size,
            layout.head_dim,
        );
        // The device path's cache is f32: the same values, widened, its blocks side by side.
        let (keys, values, view) = arrays(&kv);
        let wide = |x: &[f16]| {
            let x: Vec<f32> = (0..num_blocks)
                .flat_map(|b| {
                    let at = view.offset(BlockId(b as u32), 0, 0);
                    x[at..at + layout.block_elems()].iter().map(|v| v.to_f32())
                })
                .collect();
            Tensor::from_vec(x, shape, &Device::Cpu).unwrap()
        };
        let (keys, values) = (wide(keys), wide(values));
        let qt = Tensor::from_vec(q.clone(), (tokens, row), &Device::Cpu).unwrap();
        // The paged decode kernel's CPU reference for the two decode steps, and candle
        // operations for them, against the loop; causal, and with sliding windows narrower than
        // a block, than a chunk, and wider than every context.
        for window in [None, Some(1), Some(3), Some(6), Some(64)] {
            let mut expected = vec![0f32; q.len()];
            paged_attention(&q, arrays(&kv), &seqs, n_heads, window, &mut expected);
            for decode in [DecodeAttention::Kernel, DecodeAttention::Ops] {
                let got =
                    paged_attention_ops(&qt, (&keys, &values), &seqs, n_heads, window, decode)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                assert_eq!(got.len(), expected.len());
                let worst = got
                    .iter()
                    .zip(&expected)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst < 1e-5,
                    "{window:?} {decode:?}: largest difference {worst}"
                );
            }
        }
    }
}

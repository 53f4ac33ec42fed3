//! Causal attention over the paged KV cache, for a ragged batch.
//!
//! Each token of the batch attends to the keys and values of its own sequence at positions
//! `0..=position`, read in place from the sequence's blocks: no gathering into contiguous
//! tensors, no padding, no mask. candle has no paged attention on the CPU, so this is the one
//! hand-written numerical loop of the forward pass; it is written so that a token's result
//! depends only on its own query and its own sequence's cache (fixed summation order), which
//! keeps decoding batch-invariant.
//!
//! Grouped-query attention: the query heads sharing a KV head are processed together, so each
//! key and value vector is read once per group. Work is split across threads by token.

use rayon::prelude::*;

use crate::kv_cache::{BlockId, KvStorage};

/// The tokens of one sequence inside a batch: rows `start..start + len` of the batch, at
/// positions `pos0..pos0 + len`, with the sequence's block table.
#[derive(Clone, Debug)]
pub struct SeqSlice {
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub blocks: Vec<BlockId>,
}

/// `q` is `[tokens, n_heads * head_dim]`; writes `out` of the same shape. The current tokens'
/// keys and values must already be in `kv`.
pub fn paged_attention(
    q: &[f32],
    kv: &KvStorage,
    layer: usize,
    seqs: &[SeqSlice],
    n_heads: usize,
    out: &mut [f32],
) {
    let layout = *kv.layout();
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let row = n_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let (keys, values) = kv.layer(layer);
    // (sequence, position) of every token row.
    let rows: Vec<(usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| (0..seq.len).map(move |i| (s, seq.pos0 + i)))
        .collect();
    debug_assert_eq!(rows.len() * row, q.len());
    out.par_chunks_mut(row)
        .zip(q.par_chunks(row))
        .zip(rows.par_iter())
        .for_each(|((out, q), &(s, pos))| {
            let blocks = &seqs[s].blocks;
            let ctx = pos + 1;
            let mut scores = vec![0f32; group * ctx];
            for g in 0..layout.n_kv_heads {
                let qg = &q[g * group * hd..(g + 1) * group * hd];
                let og = &mut out[g * group * hd..(g + 1) * group * hd];
                for j in 0..ctx {
                    let at = layout.offset(blocks[j / layout.block_size], g, j % layout.block_size);
                    let k = &keys[at..at + hd];
                    for h in 0..group {
                        scores[h * ctx + j] = dot(&qg[h * hd..(h + 1) * hd], k) * scale;
                    }
                }
                for h in 0..group {
                    let s = &mut scores[h * ctx..(h + 1) * ctx];
                    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for x in s.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    for x in s.iter_mut() {
                        *x *= inv;
                    }
                }
                og.fill(0.0);
                for j in 0..ctx {
                    let at = layout.offset(blocks[j / layout.block_size], g, j % layout.block_size);
                    let v = &values[at..at + hd];
                    for h in 0..group {
                        axpy(scores[h * ctx + j], v, &mut og[h * hd..(h + 1) * hd]);
                    }
                }
            }
        });
}

const LANES: usize = 16;

/// Dot product with a fixed summation order (16 partial sums, then a fixed tree).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (a, b) = (
            &a[c * LANES..(c + 1) * LANES],
            &b[c * LANES..(c + 1) * LANES],
        );
        for l in 0..LANES {
            acc[l] = a[l].mul_add(b[l], acc[l]);
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..a.len() {
        tail = a[i].mul_add(b[i], tail);
    }
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// `y += a * x`.
#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x, *y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvLayout;

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
        let layout = KvLayout {
            num_layers: 1,
            block_size: 4,
            n_kv_heads: 2,
            head_dim: 16,
        };
        let (n_heads, hd, len) = (4, 16, 11);
        let mut kv = KvStorage::new(layout, 8);
        // Deliberately scattered blocks.
        let blocks = vec![BlockId(5), BlockId(1), BlockId(7)];
        let val = |t: usize, i: usize| ((t * 31 + i * 7) % 23) as f32 / 23.0 - 0.5;
        let mut keys = vec![vec![]; 2];
        let mut vals = vec![vec![]; 2];
        for t in 0..len {
            let k: Vec<f32> = (0..2 * hd).map(|i| val(t, i)).collect();
            let v: Vec<f32> = (0..2 * hd).map(|i| val(t + 3, i + 1)).collect();
            kv.write(0, blocks[t / 4], t % 4, &k, &v);
            for g in 0..2 {
                keys[g].push(k[g * hd..(g + 1) * hd].to_vec());
                vals[g].push(v[g * hd..(g + 1) * hd].to_vec());
            }
        }
        let q: Vec<f32> = (0..len * n_heads * hd).map(|i| val(i, 2)).collect();
        let seqs = [SeqSlice {
            start: 0,
            len,
            pos0: 0,
            blocks,
        }];
        let mut out = vec![0f32; q.len()];
        paged_attention(&q, &kv, 0, &seqs, n_heads, &mut out);
        for t in 0..len {
            for h in 0..n_heads {
                let g = h / 2;
                let at = (t * n_heads + h) * hd;
                let expect = naive(&q[at..at + hd], &keys[g][..=t], &vals[g][..=t], hd);
                for d in 0..hd {
                    assert!((out[at + d] - expect[d]).abs() < 1e-5, "t{t} h{h} d{d}");
                }
            }
        }
    }
}

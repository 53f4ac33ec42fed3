//! The decode attention kernel of the device path, as a candle custom operation: on a GPU the
//! CUDA kernel of `kernels/paged_attention.cu` (compiled to PTX by the build under the `cuda`
//! feature, loaded once per device), on the CPU [`decode_reference`], the same algorithm in
//! Rust, which the tests hold against the attention built from candle operations.
//!
//! Each (sequence, query head) is one unit of work. Its positions are dealt round-robin to
//! [`WARPS`] partitions; each partition keeps a running softmax (the largest score so far, the
//! sum of exponentials relative to it, the values weighted likewise) and the partitions are
//! merged at the end. The context length is unbounded and no score is stored.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use crate::Result;

/// Partitions of a unit's positions: the CUDA kernel's warps per thread block.
const WARPS: usize = 4;
/// Head dimensions the CUDA kernel takes: a multiple of its 32 lanes, at most 8 elements each.
pub fn kernel_fits(head_dim: usize) -> bool {
    head_dim.is_multiple_of(32) && head_dim <= 256
}

/// One decode step's attention: `seqs` one-token sequences, sequence `i` attending to positions
/// `0..lens[i]` through blocks `tables[i * width..(i + 1) * width]`.
pub struct PagedDecode {
    pub tables: Vec<u32>,
    pub lens: Vec<u32>,
    pub width: usize,
    pub n_heads: usize,
}

impl PagedDecode {
    /// `q` `[seqs, n_heads * head_dim]`; `keys`, `values` `[blocks, kv_heads, block_size,
    /// head_dim]`. Returns `[seqs, n_heads * head_dim]`.
    pub fn run(&self, q: &Tensor, keys: &Tensor, values: &Tensor) -> Result<Tensor> {
        Ok(q.contiguous()?.apply_op3_no_bwd(keys, values, self)?)
    }

    fn dims(&self, q: &Layout, cache: &Layout) -> candle_core::Result<Dims> {
        let (seqs, width) = q.shape().dims2()?;
        let (_, n_kv_heads, block_size, head_dim) = cache.shape().dims4()?;
        if width != self.n_heads * head_dim
            || seqs != self.lens.len()
            || self.tables.len() != seqs * self.width
            || !self.n_heads.is_multiple_of(n_kv_heads)
        {
            candle_core::bail!("paged decode: shapes disagree");
        }
        Ok(Dims {
            seqs,
            n_heads: self.n_heads,
            n_kv_heads,
            block_size,
            head_dim,
        })
    }
}

#[derive(Clone, Copy)]
struct Dims {
    seqs: usize,
    n_heads: usize,
    n_kv_heads: usize,
    block_size: usize,
    head_dim: usize,
}

/// The kernel's algorithm on the CPU, over contiguous `q`, `keys`, `values`.
fn decode_reference(
    op: &PagedDecode,
    d: Dims,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
) -> Vec<f32> {
    let hd = d.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let group = d.n_heads / d.n_kv_heads;
    let mut out = vec![0f32; d.seqs * d.n_heads * hd];
    for seq in 0..d.seqs {
        let table = &op.tables[seq * op.width..(seq + 1) * op.width];
        for head in 0..d.n_heads {
            let kv_head = head / group;
            let at = (seq * d.n_heads + head) * hd;
            let qh: Vec<f32> = q[at..at + hd].iter().map(|x| x * scale).collect();
            let mut parts: [(f32, f32, Vec<f32>); WARPS] =
                std::array::from_fn(|_| (f32::NEG_INFINITY, 0f32, vec![0f32; hd]));
            for (w, (m, l, acc)) in parts.iter_mut().enumerate() {
                for j in (w..op.lens[seq] as usize).step_by(WARPS) {
                    let block = table[j / d.block_size] as usize;
                    let row =
                        ((block * d.n_kv_heads + kv_head) * d.block_size + j % d.block_size) * hd;
                    let s: f32 = qh
                        .iter()
                        .zip(&keys[row..row + hd])
                        .map(|(a, b)| a * b)
                        .sum();
                    let top = m.max(s);
                    let (correction, p) = ((*m - top).exp(), (s - top).exp());
                    *l = *l * correction + p;
                    for (a, v) in acc.iter_mut().zip(&values[row..row + hd]) {
                        *a = *a * correction + p * v;
                    }
                    *m = top;
                }
            }
            let top = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out[at..at + hd];
            let mut sum = 0f32;
            for (m, l, acc) in &parts {
                let e = (m - top).exp();
                sum += l * e;
                for (x, a) in o.iter_mut().zip(acc) {
                    *x += a * e;
                }
            }
            o.iter_mut().for_each(|x| *x /= sum);
        }
    }
    out
}

/// The contiguous f32 data of a CPU storage, from its layout's offset.
fn cpu_slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("paged decode: inputs must be contiguous");
    };
    Ok(&s.as_slice::<f32>()?[start..end])
}

impl CustomOp3 for PagedDecode {
    fn name(&self) -> &'static str {
        "paged-decode"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = self.dims(ql, kl)?;
        let (q, k, v) = (cpu_slice(q, ql)?, cpu_slice(k, kl)?, cpu_slice(v, vl)?);
        let out = decode_reference(self, d, q, k, v);
        Ok((
            CpuStorage::F32(out),
            Shape::from((d.seqs, d.n_heads * d.head_dim)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, self.dims(ql, kl)?, (q, ql), (k, kl), (v, vl))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Shape};

    use super::{kernel_fits, Dims, PagedDecode, WARPS};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    /// The contiguous f32 data of a device storage, from its layout's offset.
    fn view<'a>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, f32>> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("paged decode: inputs must be contiguous");
        };
        Ok(s.as_cuda_slice::<f32>()?.slice(start..end))
    }

    pub(super) fn forward(
        op: &PagedDecode,
        d: Dims,
        (q, ql): Input,
        (k, kl): Input,
        (v, vl): Input,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        if !kernel_fits(d.head_dim) {
            candle_core::bail!("paged decode: head dimension {} unsupported", d.head_dim);
        }
        let (qv, kv, vv) = (view(q, ql)?, view(k, kl)?, view(v, vl)?);
        let dev = &q.device;
        let tables = dev.clone_htod(&op.tables)?;
        let lens = dev.clone_htod(&op.lens)?;
        let len = d.seqs * d.n_heads * d.head_dim;
        // SAFETY: the kernel writes every element of `out` before anything reads it.
        let out = unsafe { dev.alloc::<f32>(len)? };
        let func = dev.get_or_load_custom_func("paged_decode_f32", "swarmgate_paged", PTX)?;
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let ints = [d.n_heads, d.n_kv_heads, d.block_size, d.head_dim, op.width].map(|x| x as i32);
        let mut launch = func.builder();
        launch
            .arg(&qv)
            .arg(&kv)
            .arg(&vv)
            .arg(&tables)
            .arg(&lens)
            .arg(&out);
        for x in &ints {
            launch.arg(x);
        }
        launch.arg(&scale);
        let config = LaunchConfig {
            grid_dim: (d.n_heads as u32, d.seqs as u32, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature in order and type, and the grid
        // covers (head, sequence) pairs within the buffers' sizes, checked by `dims`.
        unsafe { launch.launch(config) }.w()?;
        let shape = Shape::from((d.seqs, d.n_heads * d.head_dim));
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape))
    }
}

//! The operations fused into a product's activation quantization: the RMSNorm before the
//! attention's and the feed-forward's input products, and the gated activation (SwiGLU, or
//! Gemma's GELU times up) before the feed-forward's output product.
//!
//! The kernels quantize their inputs block by block anyway; an [`Input`] computes each block of
//! inputs just before it is quantized, so the normalised or gated rows are never written out and
//! read again, and a layer takes three fewer tensor operations (each an allocation, a pass over
//! the rows and a dispatch: at one stream, most of the time between the products). The values
//! are those candle's operations compute, the same f32 operations in the same order (candle's
//! `rms_norm`, `silu`, `gelu` and the product of the halves), so fusing changes no result.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape};

use super::linear::Linear;

/// The activation of a gated feed-forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// SwiGLU's `x·σ(x)` (llama).
    Silu,
    /// GELU's tanh approximation (Gemma, as llama.cpp computes it).
    GeluTanh,
}

impl Gate {
    fn apply(self, v: f32) -> f32 {
        match self {
            Self::Silu => v / (1.0 + (-v).exp()),
            Self::GeluTanh => {
                const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
                0.5 * v * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v)))
            }
        }
    }
}

/// A product's input rows of `k` values, as a kernel reads them.
#[derive(Clone, Copy)]
pub enum Input<'a> {
    /// The rows themselves.
    Rows(&'a [f32]),
    /// Each row of `x` divided by its root mean square (`√(Σx²/k + eps)`), times `weight`.
    Normed {
        x: &'a [f32],
        weight: &'a [f32],
        eps: f32,
    },
    /// `gate(g)·u` of rows `[g | u]`, `2k` wide.
    Gated { gate_up: &'a [f32], gate: Gate },
}

impl Input<'_> {
    /// Rows of `k` inputs, or `None` when the values are not a whole number of rows.
    pub fn rows(&self, k: usize) -> Option<usize> {
        let (len, width) = match *self {
            Self::Rows(x) => (x.len(), k),
            Self::Normed { x, weight, .. } => (x.len(), if weight.len() == k { k } else { 0 }),
            Self::Gated { gate_up, .. } => (gate_up.len(), 2 * k),
        };
        (width > 0 && len % width == 0).then(|| len / width)
    }

    /// What every block of a row needs computed from the whole row first: the root mean
    /// squares of a norm's rows.
    pub fn prepare(&self, k: usize) -> Prepared<'_> {
        let norms = match *self {
            Self::Normed { x, eps, .. } => x
                .chunks_exact(k)
                .map(|row| {
                    let sum2 = row.iter().map(|&v| v * v).sum::<f32>();
                    (sum2 / k as f32 + eps).sqrt()
                })
                .collect(),
            Self::Rows(_) | Self::Gated { .. } => Vec::new(),
        };
        Prepared {
            input: *self,
            k,
            rows: self.rows(k).unwrap_or(0),
            norms,
        }
    }
}

/// An [`Input`] ready to be read block by block.
pub struct Prepared<'a> {
    input: Input<'a>,
    k: usize,
    rows: usize,
    norms: Vec<f32>,
}

impl Prepared<'_> {
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Writes inputs `start..start + dst.len()` of row `row` into `dst`.
    pub fn fill(&self, row: usize, start: usize, dst: &mut [f32]) {
        let k = self.k;
        let at = row * k + start;
        match self.input {
            Input::Rows(x) => dst.copy_from_slice(&x[at..at + dst.len()]),
            Input::Normed { x, weight, .. } => {
                let m = self.norms[row];
                let (x, w) = (&x[at..at + dst.len()], &weight[start..start + dst.len()]);
                for ((d, &x), &w) in dst.iter_mut().zip(x).zip(w) {
                    *d = x / m * w;
                }
            }
            Input::Gated { gate_up, gate } => {
                let g = &gate_up[2 * row * k + start..][..dst.len()];
                let u = &gate_up[(2 * row + 1) * k + start..][..dst.len()];
                for ((d, &g), &u) in dst.iter_mut().zip(g).zip(u) {
                    *d = gate.apply(g) * u;
                }
            }
        }
    }
}

/// `linear(rms_norm(x, weight))` as one operation on the CPU.
pub struct NormedLinear<'a> {
    pub linear: &'a Linear,
    pub eps: f32,
}

impl CustomOp2 for NormedLinear<'_> {
    fn name(&self) -> &'static str {
        "swarmgate-normed-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(x, xl)?;
        let weight = contiguous(w, wl)?;
        let input = Input::Normed {
            x,
            weight,
            eps: self.eps,
        };
        run(self.linear, input, xl.shape().dims())
    }
}

/// `linear(gate(g)·u)` of rows `[g | u]` as one operation on the CPU.
pub struct GatedLinear<'a> {
    pub linear: &'a Linear,
    pub gate: Gate,
}

impl CustomOp1 for GatedLinear<'_> {
    fn name(&self) -> &'static str {
        "swarmgate-gated-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let gate_up = contiguous(s, l)?;
        let input = Input::Gated {
            gate_up,
            gate: self.gate,
        };
        run(self.linear, input, l.shape().dims())
    }
}

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = s else {
        candle_core::bail!("fused products expect f32 activations");
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("fused products expect contiguous activations");
    };
    Ok(&data[start..end])
}

/// Runs `linear` on `input`, whose tensor had dimensions `dims`: the result keeps the leading
/// ones, its last is the product's outputs.
fn run(linear: &Linear, input: Input, dims: &[usize]) -> candle_core::Result<(CpuStorage, Shape)> {
    let Some(rows) = input.rows(linear.in_features()) else {
        candle_core::bail!("{dims:?} are not rows of {} inputs", linear.in_features());
    };
    let mut dst = vec![0f32; rows * linear.out_features()];
    linear.matmul_input(input, &mut dst);
    let mut shape = dims[..dims.len().saturating_sub(1)].to_vec();
    shape.push(linear.out_features());
    Ok((CpuStorage::F32(dst), Shape::from(shape)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{quantized, values};
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor, D};

    /// Each fused product equals the product of candle's own operations' output, bit for bit,
    /// for the 32-wide and the 256-wide (K-quant) activation blocks.
    #[test]
    fn fused_products_equal_candles_operations_then_the_product() {
        let (k, n, rows) = (512, 64, 3);
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q6K] {
            let linear = Linear::from_qtensors(&[&quantized(dtype, n, k, 7)]).unwrap();
            let cpu = &Device::Cpu;
            let x = Tensor::from_vec(values(rows * k, 1), (rows, k), cpu).unwrap();
            let w = Tensor::from_vec(values(k, 2), k, cpu).unwrap();
            let eps = 1e-5;
            let fused = x.apply_op2_no_bwd(
                &w,
                &NormedLinear {
                    linear: &linear,
                    eps,
                },
            );
            let reference = linear.forward(&candle_nn::ops::rms_norm(&x, &w, eps).unwrap());
            assert_eq!(
                fused.unwrap().to_vec2::<f32>().unwrap(),
                reference.unwrap().to_vec2::<f32>().unwrap(),
                "{dtype:?} norm"
            );
            let gate_up = Tensor::from_vec(values(rows * 2 * k, 3), (rows, 2 * k), cpu).unwrap();
            let (g, u) = (
                gate_up.narrow(D::Minus1, 0, k).unwrap(),
                gate_up.narrow(D::Minus1, k, k).unwrap(),
            );
            for (gate, act) in [
                (Gate::Silu, candle_nn::ops::silu(&g)),
                (Gate::GeluTanh, g.gelu()),
            ] {
                let fused = gate_up.apply_op1_no_bwd(&GatedLinear {
                    linear: &linear,
                    gate,
                });
                let reference = linear.forward(&(act.unwrap() * &u).unwrap());
                assert_eq!(
                    fused.unwrap().to_vec2::<f32>().unwrap(),
                    reference.unwrap().to_vec2::<f32>().unwrap(),
                    "{dtype:?} {gate:?}"
                );
            }
        }
    }

    #[test]
    fn rows_that_do_not_fit_are_refused() {
        let x = [0f32; 10];
        assert_eq!(Input::Rows(&x).rows(5), Some(2));
        assert_eq!(Input::Rows(&x).rows(4), None);
        let gated = Input::Gated {
            gate_up: &x,
            gate: Gate::Silu,
        };
        assert_eq!(gated.rows(5), Some(1));
        let normed = |weight| Input::Normed {
            x: &x,
            weight,
            eps: 1e-6,
        };
        assert_eq!(normed(&x[..5]).rows(5), Some(2));
        assert_eq!(normed(&x[..4]).rows(5), None);
    }
}

//! Kernel ridge classification over the anchors: the learned half of the `embedding` strategy.
//!
//! Nearest neighbours score an agent by its few anchors most like the request; a request whose
//! topic words belong to one agent and whose task to another ("write a reassuring email about
//! falling sales") sits near the wrong agent's anchors. A linear model fitted on every anchor
//! weighs what separates the agents across all of them instead. With the kernel the router
//! already computes (an anchor's similarity to another: MiniLM cosine plus weighted n-gram
//! cosine), kernel ridge regression fits one-hot targets (centred) in closed form: the
//! coefficients are `(K + λI)⁻¹ Y`, one column per agent, and a request's score for an agent is
//! its similarities to the anchors times that column. No iterations, no learning rate: one
//! Cholesky solve of an anchors-by-anchors system (a few hundred: milliseconds), redone when the
//! registry changes.
//!
//! The solve is written out rather than taken from a linear-algebra crate: it is the only one
//! the router needs, on a matrix that is symmetric positive definite by construction (a sum of
//! Gram matrices plus λI).

/// The ridge penalty λ, chosen by five-fold cross-validation over the default swarm's examples
/// (0.1, 0.3 and 1.0 within a point of each other).
pub const LAMBDA: f64 = 0.1;

/// Coefficients fitted over `n` anchors for `classes` classes: row `i` holds anchor `i`'s weight
/// in each class's score.
#[derive(Debug, Default)]
pub struct Ridge {
    classes: usize,
    coefficients: Vec<f32>,
}

impl Ridge {
    /// Fits `kernel` (row-major, `labels.len()` squared: the anchors' similarities to each other)
    /// to `labels` (each anchor's class, below `classes`). `None` when the system cannot be
    /// solved (a kernel that is not positive semi-definite, which a Gram matrix never is).
    pub fn fit(kernel: &[f64], labels: &[usize], classes: usize) -> Option<Self> {
        let n = labels.len();
        debug_assert_eq!(kernel.len(), n * n);
        let mut system = kernel.to_vec();
        for i in 0..n {
            system[i * n + i] += LAMBDA;
        }
        let factor = cholesky(system, n)?;
        let centre = 1.0 / classes as f64;
        let mut coefficients = vec![0.0f32; n * classes];
        let mut column = vec![0.0f64; n];
        for class in 0..classes {
            for (value, &label) in column.iter_mut().zip(labels) {
                *value = f64::from(u8::from(label == class)) - centre;
            }
            solve(&factor, n, &mut column);
            for (i, value) in column.iter().enumerate() {
                coefficients[i * classes + class] = *value as f32;
            }
        }
        Some(Self {
            classes,
            coefficients,
        })
    }

    /// Each class's score for a request whose similarities to the anchors are `similarities`
    /// (in the anchors' order).
    pub fn scores(&self, similarities: &[f32]) -> Vec<f32> {
        let mut scores = vec![0.0f32; self.classes];
        if self.classes == 0 {
            return scores;
        }
        for (s, row) in similarities
            .iter()
            .zip(self.coefficients.chunks_exact(self.classes))
        {
            for (score, c) in scores.iter_mut().zip(row) {
                *score += s * c;
            }
        }
        scores
    }
}

/// The lower-triangular `L` with `L Lᵀ = a` (row-major, `n` by `n`), or `None` when `a` is not
/// positive definite.
fn cholesky(mut a: Vec<f64>, n: usize) -> Option<Vec<f64>> {
    for j in 0..n {
        let diagonal = a[j * n + j] - (0..j).map(|k| a[j * n + k].powi(2)).sum::<f64>();
        if diagonal <= 0.0 || !diagonal.is_finite() {
            return None;
        }
        let pivot = diagonal.sqrt();
        a[j * n + j] = pivot;
        for i in j + 1..n {
            let dot: f64 = (0..j).map(|k| a[i * n + k] * a[j * n + k]).sum();
            a[i * n + j] = (a[i * n + j] - dot) / pivot;
        }
    }
    for i in 0..n {
        for j in i + 1..n {
            a[i * n + j] = 0.0;
        }
    }
    Some(a)
}

/// Solves `L Lᵀ x = b` in place, `l` from [`cholesky`].
fn solve(l: &[f64], n: usize, b: &mut [f64]) {
    for i in 0..n {
        let dot: f64 = (0..i).map(|k| l[i * n + k] * b[k]).sum();
        b[i] = (b[i] - dot) / l[i * n + i];
    }
    for i in (0..n).rev() {
        let dot: f64 = (i + 1..n).map(|k| l[k * n + i] * b[k]).sum();
        b[i] = (b[i] - dot) / l[i * n + i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cholesky_solves_a_symmetric_positive_definite_system() {
        let a = vec![4.0, 2.0, 0.6, 2.0, 5.0, 1.0, 0.6, 1.0, 3.0];
        let l = cholesky(a.clone(), 3).unwrap();
        // L Lᵀ gives `a` back.
        for i in 0..3 {
            for j in 0..3 {
                let product: f64 = (0..3).map(|k| l[i * 3 + k] * l[j * 3 + k]).sum();
                assert!((product - a[i * 3 + j]).abs() < 1e-12);
            }
        }
        let x = [1.0, -2.0, 0.5];
        let mut b: Vec<f64> = (0..3)
            .map(|i| (0..3).map(|j| a[i * 3 + j] * x[j]).sum())
            .collect();
        solve(&l, 3, &mut b);
        for (found, wanted) in b.iter().zip(x) {
            assert!((found - wanted).abs() < 1e-12, "{b:?}");
        }
        assert!(
            cholesky(vec![1.0, 2.0, 2.0, 1.0], 2).is_none(),
            "indefinite"
        );
    }

    #[test]
    fn a_linear_kernel_separates_what_nearest_neighbours_would_not() {
        // Two classes along the first axis; every anchor also carries a large shared component
        // along the second, so raw similarity is dominated by what the classes share.
        let anchors: [([f64; 2], usize); 6] = [
            ([1.0, 5.0], 0),
            ([0.8, 5.2], 0),
            ([1.2, 4.9], 0),
            ([-1.0, 5.1], 1),
            ([-0.9, 4.8], 1),
            ([-1.1, 5.0], 1),
        ];
        let n = anchors.len();
        let dot = |a: &[f64; 2], b: &[f64; 2]| a[0] * b[0] + a[1] * b[1];
        let kernel: Vec<f64> = (0..n * n)
            .map(|ij| dot(&anchors[ij / n].0, &anchors[ij % n].0))
            .collect();
        let labels: Vec<usize> = anchors.iter().map(|a| a.1).collect();
        let ridge = Ridge::fit(&kernel, &labels, 2).unwrap();
        for (query, class) in [([0.5, 6.0], 0), ([-0.5, 4.0], 1), ([-0.3, 7.0], 1)] {
            let similarities: Vec<f32> = anchors.iter().map(|a| dot(&query, &a.0) as f32).collect();
            let scores = ridge.scores(&similarities);
            let best = if scores[0] > scores[1] { 0 } else { 1 };
            assert_eq!(best, class, "{query:?}: {scores:?}");
        }
    }
}

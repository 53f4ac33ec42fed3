//! The figures every tool reports: nearest-rank percentiles, durations in milliseconds, and the
//! usual summary of a latency distribution.
//!
//! Nearest rank, not interpolation: every figure reported is a value that was measured.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile; sorts `values`. 0 for no values.
pub fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Mean and tail percentiles of one distribution; the JSON keys are part of the tools' reports.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Summary {
    /// The summary of `values` (reordered), or `None` when there are none.
    pub fn of(values: &mut [f64]) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        Some(Self {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: percentile(values, 50.0),
            p90: percentile(values, 90.0),
            p95: percentile(values, 95.0),
            p99: percentile(values, 99.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{percentile, Summary};

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 10.0);
        assert_eq!(percentile(&mut v, 95.0), 19.0);
        assert_eq!(percentile(&mut v, 100.0), 20.0);
        assert_eq!(percentile(&mut [], 50.0), 0.0);
    }

    #[test]
    fn a_summary_is_of_measured_values() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Summary::of(&mut v).unwrap();
        assert_eq!((s.p50, s.p90, s.p95, s.p99), (50.0, 90.0, 95.0, 99.0));
        assert_eq!(s.mean, 50.5);
        assert_eq!(Summary::of(&mut [7.0]).unwrap().p99, 7.0);
        assert_eq!(Summary::of(&mut []), None);
    }
}

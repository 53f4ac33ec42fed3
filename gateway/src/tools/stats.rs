//! The figures every tool reports: nearest-rank percentiles and durations in milliseconds.
//!
//! Nearest rank, not interpolation: every figure reported is a value that was measured.

use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 10.0);
        assert_eq!(percentile(&mut v, 95.0), 19.0);
        assert_eq!(percentile(&mut v, 100.0), 20.0);
        assert_eq!(percentile(&mut [], 50.0), 0.0);
    }
}

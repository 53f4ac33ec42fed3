//! A level's outcomes turned into its figures; the run's report (what `--out` writes, its JSON
//! keys part of the tool's interface); and the table printed at the end.
//!
//! Rates count completed requests only, over the level's wall time (first request sent to last
//! answer read). Latencies are in milliseconds; a distribution with no values (every request
//! failed, or inter-token gaps without streaming) is `null`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::client::{Failure, Sample};
use crate::commands::stats::{ms, Summary};

/// The whole run: what was asked, and each level's figures.
#[derive(Debug, Serialize)]
pub struct Report {
    pub settings: Settings,
    pub levels: Vec<LevelReport>,
}

#[derive(Debug, Serialize)]
pub struct Settings {
    pub url: String,
    pub scenario: &'static str,
    pub model: String,
    pub stream: bool,
    pub concurrency: Vec<usize>,
    pub requests: usize,
    pub max_tokens: usize,
    pub timeout_secs: u64,
}

#[derive(Debug, Serialize)]
pub struct LevelReport {
    pub concurrency: usize,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Failures by kind (`http_503`, `transport`, `timeout`, `stream_error`,
    /// `invalid_response`).
    pub errors: BTreeMap<String, ErrorCount>,
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub output_tokens: usize,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Option<Summary>,
    /// Gaps between consecutive content chunks.
    pub itl_ms: Option<Summary>,
    /// Time per output token after the first, per request.
    pub tpot_ms: Option<Summary>,
    pub e2e_ms: Option<Summary>,
}

#[derive(Debug, PartialEq, Serialize)]
pub struct ErrorCount {
    pub count: usize,
    /// The first such failure's message.
    pub example: String,
}

impl LevelReport {
    pub fn new(concurrency: usize, outcomes: Vec<Result<Sample, Failure>>, wall: Duration) -> Self {
        let requests = outcomes.len();
        let mut errors: BTreeMap<String, ErrorCount> = BTreeMap::new();
        let mut samples = Vec::with_capacity(requests);
        for outcome in outcomes {
            match outcome {
                Ok(sample) => samples.push(sample),
                Err(failure) => {
                    errors
                        .entry(failure.kind())
                        .or_insert_with(|| ErrorCount {
                            count: 0,
                            example: failure.message(),
                        })
                        .count += 1
                }
            }
        }
        let wall_s = wall.as_secs_f64().max(1e-9);
        let output_tokens = samples.iter().map(|s| s.output_tokens).sum();
        Self {
            concurrency,
            requests,
            completed: samples.len(),
            failed: requests - samples.len(),
            errors,
            wall_s,
            requests_per_s: samples.len() as f64 / wall_s,
            output_tokens,
            output_tokens_per_s: output_tokens as f64 / wall_s,
            ttft_ms: summary_ms(samples.iter().map(|s| s.ttft)),
            itl_ms: summary_ms(samples.iter().flat_map(|s| s.gaps.iter().copied())),
            tpot_ms: summary_ms(samples.iter().filter_map(|s| s.tpot)),
            e2e_ms: summary_ms(samples.iter().map(|s| s.e2e)),
        }
    }

    /// One line for the progress output: how the level went.
    pub fn headline(&self) -> String {
        let mut line = format!(
            "concurrency {}: {}/{} completed, {:.1} tokens/s, {:.2} requests/s",
            self.concurrency,
            self.completed,
            self.requests,
            self.output_tokens_per_s,
            self.requests_per_s
        );
        for (kind, error) in &self.errors {
            let _ = write!(line, "; {kind} ×{} ({})", error.count, error.example);
        }
        line
    }
}

fn summary_ms(durations: impl Iterator<Item = Duration>) -> Option<Summary> {
    Summary::of(&mut durations.map(ms).collect::<Vec<_>>())
}

/// The levels as a fixed-width table, one row per level; `-` where nothing was measured.
pub fn table(levels: &[LevelReport]) -> String {
    let mut out = format!(
        "{:>11} {:>9} {:>6} {:>8} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9}\n",
        "concurrency",
        "completed",
        "failed",
        "req/s",
        "tokens/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "e2e p50",
        "e2e p99",
    );
    let cell = |s: Option<Summary>, pick: fn(Summary) -> f64| {
        s.map_or_else(|| "-".to_owned(), |s| format!("{:.1}", pick(s)))
    };
    for l in levels {
        let _ = writeln!(
            out,
            "{:>11} {:>9} {:>6} {:>8.2} {:>9.1} {:>9} {:>9} {:>8} {:>9} {:>9}",
            l.concurrency,
            l.completed,
            l.failed,
            l.requests_per_s,
            l.output_tokens_per_s,
            cell(l.ttft_ms, |s| s.p50),
            cell(l.ttft_ms, |s| s.p99),
            cell(l.itl_ms, |s| s.p50),
            cell(l.e2e_ms, |s| s.p50),
            cell(l.e2e_ms, |s| s.p99),
        );
    }
    out.push_str("latencies in ms\n");
    out
}

#[cfg(test)]
mod tests {
    use reqwest::StatusCode;

    use super::*;

    fn sample(ttft_ms: u64, e2e_ms: u64, tokens: usize) -> Sample {
        Sample {
            ttft: Duration::from_millis(ttft_ms),
            e2e: Duration::from_millis(e2e_ms),
            gaps: vec![Duration::from_millis(5); tokens.saturating_sub(1)],
            output_tokens: tokens,
            tpot: None,
        }
    }

    #[test]
    fn a_level_counts_tokens_rates_and_failures() {
        let overloaded = || Failure::Status {
            code: StatusCode::SERVICE_UNAVAILABLE,
            message: "overloaded".into(),
        };
        let outcomes = vec![
            Ok(sample(10, 100, 8)),
            Err(overloaded()),
            Ok(sample(30, 300, 4)),
            Err(Failure::Timeout),
            Err(overloaded()),
        ];
        let level = LevelReport::new(2, outcomes, Duration::from_secs(2));
        assert_eq!((level.requests, level.completed, level.failed), (5, 2, 3));
        assert_eq!(level.output_tokens, 12);
        assert_eq!(level.output_tokens_per_s, 6.0);
        assert_eq!(level.requests_per_s, 1.0);
        assert_eq!(level.ttft_ms.unwrap().p50, 10.0);
        assert_eq!(level.ttft_ms.unwrap().p99, 30.0);
        assert_eq!(level.e2e_ms.unwrap().mean, 200.0);
        assert_eq!(level.itl_ms.unwrap().p50, 5.0);
        assert_eq!(level.tpot_ms, None);
        assert_eq!(
            level.errors["http_503"],
            ErrorCount {
                count: 2,
                example: "503 Service Unavailable: overloaded".into()
            }
        );
        assert_eq!(level.errors["timeout"].count, 1);
        assert!(level.headline().contains("2/5 completed"));
        assert!(level.headline().contains("http_503 ×2"));
    }

    #[test]
    fn a_level_where_everything_failed_has_no_latencies() {
        let level = LevelReport::new(1, vec![Err(Failure::Timeout)], Duration::from_secs(1));
        assert_eq!((level.ttft_ms, level.e2e_ms), (None, None));
        let json = serde_json::to_value(&level).unwrap();
        assert!(json["ttft_ms"].is_null());
        let table = table(&[level]);
        let row = table.lines().nth(1).unwrap();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>()[..3],
            ["1", "0", "1"]
        );
        assert!(row.trim_end().ends_with('-'), "{table}");
    }
}

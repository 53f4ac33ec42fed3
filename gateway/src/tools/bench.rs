//! `swarmgate bench`: drives the engine in process, closed loop, at several concurrency levels.
//!
//! At level `c`, `c` clients each submit a request, read its stream to the end, and submit the
//! next, until the level's requests are done. Prompts cycle through a fixed, varied set of chat
//! turns; every request decodes exactly `--max-tokens` tokens (EOS ignored) so levels compare.
//!
//! Reported per level: aggregate decode tokens/s (generated tokens over the level's wall time),
//! prefill tokens/s (prompt tokens over the engine's forward time spent on them), time to first
//! token p50/p95 and inter-token latency p50 (gaps between a request's consecutive tokens).

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use engine::{
    ChatMessage, EngineConfig, EngineHandle, EngineStats, Event, GenerateRequest, Prompt,
    SamplingParams,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    concurrency: Vec<usize>,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Requests per level (default: twice the concurrency, at least 8).
    #[arg(long)]
    requests: Option<usize>,
    /// Print one JSON object per level instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineConfig,
}

/// One level's figures; the JSON keys are part of the tool's interface.
#[derive(Debug, Serialize)]
struct LevelReport {
    concurrency: usize,
    requests: usize,
    decode_tok_s: f64,
    prefill_tok_s: f64,
    ttft_p50_ms: f64,
    ttft_p95_ms: f64,
    itl_p50_ms: f64,
    wall_s: f64,
}

/// Timings of one request.
struct RequestTiming {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
}

const QUESTIONS: [&str; 16] = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash map is to a new programmer, with an example in Python.",
    "Give me three tips for sleeping better.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "What are the main differences between TCP and UDP? Answer with a short list.",
    "Write a short, friendly email declining a meeting invitation.",
    "Why is the sky blue?",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "What is 17 times 23? Show your working.",
    "Describe the water cycle for a ten-year-old.",
    "List five healthy breakfast ideas and why each is good for you.",
    "How does a binary search work, and what is its time complexity?",
    "Write a limerick about a cat who learned to code.",
];

pub fn run(args: BenchArgs) -> Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs positive levels");
    }
    let engine = EngineHandle::start(&args.engine)?;
    let prompts = QUESTIONS
        .iter()
        .map(|q| engine.render_chat(&[ChatMessage::new("user", *q)]))
        .collect::<engine::Result<Vec<_>>>()?;
    let requests = |c: usize| args.requests.unwrap_or((2 * c).max(8));
    let total: usize = args
        .concurrency
        .iter()
        .map(|&c| requests(c) * args.max_tokens)
        .sum();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tokens, {per_sec}, eta {eta}")?
            .progress_chars("=> "),
    );
    let mut reports = Vec::new();
    for &c in &args.concurrency {
        bar.set_message(format!("concurrency {c:>3}"));
        let report = run_level(&engine, &prompts, c, requests(c), args.max_tokens, &bar)?;
        reports.push(report);
    }
    bar.finish_and_clear();
    if args.json {
        for r in &reports {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!(
            "{:>11} {:>8} {:>12} {:>13} {:>13} {:>13} {:>12}",
            "concurrency",
            "requests",
            "decode tok/s",
            "prefill tok/s",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "ITL p50 ms"
        );
        for r in &reports {
            println!(
                "{:>11} {:>8} {:>12.1} {:>13.1} {:>13.1} {:>13.1} {:>12.2}",
                r.concurrency,
                r.requests,
                r.decode_tok_s,
                r.prefill_tok_s,
                r.ttft_p50_ms,
                r.ttft_p95_ms,
                r.itl_p50_ms
            );
        }
    }
    Ok(())
}

fn run_level(
    engine: &EngineHandle,
    prompts: &[String],
    concurrency: usize,
    requests: usize,
    max_tokens: usize,
    bar: &ProgressBar,
) -> Result<LevelReport> {
    let before = PrefillCounters::read(engine.stats());
    let next = Mutex::new(0usize);
    let timings = Mutex::new(Vec::with_capacity(requests));
    let started = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let clients: Vec<_> = (0..concurrency)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let i = {
                            let mut n = next.lock().expect("not poisoned");
                            if *n == requests {
                                return Ok(());
                            }
                            *n += 1;
                            *n - 1
                        };
                        let timing =
                            one_request(engine, &prompts[i % prompts.len()], max_tokens, bar)?;
                        timings.lock().expect("not poisoned").push(timing);
                    }
                })
            })
            .collect();
        for client in clients {
            client.join().expect("client thread panicked")?;
        }
        Ok(())
    })?;
    let wall = started.elapsed().as_secs_f64();
    let after = PrefillCounters::read(engine.stats());
    let timings = timings.into_inner().expect("not poisoned");
    let tokens: usize = timings.iter().map(|t| t.tokens).sum();
    let mut ttft: Vec<f64> = timings.iter().map(|t| ms(t.ttft)).collect();
    let mut gaps: Vec<f64> = timings
        .iter()
        .flat_map(|t| t.gaps.iter().map(|&g| ms(g)))
        .collect();
    let prefill_secs = (after.nanos - before.nanos) as f64 / 1e9;
    Ok(LevelReport {
        concurrency,
        requests,
        decode_tok_s: tokens as f64 / wall,
        prefill_tok_s: (after.tokens - before.tokens) as f64 / prefill_secs.max(1e-9),
        ttft_p50_ms: percentile(&mut ttft, 50.0),
        ttft_p95_ms: percentile(&mut ttft, 95.0),
        itl_p50_ms: percentile(&mut gaps, 50.0),
        wall_s: wall,
    })
}

fn one_request(
    engine: &EngineHandle,
    prompt: &str,
    max_tokens: usize,
    bar: &ProgressBar,
) -> Result<RequestTiming> {
    let submitted = Instant::now();
    let mut stream = engine.submit(GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens,
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Text(prompt.to_owned()))
    })?;
    let mut ttft = None;
    let mut last = submitted;
    let mut gaps = Vec::with_capacity(max_tokens);
    let mut tokens = 0;
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Delta { tokens: ids, .. } if !ids.is_empty() => {
                let now = Instant::now();
                match ttft {
                    None => ttft = Some(now - submitted),
                    Some(_) => gaps.push(now - last),
                }
                last = now;
                tokens += ids.len();
                bar.inc(ids.len() as u64);
            }
            Event::Delta { .. } => {}
            Event::Finished { error: Some(e), .. } => bail!("request failed: {e}"),
            Event::Finished { .. } => break,
        }
    }
    Ok(RequestTiming {
        ttft: ttft.unwrap_or_default(),
        gaps,
        tokens,
    })
}

struct PrefillCounters {
    tokens: u64,
    nanos: u64,
}

impl PrefillCounters {
    fn read(stats: &EngineStats) -> Self {
        Self {
            tokens: stats.prefill_tokens.load(Ordering::Relaxed),
            nanos: stats.prefill_nanos.load(Ordering::Relaxed),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile; sorts `values`. 0 for no values.
fn percentile(values: &mut [f64], p: f64) -> f64 {
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

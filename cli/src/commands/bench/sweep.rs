//! The concurrency sweep: closed loop at several concurrency levels on one engine.
//!
//! At level `c`, `c` clients each submit a request, read its stream to the end, and submit the
//! next, until the level's requests are done. Prompts cycle through a fixed, varied set of chat
//! turns; every request decodes exactly `--max-tokens` tokens (EOS ignored) so levels compare.
//!
//! With `--constrained`, each request's answer must follow [`constrained_format`] and the turns
//! ask for it, so every token goes through the grammar: run it and a plain sweep one after the
//! other for the cost of constrained decoding.
//!
//! Reported per level: aggregate decode tokens/s (generated tokens over the level's wall time),
//! prefill tokens/s (prompt tokens over the engine's forward time spent on them), time to first
//! token p50/p95 and inter-token latency p50 (gaps between a request's consecutive tokens).

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Result;
use engine::{
    ChatMessage, EngineHandle, EngineStats, GenerateRequest, Prompt, ResponseFormat, SamplingParams,
};
use indicatif::ProgressBar;
use serde::Serialize;

use super::{closed_loop, stream_request, ttft_p50_p95, wait_until_idle, BenchArgs, Outcome};
use crate::commands::stats::{ms, percentile};
use crate::commands::{progress_bar, CHAT_QUESTIONS};

const DEFAULT_LEVELS: [usize; 4] = [1, 4, 16, 32];
const DEFAULT_MAX_TOKENS: usize = 128;

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

pub(super) fn run(args: &BenchArgs) -> Result<()> {
    let levels = if args.concurrency.is_empty() {
        &DEFAULT_LEVELS[..]
    } else {
        &args.concurrency[..]
    };
    let max_tokens = args.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let engine = EngineHandle::start(&args.engine)?;
    let format = if args.constrained {
        constrained_format()
    } else {
        ResponseFormat::Text
    };
    let prompts = CHAT_QUESTIONS
        .iter()
        .map(|q| {
            let mut turns = vec![ChatMessage::new("user", *q)];
            if args.constrained {
                let ask = "Answer with a JSON array of short strings, one idea each.";
                turns.insert(0, ChatMessage::new("system", ask));
            }
            engine
                .model()
                .encode_chat(&turns, true)
                .map(|prompt| prompt.tokens)
        })
        .collect::<engine::Result<Vec<_>>>()?;
    let requests = |c: usize| args.requests.unwrap_or((2 * c).max(8));
    let total: usize = levels.iter().map(|&c| requests(c) * max_tokens).sum();
    let bar = progress_bar(total, "tokens")?;
    let mut reports = Vec::new();
    for &c in levels {
        bar.set_message(format!("concurrency {c:>3}"));
        let report = run_level(&engine, &prompts, &format, c, requests(c), max_tokens, &bar)?;
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

/// The schema of `--constrained`: an array no answer completes within a benchmark's tokens.
fn constrained_format() -> ResponseFormat {
    ResponseFormat::JsonSchema {
        schema: serde_json::json!({
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 4096
        }),
        strict: true,
    }
}

fn run_level(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    format: &ResponseFormat,
    concurrency: usize,
    requests: usize,
    max_tokens: usize,
    bar: &ProgressBar,
) -> Result<LevelReport> {
    let before = PrefillCounters::read(engine.stats());
    let outcomes = Mutex::new(Vec::with_capacity(requests));
    let started = Instant::now();
    closed_loop(requests, concurrency, |i| {
        let request = GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens,
            ignore_eos: true,
            response_format: format.clone(),
            ..GenerateRequest::new(Prompt::Tokens(prompts[i % prompts.len()].clone()))
        };
        let outcome = stream_request(engine, request, |n| bar.inc(n as u64))?;
        outcomes.lock().expect("not poisoned").push(outcome);
        Ok(())
    })?;
    let wall = started.elapsed().as_secs_f64();
    wait_until_idle(engine);
    let after = PrefillCounters::read(engine.stats());
    let outcomes: Vec<Outcome> = outcomes.into_inner().expect("not poisoned");
    let tokens: usize = outcomes.iter().map(|o| o.tokens).sum();
    let (ttft_p50_ms, ttft_p95_ms) = ttft_p50_p95(&outcomes);
    let mut gaps: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.gaps.iter().map(|&g| ms(g)))
        .collect();
    let prefill_secs = (after.nanos - before.nanos) as f64 / 1e9;
    Ok(LevelReport {
        concurrency,
        requests,
        decode_tok_s: tokens as f64 / wall,
        prefill_tok_s: (after.tokens - before.tokens) as f64 / prefill_secs.max(1e-9),
        ttft_p50_ms,
        ttft_p95_ms,
        itl_p50_ms: percentile(&mut gaps, 50.0),
        wall_s: wall,
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

//! Several models on one engine (`--extra-model`): each model's decode throughput served alone
//! (at the level and at half of it) and with every model loaded at once, and where the KV pool
//! went meanwhile.
//!
//! Phases, each a closed loop of `--requests` requests (default: twice the streams) per model,
//! every request decoding exactly `--max-tokens` tokens (EOS ignored):
//! - alone: one model at a time, at half the level, then at the level;
//! - together: every model at the level at once. Its rates count the tokens each model decoded
//!   while all of them were running (up to the moment the first model's loop ended), so no
//!   model's tail alone inflates them.
//!
//! While a phase runs, a sampler reads how many device blocks each model's sequences hold: the
//! models draw from one pool, so a model alone can take most of it, and the split follows the
//! load when it moves from one model to the other.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use engine::{ChatMessage, EngineHandle, GenerateRequest, Prompt, SamplingParams};
use indicatif::ProgressBar;
use serde::Serialize;

use super::{closed_loop, stream_request, wait_until_idle, BenchArgs};
use crate::commands::{progress_bar, CHAT_QUESTIONS};

const DEFAULT_STREAMS: usize = 16;
const DEFAULT_MAX_TOKENS: usize = 64;
/// How often the sampler reads the models' block counts.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// One model in one phase; the JSON keys are part of the tool's interface.
#[derive(Debug, Serialize)]
struct Report {
    phase: &'static str,
    model: String,
    streams: usize,
    decode_tok_s: f64,
    /// The most device blocks the model's sequences held at once during the phase.
    peak_kv_blocks: usize,
    /// The pool all models draw from.
    pool_blocks: usize,
}

pub(super) fn run(args: &BenchArgs) -> Result<()> {
    let engine = EngineHandle::start(&args.engine)?;
    let models = engine.models();
    if models.len() < 2 {
        bail!("the models scenario needs two models or more: add --extra-model");
    }
    let streams = match args.concurrency[..] {
        [] => DEFAULT_STREAMS,
        [c] if c >= 2 => c,
        _ => bail!("the models scenario takes one concurrency level, at least 2"),
    };
    let max_tokens = args.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let requests = |c: usize| args.requests.unwrap_or(2 * c);
    let prompts = models
        .iter()
        .map(|m| {
            CHAT_QUESTIONS
                .iter()
                .map(|q| Ok(m.encode_chat(&[ChatMessage::new("user", *q)], true)?.tokens))
                .collect::<engine::Result<Vec<_>>>()
        })
        .collect::<engine::Result<Vec<_>>>()?;
    let n = models.len();
    let total = n * (requests(streams / 2) + 2 * requests(streams)) * max_tokens;
    let bar = progress_bar(total, "tokens")?;
    let bench = Bench {
        engine: &engine,
        prompts: &prompts,
        max_tokens,
        bar: &bar,
    };
    let mut reports = Vec::new();
    for m in 0..n {
        for c in [streams / 2, streams] {
            bar.set_message(format!("{} alone, {c:>2} streams", models[m].id));
            let (rates, peaks) = bench.phase(&[(m, c, requests(c))])?;
            reports.push(bench.report("alone", m, c, rates[0], peaks[m]));
        }
    }
    bar.set_message("together");
    let load: Vec<_> = (0..n).map(|m| (m, streams, requests(streams))).collect();
    let (rates, peaks) = bench.phase(&load)?;
    for m in 0..n {
        reports.push(bench.report("together", m, streams, rates[m], peaks[m]));
    }
    bar.finish_and_clear();
    let rate = |phase: &str, c: usize, m: usize| {
        reports
            .iter()
            .find(|r| r.phase == phase && r.streams == c && r.model == models[m].id)
            .map_or(0.0, |r| r.decode_tok_s)
    };
    let together: f64 = (0..n).map(|m| rate("together", streams, m)).sum();
    let half_alone: f64 = (0..n).map(|m| rate("alone", streams / 2, m)).sum();
    // Each model alone at the level for 1/n of the time: the machine shared by turns.
    let shared_alone: f64 = (0..n).map(|m| rate("alone", streams, m)).sum::<f64>() / n as f64;
    if args.json {
        for r in &reports {
            println!("{}", serde_json::to_string(r)?);
        }
        let ratios = serde_json::json!({
            "together_over_half_load_alone": together / half_alone,
            "together_over_shared_alone": together / shared_alone,
        });
        println!("{ratios}");
        return Ok(());
    }
    println!(
        "{:<9} {:<28} {:>7} {:>12} {:>16}",
        "phase", "model", "streams", "decode tok/s", "peak KV blocks"
    );
    for r in &reports {
        println!(
            "{:<9} {:<28} {:>7} {:>12.1} {:>9} of {:>4}",
            r.phase, r.model, r.streams, r.decode_tok_s, r.peak_kv_blocks, r.pool_blocks
        );
    }
    println!(
        "every model together: {together:.1} tok/s, {:.2}x the sum of each alone at {} streams \
         ({half_alone:.1} tok/s), {:.2}x each alone at {streams} for 1/{n} of the time \
         ({shared_alone:.1} tok/s)",
        together / half_alone,
        streams / 2,
        together / shared_alone,
    );
    Ok(())
}

struct Bench<'a> {
    engine: &'a EngineHandle,
    /// Per model, the chat turns its requests cycle through.
    prompts: &'a [Vec<Vec<u32>>],
    max_tokens: usize,
    bar: &'a ProgressBar,
}

impl Bench<'_> {
    /// Runs `load`, (model, streams, requests) each, all at once. Returns each entry's decode
    /// rate over the time every loop was running, and every model's peak block count.
    fn phase(&self, load: &[(usize, usize, usize)]) -> Result<(Vec<f64>, Vec<usize>)> {
        let stats = self.engine.stats();
        let decoded = || -> Vec<u64> {
            (stats.models.iter())
                .map(|m| m.decode_tokens.load(Ordering::Relaxed))
                .collect()
        };
        let peaks = Mutex::new(vec![0; stats.models.len()]);
        // The decode counters and the time when the first loop ended.
        let first_done = Mutex::new(None);
        let running = AtomicBool::new(true);
        let before = decoded();
        let started = Instant::now();
        std::thread::scope(|scope| -> Result<()> {
            scope.spawn(|| {
                while running.load(Ordering::Relaxed) {
                    let mut peaks = peaks.lock().expect("not poisoned");
                    for (peak, m) in peaks.iter_mut().zip(&stats.models) {
                        *peak = (*peak).max(m.kv_blocks.load(Ordering::Relaxed));
                    }
                    drop(peaks);
                    std::thread::sleep(SAMPLE_EVERY);
                }
            });
            let loops: Vec<_> = load
                .iter()
                .map(|&(model, streams, requests)| {
                    let (first_done, decoded) = (&first_done, &decoded);
                    scope.spawn(move || {
                        let ran = closed_loop(requests, streams, |i| self.request(model, i));
                        let mut first = first_done.lock().expect("not poisoned");
                        first.get_or_insert_with(|| (Instant::now(), decoded()));
                        ran
                    })
                })
                .collect();
            let ran = loops
                .into_iter()
                .try_for_each(|l| l.join().expect("a client loop panicked"));
            running.store(false, Ordering::Relaxed);
            ran
        })?;
        wait_until_idle(self.engine);
        let (ended, after) = first_done
            .into_inner()
            .expect("not poisoned")
            .expect("every loop ended");
        let secs = (ended - started).as_secs_f64();
        let rates = load
            .iter()
            .map(|&(m, _, _)| (after[m] - before[m]) as f64 / secs)
            .collect();
        Ok((rates, peaks.into_inner().expect("not poisoned")))
    }

    /// Request `i` of `model`'s loop.
    fn request(&self, model: usize, i: usize) -> Result<()> {
        let prompts = &self.prompts[model];
        let request = GenerateRequest {
            model: Some(self.engine.models()[model].id.clone()),
            sampling: SamplingParams::greedy(),
            max_tokens: self.max_tokens,
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Tokens(prompts[i % prompts.len()].clone()))
        };
        stream_request(self.engine, request, |n| self.bar.inc(n as u64))?;
        Ok(())
    }

    fn report(
        &self,
        phase: &'static str,
        m: usize,
        streams: usize,
        rate: f64,
        peak: usize,
    ) -> Report {
        Report {
            phase,
            model: self.engine.models()[m].id.clone(),
            streams,
            decode_tok_s: rate,
            peak_kv_blocks: peak,
            pool_blocks: self.engine.stats().kv().gauges.device_total,
        }
    }
}

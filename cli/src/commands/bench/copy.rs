//! The copy scenario: what speculative decoding saves where agents copy.
//!
//! The workload is the output agents produce from their context: a text edited and given back
//! whole, a record filled into JSON (in JSON mode, as a tool's arguments would be), code fixed
//! and printed again, a summary quoting its source. Each task runs greedy, closed loop at each
//! concurrency level, on an engine with `--speculative off`, then on a fresh one with `ngram`.
//! Both runs give the same answers (a difference is reported: it would mean drafting changes
//! what the model says).
//!
//! Reported per level and run: output tokens per second, milliseconds per output token after
//! the first (p50 over requests), engine steps, and the draft tokens accepted of those run.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{ensure, Result};
use engine::{
    ChatMessage, EngineConfig, EngineHandle, GenerateRequest, Prompt, ResponseFormat,
    SamplingParams, Speculative,
};
use serde::Serialize;

use super::{closed_loop, stream_request, wait_until_idle, BenchArgs};
use crate::commands::stats::percentile;

const SCENARIO: &str = "copy";
const DEFAULT_CONCURRENCY: [usize; 2] = [1, 4];
const DEFAULT_MAX_TOKENS: usize = 160;

/// The tasks: a user message, and whether its answer is a JSON object.
const TASKS: [(&str, bool); 8] = [
    (
        "Correct the spelling mistakes in this paragraph and write the corrected paragraph in \
         full: Our team will meet on Tuesday at ten in the morning to reveiw the quarterly \
         report. Please bring your notes, the updated budjet, and any questions about the new \
         hiring plan. The meeting will take place in the large conference room on the third \
         floor.",
        false,
    ),
    (
        "Fill a JSON object with the keys name, email, city, plan and seats from this record: \
         Customer: Maria Gonzalez. Contact: maria.gonzalez@example.com. Based in Valencia, \
         Spain. Subscribed to the Enterprise plan with 25 seats since March 2024.",
        true,
    ),
    (
        "Rename the variable `tmp` to `total` in this function and print the whole function:\n\
         def sum_prices(items):\n    tmp = 0\n    for item in items:\n        tmp += \
         item.price * item.quantity\n    return tmp\n",
        false,
    ),
    (
        "Summarise this text in two sentences, quoting its most important sentence exactly: \
         The city council approved the new cycling plan on Monday. \"Every school will have a \
         protected bike lane within three years,\" the mayor said. The plan costs twelve \
         million euros and will be paid for by the regional transport fund.",
        false,
    ),
    (
        "Fill a JSON object with the keys title, author, year and pages from this record: The \
         Left Hand of Darkness, a novel by Ursula K. Le Guin, first published in 1969, 304 \
         pages.",
        true,
    ),
    (
        "Change the date in this email from Friday to Monday and give back the whole email:\n\
         Hello Sam,\nThe delivery of the new office chairs is planned for Friday. The driver \
         will call you one hour before arriving. Please make sure someone is at the front \
         desk to sign for the delivery.\nBest regards,\nAlex",
        false,
    ),
    (
        "Add the item 'olive oil' to the end of this shopping list and write out the whole \
         list: 1. bread 2. milk 3. eggs 4. tomatoes 5. rice 6. coffee",
        false,
    ),
    (
        "Fill a JSON object with the keys order_id, product, quantity and status from this \
         message: Order 48213 for three boxes of printer paper has been shipped and should \
         arrive tomorrow.",
        true,
    ),
];

pub(super) fn run(args: &BenchArgs) -> Result<()> {
    let levels = match &args.concurrency[..] {
        [] => DEFAULT_CONCURRENCY.to_vec(),
        levels => levels.to_vec(),
    };
    let max_tokens = args.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let requests = args.requests.unwrap_or(TASKS.len());
    let mut reports = Vec::new();
    let mut answers = Vec::new();
    for speculative in [Speculative::Off, Speculative::Ngram] {
        let config = EngineConfig {
            speculative,
            ..args.engine.clone()
        };
        // Dropped at the end of the iteration, before the next engine allocates its KV cache.
        let engine = EngineHandle::start(&config)?;
        for &concurrency in &levels {
            let (report, texts) =
                run_level(&engine, speculative, concurrency, requests, max_tokens)?;
            reports.push(report);
            answers.push(texts);
        }
    }
    let (off, on) = answers.split_at(levels.len());
    let differing: usize = (off.iter().zip(on))
        .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
        .sum();
    if differing > 0 {
        eprintln!(
            "note: {differing} answers differ between the runs; drafting should not change them"
        );
    }
    if args.json {
        for report in &reports {
            println!("{}", serde_json::to_string(report)?);
        }
        return Ok(());
    }
    println!(
        "{SCENARIO}: {requests} requests per level ({} tasks that copy from their prompt, \
         greedy, at most {max_tokens} tokens each)",
        TASKS.len()
    );
    println!(
        "{:>6} {:>8} {:>10} {:>10} {:>10} {:>8} {:>10}",
        "conc", "drafts", "tok/s", "ms/token", "steps", "speedup", "accepted"
    );
    let (off, on) = reports.split_at(levels.len());
    for (a, b) in off.iter().zip(on) {
        for r in [a, b] {
            let speedup = match r.speculative {
                "off" => String::new(),
                _ => format!("{:.2}x", r.tokens_per_sec / a.tokens_per_sec),
            };
            println!(
                "{:>6} {:>8} {:>10.1} {:>10.2} {:>10} {:>8} {:>9.0}%",
                r.concurrency,
                r.speculative,
                r.tokens_per_sec,
                r.ms_per_token_p50,
                r.steps,
                speedup,
                100.0 * r.accepted_draft_tokens as f64 / r.draft_tokens.max(1) as f64,
            );
        }
    }
    Ok(())
}

/// One level's figures.
#[derive(Debug, Serialize)]
struct LevelReport {
    scenario: &'static str,
    speculative: &'static str,
    concurrency: usize,
    requests: usize,
    output_tokens: usize,
    tokens_per_sec: f64,
    /// Per request, from its first token to its last, per token after the first.
    ms_per_token_p50: f64,
    steps: u64,
    draft_tokens: u64,
    accepted_draft_tokens: u64,
}

fn run_level(
    engine: &EngineHandle,
    speculative: Speculative,
    concurrency: usize,
    requests: usize,
    max_tokens: usize,
) -> Result<(LevelReport, Vec<String>)> {
    let prompts: Vec<(Vec<u32>, bool)> = (TASKS.iter())
        .map(|&(text, json)| {
            let chat = [ChatMessage::new("user", text)];
            Ok((engine.model().encode_chat(&chat, true)?.tokens, json))
        })
        .collect::<Result<_>>()?;
    let stats = engine.stats();
    let counters = || {
        (
            stats.steps.load(Relaxed),
            stats.draft_tokens.load(Relaxed),
            stats.accepted_draft_tokens.load(Relaxed),
        )
    };
    let before = counters();
    let outcomes = Mutex::new(vec![None; requests]);
    let started = Instant::now();
    closed_loop(requests, concurrency, |i| {
        let (prompt, json) = &prompts[i % prompts.len()];
        let request = GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens,
            response_format: match json {
                true => ResponseFormat::JsonObject,
                false => ResponseFormat::Text,
            },
            ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
        };
        let outcome = stream_request(engine, request, |_| {})?;
        let decode = outcome.gaps.iter().sum::<std::time::Duration>();
        let per_token =
            (outcome.tokens > 1).then(|| decode.as_secs_f64() * 1e3 / (outcome.tokens - 1) as f64);
        outcomes.lock().unwrap()[i] = Some((outcome.text, outcome.tokens, per_token));
        Ok(())
    })?;
    let elapsed = started.elapsed().as_secs_f64();
    wait_until_idle(engine);
    let after = counters();
    let outcomes: Vec<(String, usize, Option<f64>)> = outcomes
        .into_inner()
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    ensure!(outcomes.len() == requests, "a request did not finish");
    let output_tokens = outcomes.iter().map(|o| o.1).sum();
    let mut per_token: Vec<f64> = outcomes.iter().filter_map(|o| o.2).collect();
    let report = LevelReport {
        scenario: SCENARIO,
        speculative: match speculative {
            Speculative::Off => "off",
            Speculative::Ngram => "ngram",
        },
        concurrency,
        requests,
        output_tokens,
        tokens_per_sec: output_tokens as f64 / elapsed,
        ms_per_token_p50: percentile(&mut per_token, 50.0),
        steps: after.0 - before.0,
        draft_tokens: after.1 - before.1,
        accepted_draft_tokens: after.2 - before.2,
    };
    Ok((report, outcomes.into_iter().map(|o| o.0).collect()))
}

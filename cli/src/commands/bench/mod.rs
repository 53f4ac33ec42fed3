//! `swarmgate bench`: drives the engine in process, closed loop, and reports what it measured.
//!
//! Two scenarios share the machinery here (the arguments, the closed loop of clients, timing one
//! request's stream, percentiles):
//! - [`sweep`] (the default): a fixed set of chat turns at several concurrency levels, for
//!   throughput and latency.
//! - [`shared_prefix`]: an agent workload, many requests behind a few long system prompts plus
//!   multi-turn conversations, run with prefix caching on and then off, for what the cache saves.
//! - [`overhead`]: a one-token chat through the engine's API and through HTTP, for what the
//!   gateway adds.
//! - [`grammar`]: cold compiles of structured requests' grammars.
//! - [`models`]: several models on one engine, alone and together, and where the KV pool went.
//! - [`copy`]: tasks whose answers copy from their prompts, with speculative decoding off, then
//!   on, for what drafting saves.
//!
//! Everything runs on plain threads: the engine's event streams have a blocking reader, and a
//! benchmark gains nothing from an async runtime.

mod copy;
mod grammar;
mod models;
mod overhead;
mod shared_prefix;
mod sweep;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use engine::{EngineConfig, EngineHandle, Event, GenerateRequest, Usage};

use crate::commands::stats::{ms, percentile};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// What to run: `sweep` measures throughput and latency at each concurrency level;
    /// `shared-prefix` runs an agent workload with prefix caching on, then off (whatever
    /// --prefix-cache says), and compares; `gateway-overhead` times a one-token chat through the
    /// engine's API and through HTTP (--requests pairs, default 100); `grammar-compile` times
    /// cold compiles of the test suites' schemas and a tool envelope (--requests each,
    /// default 20); `models` runs each model of a several-model engine (--extra-model) alone
    /// and all together (--concurrency streams per model, default 16; --max-tokens default 64)
    /// and reports decode rates and each model's share of the KV pool; `copy` runs tasks whose
    /// answers copy from their prompts (--concurrency default 1,4; --requests per level, default
    /// 8; --max-tokens default 160) with --speculative off, then ngram, and compares.
    #[arg(long, value_enum, default_value_t = Scenario::Sweep)]
    scenario: Scenario,
    /// Concurrency levels, comma-separated (sweep default: 1,4,16,32; shared-prefix: one
    /// level, default 4).
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Tokens each request generates (sweep default: 128, EOS ignored); shared-prefix: at most
    /// this many, stopping at EOS (default 32, which keeps both runs to a few minutes on a CPU).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Sweep: requests per level (default: twice the concurrency, at least 8). Shared-prefix:
    /// single-turn requests (default 48), besides the conversations.
    #[arg(long)]
    requests: Option<usize>,
    /// Shared-prefix: agents, each with its own system prompt (1 to 6).
    #[arg(long, default_value_t = 4)]
    agents: usize,
    /// Shared-prefix: multi-turn conversations, at most one per agent (default: one per agent).
    #[arg(long)]
    conversations: Option<usize>,
    /// Print one JSON object per level (sweep) or per run (shared-prefix) instead of a table.
    #[arg(long)]
    json: bool,
    /// Sweep: every request's answer is constrained by a JSON schema (a long array of short
    /// strings, which no answer completes within --max-tokens), and the prompts ask for one;
    /// compare with a run without it for the grammar's cost.
    #[arg(long)]
    constrained: bool,
    #[command(flatten)]
    engine: EngineConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Sweep,
    SharedPrefix,
    GatewayOverhead,
    GrammarCompile,
    Models,
    Copy,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.concurrency.contains(&0) {
        bail!("--concurrency needs positive levels");
    }
    match args.scenario {
        Scenario::Sweep => sweep::run(&args),
        Scenario::SharedPrefix => shared_prefix::run(&args),
        Scenario::GatewayOverhead => overhead::run(&args),
        Scenario::GrammarCompile => grammar::run(&args),
        Scenario::Models => models::run(&args),
        Scenario::Copy => copy::run(&args),
    }
}

/// What one request's stream showed.
struct Outcome {
    /// Submit to first token.
    ttft: Duration,
    /// Between consecutive token deltas.
    gaps: Vec<Duration>,
    tokens: usize,
    text: String,
    usage: Usage,
}

/// Submits `request` and reads its stream to the end, calling `on_tokens` with each delta's
/// token count (for progress bars).
fn stream_request(
    engine: &EngineHandle,
    request: GenerateRequest,
    on_tokens: impl Fn(usize),
) -> Result<Outcome> {
    let submitted = Instant::now();
    let mut stream = engine.submit(request)?;
    let mut ttft = None;
    let mut last = submitted;
    let mut gaps = Vec::new();
    let mut tokens = 0;
    let mut text = String::new();
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Delta {
                tokens: ids,
                text: delta,
                ..
            } => {
                text.push_str(&delta);
                // Text held back earlier (a possible stop string) comes with no tokens.
                if ids.is_empty() {
                    continue;
                }
                let now = Instant::now();
                match ttft {
                    None => ttft = Some(now - submitted),
                    Some(_) => gaps.push(now - last),
                }
                last = now;
                tokens += ids.len();
                on_tokens(ids.len());
            }
            Event::PromptLogprobs(_) => {}
            Event::Finished { error: Some(e), .. } => bail!("request failed: {e}"),
            Event::Finished { usage, .. } => {
                return Ok(Outcome {
                    ttft: ttft.unwrap_or_default(),
                    gaps,
                    tokens,
                    text,
                    usage,
                })
            }
        }
    }
    bail!("the engine stopped before the request finished")
}

/// Runs jobs `0..jobs` on `clients` threads, closed loop: a client takes the next job as soon
/// as its last one is done, so at most `clients` are in flight and the engine never idles
/// between them.
fn closed_loop(
    jobs: usize,
    clients: usize,
    job: impl Fn(usize) -> Result<()> + Sync,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= jobs {
                        return Ok(());
                    }
                    job(i)?;
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("client thread panicked"))
    })
}

/// Waits until the engine has published the step that finished the last request. It sends a
/// request's final event before publishing that step's figures, so a client that reads the
/// counters as soon as its stream ends can miss the last step.
fn wait_until_idle(engine: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let stats = engine.stats();
    while Instant::now() < deadline {
        let idle = stats.running.load(Ordering::Relaxed) == 0
            && stats.waiting.load(Ordering::Relaxed) == 0
            && stats.kv().gauges.device_used == 0;
        if idle {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// p50 and p95 of the times to first token, in ms.
fn ttft_p50_p95(outcomes: &[Outcome]) -> (f64, f64) {
    let mut ttft: Vec<f64> = outcomes.iter().map(|o| ms(o.ttft)).collect();
    (percentile(&mut ttft, 50.0), percentile(&mut ttft, 95.0))
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::closed_loop;

    #[test]
    fn closed_loop_runs_every_job_once() {
        let seen = Mutex::new(Vec::new());
        closed_loop(10, 3, |i| {
            seen.lock().unwrap().push(i);
            Ok(())
        })
        .unwrap();
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn closed_loop_reports_a_failed_job() {
        let result = closed_loop(4, 2, |i| {
            anyhow::ensure!(i != 2, "job {i} failed");
            Ok(())
        });
        assert!(result.is_err());
    }
}

//! `swarmgate loadgen --scenario tool-agents`: a load that behaves like agents. `--runs` agent
//! runs start together; each makes `--turns` chat calls, one after another: a call with tools
//! (strict schemas, `tool_choice: auto`, as agent frameworks send them; a turn answered in text
//! is followed up as if it had called) → the tool runs for a pause drawn from a log-normal distribution
//! (`--pause-median-secs`, `--pause-sigma`) → the next call with everything so far plus the
//! tool's result; the last call answers in text (`tool_choice: none`). Calls stream, so that each turn's time to first
//! token is seen.
//!
//! It reports, over the runs: job completion time (a run's start to its last answer) p50/p95,
//! time to first token of the follow-up turns (2nd and later) p50/p95, the prefix-cache hit
//! ratio (cached prompt tokens over prompt tokens, from each answer's usage: OpenAI's
//! `prompt_tokens_details.cached_tokens`, or llama.cpp's `timings.cache_n`) and the recomputed
//! tokens (per follow-up turn, the tokens of the previous turn's prompt and answer that did not
//! come from the cache). `--png` draws them beside the reports given with `--baseline`, so that
//! a server with retention and run scheduling on, the same with them off, and another server
//! can be seen side by side.
//!
//! Runs name themselves with the `x-swarmgate-run-id` header (other servers ignore it). Every
//! tool result is made from `--seed`, so every server gets the same conversations as far as the
//! models' answers allow.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use futures::StreamExt;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::header::CONTENT_TYPE;
use reqwest::Url;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::client::Chunk;
use super::sse::SseParser;
use crate::commands::stats::{ms, Summary};

/// What the scenario's runs are asked to do, one per run in turn.
const TASKS: [&str; 8] = [
    "Find why the nightly build of the billing service fails and propose a fix.",
    "Check which customers were charged twice in March and draft a refund plan.",
    "Locate the slow query behind the dashboard timeouts and suggest an index.",
    "Review the retry logic in the upload client and list what could lose data.",
    "Work out why the search results page shows stale prices after an update.",
    "Audit the password reset flow for ways an attacker could take over an account.",
    "Find which deployment raised the p99 latency of the orders API last week.",
    "Summarise what the failing integration tests in the payments repo have in common.",
];

const SYSTEM: &str = "You are a software agent. Work step by step: call one tool at a time, read \
    its result, then decide the next step. When you have enough, answer briefly.";

/// Words tool results are made of.
const WORDS: [&str; 24] = [
    "service", "request", "latency", "error", "deploy", "commit", "query", "index", "cache",
    "timeout", "retry", "customer", "invoice", "refund", "build", "test", "log", "trace", "node",
    "queue", "worker", "config", "schema", "release",
];

/// The scenario's settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub url: String,
    pub model: String,
    /// What this run measured (a server and its configuration).
    pub label: String,
    pub runs: usize,
    pub turns: usize,
    pub pause_median_secs: f64,
    pub pause_sigma: f64,
    pub max_tokens: usize,
    pub tool_result_words: usize,
    pub seed: u64,
    /// Send the `speculative_prefill` hint with every turn but the last.
    #[serde(default)]
    pub speculative_prefill: bool,
}

/// One turn as the client saw it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Turn {
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Whether it answered with a tool call.
    pub tool_call: bool,
}

/// One run: its turns, and how long the whole job took.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub jct_ms: f64,
    pub turns: Vec<Turn>,
    /// Set when a turn failed; the run stops there.
    pub error: Option<String>,
}

/// The figures over every run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Figures {
    pub completed_runs: usize,
    pub failed_runs: usize,
    pub jct_ms: Option<Summary>,
    /// Turns after the first.
    pub followup_ttft_ms: Option<Summary>,
    pub first_turn_ttft_ms: Option<Summary>,
    /// Cached prompt tokens over prompt tokens, every turn.
    pub prefix_hit_ratio: f64,
    /// Tokens the follow-ups computed again of what their previous turn had computed.
    pub recomputed_tokens: usize,
    pub prompt_tokens: usize,
    /// Follow-up turns of the model's own choosing that did not call a tool.
    pub turns_without_tool_call: usize,
    pub wall_s: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub settings: Settings,
    pub figures: Figures,
    pub runs: Vec<RunResult>,
}

/// Runs the scenario and reports it; see the module's documentation.
pub async fn run(client: reqwest::Client, url: Url, key: Option<String>, s: Settings) -> Report {
    let started = Instant::now();
    let mut runs = JoinSet::new();
    for i in 0..s.runs {
        let (client, url, key, s) = (client.clone(), url.clone(), key.clone(), s.clone());
        runs.spawn(async move { (i, agent_run(&client, &url, key.as_deref(), &s, i).await) });
    }
    let mut results: Vec<(usize, RunResult)> = Vec::with_capacity(s.runs);
    while let Some(done) = runs.join_next().await {
        results.push(done.expect("a run's task panicked"));
    }
    results.sort_by_key(|(i, _)| *i);
    let runs: Vec<RunResult> = results.into_iter().map(|(_, r)| r).collect();
    let figures = figures(&runs, started.elapsed());
    Report {
        settings: s,
        figures,
        runs,
    }
}

/// The tools every call offers.
fn tools() -> Value {
    let tool = |name: &str, description: &str, param: &str| {
        json!({"type": "function", "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {param: {"type": "string"}},
                "required": [param], "additionalProperties": false}}})
    };
    json!([
        tool("search_code", "Search the repository for a text.", "query"),
        tool("read_logs", "Read the service's recent logs.", "service"),
        tool("run_query", "Run a read-only SQL query.", "sql"),
    ])
}

/// A tool's result: `words` words drawn from `rng`.
fn tool_result(rng: &mut StdRng, words: usize) -> String {
    let mut out = String::with_capacity(words * 8);
    for i in 0..words {
        if i > 0 {
            out.push(if i % 12 == 0 { '\n' } else { ' ' });
        }
        out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        if rng.random_range(0..5) == 0 {
            out.push_str(&rng.random_range(0..10_000u32).to_string());
        }
    }
    out
}

/// A log-normal pause: the median times e to a normal draw of spread `sigma`.
fn pause(rng: &mut StdRng, median: f64, sigma: f64) -> Duration {
    // Box-Muller.
    let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    Duration::from_secs_f64((median * (sigma * z).exp()).min(600.0))
}

async fn agent_run(
    client: &reqwest::Client,
    url: &Url,
    key: Option<&str>,
    s: &Settings,
    i: usize,
) -> RunResult {
    let mut rng = StdRng::seed_from_u64(s.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let run_id = format!("tool-agents-{}-{i}", s.seed);
    let mut messages = vec![
        json!({"role": "system", "content": SYSTEM}),
        json!({"role": "user", "content": TASKS[i % TASKS.len()]}),
    ];
    let started = Instant::now();
    let mut turns = Vec::with_capacity(s.turns);
    for t in 0..s.turns {
        let last = t + 1 == s.turns;
        let mut body = json!({
            "model": s.model,
            "messages": messages,
            "tools": tools(),
            "tool_choice": if last { "none" } else { "auto" },
            "max_tokens": s.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if s.speculative_prefill && !last {
            body["swarmgate"] = json!({"speculative_prefill": true});
        }
        let answer = match call(client, url, key, &run_id, &body).await {
            Ok(answer) => answer,
            Err(e) => {
                return RunResult {
                    jct_ms: ms(started.elapsed()),
                    turns,
                    error: Some(format!("turn {}: {e:#}", t + 1)),
                }
            }
        };
        turns.push(answer.turn.clone());
        if last {
            break;
        }
        // The assistant's turn as the client sends it back, then each call's result.
        let calls: Vec<Value> = answer
            .calls
            .iter()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        if calls.is_empty() {
            messages.push(json!({"role": "assistant", "content": answer.content}));
            messages.push(
                json!({"role": "user", "content": tool_result(&mut rng, s.tool_result_words)}),
            );
        } else {
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
            for (id, _, _) in &answer.calls {
                let result = tool_result(&mut rng, s.tool_result_words);
                messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
        }
        tokio::time::sleep(pause(&mut rng, s.pause_median_secs, s.pause_sigma)).await;
    }
    RunResult {
        jct_ms: ms(started.elapsed()),
        turns,
        error: None,
    }
}

/// A streamed answer, read back.
struct Answer {
    turn: Turn,
    content: String,
    /// Each call's id, name and arguments.
    calls: Vec<(String, String, String)>,
}

async fn call(
    client: &reqwest::Client,
    url: &Url,
    key: Option<&str>,
    run_id: &str,
    body: &Value,
) -> Result<Answer> {
    let sent = Instant::now();
    let mut request = client
        .post(url.clone())
        .header(CONTENT_TYPE, "application/json")
        .header("x-swarmgate-run-id", run_id)
        .body(body.to_string());
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        anyhow::bail!("{status}: {}", text.chars().take(300).collect::<String>());
    }
    let mut parser = SseParser::default();
    let mut bytes = response.bytes_stream();
    let (mut ttft, mut done) = (None, false);
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut usage = None;
    let mut cache_n = None;
    while let Some(piece) = bytes.next().await {
        for data in parser.push(&piece?) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Chunk = serde_json::from_str(&data)
                .with_context(|| format!("a chunk that is not one: {data}"))?;
            usage = chunk.usage.or(usage);
            cache_n = chunk.timings.and_then(|t| t.cache_n).or(cache_n);
            for choice in chunk.choices {
                let delta = choice.delta;
                let text = delta.content.unwrap_or_default();
                if (!text.is_empty() || !delta.tool_calls.is_empty()) && ttft.is_none() {
                    ttft = Some(sent.elapsed());
                }
                content.push_str(&text);
                for call in delta.tool_calls {
                    if calls.len() <= call.index {
                        calls.resize(call.index + 1, Default::default());
                    }
                    let entry = &mut calls[call.index];
                    if let Some(id) = call.id {
                        entry.0 = id;
                    }
                    if let Some(f) = call.function {
                        entry.1.push_str(&f.name.unwrap_or_default());
                        entry.2.push_str(&f.arguments.unwrap_or_default());
                    }
                }
            }
        }
    }
    ensure!(done, "the stream ended without [DONE]");
    let usage = usage.context("the stream carried no usage")?;
    let cached = usage
        .prompt_tokens_details
        .map(|d| d.cached_tokens)
        .or(cache_n)
        .unwrap_or(0);
    let e2e = sent.elapsed();
    Ok(Answer {
        turn: Turn {
            ttft_ms: ms(ttft.unwrap_or(e2e)),
            e2e_ms: ms(e2e),
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cached_tokens: cached,
            tool_call: !calls.is_empty(),
        },
        content,
        calls,
    })
}

/// The figures over `runs`; see [`Figures`].
pub fn figures(runs: &[RunResult], wall: Duration) -> Figures {
    let done: Vec<&RunResult> = runs.iter().filter(|r| r.error.is_none()).collect();
    let mut jct: Vec<f64> = done.iter().map(|r| r.jct_ms).collect();
    let turns = || runs.iter().flat_map(|r| r.turns.iter().enumerate());
    let mut first: Vec<f64> = turns()
        .filter(|(t, _)| *t == 0)
        .map(|(_, x)| x.ttft_ms)
        .collect();
    let mut later: Vec<f64> = turns()
        .filter(|(t, _)| *t > 0)
        .map(|(_, x)| x.ttft_ms)
        .collect();
    let prompt: usize = turns().map(|(_, x)| x.prompt_tokens).sum();
    let cached: usize = turns().map(|(_, x)| x.cached_tokens).sum();
    let recomputed = runs
        .iter()
        .flat_map(|r| r.turns.windows(2))
        .map(|w| (w[0].prompt_tokens + w[0].completion_tokens).saturating_sub(w[1].cached_tokens))
        .sum();
    let without = runs
        .iter()
        .flat_map(|r| r.turns.iter().take(r.turns.len().saturating_sub(1)))
        .filter(|t| !t.tool_call)
        .count();
    Figures {
        completed_runs: done.len(),
        failed_runs: runs.len() - done.len(),
        jct_ms: Summary::of(&mut jct),
        followup_ttft_ms: Summary::of(&mut later),
        first_turn_ttft_ms: Summary::of(&mut first),
        prefix_hit_ratio: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        recomputed_tokens: recomputed,
        prompt_tokens: prompt,
        turns_without_tool_call: without,
        wall_s: wall.as_secs_f64(),
    }
}

/// The report as a table.
pub fn table(reports: &[Report]) -> String {
    let mut out = format!(
        "{:<28} {:>6} {:>10} {:>10} {:>11} {:>11} {:>6} {:>10}\n",
        "label", "runs", "JCT p50", "JCT p95", "TTFT2+ p50", "TTFT2+ p95", "hit%", "recomputed"
    );
    let sec = |s: &Option<Summary>, p95: bool| {
        s.as_ref().map_or("-".to_owned(), |s| {
            format!("{:.2}s", if p95 { s.p95 } else { s.p50 } / 1e3)
        })
    };
    for r in reports {
        let f = &r.figures;
        out += &format!(
            "{:<28} {:>6} {:>10} {:>10} {:>11} {:>11} {:>6.1} {:>10}\n",
            r.settings.label,
            format!("{}/{}", f.completed_runs, f.completed_runs + f.failed_runs),
            sec(&f.jct_ms, false),
            sec(&f.jct_ms, true),
            sec(&f.followup_ttft_ms, false),
            sec(&f.followup_ttft_ms, true),
            f.prefix_hit_ratio * 100.0,
            f.recomputed_tokens,
        );
    }
    out
}

/// Reads a report `--out` wrote.
pub fn read(path: &Path) -> Result<Report> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a tool-agents report", path.display()))
}

/// Draws `reports` side by side: JCT and follow-up TTFT (p50 and p95 bars) and the prefix-cache
/// hit ratio, one colour per report. Text only if `labels`.
pub fn draw(path: &PathBuf, reports: &[Report], labels: bool) -> Result<()> {
    let root = BitMapBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    let colour = |i: usize| Palette99::pick(i).to_rgba();
    type Pick = fn(&Figures) -> Option<(f64, f64)>;
    let jct: Pick = |f| f.jct_ms.as_ref().map(|s| (s.p50 / 1e3, s.p95 / 1e3));
    let ttft: Pick = |f| {
        f.followup_ttft_ms
            .as_ref()
            .map(|s| (s.p50 / 1e3, s.p95 / 1e3))
    };
    let hits: Pick = |f| Some((f.prefix_hit_ratio * 100.0, f.prefix_hit_ratio * 100.0));
    let specs: [(&str, &str, Pick, bool); 3] = [
        ("job completion time (s)", "p50 | p95", jct, true),
        ("follow-up TTFT (s)", "p50 | p95", ttft, true),
        ("prefix-cache hits (%)", "", hits, false),
    ];
    for (panel, (title, sub, pick, pair)) in panels.iter().zip(specs) {
        let values: Vec<(f64, f64)> = reports
            .iter()
            .map(|r| pick(&r.figures).unwrap_or_default())
            .collect();
        let top = values
            .iter()
            .map(|v| v.0.max(v.1))
            .fold(0.0, f64::max)
            .max(1e-3)
            * 1.15;
        let bars = if pair { 2 } else { 1 };
        let width = (reports.len() * bars) as f64;
        let mut chart = ChartBuilder::on(panel);
        chart
            .margin(12)
            .x_label_area_size(if labels { 24 } else { 4 });
        chart.y_label_area_size(if labels { 50 } else { 4 });
        if labels {
            chart.caption(format!("{title} {sub}"), ("sans-serif", 18));
        }
        let mut chart = chart.build_cartesian_2d(0.0..width + 0.5, 0.0..top)?;
        let mut mesh = chart.configure_mesh();
        mesh.disable_x_mesh().disable_x_axis();
        if !labels {
            mesh.disable_y_axis();
        }
        mesh.draw()?;
        for (i, v) in values.iter().enumerate() {
            let x0 = (i * bars) as f64 + 0.25;
            let style = colour(i).filled();
            chart.draw_series([Rectangle::new([(x0, 0.0), (x0 + 0.9, v.0)], style)])?;
            if pair {
                let faded = colour(i).mix(0.45).filled();
                chart.draw_series([Rectangle::new([(x0 + 1.0, 0.0), (x0 + 1.9, v.1)], faded)])?;
            }
        }
        if labels {
            for (i, r) in reports.iter().enumerate() {
                let x0 = (i * bars) as f64 + 0.25;
                chart
                    .draw_series([Rectangle::new(
                        [(x0, 0.0), (x0 + 0.9, 0.0)],
                        colour(i).filled(),
                    )])?
                    .label(r.settings.label.clone())
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour(i).filled())
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .draw()?;
        }
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(ttft_ms: f64, prompt: usize, completion: usize, cached: usize) -> Turn {
        Turn {
            ttft_ms,
            e2e_ms: ttft_ms + 100.0,
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: cached,
            tool_call: true,
        }
    }

    #[test]
    fn figures_count_what_follow_ups_recompute() {
        let runs = vec![
            RunResult {
                jct_ms: 3000.0,
                turns: vec![turn(100.0, 100, 20, 0), turn(40.0, 200, 20, 112)],
                error: None,
            },
            RunResult {
                jct_ms: 5000.0,
                turns: vec![turn(120.0, 100, 20, 0), turn(90.0, 200, 20, 0)],
                error: None,
            },
            RunResult {
                jct_ms: 1.0,
                turns: vec![turn(120.0, 100, 20, 0)],
                error: Some("turn 2: 503".into()),
            },
        ];
        let f = figures(&runs, Duration::from_secs(6));
        assert_eq!((f.completed_runs, f.failed_runs), (2, 1));
        // Each follow-up had 120 tokens computed before: 8 and 120 computed again.
        assert_eq!(f.recomputed_tokens, 128);
        assert_eq!(f.prompt_tokens, 700);
        assert!((f.prefix_hit_ratio - 112.0 / 700.0).abs() < 1e-9);
        assert_eq!(f.followup_ttft_ms.unwrap().p50, 40.0, "nearest rank");
        assert_eq!(f.jct_ms.unwrap().p50, 3000.0);
    }

    #[test]
    fn pauses_are_log_normal_around_their_median() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut draws: Vec<f64> = (0..4001)
            .map(|_| pause(&mut rng, 1.0, 0.5).as_secs_f64())
            .collect();
        draws.sort_by(f64::total_cmp);
        let median = draws[2000];
        assert!((0.9..1.1).contains(&median), "{median}");
        assert!(draws[0] > 0.0 && draws[4000] < 10.0);
    }
}

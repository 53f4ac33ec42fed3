//! `swarmgate loadgen`: a closed-loop load on any OpenAI-compatible server's
//! `POST /v1/chat/completions`, at several concurrency levels, measured at the client.
//!
//! At level `c`, `c` clients each send a request, read its answer to the end and send the next,
//! until the level's `--requests` are done; so at most `c` requests are in flight, and each is
//! bounded by `--timeout-secs`. Levels run one after another. Per level it reports time to first
//! token, inter-token latency, time per output token and end-to-end latency (mean, p50, p90,
//! p99), output tokens/s and requests/s, and failures by kind; then writes the report as JSON
//! (`--out`), draws the chart (`--png`) and prints a table. Progress goes to stderr.
//!
//! The pieces: [`workload`] is what is sent; [`client`] sends one request and times it, reading
//! streams with [`sse`]; [`report`] turns outcomes into figures, the JSON and the table;
//! [`chart`] draws the PNG.
//!
//! `--scenario tool-agents` is a different load: agent runs of several turns with tool pauses
//! between them, measured per run ([`tool_agents`]).
//!
//! Only a server on this machine is loaded: any other host is refused, as by the scripts in
//! `loadtests/`.

mod chart;
mod client;
mod report;
mod sse;
mod tool_agents;
mod workload;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use indicatif::ProgressBar;
use reqwest::Url;
use tokio::task::JoinSet;

use self::client::Target;
use self::report::{LevelReport, Report, Settings};
use self::workload::{Scenario, Workload};
use crate::commands::progress_bar;

const ENDPOINT: &str = "/v1/chat/completions";

#[derive(Args, Debug)]
pub struct LoadgenArgs {
    /// The server: its root (`/v1/chat/completions` is added) or the endpoint itself, of any
    /// OpenAI-compatible server. Only this machine's addresses are accepted.
    #[arg(long, alias = "base-url", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrency levels, comma-separated: requests in flight at once.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    concurrency: Vec<usize>,
    /// Requests sent at each level.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Stream the answers (server-sent events), for time to first token and inter-token
    /// latency.
    #[arg(long)]
    stream: bool,
    /// `chat`: short chat turns to `--model`; `agents`: questions for different specialists
    /// through `model: "swarm"`.
    #[arg(long, value_enum, default_value_t = Scenario::Chat)]
    scenario: Scenario,
    /// The model requests name (default: `default` for chat, `swarm` for agents).
    #[arg(long)]
    model: Option<String>,
    /// Most tokens each answer may have.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sent as a bearer token.
    #[arg(long, env = "SWARMGATE_LOADGEN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Time one request may take, answer read to the end, before it counts as timed out.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
    /// Write the report (settings and every level's figures) as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Draw throughput and latency against concurrency into this PNG.
    #[arg(long)]
    png: Option<PathBuf>,
    /// A TrueType or OpenType font for the chart's text (default: a common system font).
    #[arg(long)]
    font: Option<PathBuf>,
    #[command(flatten)]
    tool_agents: ToolAgentsArgs,
}

/// The `tool-agents` scenario's settings.
#[derive(Args, Debug)]
struct ToolAgentsArgs {
    /// tool-agents: agent runs at once.
    #[arg(long, default_value_t = 24)]
    runs: usize,
    /// tool-agents: calls per run (all but the last call a tool).
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// tool-agents: median tool pause, in seconds.
    #[arg(long, default_value_t = 1.0)]
    pause_median_secs: f64,
    /// tool-agents: spread of the pauses (sigma of their logarithm).
    #[arg(long, default_value_t = 0.5)]
    pause_sigma: f64,
    /// tool-agents: words in each tool result.
    #[arg(long, default_value_t = 120)]
    tool_result_words: usize,
    /// tool-agents: seeds the tool results and pauses.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// tool-agents: ask swarmgate to prefill each turn's likely follow-up while its tools run
    /// (the `swarmgate.speculative_prefill` hint; other servers ignore it).
    #[arg(long)]
    speculative_prefill: bool,
    /// tool-agents: what this run measures, in the table and the chart (default: the URL).
    #[arg(long)]
    label: Option<String>,
    /// tool-agents: earlier reports (`--out`) drawn and tabled beside this one.
    #[arg(long)]
    baseline: Vec<PathBuf>,
}

pub fn run(args: LoadgenArgs) -> Result<()> {
    let url = endpoint(&args.url)?;
    ensure!(
        !args.concurrency.is_empty() && !args.concurrency.contains(&0),
        "--concurrency needs positive levels"
    );
    ensure!(args.requests > 0, "--requests must be positive");
    ensure!(args.max_tokens > 0, "--max-tokens must be positive");
    ensure!(args.timeout_secs > 0, "--timeout-secs must be positive");
    // Before the run, so that an unusable --font fails fast.
    let labels = match &args.png {
        Some(_) => chart::load_font(args.font.as_deref())?,
        None => false,
    };
    let model = args
        .model
        .clone()
        .unwrap_or_else(|| args.scenario.default_model().to_owned());
    if args.scenario == Scenario::ToolAgents {
        return run_tool_agents(&args, url, model, labels);
    }
    let workload = Arc::new(Workload::new(
        args.scenario,
        &model,
        args.max_tokens,
        args.stream,
    ));
    let target = Arc::new(Target::new(
        url.clone(),
        args.api_key.clone(),
        Duration::from_secs(args.timeout_secs),
        args.stream,
    ));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let bar = progress_bar(args.concurrency.len() * args.requests, "requests")?;
    let mut levels = Vec::with_capacity(args.concurrency.len());
    for &concurrency in &args.concurrency {
        bar.set_message(format!("concurrency {concurrency:>3}"));
        let level = runtime.block_on(run_level(
            &target,
            &workload,
            concurrency,
            args.requests,
            &bar,
        ));
        // Printed even when stderr is no terminal and the bar is hidden: the errors matter.
        bar.suspend(|| eprintln!("{}", level.headline()));
        levels.push(level);
    }
    bar.finish_and_clear();
    let report = Report {
        settings: Settings {
            url: url.to_string(),
            scenario: args.scenario.name(),
            model,
            stream: args.stream,
            concurrency: args.concurrency,
            requests: args.requests,
            max_tokens: args.max_tokens,
            timeout_secs: args.timeout_secs,
        },
        levels,
    };
    if let Some(path) = &args.out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("report: {}", path.display());
    }
    if let Some(path) = &args.png {
        chart::draw(path, &report, labels)?;
        eprintln!("chart: {}", path.display());
    }
    print!("{}", report::table(&report.levels));
    Ok(())
}

/// The `tool-agents` scenario: runs it, writes and draws its report beside the baselines.
fn run_tool_agents(args: &LoadgenArgs, url: Url, model: String, labels: bool) -> Result<()> {
    let a = &args.tool_agents;
    ensure!(
        a.runs > 0 && a.turns > 0,
        "--runs and --turns must be positive"
    );
    ensure!(
        a.pause_median_secs >= 0.0 && a.pause_sigma >= 0.0,
        "pauses need a median and a spread of at least 0"
    );
    let baselines = a
        .baseline
        .iter()
        .map(|path| tool_agents::read(path))
        .collect::<Result<Vec<_>>>()?;
    let settings = tool_agents::Settings {
        url: url.to_string(),
        model,
        label: a.label.clone().unwrap_or_else(|| args.url.clone()),
        runs: a.runs,
        turns: a.turns,
        pause_median_secs: a.pause_median_secs,
        pause_sigma: a.pause_sigma,
        max_tokens: args.max_tokens,
        tool_result_words: a.tool_result_words,
        seed: a.seed,
        speculative_prefill: a.speculative_prefill,
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.timeout_secs))
        .build()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    eprintln!("{} runs of {} turns against {url}", a.runs, a.turns);
    let report = runtime.block_on(tool_agents::run(
        client,
        url,
        args.api_key.clone(),
        settings,
    ));
    if let Some(path) = &args.out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("report: {}", path.display());
    }
    if let Some(error) = report.runs.iter().find_map(|r| r.error.as_ref()) {
        eprintln!("a run failed: {error}");
    }
    let mut all = baselines;
    all.push(report);
    if let Some(path) = &args.png {
        tool_agents::draw(path, &all, labels)?;
        eprintln!("chart: {}", path.display());
    }
    print!("{}", tool_agents::table(&all));
    Ok(())
}

/// Sends `requests` requests from `concurrency` clients, closed loop, and measures them.
async fn run_level(
    target: &Arc<Target>,
    workload: &Arc<Workload>,
    concurrency: usize,
    requests: usize,
    bar: &ProgressBar,
) -> LevelReport {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut clients = JoinSet::new();
    for _ in 0..concurrency.min(requests) {
        let (target, workload) = (Arc::clone(target), Arc::clone(workload));
        let (next, bar) = (Arc::clone(&next), bar.clone());
        clients.spawn(async move {
            let mut outcomes = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    return outcomes;
                }
                outcomes.push(target.send(workload.body(i).to_owned()).await);
                bar.inc(1);
            }
        });
    }
    let mut outcomes = Vec::with_capacity(requests);
    while let Some(done) = clients.join_next().await {
        outcomes.extend(done.expect("a client task panicked"));
    }
    LevelReport::new(concurrency, outcomes, started.elapsed())
}

/// The chat completions endpoint of `url` (a server's root, or the endpoint itself); an error
/// for anything but plain HTTP to this machine.
fn endpoint(url: &str) -> Result<Url> {
    let mut url = Url::parse(url).with_context(|| format!("--url {url} is not a URL"))?;
    if url.scheme() != "http" {
        bail!("--url must start with http:// (the load goes to a server on this machine)");
    }
    let host = url.host_str().unwrap_or_default();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let local = bare == "localhost" || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !local {
        bail!("refusing to load {host}: only a server on this machine (127.0.0.1, ::1, localhost)");
    }
    let path = url.path().trim_end_matches('/');
    if !path.ends_with(ENDPOINT) {
        let path = format!("{path}{ENDPOINT}");
        url.set_path(&path);
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::endpoint;

    #[test]
    fn the_endpoint_is_added_to_a_local_root() {
        let cases = [
            (
                "http://127.0.0.1:8080",
                "http://127.0.0.1:8080/v1/chat/completions",
            ),
            (
                "http://localhost:9000/",
                "http://localhost:9000/v1/chat/completions",
            ),
            (
                "http://[::1]:8000/api",
                "http://[::1]:8000/api/v1/chat/completions",
            ),
            (
                "http://127.0.0.2/v1/chat/completions",
                "http://127.0.0.2/v1/chat/completions",
            ),
        ];
        for (given, expected) in cases {
            assert_eq!(endpoint(given).unwrap().as_str(), expected);
        }
    }

    #[test]
    fn other_hosts_and_schemes_are_refused() {
        for url in [
            "http://10.0.0.5:8080",
            "http://example.com",
            "https://127.0.0.1:8443",
            "127.0.0.1:8080",
        ] {
            assert!(endpoint(url).is_err(), "{url}");
        }
    }
}

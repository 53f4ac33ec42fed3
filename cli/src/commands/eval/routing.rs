//! `swarmgate eval routing FILE`: the routing agent against labelled queries.
//!
//! FILE is JSON lines, `{"query": "...", "agent": "coder"}` each. Every query is sent, one at a
//! time, as a one-message conversation to `POST /v1/swarm/route`: of the server at `--url`, or
//! of one this command starts in process on 127.0.0.1 with the swarm file and models given
//! (the same code path as `swarmgate serve`). The report: accuracy; per expected agent its
//! precision, recall and count; the confusion matrix (rows: expected, columns: chosen); and
//! the route latency, p50 and p95 over every query, measured at the client, HTTP included. A
//! few warm-up requests (not counted) go first so that one-time costs do not skew the
//! latencies.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use engine::{EmbedderConfig, EngineConfig};
use serde::{Deserialize, Serialize};

use crate::commands::stats::percentile;

use gateway::api::swarm::RouteResponse;
use gateway::Embeddings;
use gateway::Swarm;

#[derive(Args, Debug)]
pub struct RoutingArgs {
    /// JSON lines of `{"query", "agent"}`.
    file: PathBuf,
    /// A running server's base URL (`http://host:port`); default: start one in process.
    #[arg(long)]
    url: Option<String>,
    /// `embedding` or `llm`; default: the swarm file's.
    #[arg(long)]
    strategy: Option<String>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Requests sent first and not counted.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// The swarm file of the in-process server.
    #[arg(long, default_value = "swarm.toml")]
    swarm: PathBuf,
    #[command(flatten)]
    engine: EngineConfig,
    #[command(flatten)]
    embedding: EmbedderConfig,
}

#[derive(Debug, Deserialize)]
struct Labelled {
    query: String,
    agent: String,
}

#[derive(Debug, Serialize)]
struct AgentReport {
    /// Queries labelled with this agent.
    support: usize,
    precision: f64,
    recall: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    file: String,
    strategy: String,
    queries: usize,
    correct: usize,
    accuracy: f64,
    agents: BTreeMap<String, AgentReport>,
    /// expected -> chosen -> count.
    confusion: BTreeMap<String, BTreeMap<String, usize>>,
    latency_p50_ms: f64,
    latency_p95_ms: f64,
    latency_mean_ms: f64,
}

pub fn run(args: RoutingArgs) -> Result<()> {
    let labelled: Vec<Labelled> = super::read_jsonl(&args.file)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let base = match &args.url {
        Some(url) => url.trim_end_matches('/').to_owned(),
        None => runtime.block_on(start_server(&args))?,
    };
    let url = format!("{base}/v1/swarm/route");
    let client = reqwest::Client::new();
    let route = |query: &str| {
        let mut body = serde_json::json!({"messages": [{"role": "user", "content": query}]});
        if let Some(strategy) = &args.strategy {
            body["strategy"] = strategy.clone().into();
        }
        runtime.block_on(async {
            let response = client.post(&url).json(&body).send().await?;
            let status = response.status();
            let text = response.text().await?;
            if !status.is_success() {
                bail!("{url} answered {status}: {text}");
            }
            Ok(serde_json::from_str::<RouteResponse>(&text)?)
        })
    };
    for item in labelled.iter().cycle().take(args.warmup) {
        route(&item.query)?;
    }
    let mut chosen = Vec::with_capacity(labelled.len());
    let mut latencies = Vec::with_capacity(labelled.len());
    let mut strategy = String::new();
    for item in &labelled {
        let started = Instant::now();
        let decision = route(&item.query)?;
        latencies.push(started.elapsed().as_secs_f64() * 1e3);
        strategy = decision.strategy;
        chosen.push(decision.agent);
    }
    let report = report(&args.file, strategy, &labelled, &chosen, &mut latencies);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// Loads the models and the swarm as `swarmgate serve` does and serves on 127.0.0.1:0; returns
/// the base URL. The server runs until the process ends.
async fn start_server(args: &RoutingArgs) -> Result<String> {
    let engine_config = args.engine.clone();
    let engine =
        tokio::task::spawn_blocking(move || engine::EngineHandle::start(&engine_config)).await??;
    let embeddings = Embeddings::start(&args.embedding).await?;
    let config = router::SwarmConfig::load(&args.swarm)?;
    let swarm = Swarm::new(
        config,
        engine.clone(),
        embeddings.as_ref().map(Embeddings::embedder),
    )?;
    swarm
        .prepare()
        .await
        .map_err(|e| anyhow::anyhow!("cannot index the swarm's agents: {e}"))?;
    let mut state =
        gateway::AppState::new(engine, gateway::config::DEFAULT_MAX_BODY_BYTES).with_swarm(swarm);
    if let Some(embeddings) = embeddings {
        state = state.with_embeddings(embeddings);
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(gateway::serve_on(listener, state, std::future::pending()));
    Ok(base)
}

fn report(
    file: &std::path::Path,
    strategy: String,
    labelled: &[Labelled],
    chosen: &[String],
    latencies: &mut [f64],
) -> Report {
    let mut confusion: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for (item, agent) in labelled.iter().zip(chosen) {
        *confusion
            .entry(item.agent.clone())
            .or_default()
            .entry(agent.clone())
            .or_default() += 1;
    }
    let correct = labelled
        .iter()
        .zip(chosen)
        .filter(|(item, agent)| item.agent == **agent)
        .count();
    let agents = confusion
        .keys()
        .map(|agent| {
            let support = confusion[agent].values().sum::<usize>();
            let hits = confusion[agent].get(agent).copied().unwrap_or(0);
            let picked = chosen.iter().filter(|c| *c == agent).count();
            let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            (
                agent.clone(),
                AgentReport {
                    support,
                    precision: ratio(hits, picked),
                    recall: ratio(hits, support),
                },
            )
        })
        .collect();
    Report {
        file: file.display().to_string(),
        strategy,
        queries: labelled.len(),
        correct,
        accuracy: correct as f64 / labelled.len() as f64,
        agents,
        confusion,
        latency_p50_ms: percentile(latencies, 50.0),
        latency_p95_ms: percentile(latencies, 95.0),
        latency_mean_ms: latencies.iter().sum::<f64>() / latencies.len() as f64,
    }
}

fn render(report: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} queries, strategy {}: accuracy {:.1}% ({}/{})\n",
        report.file,
        report.queries,
        report.strategy,
        report.accuracy * 100.0,
        report.correct,
        report.queries
    );
    let _ = writeln!(
        out,
        "{:<10} {:>9} {:>7} {:>6}",
        "agent", "precision", "recall", "n"
    );
    for (agent, a) in &report.agents {
        let _ = writeln!(
            out,
            "{agent:<10} {:>9.2} {:>7.2} {:>6}",
            a.precision, a.recall, a.support
        );
    }
    let columns: BTreeSet<&String> = report
        .confusion
        .iter()
        .flat_map(|(expected, row)| std::iter::once(expected).chain(row.keys()))
        .collect();
    let _ = write!(
        out,
        "\nconfusion (rows: expected, columns: chosen)\n{:<10}",
        ""
    );
    for column in &columns {
        let _ = write!(out, " {:>8}", truncate(column));
    }
    out.push('\n');
    for (expected, row) in &report.confusion {
        let _ = write!(out, "{expected:<10}");
        for column in &columns {
            let _ = write!(out, " {:>8}", row.get(*column).copied().unwrap_or(0));
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "\nroute latency: p50 {:.1} ms, p95 {:.1} ms, mean {:.1} ms",
        report.latency_p50_ms, report.latency_p95_ms, report.latency_mean_ms
    );
    out
}

fn truncate(name: &str) -> &str {
    name.get(..8).unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_counts_precision_recall_and_the_matrix() {
        let labelled: Vec<Labelled> = [("a", "coder"), ("b", "coder"), ("c", "math")]
            .iter()
            .map(|(q, a)| Labelled {
                query: (*q).into(),
                agent: (*a).into(),
            })
            .collect();
        let chosen = ["coder".to_owned(), "math".into(), "math".into()];
        let mut latencies = [3.0, 1.0, 2.0];
        let report = report(
            std::path::Path::new("dev.jsonl"),
            "embedding".into(),
            &labelled,
            &chosen,
            &mut latencies,
        );
        assert_eq!(report.correct, 2);
        assert_eq!(report.agents["coder"].recall, 0.5);
        assert_eq!(report.agents["coder"].precision, 1.0);
        assert_eq!(report.agents["math"].precision, 0.5);
        assert_eq!(report.confusion["coder"]["math"], 1);
        assert_eq!(report.latency_p50_ms, 2.0);
        assert_eq!(report.latency_p95_ms, 3.0);
        let text = render(&report);
        assert!(text.contains("accuracy 66.7% (2/3)"), "{text}");
    }
}

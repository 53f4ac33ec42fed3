//! `swarmgate eval verifier FILE`: sends every item of a labelled JSONL file through
//! `POST /v1/swarm/verify` and reports how many bad answers were rejected and how many good ones
//! wrongly were, per defect, with the latency of each call.
//!
//! Each line is `{"question", "answer", "requires_json", "label": "good" | "bad", "defect"}`
//! (`defect` names what is wrong with a bad answer: `empty`, `off_topic`, ...). The server is
//! the one at `--url`, or one started in process on `127.0.0.1:0` with the model and embedding
//! model the flags name. Items run one at a time, so latencies are those of an idle server.
//!
//! The report also lists each group's relevance, grounding and judge scores, which is what
//! thresholds are tuned on.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use engine::{EmbedderConfig, EngineConfig, EngineHandle};
use serde::{Deserialize, Serialize};

use crate::commands::stats::percentile;

#[derive(Args, Debug)]
pub struct VerifierEvalArgs {
    /// JSONL file of labelled items.
    pub file: PathBuf,
    /// A running server's base URL (`http://127.0.0.1:8080`); absent, one is started in
    /// process.
    #[arg(long)]
    pub url: Option<String>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: EngineConfig,
    #[command(flatten)]
    pub embedding: EmbedderConfig,
}

#[derive(Debug, Deserialize)]
struct Item {
    question: String,
    answer: String,
    #[serde(default)]
    requires_json: bool,
    label: Label,
    defect: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Label {
    Good,
    Bad,
}

#[derive(Debug, Deserialize)]
struct Answer {
    verdict: String,
    score: f32,
    reasons: Vec<String>,
    relevance: Option<f32>,
    grounding: Option<f32>,
}

/// One group of items (a defect, or the good answers): how many were rejected, and the scores.
#[derive(Debug, Default, Serialize)]
struct Group {
    rejected: usize,
    total: usize,
    /// Relevance of the items that reached that check, ascending.
    relevance: Vec<f32>,
    /// The same, of the items that required JSON.
    relevance_json: Vec<f32>,
    /// Grounding of the items whose grounding was measured, ascending.
    grounding: Vec<f32>,
    /// Judge scores of the items that reached the judge, ascending.
    judge: Vec<f32>,
    /// How often each check's code was the reason.
    reasons: BTreeMap<String, usize>,
}

#[derive(Debug, Serialize)]
struct Report {
    items: usize,
    bad_rejected_pct: f64,
    good_rejected_pct: f64,
    latency_p50_ms: f64,
    latency_p95_ms: f64,
    /// `good`, then each defect.
    groups: BTreeMap<String, Group>,
}

pub fn run(args: VerifierEvalArgs) -> Result<()> {
    let items: Vec<Item> = super::read_jsonl(&args.file)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let base = match &args.url {
        Some(url) => url.trim_end_matches('/').to_owned(),
        None => runtime.block_on(start_server(&args.engine, &args.embedding))?,
    };
    let url = format!("{base}/v1/swarm/verify");
    let client = reqwest::Client::new();
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    let mut latencies = Vec::with_capacity(items.len());
    for item in &items {
        let body = serde_json::json!({
            "question": item.question,
            "answer": item.answer,
            "requires_json": item.requires_json,
        });
        let started = Instant::now();
        let answer: Answer = runtime.block_on(async {
            let response = client.post(&url).json(&body).send().await?;
            let status = response.status();
            let text = response.text().await?;
            if !status.is_success() {
                bail!("{url} answered {status}: {text}");
            }
            Ok(serde_json::from_str(&text)?)
        })?;
        latencies.push(started.elapsed().as_secs_f64() * 1000.0);
        let name = match item.label {
            Label::Good => "good".to_owned(),
            Label::Bad => item.defect.clone().unwrap_or_else(|| "bad".into()),
        };
        let group = groups.entry(name).or_default();
        group.total += 1;
        let rejected = answer.verdict == "failed";
        group.rejected += usize::from(rejected);
        match item.requires_json {
            true => group.relevance_json.extend(answer.relevance),
            false => group.relevance.extend(answer.relevance),
        }
        group.grounding.extend(answer.grounding);
        let judged = !rejected || answer.reasons.iter().any(|r| r.starts_with("judge:"));
        if judged {
            group.judge.push(answer.score);
        }
        for reason in &answer.reasons {
            let code = reason.split(':').next().unwrap_or(reason).to_owned();
            *group.reasons.entry(code).or_default() += 1;
        }
    }
    for group in groups.values_mut() {
        group.relevance.sort_by(f32::total_cmp);
        group.relevance_json.sort_by(f32::total_cmp);
        group.grounding.sort_by(f32::total_cmp);
        group.judge.sort_by(f32::total_cmp);
    }
    let (mut bad_rejected, mut bad_total) = (0, 0);
    for (name, group) in &groups {
        if name != "good" {
            bad_rejected += group.rejected;
            bad_total += group.total;
        }
    }
    let good = groups.get("good");
    let pct = |n: usize, d: usize| {
        if d == 0 {
            0.0
        } else {
            100.0 * n as f64 / d as f64
        }
    };
    let report = Report {
        items: items.len(),
        bad_rejected_pct: pct(bad_rejected, bad_total),
        good_rejected_pct: pct(good.map_or(0, |g| g.rejected), good.map_or(0, |g| g.total)),
        latency_p50_ms: percentile(&mut latencies, 50.0),
        latency_p95_ms: percentile(&mut latencies, 95.0),
        groups,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// Starts the engine, the embedder and the HTTP API on `127.0.0.1:0`; returns the base URL.
async fn start_server(engine: &EngineConfig, embedding: &EmbedderConfig) -> Result<String> {
    let engine = EngineHandle::start(engine)?;
    let mut state = gateway::AppState::new(engine, gateway::config::DEFAULT_MAX_BODY_BYTES);
    if let Some(embeddings) = gateway::Embeddings::start(embedding).await? {
        state = state.with_embeddings(embeddings);
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(gateway::serve_on(listener, state, std::future::pending()));
    Ok(base)
}

fn print_report(report: &Report) {
    println!(
        "{} items: bad rejected {:.1}%, good rejected {:.1}%; latency p50 {:.1} ms, p95 {:.1} ms",
        report.items,
        report.bad_rejected_pct,
        report.good_rejected_pct,
        report.latency_p50_ms,
        report.latency_p95_ms
    );
    println!();
    println!("{:<16} {:>8}  reasons", "group", "rejected");
    for (name, group) in &report.groups {
        let reasons: Vec<String> = group
            .reasons
            .iter()
            .map(|(code, n)| format!("{code}×{n}"))
            .collect();
        println!(
            "{:<16} {:>8}  {}",
            name,
            format!("{}/{}", group.rejected, group.total),
            reasons.join(" ")
        );
    }
    println!();
    println!("scores (ascending)");
    let list = |v: &[f32]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (name, group) in &report.groups {
        println!("{name:<16} relevance: {}", list(&group.relevance));
        println!("{:<16}   (json):  {}", "", list(&group.relevance_json));
        println!("{:<16} grounding: {}", "", list(&group.grounding));
        println!("{:<16} judge:     {}", "", list(&group.judge));
    }
}

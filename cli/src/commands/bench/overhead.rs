//! `swarmgate bench --scenario gateway-overhead`: what the HTTP gateway adds to a request.
//!
//! The same one-token chat is answered two ways, alternately, in one process: through the
//! engine's own API (render, submit, read the stream) and through `POST /v1/chat/completions` on
//! a server bound to 127.0.0.1 (JSON, validation, routing layers, the response). The engine's
//! work is the same on both paths (the prompt is identical, so its prefix is cached after the
//! first call), so the difference of the medians is the gateway's overhead.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use engine::{ChatMessage, EngineHandle, Event, GenerateRequest, Prompt, SamplingParams};
use serde::Serialize;

use super::BenchArgs;
use crate::commands::progress_bar;
use crate::commands::stats::{ms, percentile};

const QUESTION: &str = "Say hello.";

#[derive(Debug, Serialize)]
struct Report {
    scenario: &'static str,
    requests: usize,
    engine_p50_ms: f64,
    engine_p95_ms: f64,
    http_p50_ms: f64,
    http_p95_ms: f64,
    overhead_p50_ms: f64,
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let requests = args.requests.unwrap_or(100);
    let engine = EngineHandle::start(&args.engine)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}/v1/chat/completions", listener.local_addr()?);
    let state = gateway::AppState::new(engine.clone(), gateway::config::DEFAULT_MAX_BODY_BYTES);
    runtime.spawn(gateway::serve_on(listener, state, std::future::pending()));
    let client = reqwest::Client::new();
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 1,
        "temperature": 0,
    });
    let bar = progress_bar(requests, "pairs")?;
    let (mut direct, mut http) = (Vec::new(), Vec::new());
    for _ in 0..requests {
        direct.push(ms(in_process(&engine)?));
        let started = Instant::now();
        let response = runtime.block_on(async {
            let response = client.post(&url).json(&body).send().await?;
            let status = response.status();
            response.bytes().await.map(|_| status)
        })?;
        if !response.is_success() {
            bail!("the gateway answered {response}");
        }
        http.push(ms(started.elapsed()));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let (engine_p50_ms, http_p50_ms) = (percentile(&mut direct, 50.0), percentile(&mut http, 50.0));
    let report = Report {
        scenario: "gateway-overhead",
        requests,
        engine_p50_ms,
        engine_p95_ms: percentile(&mut direct, 95.0),
        http_p50_ms,
        http_p95_ms: percentile(&mut http, 95.0),
        overhead_p50_ms: http_p50_ms - engine_p50_ms,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "one-token chat, {requests} pairs: engine API p50 {:.2} ms p95 {:.2} ms; \
             HTTP p50 {:.2} ms p95 {:.2} ms; gateway overhead p50 {:.2} ms",
            report.engine_p50_ms,
            report.engine_p95_ms,
            report.http_p50_ms,
            report.http_p95_ms,
            report.overhead_p50_ms
        );
    }
    Ok(())
}

/// The same request through the engine's API: render, submit, read to the end.
fn in_process(engine: &EngineHandle) -> Result<Duration> {
    let started = Instant::now();
    let prompt = engine
        .model()
        .encode_chat(&[ChatMessage::new("user", QUESTION)], true)?
        .tokens;
    let mut stream = engine.submit(GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens: 1,
        ..GenerateRequest::new(Prompt::Tokens(prompt))
    })?;
    loop {
        match stream.blocking_next().context("the engine stopped")? {
            Event::Finished { error: Some(e), .. } => bail!("request failed: {e}"),
            Event::Finished { .. } => return Ok(started.elapsed()),
            Event::Delta { .. } | Event::PromptLogprobs(_) => {}
        }
    }
}

//! A chat completion to the swarm (`model: "swarm"`, `"auto"` or an agent's name), as the client
//! receives it: [`crate::service::swarm::run`] routes, answers and verifies; this shapes its
//! answer as a whole completion, a stream of a finished answer, or a live stream whose verdict
//! comes last. Every response carries the `x-swarm-agent` header.

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::swarm::SwarmReport;
use crate::api::{self, ChatChoice, ChatCompletion, Frame};
use crate::error::ApiError;
use crate::http::chat::Answer;
use crate::service::choices::{sse_response, Choices, ChunkFormat, Update};
use crate::service::swarm::run::{
    skipped, verdict_report, Answered, Generated, Live, Outcome, Run,
};
use crate::session::Turn;
use crate::validate::structured::Reply;

/// The header that names the agent whose answer the response carries.
pub const AGENT_HEADER: &str = "x-swarm-agent";

/// Frames a live stream may hold before the client reads them.
const LIVE_BUFFER: usize = 32;

/// The response that sends `answered`, the swarm pipeline's answer.
pub fn respond(answered: Answered) -> Result<Response, ApiError> {
    Ok(match answered {
        Answered::Whole {
            run,
            report,
            outcome,
            stream,
            include_usage,
            reply,
        } => whole(run, report, outcome, stream, include_usage, reply)?,
        Answered::Live {
            run,
            report,
            live,
            turn,
        } => stream_live(run, report, live, turn),
    })
}

/// The released answer, whole or as a stream whose first chunk carries the `swarm` object.
fn whole(
    run: Run,
    mut report: SwarmReport,
    outcome: Outcome,
    stream: bool,
    include_usage: bool,
    reply: Reply,
) -> Result<Response, ApiError> {
    let usage = run.usage();
    let agent = outcome.agent.name.to_string();
    report.agent = agent.clone();
    report.verdict = Some(outcome.verdict);
    report.consensus = outcome.consensus;
    report.usage = run.hops;
    let response = if stream {
        let mut answer = Answer::new(agent.clone(), include_usage).replying(reply, 1);
        let mut opening = answer.opening(0).expect("chat opens every choice");
        opening.swarm = Some(report);
        let frames: Vec<_> = std::iter::once(opening)
            .chain(answer.delta(0, outcome.text, &[]))
            .chain(std::iter::once(answer.finished(0, outcome.finish_reason)))
            .chain(answer.usage(usage))
            .map(Frame::Chunk)
            .chain(std::iter::once(Frame::Done))
            .collect();
        sse_response(stream::iter(frames))
    } else {
        let answer = Answer::new(agent.clone(), false).replying(reply, 1);
        let (message, finish_reason) = answer.message(outcome.text, outcome.finish_reason);
        Json(ChatCompletion {
            id: answer.id,
            object: "chat.completion",
            created: answer.created,
            model: agent.clone(),
            choices: vec![ChatChoice {
                index: 0,
                message,
                logprobs: None,
                finish_reason,
            }],
            usage,
            swarm: Some(report),
        })
        .into_response()
    };
    Ok(with_agent(response, &agent))
}

/// Streams the agent's answer from its events as it is generated; once it is done, verifies it
/// under the policy (when the policy verifies) and sends the verdict and the hops on a last
/// chunk before `[DONE]`, which waits until the answer is kept as `turn`. The client leaving
/// drops the receiver, which ends the task and with it the engine stream.
fn stream_live(mut run: Run, mut report: SwarmReport, live: Live, turn: Turn) -> Response {
    let Live {
        agent,
        policy,
        valid,
        events,
    } = live;
    let name = agent.name.to_string();
    // The agent's model's tokenizer: the one its tokens are ids of.
    let model = run.state.model_named(valid.generate.model.as_deref());
    let mut answer = Answer {
        tokenizer: valid.logprobs.map(|_| model.tokenizer.clone()),
        ..Answer::new(name.clone(), valid.include_usage).replying(valid.structured.reply.clone(), 1)
    };
    let (tx, rx) = mpsc::channel(LIVE_BUFFER);
    tokio::spawn(async move {
        let send = |frame| {
            let tx = tx.clone();
            async move { tx.send(frame).await.is_ok() }
        };
        let mut opening = answer.opening(0).expect("chat opens every choice");
        opening.swarm = Some(report.clone());
        if !send(Frame::Chunk(opening)).await {
            return;
        }
        let mut choices = Choices::new(vec![events], 1);
        let mut text = String::new();
        let mut finish_reason = api::FinishReason::Stop;
        while let Some(update) = choices.next().await {
            let chunk = match update {
                Update::Prompt { .. } => None,
                Update::Delta {
                    text: delta,
                    logprobs,
                    ..
                } => {
                    text.push_str(&delta);
                    answer.delta(0, delta, &logprobs)
                }
                Update::Finished { reason, .. } => {
                    finish_reason = reason;
                    Some(answer.finished(0, reason))
                }
                Update::Failed { error, .. } => {
                    run.state.metrics().stream_failed(&error);
                    let _ = send(Frame::Chunk(answer.failed(0, error.body()))).await;
                    let _ = send(Frame::Done).await;
                    return;
                }
            };
            if let Some(chunk) = chunk {
                if !send(Frame::Chunk(chunk)).await {
                    return;
                }
            }
        }
        let used = choices.usage();
        let usage = engine::Usage {
            prompt_tokens: used.prompt_tokens,
            completion_tokens: used.completion_tokens,
            cached_tokens: used.prompt_tokens_details.cached_tokens,
        };
        run.hop("generate", &name, 1, usage);
        let generated = Generated {
            text,
            finish_reason,
        };
        let verdict = if policy.enabled {
            match run.verify(&policy.checks, &generated, 1).await {
                Ok(verdict) => verdict_report(&verdict, 1),
                Err(e) => skipped(1, vec![format!("verifier: {e}")]),
            }
        } else {
            skipped(1, Vec::new())
        };
        run.state.metrics().agent_verdict(&name, &verdict.status);
        report.verdict = Some(verdict);
        let usage = run.usage();
        report.usage = run.hops;
        let mut last = answer.empty();
        last.swarm = Some(report);
        let frames = std::iter::once(last)
            .chain(answer.usage(usage))
            .map(Frame::Chunk)
            .chain(std::iter::once(Frame::Done));
        for frame in frames {
            if !send(frame).await {
                return;
            }
        }
    });
    with_agent(
        sse_response(turn.record(ReceiverStream::new(rx))),
        &agent.name.to_string(),
    )
}

fn with_agent(mut response: Response, agent: &str) -> Response {
    // Agent names are lowercase letters, digits, `_` and `-`: always a valid header value.
    if let Ok(value) = HeaderValue::from_str(agent) {
        response.headers_mut().insert(AGENT_HEADER, value);
    }
    response
}

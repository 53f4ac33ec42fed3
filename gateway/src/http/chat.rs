//! `POST /v1/chat/completions`: validate, submit to the engine, and answer whole or streamed.
//!
//! The request runs under its [`Admission`]: tokens per minute, deadlines, metrics. Its `n`
//! answers run side by side ([`Choices`]). A request in a conversation session gets its history
//! first and adds its answer to it once answered ([`crate::session`]).
//!
//! Non-streamed: each answer's deltas are gathered into one message; a generation that fails
//! becomes a 500 envelope, one that runs out of time a 504. Streamed: the headers wait a moment
//! for the first update, so a request that times out before its first token still gets a 504
//! (after that, keep-alive comments until the first token); then
//! server-sent events in OpenAI's order: per choice, a first chunk with
//! `{"role": "assistant", "content": ""}`, one chunk per delta that adds text (or
//! log-probabilities), a last chunk with an empty delta and the `finish_reason`; then the usage
//! chunk when asked for (`choices: []`), then `data: [DONE]`.
//!
//! The chunks are built from [`crate::service::choices::Update`]s alone, so their shape is unit-tested below without an
//! engine.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::TokenLogprob;
use tokenizers::Tokenizer;

use crate::api::tools::{FunctionCallDelta, ToolCallDelta};
use crate::api::{
    self, unix_now, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
    ChatCompletionRequest, ChoiceLogprobs, ChunkChoice, ChunkDelta, StreamEvent,
};
use crate::error::{ApiError, GenerationErrors};
use crate::http::json::ApiJson;
use crate::http::swarm_chat;
use crate::limits::Admission;
use crate::logprobs;
use crate::runs;
use crate::service::choices::{sse_response, Choices, ChunkFormat};
use crate::service::warm_up::WarmUp;
use crate::service::{swarm, AppState};
use crate::session::Echo;
use crate::tool_calls::{self, EnvelopeReader, Piece};
use crate::validate::structured::{self, Reply};
use crate::validate::{off_io, validate_chat, ValidChatRequest};

/// Creates a model response for the given chat conversation.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "generation",
    request_body = ChatCompletionRequest,
    params(("x-swarmgate-run-id" = Option<String>, Header, description = "The agent run (program) \
        this request is a turn of (1 to 256 printable ASCII characters), for run scheduling and \
        for keeping a tool-call turn's KV cache for its follow-up; without it, the session's \
        run (chat), or the `previous_response_id` chain's (responses)."),
        ("x-session-id" = Option<String>, Header, description = "The conversation session \
        (1 to 256 printable ASCII characters; without it, `user` names the session): the \
        history kept for it goes before `messages`, and a successful answer is added to it, \
        so a client sends only its new turn. Sessions belong to the API key that made them.")),
    responses(
        (status = 200, description = "The answer, or with `stream: true` server-sent events \
            of `ChatCompletionChunk`s ended by `data: [DONE]`.",
            headers(("x-session-id" = String, description = "The session the request was \
                answered in, when it named one.")),
            content((ChatCompletion = "application/json"), (StreamEvent = "text/event-stream"))),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(state): State<AppState>,
    admission: Admission,
    headers: HeaderMap,
    ApiJson(mut request): ApiJson<ChatCompletionRequest>,
) -> Result<(Echo, Response), ApiError> {
    let named = request.model.clone();
    let turn = state
        .sessions()
        .open(
            admission.caller,
            &headers,
            state.model_named(named.as_deref()),
            &mut request,
        )
        .await?;
    let echo = turn.echo();
    let run = runs::run_key(admission.caller, &headers, turn.session())?;
    if let Some(swarm) = state.swarm() {
        if swarm.answers(request.model.as_deref()) {
            let swarm = swarm.clone();
            let answered =
                swarm::run::create(state.clone(), admission, swarm, request, turn, run).await?;
            return Ok((echo, swarm_chat::respond(answered)?));
        }
    }
    let model_info = state.model_named(named.as_deref());
    let limits = state.structured_limits(admission.caller);
    let validating = state.clone();
    let ValidChatRequest {
        model,
        prompt_tokens,
        mut generate,
        n,
        stream,
        include_usage,
        logprobs,
        structured,
        messages,
        ..
    } = off_io(move || validate_chat(request, validating.model_named(named.as_deref()), &limits))
        .await?;
    let warnings = structured::compile(model_info, &structured, &limits).await?;
    generate.run = runs::turn(run.as_deref(), &model);
    let reply = &structured.reply;
    let warm_up =
        messages.map(|m| WarmUp::chat(&state, &admission, m, reply.clone(), &generate, None));
    let prompts = vec![(prompt_tokens, generate)];
    let choices = Choices::submit(&state, &admission, prompts, n, warm_up).await?;
    let answer = Answer {
        tokenizer: logprobs.map(|_| model_info.tokenizer.clone()),
        ..Answer::new(model, include_usage).replying(structured.reply, n)
    };
    if !stream {
        let (collected, usage) = choices.collect().await?;
        // A request in a session has one choice: the turn's answer.
        turn.commit(&collected[0].text).await?;
        let choices = collected
            .into_iter()
            .enumerate()
            .map(|(index, choice)| {
                let reason = choice.finish_reason.unwrap_or(api::FinishReason::Stop);
                let (message, finish_reason) = answer.message(choice.text, reason);
                ChatChoice {
                    index: index as u32,
                    logprobs: answer.logprobs(&choice.logprobs),
                    message,
                    finish_reason,
                }
            })
            .collect();
        let completion = ChatCompletion {
            id: answer.id,
            object: "chat.completion",
            created: answer.created,
            model: answer.model,
            choices,
            usage,
            swarm: None,
        };
        return Ok((echo, warned(Json(completion).into_response(), &warnings)));
    }
    let frames = choices.stream(answer, state.metrics().clone()).await?;
    Ok((echo, warned(sse_response(turn.record(frames)), &warnings)))
}

/// The response header naming what lenient schemas lost.
pub(crate) const SCHEMA_WARNINGS: &str = "x-swarmgate-schema-warnings";

/// `response` with the schema warnings, if any, in [`SCHEMA_WARNINGS`].
pub(crate) fn warned(mut response: Response, warnings: &[String]) -> Response {
    if warnings.is_empty() {
        return response;
    }
    // Header values are visible ASCII; the warnings are joined and anything else replaced.
    let text: String = warnings
        .join("; ")
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(4096)
        .collect();
    if let Ok(value) = axum::http::HeaderValue::from_str(&text) {
        response.headers_mut().insert(SCHEMA_WARNINGS, value);
    }
    response
}

/// What the completion, or every chunk, of one answer shares.
pub(crate) struct Answer {
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    /// Set when the client asked for log-probabilities: turns token ids into text and bytes.
    pub(crate) tokenizer: Option<Arc<Tokenizer>>,
    pub(crate) include_usage: bool,
    /// How the text reads back: content, or a tool-call envelope.
    pub(crate) reply: Reply,
    /// Per choice, with an envelope: its reader.
    pub(crate) readers: Vec<EnvelopeReader>,
}

impl Answer {
    /// A new answer of `model`, without log-probabilities.
    pub(crate) fn new(model: String, include_usage: bool) -> Self {
        Self {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model,
            tokenizer: None,
            include_usage,
            reply: Reply::Text,
            readers: Vec::new(),
        }
    }

    /// The same answer, its `n` choices' text read back as `reply` says.
    pub(crate) fn replying(mut self, reply: Reply, n: usize) -> Self {
        if let Reply::Envelope { json_response } = reply {
            self.readers = (0..n).map(|_| EnvelopeReader::new(json_response)).collect();
        }
        self.reply = reply;
        self
    }

    /// A whole choice's message, and its finish reason (`tool_calls` when it made calls).
    pub(crate) fn message(
        &self,
        text: String,
        reason: api::FinishReason,
    ) -> (AssistantMessage, api::FinishReason) {
        let Reply::Envelope { json_response } = self.reply else {
            return (AssistantMessage::text(text), reason);
        };
        let complete = reason != api::FinishReason::Length;
        let (content, calls) = tool_calls::read_all(&text, json_response, complete);
        if calls.is_empty() {
            return (AssistantMessage::text(content), reason);
        }
        let message = AssistantMessage {
            content: None,
            tool_calls: Some(tool_calls::api_calls(calls)),
            ..AssistantMessage::text(String::new())
        };
        let reason = match reason {
            api::FinishReason::Stop => api::FinishReason::ToolCalls,
            other => other,
        };
        (message, reason)
    }

    /// The delta of `pieces` an envelope reader gave.
    fn envelope_delta(pieces: Vec<Piece>) -> Option<ChunkDelta> {
        if pieces.is_empty() {
            return None;
        }
        let mut delta = ChunkDelta::default();
        let mut calls: Vec<ToolCallDelta> = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Content(text) => delta
                    .content
                    .get_or_insert_with(String::new)
                    .push_str(&text),
                Piece::Call { index, id, name } => calls.push(ToolCallDelta {
                    index: index as u32,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionCallDelta {
                        name: Some(name),
                        arguments: String::new(),
                    },
                }),
                Piece::Arguments { index, fragment } => match calls.last_mut() {
                    Some(last) if last.index == index as u32 => {
                        last.function.arguments.push_str(&fragment)
                    }
                    _ => calls.push(ToolCallDelta {
                        index: index as u32,
                        id: None,
                        kind: None,
                        function: FunctionCallDelta {
                            name: None,
                            arguments: fragment,
                        },
                    }),
                },
            }
        }
        delta.tool_calls = (!calls.is_empty()).then_some(calls);
        Some(delta)
    }

    fn logprobs(&self, logprobs: &[TokenLogprob]) -> Option<ChoiceLogprobs> {
        self.tokenizer.as_ref().map(|tokenizer| ChoiceLogprobs {
            content: logprobs::to_wire(tokenizer, logprobs),
        })
    }

    fn chunk(&self, choices: Vec<ChunkChoice>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            // With include_usage, OpenAI sends `"usage": null` on every chunk but the last.
            usage: self.include_usage.then_some(None),
            error: None,
            swarm: None,
        }
    }

    fn choice_chunk(
        &self,
        index: usize,
        delta: ChunkDelta,
        logprobs: Option<ChoiceLogprobs>,
        finish_reason: Option<api::FinishReason>,
    ) -> ChatCompletionChunk {
        self.chunk(vec![ChunkChoice {
            index: index as u32,
            delta,
            logprobs,
            finish_reason,
        }])
    }
}

impl ChunkFormat for Answer {
    type Chunk = ChatCompletionChunk;

    fn empty(&self) -> ChatCompletionChunk {
        self.chunk(Vec::new())
    }

    fn include_usage(&self) -> bool {
        self.include_usage
    }

    fn opening(&self, index: usize) -> Option<ChatCompletionChunk> {
        let delta = ChunkDelta {
            role: Some("assistant"),
            content: Some(String::new()),
            tool_calls: None,
        };
        Some(self.choice_chunk(index, delta, None, None))
    }

    /// Chat never asks for the prompt's log-probabilities.
    fn prompt(&mut self, _: usize, _: &[TokenLogprob]) -> Option<ChatCompletionChunk> {
        None
    }

    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: &[TokenLogprob],
    ) -> Option<ChatCompletionChunk> {
        // An empty delta is the detokenizer holding back part of a character or a possible stop
        // string; only its log-probabilities are news.
        if text.is_empty() && logprobs.is_empty() {
            return None;
        }
        let delta = match self.readers.get_mut(index) {
            Some(reader) => Self::envelope_delta(reader.push(&text)),
            None => (!text.is_empty()).then(|| ChunkDelta {
                content: Some(text),
                ..ChunkDelta::default()
            }),
        };
        // Without news in the text, only log-probabilities are worth a chunk.
        if delta.is_none() && logprobs.is_empty() {
            return None;
        }
        let delta = delta.unwrap_or_else(|| ChunkDelta {
            content: Some(String::new()),
            ..ChunkDelta::default()
        });
        Some(self.choice_chunk(index, delta, self.logprobs(logprobs), None))
    }

    fn finished(&mut self, index: usize, reason: api::FinishReason) -> ChatCompletionChunk {
        let (delta, reason) = match self.readers.get_mut(index) {
            Some(reader) => {
                let complete = reason != api::FinishReason::Length;
                let rest = Self::envelope_delta(reader.finish(complete));
                let reason = match reason {
                    api::FinishReason::Stop if reader.calls() > 0 => api::FinishReason::ToolCalls,
                    other => other,
                };
                (rest.unwrap_or_default(), reason)
            }
            None => (ChunkDelta::default(), reason),
        };
        self.choice_chunk(index, delta, None, Some(reason))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use engine::{Event, FinishReason};
    use serde_json::{json, Value};

    use super::*;
    use crate::metrics::Metrics;
    use crate::service::choices::tests::{choices_of, frames_json};
    use crate::service::choices::Collected;
    use crate::test_support::model_info;

    fn tokenizer() -> Arc<Tokenizer> {
        static MODEL: OnceLock<engine::ModelInfo> = OnceLock::new();
        MODEL.get_or_init(|| model_info(8192)).tokenizer.clone()
    }

    fn answer(logprobs: bool, include_usage: bool) -> Answer {
        Answer {
            id: "chatcmpl-test".into(),
            created: 1,
            tokenizer: logprobs.then(tokenizer),
            ..Answer::new("m".into(), include_usage)
        }
    }

    fn delta(text: &str) -> Event {
        Event::Delta {
            text: text.into(),
            tokens: vec![1],
            logprobs: Vec::new(),
        }
    }

    fn finished(reason: FinishReason, error: Option<&str>) -> Event {
        Event::Finished {
            reason,
            usage: engine::Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: 4,
            },
            error: error.map(str::to_owned),
        }
    }

    /// The SSE payloads `events` (of one choice) turn into: chunks as JSON, then "[DONE]".
    async fn stream(answer: Answer, events: Vec<Event>) -> Vec<Value> {
        sent(answer, vec![events.into_iter().map(Ok).collect()]).await
    }

    async fn sent(answer: Answer, choices: Vec<Vec<Result<Event, ApiError>>>) -> Vec<Value> {
        frames_json(choices_of(choices, 1).frames(answer, None, Metrics::new())).await
    }

    async fn collect(events: Vec<Event>) -> Result<(Vec<Collected>, api::Usage), ApiError> {
        choices_of(vec![events.into_iter().map(Ok).collect()], 1)
            .collect()
            .await
    }

    #[tokio::test]
    async fn stream_order_with_usage() {
        let events = vec![
            delta("Hel"),
            delta(""),
            delta("lo"),
            finished(FinishReason::Stop, None),
        ];
        let sent = stream(answer(false, true), events).await;
        let deltas: Vec<&Value> = sent[..4]
            .iter()
            .map(|c| &c["choices"][0]["delta"])
            .collect();
        assert_eq!(
            deltas,
            [
                &json!({"role": "assistant", "content": ""}),
                &json!({"content": "Hel"}),
                &json!({"content": "lo"}),
                &json!({}),
            ],
            "the empty delta is skipped"
        );
        assert!(sent[..4].iter().all(|c| c["usage"].is_null()));
        assert!(sent[..3]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        assert_eq!(sent[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(sent[4]["choices"], json!([]));
        assert_eq!(
            sent[4]["usage"],
            json!({
                "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                "prompt_tokens_details": {"cached_tokens": 4}
            })
        );
        assert_eq!(sent[5], "[DONE]");
        assert_eq!(sent.len(), 6);
    }

    #[tokio::test]
    async fn tool_calls_stream_as_openai_deltas() {
        let envelope = Answer::new("m".into(), false).replying(
            Reply::Envelope {
                json_response: false,
            },
            1,
        );
        let events = vec![
            delta("{\"tool_calls\": [{\"name\": \"f\", \"argu"),
            delta("ments\": {\"x\": "),
            delta("1}}]}"),
            finished(FinishReason::Stop, None),
        ];
        let sent = stream(envelope, events).await;
        let deltas: Vec<&Value> = sent.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[0], &json!({"role": "assistant", "content": ""}));
        let first = &deltas[1]["tool_calls"][0];
        assert_eq!(first["index"], 0);
        assert_eq!(first["type"], "function");
        assert_eq!(
            first["function"],
            json!({"name": "f", "arguments": "{\"x\": "})
        );
        assert!(first["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(
            deltas[2],
            &json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
        );
        assert_eq!(sent[3]["choices"][0]["finish_reason"], "tool_calls");
        assert!(sent.iter().all(|c| c["choices"][0]["delta"]["content"]
            .as_str()
            .is_none_or(|t| !t.contains('{'))));
        let (message, reason) = Answer::new("m".into(), false)
            .replying(
                Reply::Envelope {
                    json_response: false,
                },
                1,
            )
            .message(r#"{"response": "Hi"}"#.into(), api::FinishReason::Stop);
        assert_eq!(
            (message.content.as_deref(), reason),
            (Some("Hi"), api::FinishReason::Stop)
        );
    }

    #[tokio::test]
    async fn stream_without_usage_has_no_usage_key() {
        let events = vec![delta("Hi"), finished(FinishReason::Length, None)];
        let sent = stream(answer(false, false), events).await;
        assert_eq!(sent.len(), 4);
        assert!(sent[..3]
            .iter()
            .all(|c| !c.as_object().unwrap().contains_key("usage")));
        assert_eq!(sent[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(sent[3], "[DONE]");
    }

    #[tokio::test]
    async fn a_failure_mid_stream_ends_with_an_error_chunk() {
        let events = vec![
            delta("Hi"),
            finished(FinishReason::Error, Some("deadline exceeded")),
        ];
        let sent = stream(answer(false, false), events).await;
        assert_eq!(sent.len(), 4);
        assert_eq!(sent[2]["choices"][0]["finish_reason"], "error");
        assert_eq!(sent[2]["choices"][0]["delta"], json!({}));
        assert_eq!(sent[2]["error"]["type"], "server_error");
        assert!(sent[2]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("deadline exceeded"));
        assert_eq!(sent[3], "[DONE]");
    }

    #[tokio::test]
    async fn a_lost_engine_stream_still_ends_the_answer() {
        let sent = stream(answer(false, true), vec![delta("Hi")]).await;
        assert_eq!(sent.len(), 4);
        assert_eq!(sent[2]["choices"][0]["finish_reason"], "error");
        assert_eq!(
            sent[2]["error"]["message"], "The server had an error while processing your request.",
            "internal detail stays in the logs"
        );
        assert_eq!(sent[3], "[DONE]");
    }

    #[tokio::test]
    async fn logprobs_ride_on_their_chunks_even_without_text() {
        let hello = tokenizer().token_to_id("Hello").unwrap();
        let lp = |token| TokenLogprob {
            token,
            logprob: -0.5,
            top: vec![(token, -0.5)],
            scored: Vec::new(),
        };
        let events = vec![
            Event::Delta {
                text: String::new(),
                tokens: vec![hello],
                logprobs: vec![lp(hello)],
            },
            Event::Delta {
                text: "Hello".into(),
                tokens: Vec::new(),
                logprobs: Vec::new(),
            },
            finished(FinishReason::Stop, None),
        ];
        let sent = stream(answer(true, false), events).await;
        assert_eq!(sent[0]["choices"][0]["logprobs"], Value::Null);
        let held = &sent[1]["choices"][0];
        assert_eq!(held["delta"]["content"], "");
        assert_eq!(held["logprobs"]["content"][0]["token"], "Hello");
        assert_eq!(
            held["logprobs"]["content"][0]["top_logprobs"][0]["logprob"],
            -0.5
        );
        assert_eq!(sent[2]["choices"][0]["logprobs"], json!({"content": []}));
        assert_eq!(sent[3]["choices"][0]["logprobs"], Value::Null);
    }

    #[tokio::test]
    async fn collect_gathers_text_and_logprobs() {
        let hello = tokenizer().token_to_id("Hello").unwrap();
        let events = vec![
            Event::Delta {
                text: "Hello".into(),
                tokens: vec![hello],
                logprobs: vec![TokenLogprob {
                    token: hello,
                    logprob: -0.25,
                    top: Vec::new(),
                    scored: Vec::new(),
                }],
            },
            delta(" world"),
            finished(FinishReason::Stop, None),
        ];
        let (choices, usage) = collect(events).await.unwrap();
        let choice = &choices[0];
        assert_eq!(choice.text, "Hello world");
        assert_eq!(choice.finish_reason, Some(api::FinishReason::Stop));
        let wire = answer(true, false).logprobs(&choice.logprobs).unwrap();
        assert_eq!(wire.content[0].logprob, -0.25);
        assert_eq!(wire.content[0].token, "Hello");
        assert_eq!(usage.total_tokens, 13);
    }

    #[tokio::test]
    async fn collect_turns_failures_into_errors() {
        let events = vec![
            delta("Hi"),
            finished(FinishReason::Error, Some("deadline exceeded")),
        ];
        let error = collect(events).await.unwrap_err();
        assert!(matches!(&error, ApiError::Generation(m) if m == "deadline exceeded"));
        assert_eq!(
            error.status(),
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        );
        let error = collect(vec![delta("Hi")]).await.unwrap_err();
        assert!(matches!(error, ApiError::Internal(_)));
    }

    #[tokio::test]
    async fn a_timeout_mid_stream_ends_with_a_timeout_chunk() {
        let events = vec![
            Ok(delta("Hi")),
            Err(ApiError::Timeout("out of time")),
            Ok(delta("never sent")),
        ];
        let sent = sent(answer(false, true), vec![events]).await;
        assert_eq!(sent.len(), 4, "no usage chunk: the engine never finished");
        assert_eq!(sent[2]["choices"][0]["finish_reason"], "error");
        assert_eq!(sent[2]["error"]["code"], "timeout");
        assert_eq!(sent[3], "[DONE]");
    }

    #[tokio::test]
    async fn choices_stream_side_by_side_with_one_usage() {
        let a = vec![Ok(delta("A")), Ok(finished(FinishReason::Stop, None))];
        let b = vec![Ok(delta("B")), Ok(finished(FinishReason::Length, None))];
        let sent = frames_json(choices_of(vec![a, b], 2).frames(
            answer(false, true),
            None,
            Metrics::new(),
        ))
        .await;
        assert_eq!(sent.len(), 8, "2 openings, 2 deltas, 2 ends, usage, [DONE]");
        let of = |i: u64| -> Vec<&Value> {
            sent[..6]
                .iter()
                .filter(|c| c["choices"][0]["index"] == i)
                .collect()
        };
        for (i, text, reason) in [(0, "A", "stop"), (1, "B", "length")] {
            let chunks = of(i);
            assert_eq!(chunks.len(), 3);
            assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
            assert_eq!(chunks[1]["choices"][0]["delta"]["content"], text);
            assert_eq!(chunks[2]["choices"][0]["finish_reason"], reason);
        }
        assert_eq!(
            sent[6]["usage"],
            json!({
                "prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16,
                "prompt_tokens_details": {"cached_tokens": 4}
            }),
            "the prompt counts once, both answers' tokens count"
        );
        assert_eq!(sent[7], "[DONE]");
    }
}

//! `POST /v1/chat/completions`: validate, submit to the engine, and answer whole or streamed.
//!
//! The request runs under its [`Admission`]: tokens per minute, deadlines, metrics.
//!
//! Non-streamed: the deltas are gathered into one message; a generation that fails becomes a 500
//! envelope, one that runs out of time a 504. Streamed: the headers wait for the first event, so
//! a request that times out before its first token still gets a 504; then server-sent events in
//! OpenAI's order: a first chunk with `{"role": "assistant", "content": ""}`, one chunk per delta
//! that adds text (or log-probabilities), a last chunk with an empty delta and the
//! `finish_reason`, the usage chunk when asked for (`choices: []`), then `data: [DONE]`. A
//! failure after the headers are sent (a generation error, the total deadline) cannot change the
//! status, so it becomes a chunk with `finish_reason: "error"` and an `error` object, still
//! followed by `[DONE]`.
//!
//! Invariant: the engine's [`engine::EventStream`] is owned by the response (the handler's
//! future, or the SSE body) and by nothing else. When the client goes away hyper drops the
//! response, which drops the stream, which cancels the sequence and frees its KV blocks. No task
//! may be spawned that holds it.
//!
//! The answer is built from any stream of engine [`Event`]s, so its shape is unit-tested below
//! without an engine.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::{Event, FinishReason};
use futures::{Stream, StreamExt};
use tokenizers::Tokenizer;

use crate::api::{
    self, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChoiceLogprobs, ChunkChoice, ChunkDelta, PromptTokensDetails, Usage,
};
use crate::app::AppState;
use crate::error::ApiError;
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::logprobs;
use crate::validate::{validate_chat, ValidChatRequest};

/// What an engine stream that ends without its final event tells the client.
pub(crate) const LOST_STREAM: &str = "the engine ended the request without finishing it";

pub async fn create(
    State(state): State<AppState>,
    admission: Admission,
    ApiJson(request): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let engine = state.engine();
    let ValidChatRequest {
        model,
        prompt_tokens,
        generate,
        stream,
        include_usage,
        logprobs,
        ..
    } = validate_chat(request, engine.model())?;
    let mut events = admission.submit(&state, prompt_tokens, generate).await?;
    let answer = Answer {
        id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        created: unix_now(),
        model,
        tokenizer: logprobs.map(|_| engine.model().tokenizer.clone()),
        include_usage,
    };
    if stream {
        let first = match events.next().await {
            Some(Err(error)) => return Err(error),
            first => first,
        };
        let rest = state.metrics().count_failures(events);
        Ok(sse_response(
            answer.frames(futures::stream::iter(first).chain(rest)),
        ))
    } else {
        Ok(Json(answer.collect(events).await?).into_response())
    }
}

/// What the completion, or every chunk, of one answer shares.
struct Answer {
    id: String,
    created: u64,
    model: String,
    /// Set when the client asked for log-probabilities: turns token ids into text and bytes.
    tokenizer: Option<Arc<Tokenizer>>,
    include_usage: bool,
}

/// One server-sent event of a streamed answer.
#[derive(Debug)]
enum Frame {
    Chunk(Box<ChatCompletionChunk>),
    Done,
}

impl Answer {
    /// Waits for the whole generation and returns it as one completion.
    async fn collect(
        self,
        mut events: impl Stream<Item = Result<Event, ApiError>> + Unpin,
    ) -> Result<ChatCompletion, ApiError> {
        let mut content = String::new();
        let mut token_logprobs = Vec::new();
        while let Some(event) = events.next().await {
            match event? {
                Event::Delta { text, logprobs, .. } => {
                    content.push_str(&text);
                    if let Some(tokenizer) = &self.tokenizer {
                        token_logprobs.extend(logprobs::to_wire(tokenizer, &logprobs));
                    }
                }
                // Chat never asks for the prompt's log-probabilities.
                Event::PromptLogprobs(_) => {}
                Event::Finished {
                    reason,
                    usage,
                    error,
                } => {
                    let finish_reason = finish_reason(reason, error)?;
                    return Ok(ChatCompletion {
                        id: self.id,
                        object: "chat.completion",
                        created: self.created,
                        model: self.model,
                        choices: vec![ChatChoice {
                            index: 0,
                            message: AssistantMessage {
                                role: "assistant",
                                content,
                            },
                            logprobs: self.tokenizer.is_some().then_some(ChoiceLogprobs {
                                content: token_logprobs,
                            }),
                            finish_reason,
                        }],
                        usage: usage_of(usage),
                    });
                }
            }
        }
        Err(ApiError::Internal(LOST_STREAM.into()))
    }

    /// The answer as a stream of frames; the returned stream owns `events`.
    fn frames(
        self,
        events: impl Stream<Item = Result<Event, ApiError>> + Unpin + Send,
    ) -> impl Stream<Item = Frame> + Send {
        let first = self.choice_chunk(
            ChunkDelta {
                role: Some("assistant"),
                content: Some(String::new()),
            },
            None,
            None,
        );
        let state = Chunks {
            pending: VecDeque::from([Frame::Chunk(Box::new(first))]),
            answer: self,
            events: Some(events),
        };
        futures::stream::unfold(state, |mut chunks| async move {
            loop {
                if let Some(frame) = chunks.pending.pop_front() {
                    return Some((frame, chunks));
                }
                let event = chunks.events.as_mut()?.next().await;
                chunks.on_event(event);
            }
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
        }
    }

    fn choice_chunk(
        &self,
        delta: ChunkDelta,
        logprobs: Option<ChoiceLogprobs>,
        finish_reason: Option<api::FinishReason>,
    ) -> ChatCompletionChunk {
        self.chunk(vec![ChunkChoice {
            index: 0,
            delta,
            logprobs,
            finish_reason,
        }])
    }
}

/// The state of one streamed answer: the engine's events still to read and the frames already
/// due. `events` becomes `None` once the engine has finished (dropping it), so the stream ends
/// when `pending` drains.
struct Chunks<S> {
    answer: Answer,
    events: Option<S>,
    pending: VecDeque<Frame>,
}

impl<S> Chunks<S> {
    /// Queues the frames that `event` calls for; `None` means the engine dropped the request
    /// without a final event.
    fn on_event(&mut self, event: Option<Result<Event, ApiError>>) {
        let answer = &self.answer;
        let (last, usage) = match event {
            Some(Ok(Event::Delta { text, logprobs, .. })) => {
                // An empty delta is the detokenizer holding back part of a character or a
                // possible stop string; only its log-probabilities are news.
                if text.is_empty() && logprobs.is_empty() {
                    return;
                }
                let logprobs = answer.tokenizer.as_ref().map(|tokenizer| ChoiceLogprobs {
                    content: logprobs::to_wire(tokenizer, &logprobs),
                });
                let delta = ChunkDelta {
                    role: None,
                    content: Some(text),
                };
                let chunk = answer.choice_chunk(delta, logprobs, None);
                self.pending.push_back(Frame::Chunk(Box::new(chunk)));
                return;
            }
            Some(Ok(Event::PromptLogprobs(_))) => return,
            Some(Ok(Event::Finished {
                reason,
                usage,
                error,
            })) => {
                let last = match finish_reason(reason, error) {
                    Ok(reason) => answer.choice_chunk(ChunkDelta::default(), None, Some(reason)),
                    Err(error) => error_chunk(answer, error),
                };
                (last, Some(usage))
            }
            Some(Err(error)) => (error_chunk(answer, error), None),
            None => (
                error_chunk(answer, ApiError::Internal(LOST_STREAM.into())),
                None,
            ),
        };
        self.pending.push_back(Frame::Chunk(Box::new(last)));
        if let Some(usage) = usage.filter(|_| answer.include_usage) {
            let mut chunk = answer.chunk(Vec::new());
            chunk.usage = Some(Some(usage_of(usage)));
            self.pending.push_back(Frame::Chunk(Box::new(chunk)));
        }
        self.pending.push_back(Frame::Done);
        self.events = None;
    }
}

/// The reason OpenAI reports, or the error a failed generation is.
pub(crate) fn finish_reason(
    reason: FinishReason,
    error: Option<String>,
) -> Result<api::FinishReason, ApiError> {
    match reason {
        FinishReason::Stop => Ok(api::FinishReason::Stop),
        FinishReason::Length => Ok(api::FinishReason::Length),
        FinishReason::Cancelled | FinishReason::Error => Err(ApiError::Generation(
            error.unwrap_or_else(|| reason.as_str().to_owned()),
        )),
    }
}

/// The chunk that ends a failed stream: `finish_reason: "error"` and the error's envelope body.
fn error_chunk(answer: &Answer, error: ApiError) -> ChatCompletionChunk {
    match &error {
        ApiError::Internal(detail) => tracing::error!(detail, "stream failed"),
        other => tracing::warn!(error = %other, "stream failed"),
    }
    let mut chunk =
        answer.choice_chunk(ChunkDelta::default(), None, Some(api::FinishReason::Error));
    chunk.error = Some(error.body());
    chunk
}

fn sse_response(frames: impl Stream<Item = Frame> + Send + 'static) -> Response {
    let events = frames.map(|frame| {
        Ok::<_, Infallible>(match frame {
            Frame::Chunk(chunk) => {
                // Chunks hold only strings, numbers and lists, which always serialize.
                let data = serde_json::to_string(&chunk).expect("a chunk serializes to JSON");
                SseEvent::default().data(data)
            }
            Frame::Done => SseEvent::default().data("[DONE]"),
        })
    });
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response();
    // Reverse proxies such as nginx buffer responses by default, which would hold tokens back
    // until the buffer fills.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

fn usage_of(usage: engine::Usage) -> Usage {
    Usage {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        total_tokens: usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: usage.cached_tokens,
        },
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use engine::TokenLogprob;
    use serde_json::{json, Value};

    use super::*;
    use crate::test_support::model_info;

    fn tokenizer() -> Arc<Tokenizer> {
        static MODEL: OnceLock<engine::ModelInfo> = OnceLock::new();
        MODEL.get_or_init(|| model_info(8192)).tokenizer.clone()
    }

    fn answer(logprobs: bool, include_usage: bool) -> Answer {
        Answer {
            id: "chatcmpl-test".into(),
            created: 1,
            model: "m".into(),
            tokenizer: logprobs.then(tokenizer),
            include_usage,
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

    /// The SSE payloads `events` turn into: chunks as JSON, then "[DONE]".
    async fn stream(answer: Answer, events: Vec<Event>) -> Vec<Value> {
        answer
            .frames(futures::stream::iter(events).map(Ok))
            .map(|frame| match frame {
                Frame::Chunk(chunk) => serde_json::to_value(&chunk).unwrap(),
                Frame::Done => json!("[DONE]"),
            })
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
        let completion = answer(true, false)
            .collect(futures::stream::iter(events).map(Ok))
            .await
            .unwrap();
        let choice = &completion.choices[0];
        assert_eq!(choice.message.content, "Hello world");
        assert_eq!(choice.finish_reason, api::FinishReason::Stop);
        assert_eq!(choice.logprobs.as_ref().unwrap().content[0].logprob, -0.25);
        assert_eq!(completion.usage.total_tokens, 13);
    }

    #[tokio::test]
    async fn collect_turns_failures_into_errors() {
        let events = vec![
            delta("Hi"),
            finished(FinishReason::Error, Some("deadline exceeded")),
        ];
        let error = answer(false, false)
            .collect(futures::stream::iter(events).map(Ok))
            .await
            .unwrap_err();
        assert!(matches!(&error, ApiError::Generation(m) if m == "deadline exceeded"));
        assert_eq!(
            error.status(),
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        );
        let error = answer(false, false)
            .collect(futures::stream::iter(vec![delta("Hi")]).map(Ok))
            .await
            .unwrap_err();
        assert!(matches!(error, ApiError::Internal(_)));
    }

    #[tokio::test]
    async fn a_timeout_mid_stream_ends_with_a_timeout_chunk() {
        let events = vec![
            Ok(delta("Hi")),
            Err(ApiError::Timeout("out of time")),
            Ok(delta("never sent")),
        ];
        let sent: Vec<Value> = answer(false, true)
            .frames(futures::stream::iter(events))
            .map(|frame| match frame {
                Frame::Chunk(chunk) => serde_json::to_value(&chunk).unwrap(),
                Frame::Done => json!("[DONE]"),
            })
            .collect()
            .await;
        assert_eq!(sent.len(), 4, "no usage chunk: the engine never finished");
        assert_eq!(sent[2]["choices"][0]["finish_reason"], "error");
        assert_eq!(sent[2]["error"]["code"], "timeout");
        assert_eq!(sent[3], "[DONE]");
    }
}

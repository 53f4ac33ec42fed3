//! The gRPC API (`proto/swarmgate/v1/inference.proto`): chat, whole or streamed, and the model
//! list, on a port of its own, answered by the same engine under the same rules as the HTTP API.
//!
//! A gRPC request is turned into the HTTP API's wire request and goes through [`validate_chat`],
//! so both APIs accept and refuse exactly the same requests, with the same messages. The
//! `From<ApiError> for Status` impl below is the one table from errors to gRPC codes, as
//! [`crate::error`] is for HTTP statuses.
//!
//! A call is admitted as an HTTP request is ([`crate::limits`]): the caller's rate, a seat in
//! the admission queue, tokens per minute, both deadlines and the metrics. Each connection
//! carries at most `grpc_max_concurrent_streams` calls at once, and a request message over the
//! HTTP API's body limit is refused.
//!
//! Invariant: as over HTTP, the engine's event stream is owned by the call (the unary
//! handler's future, or the response stream) and by nothing else; no task is spawned that holds
//! it. When a client cancels, tonic drops the call, which drops the stream, which cancels the
//! sequence and frees its KV blocks.
//!
//! A stream that fails after it has started ends with an error status, which gRPC sends after
//! the messages; unlike server-sent events, no chunk has to carry the error.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use engine::Event;
use futures::{Stream, StreamExt};
use tokenizers::Tokenizer;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic::{Code, Request, Response, Status};

use crate::api;
use crate::api::tools::{FunctionCall, ToolCall};
use crate::error::ApiError;
use crate::logprobs;
use crate::runs;
use crate::service::admission::Events;
use crate::service::choices::{finish_reason, LOST_STREAM};
use crate::service::warm_up::{self, WarmUp};
use crate::service::AppState;
use crate::tool_calls::{self, EnvelopeReader, Piece};
use crate::validate::structured::{self, Reply};
use crate::validate::{off_io, validate_chat};

/// The messages and service stubs generated from the proto, client included.
pub mod pb {
    tonic::include_proto!("swarmgate.v1");
}

use pb::inference_server::{Inference, InferenceServer};

/// Serves the gRPC API on an already bound listener until `shutdown` completes, then lets the
/// calls in flight finish. Request messages over the HTTP API's body limit are refused. Tests
/// bind `127.0.0.1:0` and pass their own shutdown.
pub async fn serve_on(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, model = %state.model_id(), "gRPC listening");
    }
    // Each chunk is a small write; Nagle's algorithm would hold it until the previous one is
    // acknowledged.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let limit = state.max_body_bytes();
    let streams = state.grpc_max_concurrent_streams();
    let service = InferenceServer::new(InferenceService { state }).max_decoding_message_size(limit);
    Server::builder()
        .max_concurrent_streams(Some(streams))
        .trace_fn(|request| tracing::info_span!("grpc", path = %request.uri().path()))
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// Answers `swarmgate.v1.Inference` calls with the shared state's engine.
struct InferenceService {
    state: AppState,
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::ChatChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for InferenceService {
    async fn chat(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<Response<pb::ChatResponse>, Status> {
        let (answer, events) = self.submit(request).await?;
        Ok(Response::new(answer.collect(events).await?))
    }

    type ChatStreamStream = ChunkStream;

    async fn chat_stream(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let (answer, events) = self.submit(request).await?;
        Ok(Response::new(Box::pin(answer.chunks(events))))
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.state
            .auth()
            .check(&request.metadata().clone().into_headers())?;
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::Model {
                id: self.state.model_id().to_owned(),
            }],
        }))
    }
}

impl InferenceService {
    /// Checks the caller's key (sent as `authorization: Bearer KEY` metadata), admits the call
    /// as the HTTP API admits a request (rate, seats, tokens, deadlines, metrics), validates
    /// `request` by the HTTP API's rules and hands it to the engine.
    async fn submit(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<(Answer, Events), ApiError> {
        let state = &self.state;
        let headers = request.metadata().clone().into_headers();
        let caller = state.auth().check(&headers)?;
        let admission = state.limits().admit(caller, Instant::now()).await?;
        let run = runs::run_key(caller, &headers, None)?;
        let limits = state.structured_limits(caller);
        let wire = wire_request(request.into_inner())?;
        let named = wire.model.clone();
        let model = state.model_named(named.as_deref());
        // Rendering and tokenizing a large request is heavy: on the blocking pool, as over HTTP.
        let validating = state.clone();
        let valid =
            off_io(move || validate_chat(wire, validating.model_named(named.as_deref()), &limits))
                .await?;
        structured::compile(model, &valid.structured, &limits).await?;
        let mut generate = valid.generate;
        generate.run = runs::turn(run.as_deref(), &valid.model);
        let warm_up = valid.messages.map(|messages| {
            let reply = valid.structured.reply.clone();
            WarmUp::chat(state, &admission, messages, reply, &generate, None)
        });
        let seats = admission.reserve(state, 1).await?;
        let events = admission
            .submit(state, &seats, valid.prompt_tokens, generate)
            .await?;
        let events = warm_up::after(events, warm_up);
        let reader = match valid.structured.reply {
            Reply::Envelope { json_response } => Some(EnvelopeReader::new(json_response)),
            Reply::Text => None,
        };
        let answer = Answer {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            model: valid.model,
            tokenizer: valid.logprobs.map(|_| model.tokenizer.clone()),
            reader,
        };
        Ok((answer, events))
    }
}

/// The HTTP API's request for the same chat. Streaming is the RPC's choice, so `stream` stays
/// unset: nothing in validation depends on it but `stream_options`, which gRPC has no use for.
fn wire_request(request: pb::ChatRequest) -> Result<api::ChatCompletionRequest, ApiError> {
    let messages = request
        .messages
        .into_iter()
        .map(|m| api::ChatMessage {
            role: m.role,
            content: Some(api::MessageContent::Text(m.content)),
            tool_calls: (!m.tool_calls.is_empty()).then(|| {
                m.tool_calls
                    .into_iter()
                    .map(|c| ToolCall {
                        id: c.id,
                        kind: "function".into(),
                        function: FunctionCall {
                            name: c.name,
                            arguments: c.arguments,
                        },
                    })
                    .collect()
            }),
            tool_call_id: (!m.tool_call_id.is_empty()).then_some(m.tool_call_id),
        })
        .collect();
    Ok(api::ChatCompletionRequest {
        tools: json_field("tools_json", request.tools_json)?,
        tool_choice: json_field("tool_choice_json", request.tool_choice_json)?,
        parallel_tool_calls: request.parallel_tool_calls,
        response_format: json_field("response_format_json", request.response_format_json)?,
        model: request.model,
        messages,
        logprobs: request.logprobs,
        top_logprobs: request.top_logprobs.map(i64::from),
        options: api::GenerationOptions {
            max_tokens: request.max_tokens.map(i64::from),
            temperature: request.temperature,
            top_p: request.top_p,
            top_k: request.top_k.map(i64::from),
            seed: request.seed,
            stop: (!request.stop.is_empty()).then_some(api::Stop::Many(request.stop)),
            presence_penalty: request.presence_penalty,
            frequency_penalty: request.frequency_penalty,
            min_p: request.min_p,
            repetition_penalty: request.repetition_penalty,
            ignore_eos: request.ignore_eos,
            priority: request.priority,
            swarmgate: json_field("agent_hints_json", request.agent_hints_json)?,
            ..api::GenerationOptions::default()
        },
        ..api::ChatCompletionRequest::default()
    })
}

/// A field that carries JSON, parsed as the HTTP API's field of the same name.
fn json_field<T: serde::de::DeserializeOwned>(
    param: &str,
    json: Option<String>,
) -> Result<Option<T>, ApiError> {
    json.map(|text| {
        serde_json::from_str(&text)
            .map_err(|e| ApiError::invalid(param, format!("{param} is not valid here: {e}")))
    })
    .transpose()
}

/// What the response, or every chunk, of one answer shares.
struct Answer {
    id: String,
    model: String,
    /// Set when the client asked for log-probabilities: turns token ids into text and bytes.
    tokenizer: Option<Arc<Tokenizer>>,
    /// Set when the answer is a tool-call envelope.
    reader: Option<EnvelopeReader>,
}

impl Answer {
    /// Waits for the whole generation and returns it as one response.
    async fn collect(self, mut events: Events) -> Result<pb::ChatResponse, ApiError> {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        while let Some(event) = events.next().await {
            match event? {
                Event::Delta {
                    text: delta,
                    logprobs: token_logprobs,
                    ..
                } => {
                    text.push_str(&delta);
                    logprobs.extend(self.logprobs(&token_logprobs));
                }
                // Chat never asks for the prompt's log-probabilities.
                Event::PromptLogprobs(_) => {}
                Event::Finished {
                    reason,
                    usage,
                    error,
                } => {
                    let mut finish_reason = proto_finish_reason(reason, error)?;
                    let mut tool_calls = Vec::new();
                    if let Some(reader) = &self.reader {
                        let complete = finish_reason != pb::FinishReason::Length;
                        let (content, calls) =
                            tool_calls::read_all(&text, reader.json_response(), complete);
                        text = content;
                        tool_calls = calls
                            .into_iter()
                            .map(|(id, name, arguments)| pb::ToolCall {
                                id,
                                name,
                                arguments,
                            })
                            .collect();
                        if !tool_calls.is_empty() && finish_reason == pb::FinishReason::Stop {
                            finish_reason = pb::FinishReason::ToolCalls;
                        }
                    }
                    return Ok(pb::ChatResponse {
                        id: self.id,
                        model: self.model,
                        text,
                        finish_reason: finish_reason.into(),
                        usage: Some(usage_of(usage)),
                        logprobs,
                        tool_calls,
                    });
                }
            }
        }
        Err(ApiError::Internal(LOST_STREAM.into()))
    }

    /// The answer as a stream of chunks, ending with the one that carries the finish reason and
    /// the usage, or with an error status. The returned stream owns `events`, and drops it as
    /// soon as the engine has finished.
    fn chunks(self, events: Events) -> impl Stream<Item = Result<pb::ChatChunk, Status>> + Send {
        futures::stream::unfold(
            (self, Some(events)),
            |(mut answer, mut events)| async move {
                loop {
                    let next = match events.as_mut()?.next().await {
                        Some(Ok(event)) => Some(event),
                        // A deadline passed: the error ends the stream.
                        Some(Err(e)) => return Some((Err(e.into()), (answer, None))),
                        None => None,
                    };
                    let chunk = match next {
                        // An empty delta is the detokenizer holding back part of a character or a
                        // possible stop string; only its log-probabilities are news.
                        Some(Event::Delta { text, logprobs, .. })
                            if !text.is_empty() || !logprobs.is_empty() =>
                        {
                            let logprobs = answer.logprobs(&logprobs);
                            match answer.reader.as_mut().map(|r| r.push(&text)) {
                                Some(pieces) if pieces.is_empty() && logprobs.is_empty() => {
                                    continue
                                }
                                Some(pieces) => Ok(answer.pieces_chunk(pieces, logprobs)),
                                None => Ok(answer.chunk(text, logprobs)),
                            }
                        }
                        Some(Event::Delta { .. } | Event::PromptLogprobs(_)) => continue,
                        Some(Event::Finished {
                            reason,
                            usage,
                            error,
                        }) => {
                            events = None;
                            proto_finish_reason(reason, error)
                                .map(|reason| {
                                    let complete = reason != pb::FinishReason::Length;
                                    let (rest, calls) = match answer.reader.as_mut() {
                                        Some(r) => (r.finish(complete), r.calls()),
                                        None => (Vec::new(), 0),
                                    };
                                    let reason = match reason {
                                        pb::FinishReason::Stop if calls > 0 => {
                                            pb::FinishReason::ToolCalls
                                        }
                                        other => other,
                                    };
                                    pb::ChatChunk {
                                        finish_reason: reason.into(),
                                        usage: Some(usage_of(usage)),
                                        ..answer.pieces_chunk(rest, Vec::new())
                                    }
                                })
                                .map_err(Status::from)
                        }
                        None => {
                            events = None;
                            Err(ApiError::Internal(LOST_STREAM.into()).into())
                        }
                    };
                    return Some((chunk, (answer, events)));
                }
            },
        )
    }

    fn chunk(&self, delta: String, logprobs: Vec<pb::TokenLogprob>) -> pb::ChatChunk {
        pb::ChatChunk {
            id: self.id.clone(),
            model: self.model.clone(),
            delta,
            logprobs,
            finish_reason: pb::FinishReason::Unspecified.into(),
            usage: None,
            tool_calls: Vec::new(),
        }
    }

    /// The chunk of what an envelope reader gave: content and pieces of calls.
    fn pieces_chunk(&self, pieces: Vec<Piece>, logprobs: Vec<pb::TokenLogprob>) -> pb::ChatChunk {
        let mut chunk = self.chunk(String::new(), logprobs);
        for piece in pieces {
            match piece {
                Piece::Content(text) => chunk.delta.push_str(&text),
                Piece::Call { index, id, name } => chunk.tool_calls.push(pb::ToolCallDelta {
                    index: index as u32,
                    id,
                    name,
                    arguments: String::new(),
                }),
                Piece::Arguments { index, fragment } => match chunk.tool_calls.last_mut() {
                    Some(last) if last.index == index as u32 => last.arguments.push_str(&fragment),
                    _ => chunk.tool_calls.push(pb::ToolCallDelta {
                        index: index as u32,
                        arguments: fragment,
                        ..pb::ToolCallDelta::default()
                    }),
                },
            }
        }
        chunk
    }

    /// The proto entries for `token_logprobs`; none unless the client asked.
    fn logprobs(&self, token_logprobs: &[engine::TokenLogprob]) -> Vec<pb::TokenLogprob> {
        let Some(tokenizer) = &self.tokenizer else {
            return Vec::new();
        };
        logprobs::to_wire(tokenizer, token_logprobs)
            .into_iter()
            .map(|lp| pb::TokenLogprob {
                token: lp.token,
                logprob: lp.logprob,
                bytes: lp.bytes.unwrap_or_default(),
                top_logprobs: lp
                    .top_logprobs
                    .into_iter()
                    .map(|top| pb::TopLogprob {
                        token: top.token,
                        logprob: top.logprob,
                        bytes: top.bytes.unwrap_or_default(),
                    })
                    .collect(),
            })
            .collect()
    }
}

/// The HTTP API's finish reason in the proto's terms, or the error a failed generation is.
fn proto_finish_reason(
    reason: engine::FinishReason,
    error: Option<String>,
) -> Result<pb::FinishReason, ApiError> {
    match finish_reason(reason, error)? {
        api::FinishReason::Stop => Ok(pb::FinishReason::Stop),
        api::FinishReason::Length => Ok(pb::FinishReason::Length),
        api::FinishReason::ToolCalls => Ok(pb::FinishReason::ToolCalls),
        // `finish_reason` returns a failed generation as an error; it names no reason `Error`.
        api::FinishReason::Error => Err(ApiError::Internal(
            "a failed generation was reported as finished".into(),
        )),
    }
}

fn usage_of(usage: engine::Usage) -> pb::Usage {
    // Token counts are bounded by the context window, far below u32::MAX.
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    pb::Usage {
        prompt_tokens: count(usage.prompt_tokens),
        completion_tokens: count(usage.completion_tokens),
        cached_tokens: count(usage.cached_tokens),
    }
}

/// The gRPC code of each error, the counterpart of [`ApiError::status`]. The message is the one
/// the HTTP envelope carries, so an internal error's detail goes to the logs only.
impl From<ApiError> for Status {
    fn from(error: ApiError) -> Self {
        let code = match &error {
            ApiError::InvalidRequest { .. } => Code::InvalidArgument,
            ApiError::ModelNotFound(_)
            | ApiError::AgentNotFound(_)
            | ApiError::ResponseNotFound { .. } => Code::NotFound,
            ApiError::Forbidden { .. } => Code::PermissionDenied,
            ApiError::Conflict { .. } => Code::FailedPrecondition,
            // Routing is tonic's over gRPC; these are named so that every variant has a code.
            ApiError::UnknownRoute { .. } | ApiError::MethodNotAllowed { .. } => {
                Code::Unimplemented
            }
            ApiError::MissingApiKey | ApiError::InvalidApiKey => Code::Unauthenticated,
            ApiError::PayloadTooLarge | ApiError::RateLimited { .. } => Code::ResourceExhausted,
            ApiError::Timeout(_) | ApiError::BodyTimeout(_) => Code::DeadlineExceeded,
            // UNAVAILABLE is the code gRPC clients retry, with backoff, by default.
            ApiError::Overloaded(_) | ApiError::Unavailable | ApiError::StoreUnavailable(_) => {
                Code::Unavailable
            }
            ApiError::Generation(_) | ApiError::Internal(_) => Code::Internal,
        };
        match &error {
            ApiError::Internal(detail) => tracing::error!(detail, "internal error"),
            ApiError::Generation(_) | ApiError::Overloaded(_) | ApiError::Unavailable => {
                tracing::warn!(%error, "gRPC call failed")
            }
            _ => tracing::debug!(%error, "gRPC call refused"),
        }
        Status::new(code, error.body().message)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use engine::{FinishReason, ModelInfo};

    use super::*;
    use crate::test_support::model_info;
    use crate::validate::structured::StructuredLimits;

    /// `events` as an admitted call's stream.
    fn admitted(events: Vec<Event>) -> Events {
        Box::pin(futures::stream::iter(events.into_iter().map(Ok)))
    }

    fn model() -> &'static ModelInfo {
        static MODEL: OnceLock<ModelInfo> = OnceLock::new();
        MODEL.get_or_init(|| model_info(8192))
    }

    fn answer(logprobs: bool) -> Answer {
        Answer {
            id: "chatcmpl-test".into(),
            model: "m".into(),
            tokenizer: logprobs.then(|| model().tokenizer.clone()),
            reader: None,
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

    async fn stream(answer: Answer, events: Vec<Event>) -> Vec<Result<pb::ChatChunk, Status>> {
        answer.chunks(admitted(events)).collect().await
    }

    #[tokio::test]
    async fn tool_calls_stream_and_collect() {
        let envelope = || Answer {
            reader: Some(EnvelopeReader::new(false)),
            ..answer(false)
        };
        let events = || {
            vec![
                delta(r#"{"tool_calls": [{"name": "f", "arguments": {"#),
                delta(r#""x": 1}}]}"#),
                finished(FinishReason::Stop, None),
            ]
        };
        let chunks: Vec<pb::ChatChunk> = stream(envelope(), events())
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(chunks[0].tool_calls[0].name, "f");
        assert!(chunks[0].tool_calls[0].id.starts_with("call_"));
        let arguments: String = chunks
            .iter()
            .flat_map(|c| c.tool_calls.iter().map(|t| t.arguments.clone()))
            .collect();
        assert_eq!(arguments, r#"{"x": 1}"#);
        assert!(
            chunks.iter().all(|c| c.delta.is_empty()),
            "no markup as text"
        );
        assert_eq!(
            chunks.last().unwrap().finish_reason,
            i32::from(pb::FinishReason::ToolCalls)
        );
        let whole = envelope().collect(admitted(events())).await.unwrap();
        assert_eq!(whole.text, "");
        assert_eq!(whole.tool_calls[0].arguments, r#"{"x": 1}"#);
        assert_eq!(whole.finish_reason, i32::from(pb::FinishReason::ToolCalls));
    }

    fn user(content: &str) -> pb::ChatMessage {
        pb::ChatMessage {
            role: "user".into(),
            content: content.into(),
            ..pb::ChatMessage::default()
        }
    }

    #[test]
    fn every_field_reaches_the_engine_request() {
        let request = pb::ChatRequest {
            model: Some("default".into()),
            messages: vec![user("Hi")],
            max_tokens: Some(7),
            temperature: Some(0.5),
            top_p: Some(0.25),
            top_k: Some(40),
            seed: Some(-3),
            stop: vec!["END".into()],
            presence_penalty: Some(0.125),
            frequency_penalty: Some(-0.5),
            min_p: Some(0.0625),
            repetition_penalty: Some(1.5),
            ignore_eos: Some(true),
            logprobs: Some(true),
            top_logprobs: Some(2),
            tools_json: Some(
                r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]"#
                    .into(),
            ),
            tool_choice_json: Some(r#""required""#.into()),
            parallel_tool_calls: Some(false),
            response_format_json: None,
            priority: Some(3),
            agent_hints_json: Some(r#"{"osl": 5}"#.into()),
        };
        let valid = validate_chat(
            wire_request(request).unwrap(),
            model(),
            &StructuredLimits::default(),
        )
        .unwrap();
        assert!(
            matches!(&valid.generate.response_format, engine::ResponseFormat::Lark(g) if g.starts_with("start: calls\n")),
            "tools reach the grammar"
        );
        let generate = valid.generate;
        let sampling = generate.sampling;
        assert_eq!(valid.model, model().id);
        assert_eq!(generate.max_tokens, 7);
        assert_eq!(
            (sampling.temperature, sampling.top_p, sampling.top_k),
            (0.5, 0.25, 40)
        );
        assert_eq!(sampling.seed, Some(-3i64 as u64));
        assert_eq!(generate.stop, ["END"]);
        assert_eq!(
            (sampling.presence_penalty, sampling.frequency_penalty),
            (0.125, -0.5)
        );
        assert_eq!((sampling.min_p, sampling.repetition_penalty), (0.0625, 1.5));
        assert!(generate.ignore_eos);
        assert_eq!(generate.logprobs, Some(2));
        assert_eq!(
            generate.priority, -3,
            "lower runs first: the engine's higher"
        );
        assert_eq!(generate.expected_output_tokens, Some(5));
        assert!(valid.prompt.contains("Hi"));
    }

    #[test]
    fn unset_fields_take_the_http_defaults() {
        let request = pb::ChatRequest {
            messages: vec![user("Hi")],
            ..pb::ChatRequest::default()
        };
        let grpc = validate_chat(
            wire_request(request).unwrap(),
            model(),
            &StructuredLimits::default(),
        )
        .unwrap();
        let http = validate_chat(
            serde_json::from_value(serde_json::json!({
                "messages": [{"role": "user", "content": "Hi"}]
            }))
            .unwrap(),
            model(),
            &StructuredLimits::default(),
        )
        .unwrap();
        assert_eq!(grpc.generate.sampling, http.generate.sampling);
        assert_eq!(grpc.generate.max_tokens, http.generate.max_tokens);
        assert_eq!(grpc.generate.stop, http.generate.stop);
        assert_eq!(grpc.logprobs, None);
        assert_eq!(grpc.prompt, http.prompt);
    }

    #[test]
    fn refusals_name_the_field_and_map_to_codes() {
        let refused = |request: pb::ChatRequest| {
            let error = validate_chat(
                wire_request(request).unwrap(),
                model(),
                &StructuredLimits::default(),
            )
            .unwrap_err();
            let param = error.body().param;
            (Status::from(error).code(), param)
        };
        let base = || pb::ChatRequest {
            messages: vec![user("Hi")],
            ..pb::ChatRequest::default()
        };
        assert_eq!(
            refused(pb::ChatRequest {
                temperature: Some(5.0),
                ..base()
            }),
            (Code::InvalidArgument, Some("temperature".into()))
        );
        assert_eq!(
            refused(pb::ChatRequest {
                max_tokens: Some(0),
                ..base()
            }),
            (Code::InvalidArgument, Some("max_tokens".into()))
        );
        assert_eq!(
            refused(pb::ChatRequest {
                stop: vec![String::new()],
                ..base()
            }),
            (Code::InvalidArgument, Some("stop".into()))
        );
        assert_eq!(
            refused(pb::ChatRequest {
                messages: vec![pb::ChatMessage {
                    role: "robot".into(),
                    content: "x".into(),
                    ..pb::ChatMessage::default()
                }],
                ..base()
            }),
            (Code::InvalidArgument, Some("messages[0].role".into()))
        );
        assert_eq!(
            refused(pb::ChatRequest {
                model: Some("gpt-4".into()),
                ..base()
            }),
            (Code::NotFound, Some("model".into()))
        );
    }

    #[test]
    fn errors_map_to_codes_and_hide_internal_detail() {
        let code = |e: ApiError| Status::from(e).code();
        assert_eq!(code(ApiError::Overloaded("x".into())), Code::Unavailable);
        assert_eq!(code(ApiError::Unavailable), Code::Unavailable);
        assert_eq!(code(ApiError::PayloadTooLarge), Code::ResourceExhausted);
        assert_eq!(code(ApiError::Generation("x".into())), Code::Internal);
        let status = Status::from(ApiError::Internal("/secret/path.gguf".into()));
        assert_eq!(status.code(), Code::Internal);
        assert!(!status.message().contains("secret"), "{status:?}");
    }

    #[tokio::test]
    async fn stream_skips_empty_deltas_and_ends_with_reason_and_usage() {
        let events = vec![
            delta("Hel"),
            delta(""),
            delta("lo"),
            finished(FinishReason::Length, None),
        ];
        let chunks: Vec<pb::ChatChunk> = stream(answer(false), events)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let deltas: Vec<&str> = chunks.iter().map(|c| c.delta.as_str()).collect();
        assert_eq!(deltas, ["Hel", "lo", ""]);
        assert!(chunks.iter().all(|c| c.id == "chatcmpl-test"));
        assert!(chunks[..2]
            .iter()
            .all(|c| c.usage.is_none() && c.finish_reason() == pb::FinishReason::Unspecified));
        assert_eq!(chunks[2].finish_reason(), pb::FinishReason::Length);
        assert_eq!(
            chunks[2].usage,
            Some(pb::Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: 4
            })
        );
    }

    #[tokio::test]
    async fn a_failure_mid_stream_ends_it_with_a_status() {
        let events = vec![
            delta("Hi"),
            finished(FinishReason::Error, Some("deadline exceeded")),
        ];
        let sent = stream(answer(false), events).await;
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0].as_ref().unwrap().delta, "Hi");
        let status = sent[1].as_ref().unwrap_err();
        assert_eq!(status.code(), Code::Internal);
        assert!(status.message().contains("deadline exceeded"), "{status:?}");

        let sent = stream(answer(false), vec![delta("Hi")]).await;
        assert_eq!(sent.len(), 2, "a lost engine stream still ends the call");
        assert_eq!(sent[1].as_ref().unwrap_err().code(), Code::Internal);
    }

    #[tokio::test]
    async fn logprobs_ride_on_their_chunks_even_without_text() {
        let hello = model().tokenizer.token_to_id("Hello").unwrap();
        let events = vec![
            Event::Delta {
                text: String::new(),
                tokens: vec![hello],
                logprobs: vec![engine::TokenLogprob {
                    token: hello,
                    logprob: -0.5,
                    top: vec![(hello, -0.5)],
                    scored: Vec::new(),
                }],
            },
            delta("Hello"),
            finished(FinishReason::Stop, None),
        ];
        let sent = stream(answer(true), events).await;
        let held = sent[0].as_ref().unwrap();
        assert_eq!(held.delta, "");
        assert_eq!(held.logprobs[0].token, "Hello");
        assert_eq!(held.logprobs[0].bytes, b"Hello");
        assert_eq!(held.logprobs[0].top_logprobs[0].logprob, -0.5);
        assert!(sent[1].as_ref().unwrap().logprobs.is_empty());
    }

    #[tokio::test]
    async fn collect_gathers_text_or_fails() {
        let events = vec![
            delta("Hello"),
            delta(" world"),
            finished(FinishReason::Stop, None),
        ];
        let response = answer(false).collect(admitted(events)).await.unwrap();
        assert_eq!(response.text, "Hello world");
        assert_eq!(response.finish_reason(), pb::FinishReason::Stop);
        assert_eq!(response.usage.unwrap().completion_tokens, 3);
        assert!(response.logprobs.is_empty());

        let events = vec![delta("Hi"), finished(FinishReason::Cancelled, None)];
        let error = answer(false).collect(admitted(events)).await.unwrap_err();
        assert!(matches!(error, ApiError::Generation(_)), "{error:?}");
    }
}

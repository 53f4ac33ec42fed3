//! OpenAI's Responses API: `POST /v1/responses` and the stored responses, `GET` and `DELETE
//! /v1/responses/{id}`.
//!
//! A request is answered as the chat request it amounts to ([`input`]): the same validation,
//! grammar (function tools, `text.format`), [`Admission`] (limits, deadlines, metrics) and
//! engine path as `POST /v1/chat/completions`, with one answer. Its text becomes output items
//! ([`output`]): a message with `output_text`, or `function_call` items when the answer is a
//! tool-call envelope. Non-streamed, the response object; streamed, server-sent events
//! `event: <type>` with `data` numbered by `sequence_number` from 0: `response.created`,
//! `response.in_progress`, each item's events, then `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut it, `response.failed` when generation
//! failed after the headers), with no `[DONE]` after it. As for chat, a failure before the
//! first token is still an error status.
//!
//! Stored responses ([`StoredResponses`], `store` defaults to `true`): once answered (streamed:
//! before the last event goes out), the response is kept in the [`crate::state::StateStore`] with the input it
//! answered, under its caller and id, so another API key never sees it, and in Redis with
//! `--redis`, so every replica does. `previous_response_id` puts that input and the response's
//! output before the request's input (its `instructions` are not carried over); unknown, it is a
//! 404. The store keeps a response `--session-ttl-secs` after its last use (0: nothing is
//! stored, `store` reads back `false`) and its input within `--session-max-bytes`, dropping the
//! oldest turns first ([`crate::service::responses::trim`]), as a session's history. A response that cannot be
//! stored fails its request with 503 `state_store_unavailable`, or ends its stream with
//! `response.failed` carrying that code: either way the client knows it was not kept.
//!
//! Not served here: the swarm's models (`model: "swarm"` is a 404 as any unknown model),
//! background responses (`background: true` is a 400), and tools other than functions.

mod input;
mod output;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::Json;
use futures::{stream, Stream, StreamExt};
use serde_json::{json, Value};

use crate::api::responses::{
    CreateResponse, DeletedResponse, FunctionTool, InputItem, Response, ResponseEvent,
    ResponseInput, ResponseStatus, ResponseStreamEvent, SequencedEvent, TextConfig, TextFormat,
};
use crate::api::unix_now;
use crate::api::{FinishReason, Frame};
use crate::auth::Caller;
use crate::error::{ApiError, GenerationErrors, StoredErrors};
use crate::http::chat::warned;
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::runs;
use crate::service::choices::{sse_events, Choices};
use crate::service::responses::StoredResponses;
use crate::service::warm_up::WarmUp;
use crate::service::AppState;
use crate::validate::structured;
use crate::validate::{off_io, validate_chat};
use output::{ended, failure, item_id, Batch, EventFormat, Output};

/// Creates a model response.
#[utoipa::path(post, path = "/v1/responses", tag = "generation",
    request_body = CreateResponse,
    params(("x-swarmgate-run-id" = Option<String>, Header, description = "The agent run (program) \
        this request is a turn of (1 to 256 printable ASCII characters), for run scheduling and \
        for keeping a tool-call turn's KV cache for its follow-up; without it, the session's \
        run (chat), or the `previous_response_id` chain's (responses).")),
    responses(
        (status = 200, description = "The response, or with `stream: true` server-sent events \
            (`event: <type>`, a `SequencedEvent` as `data`) ended by `response.completed`, \
            `response.incomplete` or `response.failed`, with no `[DONE]`.",
            content((Response = "application/json"),
                (ResponseStreamEvent = "text/event-stream"))),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(state): State<AppState>,
    admission: Admission,
    headers: HeaderMap,
    ApiJson(mut request): ApiJson<CreateResponse>,
) -> Result<HttpResponse, ApiError> {
    let responses = state.responses();
    let caller = admission.caller;
    let id = item_id("resp");
    // The run: the header's, else the chain's (which its first response started).
    let named = runs::run_key(caller, &headers, None)?;
    let (run, mut items) = match &request.previous_response_id {
        Some(previous_id) => {
            let previous = responses
                .get(caller, previous_id, Some("previous_response_id"))
                .await?;
            let chain = previous.run.clone();
            let run = chain.unwrap_or_else(|| runs::chain_key(caller, previous_id));
            (named.unwrap_or(run), previous.context()?)
        }
        None => (
            named.unwrap_or_else(|| runs::chain_key(caller, &id)),
            Vec::new(),
        ),
    };
    let first = items.len();
    let own = std::mem::replace(&mut request.input, ResponseInput::Items(Vec::new()));
    items.extend(input::items(own));
    let mut tools = request.tools.clone().unwrap_or_default();
    let chat = input::chat_request(&request, &mut tools, &items, first)?;

    let named = chat.model.clone();
    let model_info = state.model_named(named.as_deref());
    let limits = state.structured_limits(admission.caller);
    let validating = state.clone();
    let valid =
        off_io(move || validate_chat(chat, validating.model_named(named.as_deref()), &limits))
            .await
            .map_err(input::renamed)?;
    let warnings: Vec<String> = structured::compile(model_info, &valid.structured, &limits)
        .await
        .map_err(input::renamed)?
        .iter()
        .map(|w| input::renamed_warning(w))
        .collect();
    let mut generate = valid.generate;
    generate.run = runs::turn(Some(&run), &valid.model);
    let reply = &valid.structured.reply;
    let warm_up = valid
        .messages
        .map(|messages| WarmUp::chat(&state, &admission, messages, reply.clone(), &generate, None));
    let prompt = vec![(valid.prompt_tokens, generate)];
    let choices = Choices::submit(&state, &admission, prompt, 1, warm_up).await?;
    let store = request.store.unwrap_or(true) && responses.enabled();
    let template = template(id, request, tools, valid.model, store);
    let saving = store.then(|| Saving {
        responses: responses.clone(),
        caller,
        input: items,
        run,
    });

    if !valid.stream {
        let (collected, usage) = choices.collect().await?;
        let choice = &collected[0];
        let reason = choice.finish_reason.unwrap_or(FinishReason::Stop);
        let mut output = Output::new(&valid.structured.reply);
        output.push(&choice.text);
        output.finish(reason);
        let response = ended(&template, output.items(), reason, Some(usage));
        if let Some(saving) = saving {
            saving.save(&response).await?;
        }
        return Ok(warned(Json(response).into_response(), &warnings));
    }
    let format = EventFormat::new(template, &valid.structured.reply);
    let frames = choices.stream(format, state.metrics().clone()).await?;
    let events = frames.flat_map(|frame| {
        stream::iter(match frame {
            Frame::Chunk(Batch(events)) => events,
            Frame::Done => Vec::new(),
        })
    });
    Ok(warned(sse(saved(events, saving)), &warnings))
}

/// Returns a stored response.
#[utoipa::path(get, path = "/v1/responses/{id}", tag = "generation",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "The response, as it was answered.", body = Response),
        StoredErrors,
    ),
    security(("api_key" = [])))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let stored = state.responses().get(caller, &id, None).await?;
    Ok(Json(stored.response))
}

/// Deletes a stored response.
#[utoipa::path(delete, path = "/v1/responses/{id}", tag = "generation",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "The response is gone.", body = DeletedResponse),
        StoredErrors,
    ),
    security(("api_key" = [])))]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<DeletedResponse>, ApiError> {
    state.responses().delete(caller, &id).await?;
    Ok(Json(DeletedResponse {
        id,
        object: "response.deleted",
        deleted: true,
    }))
}

/// The response `request` gets before its output: what it echoes, `in_progress`.
fn template(
    id: String,
    request: CreateResponse,
    tools: Vec<FunctionTool>,
    model: String,
    store: bool,
) -> Response {
    let format = request
        .text
        .and_then(|text| text.format)
        .unwrap_or_else(|| TextFormat {
            kind: "text".into(),
            name: None,
            description: None,
            schema: None,
            strict: None,
        });
    Response {
        id,
        object: "response",
        created_at: unix_now(),
        status: ResponseStatus::InProgress,
        background: false,
        error: None,
        incomplete_details: None,
        instructions: request.instructions,
        max_output_tokens: request.max_output_tokens,
        metadata: request.metadata.unwrap_or_default(),
        model,
        output: Vec::new(),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        previous_response_id: request.previous_response_id,
        store,
        temperature: request.temperature.unwrap_or(1.0),
        text: TextConfig {
            format: Some(format),
        },
        tool_choice: request.tool_choice.unwrap_or_else(|| json!("auto")),
        tools,
        top_p: request.top_p.unwrap_or(1.0),
        truncation: "disabled",
        usage: None,
    }
}

/// `events` as server-sent events, numbered from 0.
fn sse(events: impl Stream<Item = ResponseEvent> + Send + 'static) -> HttpResponse {
    sse_events(events.enumerate().map(|(n, event)| {
        let numbered = SequencedEvent {
            event,
            sequence_number: n as u64,
        };
        // Events hold strings, numbers and JSON values only, which always serialize.
        let data = serde_json::to_value(&numbered).expect("an event serializes to JSON");
        let kind = data["type"].as_str().unwrap_or_default().to_owned();
        SseEvent::default().event(kind).data(data.to_string())
    }))
}

/// `events`, with the response stored (when `saving`) before the event that ends it completed
/// or incomplete; if it cannot be, that event becomes `response.failed` with the store's error.
fn saved(
    events: impl Stream<Item = ResponseEvent> + Send + 'static,
    mut saving: Option<Saving>,
) -> impl Stream<Item = ResponseEvent> + Send + 'static {
    events.then(move |event| {
        let save = match &event {
            ResponseEvent::Completed { .. } | ResponseEvent::Incomplete { .. } => saving.take(),
            _ => None,
        };
        async move {
            let (
                Some(saving),
                ResponseEvent::Completed { response } | ResponseEvent::Incomplete { response },
            ) = (save, &event)
            else {
                return event;
            };
            match saving.save(response).await {
                Ok(()) => event,
                Err(error) => {
                    tracing::error!(%error, "the response was not stored");
                    ResponseEvent::Failed {
                        response: Box::new(Response {
                            status: ResponseStatus::Failed,
                            error: Some(failure(error.body())),
                            ..(**response).clone()
                        }),
                    }
                }
            }
        }
    })
}

/// A response to store once answered: whose it is and the input it answered.
struct Saving {
    responses: StoredResponses,
    caller: Caller,
    input: Vec<InputItem>,
    run: String,
}

impl Saving {
    async fn save(self, response: &Response) -> Result<(), ApiError> {
        let Self {
            responses,
            caller,
            input,
            run,
        } = self;
        responses.put(caller, response, input, &run).await
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;
    use crate::api::responses::InputContent;
    use std::sync::Arc;

    use crate::config::ServeConfig;
    use crate::state::MemoryStore;

    fn responses(ttl_secs: u64) -> StoredResponses {
        let config = ServeConfig {
            session_ttl_secs: ttl_secs,
            ..ServeConfig::default()
        };
        StoredResponses::new(&config, Arc::new(MemoryStore::new()))
    }

    fn answered(text: &str) -> Response {
        let request: CreateResponse = serde_json::from_value(json!({"input": "Hi"})).unwrap();
        let template = template(item_id("resp"), request, Vec::new(), "m".into(), true);
        let mut output = Output::new(&structured::Reply::Text);
        output.push(text);
        output.finish(FinishReason::Stop);
        ended(&template, output.items(), FinishReason::Stop, None)
    }

    fn user(text: &str) -> InputItem {
        input::items(ResponseInput::Text(text.into())).remove(0)
    }

    #[tokio::test]
    async fn a_stored_response_continues_with_its_input_then_its_output() {
        let responses = responses(60);
        let alice = Caller::Anonymous;
        let response = answered("Hello, Alice.");
        responses
            .put(alice, &response, vec![user("I am Alice.")], "run")
            .await
            .unwrap();
        let stored = responses.get(alice, &response.id, None).await.unwrap();
        assert_eq!(stored.response, serde_json::to_value(&response).unwrap());
        let context = stored.context().unwrap();
        assert_eq!(context[0], user("I am Alice."));
        assert_eq!(context[1].role.as_deref(), Some("assistant"));
        let chat = input::chat_request(
            &serde_json::from_value(json!({"input": "x"})).unwrap(),
            &mut [],
            &context,
            2,
        )
        .unwrap();
        assert_eq!(chat.messages[1].role, "assistant");
        assert!(matches!(
            &chat.messages[1].content,
            Some(crate::api::MessageContent::Parts(parts))
                if parts[0].text.as_deref() == Some("Hello, Alice.")
        ));
        assert_eq!(
            context[1].content,
            Some(InputContent::Parts(vec![
                crate::api::responses::InputPart {
                    kind: "output_text".into(),
                    text: Some("Hello, Alice.".into())
                }
            ]))
        );

        responses.delete(alice, &response.id).await.unwrap();
        for result in [
            responses.get(alice, &response.id, None).await.map(drop),
            responses.delete(alice, &response.id).await,
        ] {
            assert!(matches!(result, Err(ApiError::ResponseNotFound { .. })));
        }
    }

    #[tokio::test]
    async fn responses_belong_to_their_caller_and_may_be_turned_off() {
        let responses_on = responses(60);
        let response = answered("Hi");
        responses_on
            .put(Caller::Anonymous, &response, Vec::new(), "run")
            .await
            .unwrap();
        let key = "sk-other".parse().unwrap();
        let auth = crate::auth::Auth::new(&[key], &[], true);
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer sk-other"));
        let other = auth.check(&headers).unwrap();
        let error = responses_on
            .get(other, &response.id, Some("previous_response_id"))
            .await
            .map(drop)
            .unwrap_err();
        assert_eq!(error.status(), axum::http::StatusCode::NOT_FOUND);
        assert_eq!(error.body().param.as_deref(), Some("previous_response_id"));
        assert!(responses_on.delete(other, &response.id).await.is_err());

        let off = responses(0);
        assert!(!off.enabled());
        off.put(Caller::Anonymous, &response, Vec::new(), "run")
            .await
            .unwrap();
        let error = off
            .get(
                Caller::Anonymous,
                &response.id,
                Some("previous_response_id"),
            )
            .await
            .map(drop)
            .unwrap_err();
        assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST);
    }
}

//! A response's output, built from the answer's text as it arrives ([`Output`]), and the
//! stream of events that announces it ([`EventFormat`]).
//!
//! The text is read as chat reads it: plain text is one message item; a tool-call envelope is
//! read by [`EnvelopeReader`], whose content opens (or extends) a message item and whose calls
//! each open a function-call item. Every item is announced when it opens
//! (`response.output_item.added`, and a message's `response.content_part.added`), grows by
//! deltas, and is closed before the next one opens (its totals, then
//! `response.output_item.done`), so the items' events never interleave. An answer that ends with
//! no item at all gets one empty message, so that every response has output.
//!
//! A whole response is built the same way, its events dropped: streamed or not, the same text
//! gives the same items.

use engine::TokenLogprob;
use serde::Serialize;

use crate::api::responses::{
    IncompleteDetails, InputTokensDetails, ItemStatus, OutputContent, OutputItem,
    OutputTokensDetails, Response, ResponseError, ResponseEvent, ResponseStatus, ResponseUsage,
};
use crate::api::{self, ErrorBody};
use crate::service::choices::{ChunkFormat, StreamChunk};
use crate::tool_calls::{EnvelopeReader, Piece};
use crate::validate::structured::Reply;

/// The output items of one answer, and whether the last one is still open.
pub(crate) struct Output {
    /// With a tool-call envelope: its reader.
    reader: Option<EnvelopeReader>,
    items: Vec<OutputItem>,
    open: bool,
}

impl Output {
    /// No output yet, the text to be read as `reply` says. Plain text has its message item open
    /// from the start (announced by [`Output::added`] with the opening events).
    pub(crate) fn new(reply: &Reply) -> Self {
        let mut output = Self {
            reader: None,
            items: Vec::new(),
            open: false,
        };
        match reply {
            Reply::Envelope { json_response } => {
                output.reader = Some(EnvelopeReader::new(*json_response))
            }
            Reply::Text => {
                output.open_message();
            }
        }
        output
    }

    /// Reads the answer's next `text`.
    pub(crate) fn push(&mut self, text: &str) -> Vec<ResponseEvent> {
        let pieces = match &mut self.reader {
            Some(reader) => reader.push(text),
            None => vec![Piece::Content(text.to_owned())],
        };
        self.read(pieces)
    }

    /// The answer ended with `reason`: the rest of an envelope, then every item closed (the
    /// last one `incomplete` unless the answer ended by itself).
    pub(crate) fn finish(&mut self, reason: api::FinishReason) -> Vec<ResponseEvent> {
        let complete = reason != api::FinishReason::Length;
        let rest = match &mut self.reader {
            Some(reader) => reader.finish(complete),
            None => Vec::new(),
        };
        let mut events = self.read(rest);
        if self.items.is_empty() {
            events.extend(self.open_message());
        }
        let status = match reason {
            api::FinishReason::Stop | api::FinishReason::ToolCalls => ItemStatus::Completed,
            api::FinishReason::Length | api::FinishReason::Error => ItemStatus::Incomplete,
        };
        events.extend(self.close(status));
        events
    }

    /// The items so far.
    pub(crate) fn items(&self) -> &[OutputItem] {
        &self.items
    }

    /// The events announcing item `index` as it opened: empty, a message with its empty part.
    pub(crate) fn added(&self, index: usize) -> Vec<ResponseEvent> {
        match &self.items[index] {
            OutputItem::Message { id, role, .. } => vec![
                ResponseEvent::OutputItemAdded {
                    output_index: index,
                    item: OutputItem::Message {
                        id: id.clone(),
                        status: ItemStatus::InProgress,
                        role,
                        content: Vec::new(),
                    },
                },
                ResponseEvent::ContentPartAdded {
                    item_id: id.clone(),
                    output_index: index,
                    content_index: 0,
                    part: text_part(String::new()),
                },
            ],
            OutputItem::FunctionCall {
                id, call_id, name, ..
            } => vec![ResponseEvent::OutputItemAdded {
                output_index: index,
                item: OutputItem::FunctionCall {
                    id: id.clone(),
                    call_id: call_id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                    status: ItemStatus::InProgress,
                },
            }],
        }
    }

    fn read(&mut self, pieces: Vec<Piece>) -> Vec<ResponseEvent> {
        let mut events = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Content(text) if text.is_empty() => {}
                Piece::Content(delta) => {
                    let in_message =
                        self.open && matches!(self.items.last(), Some(OutputItem::Message { .. }));
                    if !in_message {
                        events.extend(self.close(ItemStatus::Completed));
                        events.extend(self.open_message());
                    }
                    let output_index = self.items.len() - 1;
                    let Some(OutputItem::Message { id, content, .. }) = self.items.last_mut()
                    else {
                        unreachable!("a message was opened above");
                    };
                    let OutputContent::OutputText { text, .. } = &mut content[0];
                    text.push_str(&delta);
                    events.push(ResponseEvent::OutputTextDelta {
                        item_id: id.clone(),
                        output_index,
                        content_index: 0,
                        delta,
                        logprobs: Vec::new(),
                    });
                }
                Piece::Call { id, name, .. } => {
                    events.extend(self.close(ItemStatus::Completed));
                    self.items.push(OutputItem::FunctionCall {
                        id: item_id("fc"),
                        call_id: id,
                        name,
                        arguments: String::new(),
                        status: ItemStatus::InProgress,
                    });
                    self.open = true;
                    events.extend(self.added(self.items.len() - 1));
                }
                Piece::Arguments { fragment, .. } => {
                    let output_index = self.items.len().saturating_sub(1);
                    // The reader gives a call's arguments right after its start, so they belong
                    // to the open call.
                    if let (true, Some(OutputItem::FunctionCall { id, arguments, .. })) =
                        (self.open, self.items.last_mut())
                    {
                        arguments.push_str(&fragment);
                        events.push(ResponseEvent::FunctionCallArgumentsDelta {
                            item_id: id.clone(),
                            output_index,
                            delta: fragment,
                        });
                    }
                }
            }
        }
        events
    }

    fn open_message(&mut self) -> Vec<ResponseEvent> {
        self.items.push(OutputItem::Message {
            id: item_id("msg"),
            status: ItemStatus::InProgress,
            role: "assistant",
            content: vec![text_part(String::new())],
        });
        self.open = true;
        self.added(self.items.len() - 1)
    }

    /// Closes the open item, if any, as `status`.
    fn close(&mut self, status: ItemStatus) -> Vec<ResponseEvent> {
        if !std::mem::take(&mut self.open) {
            return Vec::new();
        }
        let output_index = self.items.len() - 1;
        let item = self.items.last_mut().expect("an open item exists");
        let mut events = match item {
            OutputItem::Message {
                id,
                status: own,
                content,
                ..
            } => {
                *own = status;
                let OutputContent::OutputText { text, .. } = &content[0];
                vec![
                    ResponseEvent::OutputTextDone {
                        item_id: id.clone(),
                        output_index,
                        content_index: 0,
                        text: text.clone(),
                        logprobs: Vec::new(),
                    },
                    ResponseEvent::ContentPartDone {
                        item_id: id.clone(),
                        output_index,
                        content_index: 0,
                        part: content[0].clone(),
                    },
                ]
            }
            OutputItem::FunctionCall {
                id,
                name,
                arguments,
                status: own,
                ..
            } => {
                *own = status;
                vec![ResponseEvent::FunctionCallArgumentsDone {
                    item_id: id.clone(),
                    output_index,
                    name: name.clone(),
                    arguments: arguments.clone(),
                }]
            }
        };
        events.push(ResponseEvent::OutputItemDone {
            output_index,
            item: item.clone(),
        });
        events
    }
}

fn text_part(text: String) -> OutputContent {
    OutputContent::OutputText {
        text,
        annotations: Vec::new(),
    }
}

/// A fresh id with `prefix` (`resp`, `msg`, `fc`).
pub(crate) fn item_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// `template` (the request's echo, `in_progress`, without output) as it ended: with `output`,
/// the status `reason` gives, and the counts.
pub(crate) fn ended(
    template: &Response,
    output: &[OutputItem],
    reason: api::FinishReason,
    usage: Option<api::Usage>,
) -> Response {
    let status = match reason {
        api::FinishReason::Stop | api::FinishReason::ToolCalls => ResponseStatus::Completed,
        api::FinishReason::Length => ResponseStatus::Incomplete,
        api::FinishReason::Error => ResponseStatus::Failed,
    };
    Response {
        status,
        incomplete_details: (status == ResponseStatus::Incomplete).then_some(IncompleteDetails {
            reason: "max_output_tokens",
        }),
        output: output.to_vec(),
        usage: usage.map(counts),
        ..template.clone()
    }
}

/// An error as a failed response carries it.
pub(crate) fn failure(error: ErrorBody) -> ResponseError {
    ResponseError {
        code: error.code.unwrap_or(error.kind),
        message: error.message,
    }
}

/// Chat's counts as the Responses API names them.
fn counts(usage: api::Usage) -> ResponseUsage {
    ResponseUsage {
        input_tokens: usage.prompt_tokens,
        input_tokens_details: InputTokensDetails {
            cached_tokens: usage.prompt_tokens_details.cached_tokens,
        },
        output_tokens: usage.completion_tokens,
        output_tokens_details: OutputTokensDetails::default(),
        total_tokens: usage.total_tokens,
    }
}

/// The events one update of the answer gives, sent in order.
#[derive(Debug, Serialize)]
#[serde(transparent)]
pub(crate) struct Batch(pub(crate) Vec<ResponseEvent>);

impl Batch {
    /// The response of the event that ends the stream (completed, incomplete or failed), when
    /// the batch holds it.
    pub(crate) fn ended_mut(&mut self) -> Option<&mut Response> {
        self.0.iter_mut().rev().find_map(|event| match event {
            ResponseEvent::Completed { response }
            | ResponseEvent::Incomplete { response }
            | ResponseEvent::Failed { response } => Some(&mut **response),
            _ => None,
        })
    }
}

impl StreamChunk for Batch {
    /// The failure goes on the `response.failed` event [`EventFormat::finished`] ended with.
    fn set_error(&mut self, error: ErrorBody) {
        if let Some(response) = self.ended_mut() {
            response.error = Some(failure(error));
        }
    }

    /// The counts go on the last event's response.
    fn set_usage(&mut self, usage: api::Usage) {
        if let Some(response) = self.ended_mut() {
            response.usage = Some(counts(usage));
        }
    }
}

/// The Responses API's stream of one answer, in the order the module header gives; the last
/// event, `response.completed` or `response.incomplete`, is the usage "chunk" (it comes once the
/// engine reported its counts), and a failure ends the stream with `response.failed` instead.
pub(crate) struct EventFormat {
    template: Response,
    output: Output,
    /// Set once the answer ended.
    reason: Option<api::FinishReason>,
}

impl EventFormat {
    pub(crate) fn new(template: Response, reply: &Reply) -> Self {
        Self {
            template,
            output: Output::new(reply),
            reason: None,
        }
    }
}

impl ChunkFormat for EventFormat {
    type Chunk = Batch;

    /// The last event, its response without counts yet.
    fn empty(&self) -> Batch {
        let reason = self.reason.unwrap_or(api::FinishReason::Stop);
        let response = Box::new(ended(&self.template, self.output.items(), reason, None));
        Batch(vec![match reason {
            api::FinishReason::Length => ResponseEvent::Incomplete { response },
            _ => ResponseEvent::Completed { response },
        }])
    }

    /// The last event carries the counts, unless the answer failed: `response.failed` ended it.
    fn include_usage(&self) -> bool {
        self.reason != Some(api::FinishReason::Error)
    }

    fn opening(&self, _: usize) -> Option<Batch> {
        let snapshot = || Box::new(self.template.clone());
        let mut events = vec![
            ResponseEvent::Created {
                response: snapshot(),
            },
            ResponseEvent::InProgress {
                response: snapshot(),
            },
        ];
        for index in 0..self.output.items().len() {
            events.extend(self.output.added(index));
        }
        Some(Batch(events))
    }

    fn prompt(&mut self, _: usize, _: &[TokenLogprob]) -> Option<Batch> {
        None
    }

    fn delta(&mut self, _: usize, text: String, _: &[TokenLogprob]) -> Option<Batch> {
        let events = self.output.push(&text);
        (!events.is_empty()).then_some(Batch(events))
    }

    fn finished(&mut self, _: usize, reason: api::FinishReason) -> Batch {
        self.reason = Some(reason);
        let mut events = self.output.finish(reason);
        if reason == api::FinishReason::Error {
            let response = ended(&self.template, self.output.items(), reason, None);
            events.push(ResponseEvent::Failed {
                response: Box::new(response),
            });
        }
        Batch(events)
    }
}

#[cfg(test)]
mod tests {
    use engine::{Event, FinishReason};
    use serde_json::{json, Value};

    use super::*;
    use crate::error::ApiError;
    use crate::metrics::Metrics;
    use crate::service::choices::tests::{choices_of, frames_json};

    fn template() -> Response {
        Response {
            id: "resp_1".into(),
            object: "response",
            created_at: 1,
            status: ResponseStatus::InProgress,
            background: false,
            error: None,
            incomplete_details: None,
            instructions: None,
            max_output_tokens: None,
            metadata: Default::default(),
            model: "m".into(),
            output: Vec::new(),
            parallel_tool_calls: true,
            previous_response_id: None,
            store: true,
            temperature: 1.0,
            text: Default::default(),
            tool_choice: json!("auto"),
            tools: Vec::new(),
            top_p: 1.0,
            truncation: "disabled",
            usage: None,
        }
    }

    fn delta(text: &str) -> Result<Event, ApiError> {
        Ok(Event::Delta {
            text: text.into(),
            tokens: vec![1],
            logprobs: Vec::new(),
        })
    }

    fn finished(reason: FinishReason) -> Result<Event, ApiError> {
        Ok(Event::Finished {
            reason,
            usage: engine::Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: 4,
            },
            error: (reason == FinishReason::Error).then(|| "it broke".into()),
        })
    }

    /// The events `events` of one answer stream as, flattened, each as JSON.
    async fn stream(reply: Reply, events: Vec<Result<Event, ApiError>>) -> Vec<Value> {
        let format = EventFormat::new(template(), &reply);
        let frames = choices_of(vec![events], 1).frames(format, None, Metrics::new());
        frames_json(frames)
            .await
            .into_iter()
            .filter(|frame| frame != "[DONE]")
            .flat_map(|batch| batch.as_array().unwrap().clone())
            .collect()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[tokio::test]
    async fn text_streams_as_one_message_item() {
        let events = stream(
            Reply::Text,
            vec![
                delta("Hel"),
                delta(""),
                delta("lo"),
                finished(FinishReason::Stop),
            ],
        )
        .await;
        assert_eq!(
            types(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(events[0]["response"]["status"], "in_progress");
        assert_eq!(events[0]["response"]["output"], json!([]));
        assert_eq!(events[2]["item"]["content"], json!([]));
        let id = events[2]["item"]["id"].as_str().unwrap();
        assert!(id.starts_with("msg_"));
        assert_eq!(events[4]["item_id"], id);
        assert_eq!(events[5]["delta"], "lo");
        assert_eq!(events[6]["text"], "Hello");
        assert_eq!(events[8]["item"]["status"], "completed");
        let response = &events[9]["response"];
        assert_eq!(response["status"], "completed");
        assert_eq!(response["output"][0], events[8]["item"]);
        assert_eq!(
            response["usage"],
            json!({
                "input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 13
            })
        );
    }

    #[tokio::test]
    async fn calls_stream_as_function_call_items() {
        let envelope = Reply::Envelope {
            json_response: false,
        };
        let events = stream(
            envelope,
            vec![
                delta("{\"tool_calls\": [{\"name\": \"f\", \"argu"),
                delta("ments\": {\"x\": "),
                delta("1}}, {\"name\": \"g\", \"arguments\": {}}]}"),
                finished(FinishReason::Stop),
            ],
        )
        .await;
        assert_eq!(
            types(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let call = &events[6]["item"];
        assert_eq!(call["name"], "f");
        assert_eq!(call["arguments"], "{\"x\": 1}");
        assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
        assert!(call["id"].as_str().unwrap().starts_with("fc_"));
        assert_eq!(events[5]["arguments"], "{\"x\": 1}");
        assert_eq!(events[7]["output_index"], 1);
        let output = &events[11]["response"]["output"];
        assert_eq!(output.as_array().unwrap().len(), 2);
        assert_eq!(output[1]["name"], "g");
    }

    #[tokio::test]
    async fn a_cut_answer_is_incomplete_and_a_failure_failed() {
        let events = stream(
            Reply::Text,
            vec![delta("Hi"), finished(FinishReason::Length)],
        )
        .await;
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(last["response"]["status"], "incomplete");
        assert_eq!(
            last["response"]["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(last["response"]["output"][0]["status"], "incomplete");

        let events = stream(
            Reply::Text,
            vec![delta("Hi"), finished(FinishReason::Error)],
        )
        .await;
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["response"]["status"], "failed");
        assert_eq!(last["response"]["error"]["code"], "server_error");
        assert!(last["response"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("it broke"));
        assert_eq!(
            types(&events)
                .iter()
                .filter(|t| t.starts_with("response.completed"))
                .count(),
            0,
            "a failed response does not also complete"
        );
    }

    #[test]
    fn an_envelope_with_a_response_is_a_message_and_an_empty_answer_still_has_one() {
        let mut output = Output::new(&Reply::Envelope {
            json_response: false,
        });
        output.push(r#"{"response": "Hi"}"#);
        output.finish(api::FinishReason::Stop);
        let [OutputItem::Message { content, .. }] = output.items() else {
            panic!("{:?}", output.items());
        };
        assert_eq!(content[0], text_part("Hi".into()));

        let mut output = Output::new(&Reply::Envelope {
            json_response: false,
        });
        let events = output.finish(api::FinishReason::Length);
        assert_eq!(output.items().len(), 1);
        assert_eq!(
            events.len(),
            5,
            "added, part added, text done, part done, item done"
        );
    }
}

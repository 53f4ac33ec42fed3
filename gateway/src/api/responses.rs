//! OpenAI's Responses API on the wire: `POST /v1/responses`, the response object it answers
//! with (also what `GET /v1/responses/{id}` returns), and the events of a streamed response.
//! Serde types only; [`crate::http::responses`] turns them into a chat request and back.
//!
//! As for chat, requests are lenient: unknown fields are ignored (so are `include`,
//! `truncation`, `reasoning`, `user`, `service_tier`, `prompt_cache_key`, which SDKs send),
//! kinds are strings so that validation can name an unknown one. Responses follow OpenAI's
//! shapes field for field, `null`s included: the SDKs read `output_text` out of `output`.
//!
//! Input items and output items are one family: an output item (a `message` with
//! `output_text` parts, a `function_call`) read back as an [`InputItem`] is the same turn, which
//! is how a stored response's output goes before the next request's input.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

// ---- requests ----

/// `POST /v1/responses`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[schema(example = json!({
    "model": "default",
    "input": "Say hello in French.",
    "max_output_tokens": 16
}))]
pub struct CreateResponse {
    /// The served model's id or `"default"`; absent means the served model.
    pub model: Option<String>,
    /// A user message's text, or a list of items.
    pub input: ResponseInput,
    /// A system message put before everything else (not carried over by
    /// `previous_response_id`).
    pub instructions: Option<String>,
    /// Functions the model may call, in the Responses API's flat shape.
    pub tools: Option<Vec<FunctionTool>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "name": ...}`; any JSON, so
    /// that validation can name what is wrong with it.
    pub tool_choice: Option<Value>,
    /// `false`: at most one call per response (default `true`).
    pub parallel_tool_calls: Option<bool>,
    /// The output's format: `{"format": {"type": "text" | "json_object" | "json_schema"}}`.
    pub text: Option<TextConfig>,
    #[schema(minimum = 1)]
    pub max_output_tokens: Option<i64>,
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Up to 16 string pairs, echoed on the response.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Server-sent events instead of one response.
    pub stream: Option<bool>,
    /// Keep the response for `GET /v1/responses/{id}` and `previous_response_id` (default
    /// `true`).
    pub store: Option<bool>,
    /// A stored response whose input and output go before this request's input.
    pub previous_response_id: Option<String>,
    /// Only `false`: every response is answered while the request waits.
    pub background: Option<bool>,
    /// vLLM's extension, as on chat: lower runs first (default 0).
    #[schema(minimum = -1000000, maximum = 1000000)]
    pub priority: Option<i64>,
    /// Agent hints, as on chat.
    pub swarmgate: Option<super::AgentHints>,
    /// The same hints under NVIDIA Dynamo's name.
    pub agent_hints: Option<super::AgentHints>,
}

/// `input`: a user message's text, or items.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ResponseInput {
    Text(String),
    Items(Vec<InputItem>),
}

/// One input item: a message (`type` absent or `"message"`), a `function_call` the model made
/// earlier, or a `function_call_output` answering one. One struct for all kinds, so that an
/// unknown kind is refused by validation with its field named.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema, PartialEq)]
pub struct InputItem {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// A message's: `user`, `system`, `developer` or `assistant`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// A message's text, or its parts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<InputContent>,
    /// A function call's, or the call a function's output answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// A function call's function.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A function call's arguments, a JSON text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
    /// A function's output: text, or parts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<InputContent>,
}

/// Text, or a list of typed parts.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema, PartialEq)]
#[serde(untagged)]
pub enum InputContent {
    Text(String),
    Parts(Vec<InputPart>),
}

/// One part of a content list: `input_text` or `output_text` (other kinds are refused by
/// validation, naming them).
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema, PartialEq)]
pub struct InputPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// A function the model may call: `{"type": "function", "name", "description", "parameters",
/// "strict"}`. Echoed as given on the response.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct FunctionTool {
    /// Only `"function"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub description: Option<String>,
    /// The arguments' JSON Schema; absent means an object with no properties.
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    /// As OpenAI's Responses API: `true` unless set to `false`.
    pub strict: Option<bool>,
}

/// `text`: the output's format.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema)]
pub struct TextConfig {
    pub format: Option<TextFormat>,
}

/// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema",
/// "description", "strict"}`.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct TextFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

// ---- responses ----

/// A model response: `POST /v1/responses` and `GET /v1/responses/{id}`.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Response {
    /// `resp_...`
    pub id: String,
    /// Always `"response"`.
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    pub status: ResponseStatus,
    /// Always `false`.
    pub background: bool,
    /// Set when the response failed.
    pub error: Option<ResponseError>,
    /// Set when the response is `incomplete`.
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub metadata: BTreeMap<String, String>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub store: bool,
    pub temperature: f64,
    pub text: TextConfig,
    /// As the request gave it, else `"auto"`.
    pub tool_choice: Value,
    pub tools: Vec<FunctionTool>,
    pub top_p: f64,
    /// Always `"disabled"`: an input too long for the context is a 400.
    pub truncation: &'static str,
    /// Set once the response has finished.
    pub usage: Option<ResponseUsage>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    InProgress,
    Completed,
    /// Cut by `max_output_tokens` (or the context window).
    Incomplete,
    /// Failed after the stream had started.
    Failed,
}

#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// Always `"max_output_tokens"`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct ResponseError {
    /// `server_error`, `timeout`, `state_store_unavailable`...
    pub code: &'static str,
    pub message: String,
}

/// One item of `output`.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The answer's text.
    Message {
        /// `msg_...`
        id: String,
        status: ItemStatus,
        /// Always `"assistant"`.
        role: &'static str,
        content: Vec<OutputContent>,
    },
    /// A call the model made.
    FunctionCall {
        /// `fc_...`
        id: String,
        /// `call_...`: what the `function_call_output` answering it names.
        call_id: String,
        name: String,
        /// A JSON text valid against the function's `parameters`.
        arguments: String,
        status: ItemStatus,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    InProgress,
    Completed,
    Incomplete,
}

/// A message's content part.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputContent {
    OutputText {
        text: String,
        /// Always empty.
        #[schema(value_type = Vec<Object>)]
        annotations: Vec<Value>,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct InputTokensDetails {
    /// Input tokens served from the prefix cache rather than computed.
    pub cached_tokens: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    /// Always 0: the served models do not reason apart from their answer.
    pub reasoning_tokens: usize,
}

/// `DELETE /v1/responses/{id}`.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct DeletedResponse {
    pub id: String,
    /// Always `"response.deleted"`.
    pub object: &'static str,
    /// Always `true`.
    pub deleted: bool,
}

// ---- stream events ----

/// One server-sent event of a streamed response, as the spec describes `text/event-stream`
/// bodies: `event` is the type its data carries, and `data` a [`SequencedEvent`] as JSON. The
/// server writes these with axum's SSE encoder.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[allow(dead_code)] // A description for the spec.
pub struct ResponseStreamEvent {
    pub event: String,
    pub data: String,
}

/// The data of one server-sent event of a streamed response: an event, numbered from 0 in the
/// order sent.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct SequencedEvent {
    #[serde(flatten)]
    pub event: ResponseEvent,
    pub sequence_number: u64,
}

/// What a streamed response sends, in this order: `response.created`, `response.in_progress`;
/// per output item, `response.output_item.added`, its content (a message's part, text deltas
/// and their totals; a call's argument deltas and their total), `response.output_item.done`;
/// last, `response.completed`, `response.incomplete` or `response.failed` with the whole
/// response.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(tag = "type")]
pub enum ResponseEvent {
    #[serde(rename = "response.created")]
    Created { response: Box<Response> },
    #[serde(rename = "response.in_progress")]
    InProgress { response: Box<Response> },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputContent,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        /// Always empty.
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        /// Always empty.
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputContent,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.completed")]
    Completed { response: Box<Response> },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: Box<Response> },
    #[serde(rename = "response.failed")]
    Failed { response: Box<Response> },
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn input_reads_text_items_and_output_items() {
        let request: CreateResponse = serde_json::from_value(json!({
            "input": "Hi", "include": ["x"], "truncation": "auto", "reasoning": {}
        }))
        .unwrap();
        assert!(matches!(request.input, ResponseInput::Text(t) if t == "Hi"));
        let items: Vec<InputItem> = serde_json::from_value(json!([
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
             "arguments": "{}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"}
        ]))
        .unwrap();
        assert_eq!(items[1].role.as_deref(), Some("assistant"));
        assert_eq!(
            items[1].content,
            Some(InputContent::Parts(vec![InputPart {
                kind: "output_text".into(),
                text: Some("Hello".into())
            }]))
        );
        assert_eq!(items[2].call_id.as_deref(), Some("call_1"));
        assert_eq!(items[3].output, Some(InputContent::Text("42".into())));
        assert_eq!(
            serde_json::to_value(&items[3]).unwrap(),
            json!({"type": "function_call_output", "call_id": "call_1", "output": "42"}),
            "what is stored holds only what was read"
        );
    }

    #[test]
    fn output_items_and_events_have_openai_shape() {
        let item = OutputItem::Message {
            id: "msg_1".into(),
            status: ItemStatus::Completed,
            role: "assistant",
            content: vec![OutputContent::OutputText {
                text: "Hi".into(),
                annotations: Vec::new(),
            }],
        };
        assert_eq!(
            serde_json::to_value(&item).unwrap(),
            json!({"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Hi", "annotations": []}]})
        );
        let event = SequencedEvent {
            event: ResponseEvent::FunctionCallArgumentsDelta {
                item_id: "fc_1".into(),
                output_index: 0,
                delta: "{".into(),
            },
            sequence_number: 3,
        };
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1",
                   "output_index": 0, "delta": "{", "sequence_number": 3})
        );
    }
}

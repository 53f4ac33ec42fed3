//! Wire types of function calling and structured outputs on chat completions: `tools`,
//! `tool_choice`, `response_format: json_schema`, and the tool calls of messages and answers.
//! Serde types only; [`crate::validate::structured`] decides what is acceptable.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
/// `{"type": "json_schema", "json_schema": {...}}`. The type is kept as a string so that an
/// unknown one is refused by validation, naming the field.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<JsonSchemaFormat>,
}

/// The schema of `response_format: json_schema`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema; absent means any JSON value.
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    /// `true`: a keyword that cannot be enforced is a 400. Otherwise it is dropped and named in
    /// the `x-swarmgate-schema-warnings` response header.
    pub strict: Option<bool>,
}

/// One entry of `tools`.
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema)]
pub struct Tool {
    /// Only `"function"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Option<FunctionDefinition>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, ToSchema)]
pub struct FunctionDefinition {
    /// 1 to 64 of `a-z A-Z 0-9 _ -`.
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON Schema; absent means an object with no properties.
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// A call the model made (in an answer) or made earlier (in an assistant message).
#[derive(Clone, Debug, Deserialize, Serialize, ToSchema, PartialEq)]
pub struct ToolCall {
    /// `call_...`
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, Deserialize, Serialize, ToSchema, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON string, valid against the tool's `parameters`.
    pub arguments: String,
}

/// A streamed piece of a tool call: the first carries `id`, `type` and the name, later ones
/// fragments of `arguments`.
#[derive(Clone, Debug, Serialize, ToSchema, PartialEq)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

#[derive(Clone, Debug, Serialize, ToSchema, PartialEq)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

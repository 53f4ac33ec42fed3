//! A Responses request as the chat request it amounts to, so that chat's validation, grammar
//! and prompt decide everything once ([`chat_request`]); chat's errors are then renamed to the
//! Responses fields ([`renamed`]).
//!
//! The input items, after a stored response's with `previous_response_id`, become messages in
//! order, after `instructions` as a system message:
//! - a message (`type` absent or `"message"`) keeps its role (`user`, `system`, `developer`,
//!   `assistant`); its `input_text` / `output_text` parts become text parts;
//! - a `function_call` becomes an assistant message with that tool call; consecutive calls are
//!   one message with several calls, as a chat answer that made them;
//! - a `function_call_output` becomes a `tool` message answering its `call_id`.
//!
//! Flat function tools become chat's nested ones (`strict` defaults to `true`, as in OpenAI's
//! Responses API), `text.format` becomes `response_format`, `max_output_tokens` becomes
//! `max_completion_tokens`. A kind chat has no counterpart for is a 400 naming its field here.
//!
//! Stored inputs are bounded by [`crate::service::responses::trim`], as a session's history is.

use crate::api::responses::{CreateResponse, FunctionTool, InputContent, InputItem, ResponseInput};
use crate::api::tools::{FunctionCall, FunctionDefinition, JsonSchemaFormat, Tool, ToolCall};
use crate::api::{
    ChatCompletionRequest, ChatMessage, ContentPart, GenerationOptions, MessageContent,
    ResponseFormat,
};
use crate::error::ApiError;

/// OpenAI's bound on `metadata`.
const MAX_METADATA_PAIRS: usize = 16;

/// The items `input` holds: a text is one user message.
pub(crate) fn items(input: ResponseInput) -> Vec<InputItem> {
    match input {
        ResponseInput::Text(text) => vec![InputItem {
            role: Some("user".into()),
            content: Some(InputContent::Text(text)),
            ..InputItem::default()
        }],
        ResponseInput::Items(items) => items,
    }
}

/// The chat request `request` amounts to with `items` as its input, of which the request's own
/// start at `first` (those before came from `previous_response_id`). `tools` are the request's,
/// given their default `strict` here (as the response echoes them).
pub(crate) fn chat_request(
    request: &CreateResponse,
    tools: &mut [FunctionTool],
    items: &[InputItem],
    first: usize,
) -> Result<ChatCompletionRequest, ApiError> {
    check_own_fields(request)?;
    let mut messages = Vec::with_capacity(items.len() + 1);
    if let Some(instructions) = &request.instructions {
        messages.push(ChatMessage {
            role: "system".into(),
            content: Some(MessageContent::Text(instructions.clone())),
            ..ChatMessage::default()
        });
    }
    messages.extend(chat_messages(items, first)?);
    let text_format = request.text.as_ref().and_then(|text| text.format.as_ref());
    Ok(ChatCompletionRequest {
        model: request.model.clone(),
        messages,
        max_completion_tokens: request.max_output_tokens,
        response_format: text_format.map(|format| ResponseFormat {
            kind: format.kind.clone(),
            json_schema: (format.kind == "json_schema").then(|| JsonSchemaFormat {
                name: format.name.clone(),
                description: format.description.clone(),
                schema: format.schema.clone(),
                strict: format.strict,
            }),
        }),
        tools: request
            .tools
            .is_some()
            .then(|| chat_tools(tools))
            .transpose()?,
        tool_choice: request.tool_choice.clone(),
        parallel_tool_calls: request.parallel_tool_calls,
        options: GenerationOptions {
            stream: request.stream,
            temperature: request.temperature,
            top_p: request.top_p,
            priority: request.priority,
            swarmgate: request.swarmgate.clone(),
            agent_hints: request.agent_hints.clone(),
            ..GenerationOptions::default()
        },
        ..ChatCompletionRequest::default()
    })
}

/// Checks the fields chat has no counterpart for (or a differently named one, whose error would
/// name chat's).
fn check_own_fields(request: &CreateResponse) -> Result<(), ApiError> {
    if let Some(n) = request.max_output_tokens.filter(|&n| n < 1) {
        return Err(ApiError::invalid(
            "max_output_tokens",
            format!("max_output_tokens must be at least 1; got {n}"),
        ));
    }
    if request.background == Some(true) {
        return Err(ApiError::invalid(
            "background",
            "background responses are not supported: every response is answered while the \
             request waits",
        ));
    }
    let metadata = request.metadata.as_ref();
    if metadata.is_some_and(|pairs| {
        pairs.len() > MAX_METADATA_PAIRS || pairs.iter().any(|(k, v)| k.len() > 64 || v.len() > 512)
    }) {
        return Err(ApiError::invalid(
            "metadata",
            format!(
                "metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of up to 64 \
                 characters and values of up to 512"
            ),
        ));
    }
    Ok(())
}

/// `items` as chat messages; see the module header. Fields of items before `first` are named
/// as `previous_response_id`, whose response they came from.
fn chat_messages(items: &[InputItem], first: usize) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages: Vec<ChatMessage> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = |name: &str| match i.checked_sub(first) {
            Some(j) => format!("input[{j}]{name}"),
            None => "previous_response_id".into(),
        };
        let required = |value: &Option<String>, name: &str| {
            value.clone().ok_or_else(|| {
                ApiError::invalid(
                    field(&format!(".{name}")),
                    format!("this item needs '{name}'"),
                )
            })
        };
        match item.kind.as_deref() {
            None | Some("message") => {
                let role = required(&item.role, "role")?;
                if !["user", "system", "developer", "assistant"].contains(&role.as_str()) {
                    return Err(ApiError::invalid(
                        field(".role"),
                        format!(
                            "role '{role}' is not one of 'user', 'system', 'developer', \
                             'assistant'"
                        ),
                    ));
                }
                let Some(content) = &item.content else {
                    return Err(ApiError::invalid(
                        field(".content"),
                        "a message needs content",
                    ));
                };
                messages.push(ChatMessage {
                    role,
                    content: Some(chat_content(content, &field(".content"))?),
                    ..ChatMessage::default()
                });
            }
            Some("function_call") => {
                let call = ToolCall {
                    id: required(&item.call_id, "call_id")?,
                    kind: "function".into(),
                    function: FunctionCall {
                        name: required(&item.name, "name")?,
                        arguments: required(&item.arguments, "arguments")?,
                    },
                };
                match messages.last_mut().and_then(|m| m.tool_calls.as_mut()) {
                    Some(calls) => calls.push(call),
                    None => messages.push(ChatMessage {
                        role: "assistant".into(),
                        tool_calls: Some(vec![call]),
                        ..ChatMessage::default()
                    }),
                }
            }
            Some("function_call_output") => {
                let call_id = required(&item.call_id, "call_id")?;
                let Some(output) = &item.output else {
                    return Err(ApiError::invalid(
                        field(".output"),
                        "a function_call_output needs 'output'",
                    ));
                };
                messages.push(ChatMessage {
                    role: "tool".into(),
                    content: Some(chat_content(output, &field(".output"))?),
                    tool_call_id: Some(call_id),
                    ..ChatMessage::default()
                });
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    field(".type"),
                    format!(
                        "input items of type '{other}' are not supported; only 'message', \
                         'function_call' and 'function_call_output'"
                    ),
                ))
            }
        }
    }
    Ok(messages)
}

/// `content` as chat content: text parts for the text kinds, a 400 naming `field` for others.
fn chat_content(content: &InputContent, field: &str) -> Result<MessageContent, ApiError> {
    let parts = match content {
        InputContent::Text(text) => return Ok(MessageContent::Text(text.clone())),
        InputContent::Parts(parts) => parts,
    };
    parts
        .iter()
        .enumerate()
        .map(|(j, part)| match part.kind.as_str() {
            "input_text" | "output_text" => Ok(ContentPart {
                kind: "text".into(),
                text: part.text.clone(),
            }),
            other => Err(ApiError::invalid(
                format!("{field}[{j}].type"),
                format!(
                    "content parts of type '{other}' are not supported; only 'input_text' and \
                     'output_text'"
                ),
            )),
        })
        .collect::<Result<_, _>>()
        .map(MessageContent::Parts)
}

/// The flat tools as chat's, each given its default `strict`.
fn chat_tools(tools: &mut [FunctionTool]) -> Result<Vec<Tool>, ApiError> {
    tools
        .iter_mut()
        .enumerate()
        .map(|(i, tool)| {
            if tool.kind != "function" {
                return Err(ApiError::invalid(
                    format!("tools[{i}].type"),
                    format!(
                        "tools of type '{}' are not supported; only 'function'",
                        tool.kind
                    ),
                ));
            }
            let Some(name) = tool.name.clone() else {
                return Err(ApiError::invalid(
                    format!("tools[{i}].name"),
                    "a function tool needs a 'name'",
                ));
            };
            let strict = *tool.strict.get_or_insert(true);
            Ok(Tool {
                kind: "function".into(),
                function: Some(FunctionDefinition {
                    name,
                    description: tool.description.clone(),
                    parameters: tool.parameters.clone(),
                    strict: Some(strict),
                }),
            })
        })
        .collect()
}

/// `error` with its field named as the Responses API names it (chat's validation names chat's).
pub(crate) fn renamed(error: ApiError) -> ApiError {
    match error {
        ApiError::InvalidRequest {
            message,
            param: Some(param),
        } => ApiError::InvalidRequest {
            message,
            param: Some(rename(&param)),
        },
        other => other,
    }
}

/// A schema warning (`"<field>: <what was dropped>"`) with its field renamed.
pub(crate) fn renamed_warning(warning: &str) -> String {
    match warning.split_once(": ") {
        Some((field, rest)) => format!("{}: {rest}", rename(field)),
        None => warning.to_owned(),
    }
}

/// A chat request's field as the Responses request's. Messages do not map one to one onto
/// items (instructions, merged calls), so any of them is `input`.
fn rename(param: &str) -> String {
    if param == "max_completion_tokens" {
        return "max_output_tokens".into();
    }
    if param.starts_with("messages") {
        return "input".into();
    }
    if let Some(rest) = param.strip_prefix("response_format") {
        let rest = rest.strip_prefix(".json_schema").unwrap_or(rest);
        return format!("text.format{rest}");
    }
    if param.starts_with("tools[") {
        return param.replacen(".function", "", 1);
    }
    param.to_owned()
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::service::responses::trim;

    fn request(body: Value) -> CreateResponse {
        serde_json::from_value(body).unwrap()
    }

    /// The chat request `body` amounts to, and the tools as echoed.
    fn converted(body: Value) -> Result<(ChatCompletionRequest, Vec<FunctionTool>), ApiError> {
        let request = request(body);
        let items = items(request.input.clone());
        let mut tools = request.tools.clone().unwrap_or_default();
        chat_request(&request, &mut tools, &items, 0).map(|chat| (chat, tools))
    }

    fn param(error: ApiError) -> String {
        match error {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("not a 400: {other:?}"),
        }
    }

    fn text(message: &ChatMessage) -> &str {
        match &message.content {
            Some(MessageContent::Text(text)) => text,
            other => panic!("not text: {other:?}"),
        }
    }

    #[test]
    fn a_string_input_is_a_user_message_after_the_instructions() {
        let (chat, _) = converted(json!({
            "model": "m", "input": "Hi", "instructions": "Be brief.",
            "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stream": true
        }))
        .unwrap();
        let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user"]);
        assert_eq!(
            (text(&chat.messages[0]), text(&chat.messages[1])),
            ("Be brief.", "Hi")
        );
        assert_eq!(chat.model.as_deref(), Some("m"));
        assert_eq!(chat.max_completion_tokens, Some(7));
        assert_eq!(chat.options.temperature, Some(0.5));
        assert_eq!(chat.options.top_p, Some(0.9));
        assert_eq!(chat.options.stream, Some(true));
    }

    #[test]
    fn items_become_messages_calls_and_tool_results() {
        let (chat, _) = converted(json!({"input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
            {"type": "function_call", "call_id": "call_a", "name": "w", "arguments": "{\"c\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_b", "name": "w", "arguments": "{\"c\":\"Rome\"}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b",
             "output": [{"type": "input_text", "text": "rain"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sun, rain."}]}
        ]}))
        .unwrap();
        let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "developer",
                "user",
                "assistant",
                "tool",
                "tool",
                "assistant"
            ],
            "the two calls are one assistant message"
        );
        let calls = chat.messages[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].id, "call_b");
        assert_eq!(calls[1].kind, "function");
        assert_eq!(
            calls[1].function,
            FunctionCall {
                name: "w".into(),
                arguments: "{\"c\":\"Rome\"}".into()
            }
        );
        assert!(chat.messages[2].content.is_none());
        assert_eq!(chat.messages[3].tool_call_id.as_deref(), Some("call_a"));
        assert_eq!(text(&chat.messages[3]), "sunny");
        assert!(matches!(
            &chat.messages[5].content,
            Some(MessageContent::Parts(parts))
                if parts[0].kind == "text" && parts[0].text.as_deref() == Some("Sun, rain.")
        ));
    }

    #[test]
    fn flat_tools_and_text_format_become_chat_s() {
        let (chat, echoed) = converted(json!({
            "input": "Hi",
            "tools": [{"type": "function", "name": "f", "description": "d",
                       "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "s",
                                "schema": {"type": "object"}, "strict": true}}
        }))
        .unwrap();
        let tool = &chat.tools.as_ref().unwrap()[0];
        assert_eq!(tool.kind, "function");
        let function = tool.function.as_ref().unwrap();
        assert_eq!(function.name, "f");
        assert_eq!(function.description.as_deref(), Some("d"));
        assert_eq!(function.parameters, Some(json!({"type": "object"})));
        assert_eq!(function.strict, Some(true), "strict by default");
        assert_eq!(echoed[0].strict, Some(true), "and echoed so");
        assert_eq!(
            chat.tool_choice,
            Some(json!({"type": "function", "name": "f"}))
        );
        assert_eq!(chat.parallel_tool_calls, Some(false));
        let format = chat.response_format.unwrap();
        assert_eq!(format.kind, "json_schema");
        let schema = format.json_schema.unwrap();
        assert_eq!(schema.name.as_deref(), Some("s"));
        assert_eq!(schema.strict, Some(true));
        let (chat, _) =
            converted(json!({"input": "Hi", "text": {"format": {"type": "json_object"}}})).unwrap();
        assert!(chat.response_format.unwrap().json_schema.is_none());
    }

    #[test]
    fn what_chat_cannot_take_is_a_400_naming_the_field() {
        let cases = [
            (
                json!({"input": "Hi", "tools": [{"type": "function", "name": "f"},
                                                 {"type": "web_search"}]}),
                "tools[1].type",
            ),
            (
                json!({"input": "Hi", "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
            (json!({"input": [{"type": "reasoning"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "tool", "content": "x"}]}),
                "input[0].role",
            ),
            (json!({"input": [{"role": "user"}]}), "input[0].content"),
            (
                json!({"input": [{"role": "user", "content": [
                    {"type": "input_text", "text": "x"}, {"type": "input_image"}]}]}),
                "input[0].content[1].type",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}),
                "input[0].arguments",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "input[0].output",
            ),
            (
                json!({"input": "Hi", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (json!({"input": "Hi", "background": true}), "background"),
            (
                json!({"input": "Hi", "metadata": {"k": "v".repeat(513)}}),
                "metadata",
            ),
        ];
        for (body, field) in cases {
            assert_eq!(param(converted(body.clone()).unwrap_err()), field, "{body}");
        }
        // Items of a stored response are named by the field that brought them.
        let bad = [InputItem {
            kind: Some("reasoning".into()),
            ..InputItem::default()
        }];
        let error = chat_messages(&bad, 1).unwrap_err();
        assert_eq!(param(error), "previous_response_id");
    }

    #[test]
    fn chat_s_fields_are_renamed() {
        for (chat, responses) in [
            ("max_completion_tokens", "max_output_tokens"),
            ("messages[3].tool_call_id", "input"),
            ("response_format.json_schema.name", "text.format.name"),
            ("response_format.type", "text.format.type"),
            ("response_format", "text.format"),
            ("tools[2].function.parameters", "tools[2].parameters"),
            ("temperature", "temperature"),
        ] {
            assert_eq!(param(renamed(ApiError::invalid(chat, "x"))), responses);
        }
        assert_eq!(
            renamed_warning("tools[0].function.parameters: dropped 'not'"),
            "tools[0].parameters: dropped 'not'"
        );
    }

    fn message(role: &str, text: &str) -> InputItem {
        InputItem {
            role: Some(role.into()),
            content: Some(InputContent::Text(text.into())),
            ..InputItem::default()
        }
    }

    fn call(id: &str) -> InputItem {
        InputItem {
            kind: Some("function_call".into()),
            call_id: Some(id.into()),
            name: Some("f".into()),
            arguments: Some("{}".into()),
            ..InputItem::default()
        }
    }

    #[test]
    fn trimming_drops_whole_turns_and_keeps_the_opening() {
        let items = vec![
            message("developer", "rules"),
            message("user", "one"),
            call("c1"),
            message("user", "two"),
            message("assistant", "2"),
            message("user", "three"),
        ];
        let size = |items: &[InputItem]| -> usize {
            items
                .iter()
                .map(|i| serde_json::to_string(i).unwrap().len())
                .sum()
        };
        let mut whole = items.clone();
        trim(&mut whole, size(&items));
        assert_eq!(whole, items, "within the cap: untouched");

        let mut trimmed = items.clone();
        trim(&mut trimmed, size(&items) - 1);
        assert_eq!(
            trimmed,
            [&items[..1], &items[3..]].concat(),
            "the first turn goes with its call"
        );

        let mut tiny = items.clone();
        trim(&mut tiny, 1);
        assert_eq!(
            tiny,
            [items[0].clone(), items[5].clone()],
            "the opening and the last turn stay"
        );
    }
}

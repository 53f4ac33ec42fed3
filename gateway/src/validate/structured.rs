//! Structured outputs and function calling: `response_format`, `tools`, `tool_choice` and
//! `parallel_tool_calls` checked and turned into the grammar the engine enforces
//! ([`engine::ResponseFormat`]) and, with tools, the instructions the model reads.
//!
//! Tools use a generic format, for every model (the served models' chat templates have no tool
//! syntax of their own): the system prompt lists the functions with their JSON schemas, and
//! the answer is constrained from its first token to one JSON envelope,
//! `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` or `{"response": ...}`, with a
//! fixed layout, so [`crate::tool_calls::EnvelopeReader`] can turn it back into OpenAI's shapes
//! while it streams. `tool_choice` picks the alternatives the grammar offers:
//! - `none`: a response only (the instructions are `auto`'s, so that a run's last turn, sent
//!   with `none`, shares its prompt's prefix, and its KV cache, with the turns before);
//! - `auto` (the default with tools): a call or a response;
//! - `required`: one or more calls;
//! - a named function: exactly one call, of that function (OpenAI's "forced function");
//! - `parallel_tool_calls: false`: exactly one call instead of one or more.
//!
//! The response alternative is a JSON string, or the `response_format` schema's value when
//! there is one. Every call's arguments follow its tool's `parameters` schema.
//!
//! Strictness: a schema keyword llguidance cannot enforce is a 400 naming it when the schema
//! is `strict: true`; otherwise it is dropped and reported in the `x-swarmgate-schema-warnings`
//! header. Each schema is compiled on its own first (so that an error names its field), then
//! the whole grammar; compiled grammars are cached, so an agent's repeated requests pay once.
//!
//! Bounds ([`StructuredLimits`]): tools per request, a schema's size and nesting depth, and
//! the time compiling may take; past one, a 400 naming the field. The same struct carries the
//! bound on tokens to generate ([`super::MaxTokens`]), so every caller of
//! [`super::validate_chat`] applies the operator's limits by passing one value.

use std::time::Duration;

use engine::{ChatMessage, ModelInfo, ResponseFormat};
use serde_json::{json, Value};

use crate::api::{self, tools::ToolCall, ChatCompletionRequest, MessageContent};
use crate::error::ApiError;

/// The prefix of an answer that calls tools.
pub const CALLS_OPEN: &str = "{\"tool_calls\": [";
/// The prefix of an answer that does not.
pub const RESPONSE_OPEN: &str = "{\"response\": ";

/// Most calls in one answer when parallel calls are allowed: a small model that may always
/// add one more call would otherwise repeat itself until `max_tokens` cuts the last call.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// Bounds on what a chat request may ask: of the grammar compiler (tools, schemas), and of the
/// engine (tokens to generate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StructuredLimits {
    /// The operator's bound and default for `max_tokens`.
    pub max_tokens: super::MaxTokens,
    pub max_tools: usize,
    /// A schema's size as compact JSON.
    pub max_schema_bytes: usize,
    /// Nesting of objects and arrays in a schema.
    pub max_schema_depth: usize,
    /// How long compiling one request's grammars may take.
    pub compile_timeout: Duration,
    /// Of scheduling and caching hints.
    pub hints: super::HintLimits,
}

impl Default for StructuredLimits {
    fn default() -> Self {
        Self {
            max_tokens: super::MaxTokens::default(),
            max_tools: 128,
            max_schema_bytes: 64 * 1024,
            max_schema_depth: 32,
            compile_timeout: Duration::from_secs(2),
            hints: super::HintLimits::default(),
        }
    }
}

/// How the answer's text becomes OpenAI's message.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Reply {
    /// The text is the content.
    #[default]
    Text,
    /// The text is a tool-call envelope; `json_response`: its response alternative is a JSON
    /// value (a `response_format` schema's) rather than a string.
    Envelope { json_response: bool },
}

/// A request's structured part, checked.
#[derive(Clone, Debug, Default)]
pub struct Structured {
    /// What the engine enforces.
    pub format: ResponseFormat,
    pub reply: Reply,
    /// Tool instructions for the system prompt.
    pub instructions: Option<String>,
    /// Each schema with the field it came from, compiled alone for precise errors.
    pub schemas: Vec<(String, ResponseFormat)>,
}

/// One function the model may call.
struct Function {
    name: String,
    description: Option<String>,
    parameters: Value,
    strict: bool,
}

/// Which alternatives the answer may take.
#[derive(Clone, Debug, PartialEq)]
enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// Checks the structured fields of `request`.
pub fn structured(
    request: &ChatCompletionRequest,
    limits: &StructuredLimits,
) -> Result<Structured, ApiError> {
    let response = response_format(request, limits)?;
    let functions = functions(request.tools.as_deref().unwrap_or_default(), limits)?;
    let choice = tool_choice(request.tool_choice.as_ref(), &functions)?;
    if functions.is_empty() {
        let schemas = match &response {
            f @ ResponseFormat::JsonSchema { .. } => vec![("response_format".into(), f.clone())],
            _ => Vec::new(),
        };
        return Ok(Structured {
            format: response,
            schemas,
            ..Structured::default()
        });
    }
    let parallel =
        request.parallel_tool_calls.unwrap_or(true) && !matches!(choice, Choice::Named(_));
    let mut schemas = Vec::new();
    for (i, f) in functions.iter().enumerate() {
        schemas.push((
            format!("tools[{i}].function.parameters"),
            ResponseFormat::JsonSchema {
                schema: f.parameters.clone(),
                strict: f.strict,
            },
        ));
    }
    let (json_response, value) = match &response {
        ResponseFormat::JsonSchema { schema, strict } => {
            schemas.push((
                "response_format".into(),
                ResponseFormat::JsonSchema {
                    schema: schema.clone(),
                    strict: *strict,
                },
            ));
            (true, engine::constraint::lark_json(schema, !strict))
        }
        ResponseFormat::JsonObject => (
            true,
            engine::constraint::lark_json(&json!({"type": "object"}), false),
        ),
        _ => (
            false,
            engine::constraint::lark_json(&json!({"type": "string"}), false),
        ),
    };
    let callable: Vec<(usize, &Function)> = functions
        .iter()
        .enumerate()
        .filter(|(_, f)| match &choice {
            Choice::Named(name) => &f.name == name,
            _ => true,
        })
        .collect();
    let grammar = envelope_grammar(&callable, &choice, parallel, &value);
    Ok(Structured {
        format: ResponseFormat::Lark(grammar),
        reply: Reply::Envelope { json_response },
        instructions: Some(instructions(&functions, &choice, parallel, json_response)),
        schemas,
    })
}

/// The Lark grammar of the envelope, with the alternatives `choice` allows.
fn envelope_grammar(
    callable: &[(usize, &Function)],
    choice: &Choice,
    parallel: bool,
    response_value: &str,
) -> String {
    let lit = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let reply = matches!(choice, Choice::Auto | Choice::None);
    let mut g = String::new();
    g.push_str(match choice {
        Choice::None => "start: reply\n",
        Choice::Auto => "start: calls | reply\n",
        Choice::Required | Choice::Named(_) => "start: calls\n",
    });
    if !matches!(choice, Choice::None) {
        let more = if parallel { " more_1" } else { "" };
        g.push_str(&format!(
            "calls: {} call{more} {}\n",
            lit(CALLS_OPEN),
            lit("]}")
        ));
        if parallel {
            // `more_k`: optionally a (k+1)th call, up to MAX_PARALLEL_CALLS in all.
            for k in 1..MAX_PARALLEL_CALLS {
                let next = if k + 1 < MAX_PARALLEL_CALLS {
                    format!(" more_{}", k + 1)
                } else {
                    String::new()
                };
                g.push_str(&format!("more_{k}: ({} call{next})?\n", lit(", ")));
            }
        }
        let alternatives: Vec<String> = callable.iter().map(|(i, _)| format!("call_{i}")).collect();
        g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
        for (i, f) in callable {
            let open = format!("{{\"name\": \"{}\", \"arguments\": ", f.name);
            g.push_str(&format!("call_{i}: {} args_{i} {}\n", lit(&open), lit("}")));
            g.push_str(&format!(
                "args_{i}: {}\n",
                engine::constraint::lark_json(&f.parameters, !f.strict)
            ));
        }
    }
    if reply {
        g.push_str(&format!(
            "reply: {} reply_value {}\nreply_value: {response_value}\n",
            lit(RESPONSE_OPEN),
            lit("}")
        ));
    }
    g
}

/// What the system prompt tells the model about its tools. `auto` and `none` share their text
/// (the grammar alone keeps `none` from calling), so that an agent that ends its run with
/// `none` finds its earlier turns' prefix in the cache; a forced call is asked for in words
/// too, which a small model needs to make one call rather than repeat it.
fn instructions(functions: &[Function], choice: &Choice, parallel: bool, json: bool) -> String {
    let mut text = String::from("You can call these functions:\n");
    for f in functions {
        let mut entry = json!({"name": f.name, "parameters": f.parameters});
        if let Some(d) = &f.description {
            entry["description"] = json!(d);
        }
        text.push_str(&entry.to_string());
        text.push('\n');
    }
    let call = if parallel {
        "{\"tool_calls\": [{\"name\": \"<function name>\", \"arguments\": {<arguments>}}]} \
         (list several calls only when several different calls are needed)"
    } else {
        "{\"tool_calls\": [{\"name\": \"<function name>\", \"arguments\": {<arguments>}}]}"
    };
    match choice {
        Choice::Named(name) => text.push_str(&format!(
            "Call the function {name}. Answer with JSON only: {call}"
        )),
        Choice::Required => text.push_str(&format!(
            "Call one of these functions. Answer with JSON only: {call}"
        )),
        Choice::Auto | Choice::None => {
            let reply = if json {
                "{\"response\": <your answer as JSON>}"
            } else {
                "{\"response\": \"<your answer>\"}"
            };
            text.push_str(&format!(
                "To call functions, answer with JSON only: {call}\nTo answer without calling a \
                 function, answer with JSON only: {reply}"
            ))
        }
    }
    text
}

/// The tool instructions joined to the conversation's system message (or a new one first).
pub fn instruct(messages: &mut Vec<ChatMessage>, instructions: &str) {
    match messages.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{instructions}", first.content);
        }
        _ => messages.insert(0, ChatMessage::new("system", instructions)),
    }
}

fn response_format(
    request: &ChatCompletionRequest,
    limits: &StructuredLimits,
) -> Result<ResponseFormat, ApiError> {
    let Some(format) = &request.response_format else {
        return Ok(ResponseFormat::Text);
    };
    match format.kind.as_str() {
        "text" => Ok(ResponseFormat::Text),
        "json_object" => {
            if !mentions_json(&request.messages) {
                return Err(ApiError::invalid(
                    "messages",
                    "'messages' must contain the word 'json' in some form, to use \
                     'response_format' of type 'json_object'.",
                ));
            }
            Ok(ResponseFormat::JsonObject)
        }
        "json_schema" => {
            let Some(spec) = &format.json_schema else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "response_format of type 'json_schema' needs a 'json_schema' object",
                ));
            };
            match &spec.name {
                Some(name) if valid_name(name) => {}
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "json_schema.name must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'",
                    ))
                }
            }
            let schema = spec.schema.clone().unwrap_or_else(|| json!({}));
            check_schema("response_format.json_schema.schema", &schema, limits)?;
            Ok(ResponseFormat::JsonSchema {
                schema,
                strict: spec.strict.unwrap_or(false),
            })
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "response_format type {other:?} is not supported; use \"text\", \
                 \"json_object\" or \"json_schema\""
            ),
        )),
    }
}

fn mentions_json(messages: &[api::ChatMessage]) -> bool {
    messages.iter().any(|m| {
        let text = match &m.content {
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.text.clone())
                .collect::<Vec<_>>()
                .join(" "),
            None => String::new(),
        };
        text.to_ascii_lowercase().contains("json")
    })
}

/// OpenAI's rule for function and schema names.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A schema must be an object (or a boolean), and within the size and depth bounds.
fn check_schema(param: &str, schema: &Value, limits: &StructuredLimits) -> Result<(), ApiError> {
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be a JSON Schema object"),
        ));
    }
    let bytes = schema.to_string().len();
    if bytes > limits.max_schema_bytes {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} is {bytes} bytes; at most {} are allowed",
                limits.max_schema_bytes
            ),
        ));
    }
    let depth = depth(schema);
    if depth > limits.max_schema_depth {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} nests {depth} levels deep; at most {} are allowed",
                limits.max_schema_depth
            ),
        ));
    }
    Ok(())
}

fn depth(value: &Value) -> usize {
    // Iterative: a hostile schema may nest deeper than the stack allows recursion.
    let mut deepest = 0;
    let mut stack = vec![(value, 1)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Object(m) => stack.extend(m.values().map(|c| (c, d + 1))),
            Value::Array(a) => stack.extend(a.iter().map(|c| (c, d + 1))),
            _ => {}
        }
    }
    deepest
}

fn functions(
    tools: &[api::tools::Tool],
    limits: &StructuredLimits,
) -> Result<Vec<Function>, ApiError> {
    if tools.len() > limits.max_tools {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "at most {} tools are allowed; got {}",
                limits.max_tools,
                tools.len()
            ),
        ));
    }
    let mut out: Vec<Function> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(ApiError::invalid(
                format!("tools[{i}].type"),
                format!(
                    "tool type '{}' is not supported; only 'function'",
                    tool.kind
                ),
            ));
        }
        let Some(f) = &tool.function else {
            return Err(ApiError::invalid(
                format!("tools[{i}].function"),
                "a function tool needs a 'function' object",
            ));
        };
        if !valid_name(&f.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                "function names are 1 to 64 of a-z, A-Z, 0-9, '_' and '-'",
            ));
        }
        if out.iter().any(|o| o.name == f.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("two tools are named '{}'", f.name),
            ));
        }
        let param = format!("tools[{i}].function.parameters");
        let parameters = f
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        check_schema(&param, &parameters, limits)?;
        out.push(Function {
            name: f.name.clone(),
            description: f.description.clone(),
            parameters,
            strict: f.strict.unwrap_or(false),
        });
    }
    Ok(out)
}

fn tool_choice(choice: Option<&Value>, functions: &[Function]) -> Result<Choice, ApiError> {
    let invalid = |message: String| ApiError::invalid("tool_choice", message);
    let choice =
        match choice {
            None | Some(Value::Null) => {
                return Ok(if functions.is_empty() {
                    Choice::None
                } else {
                    Choice::Auto
                })
            }
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(invalid(format!(
                        "tool_choice '{other}' is not one of 'none', 'auto', 'required' or a \
                     function"
                    )))
                }
            },
            Some(Value::Object(o)) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    // The Responses API's flat form.
                    .or_else(|| o.get("name").and_then(Value::as_str));
                match (o.get("type").and_then(Value::as_str), name) {
                    (Some("function"), Some(name)) => Choice::Named(name.to_owned()),
                    _ => return Err(invalid(
                        "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": \
                         ...}}"
                            .into(),
                    )),
                }
            }
            Some(_) => return Err(invalid("tool_choice must be a string or an object".into())),
        };
    match &choice {
        Choice::Named(name) if !functions.iter().any(|f| &f.name == name) => Err(invalid(format!(
            "tool_choice names the function '{name}', which is not in tools"
        ))),
        Choice::Required | Choice::Named(_) if functions.is_empty() => Err(invalid(
            "tool_choice requires a call but the request has no tools".into(),
        )),
        _ => Ok(choice),
    }
}

/// An assistant message's tool calls in the envelope the model itself writes, byte for byte,
/// so that it sees its earlier calls as it made them (and its KV cache covers them): arguments
/// that are not JSON (a call cut short by `max_tokens`) as they were written.
pub fn render_calls(calls: &[ToolCall]) -> String {
    let calls: Vec<String> = calls
        .iter()
        .map(|c| {
            let mut call = format!(
                "{{\"name\": {}, \"arguments\": ",
                Value::from(c.function.name.as_str())
            );
            match serde_json::from_str::<Value>(&c.function.arguments) {
                Ok(arguments) => write_spaced(&arguments, &mut call),
                Err(_) => call.push_str(&c.function.arguments),
            }
            call.push('}');
            call
        })
        .collect();
    format!("{CALLS_OPEN}{}]}}", calls.join(", "))
}

/// An assistant's answer in text as the model itself writes it where tools are offered: in the
/// envelope's response alternative (a JSON value when `json_response` and the text is one). A
/// text already in the envelope stays as it is.
pub fn render_reply(content: &str, json_response: bool) -> String {
    if content.starts_with(CALLS_OPEN) || content.starts_with(RESPONSE_OPEN) {
        return content.to_owned();
    }
    let value = json_response
        .then(|| serde_json::from_str::<Value>(content).ok())
        .flatten()
        .unwrap_or_else(|| Value::from(content));
    let mut reply = RESPONSE_OPEN.to_owned();
    write_spaced(&value, &mut reply);
    reply.push('}');
    reply
}

/// The assistant messages of a conversation that offers tools, each in the envelope the model
/// answers in, so that the prompt carries what it wrote (and the KV cache it left) unchanged.
pub fn envelope_replies(messages: &mut [ChatMessage], json_response: bool) {
    for message in messages.iter_mut().filter(|m| m.role == "assistant") {
        message.content = render_reply(&message.content, json_response);
    }
}

/// `value` as JSON with the separators constrained answers use (`", "`, `": "`).
fn write_spaced(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_spaced(item, out);
            }
            out.push(']');
        }
        Value::Object(fields) => {
            out.push('{');
            for (i, (key, item)) in fields.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::from(key.as_str()).to_string());
                out.push_str(": ");
                write_spaced(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// A tool's result as the model reads it.
pub fn render_result(name: Option<&str>, id: &str, content: &str) -> String {
    json!({"tool_result": {"name": name, "tool_call_id": id, "content": content}}).to_string()
}

/// Compiles `schemas` (each alone, naming its field on failure) and then the request's whole
/// grammar, off the async threads and within the time bound. Returns the compiler's warnings
/// (keywords dropped from lenient schemas).
pub async fn compile(
    model: &ModelInfo,
    structured: &Structured,
    limits: &StructuredLimits,
) -> Result<Vec<String>, ApiError> {
    if structured.format == ResponseFormat::Text {
        return Ok(Vec::new());
    }
    let grammars = model.grammars.clone();
    let mut jobs = structured.schemas.clone();
    let whole = match &structured.format {
        ResponseFormat::Lark(_) => Some(structured.format.clone()),
        _ if jobs.is_empty() => Some(structured.format.clone()),
        _ => None,
    };
    let whole_param = if structured.reply == Reply::Text {
        "response_format"
    } else {
        "tools"
    };
    // A whole grammar built of schemas repeats their warnings; each is reported once, by field.
    let quiet = (whole.is_some() && !jobs.is_empty()).then_some(jobs.len());
    if let Some(format) = whole {
        jobs.push((whole_param.to_owned(), format));
    }
    let work = tokio::task::spawn_blocking(move || {
        let mut warnings = Vec::new();
        for (n, (param, format)) in jobs.into_iter().enumerate() {
            match grammars.compile(&format) {
                Ok(Some(c)) if quiet != Some(n) => {
                    for w in c.warnings() {
                        let w = format!("{param}: {w}");
                        if !warnings.contains(&w) {
                            warnings.push(w);
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(ApiError::invalid(param.clone(), format!("{param}: {e}"))),
            }
        }
        Ok(warnings)
    });
    match tokio::time::timeout(limits.compile_timeout, work).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(ApiError::Internal(format!(
            "grammar compilation failed: {e}"
        ))),
        Err(_) => Err(ApiError::invalid(
            whole_param,
            format!(
                "the schemas took longer than {} ms to compile; simplify them",
                limits.compile_timeout.as_millis()
            ),
        )),
    }
}

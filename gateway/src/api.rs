//! OpenAI's wire format for chat completions and errors: serde types and nothing else (but the
//! clock their `created` fields read, [`unix_now`]).
//!
//! Requests are `Deserialize` only and lenient on purpose: unknown fields are ignored (clients
//! send whatever their SDK version knows), numbers are read wide (`f64`, `i64`) so that
//! [`crate::validate`] can name an out-of-range field instead of serde failing on it.
//! Responses are `Serialize` only and follow OpenAI's shapes field for field, including the
//! `null`s a client may test for.
//!
//! No logic lives here: whether a value is acceptable is `validate`'s business, how an engine
//! event becomes a chunk is `http::chat`'s.
//!
//! [`embeddings`] holds the types of `POST /v1/embeddings`; [`verify`] those of
//! `POST /v1/swarm/verify`; [`agents`] those of `/v1/agents`.

pub mod agents;
pub mod completions;
pub mod embeddings;
pub mod models;
pub mod responses;
pub mod swarm;
pub mod tools;
pub mod verify;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

// ---- requests ----

/// The fields chat and text completions share: how many answers, how they are sampled, when
/// they stop, whether they stream.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct GenerationOptions {
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Most tokens to generate (chat also takes `max_completion_tokens`, which wins). Without
    /// it, a text completion generates at most 16 tokens (OpenAI's default) and a chat answer
    /// what the server's `--default-max-tokens` allows, else the room the context leaves. Above
    /// the server's `--max-tokens-limit`: 400.
    #[schema(minimum = 1)]
    pub max_tokens: Option<i64>,
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// How many answers to generate for each prompt.
    #[schema(minimum = 1, maximum = 16)]
    pub n: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    /// An end-user id. Chat takes it as the conversation session when the request has no
    /// `x-session-id` header; text completions ignore it.
    pub user: Option<String>,
    /// vLLM's extension: keep the k most likely tokens; 0 or -1 turn it off.
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    /// vLLM's extension: drop tokens less likely than `min_p` times the most likely one.
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f64>,
    /// vLLM's extension: above 1 discourages tokens already in the prompt or the output.
    #[schema(exclusive_minimum = 0)]
    pub repetition_penalty: Option<f64>,
    /// vLLM's extension: keep generating past the model's end-of-turn token (benchmarks use it
    /// to get answers of a fixed length).
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: the request's scheduling priority; lower runs first (default 0), and
    /// under memory pressure the least urgent is preempted first. It shifts the priority class
    /// of the agent serving it. An API key may bound how urgent its requests can be
    /// (`min_priority`).
    #[schema(minimum = -1000000, maximum = 1000000)]
    pub priority: Option<i64>,
    /// Agent hints: what an agent harness knows about this call.
    pub swarmgate: Option<AgentHints>,
    /// The same hints under the name NVIDIA Dynamo gives them; give one or the other.
    pub agent_hints: Option<AgentHints>,
}

/// What an agent harness knows about a call, to schedule and cache it better. Unknown fields
/// are ignored; a bad value is a 400 naming it.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct AgentHints {
    /// As the top-level `priority` (lower runs first), which it must equal when both are given.
    #[schema(minimum = -1000000, maximum = 1000000)]
    pub priority: Option<i64>,
    /// Expected output tokens: the request is admitted once they fit in the KV cache beside
    /// what is running, so that its answer is not preempted halfway.
    #[schema(minimum = 1)]
    pub osl: Option<i64>,
    /// After the answer, prefill the next turn's prefix (the conversation and this answer, as
    /// the chat template renders them) while the engine has nothing else waiting, and hold it
    /// for the run's next turn, which then starts warm.
    pub speculative_prefill: Option<bool>,
    /// Keep this request's KV blocks (prompt and answer) on the device for this many seconds
    /// after it ends, for requests that start the same way; at most the server's
    /// `--cache-ttl-max-secs` or the API key's `max_cache_ttl_secs`. 0: not kept.
    #[schema(minimum = 0)]
    pub cache_ttl_secs: Option<f64>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[schema(example = json!({
    "model": "default",
    "messages": [{"role": "user", "content": "Say hello in French."}],
    "max_tokens": 8
}))]
pub struct ChatCompletionRequest {
    /// The served model's id or `"default"`; absent means the served model.
    pub model: Option<String>,
    /// The conversation; in a session, only its new turn (the history kept for the session
    /// goes before it).
    pub messages: Vec<ChatMessage>,
    /// Supersedes `max_tokens`, which OpenAI deprecated for chat; both are accepted.
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    /// Only with `logprobs: true`.
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<i64>,
    pub response_format: Option<ResponseFormat>,
    /// Functions the model may call.
    pub tools: Option<Vec<tools::Tool>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": ...}}`.
    /// Read as any JSON so that validation can name what is wrong with it.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<serde_json::Value>,
    /// `false`: at most one call per answer (default `true`).
    pub parallel_tool_calls: Option<bool>,
    /// Options for requests to the swarm (`model: "swarm"`, `"auto"` or an agent's name).
    pub swarm: Option<swarm::SwarmOptions>,
    #[serde(flatten)]
    pub options: GenerationOptions,
}

pub use tools::ResponseFormat;

/// One message of the conversation.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    /// `null` is allowed by OpenAI for assistant messages that only carry tool calls.
    pub content: Option<MessageContent>,
    /// An assistant message's calls.
    pub tool_calls: Option<Vec<tools::ToolCall>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

/// A message's content: a plain string, or a list of typed parts.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of an array content. Kept open (`kind` is a string) so that a part this server
/// cannot use, such as `image_url`, is refused by validation with the field named rather than
/// by serde with an opaque message.
#[derive(Clone, Debug, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A text input (`prompt` of completions, `input` of embeddings): one text, several, or token
/// ids in either form. Tried in this order, so `[]` reads as an empty list of texts.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TextInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

// ---- responses ----

/// A whole, non-streamed answer.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// `chatcmpl-...`
    pub id: String,
    /// Always `"chat.completion"`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// Requests to the swarm only: which agent answered, the verdict, and the cost of each hop.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swarm: Option<swarm::SwarmReport>,
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: FinishReason,
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `"assistant"`.
    pub role: &'static str,
    /// `null` when the answer is tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<tools::ToolCall>>,
    /// Always `null`: the model never refuses by itself.
    pub refusal: Option<String>,
}

impl AssistantMessage {
    /// A text answer.
    pub fn text(content: String) -> Self {
        Self {
            role: "assistant",
            content: Some(content),
            tool_calls: None,
            refusal: None,
        }
    }
}

/// One server-sent event of a streamed answer.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    /// The same for every chunk of one answer.
    pub id: String,
    /// Always `"chat.completion.chunk"`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// Empty in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Absent unless the client asked for usage; then `null` on every chunk but the last one
    /// before `[DONE]`, which carries the totals (OpenAI's `stream_options.include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<Option<Usage>>,
    /// Set when generation failed after the stream had started, on the chunk whose
    /// `finish_reason` is `"error"`; OpenAI's SDKs raise on a chunk with an `error` key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// Requests to the swarm only: on the first chunk, and on a last chunk before `[DONE]`
    /// when the verdict comes after the text (`provisional` streams).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swarm: Option<swarm::SwarmReport>,
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: ChunkDelta,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

/// What a chunk adds to the message. The first chunk sets `role`; the last one is empty.
#[derive(Clone, Debug, Default, Serialize, ToSchema)]
pub struct ChunkDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<tools::ToolCallDelta>>,
}

/// Why a choice ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its turn, or a stop sequence was reached.
    Stop,
    /// `max_tokens` or the context window was reached.
    Length,
    /// The answer is tool calls.
    ToolCalls,
    /// Generation failed midway (streams only; a non-streamed failure is an error response).
    Error,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache rather than computed.
    pub cached_tokens: usize,
}

/// `logprobs` of a choice or a chunk: one entry per generated token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, ToSchema)]
pub struct ChoiceLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's raw bytes: a token may be part of a UTF-8 character, which `token` (text)
    /// cannot show.
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
}

/// One server-sent event of a streamed answer, as the spec describes `text/event-stream`
/// bodies: `data` is a chunk (`ChatCompletionChunk` or `CompletionChunk`) as JSON, and the last
/// event's is `[DONE]`. The server writes these with axum's SSE encoder.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[allow(dead_code)] // A description for the spec.
pub struct StreamEvent {
    pub data: String,
}

// ---- probes ----

/// `GET /health`.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Health {
    /// Always `"ok"`.
    pub status: &'static str,
}

/// `GET /ready` when the server can serve.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// Always `"ready"`.
    pub status: &'static str,
    /// The models loaded.
    pub models: Vec<String>,
}

// ---- errors ----

/// OpenAI's error envelope: `{"error": {...}}`.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct ErrorBody {
    pub message: String,
    /// `invalid_request_error`, `server_error`...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A machine-readable code such as `model_not_found`.
    pub code: Option<&'static str>,
}

/// One server-sent event of a stream: a chunk, or the closing `[DONE]`.
#[derive(Debug)]
pub enum Frame<C> {
    Chunk(C),
    Done,
}

/// Now, in Unix seconds: what `created` fields carry.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn request_reads_every_supported_field() {
        let request: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": null}
            ],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": 5, "max_completion_tokens": 6,
            "temperature": 0.5, "top_p": 0.9, "n": 1, "seed": -3,
            "stop": ["a", "b"],
            "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "logprobs": true, "top_logprobs": 2, "user": "u",
            "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": true
        }))
        .unwrap();
        assert_eq!(request.model.as_deref(), Some("m"));
        assert_eq!(request.messages.len(), 3);
        let options = &request.options;
        assert!(matches!(
            &request.messages[1].content,
            Some(MessageContent::Parts(parts)) if parts[0].kind == "text"
                && parts[0].text.as_deref() == Some("Hi")
        ));
        assert!(request.messages[2].content.is_none());
        assert!(matches!(&options.stop, Some(Stop::Many(s)) if s.len() == 2));
        assert_eq!(
            options.stream_options.as_ref().unwrap().include_usage,
            Some(true)
        );
        assert_eq!(
            (options.max_tokens, request.max_completion_tokens),
            (Some(5), Some(6))
        );
        assert_eq!((options.seed, options.top_k), (Some(-3), Some(40)));
        assert_eq!(options.repetition_penalty, Some(1.1));
        assert_eq!(options.ignore_eos, Some(true));
    }

    #[test]
    fn request_ignores_unknown_fields_and_takes_a_single_stop() {
        let request: ChatCompletionRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": "Hi", "name": "alice"}],
            "stop": "END",
            "tools": [], "response_format": {"type": "text"}, "metadata": {"k": "v"}
        }))
        .unwrap();
        assert!(request.model.is_none());
        assert!(matches!(request.options.stop, Some(Stop::One(s)) if s == "END"));
    }

    #[test]
    fn completion_has_openai_shape() {
        let completion = ChatCompletion {
            id: "chatcmpl-1".into(),
            object: "chat.completion",
            created: 7,
            model: "m".into(),
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage::text("Paris.".into()),
                logprobs: None,
                finish_reason: FinishReason::Stop,
            }],
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                total_tokens: 5,
                prompt_tokens_details: PromptTokensDetails { cached_tokens: 1 },
            },
            swarm: None,
        };
        assert_eq!(
            serde_json::to_value(&completion).unwrap(),
            json!({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Paris.", "refusal": null},
                    "logprobs": null,
                    "finish_reason": "stop"
                }],
                "usage": {
                    "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                    "prompt_tokens_details": {"cached_tokens": 1}
                }
            })
        );
    }

    fn chunk(choices: Vec<ChunkChoice>, usage: Option<Option<Usage>>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 7,
            model: "m".into(),
            choices,
            usage,
            error: None,
            swarm: None,
        }
    }

    #[test]
    fn chunks_have_openai_shape() {
        let first = chunk(
            vec![ChunkChoice {
                index: 0,
                delta: ChunkDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: None,
            }],
            None,
        );
        assert_eq!(
            serde_json::to_value(&first).unwrap(),
            json!({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                "model": "m",
                "choices": [{
                    "index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null
                }]
            })
        );
        let last = chunk(
            vec![ChunkChoice {
                index: 0,
                delta: ChunkDelta::default(),
                logprobs: None,
                finish_reason: Some(FinishReason::Length),
            }],
            Some(None),
        );
        let last = serde_json::to_value(&last).unwrap();
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"], serde_json::Value::Null);
        assert!(last.as_object().unwrap().contains_key("usage"));

        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            total_tokens: 5,
            prompt_tokens_details: PromptTokensDetails::default(),
        };
        let usage = serde_json::to_value(chunk(Vec::new(), Some(Some(usage)))).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 5);
    }

    #[test]
    fn logprobs_and_errors_have_openai_shape() {
        let logprobs = ChoiceLogprobs {
            content: vec![TokenLogprob {
                token: " Paris".into(),
                logprob: -0.5,
                bytes: Some(b" Paris".to_vec()),
                top_logprobs: vec![TopLogprob {
                    token: " Paris".into(),
                    logprob: -0.5,
                    bytes: Some(b" Paris".to_vec()),
                }],
            }],
        };
        assert_eq!(
            serde_json::to_value(&logprobs).unwrap(),
            json!({"content": [{
                "token": " Paris", "logprob": -0.5, "bytes": [32, 80, 97, 114, 105, 115],
                "top_logprobs": [
                    {"token": " Paris", "logprob": -0.5, "bytes": [32, 80, 97, 114, 105, 115]}
                ]
            }]})
        );
        let error = ErrorResponse {
            error: ErrorBody {
                message: "bad".into(),
                kind: "invalid_request_error",
                param: Some("temperature".into()),
                code: None,
            },
        };
        assert_eq!(
            serde_json::to_value(&error).unwrap(),
            json!({"error": {
                "message": "bad", "type": "invalid_request_error",
                "param": "temperature", "code": null
            }})
        );
    }
}

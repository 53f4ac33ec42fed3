//! OpenAI's wire format for the legacy `POST /v1/completions`: serde types and nothing else.
//!
//! The request shares its sampling fields with chat ([`GenerationOptions`]); what is its own is
//! the raw `prompt` (no chat template), `echo` and the older `logprobs` shape, which lists
//! tokens, their log-probabilities, their alternatives as a map and their text offsets in
//! parallel arrays.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{FinishReason, GenerationOptions, TextInput, Usage};

/// `POST /v1/completions`.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[schema(example = json!({"model": "default", "prompt": "Once upon a time", "max_tokens": 8}))]
pub struct CompletionRequest {
    /// The served model's id or `"default"`; absent means the served model.
    pub model: Option<String>,
    /// Required by OpenAI; optional here so that its absence is a 400 naming `prompt`. Several
    /// prompts (texts or token lists) each get `n` answers.
    #[schema(required = true)]
    pub prompt: Option<TextInput>,
    /// Put the prompt in front of the answer (and its tokens in front of `logprobs`).
    pub echo: Option<bool>,
    /// Report each token's log-probability and this many likeliest alternatives (0 to 20).
    #[schema(minimum = 0, maximum = 20)]
    pub logprobs: Option<i64>,
    /// Text after the insertion point; this server has no fill-in-the-middle.
    pub suffix: Option<String>,
    /// Candidates to pick the best `n` from; only `n` itself is served.
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub options: GenerationOptions,
}

/// A whole, non-streamed answer.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Completion {
    /// `cmpl-...`
    pub id: String,
    /// Always `"text_completion"`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

/// One answer; the same shape in a streamed chunk, where `text` is the new text only and
/// `finish_reason` is `null` until the choice's last chunk.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    /// `prompt_index * n + answer_index`.
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

/// One server-sent event of a streamed answer.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct CompletionChunk {
    /// The same for every chunk of one answer.
    pub id: String,
    /// Always `"text_completion"`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// Empty in the usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// As for chat: present only with `stream_options.include_usage`, `null` but on the last
    /// chunk before `[DONE]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<Option<Usage>>,
    /// Set on the chunk that ends a choice that failed midway.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<super::ErrorBody>,
}

/// The legacy `logprobs`: parallel arrays, one entry per token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// `null` for the first token of an echoed prompt, which nothing predicts.
    pub token_logprobs: Vec<Option<f32>>,
    /// The likeliest alternatives by token text; `null` where `token_logprobs` is.
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Where each token starts in the choice's text, in bytes.
    pub text_offset: Vec<usize>,
}

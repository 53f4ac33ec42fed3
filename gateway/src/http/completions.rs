//! `POST /v1/completions`: OpenAI's legacy text completions, on the same engine path as chat
//! ([`Choices`]) but with the raw prompt, `echo`, and the older `logprobs` arrays.
//!
//! Every prompt gets `n` answers; choice `i * n + j` is answer `j` to prompt `i`. With `echo`,
//! each choice's text starts with its prompt (streamed: as the choice's first chunk), and with
//! `logprobs` too, `logprobs` starts with the prompt's tokens, the first unscored (`null`), as
//! OpenAI does. Token text offsets count characters of the choice's whole text, echo included,
//! and run on across a stream's chunks.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::TokenLogprob;
use tokenizers::Tokenizer;

use crate::api::completions::{
    Completion, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
};
use crate::api::unix_now;
use crate::api::{self, StreamEvent};
use crate::error::{ApiError, GenerationErrors};
use crate::http::json::ApiJson;
use crate::limits::Admission;
use crate::logprobs::Legacy;
use crate::runs;
use crate::service::choices::{sse_response, Choices, ChunkFormat};
use crate::service::warm_up::WarmUp;
use crate::service::AppState;
use crate::validate::completion::{validate_completion, ValidCompletionRequest};
use crate::validate::off_io;

/// Completes a text prompt (the legacy completions API).
#[utoipa::path(post, path = "/v1/completions", tag = "generation",
    request_body = CompletionRequest,
    params(("x-swarmgate-run-id" = Option<String>, Header, description = "The agent run (program) \
        this request is a turn of (1 to 256 printable ASCII characters), for run scheduling and \
        for keeping a tool-call turn's KV cache for its follow-up; without it, the session's \
        run (chat), or the `previous_response_id` chain's (responses).")),
    responses(
        (status = 200, description = "The answer, or with `stream: true` server-sent events \
            of `CompletionChunk`s ended by `data: [DONE]`.",
            content((Completion = "application/json"), (StreamEvent = "text/event-stream"))),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(state): State<AppState>,
    admission: Admission,
    headers: HeaderMap,
    ApiJson(request): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let run = runs::run_key(admission.caller, &headers, None)?;
    let named = request.model.clone();
    let model_info = state.model_named(named.as_deref());
    let validating = state.clone();
    let limits = state.structured_limits(admission.caller);
    let ValidCompletionRequest {
        model,
        prompts,
        n,
        stream,
        include_usage,
        echo,
        logprobs,
        speculative_prefill,
    } = off_io(move || {
        validate_completion(request, validating.model_named(named.as_deref()), &limits)
    })
    .await?;
    let echoed: Vec<String> = prompts
        .iter()
        .map(|p| if echo { p.text.clone() } else { String::new() })
        .collect();
    // A BOS the model's encoding put in front is not in the prompt's text: it takes no
    // characters of the echo.
    let bos_text = model_info
        .bos
        .and_then(|bos| model_info.tokenizer.id_to_token(bos));
    let first_tokens = prompts
        .iter()
        .map(|p| {
            let added = model_info.bos == Some(p.first_token)
                && bos_text.as_deref().is_some_and(|b| !p.text.starts_with(b));
            (p.first_token, !added)
        })
        .collect();
    let warm_up = match &prompts[..] {
        [only] if speculative_prefill => {
            let text = only.text.clone();
            Some(WarmUp::text(&state, &admission, text, &only.generate))
        }
        _ => None,
    };
    let requests = prompts
        .into_iter()
        .map(|mut p| {
            p.generate.run = runs::turn(run.as_deref(), &model);
            (p.tokens, p.generate)
        })
        .collect();
    let choices = Choices::submit(&state, &admission, requests, n, warm_up).await?;
    let mut answer = TextAnswer {
        id: format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        created: unix_now(),
        model,
        tokenizer: logprobs.map(|_| model_info.tokenizer.clone()),
        include_usage,
        offsets: (0..choices.count())
            .map(|i| echoed[i / n].chars().count())
            .collect(),
        echoed,
        first_tokens,
        echo_logprobs: echo && logprobs.is_some(),
        n,
    };
    if !stream {
        let (collected, usage) = choices.collect().await?;
        let choices = collected
            .into_iter()
            .enumerate()
            .map(|(index, choice)| CompletionChoice {
                index: index as u32,
                logprobs: answer.logprobs(
                    index,
                    choice.prompt_logprobs.as_deref(),
                    &choice.logprobs,
                ),
                text: answer.echo_of(index).to_owned() + &choice.text,
                finish_reason: Some(choice.finish_reason.unwrap_or(api::FinishReason::Stop)),
            })
            .collect();
        return Ok(Json(Completion {
            id: answer.id,
            object: "text_completion",
            created: answer.created,
            model: answer.model,
            choices,
            usage,
        })
        .into_response());
    }
    choices
        .stream(answer, state.metrics().clone())
        .await
        .map(sse_response)
}

/// What the completion, or every chunk, of one answer shares.
struct TextAnswer {
    id: String,
    created: u64,
    model: String,
    /// Set when the client asked for log-probabilities.
    tokenizer: Option<Arc<Tokenizer>>,
    include_usage: bool,
    /// Per prompt: the text each of its choices starts with (empty without `echo`).
    echoed: Vec<String>,
    /// Per prompt: its first token, and whether it stands in the prompt's text (not a BOS the
    /// encoding added).
    first_tokens: Vec<(u32, bool)>,
    /// Whether the echoed prompts come with their log-probabilities.
    echo_logprobs: bool,
    n: usize,
    /// Per choice: characters of its text so far.
    offsets: Vec<usize>,
}

impl TextAnswer {
    fn echo_of(&self, index: usize) -> &str {
        &self.echoed[index / self.n]
    }

    /// Choice `index`'s legacy `logprobs`: its prompt's tokens (when given), which start the
    /// text, then `generated`, advancing the choice's text offset.
    fn logprobs(
        &mut self,
        index: usize,
        prompt: Option<&[TokenLogprob]>,
        generated: &[TokenLogprob],
    ) -> Option<CompletionLogprobs> {
        let tokenizer = self.tokenizer.as_ref()?;
        let mut out = CompletionLogprobs::default();
        if let Some(prompt) = prompt {
            let mut legacy = Legacy::new(tokenizer, 0);
            let (token, in_text) = self.first_tokens[index / self.n];
            legacy.push_unscored(&mut out, token, in_text);
            legacy.extend(&mut out, prompt);
        }
        let mut legacy = Legacy::new(tokenizer, self.offsets[index]);
        legacy.extend(&mut out, generated);
        self.offsets[index] = legacy.offset();
        Some(out)
    }

    fn chunk(&self, choices: Vec<CompletionChoice>) -> CompletionChunk {
        CompletionChunk {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: self.include_usage.then_some(None),
            error: None,
        }
    }

    fn choice_chunk(
        &self,
        index: usize,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish_reason: Option<api::FinishReason>,
    ) -> CompletionChunk {
        self.chunk(vec![CompletionChoice {
            index: index as u32,
            text,
            logprobs,
            finish_reason,
        }])
    }
}

impl ChunkFormat for TextAnswer {
    type Chunk = CompletionChunk;

    fn empty(&self) -> CompletionChunk {
        self.chunk(Vec::new())
    }

    fn include_usage(&self) -> bool {
        self.include_usage
    }

    /// The echoed prompt, unless it waits for its log-probabilities.
    fn opening(&self, index: usize) -> Option<CompletionChunk> {
        let echo = self.echo_of(index);
        (!echo.is_empty() && !self.echo_logprobs)
            .then(|| self.choice_chunk(index, echo.to_owned(), None, None))
    }

    /// The echoed prompt with its log-probabilities.
    fn prompt(&mut self, index: usize, logprobs: &[TokenLogprob]) -> Option<CompletionChunk> {
        let logprobs = self.logprobs(index, Some(logprobs), &[]);
        let echo = self.echo_of(index).to_owned();
        Some(self.choice_chunk(index, echo, logprobs, None))
    }

    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: &[TokenLogprob],
    ) -> Option<CompletionChunk> {
        if text.is_empty() && logprobs.is_empty() {
            return None;
        }
        let logprobs = self.logprobs(index, None, logprobs);
        Some(self.choice_chunk(index, text, logprobs, None))
    }

    fn finished(&mut self, index: usize, reason: api::FinishReason) -> CompletionChunk {
        self.choice_chunk(index, String::new(), None, Some(reason))
    }
}

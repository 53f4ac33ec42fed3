//! Turns a wire [`CompletionRequest`] into a [`ValidCompletionRequest`] by the rules the module
//! above states for every generation, plus the legacy endpoint's own: `prompt` is required and
//! non-empty (a text, texts, token ids or lists of them, each id in the vocabulary); prompts
//! times `n` at most [`MAX_CHOICES`]; `logprobs` in 0..=20; `suffix` (fill-in-the-middle) is
//! refused; `best_of`, when given, equals `n`; without `max_tokens`, at most
//! [`DEFAULT_MAX_TOKENS`] tokens per answer (OpenAI's documented default, and vLLM's). The
//! prompts are counted before any is tokenized.
//!
//! The prompt is raw text: no chat template, as OpenAI's completions endpoint does. Special-token
//! text in it (`<|im_start|>`) becomes the control token, as in vLLM and llama.cpp's servers: a
//! completions prompt is the caller's own rendering of whatever format it wants, and a client
//! that writes its own chat markup needs those tokens. This is no injection: the caller writes
//! the whole prompt and so already controls every turn in it. Anything that puts someone else's
//! text into a prompt uses the chat endpoints, whose contents never yield control tokens.

use engine::{GenerateRequest, ModelInfo};

use super::structured::StructuredLimits;
use super::{check_model, tokenize, Options, MAX_CHOICES, MAX_TOP_LOGPROBS};
use crate::api::completions::CompletionRequest;
use crate::api::TextInput;
use crate::error::ApiError;

/// Tokens an answer may take when the request names no `max_tokens`: OpenAI's documented default
/// for its completions endpoint.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// A text completion request that passed validation.
#[derive(Clone, Debug)]
pub struct ValidCompletionRequest {
    /// The served model's id.
    pub model: String,
    /// The prompts, in request order; each is answered `n` times.
    pub prompts: Vec<ValidPrompt>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Put each prompt in front of its answers (with `logprobs`, the prompt's tokens' too).
    pub echo: bool,
    /// `Some(n)`: report each token's log-probability and its `n` likeliest alternatives.
    pub logprobs: Option<usize>,
    /// Prefill the text that follows the answer once it is complete (an agent hint).
    pub speculative_prefill: bool,
}

#[derive(Clone, Debug)]
pub struct ValidPrompt {
    /// The prompt as text (decoded, when it came as token ids), for `echo`.
    pub text: String,
    pub tokens: usize,
    /// Its first token, which an echo with log-probabilities lists unscored.
    pub first_token: u32,
    /// The engine request; its prompt is the token ids.
    pub generate: GenerateRequest,
}

/// Checks `request` against the served model and the operator's `budget` (whose chat default
/// does not apply here).
pub fn validate_completion(
    request: CompletionRequest,
    model: &ModelInfo,
    limits: &StructuredLimits,
) -> Result<ValidCompletionRequest, ApiError> {
    let budget = &limits.max_tokens;
    let model_id = check_model(request.model.as_deref(), &model.id)?;
    let logprobs = match request.logprobs {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be between 0 and {MAX_TOP_LOGPROBS}; got {n}"),
            ))
        }
    };
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "suffix",
            "suffix is not supported: this server does not fill in the middle",
        ));
    }
    let max_tokens = request.options.max_tokens.map(|n| ("max_tokens", n));
    let options = Options::new(
        request.options,
        max_tokens,
        budget.limit,
        Some(DEFAULT_MAX_TOKENS),
        &limits.hints,
    )?;
    if let Some(best_of) = request.best_of.filter(|&b| b != options.n as i64) {
        return Err(ApiError::invalid(
            "best_of",
            format!(
                "best_of must equal n ({}) on this server; got {best_of}",
                options.n
            ),
        ));
    }
    let inputs = inputs(request.prompt)?;
    let echo = request.echo.unwrap_or(false);
    if inputs.len() * options.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts times n={} is more than the {MAX_CHOICES} answers one request may ask for",
                inputs.len(),
                options.n
            ),
        ));
    }
    let prompts = inputs
        .into_iter()
        .map(|input| {
            let (text, tokens) = prompt(input, model)?;
            let count = tokens.len();
            let first_token = tokens[0];
            let mut generate = options.generate(model, tokens, "prompt", None)?;
            generate.logprobs = logprobs;
            if echo {
                generate.prompt_logprobs = logprobs;
            }
            Ok(ValidPrompt {
                text,
                tokens: count,
                first_token,
                generate,
            })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok(ValidCompletionRequest {
        model: model_id,
        prompts,
        n: options.n,
        stream: options.stream,
        include_usage: options.include_usage,
        echo,
        logprobs,
        speculative_prefill: options.hints.speculative_prefill,
    })
}

/// The prompts as sent, each a text or token ids; not yet tokenized.
fn inputs(prompt: Option<TextInput>) -> Result<Vec<Result<String, Vec<i64>>>, ApiError> {
    let prompts: Vec<_> = match prompt {
        None => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(TextInput::Text(text)) => vec![Ok(text)],
        Some(TextInput::Texts(texts)) => texts.into_iter().map(Ok).collect(),
        Some(TextInput::Tokens(ids)) => vec![Err(ids)],
        Some(TextInput::TokenLists(lists)) => lists.into_iter().map(Err).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "prompt must not be an empty list",
        ));
    }
    Ok(prompts)
}

/// One prompt as text and token ids.
fn prompt(
    input: Result<String, Vec<i64>>,
    model: &ModelInfo,
) -> Result<(String, Vec<u32>), ApiError> {
    let (text, tokens) = match input {
        Ok(text) => {
            let tokens = tokenize(model, &text)?;
            (text, tokens)
        }
        Err(ids) => {
            let vocab = model.tokenizer.get_vocab_size(true) as i64;
            if let Some(bad) = ids.iter().find(|&&id| !(0..vocab).contains(&id)) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is not in the model's vocabulary"),
                ));
            }
            let tokens: Vec<u32> = ids.into_iter().map(|id| id as u32).collect();
            let text = model
                .tokenizer
                .decode(&tokens, false)
                .map_err(|e| ApiError::Internal(format!("decoding the prompt: {e}")))?;
            (text, tokens)
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    Ok((text, tokens))
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use engine::Prompt;
    use serde_json::json;

    use super::*;
    use crate::test_support::{model_info, MODEL_ID};
    use crate::validate::MaxTokens;

    fn model() -> &'static ModelInfo {
        static MODEL: OnceLock<ModelInfo> = OnceLock::new();
        MODEL.get_or_init(|| model_info(256))
    }

    fn validate(body: serde_json::Value) -> Result<ValidCompletionRequest, ApiError> {
        validate_with(body, MaxTokens::default())
    }

    fn validate_with(
        body: serde_json::Value,
        budget: MaxTokens,
    ) -> Result<ValidCompletionRequest, ApiError> {
        validate_completion(
            serde_json::from_value(body).expect("a wire request"),
            model(),
            &StructuredLimits {
                max_tokens: budget,
                ..StructuredLimits::default()
            },
        )
    }

    fn rejected_param(body: serde_json::Value) -> String {
        rejected_param_with(body, MaxTokens::default())
    }

    fn rejected_param_with(body: serde_json::Value, budget: MaxTokens) -> String {
        match validate_with(body.clone(), budget) {
            Err(e @ ApiError::InvalidRequest { .. }) => {
                e.body().param.expect("a 400 names its field")
            }
            other => panic!("{body}: expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn every_prompt_shape_is_read() {
        let text =
            validate(json!({"prompt": "The capital of France is", "max_tokens": 4})).unwrap();
        assert_eq!(text.model, MODEL_ID);
        assert_eq!(text.prompts.len(), 1);
        let prompt = &text.prompts[0];
        let Prompt::Tokens(ids) = &prompt.generate.prompt else {
            panic!("prompts reach the engine as tokens");
        };
        assert_eq!(ids.len(), prompt.tokens);
        assert_eq!(prompt.generate.max_tokens, 4);

        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let tokens = validate(json!({"prompt": ids, "max_tokens": 4})).unwrap();
        assert_eq!(
            tokens.prompts[0].text, "The capital of France is",
            "ids decode for echo"
        );

        let several = validate(json!({"prompt": ["a b", "c"], "n": 3, "echo": true})).unwrap();
        assert_eq!((several.prompts.len(), several.n), (2, 3));
        assert!(several.echo);
        let lists = validate(json!({"prompt": [[1, 2], [3]], "logprobs": 2})).unwrap();
        assert_eq!(lists.prompts.len(), 2);
        assert_eq!(lists.logprobs, Some(2));
        assert_eq!(lists.prompts[1].generate.logprobs, Some(2));
        assert_eq!(lists.prompts[1].generate.prompt_logprobs, None);
        let echo = validate(json!({"prompt": [[1, 2]], "logprobs": 1, "echo": true})).unwrap();
        assert_eq!(echo.prompts[0].generate.prompt_logprobs, Some(1));
        assert_eq!(echo.prompts[0].first_token, 1);
    }

    #[test]
    fn refusals_name_their_field() {
        for (body, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": ""}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": [49152]}), "prompt"),
            (json!({"prompt": [-1]}), "prompt"),
            (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "a", "suffix": "b"}), "suffix"),
            (json!({"prompt": "a", "n": 2, "best_of": 3}), "best_of"),
            (json!({"prompt": ["a", "b"], "n": 9}), "n"),
            (json!({"prompt": "a", "n": 17}), "n"),
            (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "a", "max_tokens": 1000}), "max_tokens"),
            (json!({"prompt": "a", "temperature": 3}), "temperature"),
            (
                json!({"prompt": "a", "stream_options": {}}),
                "stream_options",
            ),
        ] {
            assert_eq!(rejected_param(body.clone()), param, "{body}");
        }
        assert!(matches!(
            validate(json!({"prompt": "a", "model": "gpt-4"})),
            Err(ApiError::ModelNotFound(_))
        ));
    }

    #[test]
    fn without_max_tokens_an_answer_takes_at_most_16_tokens() {
        let valid = validate(json!({"prompt": "Once upon a time"})).unwrap();
        assert_eq!(valid.prompts[0].generate.max_tokens, DEFAULT_MAX_TOKENS);
        // The chat default is chat's alone; the operator's limit still bounds the default.
        let budget = MaxTokens {
            limit: Some(8),
            chat_default: Some(100),
        };
        let valid = validate_with(json!({"prompt": "Once upon a time"}), budget).unwrap();
        assert_eq!(valid.prompts[0].generate.max_tokens, 8);
        let asked = validate_with(json!({"prompt": "a", "max_tokens": 8}), budget).unwrap();
        assert_eq!(asked.prompts[0].generate.max_tokens, 8);
        assert_eq!(
            rejected_param_with(json!({"prompt": "a", "max_tokens": 9}), budget),
            "max_tokens"
        );
        // Near the end of the context the default shrinks to the room left.
        let long: Vec<i64> = vec![28; 250];
        let valid = validate(json!({"prompt": long})).unwrap();
        assert_eq!(valid.prompts[0].generate.max_tokens, 6);
    }

    #[test]
    fn prompts_are_counted_before_they_are_tokenized() {
        // Each prompt would be refused for its token id; the count is refused first.
        let prompts = vec![vec![-1i64]; MAX_CHOICES + 1];
        assert_eq!(rejected_param(json!({"prompt": prompts})), "n");
    }

    #[test]
    fn a_raw_prompt_keeps_the_control_tokens_its_caller_wrote() {
        let valid =
            validate(json!({"prompt": "<|im_start|>user\nHi<|im_end|>\n", "max_tokens": 1}))
                .unwrap();
        let Prompt::Tokens(ids) = &valid.prompts[0].generate.prompt else {
            panic!("tokens");
        };
        assert_eq!((ids[0], ids[ids.len() - 2]), (1, 2), "{ids:?}");
    }
}

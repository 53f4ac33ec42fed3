//! What callers hand the engine and what they get back: a request to generate, and the stream
//! of events that answers it. Plain data, no behaviour beyond validation and defaults.

use std::time::{Duration, Instant};

/// Identifies one request (one sequence) inside an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// How the next token is chosen from the logits.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches top_p (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one (0: off).
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of tokens already seen (1: off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was already generated (0: off).
    pub frequency_penalty: f32,
    /// Seeds this request's own random generator; the same seed gives the same tokens whatever
    /// else is in the batch. `None` draws a seed at random.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects values no sampler can honour.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err("temperature must be >= 0".into());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err("top_p must be in (0, 1]".into());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err("min_p must be in [0, 1]".into());
        }
        if self.repetition_penalty <= 0.0 {
            return Err("repetition_penalty must be > 0".into());
        }
        Ok(())
    }
}

/// The prompt, as text (the engine tokenizes it) or as token ids.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One generation request. It serializes for engines in other processes, all but its
/// `deadline` (an instant of this process's clock).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    /// The engine model that runs it, by id; `None`: the engine's first (its default).
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Generation ends when the text contains one of these; the stop string is not emitted.
    pub stop: Vec<String>,
    /// Generation ends when one of these tokens is sampled (the model's EOS always counts unless
    /// `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `Some(n)`: report each generated token's log-probability and the `n` most likely
    /// alternatives (n may be 0).
    pub logprobs: Option<usize>,
    /// `Some(n)`: report each prompt token's log-probability (given the tokens before it) and the
    /// `n` most likely alternatives at its position, in one [`Event::PromptLogprobs`]. The prompt
    /// is then computed in full: the prefix cache holds keys and values, not logits, so such a
    /// request takes no prefix-cache hit (it still leaves its blocks there for others).
    pub prompt_logprobs: Option<usize>,
    /// Higher runs first; equal priorities are served first come, first served. When memory runs
    /// out, the newest sequence of the lowest priority is preempted.
    pub priority: i32,
    /// Past this instant the request ends with an error and frees its memory.
    #[serde(skip)]
    pub deadline: Option<Instant>,
    /// What shape the output must take.
    pub response_format: ResponseFormat,
    /// Report these tokens' log-probabilities with every generated token (in
    /// [`TokenLogprob::scored`]): a router or a judge reads the model's preference among a few
    /// answers from one forward pass, without sampling.
    pub score_tokens: Vec<u32>,
    /// Whose prefix-cache blocks this request may find; `None`: everyone's.
    #[serde(default)]
    pub cache_salt: Option<CacheSalt>,
    /// The agent run this request is a turn of, if any.
    #[serde(default)]
    pub run: Option<RunTurn>,
    /// Keep this request's KV blocks on the device after it ends, for the turn that follows.
    #[serde(default)]
    pub retention: Option<Retention>,
    /// Tokens the caller expects the answer to take (the agent hint `osl`): admission waits
    /// until they fit beside the prompt, so that the answer is not preempted halfway.
    #[serde(default)]
    pub expected_output_tokens: Option<usize>,
}

/// A turn of an agent run: a program that calls the model, runs a tool for a second or a
/// minute, then calls it again with everything so far. Within a priority class the engine
/// serves runs first come, first served by the run's first arrival, so a run's later turns do
/// not queue behind runs that started after it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunTurn {
    /// Names the run: the same for each of its turns.
    pub id: String,
    /// The kind of program (its agent): the pauses between turns are learned per program.
    pub program: String,
    /// Not a turn but the prefill of the run's next one, ahead of it (speculative prefill): it
    /// neither is the turn its pause is measured to, nor ends one.
    #[serde(default)]
    pub warm_up: bool,
}

/// Keeping a finished request's KV blocks on the device for a while, for the turn that follows
/// (it arrives with the same prefix and finds them in the prefix cache). Held blocks are evicted
/// only after every plain cached block; a hold ends when the run's next turn is admitted or its
/// time is up, and its blocks join the LRU order like any others.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Retention {
    /// Only when the answer starts with this text (the opening of a tool-call envelope: the
    /// turn waits for a tool); `None`: always.
    pub if_answer_starts_with: Option<String>,
    /// The longest the blocks are held, in seconds.
    pub max_secs: f64,
    /// The engine picks the time, at most `max_secs`, from the pauses it has seen between the
    /// program's turns and from what recomputing the blocks would cost; else exactly `max_secs`.
    pub adaptive: bool,
}

/// The longest retention a request may ask for, in seconds.
pub const MAX_RETENTION_SECS: f64 = 86_400.0;

impl Retention {
    /// The longest the blocks are held (validated: finite, within [`MAX_RETENTION_SECS`]).
    pub fn longest(&self) -> Duration {
        Duration::from_secs_f64(self.max_secs)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.max_secs.is_finite() && (0.0..=MAX_RETENTION_SECS).contains(&self.max_secs)) {
            return Err(format!(
                "a retention lasts between 0 and {MAX_RETENTION_SECS} seconds"
            ));
        }
        Ok(())
    }
}

/// Who may share a request's prefix-cache blocks, as vLLM's `cache_salt`: the blocks past its
/// first `shared_prefix` tokens are keyed with `salt` too, so only requests with the same salt
/// (the same tenant) find them, and a hit cannot reveal another tenant's prompt. The blocks
/// within the shared prefix (an agent's system prompt, the same for every tenant) stay
/// everyone's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheSalt {
    pub salt: u64,
    pub shared_prefix: usize,
}

/// A constraint on the generated text, enforced token by token ([`crate::constraint`]): the
/// answer is valid by construction unless `max_tokens` cuts it short, and the sequence ends as
/// soon as the grammar is complete.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseFormat {
    #[default]
    Text,
    /// A single JSON object (OpenAI's JSON mode).
    JsonObject,
    /// A JSON value valid against `schema`. `strict`: a keyword that cannot be enforced is an
    /// error; otherwise it is dropped, with a warning.
    JsonSchema {
        schema: serde_json::Value,
        strict: bool,
    },
    /// A grammar in llguidance's Lark dialect (which embeds JSON schemas with `%json`).
    Lark(String),
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> Self {
        Self {
            model: None,
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            priority: 0,
            deadline: None,
            response_format: ResponseFormat::Text,
            score_tokens: Vec::new(),
            cache_salt: None,
            run: None,
            retention: None,
            expected_output_tokens: None,
        }
    }
}

/// The log-probability of one token (generated, or of the prompt) and of its most likely
/// alternatives.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens at this position, most likely first.
    pub top: Vec<(u32, f32)>,
    /// The log-probabilities of the request's `score_tokens` at this position, in their order
    /// (generated tokens only; empty for prompt tokens).
    pub scored: Vec<(u32, f32)>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context window is full.
    Length,
    /// The caller dropped the stream.
    Cancelled,
    /// Deadline passed, or the engine failed.
    Error,
}

impl FinishReason {
    /// The name OpenAI's API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
        }
    }
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache instead of being computed.
    pub cached_tokens: usize,
}

/// What the engine sends back for a request, in order: when the request asked for
/// `prompt_logprobs`, one `PromptLogprobs` once its prompt is computed (before any `Delta`; none
/// if it ends before that), then any number of `Delta`s, then exactly one `Finished`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// The prompt's tokens scored, from the second on (the first has nothing before it): entry
    /// `i` is prompt token `i + 1` given tokens `0..=i`, so there are `prompt_tokens - 1`.
    PromptLogprobs(Vec<TokenLogprob>),
    /// New tokens, and the text that became final with them. The text can be empty (a UTF-8
    /// character or a possible stop string still incomplete) and can be released by a later
    /// delta.
    Delta {
        text: String,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
        /// Set when `reason` is `Error`.
        error: Option<String>,
    },
}

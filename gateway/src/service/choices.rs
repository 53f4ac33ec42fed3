//! What chat and text completions share: running a request's answers (`n` per prompt) on the
//! engine side by side, and turning their events into one response, whole or streamed.
//!
//! Each answer ("choice") is its own engine sequence with its own event stream; [`Choices`]
//! merges them in arrival order into [`Update`]s tagged with the choice's index and tallies the
//! usage. Choice `j` of prompt `i` has index `i * n + j` and, when the request has a seed, seed
//! `seed + j`: answers differ from one another but the same request gives the same answers.
//! Usage counts each prompt once (as OpenAI does) and every answer's tokens.
//!
//! Streamed, the format of the chunks is the endpoint's ([`ChunkFormat`]); the order is shared:
//! each choice's opening chunk, then updates as they come, a choice's last chunk carrying its
//! `finish_reason` (or `"error"` and an error object: a failure after the headers cannot change
//! the status), the usage chunk when asked for and every choice's sequence reported its counts,
//! then `[DONE]`.
//!
//! Invariant: the engine streams are owned by the [`Choices`] and nothing else, so dropping the
//! response (the client left) drops them, which cancels every sequence and frees its blocks.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::{Event, FinishReason, GenerateRequest, TokenLogprob};
use futures::stream::{self, SelectAll};
use futures::{Stream, StreamExt};
use serde::Serialize;

use crate::api::{self, ErrorBody, Frame, PromptTokensDetails};
use crate::error::ApiError;
use crate::limits::Admission;
use crate::metrics::Metrics;
use crate::service::admission::Events;
use crate::service::warm_up::{self, WarmUp};
use crate::service::AppState;

/// What an engine stream that ends without its final event tells the client.
pub const LOST_STREAM: &str = "the engine ended the request without finishing it";

/// The reason OpenAI reports, or the error a failed generation is.
pub fn finish_reason(
    reason: FinishReason,
    error: Option<String>,
) -> Result<api::FinishReason, ApiError> {
    match reason {
        FinishReason::Stop => Ok(api::FinishReason::Stop),
        FinishReason::Length => Ok(api::FinishReason::Length),
        FinishReason::Cancelled | FinishReason::Error => Err(ApiError::Generation(
            error.unwrap_or_else(|| reason.as_str().to_owned()),
        )),
    }
}

/// How long a stream's headers wait for its first update.
pub const HEADERS_WAIT: Duration = Duration::from_secs(1);

/// The gap between keep-alive comments on a stream with nothing to send.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// One choice's items, `None` once its engine stream ended.
type Tagged = Pin<Box<dyn Stream<Item = (usize, Option<Result<Event, ApiError>>)> + Send>>;

/// What happened to one choice.
#[derive(Debug)]
pub enum Update {
    /// The log-probabilities of the prompt's tokens from the second on (when asked for; before
    /// any delta).
    Prompt {
        index: usize,
        logprobs: Vec<TokenLogprob>,
    },
    /// New text (possibly empty while a character or a stop string is incomplete) and the
    /// tokens' log-probabilities.
    Delta {
        index: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Finished {
        index: usize,
        reason: api::FinishReason,
    },
    Failed {
        index: usize,
        error: ApiError,
    },
}

/// The running answers of one request.
pub struct Choices {
    merged: SelectAll<Tagged>,
    /// Per choice: whether its last update was given out.
    ended: Vec<bool>,
    /// Answers per prompt.
    n: usize,
    usage: engine::Usage,
    /// Each choice's own counts, once its sequence reported them.
    per_choice: Vec<engine::Usage>,
    /// Choices whose engine sequence reported its usage.
    finished: usize,
}

impl Choices {
    /// Submits `n` answers to each of `prompts` (engine requests and their prompt lengths)
    /// under `admission`, in seats for all of them. Fails, cancelling what was already
    /// submitted, if any is refused. `warm_up` prefills the next turn once the answer is
    /// complete, for a request with one answer.
    pub async fn submit(
        state: &AppState,
        admission: &Admission,
        prompts: Vec<(usize, GenerateRequest)>,
        n: usize,
        warm_up: Option<WarmUp>,
    ) -> Result<Self, ApiError> {
        let mut warm_up = warm_up.filter(|_| prompts.len() * n == 1);
        let seats = admission.reserve(state, prompts.len() * n).await?;
        let mut streams = Vec::with_capacity(prompts.len() * n);
        // The first-token deadline is the request's: the first answer must start in time, the
        // others may wait their turn for memory, within the total deadline.
        let mut later = *admission;
        later.deadlines.first_token = later.deadlines.total;
        for (prompt_tokens, request) in prompts {
            for j in 0..n {
                let mut request = request.clone();
                request.sampling.seed = request.sampling.seed.map(|s| s.wrapping_add(j as u64));
                let admission = if streams.is_empty() {
                    admission
                } else {
                    &later
                };
                let events = admission
                    .submit(state, &seats, prompt_tokens, request)
                    .await?;
                streams.push(warm_up::after(events, warm_up.take()));
            }
        }
        Ok(Self::new(streams, n))
    }

    /// The answers whose events are `streams`, `n` per prompt, in index order.
    pub(crate) fn new(streams: Vec<Events>, n: usize) -> Self {
        let ended = vec![false; streams.len()];
        let per_choice = vec![engine::Usage::default(); streams.len()];
        let merged = stream::select_all(streams.into_iter().enumerate().map(|(i, events)| {
            let tagged = events
                .map(Some)
                .chain(stream::once(async { None }))
                .map(move |item| (i, item));
            Box::pin(tagged) as Tagged
        }));
        Self {
            merged,
            ended,
            n,
            usage: engine::Usage::default(),
            per_choice,
            finished: 0,
        }
    }

    /// How many answers run.
    pub fn count(&self) -> usize {
        self.ended.len()
    }

    /// The next update of any choice; `None` once every choice has ended.
    pub async fn next(&mut self) -> Option<Update> {
        loop {
            let (index, item) = self.merged.next().await?;
            if self.ended[index] {
                continue;
            }
            let update = match item {
                Some(Ok(Event::PromptLogprobs(logprobs))) => {
                    return Some(Update::Prompt { index, logprobs })
                }
                Some(Ok(Event::Delta { text, logprobs, .. })) => {
                    return Some(Update::Delta {
                        index,
                        text,
                        logprobs,
                    })
                }
                Some(Ok(Event::Finished {
                    reason,
                    usage,
                    error,
                })) => {
                    self.tally(index, usage);
                    match finish_reason(reason, error) {
                        Ok(reason) => Update::Finished { index, reason },
                        Err(error) => Update::Failed { index, error },
                    }
                }
                Some(Err(error)) => Update::Failed { index, error },
                None => Update::Failed {
                    index,
                    error: ApiError::Internal(LOST_STREAM.into()),
                },
            };
            self.ended[index] = true;
            return Some(update);
        }
    }

    fn tally(&mut self, index: usize, usage: engine::Usage) {
        if index.is_multiple_of(self.n) {
            self.usage.prompt_tokens += usage.prompt_tokens;
            self.usage.cached_tokens += usage.cached_tokens;
        }
        self.usage.completion_tokens += usage.completion_tokens;
        self.per_choice[index] = usage;
        self.finished += 1;
    }

    /// The request's token counts; complete once every choice has finished.
    pub fn usage(&self) -> api::Usage {
        let usage = self.usage;
        api::Usage {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: usage.cached_tokens,
            },
        }
    }

    /// Waits for every answer. The first failure fails the request, cancelling the others.
    pub async fn collect(mut self) -> Result<(Vec<Collected>, api::Usage), ApiError> {
        let mut choices: Vec<Collected> = (0..self.count()).map(|_| Collected::default()).collect();
        while let Some(update) = self.next().await {
            match update {
                Update::Prompt { index, logprobs } => {
                    choices[index].prompt_logprobs = Some(logprobs)
                }
                Update::Delta {
                    index,
                    text,
                    logprobs,
                } => {
                    choices[index].text.push_str(&text);
                    choices[index].logprobs.extend(logprobs);
                }
                Update::Finished { index, reason } => choices[index].finish_reason = Some(reason),
                Update::Failed { error, .. } => return Err(error),
            }
        }
        for (choice, usage) in choices.iter_mut().zip(&self.per_choice) {
            choice.usage = *usage;
        }
        Ok((choices, self.usage()))
    }

    /// The answers as server-sent events in `format`, for [`sse_response`]. This waits for the
    /// first update for up to [`HEADERS_WAIT`], so that a request that fails before any output
    /// (a deadline before its first token) still gets an error status; past that (a long queue
    /// or prefill) the headers go out, and keep-alive comments hold the connection open until
    /// the first token.
    pub async fn stream<F>(
        mut self,
        format: F,
        metrics: Metrics,
    ) -> Result<impl Stream<Item = Frame<F::Chunk>> + Send + 'static, ApiError>
    where
        F: ChunkFormat + Send + 'static,
    {
        // `next` is cancel-safe: a choice's state changes only once an item has arrived.
        let first = tokio::time::timeout(HEADERS_WAIT, self.next())
            .await
            .unwrap_or_default();
        if let Some(Update::Failed { error, .. }) = first {
            return Err(error);
        }
        Ok(self.frames(format, first, metrics))
    }

    /// The answers as server-sent events in `format`. `first` is an update already taken (so
    /// that a failure before any output could still become an error response); failures after
    /// it are counted in `metrics`.
    pub fn frames<F>(
        self,
        format: F,
        first: Option<Update>,
        metrics: Metrics,
    ) -> impl Stream<Item = Frame<F::Chunk>> + Send
    where
        F: ChunkFormat + Send + 'static,
    {
        let pending = (0..self.count())
            .filter_map(|index| format.opening(index))
            .map(Frame::Chunk)
            .collect();
        let mut streamed = Streamed {
            format,
            choices: self,
            pending,
            metrics,
            done: false,
        };
        if let Some(update) = first {
            streamed.on_update(update);
        }
        stream::unfold(streamed, |mut streamed| async move {
            loop {
                if let Some(frame) = streamed.pending.pop_front() {
                    return Some((frame, streamed));
                }
                if streamed.done {
                    return None;
                }
                match streamed.choices.next().await {
                    Some(update) => streamed.on_update(update),
                    None => streamed.finish(),
                }
            }
        })
    }
}

/// One choice's whole answer.
#[derive(Debug, Default)]
pub struct Collected {
    /// Set when the prompt's log-probabilities were asked for.
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    /// Set when the choice finished.
    pub finish_reason: Option<api::FinishReason>,
    /// The choice's own sequence's counts (its prompt, cached part included, and its tokens).
    pub usage: engine::Usage,
}

/// What the streamed chunks of every endpoint carry besides their choices.
pub trait StreamChunk {
    /// Marks a failed choice's last chunk with the error.
    fn set_error(&mut self, error: ErrorBody);
    /// Makes a chunk the one with the request's token counts.
    fn set_usage(&mut self, usage: api::Usage);
}

/// How an endpoint shapes its chunks.
pub trait ChunkFormat {
    type Chunk: StreamChunk + Serialize + Send + 'static;
    /// A chunk without choices.
    fn empty(&self) -> Self::Chunk;
    /// Whether the client asked for the usage chunk (`stream_options.include_usage`).
    fn include_usage(&self) -> bool;
    /// The chunk that opens choice `index`, if the format has one (chat's role chunk).
    fn opening(&self, index: usize) -> Option<Self::Chunk>;
    /// The prompt's log-probabilities for choice `index` (only formats that ask for them get
    /// them).
    fn prompt(&mut self, index: usize, logprobs: &[TokenLogprob]) -> Option<Self::Chunk>;
    /// New text for choice `index`; `None` when there is nothing to send.
    fn delta(
        &mut self,
        index: usize,
        text: String,
        logprobs: &[TokenLogprob],
    ) -> Option<Self::Chunk>;
    /// The last chunk of choice `index`.
    fn finished(&mut self, index: usize, reason: api::FinishReason) -> Self::Chunk;
    /// The last chunk of a choice that failed: `finish_reason: "error"` and `error`.
    fn failed(&mut self, index: usize, error: ErrorBody) -> Self::Chunk {
        let mut chunk = self.finished(index, api::FinishReason::Error);
        chunk.set_error(error);
        chunk
    }
    /// The chunk with the request's token counts, when asked for.
    fn usage(&self, usage: api::Usage) -> Option<Self::Chunk> {
        self.include_usage().then(|| {
            let mut chunk = self.empty();
            chunk.set_usage(usage);
            chunk
        })
    }
}

/// The chunk types share these fields by name, not by type.
macro_rules! stream_chunk {
    ($($chunk:ty),*) => {$(
        impl StreamChunk for $chunk {
            fn set_error(&mut self, error: ErrorBody) {
                self.error = Some(error);
            }

            fn set_usage(&mut self, usage: api::Usage) {
                self.usage = Some(Some(usage));
            }
        }
    )*};
}

stream_chunk!(api::ChatCompletionChunk, api::completions::CompletionChunk);

struct Streamed<F: ChunkFormat> {
    format: F,
    choices: Choices,
    pending: VecDeque<Frame<F::Chunk>>,
    metrics: Metrics,
    done: bool,
}

impl<F: ChunkFormat> Streamed<F> {
    fn on_update(&mut self, update: Update) {
        let chunk = match update {
            Update::Prompt { index, logprobs } => self.format.prompt(index, &logprobs),
            Update::Delta {
                index,
                text,
                logprobs,
            } => self.format.delta(index, text, &logprobs),
            Update::Finished { index, reason } => Some(self.format.finished(index, reason)),
            Update::Failed { index, error } => {
                match &error {
                    ApiError::Internal(detail) => tracing::error!(detail, "stream failed"),
                    other => tracing::warn!(error = %other, "stream failed"),
                }
                // The status is sent: the refusal is counted here, not by the response layer.
                self.metrics.stream_failed(&error);
                Some(self.format.failed(index, error.body()))
            }
        };
        self.pending.extend(chunk.map(Frame::Chunk));
    }

    fn finish(&mut self) {
        if self.choices.finished == self.choices.count() {
            let usage = self.format.usage(self.choices.usage());
            self.pending.extend(usage.map(Frame::Chunk));
        }
        self.pending.push_back(Frame::Done);
        self.done = true;
    }
}

/// The frames as a server-sent events response.
pub fn sse_response<C: Serialize>(
    frames: impl Stream<Item = Frame<C>> + Send + 'static,
) -> Response {
    sse_events(frames.map(|frame| match frame {
        Frame::Chunk(chunk) => {
            // Chunks hold only strings, numbers and lists, which always serialize.
            let data = serde_json::to_string(&chunk).expect("a chunk serializes to JSON");
            SseEvent::default().data(data)
        }
        Frame::Done => SseEvent::default().data("[DONE]"),
    }))
}

/// `events` as a server-sent events response, with keep-alive comments while nothing is sent.
pub fn sse_events(events: impl Stream<Item = SseEvent> + Send + 'static) -> Response {
    let mut response = Sse::new(events.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    // Reverse proxies such as nginx buffer responses by default, which would hold tokens back
    // until the buffer fills.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::{json, Value};

    use super::*;

    /// Choices whose engine events are given, `n` per prompt.
    pub(crate) fn choices_of(events: Vec<Vec<Result<Event, ApiError>>>, n: usize) -> Choices {
        Choices::new(
            events
                .into_iter()
                .map(|e| Box::pin(stream::iter(e)) as Events)
                .collect(),
            n,
        )
    }

    /// The SSE payloads: chunks as JSON, then "[DONE]".
    pub(crate) async fn frames_json<C: Serialize>(
        frames: impl Stream<Item = Frame<C>>,
    ) -> Vec<Value> {
        frames
            .map(|frame| match frame {
                Frame::Chunk(chunk) => serde_json::to_value(&chunk).unwrap(),
                Frame::Done => json!("[DONE]"),
            })
            .collect()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_first_token_gets_headers_then_keep_alive_comments() {
        let slow = stream::pending::<Result<Event, ApiError>>();
        let choices = Choices::new(vec![Box::pin(slow) as Events], 1);
        let response = choices
            .stream(Silent, Metrics::new())
            .await
            .map(sse_response)
            .expect("headers go out without a first update");
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut body = response.into_body().into_data_stream();
        let comment = body.next().await.unwrap().unwrap();
        assert!(comment.starts_with(b":"), "{comment:?}");
    }

    /// A format with nothing to say but the usage.
    struct Silent;

    impl ChunkFormat for Silent {
        type Chunk = api::ChatCompletionChunk;

        fn empty(&self) -> Self::Chunk {
            unreachable!("the stream never ends")
        }

        fn include_usage(&self) -> bool {
            false
        }

        fn opening(&self, _: usize) -> Option<Self::Chunk> {
            None
        }

        fn prompt(&mut self, _: usize, _: &[TokenLogprob]) -> Option<Self::Chunk> {
            None
        }

        fn delta(&mut self, _: usize, _: String, _: &[TokenLogprob]) -> Option<Self::Chunk> {
            None
        }

        fn finished(&mut self, _: usize, _: api::FinishReason) -> Self::Chunk {
            unreachable!("the stream never ends")
        }
    }
}

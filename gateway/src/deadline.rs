//! Per-request deadlines: one for the first token, one for the whole answer.
//!
//! Both run from the moment the request arrived, so time spent waiting for admission counts.
//! [`watch`] wraps a request's engine events: if the first event is late, or the last, it yields
//! an [`ApiError::Timeout`] and ends, dropping the engine's stream, which cancels the sequence
//! and frees its KV blocks at the engine's next step. The engine is also given the total
//! deadline ([`engine::GenerateRequest::deadline`]) so that it frees the memory on its own even
//! if the stream were kept; when the engine's deadline fires first, its error is reported as the
//! same timeout, judged by the clock, not by the engine's message.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use engine::{Event, FinishReason};
use futures::{Stream, StreamExt};
use tokio::time::Sleep;

use crate::error::ApiError;

const FIRST_TOKEN_TIMEOUT: &str = "The request timed out before its first token was generated.";
const TOTAL_TIMEOUT: &str = "The request timed out before its answer was complete.";

/// How long a request may take: to its first token, and in all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timeouts {
    pub first_token: Duration,
    pub total: Duration,
}

impl Timeouts {
    /// The deadlines of a request that arrived at `arrived`.
    pub fn from(&self, arrived: Instant) -> Deadlines {
        Deadlines {
            first_token: arrived + self.first_token,
            total: arrived + self.total,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    pub first_token: Instant,
    pub total: Instant,
}

impl Deadlines {
    /// The error for a request still waiting for its first token at the deadline.
    pub fn first_token_error() -> ApiError {
        ApiError::Timeout(FIRST_TOKEN_TIMEOUT)
    }

    /// The error for a request whose answer is not complete at the deadline.
    pub fn total_error() -> ApiError {
        ApiError::Timeout(TOTAL_TIMEOUT)
    }
}

/// A request's events under its deadlines; see [`watch`].
pub struct Watched<S> {
    /// `None` once the stream has ended, by the engine or by a deadline.
    events: Option<S>,
    timer: Pin<Box<Sleep>>,
    total: Instant,
    started: bool,
}

/// `events` as `Ok` items, ended by one `Err(Timeout)` if a deadline passes first.
pub fn watch<S>(events: S, deadlines: Deadlines) -> Watched<S> {
    let first = deadlines.first_token.min(deadlines.total);
    Watched {
        events: Some(events),
        timer: Box::pin(tokio::time::sleep_until(first.into())),
        total: deadlines.total,
        started: false,
    }
}

impl<S> Watched<S> {
    /// Ends the stream with a timeout; dropping the engine's stream cancels the sequence.
    fn expire(&mut self) -> ApiError {
        self.events = None;
        if self.started {
            Deadlines::total_error()
        } else {
            Deadlines::first_token_error()
        }
    }
}

impl<S: Stream<Item = Event> + Unpin> Stream for Watched<S> {
    type Item = Result<Event, ApiError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(events) = this.events.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(event) = events.poll_next_unpin(cx) {
            let Some(event) = event else {
                this.events = None;
                return Poll::Ready(None);
            };
            if !this.started {
                this.started = true;
                this.timer.as_mut().reset(this.total.into());
            }
            let failed = matches!(
                event,
                Event::Finished {
                    reason: FinishReason::Error,
                    ..
                }
            );
            if failed && Instant::now() >= this.total {
                return Poll::Ready(Some(Err(this.expire())));
            }
            return Poll::Ready(Some(Ok(event)));
        }
        ready!(this.timer.as_mut().poll(cx));
        Poll::Ready(Some(Err(this.expire())))
    }
}

#[cfg(test)]
mod tests {
    use engine::Usage;

    use super::*;

    fn delta() -> Event {
        Event::Delta {
            text: "x".into(),
            tokens: vec![1],
            logprobs: Vec::new(),
        }
    }

    fn deadlines(first_token_ms: u64, total_ms: u64) -> Deadlines {
        Timeouts {
            first_token: Duration::from_millis(first_token_ms),
            total: Duration::from_millis(total_ms),
        }
        .from(Instant::now())
    }

    /// Events sent on a channel `gap` apart, ending with `Finished` unless `endless`.
    fn paced(count: usize, gap: Duration) -> impl Stream<Item = Event> + Unpin {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            for _ in 0..count {
                tokio::time::sleep(gap).await;
                if tx.send(delta()).is_err() {
                    return;
                }
            }
            let _ = tx.send(Event::Finished {
                reason: FinishReason::Stop,
                usage: Usage::default(),
                error: None,
            });
        });
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
    }

    async fn outcome(events: impl Stream<Item = Event> + Unpin, d: Deadlines) -> Vec<String> {
        watch(events, d)
            .map(|item| match item {
                Ok(Event::PromptLogprobs(_)) => "prompt logprobs".to_owned(),
                Ok(Event::Delta { .. }) => "delta".to_owned(),
                Ok(Event::Finished { .. }) => "finished".to_owned(),
                Err(ApiError::Timeout(m)) if m == FIRST_TOKEN_TIMEOUT => "first".to_owned(),
                Err(ApiError::Timeout(_)) => "total".to_owned(),
                Err(other) => panic!("{other:?}"),
            })
            .collect()
            .await
    }

    #[tokio::test]
    async fn in_time_passes_through() {
        let seen = outcome(paced(3, Duration::from_millis(5)), deadlines(5_000, 5_000)).await;
        assert_eq!(seen, ["delta", "delta", "delta", "finished"]);
    }

    #[tokio::test]
    async fn a_late_first_token_times_out() {
        let seen = outcome(paced(3, Duration::from_secs(5)), deadlines(20, 60_000)).await;
        assert_eq!(seen, ["first"]);
    }

    #[tokio::test]
    async fn a_late_end_times_out_after_the_tokens_that_came() {
        let seen = outcome(
            paced(1_000, Duration::from_millis(20)),
            deadlines(5_000, 150),
        )
        .await;
        assert_eq!(seen.last().unwrap(), "total");
        assert!(
            seen.len() > 2 && seen[..seen.len() - 1].iter().all(|s| s == "delta"),
            "{seen:?}"
        );
    }

    #[tokio::test]
    async fn the_engines_own_deadline_error_is_the_timeout() {
        let d = deadlines(0, 0);
        let failed = Event::Finished {
            reason: FinishReason::Error,
            usage: Usage::default(),
            error: Some("any wording".into()),
        };
        let seen = outcome(futures::stream::iter([delta(), failed]), d).await;
        assert_eq!(seen, ["delta", "total"]);
    }
}

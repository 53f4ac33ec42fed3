//! What the server lets in: per-caller rate limits, a bounded admission queue, and deadlines.
//!
//! Work requests (every `POST /v1/...`) pass [`admit`], a layer after authentication, in this
//! order:
//! 1. requests per minute: one unit from the caller's `rpm` bucket, else 429 with
//!    `Retry-After`;
//! 2. the admission queue: a slot among `max_concurrent_requests` at once, waiting in line
//!    (first come, first served) when all are taken; when `max_queued_requests` already wait,
//!    503 at once. The wait counts toward the first-token deadline: a request still in line
//!    when it passes gets 504. The slot is held until the response body is finished, so a
//!    stream holds its slot while it streams;
//! 3. the handler, given an [`Admission`]: [`Admission::submit`] charges tokens per minute
//!    (prompt plus `max_tokens`, else 429), gives the engine the total deadline, and watches
//!    both deadlines and the metrics while the answer runs. When the answer ends, the tokens it
//!    did not generate are given back.
//!
//! Limits are per [`Caller`]: per API key when keys are configured; without keys all traffic
//! is one caller, so `rpm` and `tpm` bound the server as a whole (per-client limits need a key
//! per client: addresses behind proxies and NATs do not name clients). A request costing more
//! tokens than a whole minute's quota is charged the whole quota: it waits for a full bucket
//! and empties it, rather than failing forever.
//!
//! Memory stays flat under any load: the queue is a semaphore with a counted, bounded line of
//! waiters; a refused request leaves nothing behind; buckets are bounded by the
//! [`StateStore`](crate::state::StateStore).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use engine::{Event, GenerateRequest};
use futures::{Stream, StreamExt};
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::app::AppState;
use crate::auth::Caller;
use crate::config::ServeConfig;
use crate::deadline::{self, Deadlines, Timeouts};
use crate::error::ApiError;
use crate::state::{Quota, StateStore, Take};

/// The server's limits, shared by every request.
pub struct Limits {
    store: Arc<dyn StateStore>,
    rpm: Option<Quota>,
    tpm: Option<Quota>,
    queue: AdmissionQueue,
    timeouts: Timeouts,
}

impl Limits {
    /// The limits `config` sets, with buckets in `store`. `config` must have passed
    /// [`ServeConfig::validate`].
    pub fn new(config: &ServeConfig, store: Arc<dyn StateStore>) -> Self {
        Self {
            store,
            rpm: Quota::per_minute(config.rpm),
            tpm: Quota::per_minute(config.tpm),
            queue: AdmissionQueue::new(config.max_concurrent_requests, config.max_queued_requests),
            timeouts: config.timeouts(),
        }
    }

    /// Whether the limits can be applied now (their store answers).
    pub async fn ready(&self) -> Result<(), ApiError> {
        self.store.ping().await
    }

    /// Takes one request from `caller`'s requests-per-minute bucket.
    async fn check_rate(&self, caller: Caller) -> Result<(), ApiError> {
        let Some(quota) = self.rpm else {
            return Ok(());
        };
        match self.store.take(&format!("rpm:{caller}"), quota, 1).await? {
            Take::Granted => Ok(()),
            Take::Denied { retry_after } => Err(ApiError::RateLimited {
                message: format!(
                    "Rate limit reached for requests per minute (limit {}); retry in {} s.",
                    quota.capacity(),
                    retry_after.as_secs_f64().ceil()
                ),
                retry_after,
            }),
        }
    }

    /// Takes `tokens` (at most the whole quota) from `caller`'s tokens-per-minute bucket.
    async fn charge_tokens(&self, caller: Caller, tokens: u64) -> Result<TokenCharge, ApiError> {
        let Some(quota) = self.tpm else {
            return Ok(TokenCharge(None));
        };
        self.charge(format!("tpm:{caller}"), quota, tokens, |retry| {
            format!(
                "Rate limit reached for tokens per minute (limit {}, requested {tokens}); \
                 retry in {retry} s, or ask for fewer max_tokens.",
                quota.capacity(),
            )
        })
        .await
    }

    /// Takes `tokens` (at most the whole budget) from the token budget of the agent `agent`,
    /// `per_minute` tokens a minute shared by every caller; `None` is no budget.
    pub async fn charge_agent(
        &self,
        agent: &str,
        per_minute: Option<u64>,
        tokens: u64,
    ) -> Result<TokenCharge, ApiError> {
        let Some(quota) = per_minute.and_then(Quota::per_minute) else {
            return Ok(TokenCharge(None));
        };
        self.charge(format!("agent-tpm:{agent}"), quota, tokens, |retry| {
            format!(
                "The agent `{agent}` has used its token budget (limit {} tokens per minute, \
                 requested {tokens}); retry in {retry} s.",
                quota.capacity(),
            )
        })
        .await
    }

    /// Takes `tokens`, capped at the quota, from `bucket`; a refusal is a 429 whose message
    /// `refused` writes from the seconds to wait.
    async fn charge(
        &self,
        bucket: String,
        quota: Quota,
        tokens: u64,
        refused: impl FnOnce(f64) -> String,
    ) -> Result<TokenCharge, ApiError> {
        let amount = tokens.min(quota.capacity());
        match self.store.take(&bucket, quota, amount).await? {
            Take::Granted => Ok(TokenCharge(Some(Charged {
                store: self.store.clone(),
                bucket,
                quota,
                amount,
            }))),
            Take::Denied { retry_after } => Err(ApiError::RateLimited {
                message: refused(retry_after.as_secs_f64().ceil()),
                retry_after,
            }),
        }
    }
}

/// Tokens taken from a bucket for one request; [`TokenCharge::settle`] gives back what the
/// request did not use.
#[must_use = "settle the charge with the tokens used"]
pub struct TokenCharge(Option<Charged>);

struct Charged {
    store: Arc<dyn StateStore>,
    bucket: String,
    quota: Quota,
    amount: u64,
}

impl TokenCharge {
    /// The request used `used` tokens in all; the rest of the charge goes back to the bucket.
    pub fn settle(self, used: u64) {
        let Some(charged) = self.0 else { return };
        let unused = charged.amount.saturating_sub(used);
        if unused == 0 {
            return;
        }
        // Settled from inside a stream, which cannot wait on the store.
        tokio::spawn(async move {
            let given = charged
                .store
                .give_back(&charged.bucket, charged.quota, unused);
            if let Err(e) = given.await {
                tracing::warn!(error = %e, "could not give back unused tokens");
            }
        });
    }
}

/// At most `running` requests at once and `waiting` more in line; the rest are refused.
struct AdmissionQueue {
    slots: Arc<Semaphore>,
    running: usize,
    waiting: AtomicUsize,
    max_waiting: usize,
}

/// One request's place in the line; leaving (admitted, refused or gone) frees it.
struct InLine<'a>(&'a AtomicUsize);

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl AdmissionQueue {
    fn new(running: usize, max_waiting: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(running)),
            running,
            waiting: AtomicUsize::new(0),
            max_waiting,
        }
    }

    /// A slot, at once or after waiting in line; `Overloaded` when the line is full.
    async fn enter(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        // The semaphore hands freed permits to waiters first, so this cannot jump the line.
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        let joined = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_waiting).then_some(n + 1)
            });
        if joined.is_err() {
            return Err(ApiError::Overloaded(format!(
                "{} requests running and {} waiting",
                self.running, self.max_waiting
            )));
        }
        let _in_line = InLine(&self.waiting);
        // The semaphore is never closed.
        Ok(self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the admission semaphore stays open"))
    }
}

/// What [`admit`] grants a work request: whom it counts against and when it must be done.
#[derive(Clone, Copy, Debug)]
pub struct Admission {
    pub caller: Caller,
    pub arrived: Instant,
    pub deadlines: Deadlines,
}

impl<S: Send + Sync> FromRequestParts<S> for Admission {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts.extensions.get::<Admission>().copied().ok_or_else(|| {
            ApiError::Internal("a work request reached its handler without admission".into())
        })
    }
}

impl Admission {
    /// Runs `request` (whose prompt is `prompt_tokens` long) on the engine under this request's
    /// limits: charges its tokens, sets its deadline, and returns its events, ended by an `Err`
    /// if a deadline passes first. Dropping the stream cancels the request.
    pub async fn submit(
        &self,
        state: &AppState,
        prompt_tokens: usize,
        request: GenerateRequest,
    ) -> Result<impl Stream<Item = Result<Event, ApiError>> + Send + Unpin + 'static, ApiError>
    {
        self.submit_as(state, prompt_tokens, request, None).await
    }

    /// [`Admission::submit`], with the request's metrics also counted as `agent`'s.
    pub async fn submit_as(
        &self,
        state: &AppState,
        prompt_tokens: usize,
        mut request: GenerateRequest,
        agent: Option<&str>,
    ) -> Result<impl Stream<Item = Result<Event, ApiError>> + Send + Unpin + 'static, ApiError>
    {
        let cost = (prompt_tokens + request.max_tokens) as u64;
        let charge = state.limits().charge_tokens(self.caller, cost).await?;
        request.deadline = Some(self.deadlines.total);
        let events = match state.transport().submit(agent, request).await {
            Ok(events) => events,
            Err(e) => {
                charge.settle(0);
                return Err(e.into());
            }
        };
        let mut charge = Some(charge);
        let events = events.inspect(move |event| {
            if let (Event::Finished { usage, .. }, Some(charge)) = (event, charge.take()) {
                charge.settle((usage.prompt_tokens + usage.completion_tokens) as u64);
            }
        });
        let events = deadline::watch(events, self.deadlines);
        Ok(state.metrics().observe(events, self.arrived, agent))
    }
}

/// Whether a request is work for the engine, and so limited: `POST /v1/...`, except the
/// agent administration (an admin's edit, which must not wait behind the traffic it manages).
fn is_work(request: &Request) -> bool {
    let path = request.uri().path();
    request.method() == Method::POST && path.starts_with("/v1/") && path != "/v1/agents"
}

/// The layer: rate limit, then a slot in the admission queue, then the handler; the slot is
/// released when the response body is done. Other requests pass untouched.
pub async fn admit(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    if !is_work(&request) {
        return next.run(request).await;
    }
    let arrived = Instant::now();
    let limits = state.limits();
    let caller = request
        .extensions()
        .get::<Caller>()
        .copied()
        .unwrap_or_default();
    let deadlines = limits.timeouts.from(arrived);
    let admitted = async {
        limits.check_rate(caller).await?;
        tokio::time::timeout_at(deadlines.first_token.into(), limits.queue.enter())
            .await
            .map_err(|_| Deadlines::first_token_error())?
    };
    let slot = match admitted.await {
        Ok(slot) => slot,
        Err(error) => return error.into_response(),
    };
    state.metrics().queued(arrived.elapsed());
    request.extensions_mut().insert(Admission {
        caller,
        arrived,
        deadlines,
    });
    next.run(request)
        .await
        .map(|body| Body::new(Holding { body, _slot: slot }))
}

/// A response body that holds its request's admission slot until it is done or dropped.
struct Holding {
    body: Body,
    _slot: OwnedSemaphorePermit,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::time::Duration;

    use super::*;

    fn limits(config: ServeConfig) -> Limits {
        Limits::new(&config, Arc::new(crate::state::MemoryStore::new()))
    }

    /// Polls `future` once: whether it finished, and the future to keep polling.
    fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        let waker = futures::task::noop_waker();
        Pin::new(future).poll(&mut Context::from_waker(&waker))
    }

    #[tokio::test]
    async fn the_queue_admits_then_lines_up_then_refuses() {
        let queue = AdmissionQueue::new(2, 1);
        let first = queue.enter().await.unwrap();
        let _second = queue.enter().await.unwrap();
        let mut third = Box::pin(queue.enter());
        assert!(
            poll_once(&mut third).is_pending(),
            "all slots taken: it waits"
        );
        assert_eq!(queue.waiting.load(Ordering::Acquire), 1);
        let refused = queue.enter().await.unwrap_err();
        assert!(
            matches!(refused, ApiError::Overloaded(_)),
            "the line is full"
        );
        drop(first);
        assert!(
            poll_once(&mut third).is_ready(),
            "a freed slot goes to the line"
        );
        assert_eq!(queue.waiting.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn a_request_that_gives_up_leaves_the_line() {
        let queue = AdmissionQueue::new(1, 1);
        let slot = queue.enter().await.unwrap();
        let mut waiter = Box::pin(queue.enter());
        assert!(poll_once(&mut waiter).is_pending());
        drop(waiter);
        assert_eq!(queue.waiting.load(Ordering::Acquire), 0);
        drop(slot);
        let _again = queue.enter().await.expect("neither slot nor place leaked");
    }

    #[tokio::test]
    async fn requests_per_minute_are_per_caller() {
        let limits = limits(ServeConfig {
            rpm: 2,
            ..ServeConfig::default()
        });
        let alice = Caller::Anonymous;
        limits.check_rate(alice).await.unwrap();
        limits.check_rate(alice).await.unwrap();
        let Err(ApiError::RateLimited { retry_after, .. }) = limits.check_rate(alice).await else {
            panic!("the third request in a minute must be refused");
        };
        assert!(retry_after > Duration::from_secs(25) && retry_after <= Duration::from_secs(30));
        let unlimited = self::limits(ServeConfig::default());
        for _ in 0..100 {
            unlimited.check_rate(alice).await.unwrap();
        }
    }

    #[tokio::test]
    async fn tokens_are_charged_up_front_and_the_unused_given_back() {
        let limits = limits(ServeConfig {
            tpm: 100,
            ..ServeConfig::default()
        });
        let caller = Caller::Anonymous;
        // More than a minute's quota is charged as the whole quota, not refused forever.
        let charge = limits.charge_tokens(caller, 150).await.unwrap();
        assert!(matches!(
            limits.charge_tokens(caller, 10).await,
            Err(ApiError::RateLimited { .. })
        ));
        charge.settle(40);
        // The give-back runs on its own task.
        tokio::task::yield_now().await;
        let _again = limits.charge_tokens(caller, 60).await.unwrap();
        assert!(matches!(
            limits.charge_tokens(caller, 10).await,
            Err(ApiError::RateLimited { .. })
        ));
    }
}

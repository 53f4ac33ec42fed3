//! What the server lets in: per-caller rate limits, a bounded admission queue counted in
//! sequences, and deadlines. Every path that runs the engine passes here: HTTP and gRPC
//! requests, the swarm's hops, and the internal agents (router, verifier) serving a request.
//!
//! A work request (every `POST /v1/...`, and every gRPC chat) is admitted in three steps:
//! 1. [`Limits::admit`], before its body is read: one unit from the caller's `rpm` bucket,
//!    else 429 with `Retry-After`. The request gets an [`Admission`]: its caller, its deadlines
//!    and its priority. Over HTTP the [`admit`] layer does this, after authentication.
//! 2. [`Admission::reserve`], once its body is parsed and it knows how many sequences it runs at
//!    once (`n` choices, consensus samples, one for a verification): seats for all of them
//!    together among `max_concurrent_requests`, waiting in line (first come, first served)
//!    when they are taken; when `max_queued_requests` already wait, 503 at once. A request
//!    never holds part of its seats while waiting for the rest, so no two requests can hold
//!    each other up. The wait counts toward the first-token deadline: a request still in line
//!    when it passes gets 504. The seats are released when the last of the request's streams
//!    is dropped, so a stream holds its seats while it streams.
//! 3. [`Admission::submit`] per engine call: charges tokens per minute (prompt plus
//!    `max_tokens`, else 429), gives the engine the total deadline and the request's priority,
//!    and watches both deadlines and the metrics while the answer runs. When the answer ends,
//!    the tokens it did not generate are given back. [`Admission::engine`] is the same for the
//!    router and the verifier: their calls run in the request's seats, at its priority, charged
//!    to its caller.
//!
//! Limits are per [`Caller`]: per API key when keys are configured (a key may have its own
//! `rpm` and `tpm`, see [`crate::auth::KeyPolicy`]); without keys all traffic
//! is one caller, so `rpm` and `tpm` bound the server as a whole (per-client limits need a key
//! per client: addresses behind proxies and NATs do not name clients). A request costing more
//! tokens than a whole minute's quota is charged the whole quota: it waits for a full bucket
//! and empties it, rather than failing forever. A request that runs more sequences at once
//! than there are seats can never run: a 400 says so.
//!
//! Memory stays flat under any load: the queue is a semaphore with a counted, bounded line of
//! waiters; a refused request leaves nothing behind; buckets are bounded by the
//! [`StateStore`](crate::state::StateStore).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth::{Caller, KeyPolicies};
use crate::config::ServeConfig;
use crate::deadline::{Deadlines, Timeouts};
use crate::error::ApiError;
use crate::state::{Quota, StateStore, Take};

/// The server's limits, shared by every request.
pub struct Limits {
    store: Arc<dyn StateStore>,
    rpm: Option<Quota>,
    tpm: Option<Quota>,
    /// Keys' own `rpm` and `tpm`, in place of the two above.
    policies: KeyPolicies,
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
            policies: KeyPolicies::new(config.api_keys.iter().chain(&config.admin_keys)),
            queue: AdmissionQueue::new(config.max_concurrent_requests, config.max_queued_requests),
            timeouts: config.timeouts(),
        }
    }

    /// Whether the limits can be applied now (their store answers).
    pub async fn ready(&self) -> Result<(), ApiError> {
        Ok(self.store.ping().await?)
    }

    /// Takes one request from `caller`'s requests-per-minute bucket.
    async fn check_rate(&self, caller: Caller) -> Result<(), ApiError> {
        let own = self.policies.get(caller).rpm;
        let Some(quota) = own.map_or(self.rpm, Quota::per_minute) else {
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
    pub async fn charge_tokens(
        &self,
        caller: Caller,
        tokens: u64,
    ) -> Result<TokenCharge, ApiError> {
        let own = self.policies.get(caller).tpm;
        let Some(quota) = own.map_or(self.tpm, Quota::per_minute) else {
            return Ok(TokenCharge::default());
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
            return Ok(TokenCharge::default());
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
            Take::Granted => Ok(TokenCharge(vec![Charged {
                store: self.store.clone(),
                bucket,
                quota,
                amount,
            }])),
            Take::Denied { retry_after } => Err(ApiError::RateLimited {
                message: refused(retry_after.as_secs_f64().ceil()),
                retry_after,
            }),
        }
    }
}

/// Tokens taken from buckets (the caller's, an agent's budget) for one engine call;
/// [`TokenCharge::settle`] gives back to each what the call did not use.
#[must_use = "settle the charge with the tokens used"]
#[derive(Default)]
pub struct TokenCharge(Vec<Charged>);

struct Charged {
    store: Arc<dyn StateStore>,
    bucket: String,
    quota: Quota,
    amount: u64,
}

impl TokenCharge {
    /// This charge and `other`, settled together.
    pub fn and(mut self, other: TokenCharge) -> Self {
        self.0.extend(other.0);
        self
    }

    /// The call used `used` tokens in all; the rest of each charge goes back to its bucket.
    pub fn settle(self, used: u64) {
        for charged in self.0 {
            let unused = charged.amount.saturating_sub(used);
            if unused == 0 {
                continue;
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

    /// Seats for `sequences`, at once or after waiting in line; `Overloaded` when the line is
    /// full, and a 400 when there are not that many seats at all.
    async fn enter(&self, sequences: usize) -> Result<OwnedSemaphorePermit, ApiError> {
        if sequences > self.running {
            return Err(ApiError::invalid_request(format!(
                "this request runs {sequences} sequences at once (its n choices or samples); \
                 this server runs at most {} at once",
                self.running
            )));
        }
        let seats = sequences.max(1) as u32;
        // The semaphore hands freed permits to waiters first, so this cannot jump the line.
        if let Ok(slot) = self.slots.clone().try_acquire_many_owned(seats) {
            return Ok(slot);
        }
        let joined = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_waiting).then_some(n + 1)
            });
        if joined.is_err() {
            return Err(ApiError::Overloaded(format!(
                "{} sequences running and {} requests waiting",
                self.running, self.max_waiting
            )));
        }
        let _in_line = InLine(&self.waiting);
        // The semaphore is never closed.
        Ok(self
            .slots
            .clone()
            .acquire_many_owned(seats)
            .await
            .expect("the admission semaphore stays open"))
    }
}

/// What [`Limits::admit`] grants a work request: whom it counts against, when it must be
/// done, and at what priority its sequences run.
#[derive(Clone, Copy, Debug)]
pub struct Admission {
    pub caller: Caller,
    pub arrived: Instant,
    pub deadlines: Deadlines,
    /// The engine priority of every sequence the request runs, its internal agents' included.
    pub priority: i32,
    /// Tokens at the start of its prompts that every caller shares (an agent's system prompt):
    /// their prefix-cache blocks are everyone's; the rest are the caller's alone.
    pub shared_prefix: usize,
}

impl<S: Send + Sync> FromRequestParts<S> for Admission {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts.extensions.get::<Admission>().copied().ok_or_else(|| {
            ApiError::Internal("a work request reached its handler without admission".into())
        })
    }
}

/// A request's seats in the admission queue. Every stream the request runs holds a clone; the
/// seats are free again when the last is dropped.
#[derive(Clone, Debug)]
pub struct Seats {
    _held: Arc<OwnedSemaphorePermit>,
}

/// Whether a request is work for the engine, and so limited: `POST /v1/...`, except the
/// agent administration (an admin's edit, which must not wait behind the traffic it manages).
fn is_work(request: &Request) -> bool {
    let path = request.uri().path();
    request.method() == Method::POST && path.starts_with("/v1/") && path != "/v1/agents"
}

impl Limits {
    /// Seats for `sequences` sequences at once, waiting in line until `until` at most (step 2
    /// of the module header).
    pub async fn seats(&self, sequences: usize, until: Instant) -> Result<Seats, ApiError> {
        let seats = tokio::time::timeout_at(until.into(), self.queue.enter(sequences))
            .await
            .map_err(|_| Deadlines::first_token_error())??;
        Ok(Seats {
            _held: Arc::new(seats),
        })
    }

    /// Admits a work request from `caller` that arrived at `arrived` (step 1 of the module
    /// header): its rate, then its deadlines.
    pub async fn admit(&self, caller: Caller, arrived: Instant) -> Result<Admission, ApiError> {
        self.check_rate(caller).await?;
        Ok(Admission {
            caller,
            arrived,
            deadlines: self.timeouts.from(arrived),
            priority: 0,
            shared_prefix: 0,
        })
    }
}

/// The layer: [`Limits::admit`] for work requests, before their bodies are read; the handler
/// reserves its seats once it knows how many sequences it runs. Other requests pass untouched.
pub async fn admit(
    State(limits): State<Arc<Limits>>,
    mut request: Request,
    next: Next,
) -> Response {
    if !is_work(&request) {
        return next.run(request).await;
    }
    let caller = request
        .extensions()
        .get::<Caller>()
        .copied()
        .unwrap_or_default();
    match limits.admit(caller, Instant::now()).await {
        Ok(admission) => {
            request.extensions_mut().insert(admission);
            next.run(request).await
        }
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};
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
        let first = queue.enter(1).await.unwrap();
        let _second = queue.enter(1).await.unwrap();
        let mut third = Box::pin(queue.enter(1));
        assert!(
            poll_once(&mut third).is_pending(),
            "all slots taken: it waits"
        );
        assert_eq!(queue.waiting.load(Ordering::Acquire), 1);
        let refused = queue.enter(1).await.unwrap_err();
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
    async fn a_request_takes_all_its_seats_at_once() {
        let queue = AdmissionQueue::new(4, 2);
        let three = queue.enter(3).await.unwrap();
        let mut two = Box::pin(queue.enter(2));
        assert!(
            poll_once(&mut two).is_pending(),
            "one seat free: it waits for both"
        );
        let mut all = Box::pin(queue.enter(4));
        assert!(
            poll_once(&mut all).is_pending(),
            "the free seat is the first in line's: no one jumps it"
        );
        drop(three);
        let Poll::Ready(two) = poll_once(&mut two) else {
            panic!("freed seats go to the line, in order");
        };
        assert!(
            poll_once(&mut all).is_pending(),
            "two seats are still taken"
        );
        drop(two.unwrap());
        assert!(poll_once(&mut all).is_ready());
        let never = queue.enter(5).await.unwrap_err();
        assert_eq!(never.status(), axum::http::StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn a_request_that_gives_up_leaves_the_line() {
        let queue = AdmissionQueue::new(1, 1);
        let slot = queue.enter(1).await.unwrap();
        let mut waiter = Box::pin(queue.enter(1));
        assert!(poll_once(&mut waiter).is_pending());
        drop(waiter);
        assert_eq!(queue.waiting.load(Ordering::Acquire), 0);
        drop(slot);
        let _again = queue.enter(1).await.expect("neither slot nor place leaked");
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

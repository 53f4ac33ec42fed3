//! Engine calls under a request's limits: [`Admission::reserve`] takes the request's seats,
//! [`Admission::submit`] runs one engine call charged to its caller under its deadlines and in
//! the metrics, and [`Admission::engine`] is the same for the internal agents (router,
//! verifier) serving the request. [`crate::limits`] holds the limits themselves and states the
//! admission's steps.

use std::pin::Pin;
use std::sync::Arc;

use engine::{
    EngineError, Event, EventStream, Generate, GenerateRequest, ModelInfo, Prompt, RequestId,
};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};

use crate::deadline::{self, Deadlines};
use crate::error::ApiError;
use crate::limits::{Admission, Seats, TokenCharge};
use crate::service::AppState;

/// An engine call's events, ended by an `Err` if a deadline passes first.
pub type Events = Pin<Box<dyn Stream<Item = Result<Event, ApiError>> + Send>>;

impl Admission {
    /// Seats for `sequences` sequences at once; see the module header.
    pub async fn reserve(&self, state: &AppState, sequences: usize) -> Result<Seats, ApiError> {
        let seats = state
            .limits()
            .seats(sequences, self.deadlines.first_token)
            .await?;
        state.metrics().queued(self.arrived.elapsed());
        Ok(seats)
    }

    /// Runs `request` (whose prompt is `prompt_tokens` long) on the engine in `seats` under
    /// this request's limits: charges its tokens, sets its deadline and priority class, and returns
    /// its events, ended by an `Err` if a deadline passes first. Dropping the stream cancels
    /// the request.
    pub async fn submit(
        &self,
        state: &AppState,
        seats: &Seats,
        prompt_tokens: usize,
        request: GenerateRequest,
    ) -> Result<Events, ApiError> {
        self.submit_as(
            state,
            seats,
            prompt_tokens,
            request,
            None,
            TokenCharge::default(),
        )
        .await
    }

    /// [`Admission::submit`], with the request's metrics also counted as `agent`'s, and
    /// `budget` (taken from the agent's own budget) settled with the caller's charge.
    pub async fn submit_as(
        &self,
        state: &AppState,
        seats: &Seats,
        prompt_tokens: usize,
        mut request: GenerateRequest,
        agent: Option<&str>,
        budget: TokenCharge,
    ) -> Result<Events, ApiError> {
        let cost = (prompt_tokens + request.max_tokens) as u64;
        let charge = match state.limits().charge_tokens(self.caller, cost).await {
            Ok(charge) => charge.and(budget),
            Err(e) => {
                budget.settle(0);
                return Err(e);
            }
        };
        request.deadline = Some(self.deadlines.total);
        // The request's own priority (from its `priority`) shifts its agent's class.
        request.priority = self.priority.saturating_add(request.priority);
        request.cache_salt = self.caller.cache_salt(self.shared_prefix);
        let events = match state.transport().submit(agent, request).await {
            Ok(events) => events,
            Err(e) => {
                charge.settle(0);
                return Err(e.into());
            }
        };
        let mut charge = Some(charge);
        // The stream owns a share of the seats: they are free once every stream is dropped.
        let seats = seats.clone();
        let events = events.inspect(move |event| {
            let _seats = &seats;
            if let (Event::Finished { usage, .. }, Some(charge)) = (event, charge.take()) {
                charge.settle((usage.prompt_tokens + usage.completion_tokens) as u64);
            }
        });
        let events = deadline::watch(events, self.deadlines);
        Ok(Box::pin(state.metrics().observe(
            events,
            self.arrived,
            agent,
        )))
    }

    /// Runs `work` (done outside the engine, such as embeddings) in `seats` under this
    /// request's limits: `tokens` at most charged to the caller up front, the unused given back
    /// once `work` reports what it used, and the total deadline.
    pub async fn run_outside_engine<T>(
        &self,
        state: &AppState,
        _seats: &Seats,
        tokens: u64,
        work: impl std::future::Future<Output = Result<(T, u64), ApiError>>,
    ) -> Result<T, ApiError> {
        let charge = state.limits().charge_tokens(self.caller, tokens).await?;
        match tokio::time::timeout_at(self.deadlines.total.into(), work).await {
            Ok(Ok((done, used))) => {
                charge.settle(used);
                Ok(done)
            }
            Ok(Err(e)) => {
                charge.settle(0);
                Err(e)
            }
            Err(_) => {
                charge.settle(0);
                Err(Deadlines::total_error())
            }
        }
    }

    /// The engine as the router and the verifier see it while they serve this request: each
    /// call runs as `agent`'s (the internal agent's name, for the transport and the metrics),
    /// in `seats`, at this request's priority, charged to its caller. A call the limits refuse,
    /// or end at a deadline, fails; [`AdmittedEngine::refusal`] then tells why, to answer with
    /// that instead.
    pub fn engine(&self, state: &AppState, seats: &Seats, agent: Option<&str>) -> AdmittedEngine {
        AdmittedEngine {
            state: state.clone(),
            admission: Admission {
                shared_prefix: 0,
                ..*self
            },
            seats: seats.clone(),
            agent: agent.map(str::to_owned),
            refusal: Arc::default(),
        }
    }
}

/// An internal agent's engine for one request; see [`Admission::engine`].
pub struct AdmittedEngine {
    state: AppState,
    admission: Admission,
    seats: Seats,
    agent: Option<String>,
    /// Set by a call's submission, or by its relay when a deadline ends it.
    refusal: Arc<std::sync::Mutex<Option<ApiError>>>,
}

impl AdmittedEngine {
    /// Why the limits refused or ended the last call they refused or ended, if they did: the
    /// error to answer with (a 429, a 503, a 504), rather than the engine error the agent saw.
    pub fn refusal(&self) -> Option<ApiError> {
        self.refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// `error` as the request's answer: the refusal behind it, when there was one.
    pub fn explain(&self, error: impl Into<ApiError>) -> ApiError {
        self.refusal().unwrap_or_else(|| error.into())
    }
}

impl Generate for AdmittedEngine {
    fn model(&self) -> &ModelInfo {
        self.state.model()
    }

    fn submit(&self, mut request: GenerateRequest) -> BoxFuture<'_, engine::Result<EventStream>> {
        Box::pin(async move {
            // Tokenized once here: the charge needs the length, the engine the tokens.
            let model = self.state.model_named(request.model.as_deref());
            let prompt = model.check(&request)?;
            let prompt_tokens = prompt.len();
            request.prompt = Prompt::Tokens(prompt);
            let submitted = self
                .admission
                .submit_as(
                    &self.state,
                    &self.seats,
                    prompt_tokens,
                    request,
                    self.agent.as_deref(),
                    TokenCharge::default(),
                )
                .await;
            let mut events = match submitted {
                Ok(events) => events,
                Err(refused) => {
                    let message = refused.to_string();
                    *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(refused);
                    return Err(EngineError::Overloaded(message));
                }
            };
            // The agent reads an engine stream: relay the admitted events into one. The relay
            // ends when either side does, so dropping the agent's stream cancels the call, and
            // an agent that stops reading holds up the relay, and so the engine's buffer.
            let (tx, rx) = engine::event_channel();
            let refusal = self.refusal.clone();
            tokio::spawn(async move {
                loop {
                    let event = tokio::select! {
                        () = tx.closed() => return,
                        event = events.next() => event,
                    };
                    let event = match event {
                        Some(Ok(event)) => event,
                        Some(Err(e)) => {
                            let error = Some(e.to_string());
                            *refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                            Event::Finished {
                                reason: engine::FinishReason::Error,
                                usage: engine::Usage::default(),
                                error,
                            }
                        }
                        None => return,
                    };
                    let last = matches!(event, Event::Finished { .. });
                    if tx.send(event).await.is_err() || last {
                        return;
                    }
                }
            });
            Ok(EventStream::new(RequestId(0), prompt_tokens, rx))
        })
    }
}

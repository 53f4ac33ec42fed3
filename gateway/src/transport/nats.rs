//! Engines in worker processes, reached over NATS: `swarmgate gateway`.
//!
//! A request is tokenized and checked here (the gateway loads the model's tokenizer and chat
//! template, not its weights), then handed over: to the best live worker hosting its agent
//! according to the [`registry`](protocol::workers) (least loaded, prompt warm), or, when the
//! registry knows none, to the agent's queue subject, where NATS picks one. A worker that is
//! gone (no responders), silent (no answer within the accept timeout) or refusing for a reason
//! another worker may not have (overloaded, draining) is skipped for the next one, and so is a
//! worker whose subject brought an acceptance in another worker's name (that request is
//! cancelled where it claims to run).
//!
//! Once accepted, the request's batches are relayed to its [`EventStream`] by a task that
//! watches the stream: a worker that sends nothing, not even a keepalive, for the stream timeout
//! is taken for dead. If no event has reached the caller yet, the request is handed over again
//! to another worker; otherwise the stream ends with an error event. Either way the old worker
//! is told to cancel, in case it was only slow. A caller dropping the stream cancels the request
//! on its worker the same way. Prompt logprobs that came in parts (a worker splits what exceeds
//! the server's `max_payload`) reach the caller as one event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::client::RequestErrorKind;
use engine::{
    EngineError, Event, EventStream, FinishReason, GenerateRequest, ModelInfo, Prompt, RequestId,
    TokenLogprob, Usage,
};
use futures::future::BoxFuture;
use futures::StreamExt as _;
use protocol::connect::NatsArgs;
use protocol::workers::{self, Lease, Workers};
use protocol::{Batch, Cancel, Reply, Subjects, Submit, VERSION};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

use super::Transport;

/// Settings of `swarmgate gateway` besides the server's.
#[derive(Clone, Debug, clap::Args)]
pub struct GatewayArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// How long a worker may take to accept or refuse a request, in milliseconds.
    #[arg(long, env = "SWARMGATE_ACCEPT_TIMEOUT_MS", default_value_t = 2000)]
    pub accept_timeout_ms: u64,
    /// A stream silent this long (no token, no keepalive) means its worker is gone.
    #[arg(long, env = "SWARMGATE_STREAM_TIMEOUT_SECS", default_value_t = 5.0)]
    pub stream_timeout_secs: f64,
    /// Workers tried for one request before it fails.
    #[arg(long, env = "SWARMGATE_WORKER_ATTEMPTS", default_value_t = 3)]
    pub worker_attempts: usize,
}

impl GatewayArgs {
    pub fn settings(&self) -> anyhow::Result<Settings> {
        self.nats.validate()?;
        let stream_timeout = Duration::try_from_secs_f64(self.stream_timeout_secs)
            .ok()
            .filter(|t| *t > protocol::KEEPALIVE)
            .with_context(|| {
                format!(
                    "--stream-timeout-secs must be longer than the workers' keepalive ({} ms)",
                    protocol::KEEPALIVE.as_millis()
                )
            })?;
        anyhow::ensure!(
            self.worker_attempts >= 1,
            "--worker-attempts must be at least 1"
        );
        Ok(Settings {
            accept_timeout: Duration::from_millis(self.accept_timeout_ms.max(1)),
            stream_timeout,
            registry_ttl: self.nats.registry_ttl()?,
            subjects: self.nats.subjects()?,
            attempts: self.worker_attempts,
        })
    }
}

/// How the gateway talks to its workers.
#[derive(Clone, Debug)]
pub struct Settings {
    pub subjects: Subjects,
    /// How long a worker may take to accept or refuse a request.
    pub accept_timeout: Duration,
    /// How long a stream may stay silent before its worker is taken for dead.
    pub stream_timeout: Duration,
    /// How old a worker's last heartbeat may be for it to count as live.
    pub registry_ttl: Duration,
    /// Workers tried for one request, hand-overs after a failure included.
    pub attempts: usize,
}

/// The gateway's side of the NATS transport.
pub struct Nats {
    shared: Arc<Shared>,
}

struct Shared {
    client: async_nats::Client,
    /// The models requests may name, the default first; each goes to the workers serving it.
    models: Vec<ModelInfo>,
    workers: Workers,
    /// This gateway's id, in its stream subjects.
    gateway: String,
    settings: Settings,
    next_id: AtomicU64,
}

impl Nats {
    /// Follows the workers' registry on `client` (see [`NatsArgs::connect`]); requests are
    /// prepared for `models` (at least one: the default first). Fails when the registry cannot
    /// be opened.
    pub async fn connect(
        client: async_nats::Client,
        models: Vec<ModelInfo>,
        settings: Settings,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!models.is_empty(), "a gateway needs a model");
        let store =
            workers::bucket(client.clone(), &settings.subjects, settings.registry_ttl).await?;
        let workers = Workers::default();
        tokio::spawn(follow(
            client.clone(),
            store,
            workers.clone(),
            settings.clone(),
        ));
        Ok(Self {
            shared: Arc::new(Shared {
                client,
                models,
                workers,
                gateway: uuid::Uuid::new_v4().simple().to_string(),
                settings,
                next_id: AtomicU64::new(1),
            }),
        })
    }
}

/// Keeps `workers` following the registry for as long as the gateway runs. When a watch fails
/// (the connection dropped, or the server restarted without its in-memory streams and the
/// bucket is gone) the bucket is opened again, created if need be, and watched from its start,
/// so workers' next heartbeats make the gateway ready again without a restart.
async fn follow(
    client: async_nats::Client,
    mut store: async_nats::jetstream::kv::Store,
    workers: Workers,
    settings: Settings,
) {
    loop {
        if let Err(e) = workers.follow(store.clone()).await {
            tracing::warn!(error = %e, "the workers' registry watch failed; reopening it");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        match workers::bucket(client.clone(), &settings.subjects, settings.registry_ttl).await {
            Ok(reopened) => store = reopened,
            Err(e) => tracing::warn!(error = %e, "cannot reopen the workers' registry; retrying"),
        }
    }
}

impl Shared {
    /// The model named `id` (`None`: the default).
    fn model(&self, id: Option<&str>) -> engine::Result<&ModelInfo> {
        let Some(id) = id else {
            return Ok(&self.models[0]);
        };
        (self.models.iter().find(|m| m.id == id)).ok_or_else(|| {
            EngineError::InvalidRequest(format!("this gateway does not serve the model {id:?}"))
        })
    }
}

impl Transport for Nats {
    fn model(&self) -> &ModelInfo {
        &self.shared.models[0]
    }

    fn models(&self) -> &[ModelInfo] {
        &self.shared.models
    }

    fn submit<'a>(
        &'a self,
        agent: Option<&'a str>,
        mut request: GenerateRequest,
    ) -> BoxFuture<'a, engine::Result<EventStream>> {
        Box::pin(async move {
            let model = self.shared.model(request.model.as_deref())?;
            let prompt = model.check(&request)?;
            let prompt_tokens = prompt.len();
            request.prompt = Prompt::Tokens(prompt);
            let job = Job {
                shared: self.shared.clone(),
                agent: agent.map(str::to_owned),
                request,
                tried: Vec::new(),
                queue_tried: false,
            };
            let (job, handover) = job.hand_over().await?;
            let (events, rx) = engine::event_channel();
            let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(job.relay(handover, events, prompt_tokens));
            Ok(EventStream::new(RequestId(id), prompt_tokens, rx))
        })
    }

    fn serves(&self, agent: &str) -> bool {
        !self.candidates(Some(agent), &[]).is_empty()
    }

    fn is_ready(&self) -> bool {
        !self.candidates(None, &[]).is_empty()
    }

    fn local_engine(&self) -> Option<&engine::EngineHandle> {
        None
    }
}

impl Nats {
    fn candidates(&self, agent: Option<&str>, exclude: &[String]) -> Vec<String> {
        self.shared.workers.candidates(
            &self.shared.models[0].id,
            agent,
            self.shared.settings.registry_ttl,
            exclude,
        )
    }
}

/// One request on its way to a worker.
struct Job {
    shared: Arc<Shared>,
    agent: Option<String>,
    request: GenerateRequest,
    /// Workers that failed or refused it.
    tried: Vec<String>,
    /// Whether it went to the agent's queue subject once already.
    queue_tried: bool,
}

/// A request a worker accepted.
struct Handover {
    id: String,
    worker: String,
    batches: async_nats::Subscriber,
    _lease: Lease,
}

impl Job {
    /// Hands the request to a worker that accepts it, trying at most `attempts` of them.
    async fn hand_over(mut self) -> engine::Result<(Self, Handover)> {
        let settings = &self.shared.settings;
        let subjects = &settings.subjects;
        let mut last_failure = String::from("no live worker serves it");
        while self.tried.len() + usize::from(self.queue_tried) < settings.attempts {
            let chosen = self
                .shared
                .workers
                .candidates(
                    self.request
                        .model
                        .as_deref()
                        .unwrap_or(&self.shared.models[0].id),
                    self.agent.as_deref(),
                    settings.registry_ttl,
                    &self.tried,
                )
                .into_iter()
                .next();
            let subject = match (&chosen, &self.agent) {
                (Some(worker), _) => subjects.worker(worker),
                (None, _) if self.queue_tried => break,
                (None, Some(agent)) => subjects.agent(agent),
                (None, None) => subjects.any(),
            };
            self.queue_tried |= chosen.is_none();
            // Counted against the worker from the choice on, so that requests chosen at the
            // same moment spread instead of all picking the same least-loaded worker.
            let lease = chosen.as_deref().map(|w| self.shared.workers.lease(w));
            match self.offer(&subject, lease).await {
                Ok(handover) => return Ok((self, handover)),
                Err(Offer::Fatal(e)) => return Err(e),
                Err(Offer::Skip { worker, reason }) => {
                    tracing::debug!(%subject, ?worker, %reason, "worker skipped");
                    self.tried.extend(worker);
                    last_failure = reason;
                }
            }
        }
        Err(EngineError::Overloaded(format!(
            "no worker could take the request{} ({last_failure})",
            self.agent
                .as_deref()
                .map(|a| format!(" for agent `{a}`"))
                .unwrap_or_default()
        )))
    }

    /// Offers the request on `subject` (`worker`'s own, or a queue's).
    async fn offer(&self, subject: &str, lease: Option<Lease>) -> Result<Handover, Offer> {
        let worker = lease.as_ref().map(|l| l.worker.clone());
        let shared = &self.shared;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let stream = shared.settings.subjects.stream(&shared.gateway, &id);
        let nats_down = |e: &dyn std::fmt::Display| {
            Offer::Fatal(EngineError::Overloaded(format!("NATS is unreachable: {e}")))
        };
        // Subscribed before the request goes out, so no batch can arrive before its reader.
        let batches = shared
            .client
            .subscribe(stream.clone())
            .await
            .map_err(|e| nats_down(&e))?;
        let submit = Submit {
            v: VERSION,
            id: id.clone(),
            agent: self.agent.clone(),
            stream,
            deadline_ms: self
                .request
                .deadline
                .map(|d| d.saturating_duration_since(Instant::now()).as_millis() as u64),
            request: self.request.clone(),
        };
        let skip = |reason: String| Offer::Skip {
            worker: worker.clone(),
            reason,
        };
        let reply = shared
            .client
            .send_request(
                subject.to_owned(),
                async_nats::Request::new()
                    .payload(protocol::encode(&submit))
                    .timeout(Some(shared.settings.accept_timeout)),
            )
            .await
            .map_err(|e| match e.kind() {
                RequestErrorKind::NoResponders => skip("no worker listens".into()),
                RequestErrorKind::TimedOut => skip("no answer in time".into()),
                RequestErrorKind::MaxPayloadExceeded => Offer::Fatal(EngineError::InvalidRequest(
                    "the request is larger than NATS carries in one message".into(),
                )),
                RequestErrorKind::InvalidSubject | RequestErrorKind::Other => nats_down(&e),
            })?;
        match protocol::decode::<Reply>(&reply.payload) {
            Ok(Reply::Accepted { worker, .. }) => match lease {
                // Only the chosen worker listens on its own subject: an acceptance in another's
                // name comes from an impostor or a twin. The request is stopped wherever it may
                // run, and the chosen worker is skipped.
                Some(lease) if lease.worker != worker => {
                    self.cancel(&worker, &id).await;
                    Err(skip(format!(
                        "accepted in the name of {worker:?}, not of the worker chosen"
                    )))
                }
                lease => Ok(Handover {
                    _lease: lease.unwrap_or_else(|| shared.workers.lease(&worker)),
                    id,
                    worker,
                    batches,
                }),
            },
            Ok(Reply::Refused { code, message, .. }) if code.is_retryable() => {
                Err(skip(format!("refused: {message}")))
            }
            Ok(Reply::Refused {
                code: protocol::RefusalCode::InvalidRequest,
                message,
                ..
            }) => Err(Offer::Fatal(EngineError::InvalidRequest(message))),
            Ok(Reply::Refused { code, message, .. }) => Err(Offer::Fatal(EngineError::Model(
                format!("a worker refused the request ({code:?}): {message}"),
            ))),
            Err(e) => Err(skip(format!("unreadable answer: {e}"))),
        }
    }

    /// Relays the accepted request's batches to `events` until its final event, handing it to
    /// another worker if its worker dies before any event reached the caller.
    async fn relay(mut self, mut handover: Handover, events: Sender<Event>, prompt_tokens: usize) {
        let timeout = self.shared.settings.stream_timeout;
        let mut seq = 0;
        let mut generated = 0;
        // Whether any event reached the caller (keepalives are not events).
        let mut delivered = false;
        // Prompt logprobs too large for one message come in parts, in consecutive events; the
        // caller gets them whole, as one event, when the next kind of event comes.
        let mut prompt_parts: Option<Vec<TokenLogprob>> = None;
        loop {
            let next = tokio::select! {
                _ = events.closed() => {
                    self.cancel(&handover.worker, &handover.id).await;
                    return;
                }
                next = tokio::time::timeout(timeout, handover.batches.next()) => next,
            };
            let failure = match next {
                Ok(Some(message)) => match protocol::decode::<Batch>(&message.payload) {
                    Ok(batch) if batch.id == handover.id && batch.seq == seq => {
                        seq += 1;
                        let whole = batch.events.into_iter().flat_map(|event| match event {
                            Event::PromptLogprobs(part) => {
                                prompt_parts.get_or_insert_with(Vec::new).extend(part);
                                None
                            }
                            event => Some(
                                prompt_parts
                                    .take()
                                    .map(Event::PromptLogprobs)
                                    .into_iter()
                                    .chain([event]),
                            ),
                        });
                        for event in whole.flatten().collect::<Vec<_>>() {
                            let last = matches!(event, Event::Finished { .. });
                            if let Event::Delta { tokens, .. } = &event {
                                generated += tokens.len();
                            }
                            delivered = true;
                            // A caller that stopped reading (its buffer is full) is treated
                            // as gone: the relay never waits on it.
                            if let Err(e) = events.try_send(event) {
                                if let TrySendError::Full(_) = e {
                                    tracing::warn!(id = handover.id, "the caller stopped reading");
                                }
                                self.cancel(&handover.worker, &handover.id).await;
                                return;
                            }
                            if last {
                                return;
                            }
                        }
                        continue;
                    }
                    Ok(batch) => format!(
                        "batch {} came when batch {seq} was due (messages were lost)",
                        batch.seq
                    ),
                    Err(e) => format!("unreadable batch: {e}"),
                },
                Ok(None) => "the subscription ended".to_owned(),
                Err(_) => format!("nothing for {} ms", timeout.as_millis()),
            };
            tracing::warn!(worker = %handover.worker, %failure, "worker failed a request");
            self.cancel(&handover.worker, &handover.id).await;
            let worker = handover.worker.clone();
            if delivered {
                // Part of the answer is out: it cannot start over elsewhere.
                let _ = events.try_send(failed(
                    format!("worker {worker} failed mid-answer: {failure}"),
                    prompt_tokens,
                    generated,
                ));
                return;
            }
            self.tried.push(worker.clone());
            let job = self;
            match job.hand_over().await {
                Ok((job, next)) => {
                    tracing::info!(from = %worker, to = %next.worker, "request handed over");
                    self = job;
                    handover = next;
                    seq = 0;
                    prompt_parts = None;
                }
                Err(e) => {
                    let _ = events.try_send(failed(
                        format!("worker {worker} failed ({failure}) and {e}"),
                        prompt_tokens,
                        0,
                    ));
                    return;
                }
            }
        }
    }

    /// Tells `worker` to stop the request `id` (it may be gone already).
    async fn cancel(&self, worker: &str, id: &str) {
        let cancel = Cancel {
            v: VERSION,
            id: id.to_owned(),
        };
        if let Err(e) = self
            .shared
            .client
            .publish(
                self.shared.settings.subjects.cancel(worker),
                protocol::encode(&cancel),
            )
            .await
        {
            tracing::warn!(%worker, error = %e, "cannot send a cancel");
        }
    }
}

/// Why an offer did not place the request.
enum Offer {
    /// This worker (or queue) cannot take it; another may.
    Skip {
        worker: Option<String>,
        reason: String,
    },
    /// No worker can: the request itself is wrong, or NATS is out of reach.
    Fatal(EngineError),
}

/// The final event of a request whose worker failed.
fn failed(error: String, prompt_tokens: usize, completion_tokens: usize) -> Event {
    Event::Finished {
        reason: FinishReason::Error,
        usage: Usage {
            prompt_tokens,
            completion_tokens,
            cached_tokens: 0,
        },
        error: Some(error),
    }
}

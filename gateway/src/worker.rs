//! `swarmgate worker`: an engine serving requests from gateways over NATS (see
//! [`protocol`] for the wire format).
//!
//! At start-up (its engine loaded) the worker refuses to run under the id of a live worker (one
//! whose heartbeats still come), then pins the system prompts of the answering agents it
//! hosts (`--agents`, else every agent of the swarm file, or of the agent store with
//! `--database-url`, whose edits it follows), subscribes to their subjects (and to
//! requests for no agent) in the workers' queue group, to its own subject, to its cancel
//! subject and to the answers to its reader probes (see [`protocol`]), and
//! starts heartbeating into the registry. Each request is checked (version, shape,
//! names), answered at once with an acceptance or a refusal, and its events published in
//! batches on the subject it names; a malformed message is logged and refused, never fatal.
//! `/metrics`, `/health` and `/ready` are served on `--port` for Prometheus and probes; the
//! first two take the gateways' API keys when keys are configured, and `/health` and `/ready`
//! fail once the engine has stopped.
//!
//! On SIGTERM or ctrl-c the worker drains: it deletes its registry key and unsubscribes, so no
//! new request reaches it, lets the requests in flight finish for at most
//! `--drain-timeout-secs`, then exits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::kv;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::{Json, Router};
use engine::{EngineConfig, EngineError, EngineHandle, Event};
use futures::stream::SelectAll;
use futures::StreamExt as _;
use protocol::connect::NatsArgs;
use protocol::workers;
use protocol::{
    self, Batch, Cancel, Heartbeat, RefusalCode, Reply, Subjects, Submit, FLUSH_INTERVAL,
    FLUSH_TOKENS, KEEPALIVE, QUEUE_GROUP, READER_PROBE, VERSION,
};
use router::{AgentSpec, Pins, SwarmConfig};
use tokio::sync::oneshot;

use crate::agent_store::AgentStore;
use crate::auth::{ApiKey, Auth};
use crate::error::ApiError;
use crate::metrics::{self, Metrics};

/// Settings for `swarmgate worker`.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerConfig {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// The agents this worker hosts (comma-separated); without any, it hosts every agent.
    #[arg(long, env = "SWARMGATE_AGENTS", value_delimiter = ',')]
    pub agents: Vec<String>,
    /// The swarm file whose agents' system prompts are pinned warm [default: swarm.toml, if
    /// present].
    #[arg(long, env = "SWARMGATE_SWARM")]
    pub swarm: Option<PathBuf>,
    /// PostgreSQL keeping the agents (the gateways' `--database-url`): the system prompts of
    /// the agents stored there are pinned instead of the swarm file's, and follow their edits.
    #[arg(long, env = "SWARMGATE_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// This worker's name in the registry and its subjects [default: a fresh random one].
    #[arg(long, env = "SWARMGATE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Address for `/metrics` and `/health`.
    #[arg(long, env = "SWARMGATE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port for `/metrics`, `/health` and `/ready`; 0 turns them off.
    #[arg(long, env = "SWARMGATE_PORT", default_value_t = 9464)]
    pub port: u16,
    /// A key `/metrics` and `/health` require as `Authorization: Bearer KEY`, as the gateways'
    /// API does (give the same keys); repeat the flag for more (the environment variable takes
    /// a comma-separated list). Without keys they are open; `/ready` always is.
    #[arg(
        long = "api-key",
        env = "SWARMGATE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<ApiKey>,
    /// The gateways' admin keys, accepted too (an admin key is accepted wherever an API key is).
    #[arg(
        long = "admin-key",
        env = "SWARMGATE_ADMIN_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub admin_keys: Vec<ApiKey>,
    /// How often the worker publishes its load to the registry, in milliseconds.
    #[arg(long, env = "SWARMGATE_HEARTBEAT_MS", default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// On SIGTERM, how long requests in flight may take to finish before the worker exits.
    #[arg(long, env = "SWARMGATE_DRAIN_TIMEOUT_SECS", default_value_t = 30)]
    pub drain_timeout_secs: u64,
    #[command(flatten)]
    pub engine: EngineConfig,
}

/// What the request loop and the request tasks share.
struct Worker {
    id: String,
    subjects: Subjects,
    engine: EngineHandle,
    client: async_nats::Client,
    metrics: Metrics,
    /// Who may read `/metrics` and `/health`.
    auth: Auth,
    /// Cancel handles of the requests in flight, by request id.
    running: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// The reply subjects of reader probes are this, `.`, the request's id.
    probe_inbox: String,
    in_flight: AtomicUsize,
    draining: AtomicBool,
    /// The hosted agents whose system prompts are pinned, as the heartbeat tells gateways.
    warm: Mutex<Vec<String>>,
}

/// Runs the worker on `engine` until SIGTERM or ctrl-c, then drains: [`connect`], then
/// [`subscribe`] and [`heartbeat`], then take requests until the signal (or the engine's
/// failure), then [`drain`].
pub async fn run(config: WorkerConfig, engine: EngineHandle) -> anyhow::Result<()> {
    let Connected {
        id,
        client,
        registry,
        agent_store,
        hosted,
    } = connect(&config).await?;
    let subjects = config.nats.subjects()?;
    let pins = Arc::new(Pins::new(engine.clone()));
    let pinned = pins.sync(&answering(&hosted)).await?;
    let worker = Arc::new(Worker {
        id: id.clone(),
        subjects,
        engine,
        client: client.clone(),
        metrics: Metrics::new(),
        auth: Auth::new(&config.api_keys, &config.admin_keys, false),
        running: Mutex::new(HashMap::new()),
        probe_inbox: client.new_inbox(),
        in_flight: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
        warm: Mutex::new(pins.warm().await),
    });
    let following = agent_store.map(|store| {
        tokio::spawn(follow_agents(
            store,
            pins,
            worker.clone(),
            config.agents.clone(),
        ))
    });
    let mut subscribed = subscribe(&worker, &config.agents).await?;
    let beat = heartbeat(&worker, &config, registry.clone())?;
    let probes = serve_probes(&worker, &config).await?;
    tracing::info!(worker = %id, agents = ?config.agents, pinned_prompt_tokens = pinned, "worker serving");

    let shutdown = crate::shutdown_signal();
    tokio::pin!(shutdown);
    // A failed engine cannot recover: its requests have ended with errors; the worker leaves the
    // registry (so that no gateway picks it) and exits non-zero, for its supervisor to restart.
    let engine = worker.engine.clone();
    let engine_failed = engine.stopped();
    tokio::pin!(engine_failed);
    let mut failed = false;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            () = &mut engine_failed => {
                tracing::error!("the engine failed; leaving the cluster");
                failed = true;
                break;
            }
            Some(message) = subscribed.requests.next() => worker.clone().take(message).await,
            Some(message) = subscribed.cancels.next() => worker.cancel(&message.payload),
            Some(message) = subscribed.probe_answers.next() => worker.probed(&message),
            else => break,
        }
    }

    beat.abort();
    if let Some(following) = following {
        following.abort();
    }
    drain(&worker, &registry, subscribed, config.drain_timeout_secs).await;
    if let Some(probes) = probes {
        probes.abort();
    }
    let _ = client.flush().await;
    tracing::info!(worker = %id, "worker stopped");
    anyhow::ensure!(
        !failed,
        "the engine failed and stopped; exiting so that the worker is restarted"
    );
    Ok(())
}

/// A worker joined to its cluster, before it takes anything.
struct Connected {
    id: String,
    client: async_nats::Client,
    /// The workers' registry bucket.
    registry: kv::Store,
    agent_store: Option<AgentStore>,
    /// The agents it hosts (every agent of the swarm when `--agents` names none).
    hosted: Vec<AgentSpec>,
}

/// Checks the worker's names, reads the agents it hosts (from the agent store or the swarm
/// file), connects to NATS and opens the registry, refusing a worker id that is already live.
async fn connect(config: &WorkerConfig) -> anyhow::Result<Connected> {
    let id = config.worker_id.clone().unwrap_or_else(|| {
        format!(
            "worker-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        )
    });
    anyhow::ensure!(
        protocol::is_token(&id),
        "--worker-id must be letters, digits, `-` or `_`"
    );
    if let Some(bad) = config.agents.iter().find(|a| !protocol::is_token(a)) {
        anyhow::bail!("--agents: {bad:?} is not a valid agent name");
    }
    let ttl = config.nats.registry_ttl()?;
    let subjects = config.nats.subjects()?;
    let agent_store = match &config.database_url {
        Some(url) => Some(
            AgentStore::open(url)
                .await
                .context("cannot open the agent store (--database-url)")?,
        ),
        None => None,
    };
    let hosted = match &agent_store {
        Some(store) => hosting(store.load().await?, &config.agents),
        None => hosted_agents(config)?,
    };
    let client = config.nats.connect(&format!("swarmgate-{id}")).await?;
    let registry = workers::bucket(client.clone(), &subjects, ttl)
        .await
        .context("cannot open the workers' registry (is JetStream on?)")?;
    if let Some(seen) = workers::live(&registry, &id, ttl).await? {
        anyhow::bail!(
            "a worker named {id:?} is already live in cluster {:?} (its heartbeat came again \
             within {} ms): give this one another --worker-id, or stop that one first",
            config.nats.cluster,
            seen.as_millis()
        );
    }
    Ok(Connected {
        id,
        client,
        registry,
        agent_store,
        hosted,
    })
}

/// The worker's subscriptions: its requests (its agents' queue groups, `any`, and its own
/// subject), the cancels of its requests, and the answers to its reader probes.
struct Subscribed {
    requests: SelectAll<async_nats::Subscriber>,
    cancels: async_nats::Subscriber,
    probe_answers: async_nats::Subscriber,
}

/// Subscribes `worker` to the subjects of `agents` (every agent when empty) and its own.
async fn subscribe(worker: &Worker, agents: &[String]) -> anyhow::Result<Subscribed> {
    let (client, subjects) = (&worker.client, &worker.subjects);
    let mut requests = SelectAll::new();
    let agent_subjects: Vec<String> = if agents.is_empty() {
        vec![subjects.all_agents()]
    } else {
        agents.iter().map(|a| subjects.agent(a)).collect()
    };
    for subject in agent_subjects.into_iter().chain([subjects.any()]) {
        requests.push(client.queue_subscribe(subject, QUEUE_GROUP.into()).await?);
    }
    requests.push(client.subscribe(subjects.worker(&worker.id)).await?);
    Ok(Subscribed {
        requests,
        cancels: client.subscribe(subjects.cancel(&worker.id)).await?,
        probe_answers: client
            .subscribe(format!("{}.*", worker.probe_inbox))
            .await?,
    })
}

/// Publishes `worker`'s heartbeat into the registry every `--heartbeat-ms`, reopening the
/// bucket when a NATS server that restarted lost it.
fn heartbeat(
    worker: &Arc<Worker>,
    config: &WorkerConfig,
    mut registry: kv::Store,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let ttl = config.nats.registry_ttl()?;
    let worker = worker.clone();
    let agents = config.agents.clone();
    let every = Duration::from_millis(config.heartbeat_ms.max(50));
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let beat = worker.heartbeat(&agents);
            if let Err(e) = registry.put(&worker.id, protocol::encode(&beat)).await {
                // The bucket may be gone with a NATS server that restarted: it is opened
                // again, created if need be, for the next heartbeat.
                tracing::warn!(error = %e, "cannot publish the heartbeat; reopening the registry");
                match workers::bucket(worker.client.clone(), &worker.subjects, ttl).await {
                    Ok(reopened) => registry = reopened,
                    Err(e) => tracing::warn!(error = %e, "cannot reopen the registry"),
                }
            }
        }
    }))
}

/// Serves `/metrics`, `/health` and `/ready` on `--host`:`--port`, unless the port is 0.
async fn serve_probes(
    worker: &Arc<Worker>,
    config: &WorkerConfig,
) -> anyhow::Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>> {
    if config.port == 0 {
        return Ok(None);
    }
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.host, config.port))?;
    let app = Router::new()
        .route("/metrics", get(scrape))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .with_state(worker.clone());
    Ok(Some(tokio::spawn(async move {
        axum::serve(listener, app).await
    })))
}

/// Drains `worker`: out of the registry and off the request subjects first, so nothing new
/// arrives, then waits up to `timeout_secs` for the requests in flight, still taking their
/// cancels and probe answers.
async fn drain(worker: &Worker, registry: &kv::Store, subscribed: Subscribed, timeout_secs: u64) {
    let Subscribed {
        requests,
        mut cancels,
        mut probe_answers,
    } = subscribed;
    worker.draining.store(true, Ordering::SeqCst);
    if let Err(e) = registry.delete(&worker.id).await {
        tracing::warn!(error = %e, "cannot remove the worker from the registry");
    }
    for mut subscription in requests.into_iter() {
        let _ = subscription.unsubscribe().await;
    }
    let _ = worker.client.flush().await;
    let deadline = Instant::now() + Duration::from_secs(timeout_secs);
    tracing::info!(
        in_flight = worker.in_flight.load(Ordering::SeqCst),
        "draining"
    );
    loop {
        tokio::select! {
            Some(message) = cancels.next() => worker.cancel(&message.payload),
            Some(message) = probe_answers.next() => worker.probed(&message),
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        let left = worker.in_flight.load(Ordering::SeqCst);
        if left == 0 {
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(left, "drain deadline passed; cutting off the requests left");
            break;
        }
    }
}

/// The agents the worker hosts, from the swarm file when there is one; every named agent must
/// be in it.
fn hosted_agents(config: &WorkerConfig) -> anyhow::Result<Vec<AgentSpec>> {
    let path = config.swarm.clone().or_else(|| {
        let default = PathBuf::from(crate::config::DEFAULT_SWARM_FILE);
        default.exists().then_some(default)
    });
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let swarm = SwarmConfig::load(&path)?;
    if let Some(missing) = config.agents.iter().find(|name| {
        !swarm
            .agents
            .iter()
            .any(|a| a.name.as_str() == name.as_str())
    }) {
        anyhow::bail!("--agents: {} has no agent {missing:?}", path.display());
    }
    Ok(hosting(swarm.agents, &config.agents))
}

/// Those of `agents` named in `names` (`--agents`); all of them when it names none.
fn hosting(agents: Vec<AgentSpec>, names: &[String]) -> Vec<AgentSpec> {
    agents
        .into_iter()
        .filter(|a| names.is_empty() || names.iter().any(|n| n == a.name.as_str()))
        .collect()
}

/// The agents that answer requests, whose system prompts are worth pinning.
fn answering(agents: &[AgentSpec]) -> Vec<&AgentSpec> {
    agents.iter().filter(|a| !a.kind.is_system()).collect()
}

/// Keeps the pins in step with the agent store: reloads after every edit a gateway commits
/// (and after the listener reconnects), until aborted.
async fn follow_agents(
    store: AgentStore,
    pins: Arc<Pins>,
    worker: Arc<Worker>,
    names: Vec<String>,
) {
    let mut changes = store.changes();
    while changes.recv().await.is_some() {
        let hosted = match store.load().await {
            Ok(agents) => hosting(agents, &names),
            Err(e) => {
                tracing::warn!(error = %e, "cannot reload the agents; keeping the pins");
                continue;
            }
        };
        if let Err(e) = pins.sync(&answering(&hosted)).await {
            tracing::warn!(error = %e, "cannot pin the agents' system prompts");
        }
        *worker.warm.lock().unwrap() = pins.warm().await;
    }
}

impl Worker {
    fn heartbeat(&self, agents: &[String]) -> Heartbeat {
        let stats = self.engine.stats();
        Heartbeat {
            v: VERSION,
            worker: self.id.clone(),
            models: self.engine.models().iter().map(|m| m.id.clone()).collect(),
            agents: agents.to_vec(),
            running: stats.running.load(Ordering::Relaxed),
            waiting: stats.waiting.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            free_kv_blocks: stats.kv().gauges.device_free,
            warm: self.warm.lock().unwrap().clone(),
        }
    }

    /// Answers one request message: refused with a reason, or accepted and run.
    async fn take(self: Arc<Self>, message: async_nats::Message) {
        let Some(reply) = message.reply.clone() else {
            tracing::warn!(subject = %message.subject, "a request without a reply subject; dropped");
            return;
        };
        let answer = match self.start(&message.payload) {
            Ok(accepted) => accepted,
            Err((code, text)) => {
                tracing::warn!(subject = %message.subject, ?code, error = %text, "request refused");
                Reply::Refused {
                    v: VERSION,
                    code,
                    message: text,
                }
            }
        };
        if let Err(e) = self.client.publish(reply, protocol::encode(&answer)).await {
            tracing::warn!(error = %e, "cannot answer a request");
        }
    }

    /// Checks a request and starts it on the engine.
    fn start(self: &Arc<Self>, payload: &[u8]) -> Result<Reply, (RefusalCode, String)> {
        let submit: Submit = protocol::decode(payload).map_err(|e| (e.code(), e.to_string()))?;
        if !self.subjects.is_stream(&submit.stream) {
            return Err((
                RefusalCode::InvalidMessage,
                format!(
                    "`stream` {:?} is not a stream subject of this cluster",
                    submit.stream
                ),
            ));
        }
        if self.draining.load(Ordering::SeqCst) {
            return Err((RefusalCode::Draining, "the worker is shutting down".into()));
        }
        let arrived = Instant::now();
        let mut request = submit.request;
        request.deadline = submit
            .deadline_ms
            .map(|ms| arrived + Duration::from_millis(ms));
        let events = self.engine.submit(request).map_err(|e| {
            let code = match &e {
                EngineError::InvalidRequest(_) => RefusalCode::InvalidRequest,
                EngineError::Overloaded(_) => RefusalCode::Overloaded,
                _ => RefusalCode::Unavailable,
            };
            (code, e.to_string())
        })?;
        let (cancel, cancelled) = oneshot::channel();
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(submit.id.clone(), cancel);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let events = self
            .metrics
            .observe(events.map(Ok), arrived, submit.agent.as_deref());
        tokio::spawn(
            self.clone()
                .publish(submit.id, submit.stream, events, cancelled),
        );
        Ok(Reply::Accepted {
            v: VERSION,
            worker: self.id.clone(),
        })
    }

    /// Publishes a request's events in batches until its final event, a cancel (from the
    /// gateway, or a probe finding nobody reading the stream), or a failure to publish (the
    /// request is then dropped, which cancels it in the engine).
    async fn publish(
        self: Arc<Self>,
        id: String,
        subject: String,
        mut events: impl futures::Stream<Item = Result<Event, crate::ApiError>> + Unpin,
        mut cancelled: oneshot::Receiver<()>,
    ) {
        let probe = format!("{}.{id}", self.probe_inbox);
        let mut last_probe = tokio::time::Instant::now();
        let mut pending: Vec<Event> = Vec::new();
        let mut pending_tokens = 0;
        let mut flush_at: Option<tokio::time::Instant> = None;
        let mut seq = 0;
        let mut last_sent = tokio::time::Instant::now();
        // The first token goes out alone, at once: time to first token is not worth batching.
        let mut first_token_sent = false;
        loop {
            let keepalive_at = last_sent + KEEPALIVE;
            let finished = tokio::select! {
                _ = &mut cancelled => break,
                event = events.next() => {
                    let event = event.and_then(Result::ok).unwrap_or_else(lost_stream);
                    let finished = matches!(event, Event::Finished { .. });
                    if let Event::Delta { tokens, .. } = &event {
                        pending_tokens += tokens.len();
                    }
                    coalesce(&mut pending, event);
                    flush_at.get_or_insert(tokio::time::Instant::now() + FLUSH_INTERVAL);
                    if !finished && first_token_sent && pending_tokens < FLUSH_TOKENS {
                        continue;
                    }
                    finished
                }
                _ = tokio::time::sleep_until(flush_at.unwrap_or(keepalive_at)) => false,
            };
            let batches = encode_within(
                &id,
                seq,
                std::mem::take(&mut pending),
                self.client.max_payload(),
            );
            let mut failed = false;
            for batch in batches {
                let sent = if last_probe.elapsed() >= READER_PROBE {
                    last_probe = tokio::time::Instant::now();
                    self.client
                        .publish_with_reply(subject.clone(), probe.clone(), batch)
                        .await
                } else {
                    self.client.publish(subject.clone(), batch).await
                };
                if let Err(e) = sent {
                    tracing::warn!(error = %e, "cannot publish a batch; cancelling the request");
                    failed = true;
                    break;
                }
                seq += 1;
            }
            if failed {
                break;
            }
            first_token_sent |= pending_tokens > 0;
            pending_tokens = 0;
            flush_at = None;
            last_sent = tokio::time::Instant::now();
            if finished {
                break;
            }
        }
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// Handles a cancel message.
    fn cancel(&self, payload: &[u8]) {
        match protocol::decode::<Cancel>(payload) {
            Ok(cancel) => self.stop(&cancel.id),
            Err(e) => tracing::warn!(error = %e, "bad cancel message ignored"),
        }
    }

    /// Handles the answer to a reader probe: NATS's "no responders" means nobody reads the
    /// request's stream any more.
    fn probed(&self, answer: &async_nats::Message) {
        if answer.status != Some(async_nats::StatusCode::NO_RESPONDERS) {
            return;
        }
        let id = answer
            .subject
            .strip_prefix(self.probe_inbox.as_str())
            .and_then(|rest| rest.strip_prefix('.'));
        if let Some(id) = id {
            tracing::info!(request = %id, "nobody reads the request's stream; cancelling it");
            self.stop(id);
        }
    }

    /// Stops the request `id` if it is in flight: its task ends and drops its stream.
    fn stop(&self, id: &str) {
        let handle = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(handle) = handle {
            let _ = handle.send(());
        }
    }
}

/// Appends `event` to a batch, merging consecutive deltas into one.
fn coalesce(batch: &mut Vec<Event>, event: Event) {
    if let (
        Some(Event::Delta {
            text,
            tokens,
            logprobs,
        }),
        Event::Delta {
            text: more_text,
            tokens: more_tokens,
            logprobs: more_logprobs,
        },
    ) = (batch.last_mut(), &event)
    {
        text.push_str(more_text);
        tokens.extend(more_tokens);
        logprobs.extend(more_logprobs.iter().cloned());
        return;
    }
    batch.push(event);
}

/// The batches `events` go out in, numbered from `seq`: one, unless its JSON is larger than
/// `max_payload` (the NATS server's limit on a message). Then the events are spread over as
/// many batches as it takes, in order, and prompt logprobs too large for one message are cut
/// into consecutive parts (the gateway joins them again). A single delta larger than the limit
/// still goes alone, and its publication fails.
fn encode_within(id: &str, seq: u64, events: Vec<Event>, max_payload: usize) -> Vec<bytes::Bytes> {
    let batch = |seq, events| Batch {
        v: VERSION,
        id: id.to_owned(),
        seq,
        events,
    };
    let whole = batch(seq, events);
    let encoded = protocol::encode(&whole);
    // 0: the server's limit is not known yet.
    if max_payload == 0 || encoded.len() <= max_payload {
        return vec![encoded];
    }
    let room = max_payload.saturating_sub(protocol::encode(&batch(u64::MAX, vec![])).len());
    let parts = whole.events.into_iter().flat_map(|event| match event {
        Event::PromptLogprobs(entries) => {
            let empty = json_len(&Event::PromptLogprobs(Vec::new()));
            pack(entries, room.saturating_sub(empty))
                .into_iter()
                .map(Event::PromptLogprobs)
                .collect()
        }
        event => vec![event],
    });
    (seq..)
        .zip(pack(parts, room))
        .map(|(seq, events)| protocol::encode(&batch(seq, events)))
        .collect()
}

/// `items` in order, in groups whose JSON array elements (each with a comma) take at most
/// `room` bytes; an item larger than `room` makes a group by itself.
fn pack<T: serde::Serialize>(items: impl IntoIterator<Item = T>, room: usize) -> Vec<Vec<T>> {
    let mut groups: Vec<Vec<T>> = vec![Vec::new()];
    let mut used = 0;
    for item in items {
        let size = json_len(&item) + 1;
        if used + size > room && groups.last().is_some_and(|g| !g.is_empty()) {
            groups.push(Vec::new());
            used = 0;
        }
        used += size;
        groups.last_mut().expect("one group at least").push(item);
    }
    groups
}

fn json_len(value: &impl serde::Serialize) -> usize {
    serde_json::to_vec(value).map_or(0, |json| json.len())
}

/// The final event of a stream the engine ended without one.
fn lost_stream() -> Event {
    Event::Finished {
        reason: engine::FinishReason::Error,
        usage: engine::Usage::default(),
        error: Some(crate::service::choices::LOST_STREAM.into()),
    }
}

async fn scrape(
    State(worker): State<Arc<Worker>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    worker.auth.check(&headers)?;
    Ok(metrics::exposition(
        worker.metrics.render(Some(worker.engine.stats())),
    ))
}

/// The worker's state (its id, requests in flight, whether it drains); 503 once its engine has
/// stopped, so that a supervisor restarts it.
async fn health(
    State(worker): State<Arc<Worker>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    worker.auth.check(&headers)?;
    if !worker.engine.is_running() {
        return Err(ApiError::Unavailable);
    }
    Ok(Json(serde_json::json!({
        "status": if worker.draining.load(Ordering::SeqCst) { "draining" } else { "ok" },
        "worker": worker.id,
        "in_flight": worker.in_flight.load(Ordering::SeqCst),
    })))
}

/// Whether the worker takes requests: its engine runs and it is not draining. Open to probes
/// without a key, and says nothing more.
async fn ready(State(worker): State<Arc<Worker>>) -> Result<Json<serde_json::Value>, ApiError> {
    if !worker.engine.is_running() || worker.draining.load(Ordering::SeqCst) {
        return Err(ApiError::Unavailable);
    }
    Ok(Json(serde_json::json!({"status": "ready"})))
}

#[cfg(test)]
mod tests {
    use engine::{FinishReason, TokenLogprob, Usage};

    use super::*;

    fn delta(text: &str, token: u32) -> Event {
        Event::Delta {
            text: text.into(),
            tokens: vec![token],
            logprobs: vec![TokenLogprob {
                token,
                logprob: -0.5,
                top: vec![],
                scored: vec![],
            }],
        }
    }

    #[test]
    fn a_batch_over_the_payload_limit_is_spread_over_batches_that_fit() {
        let prompt: Vec<TokenLogprob> = (0..300)
            .map(|token| TokenLogprob {
                token,
                logprob: -1.25,
                top: (0..5).map(|t| (t, -2.5)).collect(),
                scored: vec![],
            })
            .collect();
        let end = Event::Finished {
            reason: FinishReason::Length,
            usage: Usage::default(),
            error: None,
        };
        let events = vec![
            Event::PromptLogprobs(prompt.clone()),
            delta("a", 1),
            end.clone(),
        ];
        let max = 2048;
        let batches = encode_within("r1", 7, events.clone(), max);
        assert!(batches.len() > 10, "{} batches", batches.len());
        let mut joined: Vec<TokenLogprob> = Vec::new();
        let mut rest = Vec::new();
        for (i, bytes) in batches.iter().enumerate() {
            assert!(bytes.len() <= max, "batch {i}: {} bytes", bytes.len());
            let batch: Batch = protocol::decode(bytes).unwrap();
            assert_eq!((batch.id.as_str(), batch.seq), ("r1", 7 + i as u64));
            for event in batch.events {
                match event {
                    Event::PromptLogprobs(part) => {
                        assert!(rest.is_empty(), "prompt logprobs come first");
                        joined.extend(part);
                    }
                    other => rest.push(other),
                }
            }
        }
        assert_eq!(joined, prompt);
        assert_eq!(rest, [delta("a", 1), end]);
        // Under the limit, and with the limit unknown, one batch as before.
        assert_eq!(encode_within("r1", 0, events.clone(), 1 << 20).len(), 1);
        assert_eq!(encode_within("r1", 0, events, 0).len(), 1);
    }

    #[test]
    fn consecutive_deltas_merge_and_other_events_keep_their_place() {
        let mut batch = Vec::new();
        let prompt = Event::PromptLogprobs(vec![]);
        coalesce(&mut batch, prompt.clone());
        coalesce(&mut batch, delta("a", 1));
        coalesce(&mut batch, delta("b", 2));
        let end = Event::Finished {
            reason: FinishReason::Stop,
            usage: Usage::default(),
            error: None,
        };
        coalesce(&mut batch, end.clone());
        assert_eq!(batch.len(), 3);
        assert_eq!(batch[0], prompt);
        match &batch[1] {
            Event::Delta {
                text,
                tokens,
                logprobs,
            } => {
                assert_eq!(text, "ab");
                assert_eq!(tokens, &[1, 2]);
                assert_eq!(logprobs.iter().map(|l| l.token).collect::<Vec<_>>(), [1, 2]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(batch[2], end);
    }
}

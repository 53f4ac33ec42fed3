//! `swarmgate worker`: an engine serving requests from gateways over NATS (see
//! [`crate::transport::protocol`] for the wire format).
//!
//! At start-up the worker loads its engine, pins the system prompts of the answering agents it
//! hosts (`--agents`, else every agent of the swarm file), subscribes to their subjects (and to
//! requests for no agent) in the workers' queue group, to its own subject, to its cancel
//! subject and to the answers to its reader probes (see [`crate::transport::protocol`]), and
//! starts heartbeating into the registry. Each request is checked (version, shape,
//! names), answered at once with an acceptance or a refusal, and its events published in
//! batches on the subject it names; a malformed message is logged and refused, never fatal.
//! `/metrics` and `/health` are served on `--port` for Prometheus and probes.
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
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use engine::{EngineConfig, EngineError, EngineHandle, Event};
use futures::stream::SelectAll;
use futures::StreamExt as _;
use router::{AgentSpec, SwarmConfig};
use tokio::sync::oneshot;

use crate::metrics::Metrics;
use crate::swarm::pins::Pins;
use crate::transport::nats::NatsArgs;
use crate::transport::protocol::{
    self, Batch, Cancel, Heartbeat, RefusalCode, Reply, Subjects, Submit, FLUSH_INTERVAL,
    FLUSH_TOKENS, KEEPALIVE, QUEUE_GROUP, READER_PROBE, VERSION,
};
use crate::transport::registry;

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
    /// This worker's name in the registry and its subjects [default: a fresh random one].
    #[arg(long, env = "SWARMGATE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Address for `/metrics` and `/health`.
    #[arg(long, env = "SWARMGATE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port for `/metrics` and `/health`; 0 turns them off.
    #[arg(long, env = "SWARMGATE_PORT", default_value_t = 9464)]
    pub port: u16,
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
    /// Cancel handles of the requests in flight, by request id.
    running: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// The reply subjects of reader probes are this, `.`, the request's id.
    probe_inbox: String,
    in_flight: AtomicUsize,
    draining: AtomicBool,
}

/// Runs the worker on `engine` until SIGTERM or ctrl-c, then drains.
pub async fn run(config: WorkerConfig, engine: EngineHandle) -> anyhow::Result<()> {
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
    let hosted = hosted_agents(&config)?;
    let client = async_nats::ConnectOptions::new()
        .name(format!("swarmgate-{id}"))
        .connect(config.nats.url.as_str())
        .await
        .with_context(|| format!("cannot reach NATS at {}", config.nats.url))?;
    let store = registry::bucket(client.clone(), &subjects, ttl)
        .await
        .context("cannot open the workers' registry (is JetStream on?)")?;

    let pins = Pins::new(engine.clone());
    let answering: Vec<&AgentSpec> = hosted.iter().filter(|a| !a.kind.is_system()).collect();
    let pinned = pins.pin(&answering).await?;
    let mut warm = Vec::new();
    for agent in &answering {
        if pins.tokens(agent.name.as_str()).await > 0 {
            warm.push(agent.name.to_string());
        }
    }
    let worker = Arc::new(Worker {
        id: id.clone(),
        subjects: subjects.clone(),
        engine,
        client: client.clone(),
        metrics: Metrics::new(),
        running: Mutex::new(HashMap::new()),
        probe_inbox: client.new_inbox(),
        in_flight: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
    });

    let mut requests = SelectAll::new();
    let agent_subjects: Vec<String> = if config.agents.is_empty() {
        vec![subjects.all_agents()]
    } else {
        config.agents.iter().map(|a| subjects.agent(a)).collect()
    };
    for subject in agent_subjects.into_iter().chain([subjects.any()]) {
        requests.push(client.queue_subscribe(subject, QUEUE_GROUP.into()).await?);
    }
    requests.push(client.subscribe(subjects.worker(&id)).await?);
    let mut cancels = client.subscribe(subjects.cancel(&id)).await?;
    let mut probe_answers = client
        .subscribe(format!("{}.*", worker.probe_inbox))
        .await?;

    let beat = {
        let worker = worker.clone();
        let agents = config.agents.clone();
        let store = store.clone();
        let every = Duration::from_millis(config.heartbeat_ms.max(50));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let beat = worker.heartbeat(&agents, &warm);
                if let Err(e) = store.put(&worker.id, protocol::encode(&beat)).await {
                    tracing::warn!(error = %e, "cannot publish the heartbeat");
                }
            }
        })
    };
    let probes = if config.port == 0 {
        None
    } else {
        let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", config.host, config.port))?;
        let app = Router::new()
            .route("/metrics", get(scrape))
            .route("/health", get(health))
            .with_state(worker.clone());
        Some(tokio::spawn(
            async move { axum::serve(listener, app).await },
        ))
    };
    tracing::info!(worker = %id, agents = ?config.agents, pinned_prompt_tokens = pinned, "worker serving");

    let shutdown = crate::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(message) = requests.next() => worker.clone().take(message).await,
            Some(message) = cancels.next() => worker.cancel(&message.payload),
            Some(message) = probe_answers.next() => worker.probed(&message),
            else => break,
        }
    }

    // Drain: out of the registry and off the subjects first, so nothing new arrives.
    worker.draining.store(true, Ordering::SeqCst);
    beat.abort();
    if let Err(e) = store.delete(&id).await {
        tracing::warn!(error = %e, "cannot remove the worker from the registry");
    }
    for mut subscription in requests.into_iter() {
        let _ = subscription.unsubscribe().await;
    }
    let _ = client.flush().await;
    let deadline = Instant::now() + Duration::from_secs(config.drain_timeout_secs);
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
    if let Some(probes) = probes {
        probes.abort();
    }
    let _ = client.flush().await;
    tracing::info!(worker = %id, "worker stopped");
    Ok(())
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
    Ok(swarm
        .agents
        .into_iter()
        .filter(|a| config.agents.is_empty() || config.agents.iter().any(|n| n == a.name.as_str()))
        .collect())
}

impl Worker {
    fn heartbeat(&self, agents: &[String], warm: &[String]) -> Heartbeat {
        let stats = self.engine.stats();
        Heartbeat {
            v: VERSION,
            worker: self.id.clone(),
            model: self.engine.model().id.clone(),
            agents: agents.to_vec(),
            running: stats.running.load(Ordering::Relaxed),
            waiting: stats.waiting.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            free_kv_blocks: stats.kv().gauges.device_free,
            warm: warm.to_vec(),
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
            let batch = protocol::encode(&Batch {
                v: VERSION,
                id: id.clone(),
                seq,
                events: std::mem::take(&mut pending),
            });
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
                break;
            }
            seq += 1;
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

/// The final event of a stream the engine ended without one.
fn lost_stream() -> Event {
    Event::Finished {
        reason: engine::FinishReason::Error,
        usage: engine::Usage::default(),
        error: Some(crate::http::chat::LOST_STREAM.into()),
    }
}

async fn scrape(State(worker): State<Arc<Worker>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        worker.metrics.render(Some(worker.engine.stats())),
    )
}

async fn health(State(worker): State<Arc<Worker>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "status": if worker.draining.load(Ordering::SeqCst) { "draining" } else { "ok" },
        "worker": worker.id,
        "in_flight": worker.in_flight.load(Ordering::SeqCst),
    }))
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

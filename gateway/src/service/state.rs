//! What every handler shares: [`AppState`], the server's state below the handlers. It holds
//! the engines' transport, the served model, the keys, the limits, the sessions, the stored
//! responses, the metrics, and, when the server has them, the swarm and the embedding model.
//! Nothing here knows of HTTP routes; the route table is [`crate::app`]'s.

use std::sync::Arc;
use std::time::Duration;

use router::{AgentKind, Registry, SwarmConfig, Verifier, VerifierConfig};

use crate::api::unix_now;
use crate::auth::{Auth, Caller};
use crate::config::ServeConfig;
use crate::connection::ConnectionTimeouts;
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::service::embeddings::Embeddings;
use crate::service::responses::StoredResponses;
use crate::service::swarm::Swarm;
use crate::session::Sessions;
use crate::state;
use crate::transport::{IntoTransport, Transport};
use crate::validate::agent_definition::AgentLimits;
use crate::validate::structured::StructuredLimits;

/// What every handler shares. Cloning is a few reference-count increments.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
    /// Absent when the server runs without an embedding model.
    embeddings: Option<Embeddings>,
    /// Absent when the server runs without a swarm file.
    swarm: Option<Swarm>,
    verifier: Arc<Verifier>,
}

struct Inner {
    transport: Arc<dyn Transport>,
    model_id: String,
    /// Unix seconds when the server was set up (the models' `created`).
    started: u64,
    max_body_bytes: usize,
    body_read_timeout: Duration,
    connection_timeouts: ConnectionTimeouts,
    grpc_max_concurrent_streams: u32,
    structured: StructuredLimits,
    agent_limits: AgentLimits,
    auth: Arc<Auth>,
    limits: Arc<Limits>,
    sessions: Sessions,
    responses: StoredResponses,
    metrics: Metrics,
}

impl AppState {
    /// State for serving the engine in this process with the default settings, refusing
    /// request bodies over `max_body_bytes`.
    pub fn new(engine: engine::EngineHandle, max_body_bytes: usize) -> Self {
        let config = ServeConfig {
            max_body_bytes,
            ..ServeConfig::default()
        };
        Self::configured(engine, &config)
    }

    /// State for serving the model `transport` reaches under `config`, which must have passed
    /// [`ServeConfig::validate`].
    pub fn configured(transport: impl IntoTransport, config: &ServeConfig) -> Self {
        let transport = transport.into_transport();
        let model_id = transport.model().id.clone();
        let verifier = Arc::new(Verifier::new(
            transport.model(),
            default_verifier_prompt(),
            VerifierConfig::default(),
        ));
        let store = state::open(config.redis.as_deref());
        Self {
            inner: Arc::new(Inner {
                transport,
                model_id,
                started: unix_now(),
                max_body_bytes: config.max_body_bytes,
                body_read_timeout: Duration::from_secs_f64(config.body_read_timeout_secs),
                connection_timeouts: config.connection_timeouts(),
                grpc_max_concurrent_streams: config.grpc_max_concurrent_streams,
                structured: config.structured_limits(),
                agent_limits: config.agent_limits(),
                auth: Arc::new(Auth::new(
                    &config.api_keys,
                    &config.admin_keys,
                    config.metrics_public,
                )),
                limits: Arc::new(Limits::new(config, store.clone())),
                sessions: Sessions::new(config, store.clone()),
                responses: StoredResponses::new(config, store),
                metrics: Metrics::new(),
            }),
            embeddings: None,
            swarm: None,
            verifier,
        }
    }

    /// The same state, checking answers with `verifier` (instead of the default swarm's
    /// verifier agent).
    pub fn with_verifier(mut self, verifier: Verifier) -> Self {
        self.verifier = Arc::new(verifier);
        self
    }

    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// The same state, also serving `embeddings` at `/v1/embeddings`.
    pub fn with_embeddings(mut self, embeddings: Embeddings) -> Self {
        self.embeddings = Some(embeddings);
        self
    }

    /// The same state, also routing requests among `swarm`'s agents.
    pub fn with_swarm(mut self, swarm: Swarm) -> Self {
        self.swarm = Some(swarm);
        self
    }

    pub fn swarm(&self) -> Option<&Swarm> {
        self.swarm.as_ref()
    }

    pub fn embeddings(&self) -> Option<&Embeddings> {
        self.embeddings.as_ref()
    }

    /// The id clients name the embedding model by, when one is served.
    pub fn embedding_model_id(&self) -> Option<&str> {
        self.embeddings.as_ref().map(Embeddings::model_id)
    }

    /// How requests reach the engines.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.inner.transport
    }

    /// The model requests are prepared for when they name none of the served models: the
    /// first.
    pub fn model(&self) -> &engine::ModelInfo {
        self.inner.transport.model()
    }

    /// The served model named `id`, or the default ([`AppState::model`]) for another name (an
    /// alias, an agent, a model not served: validation then answers for the name).
    pub fn model_named(&self, id: Option<&str>) -> &engine::ModelInfo {
        let models = self.inner.transport.models();
        id.and_then(|id| models.iter().find(|m| m.id == id))
            .unwrap_or_else(|| self.model())
    }

    /// The served model `agent` runs on: its own, or the default for an agent on `default`;
    /// `None` when no engine here serves its model.
    pub fn agent_model(&self, agent: &router::AgentSpec) -> Option<&engine::ModelInfo> {
        agent.model_among(self.inner.transport.models())
    }

    /// The id clients name the model by (besides the alias `"default"`).
    pub fn model_id(&self) -> &str {
        &self.inner.model_id
    }

    /// Unix seconds when this server was set up.
    pub fn started(&self) -> u64 {
        self.inner.started
    }

    /// The bounds on `caller`'s structured outputs, tools, answer lengths and hints: the
    /// server's, with its key's own `max_tokens`, `min_priority` and `max_cache_ttl_secs` (see
    /// [`crate::auth::KeyPolicy`]) within them.
    pub fn structured_limits(&self, caller: Caller) -> StructuredLimits {
        let mut limits = self.inner.structured;
        let policy = self.inner.auth.policy(caller);
        if let Some(own) = policy.max_tokens {
            let server = limits.max_tokens.limit.unwrap_or(own);
            limits.max_tokens.limit = Some(server.min(own));
        }
        limits.hints.min_priority = policy.min_priority;
        if let Some(own) = policy.max_cache_ttl_secs {
            let server = limits.hints.max_cache_ttl_secs;
            limits.hints.max_cache_ttl_secs = server.min(own as f64);
        }
        limits
    }

    /// The bounds on agents added at run time.
    pub fn agent_limits(&self) -> AgentLimits {
        self.inner.agent_limits
    }

    pub fn max_body_bytes(&self) -> usize {
        self.inner.max_body_bytes
    }

    /// How long a request body may take to arrive.
    pub fn body_read_timeout(&self) -> Duration {
        self.inner.body_read_timeout
    }

    /// The time limits of every HTTP connection.
    pub fn connection_timeouts(&self) -> ConnectionTimeouts {
        self.inner.connection_timeouts
    }

    /// gRPC calls one connection may carry at once.
    pub fn grpc_max_concurrent_streams(&self) -> u32 {
        self.inner.grpc_max_concurrent_streams
    }

    pub fn auth(&self) -> &Arc<Auth> {
        &self.inner.auth
    }

    pub fn limits(&self) -> &Arc<Limits> {
        &self.inner.limits
    }

    pub fn sessions(&self) -> &Sessions {
        &self.inner.sessions
    }

    /// The Responses API's stored responses.
    pub fn responses(&self) -> &StoredResponses {
        &self.inner.responses
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }
}

/// The swarm file the repository ships: the verifier agent's prompt comes from it until a
/// server is given a swarm of its own.
const DEFAULT_SWARM: &str = include_str!("../../../swarm.toml");

/// The system prompt of the default swarm's verifier agent.
fn default_verifier_prompt() -> String {
    let swarm = SwarmConfig::parse(DEFAULT_SWARM, "swarm.toml")
        .and_then(|swarm| Registry::new(swarm.agents))
        .expect("the shipped swarm file parses and keeps the rules (router's tests check it)");
    let prompt = swarm
        .list(AgentKind::Verifier)
        .next()
        .map(|agent| agent.system_prompt.clone());
    prompt.expect("the shipped swarm file has a verifier agent")
}

//! The swarm as every entry point reaches it: [`Swarm`] holds the shared registry, the routing
//! settings of the swarm file, one router per strategy and the agents' pins. The embedding
//! strategy is blocking CPU work (one MiniLM pass), so it runs on tokio's blocking threads,
//! never on a runtime worker; the `llm` strategy is a one-token request to the engine, awaited
//! like any other. [`run`] answers a chat as the swarm, [`consensus`] samples it several times.
//!
//! Where the agents are kept: in this process as the swarm file has them, or, with
//! `--database-url`, in PostgreSQL ([`crate::agent_store`]), shared by every replica. Then every
//! edit is written there first and the registry reloaded from it, and a task reloads it whenever
//! any replica edits; a reload publishes the stored agents and brings the pins and the routing
//! index in step with them. Edits and reloads are serialized, so pins follow the registry in
//! the order it changed.

pub mod consensus;
pub mod run;

use std::sync::{Arc, Weak};

use engine::{Embedder, Generate};
use router::{
    AgentId, AgentSpec, EmbeddingRouter, LlmRouter, Pins, Registry, Route, RoutingConfig,
    RoutingStrategy, SharedRegistry, SwarmConfig,
};

use crate::agent_store::{AgentStore, AgentStoreError};
use crate::api::swarm::RouteResponse;
use crate::error::ApiError;
use crate::transport::IntoTransport;
use crate::validate::agent_definition::ValidAgent;

/// The model name that asks the swarm to choose the agent.
pub const SWARM_MODEL: &str = "swarm";

/// [`SWARM_MODEL`]'s alias.
pub const AUTO_MODEL: &str = "auto";

/// The swarm as handlers reach it. Cloning is one reference-count increment.
#[derive(Clone)]
pub struct Swarm {
    inner: Arc<Inner>,
}

struct Inner {
    registry: SharedRegistry,
    routing: RoutingConfig,
    /// Absent when the server runs without an embedding model.
    embedding: Option<Arc<EmbeddingRouter>>,
    llm: LlmRouter,
    /// The router agent's name, which its engine calls run as.
    router_agent: Option<String>,
    /// Absent when the engines are in other processes, which pin their own agents' prompts.
    pins: Option<Pins>,
    /// Where the agents are kept, when not only here.
    store: Option<AgentStore>,
    /// Held by every edit and reload, from reading the agents to the last pin.
    editing: tokio::sync::Mutex<()>,
    /// Dropped with the swarm, which stops the task that follows the store.
    _following: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Swarm {
    /// The swarm of `config`, routing with the engines `transport` reaches and, when given,
    /// `embedder`.
    pub fn new(
        config: SwarmConfig,
        transport: impl IntoTransport,
        embedder: Option<Arc<Embedder>>,
    ) -> Result<Self, router::RouterError> {
        Self::build(config, None, transport, embedder)
    }

    /// The swarm of the agents in `store`, routed by `routing`, and kept in step with the store
    /// from now on (see the module header).
    pub async fn stored(
        routing: RoutingConfig,
        store: AgentStore,
        transport: impl IntoTransport,
        embedder: Option<Arc<Embedder>>,
    ) -> Result<Self, AgentStoreError> {
        let agents = store.load().await?;
        let config = SwarmConfig { routing, agents };
        let swarm = Self::build(config, Some(store), transport, embedder)
            .map_err(AgentStoreError::Corrupt)?;
        Ok(swarm)
    }

    fn build(
        config: SwarmConfig,
        store: Option<AgentStore>,
        transport: impl IntoTransport,
        embedder: Option<Arc<Embedder>>,
    ) -> Result<Self, router::RouterError> {
        let transport = transport.into_transport();
        let registry = Registry::new(config.agents)?;
        let router_agent = registry
            .list(router::AgentKind::Router)
            .next()
            .map(|a| a.name.to_string());
        let registry = SharedRegistry::new(registry);
        let margin = config.routing.margin;
        let (following, stop) = match &store {
            Some(_) => {
                let (following, stop) = tokio::sync::oneshot::channel();
                (Some(following), Some(stop))
            }
            None => (None, None),
        };
        let swarm = Self {
            inner: Arc::new(Inner {
                registry,
                routing: config.routing,
                embedding: embedder.map(|e| Arc::new(EmbeddingRouter::new(e, margin))),
                pins: transport.local_engine().cloned().map(Pins::new),
                llm: LlmRouter::new(margin),
                router_agent,
                store,
                editing: tokio::sync::Mutex::new(()),
                _following: following,
            }),
        };
        if let (Some(store), Some(stop)) = (&swarm.inner.store, stop) {
            tokio::spawn(follow(Arc::downgrade(&swarm.inner), store.changes(), stop));
        }
        Ok(swarm)
    }

    /// Embeds every agent's description and examples now, so that the first request does not
    /// pay for it.
    pub async fn prepare(&self) -> Result<(), ApiError> {
        let Some(router) = self.inner.embedding.clone() else {
            return Ok(());
        };
        let registry = self.inner.registry.snapshot();
        tokio::task::spawn_blocking(move || router.prepare(&registry))
            .await
            .map_err(|e| ApiError::Internal(format!("routing task: {e}")))??;
        Ok(())
    }

    /// The agents; edits take effect from the next request. Edit them through
    /// [`Swarm::add_agent`] and [`Swarm::remove_agent`], which keep the pins in step.
    pub fn registry(&self) -> &SharedRegistry {
        &self.inner.registry
    }

    /// Pins every answering agent's system prompt (see [`router::pins`]) on the engine
    /// in this process, if it is here, releasing the pins of agents gone, and waits until they
    /// are warm; returns the tokens newly pinned.
    pub async fn pin_prompts(&self) -> Result<usize, ApiError> {
        let Some(pins) = &self.inner.pins else {
            return Ok(0);
        };
        let registry = self.inner.registry.snapshot();
        let agents: Vec<&AgentSpec> = registry.agents().filter(|a| !a.kind.is_system()).collect();
        Ok(pins.sync(&agents).await?)
    }

    /// Tokens of `agent`'s system prompt pinned here; 0 when it has none (or the engines are
    /// elsewhere).
    pub async fn pinned_tokens(&self, agent: &str) -> usize {
        match &self.inner.pins {
            Some(pins) => pins.tokens(agent).await,
            None => 0,
        }
    }

    /// Adds `agent` to the swarm, unless it already holds `max_agents`, pins its system prompt
    /// and indexes it for routing; it answers from the next request on. With a store, the
    /// agent is written there first, and reaches the other replicas from there.
    pub async fn add_agent(&self, agent: ValidAgent, max_agents: usize) -> Result<(), ApiError> {
        let agent = agent.into_spec();
        let _editing = self.inner.editing.lock().await;
        if let Some(store) = &self.inner.store {
            store.add(&agent, max_agents).await?;
            return self.reload_locked().await;
        }
        // Every edit holds `editing`, so the count cannot change before the update.
        if self.inner.registry.snapshot().agents().count() >= max_agents {
            return Err(AgentStoreError::Full { max: max_agents }.into());
        }
        self.inner
            .registry
            .update(|registry| registry.add(agent.clone()))?;
        if let (false, Some(pins)) = (agent.kind.is_system(), &self.inner.pins) {
            if let Err(e) = pins.pin(&[&agent]).await {
                // A refused edit changes nothing: the agent goes again.
                self.inner
                    .registry
                    .update(|registry| registry.remove(&agent.name))?;
                return Err(e.into());
            }
        }
        self.prepare().await
    }

    /// Removes the specialist `name` and releases its pin; with a store, from the store first.
    pub async fn remove_agent(&self, name: &AgentId) -> Result<AgentSpec, ApiError> {
        let _editing = self.inner.editing.lock().await;
        if let Some(store) = &self.inner.store {
            let agent = store.remove(name).await?;
            self.reload_locked().await?;
            return Ok(agent);
        }
        let agent = self
            .inner
            .registry
            .update(|registry| registry.remove(name))?;
        if let Some(pins) = &self.inner.pins {
            pins.unpin(name.as_str()).await;
        }
        Ok(agent)
    }

    /// Publishes the stored agents, if they changed, and brings the pins and the routing index
    /// in step. The caller holds `editing`.
    async fn reload_locked(&self) -> Result<(), ApiError> {
        let Some(store) = &self.inner.store else {
            return Ok(());
        };
        let next = Registry::new(store.load().await?).map_err(AgentStoreError::Corrupt)?;
        let current = self.inner.registry.snapshot();
        if *current == next {
            return Ok(());
        }
        self.inner.registry.update(move |registry| {
            *registry = next;
            Ok(())
        })?;
        // The agents serve unpinned meanwhile; the edit is committed and stays.
        if let Err(e) = self.pin_prompts().await {
            tracing::warn!(error = %e, "cannot pin the changed agents' system prompts");
        }
        self.prepare().await
    }

    /// Whether a chat request for `model` is the swarm's to answer: [`SWARM_MODEL`],
    /// [`AUTO_MODEL`], or the name of an answering agent (system agents never answer users).
    pub fn answers(&self, model: Option<&str>) -> bool {
        match model {
            Some(SWARM_MODEL | AUTO_MODEL) => true,
            Some(name) => self
                .inner
                .registry
                .snapshot()
                .get(name)
                .is_some_and(|agent| !agent.kind.is_system()),
            None => false,
        }
    }

    pub fn routing(&self) -> &RoutingConfig {
        &self.inner.routing
    }

    /// The router agent's name, if the swarm has one.
    pub fn router_agent(&self) -> Option<&str> {
        self.inner.router_agent.as_deref()
    }

    /// Routes `text` (a conversation's last user turn) with `strategy`, or the swarm file's;
    /// the `llm` strategy asks `engine` (an internal agent's, whose refusals explain a failure:
    /// see [`crate::service::admission::AdmittedEngine::explain`]).
    pub async fn route(
        &self,
        engine: &dyn Generate,
        text: String,
        strategy: Option<RoutingStrategy>,
    ) -> Result<Route, ApiError> {
        let registry = self.inner.registry.snapshot();
        match strategy.unwrap_or(self.inner.routing.strategy) {
            RoutingStrategy::Embedding => {
                let router = self.inner.embedding.clone().ok_or_else(|| {
                    ApiError::invalid(
                        "strategy",
                        "the 'embedding' strategy needs the embedding model, which this server \
                         runs without",
                    )
                })?;
                let route = tokio::task::spawn_blocking(move || router.route(&registry, &text))
                    .await
                    .map_err(|e| ApiError::Internal(format!("routing task: {e}")))??;
                Ok(route)
            }
            RoutingStrategy::Llm => self
                .inner
                .llm
                .route(engine, &registry, &text)
                .await
                .map_err(ApiError::from),
        }
    }
}

/// Reloads the swarm behind `swarm` at every signal of `changes`, until the swarm is gone
/// (`stop` resolves when it drops).
async fn follow(
    swarm: Weak<Inner>,
    mut changes: tokio::sync::mpsc::Receiver<()>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            changed = changes.recv() => if changed.is_none() { return },
            _ = &mut stop => return,
        }
        let Some(inner) = swarm.upgrade() else { return };
        let swarm = Swarm { inner };
        let _editing = swarm.inner.editing.lock().await;
        match swarm.reload_locked().await {
            Ok(()) => tracing::debug!("agents reloaded from the store"),
            Err(e) => tracing::warn!(error = %e, "cannot reload the agents from the store"),
        }
    }
}

/// A routing decision as the API shows it.
pub(crate) fn route_response(route: Route) -> RouteResponse {
    RouteResponse {
        agent: route.agent.to_string(),
        strategy: match route.strategy {
            RoutingStrategy::Embedding => "embedding",
            RoutingStrategy::Llm => "llm",
        }
        .into(),
        scores: route
            .scores
            .into_iter()
            .map(|(agent, score)| (agent.to_string(), score))
            .collect(),
    }
}

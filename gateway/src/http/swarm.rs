//! `POST /v1/swarm/route`: which agent of the swarm would answer a conversation, and why (every
//! answering agent's score), without generating.
//!
//! [`Swarm`] is the swarm as handlers reach it: the shared registry, the routing settings of
//! the swarm file, and one router per strategy. The embedding strategy is blocking CPU work
//! (one MiniLM pass), so it runs on tokio's blocking threads, never on a runtime worker; the
//! `llm` strategy is a one-token request to the engine, awaited like any other.
//!
//! Without a swarm file the endpoint answers 404 for the model `swarm`, as for any model this
//! server does not serve; without an embedding model, the embedding strategy is a 400 naming
//! `strategy` (the `llm` one still works).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use engine::{ChatMessage, Embedder, ModelInfo};
use router::route::embedding::DEFAULT_METHOD;
use router::{
    AgentId, AgentSpec, EmbeddingRouter, LlmRouter, Registry, Route, RoutingConfig,
    RoutingStrategy, SharedRegistry, SwarmConfig,
};

use crate::api::swarm::{RouteRequest, RouteResponse};
use crate::app::AppState;
use crate::error::ApiError;
use crate::http::json::ApiJson;
use crate::openapi::GenerationErrors;
use crate::swarm::pins::Pins;
use crate::transport::{self, IntoTransport};
use crate::validate::swarm::{validate_route, ValidRouteRequest};

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
    /// Absent when the engines are in other processes, which pin their own agents' prompts.
    pins: Option<Pins>,
    /// The served model's id: what an agent's `model` must name, unless it says `default`.
    model_id: String,
}

impl Swarm {
    /// The swarm of `config`, routing with the engines `transport` reaches and, when given,
    /// `embedder`.
    pub fn new(
        config: SwarmConfig,
        transport: impl IntoTransport,
        embedder: Option<Arc<Embedder>>,
    ) -> Result<Self, router::RouterError> {
        let transport = transport.into_transport();
        let router_agent = config
            .agents
            .iter()
            .find(|a| a.kind == router::AgentKind::Router)
            .map(|a| a.name.to_string());
        let registry = SharedRegistry::new(Registry::new(config.agents)?);
        let margin = config.routing.margin;
        Ok(Self {
            inner: Arc::new(Inner {
                registry,
                routing: config.routing,
                embedding: embedder
                    .map(|e| Arc::new(EmbeddingRouter::new(e, margin, DEFAULT_METHOD))),
                pins: transport.local_engine().cloned().map(Pins::new),
                model_id: transport.model().id.clone(),
                llm: LlmRouter::new(
                    transport::for_agent(transport.clone(), router_agent.as_deref()),
                    margin,
                ),
            }),
        })
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

    /// Pins every answering agent's system prompt (see [`crate::swarm::pins`]) on the engine
    /// in this process, if it is here, and waits until they are warm; returns the tokens pinned.
    pub async fn pin_prompts(&self) -> Result<usize, ApiError> {
        let Some(pins) = &self.inner.pins else {
            return Ok(0);
        };
        let registry = self.inner.registry.snapshot();
        let agents: Vec<&AgentSpec> = registry.agents().filter(|a| !a.kind.is_system()).collect();
        Ok(pins.pin(&agents).await?)
    }

    /// Tokens of `agent`'s system prompt pinned here; 0 when it has none (or the engines are
    /// elsewhere).
    pub async fn pinned_tokens(&self, agent: &str) -> usize {
        match &self.inner.pins {
            Some(pins) => pins.tokens(agent).await,
            None => 0,
        }
    }

    /// Adds `agent` to the swarm, pins its system prompt and indexes it for routing; it answers
    /// from the next request on.
    pub async fn add_agent(&self, agent: AgentSpec) -> Result<(), ApiError> {
        if !agent.model.is_default() && agent.model.as_str() != self.inner.model_id {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "agent `{}` runs on model `{}`, which this server does not serve (it serves \
                     `{}`; `default` names it too)",
                    agent.name, agent.model, self.inner.model_id
                ),
            ));
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

    /// Removes the specialist `name` and releases its pin.
    pub async fn remove_agent(&self, name: &AgentId) -> Result<AgentSpec, ApiError> {
        let agent = self
            .inner
            .registry
            .update(|registry| registry.remove(name))?;
        if let Some(pins) = &self.inner.pins {
            pins.unpin(name.as_str()).await;
        }
        Ok(agent)
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

    /// Routes `text` (a conversation's last user turn) with `strategy`, or the swarm file's.
    pub async fn route(
        &self,
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
            RoutingStrategy::Llm => Ok(self.inner.llm.route(&registry, &text).await?),
        }
    }
}

/// What every prompt of `agent` starts with: its system prompt alone, rendered by `model`'s chat
/// template (no generation header) and encoded as chat requests are. Chat requests answered by
/// the agent put this system message first, so their token ids begin with these, and a pin of
/// them keeps that prefix warm. `None` for an agent without a system prompt.
pub fn system_prefix(model: &ModelInfo, agent: &AgentSpec) -> Option<engine::Result<Vec<u32>>> {
    if agent.system_prompt.trim().is_empty() {
        return None;
    }
    let system = [ChatMessage::new("system", agent.system_prompt.as_str())];
    Some(
        model
            .encode_chat(&system, false)
            .map(|prompt| prompt.tokens),
    )
}

/// Chooses the agent that would answer a conversation, without generating.
#[utoipa::path(post, path = "/v1/swarm/route", tag = "swarm",
    request_body = RouteRequest,
    responses(
        (status = 200, description = "The routing decision.", body = RouteResponse),
        GenerationErrors,
    ),
    security(("api_key" = [])))]
pub async fn route(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<RouteRequest>,
) -> Result<Json<RouteResponse>, ApiError> {
    let Some(swarm) = state.swarm() else {
        return Err(ApiError::ModelNotFound(SWARM_MODEL.into()));
    };
    let ValidRouteRequest { text, strategy } = validate_route(request)?;
    let route = swarm.route(text, strategy).await?;
    Ok(Json(route_response(route)))
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

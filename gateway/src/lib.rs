//! Swarmgate's gateway: the OpenAI-compatible HTTP API (and the same chat over gRPC) in front of
//! the engines, and the NATS worker that serves an engine to gateways. A library: the
//! `swarmgate` binary is the `cli` crate's. Uses `engine`, `router` (agents, routing, the
//! verifier) and `protocol` (the NATS wire format); nothing but `cli` and the fuzz targets uses
//! it.
//!
//! Modules, leaf first (a module uses only those above it; `scripts/module-cycles.py` checks
//! that no cycle holds more than 3 files):
//! - [`api`] is OpenAI's wire format: serde types, no behaviour. [`error`] is the one place
//!   that decides HTTP statuses and error bodies (and their OpenAPI descriptions).
//! - [`validate`] turns a wire request into a request the engine can run, or a 400 naming the
//!   offending field; only a [`validate::ValidChatRequest`] reaches the engine. Its
//!   [`validate::structured`] turns `response_format` and `tools` into the grammar the engine
//!   enforces, and [`tool_calls`] reads a tool-call answer back into OpenAI's shapes;
//!   [`logprobs`] shapes the engine's log-probabilities.
//! - [`state`] is the store (in memory, or Redis) for rate-limit buckets, sessions and stored
//!   responses; [`agent_store`] keeps the swarm's agents in PostgreSQL (`--database-url`).
//! - [`auth`] checks API keys and names the [`auth::Caller`]; [`limits`] holds the per-caller
//!   rate limits, the bounded admission queue and the [`deadline`]s; [`session`] keeps
//!   conversation histories; [`metrics`] counts it all for `GET /metrics`.
//! - [`transport`] is where engines live: this process ([`transport::Local`], `swarmgate
//!   serve`) or workers over NATS ([`transport::Nats`], `swarmgate gateway`); [`worker`] is the
//!   other side, a process serving its engine on NATS.
//! - [`service`] is what every entry point does once a request is parsed: [`AppState`], engine
//!   calls under the request's limits, choices, embeddings, verification, stored responses, and
//!   the swarm's pipeline (route, answer as an agent, verify, consensus).
//! - [`http`] (one module per endpoint family) and [`grpc`] parse, call the service and shape
//!   JSON or server-sent events; [`openapi`] is the API's document, generated from [`api`] and
//!   the handlers.
//! - [`mod@app`] is the route table and the layers every request passes; [`config`] the
//!   settings (flags, environment, file); [`serve`] runs it all, and [`connection`] serves each
//!   TCP connection under its timeouts.
//!
//! Handlers reach the engines only through [`transport::Transport::submit`] and the stream it
//! returns. Dropping that stream cancels the request wherever it runs, so a client that goes
//! away frees its KV blocks without any bookkeeping here.

pub mod agent_store;
pub mod api;
pub mod app;
pub mod auth;
pub mod config;
pub mod connection;
pub mod deadline;
pub mod error;
pub mod grpc;
pub mod http;
pub mod limits;
pub mod logprobs;
pub mod metrics;
pub mod openapi;
pub mod runs;
pub mod service;
pub mod session;
pub mod state;
#[cfg(test)]
pub(crate) mod test_support;
pub mod tool_calls;
pub mod transport;
pub mod validate;
pub mod worker;

use std::future::Future;

use anyhow::Context as _;
use futures::FutureExt as _;
use tokio::net::TcpListener;

pub use app::app;
pub use config::ServeConfig;
pub use error::ApiError;
pub use service::embeddings::Embeddings;
pub use service::swarm::Swarm;
pub use service::AppState;

/// Binds `config.host:config.port`, and `config.grpc_port` unless it is 0, and serves the HTTP
/// and gRPC APIs until SIGTERM or ctrl-c; then both stop accepting connections and let the
/// requests in flight finish, for at most `config.shutdown_grace_secs`.
pub async fn serve(
    config: config::ServeConfig,
    transport: std::sync::Arc<dyn transport::Transport>,
) -> anyhow::Result<()> {
    config.validate().map_err(anyhow::Error::msg)?;
    // Loaded before listening, like the engine: a server that listens is one that answers.
    let embeddings = service::embeddings::Embeddings::start(&config.embedding)
        .await
        .context("cannot load the embedding model")?;
    let listener = TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.host, config.port))?;
    let grpc_listener = match config.grpc_port {
        0 => None,
        port => Some(
            TcpListener::bind((config.host.as_str(), port))
                .await
                .with_context(|| format!("cannot listen on {}:{port} (gRPC)", config.host))?,
        ),
    };
    let swarm = match load_swarm(&config, &transport, embeddings.as_ref()).await? {
        Some(swarm) => {
            swarm
                .prepare()
                .await
                .map_err(|e| anyhow::anyhow!("cannot index the swarm's agents: {e}"))?;
            let pinned = swarm
                .pin_prompts()
                .await
                .map_err(|e| anyhow::anyhow!("cannot pin the agents' system prompts: {e}"))?;
            let registry = swarm.registry().snapshot();
            tracing::info!(
                agents = registry.agents().count(),
                stored = config.database_url.is_some(),
                strategy = ?swarm.routing().strategy,
                pinned_prompt_tokens = pinned,
                "swarm loaded"
            );
            let verifier = registry
                .list(router::AgentKind::Verifier)
                .next()
                .map(|agent| (agent.name.to_string(), agent.system_prompt.clone()));
            Some((swarm, verifier))
        }
        None => None,
    };
    let engine = transport.local_engine().cloned();
    let mut state = AppState::configured(transport.clone(), &config);
    if let Some(embeddings) = embeddings {
        state = state.with_embeddings(embeddings);
    }
    if let Some((swarm, verifier)) = swarm {
        state = state.with_swarm(swarm);
        // The swarm's own verifier agent judges answers (the registry requires one when a
        // policy asks for the judge; without one the shipped prompt stays).
        if let Some((name, prompt)) = verifier {
            let verifier =
                router::Verifier::new(transport.model(), prompt, router::VerifierConfig::default())
                    .as_agent(name);
            state = state.with_verifier(verifier);
        }
    }
    // One signal, awaited by both servers and by the grace period.
    let signal = shutdown_signal().shared();
    let http = async {
        serve_on(listener, state.clone(), signal.clone())
            .await
            .context("server failed")
    };
    let grpc = async {
        match grpc_listener {
            Some(listener) => grpc::serve_on(listener, state.clone(), signal.clone())
                .await
                .context("gRPC server failed"),
            None => Ok(()),
        }
    };
    let grace = std::time::Duration::from_secs(config.shutdown_grace_secs);
    tokio::select! {
        served = async { tokio::try_join!(http, grpc).map(|_| ()) } => served,
        // Its requests have already ended with errors; exiting lets a supervisor restart us.
        () = async {
            match &engine {
                Some(engine) => engine.stopped().await,
                None => std::future::pending().await,
            }
        } => Err(anyhow::anyhow!("the engine failed and stopped; exiting so that it is restarted")),
        // Dropping the servers ends the remaining streams, which cancels their sequences.
        () = async {
            signal.clone().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(grace_secs = grace.as_secs(), "grace period over; ending open streams");
            Ok(())
        }
    }
}

/// The swarm: the swarm file's agents, or with `--database-url` the stored ones (which the file
/// seeds while the table is empty; see [`agent_store`]). `None` without a swarm file and
/// without stored agents.
async fn load_swarm(
    config: &config::ServeConfig,
    transport: &std::sync::Arc<dyn transport::Transport>,
    embeddings: Option<&service::embeddings::Embeddings>,
) -> anyhow::Result<Option<service::swarm::Swarm>> {
    let file = match config.swarm_file() {
        Some(path) => Some(router::SwarmConfig::load(&path)?),
        None => None,
    };
    let embedder = embeddings.map(service::embeddings::Embeddings::embedder);
    let Some(url) = &config.database_url else {
        return match file {
            Some(file) => Ok(Some(service::swarm::Swarm::new(
                file,
                transport.clone(),
                embedder,
            )?)),
            None => Ok(None),
        };
    };
    let store = agent_store::AgentStore::open(url)
        .await
        .context("cannot open the agent store (--database-url)")?;
    let routing = match file {
        Some(file) => {
            // The file's agents must form a swarm before they may seed the table.
            router::Registry::new(file.agents.iter().cloned())?;
            if store.seed(&file.agents).await? {
                tracing::info!(
                    agents = file.agents.len(),
                    "agent store seeded from the swarm file"
                );
            }
            file.routing
        }
        None => router::RoutingConfig::default(),
    };
    if store.load().await?.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        service::swarm::Swarm::stored(routing, store, transport.clone(), embedder).await?,
    ))
}

/// Serves the API on an already bound listener until `shutdown` completes. Tests bind
/// `127.0.0.1:0` and pass their own shutdown.
pub async fn serve_on(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, model = %state.model_id(), "listening");
    }
    let upkeep = tokio::spawn(state.metrics().clone().upkeep());
    let timeouts = state.connection_timeouts();
    let served = connection::serve(listener, app(state), timeouts, shutdown).await;
    upkeep.abort();
    served
}

/// Completes on ctrl-c, or on SIGTERM where there is one (what container runtimes send).
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections, finishing requests in flight");
}

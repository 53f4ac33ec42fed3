//! Where engines live, as handlers see it: one [`Transport`] that takes a generation request for
//! an agent and returns its event stream, whether the engine runs in this process
//! ([`local::Local`], `swarmgate serve`) or in worker processes reached over NATS
//! ([`nats::Nats`], `swarmgate gateway`). Handlers, the router and the verifier never know which.
//!
//! - The [`protocol`] crate is the NATS wire format both sides speak, the workers' registry
//!   and how both join NATS.
//! - [`nats`] is the gateway's side: picks a worker, hands the request over, relays the batched
//!   token messages, fails over and watches every stream for silence.
//! - [`crate::worker`] is the other side: a worker process serving its engine on NATS.

pub mod local;
pub mod nats;

use std::sync::Arc;

use engine::{EngineHandle, EventStream, GenerateRequest, ModelInfo};
use futures::future::BoxFuture;

pub use local::Local;
pub use nats::Nats;

/// How requests reach an engine.
pub trait Transport: Send + Sync + 'static {
    /// The model requests are prepared for when they name none: tokenizer, chat template,
    /// context window.
    fn model(&self) -> &ModelInfo;

    /// Every model the engines serve, the default first.
    fn models(&self) -> &[ModelInfo];

    /// Checks `request` and hands it to an engine serving `agent` (`None`: any engine of the
    /// model). Fails without queueing when the request can never be served or no engine can
    /// take it now. Dropping the stream cancels the request wherever it runs.
    fn submit<'a>(
        &'a self,
        agent: Option<&'a str>,
        request: GenerateRequest,
    ) -> BoxFuture<'a, engine::Result<EventStream>>;

    /// Whether some engine serves `agent` now.
    fn serves(&self, agent: &str) -> bool;

    /// Whether requests can be served now: the engine runs, or some worker is live.
    fn is_ready(&self) -> bool;

    /// The engine in this process, if it is here: `/metrics` reads its statistics and the swarm
    /// pins its agents' prompts on it. Workers pin their own.
    fn local_engine(&self) -> Option<&EngineHandle>;
}

/// What a server can be built on: a transport, or the engine in this process (which becomes
/// [`Local`]).
pub trait IntoTransport {
    fn into_transport(self) -> Arc<dyn Transport>;
}

impl IntoTransport for Arc<dyn Transport> {
    fn into_transport(self) -> Arc<dyn Transport> {
        self
    }
}

impl IntoTransport for EngineHandle {
    fn into_transport(self) -> Arc<dyn Transport> {
        Arc::new(Local::new(self))
    }
}

//! The service layer: what every entry point (the HTTP handlers, gRPC, the swarm's internal
//! agents) does once a request is parsed, below the handlers and above the limits, the store and
//! the transport. [`AppState`] is the state they share; handlers parse, call in here, and shape
//! JSON or server-sent events.
//!
//! - [`state`]: [`AppState`], built once per server.
//! - [`admission`]: engine calls under a request's limits (seats, tokens, deadlines, metrics),
//!   for the request itself and for the internal agents serving it.
//! - [`choices`]: a request's answers generated side by side, collected or streamed.
//! - [`embeddings`]: the embedding model, one batch at a time off the runtime's threads.
//! - [`verify`]: the verifier's deterministic and relevance checks.
//! - [`responses`]: the Responses API's stored responses.
//! - [`warm_up`]: speculative prefill of a run's next turn.
//! - [`swarm`]: the swarm (registry, routers, pins) and its pipeline (route, answer, verify,
//!   consensus).
//!
//! Dependency order, leaf first: `api` → `error` → `validate` → `state` (the store) →
//! {`auth`, `limits`, `session`, `metrics`} → `service` → {`http`, `grpc`} → `app`.

pub mod admission;
pub mod choices;
pub mod embeddings;
pub mod responses;
pub mod state;
pub mod swarm;
pub mod verify;
pub mod warm_up;

pub use state::AppState;

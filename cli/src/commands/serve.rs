//! `swarmgate serve`: the OpenAI-compatible API, and the same chat over gRPC, on an engine in
//! this process; [`gateway::serve`] does the serving.

use std::sync::Arc;

use anyhow::Result;

use super::runtime;

pub fn run(config: gateway::ServeConfig) -> Result<()> {
    // Load the model before taking requests: a server that listens is a server that answers.
    let engine = engine::EngineHandle::start(&config.engine)?;
    let transport = Arc::new(gateway::transport::Local::new(engine));
    runtime()?.block_on(gateway::serve(config, transport))
}

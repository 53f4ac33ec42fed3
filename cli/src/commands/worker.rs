//! `swarmgate worker`: an engine serving gateways' requests over NATS; [`gateway::worker`] is
//! the worker itself.

use anyhow::Result;

use super::runtime;

pub fn run(config: gateway::worker::WorkerConfig) -> Result<()> {
    // Settings that cannot connect fail before the model loads.
    config.nats.validate()?;
    let engine = engine::EngineHandle::start(&config.engine)?;
    runtime()?.block_on(gateway::worker::run(config, engine))
}

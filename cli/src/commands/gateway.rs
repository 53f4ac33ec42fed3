//! `swarmgate gateway`: the same API as `swarmgate serve` with no engine of its own; requests go
//! over NATS to `swarmgate worker`s, found in the workers' registry (a JetStream bucket).

use std::sync::Arc;

use anyhow::{Context as _, Result};

use super::runtime;

/// `swarmgate gateway`'s own settings; the server's are [`gateway::ServeConfig`]'s.
#[derive(clap::Args)]
pub struct GatewayCommand {
    #[command(flatten)]
    serve: gateway::ServeConfig,
    #[command(flatten)]
    nats: gateway::transport::nats::GatewayArgs,
}

/// Serves with `config`, the server's settings as [`super::server_config`] read them.
pub fn run(config: gateway::ServeConfig, command: GatewayCommand) -> Result<()> {
    let nats = command.nats;
    let settings = nats.settings()?;
    // The tokenizers and the chat templates only: the weights are the workers'.
    let models = std::iter::once(&config.engine.model)
        .chain(&config.engine.extra_models)
        .map(|path| engine::ModelInfo::load(path))
        .collect::<engine::Result<Vec<_>>>()?;
    runtime()?.block_on(async {
        let client = nats.nats.connect("swarmgate-gateway").await?;
        let transport = gateway::transport::Nats::connect(client, models, settings)
            .await
            .context("cannot open the workers' registry (is JetStream on?)")?;
        gateway::serve(config, Arc::new(transport)).await
    })
}

//! `swarmgate worker`: an engine serving gateways' requests over NATS; [`gateway::worker`] is
//! the worker itself. Started as one device of a plan (`--place-on`), it loads the models and
//! hosts the agents `swarmgate plan` places there.

use std::path::PathBuf;

use anyhow::{bail, Result};
use router::{DeviceName, DeviceSpec};

use super::plan::{self, GpuSizing};
use super::runtime;

#[derive(clap::Args)]
pub struct WorkerCommand {
    #[command(flatten)]
    config: gateway::worker::WorkerConfig,
    /// Take this device's share of the swarm file's placement on --plan-devices (as `swarmgate
    /// plan` prints it): load the models placed there (`--model` first when it is among them,
    /// the others beside it in one engine) and host the agents placed there. Excludes
    /// --agents and --extra-model.
    #[arg(long, env = "SWARMGATE_PLACE_ON")]
    place_on: Option<String>,
    /// The devices the swarm is placed on, with their memory budgets, as `swarmgate plan
    /// --devices` takes them (default: `cpu` with half of this machine's RAM).
    #[arg(long, env = "SWARMGATE_PLAN_DEVICES", value_delimiter = ',')]
    plan_devices: Vec<DeviceSpec>,
}

pub fn run(command: WorkerCommand) -> Result<()> {
    let mut config = command.config;
    // Settings that cannot connect fail before the model loads.
    config.nats.validate()?;
    if let Some(device) = &command.place_on {
        if !config.agents.is_empty() || !config.engine.extra_models.is_empty() {
            bail!("--place-on takes the agents and the models from the plan: drop --agents and --extra-model");
        }
        let devices = match command.plan_devices {
            devices if devices.is_empty() => vec![plan::half_of_ram()?],
            devices => devices,
        };
        let swarm = config
            .swarm
            .clone()
            .unwrap_or_else(|| PathBuf::from("swarm.toml"));
        let engine = &config.engine;
        let gpu = GpuSizing::of(engine);
        let share = plan::share(
            &swarm,
            &engine.model,
            &devices,
            gpu,
            &DeviceName::new(device.as_str())?,
        )?;
        let Some((first, rest)) = share.models.split_first() else {
            bail!("the plan places nothing on `{device}`");
        };
        tracing::info!(device, models = ?share.models, agents = ?share.agents, "taking the plan's share");
        config.engine.model = first.clone();
        config.engine.extra_models = rest.to_vec();
        config.agents = share.agents;
        config.swarm = Some(swarm);
    }
    let engine = engine::EngineHandle::start(&config.engine)?;
    runtime()?.block_on(gateway::worker::run(config, engine))
}

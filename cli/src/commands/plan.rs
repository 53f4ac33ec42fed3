//! `swarmgate plan`: where each agent of a swarm file would run, within the devices' memory
//! budgets, printed as a table. Also the quickest check of a swarm file: every agent is
//! validated on the way.
//!
//! Models are sized from their files without loading them: on a CPU the weights are the GGUF's
//! size on disk; on a GPU (`cuda:N`) they are what the engine holds there in the `--gpu-weights`
//! form (from the GGUF's tensor list, as the engine sizes them before loading), plus its reserve
//! for a step's activations at `--max-step-tokens` and `--max-running`, and every GPU keeps the
//! engine's headroom free. KV bytes per token come from the metadata (layers x 2 x KV heads x
//! head dim x 4 bytes: the engine caches keys and values in f32). `default` is the served model
//! (`--model`); any other model id must be a GGUF beside it, named `<id>.gguf` or `<id>`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use engine::kv_cache::KvDtype;
use engine::model::{DeviceWeights, Gguf, Llama, LlamaConfig};
use engine::ModelInfo;
use router::{
    AgentSpec, ByteSize, DeviceName, DeviceSpec, ModelCatalog, ModelFootprint, ModelId, Placement,
    Registry, SwarmConfig,
};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The swarm file.
    #[arg(long, default_value = "swarm.toml")]
    config: PathBuf,
    /// Devices and their memory budgets, comma-separated, e.g.
    /// `cuda:0=80GiB,cuda:1=80GiB,cpu=16GiB` (default: `cpu` with half of this machine's RAM).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<DeviceSpec>,
    /// The served GGUF, which agents on model `default` run.
    #[arg(
        long,
        env = "SWARMGATE_MODEL",
        default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    )]
    model: PathBuf,
    #[command(flatten)]
    gpu: GpuSizing,
}

/// How the engines on a GPU will run, which sizes a replica there (the engine options of the
/// same names).
#[derive(Args, Clone, Copy, Debug)]
pub struct GpuSizing {
    /// The weights' form on a GPU.
    #[arg(long, env = "SWARMGATE_GPU_WEIGHTS", value_enum, default_value_t = DeviceWeights::F32)]
    gpu_weights: DeviceWeights,
    /// Most tokens in one engine step.
    #[arg(long, env = "SWARMGATE_MAX_STEP_TOKENS", default_value_t = 256)]
    max_step_tokens: usize,
    /// Most sequences decoding at once.
    #[arg(long, env = "SWARMGATE_MAX_RUNNING", default_value_t = 64)]
    max_running: usize,
}

impl GpuSizing {
    /// The sizing an engine with `config` runs at.
    pub fn of(config: &engine::EngineConfig) -> Self {
        Self {
            gpu_weights: config.gpu_weights,
            max_step_tokens: config.max_step_tokens,
            max_running: config.max_running,
        }
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let devices = if args.devices.is_empty() {
        vec![half_of_ram()?]
    } else {
        args.devices
    };
    print!("{}", report(&args.config, &args.model, &devices, args.gpu)?);
    Ok(())
}

/// What the plan gives one device: the files of the models to load there (the served model
/// first when it is among them) and the agents it hosts.
#[derive(Debug, PartialEq)]
pub struct Share {
    pub models: Vec<PathBuf>,
    pub agents: Vec<String>,
}

/// `device`'s share of the placement of the swarm in `config` on `devices`: what a worker
/// started as that device loads and hosts.
pub fn share(
    config: &Path,
    served: &Path,
    devices: &[DeviceSpec],
    gpu: GpuSizing,
    device: &DeviceName,
) -> Result<Share> {
    let registry = Registry::new(SwarmConfig::load(config)?.agents)?;
    let agents: Vec<AgentSpec> = registry.agents().cloned().collect();
    share_of(&agents, served, devices, gpu, device)
}

fn share_of(
    agents: &[AgentSpec],
    served: &Path,
    devices: &[DeviceSpec],
    gpu: GpuSizing,
    device: &DeviceName,
) -> Result<Share> {
    let catalog = catalog(agents, served, gpu)?;
    check_pins(agents, &catalog, served)?;
    let placement = router::plan(agents, &catalog, devices)?;
    let load = placement
        .devices()
        .iter()
        .find(|load| load.device.name == *device)
        .with_context(|| format!("the plan has no device `{device}` (see --plan-devices)"))?;
    let served_id = model_id(served)?;
    let dir = served.parent().unwrap_or(Path::new("."));
    let mut models: Vec<&ModelId> = load.models.iter().collect();
    models.sort_by_key(|m| **m != served_id);
    let models = models
        .into_iter()
        .map(|m| match *m == served_id {
            true => Ok(served.to_path_buf()),
            false => model_file(dir, m).context("the catalog's models are files"),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Share {
        models,
        agents: load.agents.iter().map(ToString::to_string).collect(),
    })
}

/// The placement of the swarm in `config` on `devices`, rendered; an error if the file is
/// invalid, a model is unknown, or the agents do not fit.
fn report(config: &Path, served: &Path, devices: &[DeviceSpec], gpu: GpuSizing) -> Result<String> {
    let swarm = SwarmConfig::load(config)?;
    let registry = Registry::new(swarm.agents)?;
    let catalog = catalog(registry.agents(), served, gpu)?;
    check_pins(registry.agents(), &catalog, served)?;
    let placement = router::plan(registry.agents(), &catalog, devices)?;
    Ok(render(&placement, &catalog))
}

/// Sizes the served model and every model the agents name.
fn catalog<'a>(
    agents: impl IntoIterator<Item = &'a AgentSpec>,
    served: &Path,
    gpu: GpuSizing,
) -> Result<ModelCatalog> {
    let mut catalog = ModelCatalog::default();
    let served_id = model_id(served)?;
    catalog.insert(served_id.clone(), footprint(served, gpu)?);
    catalog.alias(ModelId::default(), served_id);
    let dir = served.parent().unwrap_or(Path::new("."));
    for agent in agents {
        if catalog.resolve(&agent.model).is_some() {
            continue;
        }
        let path = model_file(dir, &agent.model).with_context(|| {
            format!(
                "agent `{}` runs on model `{}`, which is neither the served model ({}) nor a \
                 file {}/{}[.gguf]",
                agent.name,
                agent.model,
                served.display(),
                dir.display(),
                agent.model
            )
        })?;
        let id = model_id(&path)?;
        if catalog.resolve(&id).is_none() {
            catalog.insert(id.clone(), footprint(&path, gpu)?);
        }
        // A file name and the model id it holds are one model: one replica, not two.
        catalog.alias(agent.model.clone(), id);
    }
    Ok(catalog)
}

/// Refuses an agent whose system prompt, which the engine keeps pinned in the KV cache beside its
/// model for as long as the agent exists, would not fit in the agent's own KV reserve.
fn check_pins<'a>(
    agents: impl IntoIterator<Item = &'a AgentSpec>,
    catalog: &ModelCatalog,
    served: &Path,
) -> Result<()> {
    let dir = served.parent().unwrap_or(Path::new("."));
    let served_id = model_id(served)?;
    let mut models: BTreeMap<ModelId, ModelInfo> = BTreeMap::new();
    for agent in agents {
        let model = catalog
            .resolve(&agent.model)
            .context("the catalog holds every agent's model")?;
        if !models.contains_key(model) {
            let path = match *model == served_id {
                true => served.to_path_buf(),
                false => model_file(dir, model).context("the catalog's models are files")?,
            };
            models.insert(model.clone(), ModelInfo::load(&path)?);
        }
        let Some(prefix) = agent.system_prefix(&models[model]) else {
            continue;
        };
        let tokens = prefix?.len() as u64;
        if tokens > agent.kv_reserve_tokens {
            bail!(
                "agent `{}`: its system prompt takes {tokens} tokens of KV cache, pinned beside \
                 model `{model}`, more than its kv_reserve_tokens ({})",
                agent.name,
                agent.kv_reserve_tokens
            );
        }
    }
    Ok(())
}

/// The GGUF a model id names in `dir`, if there is one. Only plain file names count, so a
/// model id can never reach outside the models directory.
fn model_file(dir: &Path, model: &ModelId) -> Option<PathBuf> {
    let name = model.as_str();
    if Path::new(name).file_name() != Some(name.as_ref()) {
        return None;
    }
    [dir.join(name), dir.join(format!("{name}.gguf"))]
        .into_iter()
        .find(|path| path.is_file())
}

/// The engine's name for the model in `path`: the file name without extension.
fn model_id(path: &Path) -> Result<ModelId> {
    let stem = path
        .file_stem()
        .with_context(|| format!("{} has no file name", path.display()))?;
    Ok(ModelId::new(stem.to_string_lossy())?)
}

fn footprint(path: &Path, gpu: GpuSizing) -> Result<ModelFootprint> {
    let weight_bytes = std::fs::metadata(path)
        .with_context(|| format!("cannot read {} (run `make models`)", path.display()))?
        .len();
    let gguf = Gguf::open(path)?;
    let config = LlamaConfig::from_gguf(&gguf)?;
    let gpu_replica_bytes = Llama::device_weight_bytes(&gguf, gpu.gpu_weights)?
        + config.activation_bytes(gpu.max_step_tokens, gpu.max_running);
    // A block of one token costs exactly one token's KV, whatever block size the engine runs;
    // as a GPU holds it (f32), which bounds a CPU's (f16) from above.
    let kv_bytes_per_token = config.kv_layout(1, KvDtype::F32).bytes_per_block() as u64;
    Ok(ModelFootprint {
        weight_bytes,
        gpu_replica_bytes: gpu_replica_bytes as u64,
        kv_bytes_per_token,
    })
}

/// The default device: the CPU, with half of the machine's RAM, leaving the rest to the OS,
/// the host KV tier and everything else running.
pub fn half_of_ram() -> Result<DeviceSpec> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .context("cannot read /proc/meminfo to size the default device: pass --devices")?;
    let total = mem_total_bytes(&meminfo)
        .context("/proc/meminfo has no MemTotal to size the default device: pass --devices")?;
    Ok(DeviceSpec {
        name: DeviceName::new("cpu")?,
        budget_bytes: total / 2,
    })
}

fn mem_total_bytes(meminfo: &str) -> Option<u64> {
    let kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    kib.checked_mul(1024)
}

fn render(placement: &Placement, catalog: &ModelCatalog) -> String {
    let list = |items: Vec<String>| {
        if items.is_empty() {
            "-".to_owned()
        } else {
            items.join(", ")
        }
    };
    let mut devices = vec![row([
        "device", "budget", "headroom", "used", "free", "models", "agents",
    ])];
    for load in placement.devices() {
        devices.push(vec![
            load.device.name.to_string(),
            ByteSize(load.device.budget_bytes).to_string(),
            ByteSize(load.device.reserved_bytes()).to_string(),
            ByteSize(load.used_bytes).to_string(),
            ByteSize(load.free_bytes()).to_string(),
            list(load.models.iter().map(ToString::to_string).collect()),
            list(load.agents.iter().map(ToString::to_string).collect()),
        ]);
    }
    let models: BTreeSet<&ModelId> = placement.agents().values().map(|a| &a.model).collect();
    let mut footprints = vec![row([
        "model",
        "weights",
        "GPU replica",
        "KV/token",
        "agents",
        "devices",
    ])];
    for model in models {
        let footprint = catalog
            .footprint(model)
            .expect("placed models come from the catalog");
        let agents = placement
            .agents()
            .values()
            .filter(|a| &a.model == model)
            .count();
        footprints.push(vec![
            model.to_string(),
            ByteSize(footprint.weight_bytes).to_string(),
            ByteSize(footprint.gpu_replica_bytes).to_string(),
            ByteSize(footprint.kv_bytes_per_token).to_string(),
            agents.to_string(),
            list(placement.replicas(model).map(ToString::to_string).collect()),
        ]);
    }
    format!("{}\n{}", table(&devices), table(&footprints))
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.map(str::to_owned).to_vec()
}

/// Left-aligned columns two spaces apart; the last column is not padded, so long agent lists
/// leave no trailing spaces.
fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for cells in rows {
        let last = cells.len().saturating_sub(1);
        for (c, cell) in cells.iter().enumerate() {
            if c == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<width$}  ", width = widths[c]));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1";

    /// The engine's defaults.
    const SIZING: GpuSizing = GpuSizing {
        gpu_weights: DeviceWeights::F32,
        max_step_tokens: 256,
        max_running: 64,
    };

    fn repo(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
    }

    /// The served model; a missing file fails with the command that fetches it, so a green run
    /// means the test ran.
    fn served() -> PathBuf {
        let path = repo(&format!("models/{SMOLLM2}.gguf"));
        assert!(
            path.is_file(),
            "{} is missing: run `make models`",
            path.display()
        );
        path
    }

    fn devices(list: &str) -> Vec<DeviceSpec> {
        list.split(',').map(|d| d.parse().unwrap()).collect()
    }

    fn agent_on(model: &str) -> AgentSpec {
        AgentSpec {
            model: ModelId::new(model).unwrap(),
            ..AgentSpec::new(
                router::AgentId::new("poet").unwrap(),
                router::AgentKind::General,
            )
        }
    }

    #[test]
    fn smollm2_is_sized_from_its_file_and_metadata() {
        let footprint = footprint(&served(), SIZING).unwrap();
        assert_eq!(
            footprint.weight_bytes,
            std::fs::metadata(served()).unwrap().len()
        );
        // 30 layers x K and V x 3 KV heads x 64 dims x 4 bytes.
        assert_eq!(footprint.kv_bytes_per_token, 30 * 2 * 3 * 64 * 4);
    }

    #[test]
    fn the_default_swarm_fits_on_one_cpu() {
        let out = report(&repo("swarm.toml"), &served(), &devices("cpu=4GiB"), SIZING).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("device  budget"), "{out}");
        assert!(lines[1].starts_with("cpu     4.0 GiB"), "{out}");
        assert!(
            lines[1].ends_with(&format!(
                "{SMOLLM2}  analyst, coder, general, math, router, support, verifier, writer"
            )),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "{SMOLLM2}  93.8 MiB  1.3 GiB      45.0 KiB  8       cpu"
            )),
            "{out}"
        );
    }

    /// On a GPU a replica is what the engine holds there: f32 weights take four bytes a weight,
    /// so a GPU that holds the default swarm with quantized weights refuses it with f32 ones.
    #[test]
    fn a_gpu_pays_for_the_weights_in_their_gpu_form() {
        let sizing = |gpu_weights| GpuSizing {
            gpu_weights,
            ..SIZING
        };
        let f32 = footprint(&served(), sizing(DeviceWeights::F32)).unwrap();
        let quantized = footprint(&served(), sizing(DeviceWeights::Quantized)).unwrap();
        // SmolLM2's 134.5 million weights: 4 bytes each as f32, under 1 in Q4_1 blocks; the
        // activation reserve is the same for both.
        let saved = f32.gpu_replica_bytes - quantized.gpu_replica_bytes;
        assert!(saved > 3 * 134_000_000, "{f32:?} {quantized:?}");
        let swarm = SwarmConfig::load(&repo("swarm.toml")).unwrap();
        let registry = Registry::new(swarm.agents).unwrap();
        let reserves: u64 = registry
            .agents()
            .map(|a| a.kv_reserve_tokens * f32.kv_bytes_per_token)
            .sum();
        let budget = quantized.gpu_replica_bytes + reserves + router::GPU_HEADROOM;
        let gpu = [DeviceSpec {
            name: DeviceName::new("cuda:0").unwrap(),
            budget_bytes: budget,
        }];
        let plan = |weights| {
            let catalog = catalog(registry.agents(), &served(), sizing(weights)).unwrap();
            router::plan(registry.agents(), &catalog, &gpu)
        };
        let placement = plan(DeviceWeights::Quantized).unwrap();
        assert_eq!(placement.devices()[0].free_bytes(), 0);
        let err = plan(DeviceWeights::F32).unwrap_err().to_string();
        assert!(err.starts_with("infeasible placement"), "{err}");
    }

    #[test]
    fn an_infeasible_swarm_is_an_error_naming_an_agent() {
        let err = report(
            &repo("swarm.toml"),
            &served(),
            &devices("cuda:0=512MiB,cpu=300MiB"),
            SIZING,
        )
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("infeasible placement: agent `"), "{err}");
        assert!(err.contains(&format!("(model `{SMOLLM2}`)")), "{err}");
    }

    /// An agent's reserve holds its pinned system prompt, or the plan names the agent.
    #[test]
    fn a_system_prompt_larger_than_its_reserve_is_refused() {
        let mut agent = AgentSpec {
            system_prompt: "You are a careful poet who writes short verses.".into(),
            ..agent_on("default")
        };
        let catalog = catalog([&agent], &served(), SIZING).unwrap();
        check_pins([&agent], &catalog, &served()).unwrap();
        agent.kv_reserve_tokens = 8;
        let err = check_pins([&agent], &catalog, &served())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("agent `poet`: its system prompt takes"),
            "{err}"
        );
        assert!(err.contains("more than its kv_reserve_tokens (8)"), "{err}");
    }

    /// A swarm whose `math` agent runs on Gemma 3 beside the others on SmolLM2: Gemma is sized
    /// from its own file (18 layers, one KV head of 256), both models share a device with room
    /// for both, go to separate devices when none has room for both, and a budget that holds
    /// neither is refused naming an agent.
    #[test]
    fn two_models_are_packed_by_memory() {
        let gemma = repo("models/gemma-3-270m-q4_k_m.gguf");
        let footprint = footprint(&gemma, SIZING).unwrap();
        assert_eq!(footprint.kv_bytes_per_token, 18 * 2 * 256 * 4);
        assert_eq!(
            footprint.weight_bytes,
            std::fs::metadata(&gemma).unwrap().len()
        );
        let swarm = SwarmConfig::load(&repo("swarm.toml")).unwrap();
        let mut agents = Registry::new(swarm.agents)
            .unwrap()
            .agents()
            .cloned()
            .collect::<Vec<_>>();
        for agent in &mut agents {
            if agent.name.as_str() == "math" {
                agent.model = ModelId::new("gemma-3-270m-q4_k_m").unwrap();
            }
        }
        let catalog = catalog(&agents, &served(), SIZING).unwrap();
        let plan = |list: &str| router::plan(&agents, &catalog, &devices(list));
        let together = plan("cpu=4GiB").unwrap();
        assert_eq!(together.devices()[0].models.len(), 2);
        // SmolLM2 with its seven agents' reserves needs 1.41 GiB, Gemma with `math`'s 385 MiB:
        // the larger group takes the large device, the smaller the one that just holds it (best
        // fit), each device one model.
        let apart = plan("cpu=2GiB,cpu1=400MiB").unwrap();
        for device in apart.devices() {
            assert_eq!(device.models.len(), 1, "{apart:?}");
        }
        let math = &apart.agents()[&router::AgentId::new("math").unwrap()];
        assert_eq!(math.model.as_str(), "gemma-3-270m-q4_k_m");
        assert_eq!(math.device.as_str(), "cpu1");
        let err = plan("cpu=300MiB").unwrap_err().to_string();
        assert!(err.starts_with("infeasible placement: agent `"), "{err}");
        // A worker started as each device loads its models and hosts its agents.
        let share = |list: &str, name: &str| {
            let name = DeviceName::new(name).unwrap();
            share_of(&agents, &served(), &devices(list), SIZING, &name)
        };
        let cpu = share("cpu=2GiB,cpu1=400MiB", "cpu").unwrap();
        assert_eq!(cpu.models, [served()]);
        assert!(cpu.agents.contains(&"coder".to_owned()));
        assert!(!cpu.agents.contains(&"math".to_owned()));
        let cpu1 = share("cpu=2GiB,cpu1=400MiB", "cpu1").unwrap();
        assert_eq!(
            (cpu1.models, cpu1.agents),
            (vec![gemma], vec!["math".to_owned()])
        );
        let both = share("cpu=4GiB", "cpu").unwrap();
        assert_eq!(both.models.len(), 2);
        assert_eq!(both.models[0], served(), "the served model first");
        assert!(share("cpu=4GiB", "cuda:7").is_err());
    }

    #[test]
    fn an_unknown_model_is_an_error_naming_it() {
        let err = catalog([&agent_on("mystery-7b")], &served(), SIZING)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("agent `poet` runs on model `mystery-7b`"),
            "{err}"
        );
    }

    #[test]
    fn a_model_file_name_is_the_served_model_not_a_second_one() {
        for name in [SMOLLM2, &format!("{SMOLLM2}.gguf")] {
            let agent = agent_on(name);
            let catalog = catalog([&agent], &served(), SIZING).unwrap();
            let resolved = catalog.resolve(&agent.model).unwrap();
            assert_eq!(resolved.as_str(), SMOLLM2);
            assert_eq!(catalog.resolve(&ModelId::default()), Some(resolved));
        }
    }

    #[test]
    fn model_ids_cannot_reach_outside_the_models_directory() {
        let dir = repo("models");
        assert!(model_file(&dir, &ModelId::new(format!("{SMOLLM2}.gguf")).unwrap()).is_some());
        assert!(model_file(&dir, &ModelId::new("../swarm.toml").unwrap()).is_none());
    }

    #[test]
    fn mem_total_is_read_in_kib() {
        let meminfo = "MemTotal:       24567890 kB\nMemFree:         1234 kB\n";
        assert_eq!(mem_total_bytes(meminfo), Some(24_567_890 * 1024));
        assert_eq!(mem_total_bytes("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn tables_align_columns_without_trailing_spaces() {
        let rows = [row(["a", "bb", "c"]), row(["ccc", "d", "eeee"])];
        assert_eq!(table(&rows), "a    bb  c\nccc  d   eeee\n");
    }
}

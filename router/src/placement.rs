//! Placement: which devices host a replica of which model, and which agents each device serves.
//!
//! Input: the agents (each names a model and a KV reserve in tokens), a [`ModelCatalog`] (each
//! model's bytes per replica and KV bytes per token) and the devices with their memory budgets.
//! Output: a [`Placement`]. A replica costs its weights on a CPU; on a GPU (a device named
//! `cuda:N`) its weights in the form the GPU holds them plus the engine's reserve for a step's
//! activations, and every GPU keeps the engine's headroom free ([`GPU_HEADROOM`]). Other runtime
//! overheads (the host KV tier, the process) are the budget's margin to leave.
//!
//! Invariants of every placement [`plan`] returns:
//! - every agent is on exactly one device, and that device hosts its model: a KV cache is only
//!   useful next to the weights that attend over it;
//! - a device's used bytes are the replica cost of each model it hosts, counted once however
//!   many agents share it, plus the KV reserves of its agents; used plus the device's reserved
//!   headroom never exceeds the budget;
//! - a device hosts a model only if it serves at least one of the model's agents;
//! - the agents of one model are on one device whenever some device has room for all of them
//!   when their turn comes; they are split only when none has, and each extra device pays for
//!   another copy of the weights;
//! - the result depends only on the inputs' values, not on the order of the agents: ties go to
//!   the device listed first, and agents of equal reserve are taken by name.
//!
//! Algorithm. Group the agents by model; a group's need is its weights plus its KV reserves.
//! Take the groups largest first: big groups are the hardest to fit, so they choose while the
//! devices are emptiest. For each group, until all its agents are placed:
//! 1. if a device not yet hosting the model has room for every agent left, take the one with
//!    the least room that suffices (best fit, which keeps large free spaces for large groups);
//! 2. otherwise open a replica on the device with the most room and fill it with the agents
//!    left, largest reserve first, skipping those that do not fit (first-fit decreasing).
//!
//! If the device with the most room cannot take the weights plus the largest agent left, no
//! device can (devices already hosting the model were filled with every agent that fit), so the
//! plan is infeasible: the error names that agent, its model and the largest free budget.
//!
//! Complexity: with A agents, G models and D devices, O(A log A) to sort plus, per replica
//! opened, one scan of the devices and of the group's agents: O(G·D·(D + A)) in all, which is
//! microseconds for tens of agents on a handful of devices. Exact packing is bin packing, which
//! is NP-hard; best fit and first-fit decreasing are the classic heuristics (FFD uses at most
//! 11/9 of the optimal number of bins, plus one), and here each group is dominated by its
//! weights, so items are few and large and the heuristic is rarely off. Placement runs once at
//! start-up, so an exact solver would buy little.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::{AgentId, AgentSpec, ModelId, Result, RouterError};

/// What the engine keeps free on a GPU beyond its weights, KV pool and activations.
pub const GPU_HEADROOM: u64 = engine::GPU_HEADROOM as u64;

/// Device names are listed as `NAME=SIZE,NAME=SIZE` on the command line, so they cannot hold
/// the separators.
fn check_device_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty()
        || name
            .chars()
            .any(|c| c.is_whitespace() || c == '=' || c == ',')
    {
        return Err("a device name is non-empty, without whitespace, `=` or `,`");
    }
    Ok(())
}

validated_name!(
    /// A device as the runtime names it: `cuda:0`, `cpu`.
    DeviceName,
    "device name",
    check_device_name
);

/// A number of bytes, written and read with units: `80GiB`, `16GB`, `512MiB`, `1.5GiB`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

const BINARY_UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];

impl fmt::Display for ByteSize {
    /// Binary units with one decimal, which is what memory budgets are reasoned in.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match BINARY_UNITS.iter().find(|(_, shift)| self.0 >= 1 << shift) {
            Some((unit, shift)) => {
                write!(f, "{:.1} {unit}", self.0 as f64 / (1u64 << shift) as f64)
            }
            None => write!(f, "{} B", self.0),
        }
    }
}

impl FromStr for ByteSize {
    type Err = RouterError;

    fn from_str(text: &str) -> Result<Self> {
        let error = |reason| RouterError::InvalidSize {
            text: text.to_owned(),
            reason,
        };
        let trimmed = text.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => {
                return Err(error(
                    "the unit is one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
                ))
            }
        };
        let bytes = if number.contains('.') {
            let value: f64 = number.parse().map_err(|_| error("not a number"))?;
            let bytes = (value * multiplier as f64).round();
            // Every f64 at or above 2^64 is out of range; the comparison is exact.
            if bytes >= u64::MAX as f64 {
                return Err(error("too large"));
            }
            bytes as u64
        } else {
            let value: u64 = number.parse().map_err(|_| error("not a number"))?;
            value
                .checked_mul(multiplier)
                .ok_or_else(|| error("too large"))?
        };
        Ok(Self(bytes))
    }
}

/// A device and the bytes placement may fill on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    pub name: DeviceName,
    pub budget_bytes: u64,
}

impl FromStr for DeviceSpec {
    type Err = RouterError;

    /// `NAME=SIZE`, e.g. `cuda:0=80GiB`.
    fn from_str(text: &str) -> Result<Self> {
        let (name, size) = text.split_once('=').ok_or_else(|| {
            RouterError::InvalidDevices(format!("{text:?} is not NAME=SIZE (e.g. cuda:0=80GiB)"))
        })?;
        Ok(Self {
            name: DeviceName::new(name.trim())?,
            budget_bytes: size.parse::<ByteSize>()?.0,
        })
    }
}

impl DeviceSpec {
    /// Whether this is a GPU (`cuda:N`), where replicas and headroom cost what the engine
    /// reserves on one.
    pub fn is_gpu(&self) -> bool {
        matches!(
            self.name.as_str().parse::<engine::DeviceSpec>(),
            Ok(engine::DeviceSpec::Cuda(_))
        )
    }

    /// Bytes placement leaves free on this device.
    pub fn reserved_bytes(&self) -> u64 {
        if self.is_gpu() {
            GPU_HEADROOM
        } else {
            0
        }
    }
}

/// What one model costs in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelFootprint {
    /// Bytes of weights, paid once per CPU device that hosts the model.
    pub weight_bytes: u64,
    /// Bytes a replica takes on a GPU: the weights in the form the GPU holds them, and the
    /// engine's activation reserve.
    pub gpu_replica_bytes: u64,
    /// Bytes of KV cache one token takes, across layers, keys and values.
    pub kv_bytes_per_token: u64,
}

impl ModelFootprint {
    /// Bytes one replica of the model takes on `device`, before any KV.
    pub fn replica_bytes(&self, device: &DeviceSpec) -> u64 {
        if device.is_gpu() {
            self.gpu_replica_bytes
        } else {
            self.weight_bytes
        }
    }
}

/// The models placement may use, filled by the caller, which knows where models live.
#[derive(Clone, Debug, Default)]
pub struct ModelCatalog {
    models: BTreeMap<ModelId, ModelFootprint>,
    aliases: BTreeMap<ModelId, ModelId>,
}

impl ModelCatalog {
    pub fn insert(&mut self, model: ModelId, footprint: ModelFootprint) {
        self.models.insert(model, footprint);
    }

    /// Makes `alias` name `model` (`default` for the served model, or a file name for its
    /// model id), so that agents naming either share one replica instead of paying twice.
    pub fn alias(&mut self, alias: ModelId, model: ModelId) {
        self.aliases.insert(alias, model);
    }

    /// The model `id` names, after its alias, if the catalog has it.
    pub fn resolve<'a>(&'a self, id: &'a ModelId) -> Option<&'a ModelId> {
        let model = self.aliases.get(id).unwrap_or(id);
        self.models.get_key_value(model).map(|(k, _)| k)
    }

    /// The footprint of the model `id` names, after its alias.
    pub fn footprint(&self, id: &ModelId) -> Option<ModelFootprint> {
        self.resolve(id).map(|model| self.models[model])
    }
}

/// One device after placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLoad {
    pub device: DeviceSpec,
    /// Replicas of the models hosted plus KV reserves of the agents served.
    pub used_bytes: u64,
    pub models: BTreeSet<ModelId>,
    pub agents: BTreeSet<AgentId>,
}

impl DeviceLoad {
    pub fn free_bytes(&self) -> u64 {
        self.device
            .budget_bytes
            .saturating_sub(self.device.reserved_bytes())
            .saturating_sub(self.used_bytes)
    }
}

/// Where one agent runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentPlacement {
    /// The model after aliases (`default` resolved), hosted on `device`.
    pub model: ModelId,
    pub device: DeviceName,
    /// Bytes of the agent's KV reserve.
    pub kv_bytes: u64,
}

/// The outcome of [`plan`]; see the module header for what it guarantees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    devices: Vec<DeviceLoad>,
    agents: BTreeMap<AgentId, AgentPlacement>,
}

impl Placement {
    /// Every device, in the order given, including those left empty.
    pub fn devices(&self) -> &[DeviceLoad] {
        &self.devices
    }

    /// Every agent's placement, by name.
    pub fn agents(&self) -> &BTreeMap<AgentId, AgentPlacement> {
        &self.agents
    }

    pub fn agent(&self, name: &str) -> Option<&AgentPlacement> {
        self.agents.get(name)
    }

    /// The devices hosting a replica of `model` (a resolved id, as in [`AgentPlacement`]).
    pub fn replicas<'a>(&'a self, model: &'a ModelId) -> impl Iterator<Item = &'a DeviceName> {
        self.devices
            .iter()
            .filter(move |d| d.models.contains(model))
            .map(|d| &d.device.name)
    }
}

/// One agent's KV reserve, in bytes.
struct Demand<'a> {
    agent: &'a AgentId,
    kv_bytes: u64,
}

/// The agents of one model, largest reserve first.
struct Group<'a> {
    model: &'a ModelId,
    footprint: ModelFootprint,
    demands: Vec<Demand<'a>>,
}

/// A replica plus reserves, saturating: an absurd reserve must read as "does not fit", not wrap.
fn need<'d, 'a: 'd>(replica_bytes: u64, demands: impl IntoIterator<Item = &'d Demand<'a>>) -> u64 {
    demands
        .into_iter()
        .fold(replica_bytes, |sum, d| sum.saturating_add(d.kv_bytes))
}

/// Places every agent on a device hosting its model, within every device's budget; see the
/// module header for the algorithm and its guarantees.
pub fn plan<'a>(
    agents: impl IntoIterator<Item = &'a AgentSpec>,
    catalog: &'a ModelCatalog,
    devices: &[DeviceSpec],
) -> Result<Placement> {
    check_devices(devices)?;
    let mut loads: Vec<DeviceLoad> = devices
        .iter()
        .map(|device| DeviceLoad {
            device: device.clone(),
            used_bytes: 0,
            models: BTreeSet::new(),
            agents: BTreeSet::new(),
        })
        .collect();
    let mut placed = BTreeMap::new();
    for group in groups(agents, catalog)? {
        place_group(&group, &mut loads, &mut placed)?;
    }
    Ok(Placement {
        devices: loads,
        agents: placed,
    })
}

fn check_devices(devices: &[DeviceSpec]) -> Result<()> {
    if devices.is_empty() {
        return Err(RouterError::InvalidDevices(
            "no device to place agents on".into(),
        ));
    }
    let mut seen = BTreeSet::new();
    for device in devices {
        if !seen.insert(&device.name) {
            return Err(RouterError::InvalidDevices(format!(
                "`{}` is listed twice",
                device.name
            )));
        }
    }
    Ok(())
}

/// The agents grouped by (resolved) model, largest group first, ties by model id.
fn groups<'a>(
    agents: impl IntoIterator<Item = &'a AgentSpec>,
    catalog: &'a ModelCatalog,
) -> Result<Vec<Group<'a>>> {
    let mut by_model: BTreeMap<&ModelId, Group> = BTreeMap::new();
    let mut names = BTreeSet::new();
    for spec in agents {
        if !names.insert(&spec.name) {
            return Err(RouterError::DuplicateAgent(spec.name.clone()));
        }
        let unknown = || RouterError::UnknownModel {
            agent: spec.name.clone(),
            model: spec.model.clone(),
        };
        let model = catalog.resolve(&spec.model).ok_or_else(unknown)?;
        let footprint = catalog.footprint(model).ok_or_else(unknown)?;
        by_model
            .entry(model)
            .or_insert_with(|| Group {
                model,
                footprint,
                demands: Vec::new(),
            })
            .demands
            .push(Demand {
                agent: &spec.name,
                // An absurd reserve saturates and is reported as not fitting.
                kv_bytes: spec
                    .kv_reserve_tokens
                    .saturating_mul(footprint.kv_bytes_per_token),
            });
    }
    let mut groups: Vec<Group> = by_model.into_values().collect();
    for group in &mut groups {
        group.demands.sort_by(|a, b| {
            b.kv_bytes
                .cmp(&a.kv_bytes)
                .then_with(|| a.agent.cmp(b.agent))
        });
    }
    // Stable: equal needs keep the map's order, by model id.
    groups.sort_by_cached_key(|g| {
        let replica = g.footprint.weight_bytes.max(g.footprint.gpu_replica_bytes);
        Reverse(need(replica, &g.demands))
    });
    Ok(groups)
}

fn place_group(
    group: &Group,
    loads: &mut [DeviceLoad],
    placed: &mut BTreeMap<AgentId, AgentPlacement>,
) -> Result<()> {
    let mut left: Vec<&Demand> = group.demands.iter().collect();
    while let Some(largest) = left.first() {
        // (device index, room for KV after a replica) of the devices that could take a new
        // replica.
        let candidates: Vec<(usize, u64)> = loads
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.models.contains(group.model))
            .filter_map(|(i, l)| {
                let replica = group.footprint.replica_bytes(&l.device);
                l.free_bytes().checked_sub(replica).map(|room| (i, room))
            })
            .collect();
        let all_left = need(0, left.iter().copied());
        let best_fit = candidates
            .iter()
            .filter(|(_, room)| *room >= all_left)
            .min_by_key(|(i, room)| (*room, *i));
        if let Some(&(device, _)) = best_fit {
            host(&mut loads[device], group, &left, placed);
            return Ok(());
        }
        let roomiest = candidates
            .iter()
            .max_by_key(|(i, room)| (*room, Reverse(*i)))
            .filter(|(_, room)| *room >= largest.kv_bytes);
        let Some(&(device, mut room)) = roomiest else {
            return Err(infeasible(group, largest, loads));
        };
        let (taken, rest): (Vec<&Demand>, Vec<&Demand>) = left.into_iter().partition(|d| {
            let fits = d.kv_bytes <= room;
            if fits {
                room -= d.kv_bytes;
            }
            fits
        });
        host(&mut loads[device], group, &taken, placed);
        left = rest;
    }
    Ok(())
}

/// Puts a replica of the group's model on `load` with `demands`, which fit.
fn host(
    load: &mut DeviceLoad,
    group: &Group,
    demands: &[&Demand],
    placed: &mut BTreeMap<AgentId, AgentPlacement>,
) {
    load.models.insert(group.model.clone());
    load.used_bytes += group.footprint.replica_bytes(&load.device);
    for demand in demands {
        load.used_bytes += demand.kv_bytes;
        load.agents.insert(demand.agent.clone());
        placed.insert(
            demand.agent.clone(),
            AgentPlacement {
                model: group.model.clone(),
                device: load.device.name.clone(),
                kv_bytes: demand.kv_bytes,
            },
        );
    }
}

fn infeasible(group: &Group, demand: &Demand, loads: &[DeviceLoad]) -> RouterError {
    let roomiest = loads
        .iter()
        .enumerate()
        .max_by_key(|(i, l)| (l.free_bytes(), Reverse(*i)))
        .map(|(_, l)| l)
        .expect("plan refuses an empty device list");
    RouterError::Infeasible {
        agent: demand.agent.clone(),
        model: group.model.clone(),
        weight_bytes: group.footprint.replica_bytes(&roomiest.device),
        kv_bytes: demand.kv_bytes,
        largest_free_bytes: roomiest.free_bytes(),
        largest_free_device: roomiest.device.name.clone(),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::AgentKind;

    const GIB: u64 = 1 << 30;

    fn agent(name: &str, model: &str, kv_reserve_tokens: u64) -> AgentSpec {
        AgentSpec {
            model: ModelId::new(model).unwrap(),
            kv_reserve_tokens,
            ..AgentSpec::new(AgentId::new(name).unwrap(), AgentKind::Specialist)
        }
    }

    fn device(name: &str, budget_bytes: u64) -> DeviceSpec {
        DeviceSpec {
            name: DeviceName::new(name).unwrap(),
            budget_bytes,
        }
    }

    fn catalog(models: &[(&str, u64, u64)]) -> ModelCatalog {
        let mut catalog = ModelCatalog::default();
        for &(id, weight_bytes, kv_bytes_per_token) in models {
            catalog.insert(
                ModelId::new(id).unwrap(),
                ModelFootprint {
                    weight_bytes,
                    gpu_replica_bytes: weight_bytes,
                    kv_bytes_per_token,
                },
            );
        }
        catalog
    }

    fn model(id: &str) -> ModelId {
        ModelId::new(id).unwrap()
    }

    /// Asserts every invariant of the module header that a placement can show by itself.
    fn assert_valid(
        placement: &Placement,
        agents: &[AgentSpec],
        catalog: &ModelCatalog,
        devices: &[DeviceSpec],
    ) {
        let loads = placement.devices();
        let specs: Vec<&DeviceSpec> = loads.iter().map(|l| &l.device).collect();
        assert_eq!(
            specs,
            devices.iter().collect::<Vec<_>>(),
            "devices in input order"
        );
        assert_eq!(
            placement.agents().len(),
            agents.len(),
            "every agent placed once"
        );
        for spec in agents {
            let at = placement.agent(spec.name.as_str()).expect("agent placed");
            let resolved = catalog.resolve(&spec.model).unwrap();
            assert_eq!(&at.model, resolved);
            let footprint = catalog.footprint(resolved).unwrap();
            assert_eq!(
                at.kv_bytes,
                spec.kv_reserve_tokens * footprint.kv_bytes_per_token
            );
            let load = loads.iter().find(|l| l.device.name == at.device).unwrap();
            assert!(load.agents.contains(&spec.name));
            assert!(load.models.contains(&at.model), "KV next to its weights");
        }
        for load in loads {
            let served: BTreeSet<ModelId> = load
                .agents
                .iter()
                .map(|a| placement.agent(a.as_str()).unwrap().model.clone())
                .collect();
            assert_eq!(served, load.models, "no replica without agents");
            let weights: u64 = load
                .models
                .iter()
                .map(|m| catalog.footprint(m).unwrap().replica_bytes(&load.device))
                .sum();
            let kv: u64 = load
                .agents
                .iter()
                .map(|a| placement.agent(a.as_str()).unwrap().kv_bytes)
                .sum();
            assert_eq!(load.used_bytes, weights + kv, "weights once per device");
            assert!(
                load.used_bytes + load.device.reserved_bytes() <= load.device.budget_bytes,
                "{} over budget",
                load.device.name
            );
        }
    }

    /// The fewest devices a model's agents could occupy if they had the devices to themselves:
    /// the least `k` for which the `k` largest budgets, each less one copy of the weights, hold
    /// all the reserves. A lower bound for any placement.
    fn fewest_devices(weight: u64, total_kv: u64, devices: &[DeviceSpec]) -> usize {
        let mut budgets: Vec<u64> = devices
            .iter()
            .map(|d| d.budget_bytes - d.reserved_bytes())
            .collect();
        budgets.sort_unstable_by(|a, b| b.cmp(a));
        let mut room = 0;
        for (k, budget) in budgets.iter().enumerate() {
            room += budget.saturating_sub(weight);
            if room >= total_kv {
                return k + 1;
            }
        }
        usize::MAX
    }

    #[test]
    fn sizes_parse_with_decimal_and_binary_units() {
        let parse = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(parse("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse("16GB").unwrap(), 16_000_000_000);
        assert_eq!(parse("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse("1.5 gib").unwrap(), 3 * GIB / 2);
        assert_eq!(parse("4096").unwrap(), 4096);
        for bad in ["", "GiB", "80GiBs", "1.2.3GB", "-1GB", "99999999999TiB"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_display_in_binary_units() {
        assert_eq!(ByteSize(80 * GIB).to_string(), "80.0 GiB");
        assert_eq!(ByteSize(98_362_432).to_string(), "93.8 MiB");
        assert_eq!(ByteSize(46_080).to_string(), "45.0 KiB");
        assert_eq!(ByteSize(12).to_string(), "12 B");
    }

    #[test]
    fn devices_parse_as_name_equals_size() {
        let d: DeviceSpec = "cuda:0=80GiB".parse().unwrap();
        assert_eq!(d, device("cuda:0", 80 * GIB));
        assert!("cuda:0".parse::<DeviceSpec>().is_err());
        assert!("=1GiB".parse::<DeviceSpec>().is_err());
        assert!("cpu=lots".parse::<DeviceSpec>().is_err());
    }

    #[test]
    fn device_lists_are_non_empty_without_repeats() {
        let catalog = catalog(&[("m", 10, 1)]);
        let agents = [agent("a", "m", 1)];
        let err = plan(&agents, &catalog, &[]);
        assert!(matches!(err, Err(RouterError::InvalidDevices(_))));
        let twice = [device("cpu", 100), device("cpu", 100)];
        let err = plan(&agents, &catalog, &twice).unwrap_err().to_string();
        assert!(err.contains("`cpu` is listed twice"), "{err}");
    }

    #[test]
    fn agents_of_one_model_share_one_copy_of_the_weights() {
        let catalog = catalog(&[("m", 1000, 2)]);
        let agents = [
            agent("a", "m", 10),
            agent("b", "m", 20),
            agent("c", "m", 30),
        ];
        let devices = [device("big", 5000), device("small", 1200)];
        let placement = plan(&agents, &catalog, &devices).unwrap();
        assert_valid(&placement, &agents, &catalog, &devices);
        let small = &placement.devices()[1];
        assert_eq!(
            small.used_bytes,
            1000 + 2 * 60,
            "best fit: the smaller device suffices"
        );
        assert_eq!(small.agents.len(), 3);
        assert_eq!(placement.replicas(&model("m")).count(), 1);
    }

    #[test]
    fn the_default_alias_shares_the_served_model() {
        let mut catalog = catalog(&[("served", 1000, 1)]);
        catalog.alias(ModelId::default(), model("served"));
        let agents = [agent("a", "default", 10), agent("b", "served", 10)];
        let devices = [device("cpu", 1030)];
        let placement = plan(&agents, &catalog, &devices).unwrap();
        assert_valid(&placement, &agents, &catalog, &devices);
        assert_eq!(placement.agent("a").unwrap().model, model("served"));
        assert_eq!(placement.devices()[0].used_bytes, 1020);
    }

    #[test]
    fn a_group_too_big_for_one_device_splits_and_pays_weights_again() {
        let catalog = catalog(&[("m", 600, 1)]);
        let agents: Vec<_> = (0..4).map(|i| agent(&format!("a{i}"), "m", 200)).collect();
        let devices = [device("d0", 1000), device("d1", 1000), device("d2", 1000)];
        let placement = plan(&agents, &catalog, &devices).unwrap();
        assert_valid(&placement, &agents, &catalog, &devices);
        let used: Vec<u64> = placement.devices().iter().map(|d| d.used_bytes).collect();
        assert_eq!(used, [1000, 1000, 0]);
    }

    #[test]
    fn an_unknown_model_names_the_agent_and_the_model() {
        let catalog = catalog(&[("m", 1, 1)]);
        let agents = [agent("a", "m", 1), agent("poet", "gpt-x", 1)];
        let err = plan(&agents, &catalog, &[device("cpu", 100)]);
        assert!(matches!(
            &err,
            Err(RouterError::UnknownModel { agent, model })
                if agent.as_str() == "poet" && model.as_str() == "gpt-x"
        ));
    }

    #[test]
    fn an_infeasible_plan_names_the_agent_that_does_not_fit() {
        let catalog = catalog(&[("small", 10 * GIB, 1 << 20), ("big", 40 * GIB, 1 << 20)]);
        let agents = [
            agent("chat", "small", 4096),
            agent("notes", "small", 4096),
            // 40 GiB of weights plus 48 GiB of KV: more than any one device holds.
            agent("archivist", "big", 48 * 1024),
        ];
        let devices = [device("cuda:0", 80 * GIB), device("cuda:1", 24 * GIB)];
        let err = plan(&agents, &catalog, &devices).unwrap_err();
        match &err {
            RouterError::Infeasible {
                agent,
                model,
                largest_free_bytes,
                largest_free_device,
                ..
            } => {
                assert_eq!(agent.as_str(), "archivist");
                assert_eq!(model.as_str(), "big");
                assert_eq!(*largest_free_bytes, 80 * GIB - GPU_HEADROOM);
                assert_eq!(largest_free_device.as_str(), "cuda:0");
            }
            other => panic!("expected infeasible, got {other:?}"),
        }
        let message = err.to_string();
        assert!(
            message.contains("agent `archivist` (model `big`)"),
            "{message}"
        );
        assert!(
            message.contains("needs 48.0 GiB of KV reserve beside the model's 40.0 GiB replica"),
            "{message}"
        );
        assert!(
            message.contains("largest free budget is 79.8 GiB, on `cuda:0`"),
            "{message}"
        );
    }

    /// A GPU replica costs what the engine holds there (here f32 weights and activations, four
    /// times the file), a CPU one the file; a GPU keeps the engine's headroom free.
    #[test]
    fn gpus_pay_their_replica_form_and_keep_headroom() {
        let mut catalog = ModelCatalog::default();
        catalog.insert(
            model("m"),
            ModelFootprint {
                weight_bytes: GIB,
                gpu_replica_bytes: 4 * GIB,
                kv_bytes_per_token: 1 << 20,
            },
        );
        let agents = [agent("a", "m", 1024)];
        // Exactly replica + KV + headroom: fits, and pays the GPU form.
        let gpu = [device("cuda:0", 5 * GIB + GPU_HEADROOM)];
        let placement = plan(&agents, &catalog, &gpu).unwrap();
        assert_valid(&placement, &agents, &catalog, &gpu);
        assert_eq!(placement.devices()[0].used_bytes, 5 * GIB);
        assert_eq!(placement.devices()[0].free_bytes(), 0);
        // A byte less on the GPU: the agent goes to a CPU device, which pays the file's size.
        let both = [
            device("cuda:0", 5 * GIB + GPU_HEADROOM - 1),
            device("cpu", 2 * GIB),
        ];
        let placement = plan(&agents, &catalog, &both).unwrap();
        assert_valid(&placement, &agents, &catalog, &both);
        assert_eq!(placement.agent("a").unwrap().device.as_str(), "cpu");
        assert_eq!(placement.devices()[1].used_bytes, 2 * GIB);
        // The GPU alone: refused, naming what the replica costs there.
        let err = plan(&agents, &catalog, &both[..1]).unwrap_err();
        assert!(
            matches!(err, RouterError::Infeasible { weight_bytes, .. } if weight_bytes == 4 * GIB),
            "{err}"
        );
    }

    #[test]
    fn weights_larger_than_every_device_name_the_first_agent_of_the_model() {
        let catalog = catalog(&[("huge", 100 * GIB, 1)]);
        let agents = [agent("b", "huge", 1), agent("a", "huge", 1)];
        let err = plan(&agents, &catalog, &[device("cuda:0", 80 * GIB)]);
        assert!(matches!(err, Err(RouterError::Infeasible { agent, .. }) if agent.as_str() == "a"));
    }

    /// 24 agents on three llama-class models, on four 80 GiB devices. The 70B model in fp8
    /// (65 GiB of weights) with its six long-context agents needs 80.2 GiB, just over one
    /// device, so it must take two; the 13B and 7B models in fp16 fit one device each. KV
    /// bytes per token are 2 (K and V) x layers x KV heads x head dim x 2 bytes.
    #[test]
    fn simulation_24_agents_3_models_4_devices() {
        let catalog = catalog(&[
            ("llama-7b-f16", 14_000_000_000, 2 * 32 * 32 * 128 * 2),
            ("llama-13b-f16", 26_000_000_000, 2 * 40 * 40 * 128 * 2),
            ("llama-70b-fp8", 70_000_000_000, 2 * 80 * 8 * 128 * 2),
        ]);
        let mut agents = Vec::new();
        for i in 0..12 {
            agents.push(agent(
                &format!("chat-{i:02}"),
                "llama-7b-f16",
                [2048, 4096, 8192][i % 3],
            ));
        }
        for i in 0..6 {
            agents.push(agent(&format!("code-{i}"), "llama-13b-f16", 4096));
        }
        for i in 0..6 {
            agents.push(agent(&format!("research-{i}"), "llama-70b-fp8", 8192));
        }
        let devices: Vec<_> = (0..4)
            .map(|i| device(&format!("cuda:{i}"), 80 * GIB))
            .collect();
        let placement = plan(&agents, &catalog, &devices).unwrap();
        assert_valid(&placement, &agents, &catalog, &devices);
        for (id, expected) in [
            ("llama-70b-fp8", 2),
            ("llama-13b-f16", 1),
            ("llama-7b-f16", 1),
        ] {
            let m = model(id);
            let footprint = catalog.footprint(&m).unwrap();
            let total_kv: u64 = placement
                .agents()
                .values()
                .filter(|a| a.model == m)
                .map(|a| a.kv_bytes)
                .sum();
            let replicas = placement.replicas(&m).count();
            assert_eq!(replicas, expected, "{id}");
            assert_eq!(
                replicas,
                fewest_devices(footprint.weight_bytes, total_kv, &devices),
                "{id} on as few devices as its agents allow"
            );
        }
    }

    /// Inputs of every kind, feasible or not: up to 3 models, 12 agents and 4 devices, in
    /// small units so that devices are often too small.
    fn any_input() -> impl Strategy<Value = (Vec<AgentSpec>, ModelCatalog, Vec<DeviceSpec>)> {
        let models = prop::collection::vec((0u64..=500, 1u64..=4), 1..=3);
        let budgets = prop::collection::vec(1u64..=1000, 1..=4);
        (models, budgets)
            .prop_flat_map(|(models, budgets)| {
                let n = models.len();
                let agents = prop::collection::vec((0..n, 1u64..=100), 1..=12);
                (Just(models), Just(budgets), agents)
            })
            .prop_map(|(models, budgets, agents)| {
                let names: Vec<String> = (0..models.len()).map(|i| format!("m{i}")).collect();
                let specs: Vec<(&str, u64, u64)> = names
                    .iter()
                    .zip(&models)
                    .map(|(n, &(w, k))| (n.as_str(), w, k))
                    .collect();
                let agents = agents
                    .iter()
                    .enumerate()
                    .map(|(i, &(m, reserve))| agent(&format!("a{i}"), &names[m], reserve))
                    .collect();
                let devices = budgets
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| device(&format!("d{i}"), b))
                    .collect();
                (agents, catalog(&specs), devices)
            })
    }

    proptest! {
        /// Any input: a placement keeps every invariant; a refusal names an agent of the input
        /// whose weights and reserve together exceed the largest free budget it reports.
        #[test]
        fn plans_keep_their_invariants_or_name_what_does_not_fit(
            (agents, catalog, devices) in any_input()
        ) {
            match plan(&agents, &catalog, &devices) {
                Ok(placement) => assert_valid(&placement, &agents, &catalog, &devices),
                Err(RouterError::Infeasible { agent, weight_bytes, kv_bytes, largest_free_bytes, .. }) => {
                    prop_assert!(agents.iter().any(|a| a.name == agent));
                    prop_assert!(weight_bytes + kv_bytes > largest_free_bytes);
                }
                Err(other) => prop_assert!(false, "unexpected error {other}"),
            }
        }

        /// The order agents are listed in does not change the plan.
        #[test]
        fn plans_do_not_depend_on_agent_order(
            (agents, shuffled, catalog, devices) in any_input().prop_flat_map(|(a, c, d)| {
                (Just(a.clone()), Just(a).prop_shuffle(), Just(c), Just(d))
            })
        ) {
            let a = plan(&agents, &catalog, &devices).map_err(|e| e.to_string());
            let b = plan(&shuffled, &catalog, &devices).map_err(|e| e.to_string());
            prop_assert_eq!(a, b);
        }

        /// When there are at least as many devices as models and every model's group (weights
        /// plus all its reserves) fits on the smallest device, every model is on exactly one
        /// device: when a group's turn comes, fewer devices than groups are in use, so one
        /// is still empty and has room for it.
        #[test]
        fn each_model_is_on_one_device_when_devices_are_roomy_enough(
            min_budget in 1_000u64..=100_000,
            models in prop::collection::vec(
                (1u64..=50, 1u64..=8, prop::collection::vec(1u64..=100, 1..=6)),
                1..=4,
            ),
            extra_devices in 0usize..=2,
            extra_budgets in prop::collection::vec(0u64..=100_000, 6),
        ) {
            let mut specs = Vec::new();
            let mut agents = Vec::new();
            let names: Vec<String> = (0..models.len()).map(|i| format!("m{i}")).collect();
            for (m, (weight_percent, kv_per_token, shares)) in models.iter().enumerate() {
                // Weights take up to half the smallest device; reserves share what is left.
                let weight = min_budget * weight_percent / 100;
                let room_per_agent = (min_budget - weight) / shares.len() as u64;
                specs.push((names[m].as_str(), weight, *kv_per_token));
                for (i, share) in shares.iter().enumerate() {
                    let tokens = (room_per_agent * share / 100 / kv_per_token).max(1);
                    agents.push(agent(&format!("m{m}-a{i}"), &names[m], tokens));
                }
            }
            let catalog = catalog(&specs);
            let devices: Vec<_> = (0..models.len() + extra_devices)
                .map(|i| device(&format!("d{i}"), min_budget + extra_budgets[i]))
                .collect();
            let placement = plan(&agents, &catalog, &devices).unwrap();
            assert_valid(&placement, &agents, &catalog, &devices);
            for name in &names {
                prop_assert_eq!(placement.replicas(&model(name)).count(), 1);
            }
        }

        /// One model alone on identical empty devices, with agents of equal reserve: the plan
        /// uses the optimal number of devices, ceil(agents / agents that fit beside the
        /// weights), and is refused exactly when that exceeds the devices there are.
        #[test]
        fn a_lone_model_uses_the_optimal_number_of_identical_devices(
            budget in 100u64..=10_000,
            weight_percent in 0u64..=90,
            kv in 1u64..=1_000,
            n_agents in 1usize..=24,
            n_devices in 1usize..=6,
        ) {
            let weight = budget * weight_percent / 100;
            let per_device = ((budget - weight) / kv) as usize;
            let catalog = catalog(&[("m", weight, kv)]);
            let agents: Vec<_> = (0..n_agents).map(|i| agent(&format!("a{i}"), "m", 1)).collect();
            let devices: Vec<_> = (0..n_devices).map(|i| device(&format!("d{i}"), budget)).collect();
            let result = plan(&agents, &catalog, &devices);
            if per_device == 0 || n_agents > per_device * n_devices {
                prop_assert!(result.is_err());
            } else {
                let placement = result.unwrap();
                assert_valid(&placement, &agents, &catalog, &devices);
                prop_assert_eq!(
                    placement.replicas(&model("m")).count(),
                    n_agents.div_ceil(per_device)
                );
            }
        }
    }
}

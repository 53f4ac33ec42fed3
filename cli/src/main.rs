//! `swarmgate`, Swarmgate's one binary: the servers and the command-line tools, each a subcommand
//! whose code is in [`commands`]. This file holds the command line, the logging and allocator
//! set-up, and the dispatch; nothing else.
//!
//! - `swarmgate serve` serves the OpenAI-compatible API, and the same chat over gRPC, on the
//!   engine, in one process.
//! - `swarmgate gateway` serves the same API with no engine of its own: requests go over NATS to
//!   `swarmgate worker`s, which each run an engine for the agents placed on them.
//! - `swarmgate generate` answers one prompt on the command line.
//! - `swarmgate bench` drives the engine in process and reports throughput and latency, or what
//!   prefix caching saves on an agent workload.
//! - `swarmgate eval routing FILE` measures the routing agent's accuracy and latency on
//!   labelled queries; `swarmgate eval verifier FILE` measures the verifier on labelled answers.
//! - `swarmgate plan` shows where the agents of a swarm file would run within device budgets.
//! - `swarmgate openapi` prints the HTTP API's OpenAPI document.
//! - `swarmgate loadgen` loads an OpenAI-compatible server on this machine over HTTP and reports
//!   throughput and latency per concurrency level, as JSON and a chart.
//!
//! This crate depends on `gateway`, `engine` and `router`, and nothing depends on it: what only
//! the binary and its tools need (the HTTP client, charts, progress bars, the log subscriber)
//! is a dependency of this crate alone, and the libraries stay free of it.

mod commands;

/// One malloc arena per core, before any thread starts, unless `MALLOC_ARENA_MAX` says
/// otherwise. glibc's default of eight per core lets a server's memory keep growing under
/// varied traffic as each new arena fills: with one per core, a second identical load adds
/// nothing (see the README's reliability section), and threads still rarely share one, since
/// small allocations come from per-thread caches first.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let arenas = libc::c_int::try_from(cores.max(2)).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only sets a tunable; no other thread exists yet.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) };
    }
}

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "swarmgate",
    version,
    about = "An inference gateway for agent swarms"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up and matched once: the variants' sizes cost nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API on the local engine.
    Serve(gateway::ServeConfig),
    /// Serve the API with the engines in worker processes, reached over NATS.
    Gateway(commands::gateway::GatewayCommand),
    /// Run an engine for gateways, taking their requests over NATS.
    Worker(commands::worker::WorkerCommand),
    /// Answer one prompt and print the answer as it is generated.
    Generate(commands::generate::GenerateArgs),
    /// Benchmark the engine in process: a concurrency sweep, or prefix caching on and off.
    Bench(commands::bench::BenchArgs),
    /// Place a swarm's agents and models on devices within their memory budgets.
    Plan(commands::plan::PlanArgs),
    /// Check the device path (a GPU's) against the CPU kernels: logits, greedy continuations,
    /// batch invariance; one JSON report.
    DeviceCheck(commands::device_check::DeviceCheckArgs),
    /// Print the HTTP API's OpenAPI document (`--write openapi/openapi.json` updates the
    /// committed copy).
    Openapi(commands::openapi::OpenApiArgs),
    /// Measure a swarm decision against labelled data (`eval routing FILE`, `eval verifier FILE`).
    Eval(commands::eval::EvalArgs),
    /// Load a chat completions server on this machine at several concurrency levels: latency,
    /// throughput, errors; a JSON report and a PNG chart.
    Loadgen(commands::loadgen::LoadgenArgs),
}

fn main() -> Result<()> {
    limit_malloc_arenas();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SWARMGATE_LOG")
                .unwrap_or_else(|_| "warn,swarmgate=info,gateway=info,engine=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Serve(_) => commands::serve::run(commands::server_config(&matches, "serve")?),
        Command::Gateway(command) => {
            commands::gateway::run(commands::server_config(&matches, "gateway")?, command)
        }
        Command::Worker(command) => commands::worker::run(command),
        Command::Generate(args) => commands::generate::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Plan(args) => commands::plan::run(args),
        Command::DeviceCheck(args) => commands::device_check::run(args),
        Command::Openapi(args) => commands::openapi::run(args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Loadgen(args) => commands::loadgen::run(args),
    }
}

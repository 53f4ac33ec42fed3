//! `swarmgate`: the server and its tools.
//!
//! - `swarmgate serve` serves the OpenAI-compatible API, and the same chat over gRPC, on the
//!   engine, in one process.
//! - `swarmgate generate` answers one prompt on the command line.
//! - `swarmgate bench` drives the engine in process and reports throughput and latency, or what
//!   prefix caching saves on an agent workload.
//! - `swarmgate eval routing FILE` measures the routing agent's accuracy and latency on
//!   labelled queries; `swarmgate eval verifier FILE` measures the verifier on labelled answers.
//! - `swarmgate plan` shows where the agents of a swarm file would run within device budgets.
//! - `swarmgate openapi` prints the HTTP API's OpenAPI document.
//! - `swarmgate loadgen` loads an OpenAI-compatible server on this machine over HTTP and reports
//!   throughput and latency per concurrency level, as JSON and a chart.

mod tools;

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

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API on the local engine.
    Serve(gateway::ServeConfig),
    /// Answer one prompt and print the answer as it is generated.
    Generate(tools::generate::GenerateArgs),
    /// Benchmark the engine in process: a concurrency sweep, or prefix caching on and off.
    Bench(tools::bench::BenchArgs),
    /// Place a swarm's agents and models on devices within their memory budgets.
    Plan(tools::plan::PlanArgs),
    /// Print the HTTP API's OpenAPI document (`--write openapi/openapi.json` updates the
    /// committed copy).
    Openapi(tools::openapi::OpenApiArgs),
    /// Measure a swarm decision against labelled data (`eval routing FILE`, `eval verifier FILE`).
    Eval(tools::eval::EvalArgs),
    /// Load a chat completions server on this machine at several concurrency levels: latency,
    /// throughput, errors; a JSON report and a PNG chart.
    Loadgen(tools::loadgen::LoadgenArgs),
}

fn main() -> Result<()> {
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
        Command::Serve(_) => {
            // Re-read from the matches: which settings were given decides what the file may set.
            let serve_matches = matches
                .subcommand_matches("serve")
                .expect("the serve command was parsed");
            let config = gateway::ServeConfig::load(serve_matches)
                .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
            serve(config)
        }
        Command::Generate(args) => tools::generate::run(args),
        Command::Bench(args) => tools::bench::run(args),
        Command::Plan(args) => tools::plan::run(args),
        Command::Openapi(args) => tools::openapi::run(args),
        Command::Eval(args) => tools::eval::run(args),
        Command::Loadgen(args) => tools::loadgen::run(args),
    }
}

fn serve(config: gateway::ServeConfig) -> Result<()> {
    // Load the model before taking requests: a server that listens is a server that answers.
    let engine = engine::EngineHandle::start(&config.engine)?;
    // The HTTP side is light; most cores belong to the engine's compute threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("swarmgate-http")
        .enable_all()
        .build()?;
    runtime.block_on(gateway::serve(config, engine))
}

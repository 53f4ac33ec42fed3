//! `swarmgate`: the server and its tools.
//!
//! - `swarmgate serve` serves the OpenAI-compatible API on the engine, in one process.
//! - `swarmgate generate` answers one prompt on the command line.
//! - `swarmgate bench` drives the engine in process and reports throughput and latency.

mod tools;

use anyhow::Result;
use clap::{Parser, Subcommand};

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
    /// Answer one prompt and print the answer as it is generated.
    Generate(tools::generate::GenerateArgs),
    /// Benchmark the engine in process at several concurrency levels.
    Bench(tools::bench::BenchArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SWARMGATE_LOG")
                .unwrap_or_else(|_| "warn,swarmgate=info,gateway=info,engine=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Generate(args) => tools::generate::run(args),
        Command::Bench(args) => tools::bench::run(args),
    }
}

//! `swarmgate eval`: measures a decision the gateway makes against labelled data.
//!
//! - `swarmgate eval routing FILE`: the routing agent against labelled queries.
//! - `swarmgate eval verifier FILE`: the verifier against labelled good and bad answers.

pub mod routing;
pub mod verifier;

use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(subcommand)]
    what: Eval,
}

#[derive(Subcommand, Debug)]
enum Eval {
    /// Route labelled queries through `POST /v1/swarm/route`: accuracy, per-agent precision and
    /// recall, a confusion matrix, and route latency.
    Routing(routing::RoutingArgs),
    /// Judge labelled answers through `POST /v1/swarm/verify`: bad answers rejected, good ones
    /// rejected, per defect, and latency.
    Verifier(verifier::VerifierEvalArgs),
}

/// The labelled items of a JSONL file, one per non-blank line; an error names the line.
fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let items = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), i + 1))
        })
        .collect::<Result<Vec<T>>>()?;
    if items.is_empty() {
        bail!("{} has no items", path.display());
    }
    Ok(items)
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    match args.what {
        Eval::Routing(args) => routing::run(args),
        Eval::Verifier(args) => verifier::run(args),
    }
}

//! `swarmgate eval`: measures a decision the gateway makes against labelled data.
//!
//! - `swarmgate eval routing FILE`: the routing agent against labelled queries.

pub mod routing;

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
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    match args.what {
        Eval::Routing(args) => routing::run(args),
    }
}

//! `swarmgate eval`: measures a decision the gateway makes against labelled data.
//!
//! - `swarmgate eval routing FILE`: the routing agent against labelled queries.
//! - `swarmgate eval verifier FILE`: the verifier against labelled good and bad answers.

pub mod routing;
pub mod verifier;

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

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    match args.what {
        Eval::Routing(args) => routing::run(args),
        Eval::Verifier(args) => verifier::run(args),
    }
}

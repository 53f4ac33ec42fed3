//! `swarmgate openapi`: prints the HTTP API's OpenAPI document, or writes it to a file (the
//! committed `openapi/openapi.json`, which a test keeps current).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args)]
pub struct OpenApiArgs {
    /// Write the spec here instead of printing it.
    #[arg(long)]
    pub write: Option<PathBuf>,
}

pub fn run(args: OpenApiArgs) -> Result<()> {
    let spec = gateway::openapi::spec_json();
    match args.write {
        Some(path) => {
            std::fs::write(&path, spec).with_context(|| format!("writing {}", path.display()))?
        }
        None => print!("{spec}"),
    }
    Ok(())
}

//! The binary's subcommands, one module each: the servers ([`serve`], [`gateway`], [`worker`])
//! and the tools. What several of them share lives here: the servers' settings as the command
//! line and the configuration file give them, their tokio runtime, the tools' progress bar, the
//! [`stats`] they report, and one set of chat turns.

pub mod bench;
pub mod device_check;
pub mod eval;
pub mod gateway;
pub mod generate;
pub mod loadgen;
pub mod openapi;
pub mod plan;
pub mod serve;
pub mod stats;
pub mod worker;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};

/// The server's settings of `subcommand`, re-read from the matches: which settings were given
/// decides what the configuration file may set.
pub fn server_config(
    matches: &clap::ArgMatches,
    subcommand: &str,
) -> Result<::gateway::ServeConfig> {
    let matches = matches
        .subcommand_matches(subcommand)
        .expect("the subcommand was parsed");
    ::gateway::ServeConfig::load(matches).map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))
}

/// The servers' runtime. The HTTP and NATS side is light; most cores belong to the engine's
/// compute threads.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("swarmgate-io")
        .enable_all()
        .build()?)
}

/// Varied, short chat turns: what the in-process benchmark and the HTTP load generator send,
/// so that their figures compare.
pub const CHAT_QUESTIONS: [&str; 16] = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash map is to a new programmer, with an example in Python.",
    "Give me three tips for sleeping better.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "What are the main differences between TCP and UDP? Answer with a short list.",
    "Write a short, friendly email declining a meeting invitation.",
    "Why is the sky blue?",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "What is 17 times 23? Show your working.",
    "Describe the water cycle for a ten-year-old.",
    "List five healthy breakfast ideas and why each is good for you.",
    "How does a binary search work, and what is its time complexity?",
    "Write a limerick about a cat who learned to code.",
];

/// A progress bar on stderr counting `len` `unit`s, with rate and time left.
pub fn progress_bar(len: usize, unit: &str) -> Result<ProgressBar> {
    let template = format!("{{msg}} [{{bar:40}}] {{pos}}/{{len}} {unit}, {{per_sec}}, eta {{eta}}");
    Ok(ProgressBar::new(len as u64)
        .with_style(ProgressStyle::with_template(&template)?.progress_chars("=> ")))
}

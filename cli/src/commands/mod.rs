//! Command-line tools built into the binary, and what several of them share: the progress bar,
//! the [`stats`] they report, and one set of chat turns.

pub mod bench;
pub mod eval;
pub mod generate;
pub mod loadgen;
pub mod openapi;
pub mod plan;
pub mod stats;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};

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

//! `swarmgate generate`: one chat turn on the command line, streamed to stdout.

use std::io::Write;

use anyhow::{bail, Result};
use clap::Args;
use engine::{
    ChatMessage, EngineConfig, EngineHandle, Event, GenerateRequest, Prompt, SamplingParams,
};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The user's message.
    #[arg(long)]
    prompt: String,
    /// A system prompt (default: the model's own).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    engine: EngineConfig,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let engine = EngineHandle::start(&args.engine)?;
    let mut messages = Vec::new();
    if let Some(system) = args.system {
        messages.push(ChatMessage::new("system", system));
    }
    messages.push(ChatMessage::new("user", args.prompt));
    let prompt = engine.model().encode_chat(&messages, true)?.tokens;
    let mut stream = engine.submit(GenerateRequest {
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: args.seed,
            ..SamplingParams::default()
        },
        max_tokens: args.max_tokens,
        ..GenerateRequest::new(Prompt::Tokens(prompt))
    })?;
    let mut out = std::io::stdout().lock();
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Delta { text, .. } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Event::PromptLogprobs(_) => {}
            Event::Finished {
                reason,
                usage,
                error,
            } => {
                writeln!(out)?;
                if let Some(error) = error {
                    bail!("generation failed: {error}");
                }
                tracing::info!(
                    finish_reason = reason.as_str(),
                    prompt_tokens = usage.prompt_tokens,
                    completion_tokens = usage.completion_tokens,
                    "done"
                );
                break;
            }
        }
    }
    Ok(())
}

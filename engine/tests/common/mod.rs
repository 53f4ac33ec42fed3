//! Helpers shared by the engine's integration tests: an engine on the real model, and a way to
//! read a request's whole outcome.
#![allow(dead_code)] // each test binary uses its own subset

pub mod llamacpp;
pub mod reference;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use engine::{
    ChatMessage, EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest, Prompt,
    SamplingParams, TokenLogprob,
};

/// Engines in a test binary run one at a time: each uses every core, and several at once would
/// only measure the oversubscription.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn config(kv_cache_mb: usize) -> EngineConfig {
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        model.exists(),
        "{} is missing: run `make models`",
        model.display()
    );
    EngineConfig {
        model,
        kv_cache_mb,
        ..EngineConfig::default()
    }
}

/// `text` as a user's message, rendered by the chat template and encoded for generation.
pub fn user_prompt(engine: &EngineHandle, text: &str) -> Vec<u32> {
    engine
        .model()
        .encode_chat(&[ChatMessage::new("user", text)], true)
        .unwrap()
        .tokens
}

/// What a request produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
    pub error: Option<String>,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// What `Event::PromptLogprobs` carried, if it came.
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
}

impl Outcome {
    /// The same outcome with the prefix-cache figure cleared, to compare what was generated
    /// between runs that found different things in the cache.
    pub fn generated(&self) -> Outcome {
        Outcome {
            cached_tokens: 0,
            ..self.clone()
        }
    }
}

/// Reads a stream to its end, checking the order of its events.
pub fn collect(mut stream: engine::EventStream) -> Outcome {
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut prompt_logprobs = None;
    let mut deltas = 0;
    loop {
        match stream
            .blocking_next()
            .expect("the stream ends with Finished")
        {
            Event::PromptLogprobs(entries) => {
                assert_eq!(deltas, 0, "prompt log-probabilities come before any delta");
                assert!(
                    prompt_logprobs.is_none(),
                    "prompt log-probabilities came twice"
                );
                prompt_logprobs = Some(entries);
            }
            Event::Delta {
                text: t,
                tokens: ids,
                ..
            } => {
                text.push_str(&t);
                tokens.extend(ids);
                deltas += 1;
            }
            Event::Finished {
                reason,
                usage,
                error,
            } => {
                return Outcome {
                    tokens,
                    text,
                    reason,
                    error,
                    completion_tokens: usage.completion_tokens,
                    cached_tokens: usage.cached_tokens,
                    prompt_logprobs,
                }
            }
        }
    }
}

pub fn request(prompt: &[u32], sampling: SamplingParams, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        sampling,
        max_tokens,
        ..GenerateRequest::new(Prompt::Tokens(prompt.to_vec()))
    }
}

/// Waits until the engine has published that no sequence holds a block any more.
pub fn assert_pool_whole(engine: &EngineHandle) {
    let stats = engine.stats();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let kv = stats.kv().gauges;
        let idle = stats.running.load(Ordering::Relaxed) == 0;
        if idle && kv.device_used == 0 && kv.host_swapped == 0 {
            assert_eq!(kv.device_free + kv.device_cached, kv.device_total);
            return;
        }
        assert!(Instant::now() < deadline, "blocks still held: {kv:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

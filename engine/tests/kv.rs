//! The KV memory hierarchy end to end on the real model: prefix reuse, the host tier, swapping
//! and pinning, each checked against the engine's counters and against the tokens an engine
//! without them produces.

mod common;

use candle_core::Device;
use common::{assert_pool_whole, collect, config, request, serial, Outcome};
use engine::model::{Backend, DeviceWeights};
use engine::{
    ChatMessage, EngineConfig, EngineHandle, GenerateRequest, KvSnapshot, Prompt, SamplingParams,
};

const BLOCK: usize = 16;

/// A long system prompt (an agent's instructions), about `sentences` sentences long.
fn system_prompt(agent: &str, sentences: usize) -> String {
    let rules = [
        "Answer the question that was asked, and only that question.",
        "Prefer short sentences and plain words over jargon.",
        "When a request is ambiguous, state the assumption you make before answering.",
        "Never invent order numbers, prices or dates that the customer did not give you.",
        "If a calculation is needed, show the steps on separate lines.",
        "Keep a friendly, calm tone even when the user is upset.",
        "Point to the relevant policy when you refuse something.",
        "End with one line that says what the user should do next.",
    ];
    let mut text = format!("You are {agent}, an assistant in a team of specialist agents. ");
    for i in 0..sentences {
        text.push_str(rules[i % rules.len()]);
        text.push(' ');
    }
    text
}

fn chat_tokens(engine: &EngineHandle, system: &str, user: &str) -> Vec<u32> {
    engine
        .model()
        .encode_chat(
            &[
                ChatMessage::new("system", system),
                ChatMessage::new("user", user),
            ],
            true,
        )
        .unwrap()
        .tokens
}

fn run(engine: &EngineHandle, prompt: &[u32], max_tokens: usize) -> Outcome {
    collect(
        engine
            .submit(request(prompt, SamplingParams::greedy(), max_tokens))
            .unwrap(),
    )
}

/// Submits every prompt at once; request `i` scores its prompt with `prompt_logprobs(i)`.
fn run_all(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    prompt_logprobs: impl Fn(usize) -> Option<usize>,
) -> Vec<Outcome> {
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            engine
                .submit(GenerateRequest {
                    prompt_logprobs: prompt_logprobs(i),
                    ..request(p, SamplingParams::greedy(), max_tokens)
                })
                .unwrap()
        })
        .collect();
    streams.into_iter().map(collect).collect()
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn counters(engine: &EngineHandle) -> KvSnapshot {
    engine.stats().kv()
}

fn prefill_tokens(engine: &EngineHandle) -> u64 {
    engine
        .stats()
        .prefill_tokens
        .load(std::sync::atomic::Ordering::Relaxed)
}

fn uncached() -> EngineHandle {
    EngineHandle::start(&EngineConfig {
        prefix_cache: false,
        host_kv_cache_mb: 0,
        ..config(128)
    })
    .unwrap()
}

#[test]
fn a_shared_300_token_prefix_is_computed_once() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(128)).unwrap();
    let system = system_prompt("the support agent of an online shop", 24);
    let a = chat_tokens(&engine, &system, "Where is my order?");
    let b = chat_tokens(&engine, &system, "Can I change the delivery address?");
    let shared = common_prefix(&a, &b);
    assert!(shared >= 300, "the prompts share {shared} tokens");
    let first = run(&engine, &a, 16);
    assert_eq!(first.cached_tokens, 0);

    let before = prefill_tokens(&engine);
    let second = run(&engine, &b, 16);
    let computed = prefill_tokens(&engine) - before;
    let reusable = shared / BLOCK * BLOCK;
    assert_eq!(second.cached_tokens, reusable);
    assert_eq!(
        computed as usize,
        b.len() - reusable,
        "only the new tokens are computed"
    );

    let reference = uncached();
    assert_eq!(run(&reference, &b, 16), second.generated());
    assert_pool_whole(&engine);
}

#[test]
fn an_evicted_prefix_comes_back_from_the_host_tier() {
    let _serial = serial();
    // 48 blocks of 16 tokens: room for about two 350-token prompts.
    let engine = EngineHandle::start(&EngineConfig {
        device_kv_blocks: Some(48),
        ..config(128)
    })
    .unwrap();
    let system = system_prompt("the data analyst", 24);
    let first = chat_tokens(&engine, &system, "Summarise last week's sales.");
    run(&engine, &first, 8);

    // Other agents' long prompts fill the device; the analyst's blocks, least recently used,
    // are evicted to the host tier.
    for agent in ["the coder", "the math tutor", "the writer"] {
        let other = chat_tokens(&engine, &system_prompt(agent, 24), "Hello!");
        run(&engine, &other, 8);
    }
    let before = counters(&engine).counters;
    assert!(before.evictions_to_host > 0);

    let again = chat_tokens(&engine, &system, "Which region grew fastest?");
    let out = run(&engine, &again, 16);
    let after = counters(&engine).counters;
    let host_hits = (after.host_hit_tokens - before.host_hit_tokens) as usize;
    assert!(
        host_hits >= 256,
        "served {host_hits} tokens from the host tier"
    );
    assert_eq!(
        out.cached_tokens,
        common_prefix(&first, &again) / BLOCK * BLOCK
    );

    let reference = uncached();
    assert_eq!(run(&reference, &again, 16), out.generated());
    assert_pool_whole(&engine);
}

#[test]
fn swapping_under_pressure_changes_no_token() {
    swapping_changes_no_token(EngineHandle::start, 16, 8, 24, 0.0);
}

/// The same on the device path, run on the CPU: its cache as tensors, the copies between the
/// tiers from and into them, the greedy choice made where the logits are. Shorter prompts and
/// fewer requests, on a pool as tight for them: its f32 products are slow on two cores. Its
/// GEMMs sum in an order that depends on the batch's rows, so log-probabilities may move in the
/// last digits (1e-5 seen) as batches differ.
#[test]
fn the_device_path_swaps_through_the_host_tier_without_changing_a_token() {
    let device_path = |config: &EngineConfig| {
        let backend = Backend::Tensors {
            device: Device::Cpu,
            weights: DeviceWeights::F32,
        };
        EngineHandle::start_on(config, backend)
    };
    swapping_changes_no_token(device_path, 4, 4, 12, 1e-3);
}

/// Rounds of `per_round` requests to three agents (system prompts of `sentences` sentences), the
/// first agent again at the end, on an engine with room and on one with a pool of about two
/// prompts: the same tokens and prompt log-probabilities (within `tolerance`), with swaps and
/// host-tier hits on the tight one.
fn swapping_changes_no_token(
    start: impl Fn(&EngineConfig) -> engine::Result<EngineHandle>,
    sentences: usize,
    per_round: usize,
    max_tokens: usize,
    tolerance: f32,
) {
    let _serial = serial();
    let roomy = start(&config(256)).unwrap();
    let tight = start(&EngineConfig {
        device_kv_blocks: Some(5 * sentences / 2),
        ..config(256)
    })
    .unwrap();
    let agents = ["the coder", "the math tutor", "the support agent"];
    let mut prompts = Vec::new();
    for (round, agent) in [0, 1, 2, 0].into_iter().enumerate() {
        let system = system_prompt(agents[agent], sentences);
        for i in 0..per_round {
            let question = format!(
                "Request {round}-{i}: please explain item number {} of the list you were given, \
                 with an example, and say how it applies to a team of {} people.",
                i + 1,
                3 + i
            );
            prompts.push(chat_tokens(&roomy, &system, &question));
        }
    }
    assert!(prompts.iter().all(|p| p.len() >= 12 * sentences));
    // A few requests also score their prompts: swapped out and back in, they must still report
    // them once, the same.
    let scored = |i: usize| (i % 8 == 5).then_some(1);
    let expect = run_all(&roomy, &prompts, max_tokens, scored);
    let got = run_all(&tight, &prompts, max_tokens, scored);
    for (i, (e, g)) in expect.iter().zip(&got).enumerate() {
        assert_eq!(e.tokens, g.tokens, "request {i}");
        assert_eq!(e.reason, g.reason, "request {i}");
        assert_eq!(g.prompt_logprobs.is_some(), scored(i).is_some());
        if tolerance == 0.0 {
            assert_eq!(e.prompt_logprobs, g.prompt_logprobs, "request {i}");
            continue;
        }
        let (e, g) = (
            e.prompt_logprobs.iter().flatten(),
            g.prompt_logprobs.iter().flatten(),
        );
        for (pos, (e, g)) in e.zip(g).enumerate() {
            assert_eq!(e.token, g.token, "request {i} position {pos}");
            let diff = (e.logprob - g.logprob).abs();
            assert!(diff <= tolerance, "request {i} position {pos}: {diff}");
        }
    }
    let kv = counters(&tight);
    eprintln!("tight pool after the run: {kv:?}");
    assert!(kv.swaps_out > 0, "{kv:?}");
    assert!(kv.counters.swapped_in_blocks > 0, "{kv:?}");
    assert!(kv.counters.host_hit_tokens > 0, "{kv:?}");
    assert_pool_whole(&tight);
}

#[test]
fn a_pinned_prefix_stays_on_the_device() {
    let _serial = serial();
    let engine = EngineHandle::start(&EngineConfig {
        device_kv_blocks: Some(48),
        ..config(128)
    })
    .unwrap();
    let system = system_prompt("the writer", 24);
    let probe = chat_tokens(&engine, &system, "x");
    let other = chat_tokens(&engine, &system, "y");
    let prefix = &probe[..common_prefix(&probe, &other)];
    let mut pin = engine
        .pin_prefix(None, &Prompt::Tokens(prefix.to_vec()))
        .unwrap();
    let pinned_blocks = prefix.len() / BLOCK;
    assert_eq!(futures::executor::block_on(pin.pinned()), pinned_blocks);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while counters(&engine).gauges.device_pinned < pinned_blocks {
        assert!(
            std::time::Instant::now() < deadline,
            "the pinned blocks never showed in the gauge"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for agent in ["the coder", "the math tutor", "the analyst"] {
        let filler = chat_tokens(&engine, &system_prompt(agent, 24), "Hello!");
        run(&engine, &filler, 8);
    }
    let before = counters(&engine).counters;
    let out = run(&engine, &chat_tokens(&engine, &system, "Write a title."), 8);
    let after = counters(&engine).counters;
    assert_eq!(after.host_hit_tokens, before.host_hit_tokens);
    assert_eq!(out.cached_tokens, pinned_blocks * BLOCK);
    drop(pin);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while counters(&engine).gauges.device_pinned > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the prefix stayed pinned"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_pool_whole(&engine);
}

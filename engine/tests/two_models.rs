//! One engine serving two models of different architectures and cache shapes (SmolLM2 and
//! Gemma 3): one scheduler, one KV pool they both draw from.

mod common;

use std::sync::atomic::Ordering;

use common::reference::{gemma3_path, model_path, Ours};
use common::{assert_pool_whole, collect, request, serial, Outcome};
use engine::model::Backend;
use engine::{
    ChatMessage, EngineConfig, EngineHandle, FinishReason, GenerateRequest, SamplingParams,
};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1";
const GEMMA3: &str = "gemma-3-270m-q4_k_m";

fn engine(config: EngineConfig) -> EngineHandle {
    EngineHandle::start(&EngineConfig {
        model: model_path(),
        extra_models: vec![gemma3_path()],
        ..config
    })
    .expect("the two-model engine starts")
}

/// Request `i` of sixteen for `model`: a chat question of its own, greedy or seeded sampling.
fn mixed_request(engine: &EngineHandle, model: &str, i: usize) -> GenerateRequest {
    let info = engine.models().iter().find(|m| m.id == model).unwrap();
    let topics = [
        "rivers", "bread", "comets", "violins", "glaciers", "bees", "chess", "tides",
    ];
    let question = format!(
        "Tell me one fact about {} (number {i}).",
        topics[i % topics.len()]
    );
    let prompt = info
        .encode_chat(&[ChatMessage::new("user", question)], true)
        .unwrap()
        .tokens;
    let sampling = match i % 2 {
        0 => SamplingParams::greedy(),
        _ => SamplingParams {
            temperature: 0.8,
            seed: Some(i as u64),
            ..SamplingParams::default()
        },
    };
    GenerateRequest {
        model: Some(model.into()),
        ignore_eos: true,
        ..request(&prompt, sampling, 12)
    }
}

/// `max_tokens` greedy tokens after `prompt` from `model`, whatever the end of turn.
fn greedy(engine: &EngineHandle, model: &str, prompt: &[u32], max_tokens: usize) -> Outcome {
    let request = GenerateRequest {
        model: Some(model.into()),
        ignore_eos: true,
        ..request(prompt, SamplingParams::greedy(), max_tokens)
    };
    collect(engine.submit(request).unwrap())
}

/// Sixteen requests for each model on `engine`, each alone and then all at once: the outcomes,
/// alone and together.
fn alone_and_together(engine: &EngineHandle) -> (Vec<Outcome>, Vec<Outcome>) {
    let requests: Vec<GenerateRequest> = [SMOLLM2, GEMMA3]
        .iter()
        .flat_map(|model| (0..16).map(|i| mixed_request(engine, model, i)))
        .collect();
    let alone: Vec<Outcome> = requests
        .iter()
        .map(|r| collect(engine.submit(r.clone()).unwrap()))
        .collect();
    let streams: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let together = streams.into_iter().map(collect).collect();
    (alone, together)
}

fn assert_same(alone: &[Outcome], together: &[Outcome]) {
    for (i, (a, t)) in alone.iter().zip(together).enumerate() {
        assert_eq!(a.reason, FinishReason::Length, "request {i}: {:?}", a.error);
        assert_eq!(a.tokens.len(), 12);
        assert_eq!(
            a.generated(),
            t.generated(),
            "request {i} changed in the mixed batch"
        );
    }
}

/// Sixteen requests for each model at once give each request exactly the tokens it gives
/// alone: the models' forwards share a step and a cache, nothing else.
#[test]
fn a_mixed_batch_gives_each_request_what_it_gives_alone() {
    let _serial = serial();
    let engine = engine(EngineConfig {
        kv_cache_mb: 64,
        prefix_cache: false,
        ..EngineConfig::default()
    });
    let (alone, together) = alone_and_together(&engine);
    assert_same(&alone, &together);
    // The two models' answers differ (each ran its own weights).
    assert_ne!(together[0].text, together[16].text);
    let stats = engine.stats();
    for (m, id) in stats.models.iter().zip([SMOLLM2, GEMMA3]) {
        assert_eq!(m.id, id);
        // Each request's first token comes from its prefill; the other 11 are decoded.
        assert_eq!(m.decode_tokens.load(Ordering::Relaxed), 2 * 16 * 11);
    }
    assert_pool_whole(&engine);
}

/// In a pool far too small for the 32 at once, sequences of both models are preempted, their
/// blocks swapped out to the host tier and back (or recomputed), and reused from the prefix
/// cache: each request still gives exactly what it gives alone.
#[test]
fn preemption_swaps_and_prefix_hits_serve_both_models_unchanged() {
    let _serial = serial();
    let engine = engine(EngineConfig {
        device_kv_blocks: Some(40),
        ..EngineConfig::default()
    });
    let (alone, together) = alone_and_together(&engine);
    assert_same(&alone, &together);
    let kv = engine.stats().kv();
    assert!(kv.swaps_out > 0, "{kv:?}");
    assert!(
        kv.counters.device_hit_tokens + kv.counters.host_hit_tokens > 0,
        "{kv:?}"
    );
    assert!(together.iter().skip(16).any(|o| o.cached_tokens > 0));
    assert_pool_whole(&engine);
}

/// Each model answers with its own chat format: SmolLM2, an instruction-tuned model, alone;
/// Gemma 3's base model after one example exchange.
#[test]
fn each_model_knows_the_capital_of_france() {
    let _serial = serial();
    let engine = engine(EngineConfig {
        kv_cache_mb: 32,
        ..EngineConfig::default()
    });
    let question = "What is the capital of France?";
    let alone = [ChatMessage::new(
        "user",
        format!("{question} Answer in one sentence."),
    )];
    let one_shot = [
        ChatMessage::new("user", "What is the capital of Italy?"),
        ChatMessage::new("assistant", "Rome."),
        ChatMessage::new("user", question),
    ];
    for (model, messages) in [(SMOLLM2, &alone[..]), (GEMMA3, &one_shot[..])] {
        let info = engine.models().iter().find(|m| m.id == model).unwrap();
        let prompt = info.encode_chat(messages, true).unwrap().tokens;
        let out = collect(
            engine
                .submit(GenerateRequest {
                    model: Some(model.into()),
                    ..request(&prompt, SamplingParams::greedy(), 16)
                })
                .unwrap(),
        );
        assert!(out.text.contains("Paris"), "{model}: {:?}", out.text);
    }
    // A model the engine does not serve is refused up front, naming those it serves.
    let refused = engine.submit(GenerateRequest {
        model: Some("llama-70b".into()),
        ..GenerateRequest::new(engine::Prompt::Text("Hi".into()))
    });
    let error = refused
        .err()
        .expect("an unknown model is refused")
        .to_string();
    assert!(error.contains(SMOLLM2) && error.contains(GEMMA3), "{error}");
}

/// The pool is one: a model takes blocks the other left cached (most of the pool), and the same
/// tokens under the two models never share a block. A block is the memory of SmolLM2's 16
/// tokens, which holds 120 tokens of Gemma 3's 3 global layers, or 24 of its 15 windowed ones.
#[test]
fn kv_memory_moves_to_the_model_with_the_load() {
    let _serial = serial();
    const BLOCKS: usize = 48;
    let engine = engine(EngineConfig {
        device_kv_blocks: Some(BLOCKS),
        host_kv_cache_mb: 0,
        ..EngineConfig::default()
    });
    let capacity: Vec<usize> = (engine.models().iter())
        .map(|m| m.kv_capacity_tokens)
        .collect();
    // Gemma's windowed layers hold the blocks of their window and of one step's chunk (256
    // tokens), 24 tokens a block, its global layers 120 tokens a block: 33 blocks for the
    // first, 15 for 1800 tokens.
    assert_eq!(capacity, [BLOCKS * 16, 1800]);
    // Token ids both vocabularies hold: 40 of SmolLM2's blocks, 32 of Gemma's.
    let prompt: Vec<u32> = (0..640).map(|t| 1000 + (t * 7) % 3000).collect();
    let run = |model: &str| greedy(&engine, model, &prompt, 4);
    let first = run(SMOLLM2);
    assert_eq!(first.reason, FinishReason::Length, "{:?}", first.error);
    assert_pool_whole(&engine);
    let kv = engine.stats().kv();
    assert!(kv.gauges.device_cached >= 40, "{:?}", kv.gauges);
    // Gemma needs 33 of the 48 blocks: it can only have them by evicting SmolLM2's, and it
    // finds none of them as its own prefix.
    let second = run(GEMMA3);
    assert_eq!(second.reason, FinishReason::Length, "{:?}", second.error);
    assert_eq!(second.cached_tokens, 0, "a block crossed models");
    let kv = engine.stats().kv();
    assert!(kv.counters.device_evictions >= 25, "{:?}", kv.counters);
    // Gemma's prefix is cached now; SmolLM2's was evicted, and a second Gemma run finds its own.
    let again = run(GEMMA3);
    assert_eq!(again.tokens, second.tokens);
    assert!(again.cached_tokens >= 600, "{}", again.cached_tokens);
    assert_pool_whole(&engine);
}

/// Gemma 3's sliding-window layers keep blocks of their own (24 tokens of their 15 layers in a
/// block, beside 120 tokens of the 3 global layers) and give back those their window of 512
/// positions has left: a prompt of 990 tokens and 24 more decoded run in a pool of 44 blocks,
/// where keeping every block would take 51, and give exactly the tokens of a forward that keeps
/// every position. The same prompt again finds its prefix, although the windowed blocks of its
/// start were given back (and may since be evicted): a hit needs only what the window reads.
/// A shorter prompt whose answer grows past the window switches to the same layout on the way.
#[test]
fn windowed_layers_hold_only_their_window() {
    let _serial = serial();
    let engine = engine(EngineConfig {
        device_kv_blocks: Some(44),
        host_kv_cache_mb: 0,
        ..EngineConfig::default()
    });
    let prompt: Vec<u32> = (0..990).map(|t| 1000 + (t * 7) % 3000).collect();
    assert!((prompt.len() + 24).div_ceil(20) > 44, "would fit whole");
    let mut reference = Ours::load(&gemma3_path(), Backend::Kernels);
    let expected = reference.greedy(&prompt, 24, 0);
    let run = || greedy(&engine, GEMMA3, &prompt, 24);
    let first = run();
    assert_eq!(first.reason, FinishReason::Length, "{:?}", first.error);
    assert_eq!(first.tokens, expected);
    let again = run();
    assert_eq!(again.tokens, expected);
    assert_eq!(
        again.cached_tokens, 960,
        "a prefix ends on a global block's boundary"
    );
    // A prompt within the window keeps every layer together; its answer grows past the window,
    // and the sequence goes on with its windowed layers apart, its cache computed again.
    let short = &prompt[..500];
    let expected = reference.greedy(short, 24, 0);
    let relayouts = || engine.stats().kv().relayouts;
    let before = relayouts();
    let crossing = greedy(&engine, GEMMA3, short, 24);
    assert_eq!(crossing.tokens, expected);
    assert_eq!(relayouts(), before + 1);
    assert_pool_whole(&engine);
}

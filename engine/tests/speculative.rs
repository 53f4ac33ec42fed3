//! Speculative decoding changes how many steps an answer takes, never the answer: the same
//! requests on an engine drafting by prompt lookup and on one decoding a token a step give the
//! same tokens, text, finish reasons and log-probabilities, for greedy and seeded sampling, with
//! penalties, stop strings and grammars, alone and batched; and the drafting engine gets there
//! in fewer steps on answers that copy their prompt.

mod common;

use std::sync::atomic::Ordering;

use common::{assert_pool_whole, collect, config, serial, user_prompt, Outcome};
use engine::{
    EngineHandle, Event, GenerateRequest, Prompt, ResponseFormat, SamplingParams, Speculative,
};

/// Prompts whose answers copy from them (a text to repeat or edit, a record to put in JSON,
/// code to fix), and one that copies nothing.
const PROMPTS: [&str; 5] = [
    "Repeat the following text exactly, word for word: The quick brown fox jumps over the lazy \
     dog. The lazy dog sleeps in the sun while the quick brown fox runs into the forest.",
    "Here is a record: name Ada Lovelace, born 10 December 1815 in London, occupation \
     mathematician, known for notes on the Analytical Engine. Write it as a JSON object with \
     the keys name, born, city, occupation and known_for.",
    "Fix the bug in this function and print the whole corrected function:\n\
     fn total(items: &[u32]) -> u32 {\n    let mut sum = 0;\n    for item in items {\n        \
     sum -= item;\n    }\n    sum\n}",
    "Rewrite this sentence replacing every 'cat' with 'dog': the cat sat on the mat, the cat \
     ate the food of the cat next door, and the cat slept.",
    "Write a short poem about the sea.",
];

fn engine(speculative: Speculative) -> EngineHandle {
    EngineHandle::start(&engine::EngineConfig {
        speculative,
        ..config(128)
    })
    .unwrap()
}

/// The requests compared: each prompt with every kind of sampling and output control.
fn requests(engine: &EngineHandle) -> Vec<GenerateRequest> {
    let mut requests = Vec::new();
    for (i, text) in PROMPTS.iter().enumerate() {
        let prompt = Prompt::Tokens(user_prompt(engine, text));
        let base = GenerateRequest {
            max_tokens: 48,
            ..GenerateRequest::new(prompt)
        };
        let seeded = SamplingParams {
            temperature: 0.7,
            top_p: 0.95,
            seed: Some(40 + i as u64),
            ..SamplingParams::default()
        };
        requests.extend([
            GenerateRequest {
                sampling: SamplingParams::greedy(),
                ..base.clone()
            },
            GenerateRequest {
                sampling: seeded.clone(),
                ..base.clone()
            },
            GenerateRequest {
                sampling: SamplingParams {
                    frequency_penalty: 0.3,
                    repetition_penalty: 1.1,
                    ..seeded.clone()
                },
                logprobs: Some(2),
                ..base.clone()
            },
            GenerateRequest {
                sampling: SamplingParams::greedy(),
                stop: vec!["lazy dog".into(), "}\n".into(), "next door".into()],
                ..base.clone()
            },
            GenerateRequest {
                sampling: seeded,
                response_format: ResponseFormat::JsonObject,
                ..base.clone()
            },
        ]);
    }
    requests
}

/// Each request alone, then all together; with the engine's steps and accepted draft tokens.
fn run(engine: &EngineHandle) -> (Vec<Outcome>, Vec<Outcome>, u64, u64) {
    let stats = engine.stats();
    let requests = requests(engine);
    let alone: Vec<Outcome> = (requests.iter())
        .map(|r| collect(engine.submit(r.clone()).unwrap()))
        .collect();
    let steps = stats.steps.load(Ordering::Relaxed);
    let accepted = stats.accepted_draft_tokens.load(Ordering::Relaxed);
    let streams: Vec<_> = (requests.iter())
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let together = streams.into_iter().map(collect).collect();
    assert_pool_whole(engine);
    (alone, together, steps, accepted)
}

/// The log-probabilities a stream carried, token by token.
fn logprobs(engine: &EngineHandle, request: GenerateRequest) -> Vec<engine::TokenLogprob> {
    let mut stream = engine.submit(request).unwrap();
    let mut all = Vec::new();
    loop {
        match stream.blocking_next().unwrap() {
            Event::Delta { logprobs, .. } => all.extend(logprobs),
            Event::Finished { .. } => return all,
            Event::PromptLogprobs(_) => {}
        }
    }
}

#[test]
fn drafting_gives_the_tokens_of_one_token_a_step() {
    let _serial = serial();
    let off = engine(Speculative::Off);
    let (plain, plain_batched, plain_steps, none) = run(&off);
    assert_eq!(none, 0, "an engine that does not draft accepts no draft");
    let with_logprobs = requests(&off).swap_remove(2);
    let plain_logprobs = logprobs(&off, with_logprobs.clone());
    drop(off);

    let ngram = engine(Speculative::Ngram);
    let (drafted, drafted_batched, steps, accepted) = run(&ngram);
    for (i, (a, b)) in plain.iter().zip(&drafted).enumerate() {
        assert!(!a.tokens.is_empty(), "request {i} generated nothing");
        assert_eq!(a.generated(), b.generated(), "request {i} alone");
    }
    for (i, (a, b)) in plain_batched.iter().zip(&drafted_batched).enumerate() {
        assert_eq!(a.generated(), b.generated(), "request {i} batched");
    }
    // Batched or not, the answers are the same too.
    for (i, (a, b)) in plain.iter().zip(&plain_batched).enumerate() {
        assert_eq!(
            a.generated(),
            b.generated(),
            "request {i}, alone and batched"
        );
    }
    let drafted_logprobs = logprobs(&ngram, with_logprobs);
    assert_eq!(plain_logprobs.len(), plain[2].tokens.len());
    assert_eq!(plain_logprobs, drafted_logprobs);
    // The drafts were used, and each token they gave saved a step: the answers copying their
    // prompts took fewer.
    let tokens: usize = plain.iter().map(|o| o.completion_tokens).sum();
    assert!(
        accepted * 8 > tokens as u64,
        "{accepted} of {tokens} tokens drafted"
    );
    assert_eq!(
        steps + accepted,
        plain_steps,
        "{steps} steps, {accepted} drafted"
    );
}

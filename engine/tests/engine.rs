//! The engine end to end on the real model: batch invariance, preemption, stop strings,
//! cancellation and deadlines, with the block pool checked to be whole afterwards.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{assert_pool_whole, collect, config, request, serial, user_prompt, Outcome};
use engine::{
    EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest, Prompt, SamplingParams,
};

/// 16 chat prompts from about 5 to about 400 tokens.
fn prompts(engine: &EngineHandle) -> Vec<Vec<u32>> {
    let topics = [
        "the moon",
        "rust",
        "bread",
        "the ocean",
        "chess",
        "rain",
        "trains",
        "music",
        "coffee",
        "maps",
        "birds",
        "glass",
        "winter",
        "numbers",
        "gardens",
        "rivers",
    ];
    let tokenizer = &engine.model().tokenizer;
    topics
        .iter()
        .enumerate()
        .map(|(i, topic)| {
            if i == 0 {
                // A bare prompt of a few tokens, no template.
                tokenizer
                    .encode(format!("Tell me about {topic}"), false)
                    .unwrap()
                    .get_ids()
                    .to_vec()
            } else {
                let context = "Here is some background you may use. ".repeat(i * 3);
                user_prompt(engine, &format!("{context}Tell me about {topic}."))
            }
        })
        .collect()
}

/// Each request alone, then all at once: the tokens must be identical.
fn alone_vs_together(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    sampling: impl Fn(usize) -> SamplingParams,
) {
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(
        lens.iter().min().unwrap() <= &8 && lens.iter().max().unwrap() >= &380,
        "{lens:?}"
    );
    let alone: Vec<Outcome> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| collect(engine.submit(request(p, sampling(i), 40)).unwrap()))
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| engine.submit(request(p, sampling(i), 40)).unwrap())
        .collect();
    let together: Vec<Outcome> = streams.into_iter().map(collect).collect();
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert!(!a.tokens.is_empty());
        assert_eq!(
            a.generated(),
            t.generated(),
            "request {i} (prompt of {} tokens) differs in a batch",
            lens[i]
        );
    }
    assert_pool_whole(engine);
}

#[test]
fn greedy_requests_give_the_same_tokens_alone_and_batched() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(256)).unwrap();
    let prompts = prompts(&engine);
    alone_vs_together(&engine, &prompts, |_| SamplingParams::greedy());
}

#[test]
fn seeded_sampling_gives_the_same_tokens_alone_and_batched() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(256)).unwrap();
    let prompts = prompts(&engine);
    alone_vs_together(&engine, &prompts, |i| SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed: Some(1000 + i as u64),
        ..SamplingParams::default()
    });
}

#[test]
fn preemption_by_recompute_changes_no_token() {
    let _serial = serial();
    let roomy = EngineHandle::start(&config(256)).unwrap();
    // 24 blocks of 16 tokens for 8 sequences that each grow to ~100 tokens (7 blocks), and no
    // host tier to swap to. (Sized in blocks: 18 MiB made 51 of SmolLM2's f16 blocks, which
    // some arrival orders of the 8 requests never outgrew.)
    let tight = EngineHandle::start(&EngineConfig {
        host_kv_cache_mb: 0,
        device_kv_blocks: Some(24),
        ..config(18)
    })
    .unwrap();
    let prompts: Vec<Vec<u32>> = prompts(&roomy).into_iter().skip(2).take(8).collect();
    // Every other request also asks for prompt log-probabilities: preempted, it must still report
    // them once, the same.
    let run = |engine: &EngineHandle| -> Vec<Outcome> {
        let streams: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                engine
                    .submit(GenerateRequest {
                        prompt_logprobs: (i % 2 == 1).then_some(2),
                        ..request(&p[..p.len().min(60)], SamplingParams::greedy(), 40)
                    })
                    .unwrap()
            })
            .collect();
        streams.into_iter().map(collect).collect()
    };
    let expect = run(&roomy);
    let got = run(&tight);
    assert!(
        tight.stats().kv().recomputes > 0,
        "the tight pool must have forced preemptions by recompute"
    );
    assert_eq!(
        expect.iter().map(Outcome::generated).collect::<Vec<_>>(),
        got.iter().map(Outcome::generated).collect::<Vec<_>>()
    );
    assert!(got
        .iter()
        .skip(1)
        .step_by(2)
        .all(|o| o.prompt_logprobs.is_some()));
    assert_pool_whole(&tight);
}

#[test]
fn stop_string_spanning_two_tokens_ends_generation_unseen() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let prompt = user_prompt(&engine, "Write two sentences about the sea.");
    let free = collect(
        engine
            .submit(GenerateRequest {
                sampling: SamplingParams::greedy(),
                max_tokens: 40,
                ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
            })
            .unwrap(),
    );
    // Find two consecutive tokens, each at least two characters of text, and take a stop string
    // made of the end of one and the start of the next.
    let tokenizer = &engine.model().tokenizer;
    let piece = |t: u32| tokenizer.decode(&[t], true).unwrap();
    let i = (5..free.tokens.len() - 1)
        .find(|&i| {
            let (a, b) = (piece(free.tokens[i]), piece(free.tokens[i + 1]));
            a.trim().len() >= 2 && b.trim().len() >= 2 && a.is_ascii() && b.is_ascii()
        })
        .expect("two ordinary tokens in a row");
    let (a, b) = (piece(free.tokens[i]), piece(free.tokens[i + 1]));
    let stop = format!("{}{}", &a[a.len() - 2..], &b[..2]);
    let stopped = collect(
        engine
            .submit(GenerateRequest {
                sampling: SamplingParams::greedy(),
                max_tokens: 40,
                stop: vec![stop.clone()],
                ..GenerateRequest::new(Prompt::Tokens(prompt))
            })
            .unwrap(),
    );
    assert_eq!(stopped.reason, FinishReason::Stop);
    assert!(
        !stopped.text.contains(&stop),
        "{:?} contains {stop:?}",
        stopped.text
    );
    let cut = free
        .text
        .find(&stop)
        .expect("the stop string is in the free text");
    assert_eq!(stopped.text, free.text[..cut]);
    assert_eq!(stopped.tokens, free.tokens[..stopped.tokens.len()]);
    assert!(stopped.tokens.len() <= i + 2);
    assert_pool_whole(&engine);
}

#[test]
fn max_tokens_and_eos_finish_with_the_right_reason() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let prompt = user_prompt(&engine, "Say hello.");
    let short = collect(
        engine
            .submit(GenerateRequest {
                sampling: SamplingParams::greedy(),
                max_tokens: 3,
                ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
            })
            .unwrap(),
    );
    assert_eq!(short.reason, FinishReason::Length);
    assert_eq!(short.completion_tokens, 3);
    let full = collect(
        engine
            .submit(GenerateRequest {
                sampling: SamplingParams::greedy(),
                max_tokens: 200,
                ..GenerateRequest::new(Prompt::Tokens(prompt))
            })
            .unwrap(),
    );
    assert_eq!(
        full.reason,
        FinishReason::Stop,
        "the model ends a greeting with <|im_end|>"
    );
    assert!(!full.text.contains("<|im_end|>"));
    // The EOS token is counted but not streamed.
    assert_eq!(full.completion_tokens, full.tokens.len() + 1);
}

#[test]
fn dropping_the_stream_cancels_and_frees_blocks() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let mut stream = engine
        .submit(GenerateRequest {
            max_tokens: 500,
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Text("Once upon a time".into()))
        })
        .unwrap();
    for _ in 0..3 {
        assert!(matches!(stream.blocking_next(), Some(Event::Delta { .. })));
    }
    drop(stream);
    assert_pool_whole(&engine);
}

#[test]
fn a_passed_deadline_ends_with_an_error_and_frees_blocks() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let out = collect(
        engine
            .submit(GenerateRequest {
                max_tokens: 5000,
                ignore_eos: true,
                deadline: Some(Instant::now() + Duration::from_millis(300)),
                ..GenerateRequest::new(Prompt::Text("Count to one thousand:".into()))
            })
            .unwrap(),
    );
    assert_eq!(out.reason, FinishReason::Error);
    assert_eq!(out.error.as_deref(), Some("deadline exceeded"));
    assert!(out.completion_tokens < 5000);
    assert_pool_whole(&engine);
}

#[test]
fn invalid_requests_are_refused_before_queueing() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let bad = |r: GenerateRequest| engine.submit(r).err().expect("refused").to_string();
    assert!(bad(GenerateRequest::new(Prompt::Text(String::new()))).contains("empty"));
    assert!(bad(GenerateRequest::new(Prompt::Tokens(vec![1, 999_999]))).contains("vocabulary"));
    let huge = vec![100u32; 20_000];
    assert!(bad(GenerateRequest::new(Prompt::Tokens(huge))).contains("at most"));
    let mut r = GenerateRequest::new(Prompt::Text("hi".into()));
    r.sampling.top_p = 0.0;
    assert!(bad(r).contains("top_p"));
}

#[test]
fn logprobs_come_with_each_token() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let mut stream = engine
        .submit(GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens: 5,
            logprobs: Some(3),
            ..GenerateRequest::new(Prompt::Text("The capital of France is".into()))
        })
        .unwrap();
    let mut seen = 0;
    while let Some(Event::Delta {
        tokens, logprobs, ..
    }) = stream.blocking_next()
    {
        for (t, lp) in tokens.iter().zip(&logprobs) {
            assert_eq!(*t, lp.token);
            assert_eq!(lp.top.len(), 3);
            // Greedy: the chosen token is the most likely one.
            assert_eq!(lp.top[0].0, *t);
            assert!(lp.logprob <= 0.0 && (lp.logprob - lp.top[0].1).abs() < 1e-6);
            seen += 1;
        }
    }
    assert!(seen > 0);
}

#[test]
fn json_mode_produces_a_json_object() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let prompt = user_prompt(
        &engine,
        "Describe a cat as JSON with the keys name, age and colour.",
    );
    for sampling in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..SamplingParams::default()
        },
    ] {
        let out = collect(
            engine
                .submit(GenerateRequest {
                    sampling,
                    max_tokens: 300,
                    response_format: engine::ResponseFormat::JsonObject,
                    ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
                })
                .unwrap(),
        );
        assert_eq!(out.reason, FinishReason::Stop, "{:?}", out.text);
        let value: serde_json::Value = serde_json::from_str(&out.text)
            .unwrap_or_else(|e| panic!("{:?} is not JSON: {e}", out.text));
        assert!(value.is_object(), "{value}");
    }
    assert_pool_whole(&engine);
}

/// What a grammar forces (here the keys of a strict schema, its braces and separators) is not
/// sampled a token at a time: it joins the token before it and runs through the model with it,
/// so the answer takes fewer steps than it has tokens. Each of its tokens still reaches the
/// stream, and a request that asks for log-probabilities gets one per token (nothing is skipped
/// for it).
#[test]
fn forced_grammar_text_runs_as_a_chunk_not_a_step_per_token() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let prompt = user_prompt(&engine, "Is the sky blue? Answer as JSON.");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "the_answer_to_the_question_in_one_word": {"type": "string", "maxLength": 12},
            "how_confident_you_are_from_one_to_ten": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": [
            "the_answer_to_the_question_in_one_word",
            "how_confident_you_are_from_one_to_ten",
        ],
        "additionalProperties": false,
    });
    let request = |logprobs| GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens: 80,
        logprobs,
        response_format: engine::ResponseFormat::JsonSchema {
            schema: schema.clone(),
            strict: true,
        },
        ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
    };
    let steps = || engine.stats().steps.load(Ordering::Relaxed);
    let before = steps();
    let mut stream = engine.submit(request(None)).unwrap();
    let (mut text, mut tokens, mut deltas) = (Vec::new(), Vec::new(), 0u64);
    let (reason, completion_tokens) = loop {
        match stream
            .blocking_next()
            .expect("the stream ends with Finished")
        {
            Event::Delta {
                text: t,
                tokens: ids,
                ..
            } => {
                text.push(t);
                tokens.extend(ids);
                deltas += 1;
            }
            Event::Finished { reason, usage, .. } => break (reason, usage.completion_tokens),
            Event::PromptLogprobs(_) => panic!("no prompt log-probabilities were asked for"),
        }
    };
    let taken = steps() - before;
    assert_eq!(
        text[0], r#"{"the_answer_to_the_question_in_one_word":"#,
        "the grammar's forced opening comes first, whole"
    );
    // The opening is computed with the prompt: the first step samples after it, and each
    // step samples one token (the end of sequence too, which is not streamed), so there is
    // one step per delta after the first, and the last.
    assert_eq!(taken, deltas, "the opening was prefilled, not decoded");
    let text = text.concat();
    assert_eq!(reason, FinishReason::Stop, "{text:?}");
    let value: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    assert_eq!(value.as_object().map(|o| o.len()), Some(2), "{value}");
    assert_eq!(
        tokens.len() + 1,
        completion_tokens,
        "every token is streamed but the end of sequence"
    );
    assert_eq!(
        engine.model().tokenizer.decode(&tokens, true).unwrap(),
        text,
        "the streamed tokens spell the text"
    );
    // The two keys alone are well over 20 tokens, none of them sampled.
    assert!(
        taken + 20 <= completion_tokens as u64,
        "{taken} steps (prefill included) for {completion_tokens} tokens"
    );

    let mut stream = engine.submit(request(Some(2))).unwrap();
    let (mut tokens, mut logprobs) = (0, 0);
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Delta {
                tokens: t,
                logprobs: l,
                ..
            } => {
                tokens += t.len();
                logprobs += l.len();
            }
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Stop);
                break;
            }
            Event::PromptLogprobs(_) => {}
        }
    }
    assert!(
        tokens > 20 && logprobs == tokens,
        "{logprobs} log-probabilities for {tokens} tokens"
    );
    assert_pool_whole(&engine);
}

/// A chat prompt of 40 to 100 tokens.
fn medium_prompt(engine: &EngineHandle) -> Vec<u32> {
    prompts(engine)
        .into_iter()
        .find(|p| (40..100).contains(&p.len()))
        .expect("a prompt of 40 to 100 tokens")
}

/// A greedy request for prompt log-probabilities with `top` alternatives per token.
fn with_prompt_logprobs(prompt: &[u32], top: usize, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_logprobs: Some(top),
        ..request(prompt, SamplingParams::greedy(), max_tokens)
    }
}

#[test]
fn prompt_logprobs_do_not_depend_on_chunking_batching_or_the_prefix_cache() {
    let _serial = serial();
    let whole = EngineHandle::start(&config(64)).unwrap();
    let prompt = medium_prompt(&whole);
    let first = collect(whole.submit(with_prompt_logprobs(&prompt, 3, 2)).unwrap());
    let entries = first.prompt_logprobs.clone().expect("asked for");
    assert_eq!(entries.len(), prompt.len() - 1);
    let scored: Vec<u32> = entries.iter().map(|e| e.token).collect();
    assert_eq!(scored, prompt[1..]);
    // The prompt's blocks are now cached: a plain request takes them, one asking for prompt
    // log-probabilities does not, and reports the same entries, bit for bit.
    let plain = collect(
        whole
            .submit(request(&prompt, SamplingParams::greedy(), 2))
            .unwrap(),
    );
    assert!(plain.cached_tokens >= 32, "{}", plain.cached_tokens);
    assert_eq!(plain.prompt_logprobs, None, "not asked for, not sent");
    let again = collect(whole.submit(with_prompt_logprobs(&prompt, 3, 2)).unwrap());
    assert_eq!(again.cached_tokens, 0);
    assert_eq!(again, first);
    assert_eq!(plain.tokens, first.tokens);

    // Prefilled 7 tokens a step, beside another request's chunks and decodes.
    let chunked = EngineHandle::start(&EngineConfig {
        max_step_tokens: 7,
        ..config(64)
    })
    .unwrap();
    let other = prompts(&chunked).swap_remove(1);
    let neighbour = chunked
        .submit(request(&other, SamplingParams::greedy(), 8))
        .unwrap();
    let steps = || chunked.stats().steps.load(Ordering::Relaxed) as usize;
    let before = steps();
    let split = collect(chunked.submit(with_prompt_logprobs(&prompt, 3, 2)).unwrap());
    assert!(steps() - before >= prompt.len() / 7, "not chunked");
    assert_eq!(split, first);
    collect(neighbour);
    assert_pool_whole(&chunked);
    assert_pool_whole(&whole);
}

#[test]
fn prompt_logprobs_rank_alternatives_as_generation_does() {
    let _serial = serial();
    let engine = EngineHandle::start(&config(64)).unwrap();
    let prompt = medium_prompt(&engine);
    let entries = collect(engine.submit(with_prompt_logprobs(&prompt, 5, 1)).unwrap())
        .prompt_logprobs
        .expect("asked for");
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e.top.len(), 5);
        assert!(e.scored.is_empty());
        assert!(
            e.top.windows(2).all(|w| w[0].1 >= w[1].1),
            "entry {i}: {:?}",
            e.top
        );
        assert!(e.logprob <= e.top[0].1 && e.top[0].1 <= 0.0, "entry {i}");
        if let Some(&(_, lp)) = e.top.iter().find(|t| t.0 == e.token) {
            assert_eq!(lp, e.logprob, "entry {i}");
        }
    }
    // Entry k - 1 comes from the logits at position k - 1, the ones a request with prompt
    // `prompt[..k]` samples its first token from: the greedy token heads the alternatives, and
    // the generated token's own log-probabilities are the same numbers.
    for k in [2, prompt.len() / 2, prompt.len() - 1] {
        let mut stream = engine
            .submit(GenerateRequest {
                logprobs: Some(5),
                ..request(&prompt[..k], SamplingParams::greedy(), 1)
            })
            .unwrap();
        let Some(Event::Delta { logprobs, .. }) = stream.blocking_next() else {
            panic!("the first event is the token")
        };
        let entry = &entries[k - 1];
        assert_eq!(logprobs[0].top[0].0, logprobs[0].token);
        assert_eq!(logprobs[0].top, entry.top, "prefix of {k} tokens");
    }
    // A one-token prompt has nothing to score, and says so.
    let single = collect(
        engine
            .submit(with_prompt_logprobs(&prompt[..1], 5, 1))
            .unwrap(),
    );
    assert_eq!(single.prompt_logprobs, Some(Vec::new()));
    assert_pool_whole(&engine);
}

#[test]
fn prompt_logprobs_survive_a_recompute_in_the_middle_of_the_prompt() {
    let _serial = serial();
    let roomy = EngineHandle::start(&config(64)).unwrap();
    let prompt = prompts(&roomy)
        .into_iter()
        .find(|p| p.len() >= 100)
        .expect("a prompt of 100 tokens or more");
    let expect = collect(roomy.submit(with_prompt_logprobs(&prompt, 2, 2)).unwrap());
    // Four sequences of a few tokens decode 60 each (4 blocks of 16 apiece in the end) while the
    // long prompt, submitted last, is prefilled 2 tokens a step beside them. About 45 steps in,
    // when the decoders reach their fourth block, the prompt holds 6 of the pool's 20 and only 2
    // are left: the newest sequence, the one scoring its prompt, is preempted and later
    // prefilled again from the start (there is no host tier to swap it to).
    let tight = EngineHandle::start(&EngineConfig {
        device_kv_blocks: Some(20),
        host_kv_cache_mb: 0,
        max_step_tokens: 6,
        ..config(64)
    })
    .unwrap();
    let decoders: Vec<_> = [
        "Once upon a time",
        "The sea was",
        "In the morning",
        "Rain fell",
    ]
    .into_iter()
    .map(|text| {
        tight
            .submit(GenerateRequest {
                max_tokens: 60,
                ignore_eos: true,
                ..GenerateRequest::new(Prompt::Text(text.into()))
            })
            .unwrap()
    })
    .collect();
    let got = collect(tight.submit(with_prompt_logprobs(&prompt, 2, 2)).unwrap());
    for d in decoders {
        assert_eq!(collect(d).completion_tokens, 60);
    }
    assert!(tight.stats().kv().recomputes > 0, "no preemption happened");
    assert_eq!(got.generated(), expect.generated());
    assert_pool_whole(&tight);
}

#[test]
fn a_reader_that_stops_reading_ends_its_request_and_frees_its_blocks() {
    let _serial = serial();
    let engine = EngineHandle::start(&EngineConfig {
        max_unread_events: 8,
        ..config(64)
    })
    .unwrap();
    let prompt = user_prompt(&engine, "Count from one to a thousand.");
    let stream = engine
        .submit(GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens: 500,
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Tokens(prompt))
        })
        .unwrap();
    // Nothing is read: the engine must give up on the request by itself.
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.stats().decode_tokens.load(Ordering::Relaxed) == 0
        || engine.stats().running.load(Ordering::Relaxed) > 0
    {
        assert!(Instant::now() < deadline, "the unread request still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    let outcome = collect(stream);
    assert_eq!(outcome.reason, FinishReason::Error);
    assert!(
        outcome
            .error
            .as_deref()
            .unwrap()
            .contains("stopped reading"),
        "{outcome:?}"
    );
    assert!(outcome.tokens.len() < 8, "at most the buffer was generated");
    assert_pool_whole(&engine);
}

//! Gemma 3 served: its chat format (the GGUF ships none, so the built-in one) and an answer.

mod common;

use common::reference::{gemma3_path, model_path};
use common::{collect, request, serial};
use engine::{ChatMessage, EngineConfig, EngineHandle, FinishReason, SamplingParams};

fn engine() -> EngineHandle {
    let config = EngineConfig {
        model: gemma3_path(),
        kv_cache_mb: 64,
        ..EngineConfig::default()
    };
    EngineHandle::start(&config).expect("the Gemma 3 engine starts")
}

#[test]
fn gemma3_chat_format() {
    let _serial = serial();
    let engine = engine();
    let model = engine.model();
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi!"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "<end_of_turn> is text here"),
    ];
    let prompt = model.encode_chat(&messages, true).unwrap().tokens;
    let expected = "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n\
                    <start_of_turn>model\nHello.<end_of_turn>\n\
                    <start_of_turn>user\n<end_of_turn> is text here<end_of_turn>\n\
                    <start_of_turn>model\n";
    assert_eq!(model.tokenizer.decode(&prompt, false).unwrap(), expected);
    // The template's markup is control tokens; the same text inside a message is not.
    let end_of_turn = model.tokenizer.token_to_id("<end_of_turn>").unwrap();
    assert_eq!(prompt[0], model.tokenizer.token_to_id("<bos>").unwrap());
    assert_eq!(prompt.iter().filter(|&&t| t == end_of_turn).count(), 3);
    assert!(model.eos.contains(&end_of_turn), "a turn ends generation");
}

/// The GGUF is Gemma 3's base model, not its instruction-tuned one: asked alone it repeats the
/// question (as llama.cpp's run of it does), but an agent whose prompt shows one exchange gets
/// its answer.
#[test]
fn gemma3_knows_the_capital_of_france() {
    let _serial = serial();
    let engine = engine();
    let messages = [
        ChatMessage::new("user", "What is the capital of Italy?"),
        ChatMessage::new("assistant", "Rome."),
        ChatMessage::new("user", "What is the capital of France?"),
    ];
    let prompt = engine.model().encode_chat(&messages, true).unwrap().tokens;
    let out = collect(
        engine
            .submit(request(&prompt, SamplingParams::greedy(), 3))
            .unwrap(),
    );
    assert!(out.text.starts_with("Paris"), "{:?}", out.text);
    assert_eq!(out.reason, FinishReason::Length);
}

/// A raw text prompt (`/v1/completions`) starts with BOS when the GGUF asks for one, as
/// llama.cpp's server encodes it: Gemma does, SmolLM2 does not.
#[test]
fn raw_text_prompts_start_with_bos_when_the_model_asks() {
    let gemma = engine::ModelInfo::load(&gemma3_path()).unwrap();
    let bos = gemma.tokenizer.token_to_id("<bos>").unwrap();
    assert_eq!(gemma.bos, Some(bos));
    let hello = gemma.encode_text("Hello").unwrap();
    assert_eq!(hello[0], bos);
    assert_eq!(gemma.tokenizer.decode(&hello, false).unwrap(), "<bos>Hello");
    // Written out already, it is not doubled; an empty text stays empty.
    assert_eq!(gemma.encode_text("<bos>Hello").unwrap(), hello);
    assert!(gemma.encode_text("").unwrap().is_empty());
    let smollm = engine::ModelInfo::load(&model_path()).unwrap();
    assert_eq!(smollm.bos, None);
    let ids = smollm.encode_text("Hello").unwrap();
    assert_eq!(smollm.tokenizer.decode(&ids, false).unwrap(), "Hello");
}

//! The Gemma 3 tokenizer (SentencePiece BPE built from the GGUF's vocabulary and scores) against
//! llama.cpp's on the same GGUF.
//!
//! `fixtures/gemma3_tokens.json` (written once by `scripts/llamacpp-tokens.py` with llama.cpp's
//! `llama-server`) holds, for texts that reach every path of the tokenizer (spaces alone and in
//! runs, newlines and tabs, which are whole user-defined tokens; digits; accents, CJK, emoji
//! and characters outside the vocabulary, spelled in byte tokens; control tokens in the text
//! and look-alikes that are not), the ids llama.cpp gives and the text it decodes them to.

use std::path::PathBuf;

use engine::model::tokenizer::{token_bytes, tokenizer_from_gguf};
use engine::model::Gguf;
use serde::Deserialize;
use tokenizers::Tokenizer;

#[derive(Deserialize)]
struct Table {
    texts: Vec<Entry>,
}

#[derive(Deserialize)]
struct Entry {
    text: String,
    tokens: Vec<u32>,
    decoded: String,
}

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn gemma() -> Tokenizer {
    let path = fixture_dir().join("../models/gemma-3-270m-q4_k_m.gguf");
    let gguf = Gguf::open(&path).expect("the Gemma 3 GGUF (run `make models`)");
    tokenizer_from_gguf(gguf.content()).expect("the Gemma 3 tokenizer builds from its GGUF")
}

fn table() -> Table {
    let path = fixture_dir().join("tests/fixtures/gemma3_tokens.json");
    let text = std::fs::read_to_string(&path).expect("the llama.cpp token table");
    serde_json::from_str(&text).expect("the table parses")
}

#[test]
fn encodes_as_llama_cpp_does() {
    let tokenizer = gemma();
    let table = table();
    assert!(table.texts.len() >= 20);
    for entry in &table.texts {
        let ids = tokenizer
            .encode(entry.text.as_str(), false)
            .expect("encodes");
        assert_eq!(ids.get_ids(), entry.tokens.as_slice(), "{:?}", entry.text);
    }
}

#[test]
fn decodes_as_llama_cpp_does_and_round_trips() {
    let tokenizer = gemma();
    for entry in table().texts {
        let decoded = tokenizer.decode(&entry.tokens, false).expect("decodes");
        assert_eq!(decoded, entry.decoded, "{:?}", entry.text);
        assert_eq!(
            decoded, entry.text,
            "llama.cpp's decoding round-trips these texts"
        );
    }
}

#[test]
fn token_bytes_spell_the_text() {
    // A byte token holds part of a character, so its bytes, not its text, add up to the text.
    let tokenizer = gemma();
    for entry in table().texts {
        let bytes: Vec<u8> = entry
            .tokens
            .iter()
            .flat_map(|&id| token_bytes(&tokenizer, id).expect("in the vocabulary"))
            .collect();
        assert_eq!(String::from_utf8(bytes).as_deref(), Ok(entry.text.as_str()));
    }
    assert_eq!(token_bytes(&tokenizer, 248), Some(vec![b'\n']), "<0x0A>");
}

#[test]
fn bos_is_prepended_and_control_tokens_are_special() {
    let tokenizer = gemma();
    let ids = tokenizer.encode("Hello", true).expect("encodes");
    assert_eq!(ids.get_ids(), &[2, 9259], "add_bos_token: <bos> first");
    for (token, id) in [
        ("<start_of_turn>", 105),
        ("<end_of_turn>", 106),
        ("<eos>", 1),
    ] {
        assert_eq!(tokenizer.token_to_id(token), Some(id));
        let text = tokenizer.decode(&[id, 9259], true).expect("decodes");
        assert_eq!(text, "Hello", "skip_special_tokens drops {token}");
    }
}

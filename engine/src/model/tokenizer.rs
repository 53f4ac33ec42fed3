//! Builds a `tokenizers::Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata alone.
//!
//! Supported:
//! - `tokenizer.ggml.model = "gpt2"` (byte-level BPE, SmolLM2), with the pre-tokenizers named in
//!   [`pre_tokenizer`]: no normalizer, a byte-level pre-tokenizer that never adds a prefix space,
//!   a byte-level decoder;
//! - `tokenizer.ggml.model = "llama"` (SentencePiece BPE with byte fallback, Gemma 3): spaces
//!   become `▁`, the whole text is one word, pieces merge best score first (the merges are
//!   derived from `tokenizer.ggml.scores`, see [`merges_from_scores`]) and a character missing
//!   from the vocabulary is spelled in its `<0xXX>` byte tokens, as llama.cpp's SPM tokenizer
//!   does.
//!
//! Both register every control token (`token_type` 3) as a special added token, so that
//! `<|im_start|>` in a prompt encodes to its own id and decoding with `skip_special_tokens` drops
//! it, and every user-defined token (`token_type` 4: Gemma's runs of spaces, newlines and tabs)
//! as an added token matched verbatim in the raw text.
//!
//! Invariants:
//! - token ids are the GGUF's own: token `i` of `tokenizer.ggml.tokens` has id `i`;
//! - an unknown `tokenizer.ggml.model` or `tokenizer.ggml.pre` is an error, never a guess: a
//!   tokenizer that splits text slightly differently from training still "works" but quietly
//!   degrades every generation, which is far worse than refusing to load.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{
    AddedToken, ModelWrapper, PaddingParams, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

use crate::{EngineError, Result};

/// GPT-2's word-splitting regex: contractions, letter runs, digit runs and punctuation runs (each
/// with at most one leading space), then whitespace. `\s+(?!\S)` leaves the last space of a run
/// to the word after it, which is why "a   b" becomes "a", "  ", " b".
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// llama.cpp's `token_type` values (`llama_token_type`) that change how a token is registered.
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Builds the tokenizer described by a GGUF's metadata.
///
/// Fails with [`EngineError::Tokenizer`] when a required key is missing or malformed, or when the
/// tokenizer model or pre-tokenizer is one this module does not implement.
pub fn tokenizer_from_gguf(content: &Content) -> Result<Tokenizer> {
    let model = required_str(content, "tokenizer.ggml.model")?;
    if model != "gpt2" && model != "llama" {
        return Err(EngineError::Tokenizer(format!(
            "tokenizer.ggml.model = {model:?} is not supported (known: \"gpt2\", byte-level \
             BPE; \"llama\", SentencePiece BPE)"
        )));
    }

    let tokens = string_array(content, "tokenizer.ggml.tokens")?;
    let vocab_size = tokens.len();
    let token_types = match content.metadata.get("tokenizer.ggml.token_type") {
        Some(value) => int_array(value, "tokenizer.ggml.token_type")?,
        None => vec![1; vocab_size],
    };
    if token_types.len() != vocab_size {
        return Err(EngineError::Tokenizer(format!(
            "tokenizer.ggml.token_type has {} entries for {vocab_size} tokens",
            token_types.len()
        )));
    }

    let mut vocab = Vocab::with_capacity(vocab_size);
    for (id, token) in tokens.iter().enumerate() {
        let id = u32::try_from(id)
            .map_err(|_| EngineError::Tokenizer(format!("vocabulary of {vocab_size} tokens")))?;
        if let Some(first) = vocab.insert(token.to_string(), id) {
            // A repeated string leaves one of the two ids undecodable; refuse instead.
            return Err(EngineError::Tokenizer(format!(
                "token {token:?} appears twice in tokenizer.ggml.tokens (ids {first} and {id})"
            )));
        }
    }

    let special_id = |key: &str| -> Result<Option<(u32, String)>> {
        match optional_u32(content, key)? {
            None => Ok(None),
            Some(id) => match tokens.get(id as usize) {
                Some(token) => Ok(Some((id, token.to_string()))),
                None => Err(EngineError::Tokenizer(format!(
                    "{key} = {id} is outside the vocabulary of {vocab_size} tokens"
                ))),
            },
        }
    };
    let bos = special_id("tokenizer.ggml.bos_token_id")?;
    let eos = special_id("tokenizer.ggml.eos_token_id")?;
    // Read only to reject a corrupt id; see the BPE below for why it is not used.
    special_id("tokenizer.ggml.unknown_token_id")?;
    let pad = special_id("tokenizer.ggml.padding_token_id")?;

    let mut tokenizer = match model {
        "gpt2" => byte_level_bpe(content, vocab)?,
        _ => sentencepiece_bpe(content, vocab, &tokens, &token_types)?,
    };

    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (token, &kind) in tokens.iter().zip(&token_types) {
        match kind {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(token.to_string(), true)),
            // Stored as plain text; matched verbatim in the raw input (before spaces become
            // `▁`), like a non-special added token.
            TOKEN_TYPE_USER_DEFINED => {
                user_defined.push(AddedToken::from(token.to_string(), false).normalized(false))
            }
            _ => {}
        }
    }
    tokenizer.add_special_tokens(special).map_err(tk)?;
    tokenizer.add_tokens(user_defined).map_err(tk)?;

    let add_bos = adds_bos(content)?;
    let add_eos = optional_bool(content, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let bos = match (add_bos, bos) {
        (false, _) => None,
        (true, Some(bos)) => Some(bos),
        (true, None) => {
            return Err(EngineError::Tokenizer(
                "tokenizer.ggml.add_bos_token is set but bos_token_id is missing".into(),
            ))
        }
    };
    let eos = match (add_eos, eos) {
        (false, _) => None,
        (true, Some(eos)) => Some(eos),
        (true, None) => {
            return Err(EngineError::Tokenizer(
                "tokenizer.ggml.add_eos_token is set but eos_token_id is missing".into(),
            ))
        }
    };
    if let Some(processor) = bos_eos_processor(bos, eos)? {
        tokenizer.with_post_processor(Some(processor));
    }

    if let Some((pad_id, pad_token)) = pad {
        // Batch-longest padding is a no-op for single encodes; it only records the pad token.
        tokenizer.with_padding(Some(PaddingParams {
            pad_id,
            pad_token,
            ..PaddingParams::default()
        }));
    }
    Ok(tokenizer)
}

/// Byte-level BPE (`gpt2`): the GGUF's merges, its pre-tokenizer, bytes mapped to printable
/// characters.
fn byte_level_bpe(content: &Content, vocab: Vocab) -> Result<Tokenizer> {
    let pre = optional_str(content, "tokenizer.ggml.pre")?;
    let merges = string_array(content, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|merge| {
            // Byte-level tokens never contain a space (it is mapped to 'Ġ'), so the first space
            // is the separator.
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    EngineError::Tokenizer(format!(
                        "tokenizer.ggml.merges entry {merge:?} is not two tokens separated by a space"
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    // No unknown token: byte-level BPE only needs one for a byte missing from the vocabulary
    // (SmolLM2 lacks 21 of the 256), and the GGUF's unknown id names `<|endoftext|>`, which
    // would plant a document boundary in the prompt. Such bytes are dropped instead, as
    // llama.cpp does.
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| EngineError::Tokenizer(format!("building the BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// SentencePiece BPE (`llama`): spaces become `▁` (with no prefix space added, as
/// `tokenizer.ggml.add_space_prefix = false` asks; a GGUF asking for one is refused), no
/// pre-tokenizer, merges from the scores, byte fallback.
fn sentencepiece_bpe(
    content: &Content,
    vocab: Vocab,
    tokens: &[&str],
    token_types: &[i64],
) -> Result<Tokenizer> {
    if optional_bool(content, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true) {
        return Err(EngineError::Tokenizer(
            "tokenizer.ggml.add_space_prefix (a space before the text) is not supported".into(),
        ));
    }
    let scores = f32_array(content, "tokenizer.ggml.scores")?;
    if scores.len() != tokens.len() {
        return Err(EngineError::Tokenizer(format!(
            "tokenizer.ggml.scores has {} entries for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let unk = optional_u32(content, "tokenizer.ggml.unknown_token_id")?
        .and_then(|id| tokens.get(id as usize))
        .ok_or_else(|| {
            EngineError::Tokenizer("SentencePiece needs tokenizer.ggml.unknown_token_id".into())
        })?;
    let merges = merges_from_scores(tokens, token_types, &scores);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk.to_string())
        .byte_fallback(true)
        .build()
        .map_err(|e| EngineError::Tokenizer(format!("building the BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_normalizer(Some(Replace::new(" ", SPACE).map_err(tk)?))
        .map_err(tk)?;
    tokenizer.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
        Replace::new(SPACE, " ").map_err(tk)?.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ]))));
    Ok(tokenizer)
}

/// SentencePiece's word-boundary mark, which stands for a space in its pieces.
const SPACE: &str = "\u{2581}";

/// BPE merges equivalent to SentencePiece's scores: a piece is made from every split of it into
/// two pieces of the vocabulary, and merges are applied best-scoring piece first (ties: the
/// vocabulary's order, then the split's pieces' ids), which is what SentencePiece's (and
/// llama.cpp's) tokenizer does when it repeatedly joins the adjacent pair whose join scores
/// best. Only normal pieces (`token_type` 1) are made by merging: control, user-defined and
/// byte tokens are matched whole or are the fallback.
fn merges_from_scores(
    tokens: &[&str],
    token_types: &[i64],
    scores: &[f32],
) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|&(id, _)| token_types[id] == TOKEN_TYPE_NORMAL)
        .map(|(id, &t)| (t, id))
        .collect();
    let mut merges: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if token_types[id] != TOKEN_TYPE_NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                merges.push((scores[id], id, l, r));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    merges
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l].to_string(), tokens[r].to_string()))
        .collect()
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` name: how raw text is cut into words before BPE.
///
/// Each arm lists the splitting steps; the byte-level mapping (without prefix space) is appended
/// to all of them. Supporting another model is one more arm here.
fn pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper> {
    let mut steps: Vec<PreTokenizerWrapper> = match pre {
        // Files converted before `tokenizer.ggml.pre` existed are plain GPT-2.
        None | Some("gpt-2") | Some("gpt2") => vec![regex_split(GPT2_PATTERN)?],
        // SmolLM: every digit is its own word, then GPT-2's regex.
        Some("smollm") => vec![Digits::new(true).into(), regex_split(GPT2_PATTERN)?],
        Some(other) => {
            return Err(EngineError::Tokenizer(format!(
                "tokenizer.ggml.pre = {other:?} is not supported (known: \"gpt-2\", \"smollm\")"
            )))
        }
    };
    // Splitting is done above; this step only maps bytes to BPE's printable alphabet.
    steps.push(ByteLevel::new(false, true, false).into());
    Ok(Sequence::new(steps).into())
}

/// A split step that keeps each regex match as its own word (and the text between matches too).
fn regex_split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| EngineError::Tokenizer(format!("pre-tokenizer regex {pattern:?}: {e}")))?;
    Ok(split.into())
}

/// A post-processor that wraps every encoded sequence in BOS and/or EOS, or `None` when the
/// model wants neither (SmolLM2: its chat template already writes every special token).
fn bos_eos_processor(
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
) -> Result<Option<TemplateProcessing>> {
    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    // Template pieces name entries of `special_tokens` by key, so fixed keys avoid any clash
    // between token text (which may contain ':' or spaces) and the template syntax.
    let mut special_tokens = Vec::new();
    let (mut single, mut pair_a, mut pair_b) = (Vec::new(), Vec::new(), Vec::new());
    if let Some((id, token)) = bos {
        special_tokens.push(SpecialToken::new("bos".into(), vec![id], vec![token]).map_err(tk)?);
        single.push("bos");
        pair_a.push("bos");
        pair_b.push("bos:1");
    }
    single.push("$A");
    pair_a.push("$A");
    pair_b.push("$B:1");
    if let Some((id, token)) = eos {
        special_tokens.push(SpecialToken::new("eos".into(), vec![id], vec![token]).map_err(tk)?);
        single.push("eos");
        pair_a.push("eos");
        pair_b.push("eos:1");
    }
    pair_a.extend(pair_b);
    let processor = TemplateProcessing::builder()
        .try_single(single.join(" "))
        .map_err(|e| EngineError::Tokenizer(format!("bos/eos template: {e}")))?
        .try_pair(pair_a.join(" "))
        .map_err(|e| EngineError::Tokenizer(format!("bos/eos template: {e}")))?
        .special_tokens(special_tokens)
        .build()
        .map_err(|e| EngineError::Tokenizer(format!("bos/eos template: {e}")))?;
    Ok(Some(processor))
}

/// The raw bytes one token stands for, as OpenAI's logprobs report them: a token may hold only
/// part of a UTF-8 character, so its text alone cannot say which bytes it adds. Added tokens
/// (control tokens such as `<|im_end|>`) are their own text. `None` for an id outside the
/// vocabulary.
pub fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Option<Vec<u8>> {
    // The borrowed map: `Tokenizer::get_added_tokens_decoder` clones it, per call.
    let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
    if let Some(added) = added.get(&id) {
        return Some(added.content.clone().into_bytes());
    }
    let token = tokenizer.id_to_token(id)?;
    if let ModelWrapper::BPE(bpe) = tokenizer.get_model() {
        if bpe.byte_fallback {
            return Some(sentencepiece_bytes(&token));
        }
    }
    let table = unicode_to_byte();
    // Every char of a byte-level token is in the table; a foreign one is kept as its UTF-8
    // rather than dropped, so the bytes still spell what the vocabulary says.
    let mut bytes = Vec::with_capacity(token.len());
    for c in token.chars() {
        match table.get(&c) {
            Some(&b) => bytes.push(b),
            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    Some(bytes)
}

/// A SentencePiece piece's bytes: a byte token (`<0x0A>`) is its byte, any other piece its text
/// with `▁` read as a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    let byte = piece
        .strip_prefix("<0x")
        .and_then(|rest| rest.strip_suffix('>'))
        .filter(|hex| hex.len() == 2)
        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
    match byte {
        Some(b) => vec![b],
        None => piece.replace(SPACE, " ").into_bytes(),
    }
}

/// The inverse of GPT-2's byte-to-character table: printable Latin-1 bytes stand for
/// themselves; the other 68 bytes are shifted, in order, to the characters from U+0100 on.
fn unicode_to_byte() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<char, u8>> =
        std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut shifted = 0u32;
        (0..=255u8)
            .map(|b| {
                let c = if printable(b) {
                    char::from(b)
                } else {
                    shifted += 1;
                    char::from_u32(255 + shifted).expect("U+0100..U+0143 are chars")
                };
                (c, b)
            })
            .collect()
    })
}

fn tk(e: tokenizers::Error) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

fn required_str<'a>(content: &'a Content, key: &str) -> Result<&'a str> {
    optional_str(content, key)?.ok_or_else(|| EngineError::Tokenizer(format!("GGUF has no {key}")))
}

fn optional_str<'a>(content: &'a Content, key: &str) -> Result<Option<&'a str>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(key, "a string", other)),
    }
}

/// Whether the model wants BOS in front of what it encodes (`tokenizer.ggml.add_bos_token`).
pub(crate) fn adds_bos(content: &Content) -> Result<bool> {
    Ok(optional_bool(content, "tokenizer.ggml.add_bos_token")?.unwrap_or(false))
}

fn optional_bool(content: &Content, key: &str) -> Result<Option<bool>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(key, "a bool", other)),
    }
}

fn optional_u32(content: &Content, key: &str) -> Result<Option<u32>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(value) => {
            let n = as_int(value).ok_or_else(|| wrong_type(key, "an integer", value))?;
            u32::try_from(n)
                .map(Some)
                .map_err(|_| EngineError::Tokenizer(format!("{key} = {n} is not a token id")))
        }
    }
}

fn string_array<'a>(content: &'a Content, key: &str) -> Result<Vec<&'a str>> {
    array(content, key, "an array of strings", |item| match item {
        Value::String(s) => Some(s.as_str()),
        _ => None,
    })
}

fn f32_array(content: &Content, key: &str) -> Result<Vec<f32>> {
    array(content, key, "an array of f32", |item| match item {
        Value::F32(x) => Some(*x),
        _ => None,
    })
}

/// The array at `key`, each item read by `read` (`None`: not `what`).
fn array<'a, T>(
    content: &'a Content,
    key: &str,
    what: &str,
    read: impl Fn(&'a Value) -> Option<T>,
) -> Result<Vec<T>> {
    let value = content
        .metadata
        .get(key)
        .ok_or_else(|| EngineError::Tokenizer(format!("GGUF has no {key}")))?;
    let Value::Array(items) = value else {
        return Err(wrong_type(key, what, value));
    };
    items
        .iter()
        .map(|item| read(item).ok_or_else(|| wrong_type(key, what, item)))
        .collect()
}

fn int_array(value: &Value, key: &str) -> Result<Vec<i64>> {
    let Value::Array(items) = value else {
        return Err(wrong_type(key, "an array of integers", value));
    };
    items
        .iter()
        .map(|item| as_int(item).ok_or_else(|| wrong_type(key, "an array of integers", item)))
        .collect()
}

/// Any GGUF integer type: writers differ in which width they pick for ids and token types.
fn as_int(value: &Value) -> Option<i64> {
    match *value {
        Value::U8(v) => Some(v.into()),
        Value::I8(v) => Some(v.into()),
        Value::U16(v) => Some(v.into()),
        Value::I16(v) => Some(v.into()),
        Value::U32(v) => Some(v.into()),
        Value::I32(v) => Some(v.into()),
        Value::U64(v) => i64::try_from(v).ok(),
        Value::I64(v) => Some(v),
        _ => None,
    }
}

fn wrong_type(key: &str, expected: &str, found: &Value) -> EngineError {
    EngineError::Tokenizer(format!(
        "{key} should be {expected}, found {:?}",
        found.value_type()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{encode, read_smollm2_content, smollm2_tokenizer};

    fn id(token: &str) -> u32 {
        smollm2_tokenizer()
            .token_to_id(token)
            .unwrap_or_else(|| panic!("{token:?} is in the vocabulary"))
    }

    fn build_err(edit: impl FnOnce(&mut Content)) -> String {
        let mut content = read_smollm2_content();
        edit(&mut content);
        match tokenizer_from_gguf(&content) {
            Err(EngineError::Tokenizer(message)) => message,
            Err(other) => panic!("expected a tokenizer error, got {other}"),
            Ok(_) => panic!("expected the edited metadata to be rejected"),
        }
    }

    #[test]
    fn vocabulary_and_control_tokens() {
        let tokenizer = smollm2_tokenizer();
        assert_eq!(tokenizer.get_vocab_size(true), 49152);
        assert_eq!(tokenizer.get_vocab_size(false), 49152);
        assert_eq!(tokenizer.token_to_id("<|endoftext|>"), Some(0));
        assert_eq!(tokenizer.token_to_id("<|im_start|>"), Some(1));
        assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(2));
        let specials: Vec<u32> = tokenizer
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(&id, _)| id)
            .collect();
        // SmolLM2 marks exactly ids 0..=16 as control tokens.
        assert_eq!(specials.len(), 17);
        assert!(specials.iter().all(|&id| id <= 16));
        let padding = tokenizer.get_padding().expect("pad id recorded");
        assert_eq!(
            (padding.pad_id, padding.pad_token.as_str()),
            (2, "<|im_end|>")
        );
    }

    #[test]
    fn token_bytes_undo_the_byte_level_mapping() {
        let tokenizer = smollm2_tokenizer();
        assert_eq!(token_bytes(&tokenizer, id("Ġworld")).unwrap(), b" world");
        assert_eq!(token_bytes(&tokenizer, id("Hello")).unwrap(), b"Hello");
        assert_eq!(token_bytes(&tokenizer, 2).unwrap(), b"<|im_end|>");
        assert_eq!(token_bytes(&tokenizer, 1 << 30), None);
        // Every token's bytes, concatenated, give back the text, even where a token splits a
        // character.
        for text in ["Crème brûlée", "日本語", "🙂👍🏽 ☕"] {
            let bytes: Vec<u8> = encode(text)
                .into_iter()
                .flat_map(|t| token_bytes(&tokenizer, t).unwrap())
                .collect();
            assert_eq!(bytes, text.as_bytes());
        }
        let newline = encode("\n");
        assert_eq!(newline.len(), 1);
        assert_eq!(token_bytes(&tokenizer, newline[0]).unwrap(), b"\n");
    }

    #[test]
    fn known_encodings() {
        assert_eq!(encode("Hello world"), vec![id("Hello"), id("Ġworld")]);
        // No prefix space: the first word is not "ĠHello".
        assert_ne!(id("Hello"), id("ĠHello"));
        assert_eq!(encode("Hello"), vec![id("Hello")]);
        assert_eq!(encode(" Hello"), vec![id("ĠHello")]);
        // GPT-2's `\s+(?!\S)`: a run of spaces gives its last space to the next word.
        assert_eq!(encode("a   b"), vec![id("a"), id("ĠĠ"), id("Ġb")]);
    }

    #[test]
    fn digits_are_split_one_by_one() {
        let digits: Vec<u32> = "12345".chars().map(|c| id(&c.to_string())).collect();
        assert_eq!(encode("12345"), digits);
        let ids = encode("in 2024 we");
        assert_eq!(
            ids,
            vec![
                id("in"),
                id("Ġ"),
                id("2"),
                id("0"),
                id("2"),
                id("4"),
                id("Ġwe")
            ]
        );
    }

    #[test]
    fn round_trips() {
        let tokenizer = smollm2_tokenizer();
        let samples = [
            "The quick brown fox jumps over the lazy dog.",
            "Crème brûlée, naïve café, Ærøskøbing, Łódź, Straße",
            "日本語のテキストと中文文本，还有한국어.",
            "Emoji: 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and ☕",
            "fn main() {\n\tlet x = vec![1, 2, 3];\n\tif x.len() > 2 {\n\t\tprintln!(\"{x:?}\");\n\t}\n}\n",
            "def f(a):\n    return a  *  2    # trailing   \n\n\n",
            "   leading and trailing spaces   ",
            "\n\nnewlines\r\n\r\nand\ttabs\t\t",
            "12345 + 678.90 = 3.14159e10",
            "it's they're we've I'm you'll he'd",
            "",
        ];
        for text in samples {
            let ids = encode(text);
            let decoded = tokenizer.decode(&ids, true).expect("decodes");
            assert_eq!(decoded, text, "round trip of {text:?} via {ids:?}");
        }
    }

    #[test]
    fn bytes_missing_from_the_vocabulary_are_dropped() {
        // U+0004 and the lead byte 0xF1 of U+40000 have no byte token in SmolLM2.
        assert_eq!(smollm2_tokenizer().token_to_id("Ą"), None);
        assert_eq!(smollm2_tokenizer().token_to_id("ñ"), None);
        let ids = encode("a\u{4}b");
        assert_eq!(ids, [id("a"), id("b")]);
        let ids = encode("x\u{40000}");
        assert!(!ids.contains(&0), "never <|endoftext|>: {ids:?}");
        // Its three continuation bytes survive, and decode as invalid UTF-8.
        let decoded = smollm2_tokenizer().decode(&ids, true).unwrap();
        assert_eq!(decoded, "x\u{FFFD}\u{FFFD}\u{FFFD}");
    }

    #[test]
    fn control_tokens_inside_text_stay_whole() {
        let tokenizer = smollm2_tokenizer();
        let text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n";
        let ids = encode(text);
        assert_eq!(ids[0], 1);
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 2);
        assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
        assert_eq!(encode("<|im_start|>"), vec![1]);
        assert_eq!(encode("<|im_end|>"), vec![2]);
        assert_eq!(encode("x<|im_end|>y"), vec![id("x"), 2, id("y")]);
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
        assert_eq!(
            tokenizer.decode(&ids, true).unwrap(),
            "user\nHi there\nassistant\n"
        );
    }

    #[test]
    fn add_bos_token_prepends_bos() {
        let mut content = read_smollm2_content();
        content
            .metadata
            .insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        let tokenizer = tokenizer_from_gguf(&content).unwrap();
        let ids = tokenizer.encode("Hello", true).unwrap().get_ids().to_vec();
        assert_eq!(ids, vec![1, id("Hello")]);
        // Callers that render a chat template ask for no extra tokens.
        let ids = tokenizer.encode("Hello", false).unwrap().get_ids().to_vec();
        assert_eq!(ids, vec![id("Hello")]);
    }

    #[test]
    fn unsupported_model_is_rejected() {
        let message = build_err(|c| {
            c.metadata
                .insert("tokenizer.ggml.model".into(), Value::String("t5".into()));
        });
        assert!(message.contains("\"t5\""), "{message}");
    }

    #[test]
    fn sentencepiece_needs_its_scores() {
        // SmolLM2's metadata called SentencePiece: it has no scores to merge by.
        let message = build_err(|c| {
            c.metadata
                .insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
            c.metadata
                .insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
        });
        assert!(message.contains("tokenizer.ggml.scores"), "{message}");
        let message = build_err(|c| {
            c.metadata
                .insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
            c.metadata
                .insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(true));
        });
        assert!(message.contains("add_space_prefix"), "{message}");
    }

    #[test]
    fn merges_follow_the_scores() {
        // "ab" scores better than "bc": in "abc" the pair (a, b) merges first.
        let tokens = ["a", "b", "c", "ab", "bc", "abc", "<ctl>"];
        let types = [1, 1, 1, 1, 1, 1, 3];
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, 0.0];
        let merges = merges_from_scores(&tokens, &types, &scores);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(l, r)| (l.as_str(), r.as_str()))
            .collect();
        assert_eq!(pairs, [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]);
    }

    #[test]
    fn unsupported_pre_tokenizer_is_rejected() {
        let message = build_err(|c| {
            c.metadata
                .insert("tokenizer.ggml.pre".into(), Value::String("qwen2".into()));
        });
        assert!(message.contains("\"qwen2\""), "{message}");
    }

    /// The words a pre-tokenizer cuts `text` into, in the byte-level alphabet.
    fn words(pre: Option<&str>, text: &str) -> Vec<String> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut pretokenized = PreTokenizedString::from(text);
        pre_tokenizer(pre)
            .unwrap()
            .pre_tokenize(&mut pretokenized)
            .unwrap();
        pretokenized
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(word, _, _)| word.to_string())
            .collect()
    }

    #[test]
    fn pre_tokenizers_split_words() {
        assert_eq!(
            words(Some("smollm"), "ab 123 é!"),
            ["ab", "Ġ", "1", "2", "3", "ĠÃ©", "!"]
        );
        // Plain GPT-2 keeps digit runs, and a missing name means plain GPT-2.
        assert_eq!(
            words(Some("gpt-2"), "ab 123 é!"),
            ["ab", "Ġ123", "ĠÃ©", "!"]
        );
        assert_eq!(words(None, "ab 123"), ["ab", "Ġ123"]);
        // Only a space (not a tab) may lead a word; the whitespace run keeps all but the last.
        assert_eq!(words(Some("gpt-2"), "x  \n\ty"), ["x", "ĠĠĊ", "ĉ", "y"]);
    }

    #[test]
    fn malformed_metadata_is_rejected() {
        let message = build_err(|c| {
            c.metadata.remove("tokenizer.ggml.merges");
        });
        assert!(message.contains("tokenizer.ggml.merges"), "{message}");

        let message = build_err(|c| {
            c.metadata.insert(
                "tokenizer.ggml.merges".into(),
                Value::Array(vec![Value::String("nospace".into())]),
            );
        });
        assert!(message.contains("nospace"), "{message}");

        let message = build_err(|c| {
            c.metadata
                .insert("tokenizer.ggml.eos_token_id".into(), Value::U32(60_000));
        });
        assert!(message.contains("60000"), "{message}");

        let message = build_err(|c| {
            c.metadata
                .insert("tokenizer.ggml.token_type".into(), Value::Array(vec![]));
        });
        assert!(message.contains("token_type"), "{message}");
    }
}

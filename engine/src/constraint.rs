//! Constrained decoding: the output must match a grammar (a JSON schema, JSON mode, or a Lark
//! grammar), enforced token by token with [llguidance].
//!
//! [`Grammars`] is built once per model from its tokenizer: llguidance's vocabulary trie (every
//! token's bytes; control tokens are marked special so that no grammar text can produce them)
//! and a parser factory. [`Grammars::compile`] turns a [`ResponseFormat`] into a [`Constraint`]
//! for one sequence. Compiled grammars are cached by the SHA-256 of the format, least recently
//! used dropped past [`CACHE_ENTRIES`]: the many requests of an agent that share a schema
//! compile it once, and each gets a deep clone of the compiled parser.
//!
//! Compilation happens where a request is submitted, never on the engine loop: a slow schema
//! delays only its own request. The loop only advances parsers and computes masks.
//!
//! Cost per token (see [`crate::sampler`]): the sampler first checks the token it would choose
//! anyway (one parser step); only when that token is refused does it compute the full mask (a
//! walk of the vocabulary trie, typically tens to hundreds of microseconds), so a model that
//! follows its instructions pays almost nothing for the guarantee.
//!
//! JSON is generated compactly (`", "` and `": "` as separators, no other whitespace): a small
//! model allowed free whitespace tends to pad an answer with newlines until it runs out of
//! tokens.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use crate::request::ResponseFormat;

/// Compiled grammars kept for reuse.
pub const CACHE_ENTRIES: usize = 256;

/// Why a grammar could not be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// The JSON options every schema is compiled with unless it sets its own `x-guidance`.
fn compact_json(lenient: bool) -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
    })
}

/// `schema` with the compile options of [`compact_json`] (a schema's own `x-guidance` wins).
/// `lenient`: keywords llguidance cannot enforce are dropped with a warning instead of failing.
pub fn with_json_options(mut schema: Value, lenient: bool) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| compact_json(lenient));
    }
    schema
}

/// The Lark directive that embeds a JSON schema in a grammar, with compact output.
pub fn lark_json(schema: &Value, lenient: bool) -> String {
    format!("%json {}", with_json_options(schema.clone(), lenient))
}

/// The vocabulary as llguidance sees it, tokenizing with the model's own tokenizer.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl toktrie::TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Text the grammar forces is UTF-8 except mid-character; the trie's greedy split is the
        // fallback there.
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false) {
                Ok(encoding) => encoding.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The grammar compiler of one model, with its cache. Shared by every submitter.
pub struct Grammars {
    factory: ParserFactory,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<[u8; 32], (TokenParser, u64)>,
    clock: u64,
}

impl Grammars {
    /// Builds the vocabulary trie of `tokenizer`; `eos` ends a constrained answer. `vocab_size`
    /// is the model's (its logits' width), which may exceed the tokenizer's.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        eos: u32,
        vocab_size: usize,
    ) -> Result<Self, GrammarError> {
        let vocab_size = vocab_size.max(tokenizer.get_vocab_size(true));
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match added.get(&id) {
                // Marked special: only a grammar naming it could produce it. (Added tokens
                // that are plain text, Gemma's runs of newlines or spaces, are text here too.)
                Some(added) if added.special => {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER], added.content.as_bytes()].concat()
                }
                _ => crate::model::tokenizer::token_bytes(&tokenizer, id)
                    .unwrap_or_else(|| format!("\u{ff}<[{id}]>").into_bytes()),
            })
            .collect();
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// The constraint for `format`; `None` for free text.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Option<Constraint>, GrammarError> {
        let grammar = match format {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject => TopLevelGrammar::from_json_schema(with_json_options(
                json!({"type": "object"}),
                false,
            )),
            ResponseFormat::JsonSchema { schema, strict } => {
                TopLevelGrammar::from_json_schema(with_json_options(schema.clone(), !strict))
            }
            ResponseFormat::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        };
        let key: [u8; 32] =
            Sha256::digest(serde_json::to_vec(format).map_err(|e| GrammarError(e.to_string()))?)
                .into();
        let cached = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.clock += 1;
            let now = cache.clock;
            cache.entries.get_mut(&key).map(|(parser, used)| {
                *used = now;
                parser.deep_clone()
            })
        };
        let parser = match cached {
            Some(parser) => parser,
            None => {
                let parser = self
                    .factory
                    .create_parser(grammar)
                    .map_err(|e| GrammarError(e.to_string()))?;
                self.remember(key, parser.deep_clone());
                parser
            }
        };
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(GrammarError(error));
        }
        let warnings = matcher.grammar_warnings();
        Ok(Some(Constraint { matcher, warnings }))
    }

    fn remember(&self, key: [u8; 32], parser: TokenParser) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.entries.len() >= CACHE_ENTRIES {
            let oldest = cache
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                cache.entries.remove(&oldest);
            }
        }
        cache.clock += 1;
        let now = cache.clock;
        cache.entries.insert(key, (parser, now));
    }

    /// Grammars compiled and kept.
    pub fn cached(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entries
            .len()
    }
}

/// One sequence's grammar state: which tokens may come next.
pub struct Constraint {
    matcher: Matcher,
    warnings: Vec<String>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// What the compiler dropped from a lenient schema.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Whether `token` may come next (the end-of-sequence token once the grammar is complete).
    pub fn allows(&mut self, token: u32) -> bool {
        self.matcher.validate_tokens(&[token]).is_ok_and(|n| n == 1)
    }

    /// Masks out of `logits` every token that may not come next. Fails when the grammar is in
    /// error (nothing may come).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError(e.to_string()))?;
        for (t, l) in logits.iter_mut().enumerate() {
            if !(t < mask.len() && mask.is_allowed(t as u32)) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Records that `token` was chosen.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError(e.to_string()))
    }

    /// The grammar is complete and admits nothing more: the sequence must end.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Takes the tokens the grammar forces next, whatever the model would prefer (at most
    /// `max`): they are consumed here as if sampled. Empty when nothing is forced, or when
    /// consuming them failed (the next mask then reports the error).
    pub fn fast_forward(&mut self, max: usize) -> Vec<u32> {
        let mut tokens = self.matcher.compute_ff_tokens();
        tokens.truncate(max);
        if tokens.is_empty() || self.matcher.consume_tokens(&tokens).is_err() {
            return Vec::new();
        }
        tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{model_path, SMOLLM2_GGUF};

    fn grammars() -> &'static (Grammars, Arc<Tokenizer>) {
        static G: std::sync::OnceLock<(Grammars, Arc<Tokenizer>)> = std::sync::OnceLock::new();
        G.get_or_init(|| {
            let info = crate::ModelInfo::load(&model_path(SMOLLM2_GGUF)).expect("model metadata");
            (
                Grammars::new(info.tokenizer.clone(), info.eos[0], 0).expect("grammars"),
                info.tokenizer.clone(),
            )
        })
    }

    /// Feeds `text`'s tokens; returns whether every one was allowed, then whether EOS may come.
    fn run(format: &ResponseFormat, text: &str) -> (bool, bool) {
        let (g, tok) = grammars();
        let mut c = g.compile(format).unwrap().expect("a constraint");
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        for t in ids {
            if !c.allows(t) {
                return (false, false);
            }
            c.accept(t).unwrap();
        }
        let eos = g.factory.tok_env().tok_trie().eos_token();
        (true, c.is_done() || c.allows(eos))
    }

    #[test]
    fn json_mode_takes_compact_objects_only() {
        assert_eq!(
            run(&ResponseFormat::JsonObject, r#"{"a": [1, "x"], "b": null}"#),
            (true, true)
        );
        assert_eq!(
            run(&ResponseFormat::JsonObject, r#"{"a": 1"#),
            (true, false)
        );
        assert!(!run(&ResponseFormat::JsonObject, "[1]").0);
        assert!(
            !run(&ResponseFormat::JsonObject, "{\n").0,
            "no free whitespace"
        );
    }

    #[test]
    fn schemas_are_enforced_and_unknown_keywords_refused_when_strict() {
        let schema = json!({
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": false
        });
        let strict = ResponseFormat::JsonSchema {
            schema: schema.clone(),
            strict: true,
        };
        assert_eq!(run(&strict, r#"{"n": 7}"#), (true, true));
        assert!(!run(&strict, r#"{"n": 12}"#).0);
        assert!(!run(&strict, r#"{"m": 1}"#).0);
        let mut odd = schema;
        odd["not"] = json!({"type": "string"});
        let (g, _) = grammars();
        let error = g
            .compile(&ResponseFormat::JsonSchema {
                schema: odd.clone(),
                strict: true,
            })
            .unwrap_err();
        assert!(error.0.contains("not"), "{error}");
        let lenient = g
            .compile(&ResponseFormat::JsonSchema {
                schema: odd,
                strict: false,
            })
            .unwrap()
            .unwrap();
        assert!(lenient.warnings().iter().any(|w| w.contains("not")));
    }

    #[test]
    fn control_tokens_never_satisfy_a_grammar() {
        let (g, tok) = grammars();
        let lark = ResponseFormat::Lark(r#"start: "<|im_end|>" | "x""#.into());
        let mut c = g.compile(&lark).unwrap().unwrap();
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        assert!(
            !c.allows(im_end),
            "the marker's text, not the control token"
        );
    }

    #[test]
    fn compiled_grammars_are_cached_by_content() {
        // A compiler of its own: the tests running beside it compile into the shared one's
        // cache at any moment.
        let info = crate::ModelInfo::load(&model_path(SMOLLM2_GGUF)).expect("model metadata");
        let g = Grammars::new(info.tokenizer.clone(), info.eos[0], 0).expect("grammars");
        let format = ResponseFormat::JsonSchema {
            schema: json!({"type": "object", "properties": {"cache_probe": {"type": "boolean"}}}),
            strict: true,
        };
        let before = g.cached();
        g.compile(&format).unwrap();
        g.compile(&format).unwrap();
        assert_eq!(g.cached(), before + 1);
    }

    #[test]
    fn a_malformed_grammar_is_an_error() {
        let (g, _) = grammars();
        for format in [
            ResponseFormat::JsonSchema {
                schema: json!({"type": 5}),
                strict: true,
            },
            ResponseFormat::Lark("start: (".into()),
        ] {
            assert!(g.compile(&format).is_err(), "{format:?}");
        }
    }
}

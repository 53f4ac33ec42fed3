//! Turns the engine's per-token log-probabilities (token ids) into OpenAI's chat `logprobs`
//! entries (token text, raw bytes, alternatives), or into the legacy completions' parallel
//! arrays ([`Legacy`]).
//!
//! A token may hold only part of a UTF-8 character; its `bytes` are exact (from the tokenizer's
//! byte-level table) and its `token` text is those bytes decoded lossily, which is what a client
//! that prints tokens wants. Log-probabilities that are not finite (a token the sampler ruled
//! out) become -9999, OpenAI's stand-in, because JSON has no `-Infinity`.

use engine::model::tokenizer::token_bytes;
use tokenizers::Tokenizer;

use std::collections::BTreeMap;

use crate::api;
use crate::api::completions::CompletionLogprobs;

/// OpenAI's value for "impossible".
const FLOOR: f32 = -9999.0;

/// The wire entries for `logprobs`, in order.
pub fn to_wire(tokenizer: &Tokenizer, logprobs: &[engine::TokenLogprob]) -> Vec<api::TokenLogprob> {
    logprobs
        .iter()
        .map(|lp| {
            let (token, bytes) = describe(tokenizer, lp.token);
            api::TokenLogprob {
                token,
                logprob: finite(lp.logprob),
                bytes,
                top_logprobs: lp
                    .top
                    .iter()
                    .map(|&(id, logprob)| {
                        let (token, bytes) = describe(tokenizer, id);
                        api::TopLogprob {
                            token,
                            logprob: finite(logprob),
                            bytes,
                        }
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Builds a choice's legacy `logprobs` token by token, keeping each token's text offset.
pub struct Legacy<'a> {
    tokenizer: &'a Tokenizer,
    /// Characters of the choice's text so far.
    offset: usize,
}

impl<'a> Legacy<'a> {
    /// For a choice whose text starts `offset` characters in.
    pub fn new(tokenizer: &'a Tokenizer, offset: usize) -> Self {
        Self { tokenizer, offset }
    }

    /// The characters covered so far.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Appends `logprobs` to `out`.
    pub fn extend(&mut self, out: &mut CompletionLogprobs, logprobs: &[engine::TokenLogprob]) {
        for lp in logprobs {
            let (token, _) = describe(self.tokenizer, lp.token);
            let top = lp
                .top
                .iter()
                .map(|&(id, logprob)| (describe(self.tokenizer, id).0, finite(logprob)))
                .collect();
            self.push(out, token, Some((finite(lp.logprob), top)));
        }
    }

    /// Appends an echoed prompt's first token, which nothing predicts; `in_text`: whether it
    /// takes characters of the text (a BOS the encoding added does not).
    pub fn push_unscored(&mut self, out: &mut CompletionLogprobs, token: u32, in_text: bool) {
        let (token, _) = describe(self.tokenizer, token);
        let offset = self.offset;
        self.push(out, token, None);
        if !in_text {
            self.offset = offset;
        }
    }

    fn push(
        &mut self,
        out: &mut CompletionLogprobs,
        token: String,
        scored: Option<(f32, BTreeMap<String, f32>)>,
    ) {
        out.text_offset.push(self.offset);
        self.offset += token.chars().count();
        out.tokens.push(token);
        let (logprob, top) = scored.unzip();
        out.token_logprobs.push(logprob);
        out.top_logprobs.push(top);
    }
}

fn describe(tokenizer: &Tokenizer, id: u32) -> (String, Option<Vec<u8>>) {
    match token_bytes(tokenizer, id) {
        Some(bytes) => (String::from_utf8_lossy(&bytes).into_owned(), Some(bytes)),
        // The engine only samples ids of its own vocabulary; should one slip through, the client
        // still gets a well-formed entry.
        None => (String::new(), None),
    }
}

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        FLOOR
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;
    use crate::test_support::model_info;

    fn tokenizer() -> &'static Tokenizer {
        static MODEL: OnceLock<engine::ModelInfo> = OnceLock::new();
        &MODEL.get_or_init(|| model_info(8192)).tokenizer
    }

    fn id(text: &str) -> u32 {
        let ids = tokenizer().encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids.len(), 1, "{text:?} is one token");
        ids[0]
    }

    #[test]
    fn tokens_carry_text_bytes_and_alternatives() {
        let paris = id(" Paris");
        let london = id(" London");
        let wire = to_wire(
            tokenizer(),
            &[engine::TokenLogprob {
                token: paris,
                logprob: -0.25,
                top: vec![(paris, -0.25), (london, f32::NEG_INFINITY)],
                scored: Vec::new(),
            }],
        );
        assert_eq!(
            wire,
            vec![api::TokenLogprob {
                token: " Paris".into(),
                logprob: -0.25,
                bytes: Some(b" Paris".to_vec()),
                top_logprobs: vec![
                    api::TopLogprob {
                        token: " Paris".into(),
                        logprob: -0.25,
                        bytes: Some(b" Paris".to_vec()),
                    },
                    api::TopLogprob {
                        token: " London".into(),
                        logprob: FLOOR,
                        bytes: Some(b" London".to_vec()),
                    },
                ],
            }]
        );
    }

    #[test]
    fn partial_characters_keep_exact_bytes() {
        let ids = tokenizer().encode("🙂", false).unwrap().get_ids().to_vec();
        let logprobs: Vec<_> = ids
            .iter()
            .map(|&token| engine::TokenLogprob {
                token,
                logprob: -1.0,
                top: Vec::new(),
                scored: Vec::new(),
            })
            .collect();
        let bytes: Vec<u8> = to_wire(tokenizer(), &logprobs)
            .into_iter()
            .flat_map(|t| t.bytes.unwrap())
            .collect();
        assert_eq!(bytes, "🙂".as_bytes());
    }

    #[test]
    fn legacy_arrays_run_in_parallel_with_offsets() {
        let (paris, london) = (id(" Paris"), id(" London"));
        let mut out = CompletionLogprobs::default();
        let mut legacy = Legacy::new(tokenizer(), 3);
        legacy.push_unscored(&mut out, london, true);
        legacy.extend(
            &mut out,
            &[engine::TokenLogprob {
                token: paris,
                logprob: -0.25,
                top: vec![(paris, -0.25), (london, f32::NEG_INFINITY)],
                scored: Vec::new(),
            }],
        );
        assert_eq!(out.tokens, [" London", " Paris"]);
        assert_eq!(out.token_logprobs, [None, Some(-0.25)]);
        assert_eq!(out.text_offset, [3, 10]);
        assert_eq!(legacy.offset(), 16);
        assert_eq!(out.top_logprobs[0], None);
        let top = out.top_logprobs[1].as_ref().unwrap();
        assert_eq!((top[" Paris"], top[" London"]), (-0.25, FLOOR));
        // A first token that is not in the echoed text (a BOS the encoding added) is listed
        // and takes no characters.
        let mut out = CompletionLogprobs::default();
        let mut legacy = Legacy::new(tokenizer(), 0);
        legacy.push_unscored(&mut out, london, false);
        assert_eq!((out.tokens[0].as_str(), out.text_offset[0]), (" London", 0));
        assert_eq!(legacy.offset(), 0);
    }
}

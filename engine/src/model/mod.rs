//! Everything read from a model file: the llama forward over a ragged batch and its kernels, and
//! the text side (tokenizer, chat template, chat prompts as ids) built from GGUF metadata alone,
//! so that no `tokenizer.json` has to sit beside it. Apart from those, [`bert`] is the sentence-embedding
//! model, read from a sentence-transformers directory, with its f32 encoder (`bert_encoder`)
//! and that encoder's dense products (`dense`).

pub mod attention;
pub mod bert;
mod bert_encoder;
pub mod chat_prompt;
pub mod chat_template;
mod dense;
mod fused;
pub mod gguf;
pub mod linear;
pub mod llama;
mod paged_kernel;
mod super_blocks;
pub mod tokenizer;

pub use attention::{DecodeAttention, SeqSlice};
pub use bert::SentenceBert;
pub use gguf::Gguf;
pub use llama::{Backend, DeviceWeights, Llama, LlamaConfig};

use crate::kv_cache::BlockId;

/// Which of a sequence's tokens in a batch get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: a prefill chunk that stops short of the sequence's end.
    None,
    /// The last token's, to sample the next token from.
    Last,
    /// Every token's: to score each against the token after it (prompt log-probabilities), the
    /// last row still the one to sample from; or to sample after each token of a decode step's
    /// draft.
    Every,
}

impl Logits {
    /// How many rows a chunk of `len` tokens contributes.
    pub fn rows(self, len: usize) -> usize {
        match self {
            Self::None => 0,
            Self::Last => 1,
            Self::Every => len,
        }
    }
}

/// The input of one forward pass: the tokens of several sequences, concatenated.
#[derive(Clone, Debug, Default)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// The sequences, once per layer group of the cache, with that group's blocks:
    /// `seqs[group][sequence]`.
    pub seqs: Vec<Vec<SeqSlice>>,
    /// Rows (indices into `tokens`) whose logits are wanted, in output order.
    pub logits_rows: Vec<u32>,
}

impl ForwardBatch {
    /// Appends a sequence's next `tokens`, the first at position `pos0`. `tables` are its
    /// blocks, a table for each layer group the cache keeps apart (one for all layers keeps
    /// them together; every sequence of a batch has as many), each covering every position up
    /// to `pos0 + tokens.len()`. `logits` says which of its rows come back.
    pub fn push(&mut self, tokens: &[u32], pos0: usize, tables: Vec<Vec<BlockId>>, logits: Logits) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((pos0..pos0 + tokens.len()).map(|p| p as u32));
        self.seqs
            .resize(tables.len().max(self.seqs.len()), Vec::new());
        for (seqs, blocks) in self.seqs.iter_mut().zip(tables) {
            seqs.push(SeqSlice {
                start,
                len: tokens.len(),
                pos0,
                blocks,
            });
        }
        let end = start + tokens.len();
        let rows = end - logits.rows(tokens.len())..end;
        self.logits_rows.extend(rows.map(|r| r as u32));
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

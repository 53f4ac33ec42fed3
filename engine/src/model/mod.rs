//! Everything read from a model file: the llama forward over a ragged batch and its kernels, and
//! the text side (tokenizer, chat template) built from GGUF metadata alone, so that no
//! `tokenizer.json` has to sit beside it. Apart from those, [`bert`] is the sentence-embedding
//! model, read from a sentence-transformers directory.

pub mod attention;
pub mod bert;
pub mod chat_template;
pub mod gguf;
pub mod linear;
pub mod llama;
pub mod tokenizer;

pub use attention::SeqSlice;
pub use bert::SentenceBert;
pub use gguf::Gguf;
pub use llama::{Llama, LlamaConfig};

use crate::kv_cache::BlockId;

/// The input of one forward pass: the tokens of several sequences, concatenated.
#[derive(Clone, Debug, Default)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub seqs: Vec<SeqSlice>,
    /// Rows (indices into `tokens`) whose logits are wanted, in output order.
    pub logits_rows: Vec<u32>,
}

impl ForwardBatch {
    /// Appends a sequence's next `tokens`, the first at position `pos0`; `blocks` must cover
    /// every position up to `pos0 + tokens.len()`. With `logits`, the last token's logits are
    /// returned.
    pub fn push(&mut self, tokens: &[u32], pos0: usize, blocks: Vec<BlockId>, logits: bool) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((pos0..pos0 + tokens.len()).map(|p| p as u32));
        self.seqs.push(SeqSlice {
            start,
            len: tokens.len(),
            pos0,
            blocks,
        });
        if logits {
            self.logits_rows.push((start + tokens.len() - 1) as u32);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

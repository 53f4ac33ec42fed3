//! A sentence-transformers BERT model (all-MiniLM-L6-v2 and its kin) read from its directory:
//! `config.json`, `model.safetensors`, `tokenizer.json`, and the `sentence_bert_config.json` and
//! `1_Pooling/config.json` that sentence-transformers writes beside them.
//!
//! A sentence embedding is computed exactly as sentence-transformers computes it for a mean-pooled
//! model: word pieces with `[CLS]` and `[SEP]`, truncated to `max_seq_length` word pieces in all
//! (the last ones are dropped, `[SEP]` is kept); BERT's encoder in f32 over a batch padded to its
//! longest member, with an attention mask; the mean of the last hidden states over the tokens
//! that are not padding (`[CLS]` and `[SEP]` included); L2 normalisation.
//!
//! Invariants:
//! - padding never changes a result: padded keys are masked out of attention and padded rows out
//!   of the mean, so an input's embedding is the same alone or in any batch (up to float rounding
//!   in the matrix products);
//! - a directory whose pooling is not the mean is refused at load, never embedded the wrong way.
//!
//! Everything here is blocking CPU work on the calling thread; [`crate::embed`] decides on which
//! threads it runs.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use serde::Deserialize;
use tokenizers::{Tokenizer, TruncationParams};

use crate::{EngineError, Result};

/// `sentence_bert_config.json`: how many word pieces the encoder reads.
#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: usize,
}

/// `1_Pooling/config.json`: which pooling the model was trained with.
#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

/// The encoder, its tokenizer, and what pooling needs to know.
pub struct SentenceBert {
    model: BertModel,
    tokenizer: Tokenizer,
    pad_id: u32,
    dimensions: usize,
    max_tokens: usize,
}

impl SentenceBert {
    /// Loads the model in `dir`. Blocking: it reads every weight.
    pub fn load(dir: &Path) -> Result<Self> {
        let config: Config = read_json(&dir.join("config.json"))?;
        // sentence-transformers' own fallback when the file is absent: the position table's size.
        let max_tokens = match dir.join("sentence_bert_config.json") {
            path if path.is_file() => read_json::<SentenceBertConfig>(&path)?.max_seq_length,
            _ => config.max_position_embeddings,
        };
        if max_tokens < 2 || max_tokens > config.max_position_embeddings {
            return Err(EngineError::Model(format!(
                "{}: max_seq_length {max_tokens} does not fit the model's {} positions",
                dir.display(),
                config.max_position_embeddings
            )));
        }
        let pooling = dir.join("1_Pooling/config.json");
        if pooling.is_file() {
            let pooling: PoolingConfig = read_json(&pooling)?;
            if !pooling.pooling_mode_mean_tokens
                || pooling.pooling_mode_cls_token
                || pooling.pooling_mode_max_tokens
                || pooling.pooling_mode_mean_sqrt_len_tokens
            {
                return Err(EngineError::Model(format!(
                    "{}: only mean pooling is supported",
                    dir.display()
                )));
            }
        }

        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| {
            EngineError::Tokenizer(format!("{}: {e}", dir.join("tokenizer.json").display()))
        })?;
        // The file's own settings (truncation at 128, padding to a fixed 128) are not the ones
        // sentence-transformers encodes with; batches are padded here, to their longest member.
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                ..TruncationParams::default()
            }))
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(None);

        let weights = dir.join("model.safetensors");
        let bytes = std::fs::read(&weights).map_err(|e| {
            EngineError::Model(format!(
                "cannot read {}: {e} (run `make models`)",
                weights.display()
            ))
        })?;
        let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, &Device::Cpu)?;
        let model = BertModel::load(vb, &config)?;
        Ok(Self {
            model,
            tokenizer,
            pad_id: config.pad_token_id as u32,
            dimensions: config.hidden_size,
            max_tokens,
        })
    }

    /// Length of every embedding.
    pub fn dimensions(&self) -> usize {
        self.dimensions
    }

    /// Word pieces an input is truncated to, `[CLS]` and `[SEP]` included.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The token ids the encoder reads for `text`: truncated, with `[CLS]` and `[SEP]`.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// One embedding per sequence of `batch` (each from [`Self::tokenize`]), in one forward pass.
    pub fn embed(&self, batch: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let Some(longest) = batch.iter().map(|s| s.len()).max() else {
            return Ok(Vec::new());
        };
        let mut ids = Vec::with_capacity(batch.len() * longest);
        let mut mask = Vec::with_capacity(batch.len() * longest);
        for seq in batch {
            let pad = longest - seq.len();
            ids.extend_from_slice(seq);
            ids.extend(std::iter::repeat_n(self.pad_id, pad));
            mask.extend(std::iter::repeat_n(1f32, seq.len()));
            mask.extend(std::iter::repeat_n(0f32, pad));
        }
        let shape = (batch.len(), longest);
        let ids = Tensor::from_vec(ids, shape, &Device::Cpu)?;
        let mask = Tensor::from_vec(mask, shape, &Device::Cpu)?;
        let token_types = ids.zeros_like()?;
        let hidden = self.model.forward(&ids, &token_types, Some(&mask))?;

        // Mean over the real tokens. Every sequence holds at least `[CLS]` and `[SEP]`, so the
        // count is never zero and sentence-transformers' clamp of it never applies.
        let summed = hidden.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
        let mean = summed.broadcast_div(&mask.sum_keepdim(1)?)?;
        // torch's `F.normalize`: divide by the norm, or by 1e-12 when it is smaller.
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?;
        Ok(mean.broadcast_div(&norm)?.to_vec2::<f32>()?)
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        EngineError::Model(format!(
            "cannot read {}: {e} (run `make models`)",
            path.display()
        ))
    })?;
    serde_json::from_str(&text).map_err(|e| EngineError::Model(format!("{}: {e}", path.display())))
}

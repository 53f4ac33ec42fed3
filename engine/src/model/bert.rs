//! A sentence-transformers BERT model (all-MiniLM-L6-v2 and its kin) read from its directory:
//! `config.json`, `model.safetensors`, `tokenizer.json`, and the `sentence_bert_config.json` and
//! `1_Pooling/config.json` that sentence-transformers writes beside them.
//!
//! A sentence embedding is computed exactly as sentence-transformers computes it for a mean-pooled
//! model: word pieces with `[CLS]` and `[SEP]`, truncated to `max_seq_length` word pieces in all
//! (the last ones are dropped, `[SEP]` is kept); BERT's encoder in f32 ([`BertEncoder`], over
//! the batch's sequences concatenated, each attending to itself only); the mean of the last
//! hidden states over each sequence's tokens (`[CLS]` and `[SEP]` included); L2 normalisation.
//!
//! Invariants:
//! - an input's embedding is the same alone or in any batch: sequences never see each other and
//!   there is no padding to mask;
//! - a directory whose pooling is not the mean is refused at load, never embedded the wrong way.
//!
//! Everything here is blocking work on the calling thread (and, for large products, on the
//! rayon pool it runs in); [`crate::embed`] decides on which threads it runs.
//!
//! On a device (a GPU, `--embedding-device`) the encoder is candle-transformers' `BertModel`
//! instead, over the batch padded to its longest member with an attention mask, the pooling
//! masked to each sequence's tokens; on the CPU that is also the oracle the tests hold
//! [`BertEncoder`] against.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use serde::Deserialize;
use tokenizers::{Tokenizer, TruncationParams};

use super::bert_encoder::BertEncoder;
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
    encoder: Encoder,
    tokenizer: Tokenizer,
    max_tokens: usize,
    hidden: usize,
}

enum Encoder {
    /// Ours, on the CPU.
    Kernels(BertEncoder),
    /// candle-transformers', on `device`.
    Candle { model: BertModel, device: Device },
}

impl SentenceBert {
    /// Loads the model in `dir`, for our CPU encoder (`device` `None`) or for candle's on
    /// `device`. Blocking: it reads every weight.
    pub fn load(dir: &Path, device: Option<&Device>) -> Result<Self> {
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
        // sentence-transformers encodes with, and the encoder needs no padding.
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
        let in_file = |e: EngineError| match e {
            EngineError::Model(m) => EngineError::Model(format!("{}: {m}", weights.display())),
            other => other,
        };
        let encoder = match device {
            None => Encoder::Kernels(BertEncoder::load(&bytes, &config).map_err(in_file)?),
            Some(device) => {
                let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, device)?;
                Encoder::Candle {
                    model: BertModel::load(vb, &config).map_err(|e| in_file(e.into()))?,
                    device: device.clone(),
                }
            }
        };
        Ok(Self {
            encoder,
            tokenizer,
            max_tokens,
            hidden: config.hidden_size,
        })
    }

    /// Length of every embedding.
    pub fn dimensions(&self) -> usize {
        self.hidden
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
        if let Some(empty) = batch.iter().position(|s| s.is_empty()) {
            return Err(EngineError::InvalidRequest(format!(
                "sequence {empty} of the batch has no tokens"
            )));
        }
        let (model, device) = match &self.encoder {
            Encoder::Kernels(encoder) => return self.embed_kernels(encoder, batch),
            Encoder::Candle { model, device } => (model, device),
        };
        let longest = batch.iter().map(|s| s.len()).max().unwrap_or(0);
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for seq in batch {
            ids.extend_from_slice(seq);
            ids.extend(std::iter::repeat_n(0u32, longest - seq.len()));
            mask.extend(std::iter::repeat_n(1f32, seq.len()));
            mask.extend(std::iter::repeat_n(0f32, longest - seq.len()));
        }
        let shape = (batch.len(), longest);
        let ids = Tensor::from_vec(ids, shape, device)?;
        let mask = Tensor::from_vec(mask, shape, device)?;
        let hidden = model.forward(&ids, &ids.zeros_like()?, Some(&mask))?;
        let summed = hidden.broadcast_mul(&mask.unsqueeze(2)?)?.sum(1)?;
        let mean = summed.broadcast_div(&mask.sum_keepdim(1)?)?;
        // torch's `F.normalize`: divide by the norm, or by 1e-12 when it is smaller.
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?;
        Ok(mean.broadcast_div(&norm)?.to_vec2()?)
    }

    /// [`Self::embed`] on our encoder: the sequences concatenated, no padding.
    fn embed_kernels(&self, encoder: &BertEncoder, batch: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<u32> = batch.concat();
        let mut seqs = Vec::with_capacity(batch.len());
        let mut start = 0;
        for seq in batch {
            seqs.push(start..start + seq.len());
            start += seq.len();
        }
        let hidden = encoder.forward(&tokens, &seqs)?;
        let h = self.dimensions();
        Ok(seqs
            .iter()
            .map(|seq| {
                // The mean over the sequence's tokens, summed in order as torch sums the
                // masked states.
                let mut mean = vec![0f32; h];
                for row in hidden[seq.start * h..seq.end * h].chunks_exact(h) {
                    for (m, &v) in mean.iter_mut().zip(row) {
                        *m += v;
                    }
                }
                let count = seq.len() as f32;
                mean.iter_mut().for_each(|m| *m /= count);
                // torch's `F.normalize`: divide by the norm, or by 1e-12 when it is smaller.
                let norm = mean.iter().map(|m| m * m).sum::<f32>().sqrt().max(1e-12);
                mean.iter_mut().for_each(|m| *m /= norm);
                mean
            })
            .collect())
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

//! Everything read from a model file: the text side (tokenizer, chat template) built from GGUF
//! metadata alone, so that no `tokenizer.json` or `tokenizer_config.json` has to sit beside it.

pub mod chat_template;
pub mod tokenizer;

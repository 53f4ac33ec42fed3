//! A GGUF file opened for loading: typed metadata lookups and tensors read on demand.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;

use crate::{EngineError, Result};

pub struct Gguf {
    path: PathBuf,
    content: gguf_file::Content,
    reader: BufReader<File>,
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| {
            EngineError::Model(format!(
                "cannot open {}: {e} (run `make models`)",
                path.display()
            ))
        })?;
        let mut reader = BufReader::new(file);
        let content = gguf_file::Content::read(&mut reader).map_err(|e| {
            EngineError::Model(format!("{} is not a GGUF file: {e}", path.display()))
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }

    fn value(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| EngineError::Model(format!("GGUF metadata has no {key}")))
    }

    fn typed<T>(
        &self,
        key: &str,
        get: impl Fn(&gguf_file::Value) -> candle_core::Result<T>,
    ) -> Result<T> {
        get(self.value(key)?).map_err(|e| EngineError::Model(format!("GGUF metadata {key}: {e}")))
    }

    pub fn string(&self, key: &str) -> Result<String> {
        self.typed(key, |v| v.to_string().cloned())
    }

    pub fn u32(&self, key: &str) -> Result<u32> {
        self.typed(key, |v| v.to_u32())
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        self.typed(key, |v| v.to_f32())
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The tensor's shape, rows first.
    pub fn tensor_dims(&self, name: &str) -> Result<Vec<usize>> {
        self.content
            .tensor_infos
            .get(name)
            .map(|t| t.shape.dims().to_vec())
            .ok_or_else(|| EngineError::Model(format!("GGUF has no tensor {name}")))
    }

    pub fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| EngineError::Model(format!("tensor {name}: {e}")))
    }
}

//! The memory behind the KV blocks: per layer, one key and one value array holding every block.
//!
//! Layout per layer: `[block][kv_head][slot][head_dim]` f32, so the keys of one head in one
//! block (the unit attention streams through) are contiguous. The arrays are allocated once, at
//! start-up, from the memory budget; nothing here allocates afterwards.

use super::BlockId;

/// Shape of the cache, as the model defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// f32 values of one block in one layer, for keys or for values.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Bytes one block costs across all layers, keys and values.
    pub fn bytes_per_block(&self) -> usize {
        2 * self.num_layers * self.block_elems() * std::mem::size_of::<f32>()
    }

    /// How many blocks a budget of `bytes` holds.
    pub fn blocks_for_budget(&self, bytes: usize) -> usize {
        bytes / self.bytes_per_block()
    }

    /// Where token slot `slot` of head `head` starts inside a layer array.
    #[inline]
    pub fn offset(&self, block: BlockId, head: usize, slot: usize) -> usize {
        ((block.index() * self.n_kv_heads + head) * self.block_size + slot) * self.head_dim
    }
}

pub struct KvStorage {
    layout: KvLayout,
    num_blocks: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvStorage {
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let elems = num_blocks * layout.block_elems();
        let alloc = || (0..layout.num_layers).map(|_| vec![0f32; elems]).collect();
        Self {
            layout,
            num_blocks,
            keys: alloc(),
            values: alloc(),
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Keys and values of one layer.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Stores the keys and values of one token (`[n_kv_heads * head_dim]` each) at `slot` of
    /// `block`.
    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.layout.head_dim;
        for head in 0..self.layout.n_kv_heads {
            let at = self.layout.offset(block, head, slot);
            self.keys[layer][at..at + hd].copy_from_slice(&k[head * hd..(head + 1) * hd]);
            self.values[layer][at..at + hd].copy_from_slice(&v[head * hd..(head + 1) * hd]);
        }
    }
}

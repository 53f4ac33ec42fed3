//! The memory behind the KV blocks: per layer, one key and one value array holding every device
//! block; and the host tier's slots, each one whole block (every layer's keys and values).
//!
//! Layout per layer: `[block][kv_head][slot][head_dim]` f32, so the keys of one head in one
//! block (the unit attention streams through) are contiguous, and so is a whole block, which
//! makes a copy between the tiers one `memcpy` per layer and side. Everything is allocated once,
//! at start-up, from the memory budgets; nothing here allocates afterwards. The device tier's
//! pages are touched then too ([`resident`]), so the process holds its budget from the start
//! instead of growing into it as blocks are first used: its size then says something about the
//! rest of its memory. The host tier, an overflow store, is committed as it fills.

use super::{BlockId, CopyOp, HostSlot};

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
        let alloc = || (0..layout.num_layers).map(|_| resident(elems)).collect();
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

    /// Runs a step's copies between the tiers, in the order given.
    pub fn run_copies(&mut self, copies: &[CopyOp], host: &mut HostStore) {
        let be = self.layout.block_elems();
        for &copy in copies {
            for layer in 0..self.layout.num_layers {
                for (side, device) in [&mut self.keys[layer], &mut self.values[layer]]
                    .into_iter()
                    .enumerate()
                {
                    match copy {
                        CopyOp::ToHost { block, slot } => host
                            .part_mut(slot, layer, side)
                            .copy_from_slice(&device[block.index() * be..(block.index() + 1) * be]),
                        CopyOp::ToDevice { slot, block } => device
                            [block.index() * be..(block.index() + 1) * be]
                            .copy_from_slice(host.part(slot, layer, side)),
                    }
                }
            }
        }
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

/// `len` zeros, every page of them written once, so that the system commits them now.
fn resident(len: usize) -> Vec<f32> {
    // Freshly allocated zeros are mapped lazily; a plain store of zero into them may be optimised
    // away as redundant, a volatile one may not.
    const PAGE: usize = 4096 / std::mem::size_of::<f32>();
    let mut values = vec![0f32; len];
    for i in (0..len).step_by(PAGE) {
        // SAFETY: `i < len`, so the pointer is in bounds and aligned for an f32.
        unsafe { std::ptr::write_volatile(values.as_mut_ptr().add(i), 0.0) };
    }
    values
}

/// The host tier's memory: `slots` whole blocks.
pub struct HostStore {
    layout: KvLayout,
    data: Vec<f32>,
}

impl HostStore {
    pub fn new(layout: KvLayout, slots: usize) -> Self {
        Self {
            layout,
            data: vec![0f32; slots * 2 * layout.num_layers * layout.block_elems()],
        }
    }

    fn range(&self, slot: HostSlot, layer: usize, side: usize) -> std::ops::Range<usize> {
        let be = self.layout.block_elems();
        let at = ((slot.index() * self.layout.num_layers + layer) * 2 + side) * be;
        at..at + be
    }

    fn part(&self, slot: HostSlot, layer: usize, side: usize) -> &[f32] {
        &self.data[self.range(slot, layer, side)]
    }

    fn part_mut(&mut self, slot: HostSlot, layer: usize, side: usize) -> &mut [f32] {
        let r = self.range(slot, layer, side);
        &mut self.data[r]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_through_the_host() {
        let layout = KvLayout {
            num_layers: 2,
            block_size: 2,
            n_kv_heads: 1,
            head_dim: 4,
        };
        let mut kv = KvStorage::new(layout, 3);
        let mut host = HostStore::new(layout, 2);
        let k: Vec<f32> = (0..4).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..4).map(|i| -(i as f32)).collect();
        for layer in 0..2 {
            kv.write(layer, BlockId(1), 1, &k, &v);
        }
        kv.run_copies(
            &[CopyOp::ToHost {
                block: BlockId(1),
                slot: HostSlot(1),
            }],
            &mut host,
        );
        kv.run_copies(
            &[CopyOp::ToDevice {
                slot: HostSlot(1),
                block: BlockId(2),
            }],
            &mut host,
        );
        for layer in 0..2 {
            let (keys, values) = kv.layer(layer);
            let at = layout.offset(BlockId(2), 0, 1);
            assert_eq!(&keys[at..at + 4], &k[..]);
            assert_eq!(&values[at..at + 4], &v[..]);
        }
    }
}

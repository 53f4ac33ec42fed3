//! The memory behind the KV blocks: per layer, one key and one value array holding every device
//! block; and the host tier's slots, each one whole block (every layer's keys and values).
//!
//! Layout per layer: `[block][kv_head][slot][head_dim]` f32, so the keys of one head in one
//! block (the unit attention streams through) are contiguous, and so is a whole block, which
//! makes a copy between the tiers one contiguous copy per layer and side. Everything is allocated
//! once, at start-up, from the memory budgets; nothing here allocates afterwards.
//!
//! The device tier is either arrays in RAM, which the CPU kernels read in place, or tensors on
//! the model's device (a GPU's memory), `[blocks, kv_heads, block_size, head_dim]` per layer,
//! which attention reads through candle operations and a step's new keys and values are
//! scattered into. RAM pages are touched at start-up ([`resident`]), so the process holds its
//! budget from the start instead of growing into it as blocks are first used: its size then says
//! something about the rest of its memory. The host tier, an overflow store in CPU RAM, is
//! committed as it fills.

use candle_core::{DType, Device, Tensor};

use super::{BlockId, CopyOp, HostSlot};
use crate::Result;

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
    memory: Memory,
}

enum Memory {
    Arrays {
        keys: Vec<Vec<f32>>,
        values: Vec<Vec<f32>>,
    },
    Tensors {
        keys: Vec<Tensor>,
        values: Vec<Tensor>,
    },
}

/// One layer of the cache, as attention reads it.
pub enum LayerKv<'a> {
    Arrays {
        keys: &'a [f32],
        values: &'a [f32],
    },
    Tensors {
        keys: &'a Tensor,
        values: &'a Tensor,
    },
}

/// Where a batch's tokens go in the cache, in the form the storage writes them.
pub enum Slots {
    /// `(block, slot)` of each token.
    Places(Vec<(BlockId, usize)>),
    /// Row of each (token, KV head) in a layer seen as `[blocks * kv_heads * block_size,
    /// head_dim]`, repeated across `head_dim` for a scatter: `[tokens * kv_heads, head_dim]` u32.
    Rows(Tensor),
}

impl KvStorage {
    /// The device tier as arrays in RAM, for the CPU kernels.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        let elems = num_blocks * layout.block_elems();
        let alloc = || (0..layout.num_layers).map(|_| resident(elems)).collect();
        Self {
            layout,
            num_blocks,
            memory: Memory::Arrays {
                keys: alloc(),
                values: alloc(),
            },
        }
    }

    /// The device tier as tensors in `device`'s memory (zeros).
    pub fn on_device(layout: KvLayout, num_blocks: usize, device: &Device) -> Result<Self> {
        let shape = (
            num_blocks,
            layout.n_kv_heads,
            layout.block_size,
            layout.head_dim,
        );
        let alloc = || -> Result<Vec<Tensor>> {
            (0..layout.num_layers)
                .map(|_| Ok(Tensor::zeros(shape, DType::F32, device)?))
                .collect()
        };
        Ok(Self {
            layout,
            num_blocks,
            memory: Memory::Tensors {
                keys: alloc()?,
                values: alloc()?,
            },
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The device the blocks live on, when they are tensors.
    pub fn device(&self) -> Option<&Device> {
        match &self.memory {
            Memory::Arrays { .. } => None,
            Memory::Tensors { keys, .. } => keys.first().map(Tensor::device),
        }
    }

    /// Keys and values of one layer.
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        match &self.memory {
            Memory::Arrays { keys, values } => LayerKv::Arrays {
                keys: &keys[layer],
                values: &values[layer],
            },
            Memory::Tensors { keys, values } => LayerKv::Tensors {
                keys: &keys[layer],
                values: &values[layer],
            },
        }
    }

    /// Prepares the writes of a batch whose token `i` goes to `places[i]`, once for every layer.
    pub fn slots(&self, places: Vec<(BlockId, usize)>) -> Result<Slots> {
        let Memory::Tensors { keys, .. } = &self.memory else {
            return Ok(Slots::Places(places));
        };
        let l = &self.layout;
        let rows: Vec<u32> = places
            .iter()
            .flat_map(|&(block, slot)| {
                (0..l.n_kv_heads).flat_map(move |head| {
                    let row = (l.offset(block, head, slot) / l.head_dim) as u32;
                    std::iter::repeat_n(row, l.head_dim)
                })
            })
            .collect();
        let shape = (places.len() * l.n_kv_heads, l.head_dim);
        let device = keys.first().map_or(&Device::Cpu, Tensor::device);
        Ok(Slots::Rows(Tensor::from_vec(rows, shape, device)?))
    }

    /// Stores a batch's keys and values, `[tokens, n_kv_heads * head_dim]` each, at `slots`.
    pub fn write(&mut self, layer: usize, slots: &Slots, k: &Tensor, v: &Tensor) -> Result<()> {
        let l = self.layout;
        match (&mut self.memory, slots) {
            (Memory::Arrays { keys, values }, Slots::Places(places)) => {
                let width = l.n_kv_heads * l.head_dim;
                let k = k.flatten_all()?.to_vec1::<f32>()?;
                let v = v.flatten_all()?.to_vec1::<f32>()?;
                for (row, &place) in places.iter().enumerate() {
                    let span = row * width..(row + 1) * width;
                    let layer = (&mut keys[layer][..], &mut values[layer][..]);
                    store_token(&l, layer, place, &k[span.clone()], &v[span]);
                }
            }
            (Memory::Tensors { keys, values }, Slots::Rows(rows)) => {
                let flat = (self.num_blocks * l.n_kv_heads * l.block_size, l.head_dim);
                for (cache, new) in [(&keys[layer], k), (&values[layer], v)] {
                    let new = new.contiguous()?.reshape(rows.shape())?;
                    cache.reshape(flat)?.scatter_set(rows, &new, 0)?;
                }
            }
            _ => {
                return Err(crate::EngineError::Model(
                    "KV slots prepared for another kind of storage".into(),
                ))
            }
        }
        Ok(())
    }

    /// Runs a step's copies between the tiers, in the order given.
    pub fn run_copies(&mut self, copies: &[CopyOp], host: &mut HostStore) -> Result<()> {
        let be = self.layout.block_elems();
        let layers = self.layout.num_layers;
        match &mut self.memory {
            Memory::Arrays { keys, values } => {
                let blocks = |b: BlockId| b.index() * be..(b.index() + 1) * be;
                for &copy in copies {
                    for layer in 0..layers {
                        let sides = [&mut keys[layer], &mut values[layer]];
                        for (side, device) in sides.into_iter().enumerate() {
                            match copy {
                                CopyOp::ToHost { block, slot } => host
                                    .part_mut(slot, layer, side)
                                    .copy_from_slice(&device[blocks(block)]),
                                CopyOp::ToDevice { slot, block } => device[blocks(block)]
                                    .copy_from_slice(host.part(slot, layer, side)),
                            }
                        }
                    }
                }
            }
            // Consecutive copies the same way go together: one transfer per layer and side.
            Memory::Tensors { keys, values } => {
                let to_host = |c: &CopyOp| matches!(c, CopyOp::ToHost { .. });
                for run in copies.chunk_by(|a, b| to_host(a) == to_host(b)) {
                    let index = run_index(run, be, keys[0].device())?;
                    for layer in 0..layers {
                        for (side, device) in [&keys[layer], &values[layer]].into_iter().enumerate()
                        {
                            copy_blocks(run, &index, device, host, (layer, side))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Stores the keys and values of one token (`[n_kv_heads * head_dim]` each) at `slot` of
    /// `block`.
    #[cfg(test)]
    pub(crate) fn write_token(
        &mut self,
        layer: usize,
        block: BlockId,
        slot: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let slots = self.slots(vec![(block, slot)])?;
        let device = self.device().cloned().unwrap_or(Device::Cpu);
        let row = |x: &[f32]| Tensor::from_slice(x, (1, x.len()), &device);
        self.write(layer, &slots, &row(k)?, &row(v)?)
    }
}

/// The blocks a run of copies all one way reads or writes, as the device's index: their ids to
/// gather (to the host), or each id repeated across a block's row to scatter (to the device).
fn run_index(run: &[CopyOp], be: usize, device: &Device) -> Result<Tensor> {
    let blocks = run.iter().map(|c| match *c {
        CopyOp::ToHost { block, .. } | CopyOp::ToDevice { block, .. } => block.index() as u32,
    });
    Ok(match run[0] {
        CopyOp::ToHost { .. } => Tensor::from_iter(blocks, device)?,
        CopyOp::ToDevice { .. } => {
            let index = blocks.flat_map(|b| std::iter::repeat_n(b, be)).collect();
            Tensor::from_vec(index, (run.len(), be), device)?
        }
    })
}

/// Copies `run` (copies all one way, `index` from [`run_index`]) between one side of one layer
/// of a cache held as tensors, seen as rows of one block each, and the host tier: one transfer.
fn copy_blocks(
    run: &[CopyOp],
    index: &Tensor,
    cache: &Tensor,
    host: &mut HostStore,
    (layer, side): (usize, usize),
) -> Result<()> {
    let be = host.layout.block_elems();
    let rows = cache.reshape((cache.dim(0)?, be))?;
    if let CopyOp::ToHost { .. } = run[0] {
        let data = rows
            .index_select(index, 0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (copy, data) in run.iter().zip(data.chunks_exact(be)) {
            if let CopyOp::ToHost { slot, .. } = *copy {
                host.part_mut(slot, layer, side).copy_from_slice(data);
            }
        }
        return Ok(());
    }
    let mut data = Vec::with_capacity(run.len() * be);
    for copy in run {
        if let CopyOp::ToDevice { slot, .. } = *copy {
            data.extend_from_slice(host.part(slot, layer, side));
        }
    }
    let data = Tensor::from_vec(data, (run.len(), be), cache.device())?;
    rows.scatter_set(index, &data, 0)?;
    Ok(())
}

/// Stores one token's keys and values into a layer held as arrays.
fn store_token(
    l: &KvLayout,
    (keys, values): (&mut [f32], &mut [f32]),
    (block, slot): (BlockId, usize),
    k: &[f32],
    v: &[f32],
) {
    let hd = l.head_dim;
    for head in 0..l.n_kv_heads {
        let at = l.offset(block, head, slot);
        keys[at..at + hd].copy_from_slice(&k[head * hd..(head + 1) * hd]);
        values[at..at + hd].copy_from_slice(&v[head * hd..(head + 1) * hd]);
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

    /// A layer's keys and values, flattened, whichever the storage.
    fn read(kv: &KvStorage, layer: usize) -> (Vec<f32>, Vec<f32>) {
        match kv.layer(layer) {
            LayerKv::Arrays { keys, values } => (keys.to_vec(), values.to_vec()),
            LayerKv::Tensors { keys, values } => {
                let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                (flat(keys), flat(values))
            }
        }
    }

    /// Tokens written land at their block's offsets, and blocks sent to the host and back into
    /// other blocks (two at a time each way) arrive whole, for arrays and for tensors alike (the
    /// same layout).
    #[test]
    fn blocks_round_trip_through_the_host() {
        let layout = KvLayout {
            num_layers: 2,
            block_size: 2,
            n_kv_heads: 2,
            head_dim: 4,
        };
        let width = layout.n_kv_heads * layout.head_dim;
        let token = |seed: f32| -> (Vec<f32>, Vec<f32>) {
            let k = (0..width).map(|i| seed + i as f32).collect();
            let v = (0..width).map(|i| -seed - i as f32).collect();
            (k, v)
        };
        // (block, slot) written, and the block its copy lands in.
        let written = [((1, 1), 2, token(1.0)), ((0, 0), 3, token(100.0))];
        for mut kv in [
            KvStorage::new(layout, 4),
            KvStorage::on_device(layout, 4, &Device::Cpu).unwrap(),
        ] {
            let mut host = HostStore::new(layout, 2);
            for layer in 0..2 {
                for ((block, slot), _, (k, v)) in &written {
                    kv.write_token(layer, BlockId(*block), *slot, k, v).unwrap();
                }
            }
            let to_host = |b: u32, s: u32| CopyOp::ToHost {
                block: BlockId(b),
                slot: HostSlot(s),
            };
            let to_device = |s: u32, b: u32| CopyOp::ToDevice {
                slot: HostSlot(s),
                block: BlockId(b),
            };
            let copies = [
                to_host(1, 1),
                to_host(0, 0),
                to_device(1, 2),
                to_device(0, 3),
            ];
            kv.run_copies(&copies, &mut host).unwrap();
            for layer in 0..2 {
                let (keys, values) = read(&kv, layer);
                for ((block, slot), copy, (k, v)) in &written {
                    for block in [*block, *copy] {
                        for head in 0..layout.n_kv_heads {
                            let at = layout.offset(BlockId(block), head, *slot);
                            let hd = head * layout.head_dim..(head + 1) * layout.head_dim;
                            assert_eq!(keys[at..at + layout.head_dim], k[hd.clone()]);
                            assert_eq!(values[at..at + layout.head_dim], v[hd]);
                        }
                    }
                }
                let nonzero = keys.iter().filter(|x| **x != 0.0).count();
                assert_eq!(nonzero, 4 * width, "nothing else was written");
            }
        }
    }
}

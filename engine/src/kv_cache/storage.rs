//! The memory behind the KV blocks, and the host tier's slots, each one whole block (every
//! layer's keys and values).
//!
//! The device tier is either one arena of f16 in RAM, which the CPU kernels read in place (f16 as
//! llama.cpp keeps its cache: half the memory, and half the bytes attention streams through),
//! or f32 tensors on the model's device (a GPU's memory), `[blocks, kv_heads, block_size,
//! head_dim]` per layer, which attention reads through candle operations and a step's new keys
//! and values are scattered into. The host tier holds blocks in the device tier's type.
//!
//! The arena is a row of slabs, one per block: `[block][layer][key, value][kv_head][slot]
//! [head_dim]`. The keys of one head in one block (the unit attention streams through) are
//! contiguous, a whole block is one contiguous copy to or from the host, and models of different
//! shapes can draw their blocks from one arena: the slab is the largest of their blocks, and a
//! block id means the same memory whichever model holds it (see [`KvStorage::shared`]).
//! Everything is allocated once, at start-up, from the memory budgets; nothing here allocates
//! afterwards. RAM pages are touched at start-up ([`resident`]), so the process holds its
//! budget from the start instead of growing into it as blocks are first used: its size then says
//! something about the rest of its memory. The host tier, an overflow store in CPU RAM, is
//! committed as it fills.

use candle_core::{DType, Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

use super::transfer::{Copier, Download, Upload, MAX_IN_FLIGHT, MAX_TRANSFER_BYTES};
use super::{BlockId, CopyOp, HostSlot};
use crate::Result;

/// The type of the cache's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// The CPU kernels' cache, arrays in RAM.
    F16,
    /// The device path's cache, tensors read by candle operations and the decode kernel.
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// Shape of the cache, as the model defines it, and how far apart its blocks are in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
    /// Elements from a block to the next in one layer's keys or values: a block's worth in a
    /// per-layer tensor, a slab in the arena.
    pub block_stride: usize,
}

impl KvLayout {
    /// A model's cache shape, its blocks side by side in per-layer arrays.
    pub fn new(
        num_layers: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        Self {
            num_layers,
            block_size,
            n_kv_heads,
            head_dim,
            dtype,
            block_stride: block_size * n_kv_heads * head_dim,
        }
    }

    /// Elements of one whole block: every layer's keys and values.
    pub fn slab_elems(&self) -> usize {
        2 * self.num_layers * self.block_elems()
    }

    /// The same shape with its blocks `slab` elements apart, as the arena holds them.
    fn in_slabs(self, slab: usize) -> Self {
        Self {
            block_stride: slab,
            ..self
        }
    }

    /// Where the keys (`side` 0) or values (1) of `layer` start within a slab.
    fn side_base(&self, layer: usize, side: usize) -> usize {
        (layer * 2 + side) * self.block_elems()
    }

    /// Values of one block in one layer, for keys or for values.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Bytes one block costs across all layers, keys and values.
    pub fn bytes_per_block(&self) -> usize {
        2 * self.num_layers * self.block_elems() * self.dtype.bytes()
    }

    /// Where token slot `slot` of head `head` starts inside a layer's keys or values.
    #[inline]
    pub fn offset(&self, block: BlockId, head: usize, slot: usize) -> usize {
        block.index() * self.block_stride + (head * self.block_size + slot) * self.head_dim
    }
}

pub struct KvStorage {
    /// The layout of the model the storage is read for now (see [`KvStorage::select`]).
    layout: KvLayout,
    /// Where each of that model's layers keeps its keys and values.
    layers: Vec<LayerPlace>,
    num_blocks: usize,
    memory: Memory,
}

enum Memory {
    /// `num_blocks` slabs of `slab` elements.
    Arrays {
        arena: Vec<f16>,
        slab: usize,
    },
    Tensors(DeviceCache),
}

/// The device tier as tensors, and the runs of blocks moving between it and the host tier.
///
/// A run going to the host is gathered on the device when its copies run (so the step's writes,
/// queued after, cannot change it), and lands in its host slots when the next copies run (the
/// transfer meanwhile overlapping the step) or before a run reads host slots. A run coming back
/// is scattered into each layer when the step first writes that layer, so that the transfer of
/// the later layers overlaps the compute of the earlier ones; copies that read device blocks
/// first land every run still on its way in.
struct DeviceCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    copier: Copier,
    outbound: Vec<Outbound>,
    inbound: Vec<Inbound>,
}

/// Blocks gathered for the host, `[layers, 2 (keys, values), blocks, block_elems]`.
struct Outbound {
    slots: Vec<HostSlot>,
    download: Download,
}

/// Blocks coming back: their scatter index ([`run_index`]), their values `[layers, 2 *
/// blocks, block_elems]` (keys, then values), and the layers already scattered.
struct Inbound {
    index: Tensor,
    upload: Upload,
    landed: Vec<bool>,
}

/// Where one layer keeps its keys and values: in its group's blocks (see
/// [`KvStorage::select`]), laid out as `layout` says, the `index`-th of the group's layers.
#[derive(Clone, Copy, Debug)]
struct LayerPlace {
    layout: KvLayout,
    index: usize,
    group: usize,
}

/// Every layer of `layout` in one group: the blocks hold them all.
fn whole(layout: KvLayout) -> Vec<LayerPlace> {
    (0..layout.num_layers)
        .map(|index| LayerPlace {
            layout,
            index,
            group: 0,
        })
        .collect()
}

/// One layer of the cache, as attention reads it.
pub enum LayerKv<'a> {
    Arrays {
        keys: &'a [f16],
        values: &'a [f16],
    },
    Tensors {
        keys: &'a Tensor,
        values: &'a Tensor,
    },
}

/// Where a batch's tokens go in the cache, in the form the storage writes them.
pub enum Slots {
    /// `(block, slot)` of each token, per layer group.
    Places(Vec<Vec<(BlockId, usize)>>),
    /// Row of each (token, KV head) in a layer seen as `[blocks * kv_heads * block_size,
    /// head_dim]`, repeated across `head_dim` for a scatter: `[tokens * kv_heads, head_dim]` u32.
    Rows(Tensor),
}

impl KvStorage {
    /// The device tier as arrays in RAM, for the CPU kernels (`layout.dtype` must be f16).
    pub fn new(layout: KvLayout, num_blocks: usize) -> Self {
        Self::shared(&[layout], num_blocks).expect("one layout fits its own slabs")
    }

    /// One arena in RAM whose blocks any of `layouts` (models of one engine, f16) may hold:
    /// `num_blocks` slabs, each the size of the largest of their blocks. A model holds as many
    /// tokens in a slab as fit ([`KvStorage::block_sizes`]), so a smaller model's blocks are
    /// longer. It reads as the first model's until [`KvStorage::select`] picks another.
    pub fn shared(layouts: &[KvLayout], num_blocks: usize) -> Result<Self> {
        let first = *layouts
            .first()
            .ok_or_else(|| crate::EngineError::Model("a cache for no model".into()))?;
        let slab = layouts.iter().map(KvLayout::slab_elems).max().unwrap_or(0);
        if layouts.iter().any(|l| l.dtype != KvDtype::F16) {
            return Err(crate::EngineError::Model(
                "models sharing a cache need f16 blocks".into(),
            ));
        }
        let layout = first.in_slabs(slab);
        Ok(Self {
            layout,
            layers: whole(layout),
            num_blocks,
            memory: Memory::Arrays {
                arena: resident(num_blocks * slab),
                slab,
            },
        })
    }

    /// Reads and writes the blocks as the model whose one-token block is `token` (its layout with
    /// a block size of 1) lays them out from now on, the model about to run its forward, its
    /// layers in `groups` (a block of a group holds only that group's layers; one group of every
    /// layer keeps them all together). Returns how many tokens a block holds for each group
    /// ([`KvStorage::block_sizes`]). Fails for a model the storage was not made for, or groups a
    /// cache held as tensors cannot keep apart.
    pub fn select(&mut self, token: KvLayout, groups: &[Vec<usize>]) -> Result<Vec<usize>> {
        let sizes = self.block_sizes(&token, groups);
        let layers = groups.iter().map(Vec::len).sum::<usize>();
        let fits = layers == token.num_layers
            && sizes.iter().all(|&n| n > 0)
            && match &self.memory {
                Memory::Arrays { .. } => token.dtype == KvDtype::F16,
                Memory::Tensors(_) => {
                    let layout = KvLayout::new(
                        token.num_layers,
                        self.layout.block_size,
                        token.n_kv_heads,
                        token.head_dim,
                        token.dtype,
                    );
                    groups.len() == 1 && layout == self.layout
                }
            };
        if !fits {
            return Err(crate::EngineError::Model(format!(
                "this KV cache was not made for a model with {token:?} in {} layer groups",
                groups.len()
            )));
        }
        if let Memory::Arrays { slab, .. } = self.memory {
            let sized = |layers: usize, block_size: usize| {
                let layout = KvLayout::new(
                    layers,
                    block_size,
                    token.n_kv_heads,
                    token.head_dim,
                    token.dtype,
                );
                layout.in_slabs(slab)
            };
            self.layout = sized(token.num_layers, sizes[0]);
            // Every entry is set below: the groups hold each layer once.
            let place = LayerPlace {
                layout: self.layout,
                index: 0,
                group: 0,
            };
            self.layers.resize(token.num_layers, place);
            for (group, (layers, &size)) in groups.iter().zip(&sizes).enumerate() {
                let layout = sized(layers.len(), size);
                for (index, &layer) in layers.iter().enumerate() {
                    self.layers[layer] = LayerPlace {
                        layout,
                        index,
                        group,
                    };
                }
            }
        }
        Ok(sizes)
    }

    /// Tokens a block holds for each group of layers (see [`KvStorage::select`]) of the model
    /// whose one-token block is `token`: in the arena, as many as fit in a slab for the group's
    /// layers, each group's a divisor of the largest (so that a prefix can end on a block
    /// boundary of every group); on tensors, the one model's block size. 0 where not one fits.
    pub fn block_sizes(&self, token: &KvLayout, groups: &[Vec<usize>]) -> Vec<usize> {
        match &self.memory {
            Memory::Arrays { slab, .. } => {
                let fit: Vec<usize> = (groups.iter())
                    .map(|g| slab / (2 * g.len().max(1) * token.block_elems()))
                    .collect();
                let most = fit.iter().copied().max().unwrap_or(0);
                (fit.iter())
                    .map(|&f| (1..=f).rev().find(|d| most % d == 0).unwrap_or(0))
                    .collect()
            }
            Memory::Tensors(_) => vec![self.layout.block_size; groups.len()],
        }
    }

    /// The device tier as tensors in `device`'s memory (zeros; `layout.dtype` must be f32).
    pub fn on_device(layout: KvLayout, num_blocks: usize, device: &Device) -> Result<Self> {
        debug_assert_eq!(layout.dtype, KvDtype::F32);
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
            layers: whole(layout),
            num_blocks,
            memory: Memory::Tensors(DeviceCache {
                keys: alloc()?,
                values: alloc()?,
                copier: Copier::for_device(device)?,
                outbound: Vec::new(),
                inbound: Vec::new(),
            }),
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// How `layer`'s keys and values are laid out: its group's blocks, from where
    /// [`KvStorage::layer`] starts.
    pub fn layer_layout(&self, layer: usize) -> &KvLayout {
        &self.layers[layer].layout
    }

    /// The group of the selected model's layers that `layer` belongs to.
    pub fn layer_group(&self, layer: usize) -> usize {
        self.layers[layer].group
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The device the blocks live on, when they are tensors.
    pub fn device(&self) -> Option<&Device> {
        match &self.memory {
            Memory::Arrays { .. } => None,
            Memory::Tensors(cache) => cache.keys.first().map(Tensor::device),
        }
    }

    /// Keys and values of one layer, as the step has written them (a layer is read after the
    /// step's [`KvStorage::write`] to it, which lands what was on its way there).
    pub fn layer(&self, layer: usize) -> LayerKv<'_> {
        match &self.memory {
            Memory::Arrays { arena, .. } => {
                let p = &self.layers[layer];
                LayerKv::Arrays {
                    keys: &arena[p.layout.side_base(p.index, 0)..],
                    values: &arena[p.layout.side_base(p.index, 1)..],
                }
            }
            Memory::Tensors(cache) => LayerKv::Tensors {
                keys: &cache.keys[layer],
                values: &cache.values[layer],
            },
        }
    }

    /// Prepares the writes of a batch whose token `i` goes to `places[g][i]` in the layers of
    /// group `g`, once for every layer.
    pub fn slots(&self, mut places: Vec<Vec<(BlockId, usize)>>) -> Result<Slots> {
        let Memory::Tensors(DeviceCache { keys, .. }) = &self.memory else {
            return Ok(Slots::Places(places));
        };
        let (Some(places), None) = (places.pop(), places.pop()) else {
            return Err(crate::EngineError::Model(
                "a cache held as tensors keeps one group of layers".into(),
            ));
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
            (Memory::Arrays { arena, .. }, Slots::Places(places)) => {
                let p = self.layers[layer];
                let width = l.n_kv_heads * l.head_dim;
                let k = k.flatten_all()?.to_vec1::<f32>()?;
                let v = v.flatten_all()?.to_vec1::<f32>()?;
                for (row, &place) in places[p.group].iter().enumerate() {
                    let span = row * width..(row + 1) * width;
                    let kv = (&k[span.clone()], &v[span]);
                    store_token(&p.layout, arena, p.index, place, kv);
                }
            }
            (Memory::Tensors(cache), Slots::Rows(rows)) => {
                cache.land(layer)?;
                let flat = (self.num_blocks * l.n_kv_heads * l.block_size, l.head_dim);
                for (cache, new) in [(&cache.keys[layer], k), (&cache.values[layer], v)] {
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

    /// Runs a step's copies between the tiers, in the order given. For a cache held as tensors
    /// they may still be under way when this returns (see `DeviceCache`): the step's writes and the
    /// next copies see them done, and [`KvStorage::settle`] completes them.
    pub fn run_copies(&mut self, copies: &[CopyOp], host: &mut HostStore) -> Result<()> {
        let matches = match &self.memory {
            Memory::Arrays { slab, .. } => host.layout.dtype == KvDtype::F16 && host.slab == *slab,
            Memory::Tensors(_) => host.layout == self.layout,
        };
        if !matches {
            return Err(crate::EngineError::Model(
                "the host tier was laid out for another cache".into(),
            ));
        }
        let be = self.layout.block_elems();
        match &mut self.memory {
            Memory::Arrays { arena, slab } => {
                let slab = *slab;
                let block = |b: BlockId| b.index() * slab..(b.index() + 1) * slab;
                for &copy in copies {
                    match copy {
                        CopyOp::ToHost { block: b, slot } => {
                            host.slot_mut(slot).copy_from_slice(&arena[block(b)])
                        }
                        CopyOp::ToDevice { slot, block: b } => {
                            arena[block(b)].copy_from_slice(host.slot(slot))
                        }
                    }
                }
            }
            // Consecutive copies the same way go together: one transfer per layer and side.
            Memory::Tensors(cache) => {
                cache.settle(host)?;
                let to_host = |c: &CopyOp| matches!(c, CopyOp::ToHost { .. });
                let per_transfer = (MAX_TRANSFER_BYTES / self.layout.bytes_per_block()).max(1);
                for run in copies.chunk_by(|a, b| to_host(a) == to_host(b)) {
                    for part in run.chunks(per_transfer) {
                        if to_host(&part[0]) {
                            cache.land_all()?;
                            if cache.outbound.len() >= MAX_IN_FLIGHT {
                                cache.finish_outbound(host)?;
                            }
                            cache.send(part, be)?;
                        } else {
                            cache.finish_outbound(host)?;
                            if cache.inbound.len() >= MAX_IN_FLIGHT {
                                cache.land_all()?;
                            }
                            cache.receive(part, host)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Completes every transfer under way, so that both tiers hold what the copies run so far
    /// put there.
    pub fn settle(&mut self, host: &mut HostStore) -> Result<()> {
        match &mut self.memory {
            Memory::Arrays { .. } => Ok(()),
            Memory::Tensors(cache) => cache.settle(host),
        }
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
        let slots = self.slots(vec![vec![(block, slot)]])?;
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

/// The host slots of a run of copies.
fn run_slots(run: &[CopyOp]) -> Vec<HostSlot> {
    run.iter()
        .map(|c| match *c {
            CopyOp::ToHost { slot, .. } | CopyOp::ToDevice { slot, .. } => slot,
        })
        .collect()
}

/// Each block part of a run's staging, laid out `[layers, 2 (keys, values), blocks,
/// block_elems]`: `(slot, layer, side, offset)`.
fn staged(
    slots: &[HostSlot],
    layers: usize,
    be: usize,
) -> impl Iterator<Item = (HostSlot, usize, usize, usize)> + '_ {
    let n = slots.len();
    slots.iter().enumerate().flat_map(move |(i, &slot)| {
        (0..layers).flat_map(move |layer| {
            (0..2).map(move |side| (slot, layer, side, ((layer * 2 + side) * n + i) * be))
        })
    })
}

impl DeviceCache {
    fn num_layers(&self) -> usize {
        self.keys.len()
    }

    /// Gathers the blocks of `run` (all to the host) and starts their transfer.
    fn send(&mut self, run: &[CopyOp], be: usize) -> Result<()> {
        let index = run_index(run, be, self.keys[0].device())?;
        let mut parts = Vec::with_capacity(2 * self.num_layers());
        for (keys, values) in self.keys.iter().zip(&self.values) {
            for cache in [keys, values] {
                let rows = cache.reshape((cache.dim(0)?, be))?;
                parts.push(rows.index_select(&index, 0)?);
            }
        }
        let download = self.copier.download(Tensor::stack(&parts, 0)?)?;
        let slots = run_slots(run);
        self.outbound.push(Outbound { slots, download });
        Ok(())
    }

    /// Lands every run gathered for the host in its slots.
    fn finish_outbound(&mut self, host: &mut HostStore) -> Result<()> {
        let (layers, be) = (host.layout.num_layers, host.layout.block_elems());
        for Outbound { slots, download } in self.outbound.drain(..) {
            self.copier.finish(download, |data| {
                for (slot, layer, side, at) in staged(&slots, layers, be) {
                    host.part_mut(slot, layer, side)
                        .copy_from_slice(&data[at..at + be]);
                }
            })?;
        }
        Ok(())
    }

    /// Starts the transfer of the host slots of `run` (all to the device).
    fn receive(&mut self, run: &[CopyOp], host: &HostStore) -> Result<()> {
        let be = host.layout.block_elems();
        let device = self.keys[0].device().clone();
        let index = run_index(run, be, &device)?;
        let slots = run_slots(run);
        let layers = self.num_layers();
        let upload = self
            .copier
            .upload(&device, (layers, 2 * slots.len(), be), |data| {
                for (slot, layer, side, at) in staged(&slots, layers, be) {
                    data[at..at + be].copy_from_slice(host.part(slot, layer, side));
                }
            })?;
        self.inbound.push(Inbound {
            index,
            upload,
            landed: vec![false; layers],
        });
        Ok(())
    }

    /// Scatters into `layer` what is on its way there.
    fn land(&mut self, layer: usize) -> Result<()> {
        for inbound in &mut self.inbound {
            if inbound.landed[layer] {
                continue;
            }
            self.copier.arrived(&inbound.upload, layer)?;
            let data = inbound.upload.data.get(layer)?;
            let n = inbound.index.dim(0)?;
            for (side, cache) in [&self.keys[layer], &self.values[layer]]
                .into_iter()
                .enumerate()
            {
                let rows = cache.reshape((cache.dim(0)?, data.dim(1)?))?;
                rows.scatter_set(&inbound.index, &data.narrow(0, side * n, n)?, 0)?;
            }
            inbound.landed[layer] = true;
        }
        self.inbound.retain(|i| !i.landed.iter().all(|&l| l));
        Ok(())
    }

    fn land_all(&mut self) -> Result<()> {
        (0..self.num_layers()).try_for_each(|layer| self.land(layer))
    }

    fn settle(&mut self, host: &mut HostStore) -> Result<()> {
        self.land_all()?;
        self.finish_outbound(host)
    }
}

/// Stores one token's keys and values into `layer` of the arena, rounded to f16.
fn store_token(
    l: &KvLayout,
    arena: &mut [f16],
    layer: usize,
    (block, slot): (BlockId, usize),
    (k, v): (&[f32], &[f32]),
) {
    let hd = l.head_dim;
    for (side, new) in [k, v].into_iter().enumerate() {
        let base = l.side_base(layer, side);
        for head in 0..l.n_kv_heads {
            let at = base + l.offset(block, head, slot);
            arena[at..at + hd].convert_from_f32_slice(&new[head * hd..(head + 1) * hd]);
        }
    }
}

/// `len` zeros, every page of them written once, so that the system commits them now.
fn resident(len: usize) -> Vec<f16> {
    // Freshly allocated zeros are mapped lazily; a plain store of zero into them may be optimised
    // away as redundant, a volatile one may not.
    const PAGE: usize = 4096 / std::mem::size_of::<f16>();
    let mut values = vec![f16::ZERO; len];
    for i in (0..len).step_by(PAGE) {
        // SAFETY: `i < len`, so the pointer is in bounds and aligned for an f16.
        unsafe { std::ptr::write_volatile(values.as_mut_ptr().add(i), f16::ZERO) };
    }
    values
}

/// The host tier's memory: `slots` whole blocks, in the device tier's type, each a slab laid out
/// as the arena's.
pub struct HostStore {
    layout: KvLayout,
    /// Elements per slot.
    slab: usize,
    data: HostData,
}

enum HostData {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

/// An element type the host tier holds.
trait HostElem: Sized {
    fn of(data: &HostData) -> &[Self];
    fn of_mut(data: &mut HostData) -> &mut [Self];
}

// `run_copies` checks that the host store has the cache's layout, and so its type, before any
// copy: a store of the other type is never read or written.
impl HostElem for f16 {
    fn of(data: &HostData) -> &[Self] {
        match data {
            HostData::F16(d) => d,
            HostData::F32(_) => unreachable!("an f32 host store read as f16"),
        }
    }
    fn of_mut(data: &mut HostData) -> &mut [Self] {
        match data {
            HostData::F16(d) => d,
            HostData::F32(_) => unreachable!("an f32 host store written as f16"),
        }
    }
}

impl HostElem for f32 {
    fn of(data: &HostData) -> &[Self] {
        match data {
            HostData::F32(d) => d,
            HostData::F16(_) => unreachable!("an f16 host store read as f32"),
        }
    }
    fn of_mut(data: &mut HostData) -> &mut [Self] {
        match data {
            HostData::F32(d) => d,
            HostData::F16(_) => unreachable!("an f16 host store written as f32"),
        }
    }
}

impl HostStore {
    /// `slots` blocks of `storage`'s (of any model it holds blocks of).
    pub fn for_storage(storage: &KvStorage, slots: usize) -> Self {
        let layout = storage.layout;
        let slab = match &storage.memory {
            Memory::Arrays { slab, .. } => *slab,
            Memory::Tensors(_) => layout.slab_elems(),
        };
        let len = slots * slab;
        let data = match layout.dtype {
            // Zeros from the allocator, mapped as slots fill (unlike the device pool's, which
            // are committed up front): an idle host tier costs no memory.
            KvDtype::F16 => HostData::F16(vec![0u16; len].reinterpret_into()),
            KvDtype::F32 => HostData::F32(vec![0f32; len]),
        };
        Self { layout, slab, data }
    }

    fn range(&self, slot: HostSlot, layer: usize, side: usize) -> std::ops::Range<usize> {
        let at = slot.index() * self.slab + self.layout.side_base(layer, side);
        at..at + self.layout.block_elems()
    }

    fn slot<T: HostElem>(&self, slot: HostSlot) -> &[T] {
        &T::of(&self.data)[slot.index() * self.slab..(slot.index() + 1) * self.slab]
    }

    fn slot_mut<T: HostElem>(&mut self, slot: HostSlot) -> &mut [T] {
        let r = slot.index() * self.slab..(slot.index() + 1) * self.slab;
        &mut T::of_mut(&mut self.data)[r]
    }

    fn part<T: HostElem>(&self, slot: HostSlot, layer: usize, side: usize) -> &[T] {
        &T::of(&self.data)[self.range(slot, layer, side)]
    }

    fn part_mut<T: HostElem>(&mut self, slot: HostSlot, layer: usize, side: usize) -> &mut [T] {
        let r = self.range(slot, layer, side);
        &mut T::of_mut(&mut self.data)[r]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer's keys and values, flattened, whichever the storage.
    fn read(kv: &KvStorage, layer: usize) -> (Vec<f32>, Vec<f32>) {
        match kv.layer(layer) {
            LayerKv::Arrays { keys, values } => {
                let wide = |x: &[f16]| x.iter().map(|v| v.to_f32()).collect();
                (wide(keys), wide(values))
            }
            LayerKv::Tensors { keys, values } => {
                let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                (flat(keys), flat(values))
            }
        }
    }

    /// Runs longer than one transfer go in parts, a bounded number under way at once, and still
    /// arrive whole and in order: blocks of 20 MiB (one part each), four out and four back
    /// reversed in one step's copies, for tensors and arrays alike.
    #[test]
    fn runs_of_large_blocks_move_in_parts() {
        let layout = KvLayout::new(1, 1, 1, 5 << 19, KvDtype::F32);
        let arrays = KvLayout {
            dtype: KvDtype::F16,
            ..layout
        };
        assert_eq!(MAX_TRANSFER_BYTES / layout.bytes_per_block(), 1);
        let value = |block: u32, side: f32| side * (block as f32 + 1.0);
        let to_host = |b: u32| CopyOp::ToHost {
            block: BlockId(b),
            slot: HostSlot(b),
        };
        let to_device = |b: u32| CopyOp::ToDevice {
            slot: HostSlot(b),
            block: BlockId(3 - b),
        };
        for mut kv in [
            KvStorage::new(arrays, 4),
            KvStorage::on_device(layout, 4, &Device::Cpu).unwrap(),
        ] {
            let mut host = HostStore::for_storage(&kv, 4);
            for b in 0..4 {
                let k = vec![value(b, 1.0); layout.head_dim];
                let v = vec![value(b, -1.0); layout.head_dim];
                kv.write_token(0, BlockId(b), 0, &k, &v).unwrap();
            }
            let copies: Vec<CopyOp> = (0..4).map(to_host).chain((0..4).map(to_device)).collect();
            kv.run_copies(&copies, &mut host).unwrap();
            kv.settle(&mut host).unwrap();
            let (keys, values) = read(&kv, 0);
            for b in 0..4u32 {
                let at = kv.layout().offset(BlockId(3 - b), 0, 0);
                let block = at..at + layout.head_dim;
                assert!(
                    keys[block.clone()].iter().all(|x| *x == value(b, 1.0)),
                    "{b}"
                );
                assert!(values[block].iter().all(|x| *x == value(b, -1.0)), "{b}");
            }
        }
    }

    /// Tokens written land at their block's offsets, and blocks sent to the host and back into
    /// other blocks (two at a time each way) arrive whole, for arrays and for tensors alike (the
    /// same shape); copies keep their order whatever is still in flight: a block swapped in and
    /// out again within one step's copies, a host slot reused at once, a token written into a
    /// block on its way in.
    #[test]
    fn blocks_round_trip_through_the_host() {
        let layout = KvLayout::new(2, 2, 2, 4, KvDtype::F16);
        let width = layout.n_kv_heads * layout.head_dim;
        type Token = (Vec<f32>, Vec<f32>);
        let token = |seed: f32| -> Token {
            let k = (0..width).map(|i| seed + i as f32).collect();
            let v = (0..width).map(|i| -seed - i as f32).collect();
            (k, v)
        };
        let to_host = |b: u32, s: u32| CopyOp::ToHost {
            block: BlockId(b),
            slot: HostSlot(s),
        };
        let to_device = |s: u32, b: u32| CopyOp::ToDevice {
            slot: HostSlot(s),
            block: BlockId(b),
        };
        // Whether `block` holds exactly `tokens` (slot, token) in every layer.
        let holds = |kv: &KvStorage, block: u32, tokens: &[(usize, &Token)]| {
            (0..layout.num_layers).all(|layer| {
                let (keys, values) = read(kv, layer);
                (0..layout.block_size).all(|slot| {
                    let token = tokens.iter().find(|(s, _)| *s == slot).map(|(_, t)| *t);
                    (0..layout.n_kv_heads).all(|head| {
                        let at = kv.layout().offset(BlockId(block), head, slot);
                        let hd = head * layout.head_dim..(head + 1) * layout.head_dim;
                        let (k, v) = (
                            &keys[at..at + layout.head_dim],
                            &values[at..at + layout.head_dim],
                        );
                        match token {
                            Some((tk, tv)) => k == &tk[hd.clone()] && v == &tv[hd],
                            None => k.iter().chain(v).all(|x| *x == 0.0),
                        }
                    })
                })
            })
        };
        let (a, b, c) = (token(1.0), token(100.0), token(1000.0));
        let tensors = KvLayout {
            dtype: KvDtype::F32,
            ..layout
        };
        for mut kv in [
            KvStorage::new(layout, 5),
            KvStorage::on_device(tensors, 5, &Device::Cpu).unwrap(),
        ] {
            let mut host = HostStore::for_storage(&kv, 2);
            for layer in 0..2 {
                kv.write_token(layer, BlockId(1), 1, &a.0, &a.1).unwrap();
                kv.write_token(layer, BlockId(0), 0, &b.0, &b.1).unwrap();
            }
            let copies = [
                to_host(1, 1),
                to_host(0, 0),
                to_device(1, 2),
                to_device(0, 3),
            ];
            kv.run_copies(&copies, &mut host).unwrap();
            kv.settle(&mut host).unwrap();
            assert!(holds(&kv, 1, &[(1, &a)]) && holds(&kv, 2, &[(1, &a)]));
            assert!(holds(&kv, 0, &[(0, &b)]) && holds(&kv, 3, &[(0, &b)]));
            assert!(holds(&kv, 4, &[]), "nothing else was written");

            // In, and out again from the same block into a slot that was just read.
            kv.run_copies(&[to_device(1, 4), to_host(4, 1)], &mut host)
                .unwrap();
            // Back in, and a token written into that block before anything settles.
            kv.run_copies(&[to_device(1, 0)], &mut host).unwrap();
            for layer in 0..2 {
                kv.write_token(layer, BlockId(0), 0, &c.0, &c.1).unwrap();
            }
            kv.settle(&mut host).unwrap();
            assert!(holds(&kv, 4, &[(1, &a)]));
            assert!(holds(&kv, 0, &[(0, &c), (1, &a)]));
        }
    }
}

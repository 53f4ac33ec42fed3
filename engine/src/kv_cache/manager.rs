//! The KV manager: one owner for both tiers' books, handing out [`BlockTable`]s.
//!
//! What it decides:
//! - *prefix reuse*: a new sequence takes references to every leading full block already cached,
//!   on the device or (copied back) from the host tier, and computes only the rest;
//! - *eviction*: when an allocation finds no free block it evicts the least recently used cached
//!   block, first copying it to the host tier (unless the host already has it);
//! - *swapping*: a preempted sequence's blocks are copied to the host tier and freed, and copied
//!   back into new blocks when it resumes;
//! - *pinning*: pinned prefix blocks stay on the device;
//! - *retention*: held blocks (a turn that ended in tool calls, kept for its follow-up) are
//!   evicted only after every plain cached block, so pressure demotes them to the host tier
//!   before it costs anyone a recomputation; a hold ends when let go, or when its block is
//!   evicted.
//!
//! Data never moves here. Every copy is queued as a [`CopyOp`]; the engine loop runs the step's copies
//! in one batch after scheduling and before the forward pass (device-to-host first, then
//! host-to-device), which is always early enough: a block handed to a new owner is only written
//! by that forward pass, and a host slot being read is locked until the copies have run.
//!
//! RAII: a [`BlockTable`] releases its blocks when dropped, a [`SwappedBlocks`] its host slots,
//! so no path out of the engine (finish, cancel, deadline, error) can leak either.
//!
//! The engine is single-threaded: the shared state is an `Rc<RefCell<_>>` whose borrows never
//! outlive a call.

use std::cell::RefCell;
use std::rc::Rc;

use super::block_pool::{BlockId, DevicePool};
use super::host_tier::{HostSlot, HostTier};
use super::prefix::{extend_keys, BlockKey, Salts};
use crate::request::CacheSalt;

#[derive(Clone, Debug)]
pub struct KvConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Host-tier capacity in blocks (0: no host tier; evicted blocks are dropped and preemption
    /// recomputes).
    pub host_slots: usize,
    pub prefix_caching: bool,
    /// Mixed into block hashes: see [`super::prefix::model_salt`]; tables for other models
    /// sharing the pool use theirs, and their block sizes ([`BlockTable::for_model`]).
    pub salt: u64,
}

/// One block's worth of data to move before the next forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyOp {
    ToHost { block: BlockId, slot: HostSlot },
    ToDevice { slot: HostSlot, block: BlockId },
}

/// Counters since start-up, in tokens or blocks as named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvCounters {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_query_tokens: u64,
    pub device_hit_tokens: u64,
    pub host_hit_tokens: u64,
    /// Cached blocks evicted from the device (copied to the host or dropped).
    pub device_evictions: u64,
    /// Of those, copied to the host tier.
    pub evictions_to_host: u64,
    /// Cached blocks dropped from the host tier.
    pub host_evictions: u64,
    pub swapped_out_blocks: u64,
    pub swapped_in_blocks: u64,
    /// Blocks put under a retention hold.
    pub retained_blocks: u64,
    /// Prefix hits on held blocks.
    pub retained_hit_blocks: u64,
    /// Held blocks evicted while held, under pressure (to the host tier, when it has room).
    pub retained_demoted_blocks: u64,
    /// Holds that ran out their time with the block still on the device.
    pub retention_expired_blocks: u64,
}

/// Current occupancy of both tiers, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvGauges {
    pub device_total: usize,
    pub device_free: usize,
    pub device_used: usize,
    /// Unreferenced blocks kept for prefix reuse (evictable).
    pub device_cached: usize,
    pub device_pinned: usize,
    /// Blocks under a retention hold.
    pub device_retained: usize,
    pub host_total: usize,
    pub host_free: usize,
    pub host_cached: usize,
    pub host_swapped: usize,
}

/// Cached tokens a sequence got at admission, by tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub device_tokens: usize,
    pub host_tokens: usize,
}

impl PrefixHit {
    pub fn tokens(&self) -> usize {
        self.device_tokens + self.host_tokens
    }
}

#[derive(Debug)]
struct KvState {
    config: KvConfig,
    device: DevicePool,
    host: HostTier,
    pending: Vec<CopyOp>,
    /// Slots read by pending copies: unlock them after the copies; swapped ones are then freed.
    reading: Vec<(HostSlot, bool)>,
    counters: KvCounters,
    /// Blocks evicted, in order, for tests to check the LRU order against.
    #[cfg(test)]
    eviction_log: Vec<BlockId>,
}

impl KvState {
    /// One block for a new owner: free, or evicted from the cache (its content saved to the host
    /// tier when there is room and the host does not have it yet).
    fn alloc_block(&mut self) -> Option<BlockId> {
        if let Some(b) = self.device.take_free() {
            return Some(b);
        }
        let (b, key, held) = self.device.take_evicted()?;
        self.counters.device_evictions += 1;
        self.counters.retained_demoted_blocks += u64::from(held);
        #[cfg(test)]
        self.eviction_log.push(b);
        if self.host.capacity() > 0 && !self.host.contains(&key) {
            if let Some((slot, dropped)) = self.host.alloc() {
                self.counters.host_evictions += u64::from(dropped.is_some());
                self.host.insert_cached(slot, key);
                self.pending.push(CopyOp::ToHost { block: b, slot });
                self.counters.evictions_to_host += 1;
            }
        }
        Some(b)
    }

    /// `n` blocks or none.
    fn alloc_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.device.num_available() < n {
            return None;
        }
        Some(
            (0..n)
                .map(|_| self.alloc_block().expect("counted"))
                .collect(),
        )
    }
}

/// Cloneable handle to the manager; clones share it.
#[derive(Clone, Debug)]
pub struct KvManager {
    state: Rc<RefCell<KvState>>,
}

impl KvManager {
    pub fn new(config: KvConfig) -> Self {
        Self {
            state: Rc::new(RefCell::new(KvState {
                device: DevicePool::new(config.num_blocks),
                host: HostTier::new(config.host_slots),
                config,
                pending: Vec::new(),
                reading: Vec::new(),
                counters: KvCounters::default(),
                #[cfg(test)]
                eviction_log: Vec::new(),
            })),
        }
    }

    pub fn block_size(&self) -> usize {
        self.state.borrow().config.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.state.borrow().config.num_blocks
    }

    /// Device blocks an allocation could get now (free plus evictable).
    pub fn num_available(&self) -> usize {
        self.state.borrow().device.num_available()
    }

    /// An empty table whose blocks come from this manager.
    pub fn table(&self) -> BlockTable {
        BlockTable {
            kv: self.clone(),
            blocks: Vec::new(),
            keys: Vec::new(),
            registered: 0,
            tenant: None,
            salt: self.state.borrow().config.salt,
            block_size: self.block_size(),
        }
    }

    /// The copies the last scheduling decisions need, to run before the next forward pass.
    /// Call [`KvManager::copies_done`] once they have run.
    pub fn take_copies(&self) -> Vec<CopyOp> {
        let mut copies = std::mem::take(&mut self.state.borrow_mut().pending);
        // Saves before loads: a slot or block can be the target of one and the source of the
        // other within a step.
        copies.sort_by_key(|c| matches!(c, CopyOp::ToDevice { .. }));
        copies
    }

    pub fn copies_done(&self) {
        let mut s = self.state.borrow_mut();
        for (slot, swapped) in std::mem::take(&mut s.reading) {
            s.host.unlock(slot);
            if swapped {
                s.host.free_swapped(slot);
            }
        }
    }

    /// Counts a prefix lookup of `query_tokens` prompt tokens that a sequence kept (lookups
    /// given back because the sequence could not be admitted yet are not counted).
    pub fn count_prefix_lookup(&self, query_tokens: usize, hit: PrefixHit) {
        let c = &mut self.state.borrow_mut().counters;
        c.prefix_query_tokens += query_tokens as u64;
        c.device_hit_tokens += hit.device_tokens as u64;
        c.host_hit_tokens += hit.host_tokens as u64;
    }

    /// Pins the cached device blocks holding `keys`; returns how many were found and pinned.
    pub fn pin(&self, keys: &[BlockKey]) -> usize {
        let mut s = self.state.borrow_mut();
        keys.iter().filter(|k| s.device.pin(k)).count()
    }

    pub fn unpin(&self, keys: &[BlockKey]) {
        let mut s = self.state.borrow_mut();
        for k in keys {
            s.device.unpin(k);
        }
    }

    /// Holds the cached device blocks with `keys` (see [`DevicePool::hold`]); returns how many
    /// were found and held.
    ///
    /// [`DevicePool::hold`]: super::block_pool::DevicePool::hold
    pub fn hold(&self, keys: &[BlockKey]) -> usize {
        let mut s = self.state.borrow_mut();
        let held = keys.iter().filter(|k| s.device.hold(k)).count();
        s.counters.retained_blocks += held as u64;
        held
    }

    /// Lets go of one [`KvManager::hold`] of `keys`: the follow-up came (`expired` false), or
    /// the time ran out (`expired`, counted). Blocks evicted meanwhile are skipped.
    pub fn unhold(&self, keys: &[BlockKey], expired: bool) {
        let mut s = self.state.borrow_mut();
        let let_go = keys.iter().filter(|k| s.device.unhold(k)).count();
        if expired {
            s.counters.retention_expired_blocks += let_go as u64;
        }
    }

    pub fn counters(&self) -> KvCounters {
        self.state.borrow().counters
    }

    pub fn gauges(&self) -> KvGauges {
        let s = self.state.borrow();
        KvGauges {
            device_total: s.device.num_blocks(),
            device_free: s.device.num_free(),
            device_used: s.device.num_used(),
            device_cached: s.device.num_evictable(),
            device_pinned: s.device.num_pinned(),
            device_retained: s.device.num_held(),
            host_total: s.host.capacity(),
            host_free: s.host.num_free(),
            host_cached: s.host.num_cached(),
            host_swapped: s.host.num_swapped(),
        }
    }

    /// Device blocks in eviction order (next first); for tests.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        self.state.borrow().device.eviction_order()
    }

    pub fn is_pinned(&self, b: BlockId) -> bool {
        self.state.borrow().device.is_pinned(b)
    }

    pub fn is_held(&self, b: BlockId) -> bool {
        self.state.borrow().device.is_held(b)
    }

    /// Blocks evicted since the last call, in order.
    #[cfg(test)]
    fn take_eviction_log(&self) -> Vec<BlockId> {
        std::mem::take(&mut self.state.borrow_mut().eviction_log)
    }

    /// The hash of the key device block `b` is cached under, if any; for tests.
    pub fn cached_hash(&self, b: BlockId) -> Option<super::prefix::BlockHash> {
        self.state.borrow().device.cached_hash(b)
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.state.borrow().device.refs(b)
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        let s = self.state.borrow();
        s.device.check_invariants()?;
        s.host.check_invariants()
    }
}

/// The device blocks of one sequence, in position order: token `p` lives in
/// `blocks[p / block_size]`. Leading blocks may be shared with other sequences (prefix reuse).
#[derive(Debug)]
pub struct BlockTable {
    kv: KvManager,
    blocks: Vec<BlockId>,
    /// Keys of the sequence's full blocks computed so far (they depend only on its tokens, so
    /// they survive preemption).
    keys: Vec<BlockKey>,
    /// Leading blocks already offered to the prefix cache.
    registered: usize,
    /// Whose blocks the sequence may share; `None`: everyone's.
    tenant: Option<CacheSalt>,
    /// The salt of the model the blocks are for (see [`super::prefix::model_salt`]).
    salt: u64,
    /// Tokens per block, as the model lays them out.
    block_size: usize,
}

impl BlockTable {
    /// The same table, sharing cached blocks as `tenant` says.
    pub fn salted(mut self, tenant: Option<CacheSalt>) -> Self {
        self.tenant = tenant;
        self
    }

    /// The same table, for the model whose salt is `salt` and whose blocks hold `block_size`
    /// tokens: its blocks are never shared with another model's, whatever their tokens.
    pub fn for_model(mut self, salt: u64, block_size: usize) -> Self {
        self.salt = salt;
        self.block_size = block_size;
        self
    }

    /// Tokens per block: token `p` lives in `blocks()[p / block_size()]`.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    fn salts(&self) -> Salts {
        Salts {
            model: self.salt,
            tenant: self.tenant,
        }
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Grows the table to `n` blocks; all or nothing. Returns false when too few are available.
    pub fn grow_to(&mut self, n: usize) -> bool {
        if n <= self.blocks.len() {
            return true;
        }
        let mut s = self.kv.state.borrow_mut();
        match s.alloc_blocks(n - self.blocks.len()) {
            Some(new) => {
                self.blocks.extend(new);
                true
            }
            None => false,
        }
    }

    /// Gives every block back (preemption by recompute, or the end of the sequence).
    pub fn clear(&mut self) {
        let mut s = self.kv.state.borrow_mut();
        // Tail first, so that the tail is evicted before the prefix it extends.
        for &b in self.blocks.iter().rev() {
            s.device.release(b);
        }
        self.blocks.clear();
        self.registered = 0;
    }

    /// For an empty table: reuses the cached blocks of the longest cached prefix of `tokens`,
    /// from the device or copied back from the host. Never all of `tokens`: the last token must
    /// be computed for its logits.
    pub fn attach_prefix(&mut self, tokens: &[u32]) -> PrefixHit {
        debug_assert!(self.blocks.is_empty());
        let mut s = self.kv.state.borrow_mut();
        let mut hit = PrefixHit::default();
        if !s.config.prefix_caching || tokens.is_empty() {
            return hit;
        }
        let bs = self.block_size;
        let usable = (tokens.len() - 1) / bs;
        extend_keys(self.salts(), &tokens[..usable * bs], bs, &mut self.keys);
        for key in &self.keys[..usable] {
            if let Some((b, held)) = s.device.acquire_cached(key) {
                s.counters.retained_hit_blocks += u64::from(held);
                self.blocks.push(b);
                hit.device_tokens += bs;
                continue;
            }
            let Some(slot) = s.host.lookup(key) else {
                break;
            };
            // Locked first: making room on the device may save a block to the host, and that
            // must not take this slot.
            s.host.lock(slot);
            let Some(b) = s.alloc_block() else {
                s.host.unlock(slot);
                break;
            };
            s.reading.push((slot, false));
            s.pending.push(CopyOp::ToDevice { slot, block: b });
            // Registered now: the copy lands before anyone reads it.
            s.device.register(b, key);
            self.blocks.push(b);
            hit.host_tokens += bs;
        }
        self.registered = self.blocks.len();
        hit
    }

    /// Offers the blocks that `tokens[..computed]` fills to the prefix cache.
    pub fn register_full(&mut self, tokens: &[u32], computed: usize) {
        let mut s = self.kv.state.borrow_mut();
        if !s.config.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let full = (computed / bs).min(self.blocks.len());
        if full <= self.registered {
            return;
        }
        extend_keys(self.salts(), &tokens[..full * bs], bs, &mut self.keys);
        for i in self.registered..full {
            s.device.register(self.blocks[i], &self.keys[i]);
        }
        self.registered = full;
    }

    /// Keys of the full blocks among the first `tokens` tokens, for pinning.
    pub fn prefix_keys(&self, tokens: usize) -> Vec<BlockKey> {
        let n = (tokens / self.block_size).min(self.registered);
        self.keys[..n].to_vec()
    }

    /// Copies every block to the host tier and frees them on the device. `None`, with nothing
    /// changed, when the host tier has no room.
    pub fn swap_out(&mut self) -> Option<SwappedBlocks> {
        let slots = {
            let mut s = self.kv.state.borrow_mut();
            if s.host.num_available() < self.blocks.len() {
                return None;
            }
            let mut slots = Vec::with_capacity(self.blocks.len());
            for &block in &self.blocks {
                let (slot, dropped) = s.host.alloc().expect("counted");
                s.counters.host_evictions += u64::from(dropped.is_some());
                s.host.insert_swapped(slot);
                s.pending.push(CopyOp::ToHost { block, slot });
                slots.push(slot);
            }
            s.counters.swapped_out_blocks += slots.len() as u64;
            slots
        };
        self.clear();
        Some(SwappedBlocks {
            kv: self.kv.clone(),
            slots,
        })
    }

    /// Copies swapped-out blocks back into new device blocks, for an empty table. Gives the
    /// swapped blocks back when too few device blocks are available.
    pub fn swap_in(&mut self, mut swapped: SwappedBlocks) -> Result<(), SwappedBlocks> {
        debug_assert!(self.blocks.is_empty());
        let mut s = self.kv.state.borrow_mut();
        let Some(blocks) = s.alloc_blocks(swapped.slots.len()) else {
            drop(s);
            return Err(swapped);
        };
        for (&slot, &block) in swapped.slots.iter().zip(&blocks) {
            s.host.lock(slot);
            s.reading.push((slot, true));
            s.pending.push(CopyOp::ToDevice { slot, block });
        }
        s.counters.swapped_in_blocks += blocks.len() as u64;
        swapped.slots.clear();
        self.blocks = blocks;
        Ok(())
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.clear();
    }
}

/// A preempted sequence's blocks, parked in the host tier.
#[derive(Debug)]
pub struct SwappedBlocks {
    kv: KvManager,
    slots: Vec<HostSlot>,
}

impl SwappedBlocks {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

impl Drop for SwappedBlocks {
    fn drop(&mut self) {
        let mut s = self.kv.state.borrow_mut();
        for &slot in &self.slots {
            s.host.free_swapped(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BS: usize = 4;

    fn manager(blocks: usize, host: usize) -> KvManager {
        KvManager::new(KvConfig {
            num_blocks: blocks,
            block_size: BS,
            host_slots: host,
            prefix_caching: true,
            salt: 7,
        })
    }

    /// Fills `tokens` into a fresh table as the engine would: prefix reuse, then blocks for the
    /// rest, then registration.
    fn fill(kv: &KvManager, tokens: &[u32]) -> (BlockTable, PrefixHit) {
        let mut t = kv.table();
        let hit = t.attach_prefix(tokens);
        assert!(t.grow_to(tokens.len().div_ceil(BS)));
        t.register_full(tokens, tokens.len());
        (t, hit)
    }

    #[test]
    fn a_shared_prefix_is_computed_once() {
        let kv = manager(16, 0);
        let prompt: Vec<u32> = (0..13).collect();
        let (a, hit) = fill(&kv, &prompt);
        assert_eq!(hit.tokens(), 0);
        let mut other = prompt[..12].to_vec();
        other.extend([90, 91]);
        let (b, hit) = fill(&kv, &other);
        assert_eq!(hit.device_tokens, 12);
        assert_eq!(&a.blocks()[..3], &b.blocks()[..3]);
        assert_eq!(kv.refs(a.blocks()[0]), 2);
        drop(a);
        drop(b);
        // A prompt that is entirely cached still computes its last token.
        let (c, hit) = fill(&kv, &prompt[..12]);
        assert_eq!(hit.device_tokens, 8);
        drop(c);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn evicted_blocks_come_back_from_the_host() {
        let kv = manager(4, 8);
        let prompt: Vec<u32> = (0..9).collect();
        drop(fill(&kv, &prompt));
        // Another sequence takes every block, evicting the cached two to the host.
        let (hog, _) = fill(&kv, &[50; 16]);
        let copies = kv.take_copies();
        assert_eq!(
            copies
                .iter()
                .filter(|c| matches!(c, CopyOp::ToHost { .. }))
                .count(),
            2
        );
        kv.copies_done();
        drop(hog);
        let (t, hit) = fill(&kv, &prompt);
        assert_eq!(hit.host_tokens, 8, "both blocks come back from the host");
        let loads = kv.take_copies();
        assert_eq!(
            loads
                .iter()
                .filter(|c| matches!(c, CopyOp::ToDevice { .. }))
                .count(),
            2
        );
        kv.copies_done();
        drop(t);
        assert!(kv.counters().evictions_to_host >= 2);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn swapped_blocks_return_in_one_batch() {
        let kv = manager(4, 4);
        let (mut t, _) = fill(&kv, &[3; 10]);
        let swapped = t.swap_out().unwrap();
        assert!(t.is_empty());
        assert_eq!(kv.gauges().host_swapped, 3);
        let out = kv.take_copies();
        assert_eq!(out.len(), 3);
        kv.copies_done();
        t.swap_in(swapped).unwrap();
        let back = kv.take_copies();
        assert_eq!(
            back.iter()
                .filter(|c| matches!(c, CopyOp::ToDevice { .. }))
                .count(),
            3
        );
        kv.copies_done();
        assert_eq!(kv.gauges().host_swapped, 0);
        drop(t);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn a_full_host_falls_back_to_none() {
        let kv = manager(4, 1);
        let (mut t, _) = fill(&kv, &[3; 10]);
        assert!(t.swap_out().is_none());
        assert_eq!(t.len(), 3, "nothing changed");
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// A new sequence: `prefix` selects one of a few shared prefixes, `tail` its own tokens.
        Allocate {
            prefix: usize,
            tail: usize,
        },
        Finish(usize),
        Cancel(usize),
        /// Preempt: swap out, or drop the blocks when the host is full.
        Preempt(usize),
        SwapIn(usize),
        Grow(usize),
        Pin(usize),
        Unpin(usize),
        /// A turn ends in tool calls: its blocks are held, then the sequence finishes.
        Retain(usize),
        /// A hold is let go: its follow-up came, or its time ran out.
        LetGo {
            hold: usize,
            expired: bool,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0usize..3, 0usize..12).prop_map(|(prefix, tail)| Op::Allocate { prefix, tail }),
            1 => any::<usize>().prop_map(Op::Finish),
            1 => any::<usize>().prop_map(Op::Cancel),
            1 => any::<usize>().prop_map(Op::Preempt),
            1 => any::<usize>().prop_map(Op::SwapIn),
            1 => any::<usize>().prop_map(Op::Grow),
            1 => any::<usize>().prop_map(Op::Pin),
            1 => any::<usize>().prop_map(Op::Unpin),
            1 => any::<usize>().prop_map(Op::Retain),
            1 => (any::<usize>(), any::<bool>()).prop_map(|(hold, expired)| Op::LetGo { hold, expired }),
        ]
    }

    struct Seq {
        id: u32,
        tokens: Vec<u32>,
        table: BlockTable,
        swapped: Option<SwappedBlocks>,
        /// Leading blocks whose content is in place.
        valid: usize,
    }

    impl Seq {
        /// What each of its blocks must hold: a full block its key's hash, the partial last
        /// block a mark of its own.
        fn expected(&self) -> Vec<u64> {
            let mut keys = Vec::new();
            let salts = Salts {
                model: 7,
                tenant: None,
            };
            extend_keys(salts, &self.tokens, BS, &mut keys);
            let mut want: Vec<u64> = keys.iter().map(|k| k.hash.0).collect();
            if !self.tokens.len().is_multiple_of(BS) {
                want.push(u64::from(self.id) << 32 | self.tokens.len() as u64);
            }
            want
        }
    }

    /// Stand-ins for the two tiers' memory: one number per block, moved by the copies exactly
    /// as the engine loop moves the real keys and values.
    struct Contents {
        device: Vec<u64>,
        host: Vec<u64>,
    }

    impl Contents {
        fn run_copies(&mut self, kv: &KvManager) {
            for copy in kv.take_copies() {
                match copy {
                    CopyOp::ToHost { block, slot } => {
                        self.host[slot.index()] = self.device[block.index()]
                    }
                    CopyOp::ToDevice { slot, block } => {
                        self.device[block.index()] = self.host[slot.index()]
                    }
                }
            }
            kv.copies_done();
        }
    }

    proptest! {
        /// Over random allocate / share prefix / finish / cancel / preempt / swap out / swap in /
        /// evict / pin / retain / let go or expire: the books stay consistent after every
        /// operation, evictions follow LRU order with held blocks last (demoted only once no
        /// plain cached block is left), pinned blocks are never evicted, every sequence's blocks
        /// hold its own keys and values after each step's copies (shared, copied back from the
        /// host or swapped in), and once every hold has expired nothing leaks.
        #[test]
        fn kv_invariants(ops in prop::collection::vec(op(), 1..150), blocks in 4usize..20, host in 0usize..12) {
            let kv = manager(blocks, host);
            let prefixes: [Vec<u32>; 3] = [(0..8).collect(), (100..112).collect(), (200..204).collect()];
            let mut mem = Contents { device: vec![0; blocks], host: vec![0; host] };
            let mut seqs: Vec<Seq> = Vec::new();
            let mut pins: Vec<Vec<BlockKey>> = Vec::new();
            let mut holds: Vec<Vec<BlockKey>> = Vec::new();
            let mut next_token = 1000u32;
            let mut next_id = 0u32;
            for op in ops {
                // Tables given up within an operation are dropped after its checks, so that what
                // they held and released does not blur the eviction order checked below.
                let mut given_up = Vec::new();
                let order = kv.eviction_order();
                let evictions = kv.counters().device_evictions;
                let demoted = kv.counters().retained_demoted_blocks;
                let pinned: Vec<(BlockId, Option<_>)> = (0..blocks as u32)
                    .map(BlockId)
                    .filter(|&b| kv.is_pinned(b))
                    .map(|b| (b, kv.cached_hash(b)))
                    .collect();
                match op {
                    Op::Allocate { prefix, tail } => {
                        let mut tokens = prefixes[prefix].clone();
                        tokens.extend((0..tail).map(|_| { next_token += 1; next_token }));
                        let mut table = kv.table();
                        let hit = table.attach_prefix(&tokens);
                        prop_assert!(hit.tokens() < tokens.len());
                        if table.grow_to(tokens.len().div_ceil(BS)) {
                            table.register_full(&tokens, tokens.len());
                            next_id += 1;
                            let valid = hit.tokens() / BS;
                            seqs.push(Seq { id: next_id, tokens, table, swapped: None, valid });
                        } else {
                            given_up.push(table);
                        }
                    }
                    Op::Finish(i) | Op::Cancel(i) if !seqs.is_empty() => {
                        seqs.remove(i % seqs.len());
                    }
                    Op::Preempt(i) if !seqs.is_empty() => {
                        let n = seqs.len();
                        let s = &mut seqs[i % n];
                        if s.swapped.is_none() && !s.table.is_empty() {
                            match s.table.swap_out() {
                                Some(sw) => s.swapped = Some(sw),
                                None => s.table.clear(),
                            }
                            s.valid = 0;
                        }
                    }
                    Op::SwapIn(i) if !seqs.is_empty() => {
                        let n = seqs.len();
                        let s = &mut seqs[i % n];
                        if let Some(sw) = s.swapped.take() {
                            match s.table.swap_in(sw) {
                                Ok(()) => s.valid = s.table.len(),
                                Err(sw) => s.swapped = Some(sw),
                            }
                        }
                    }
                    Op::Grow(i) if !seqs.is_empty() => {
                        let n = seqs.len();
                        let s = &mut seqs[i % n];
                        if s.swapped.is_none() && !s.table.is_empty() {
                            s.tokens.extend([next_token; BS]);
                            next_token += 1;
                            if s.table.grow_to(s.tokens.len().div_ceil(BS)) {
                                s.table.register_full(&s.tokens, s.tokens.len());
                                // The old partial block is rewritten with its new tokens.
                                s.valid = s.valid.min((s.tokens.len() - BS) / BS);
                            } else {
                                s.tokens.truncate(s.tokens.len() - BS);
                            }
                        }
                    }
                    Op::Pin(i) if !seqs.is_empty() => {
                        let s = &seqs[i % seqs.len()];
                        let keys = s.table.prefix_keys(s.tokens.len());
                        kv.pin(&keys);
                        pins.push(keys);
                    }
                    Op::Unpin(i) if !pins.is_empty() => {
                        let keys = pins.remove(i % pins.len());
                        kv.unpin(&keys);
                    }
                    Op::Retain(i) if !seqs.is_empty() => {
                        let s = seqs.remove(i % seqs.len());
                        let keys = s.table.prefix_keys(s.tokens.len());
                        let held = kv.hold(&keys);
                        prop_assert!(held <= keys.len());
                        holds.push(keys);
                        given_up.push(s.table);
                    }
                    Op::LetGo { hold, expired } if !holds.is_empty() => {
                        let keys = holds.remove(hold % holds.len());
                        kv.unhold(&keys, expired);
                    }
                    _ => {}
                }
                // Evictions took the least recently used evictable blocks: the evicted ones are
                // the first of the old order, skipping the blocks prefix hits and pins took back.
                let evicted = kv.take_eviction_log();
                prop_assert_eq!(evicted.len() as u64, kv.counters().device_evictions - evictions);
                // Held blocks go last: one is demoted only once no plain cached block is left.
                if kv.counters().retained_demoted_blocks > demoted {
                    let plain = kv.eviction_order().into_iter().filter(|&b| !kv.is_held(b)).count();
                    prop_assert_eq!(plain, 0, "a held block was demoted before a plain one");
                }
                let still = kv.eviction_order();
                let expect: Vec<BlockId> = order
                    .iter()
                    .copied()
                    .filter(|b| evicted.contains(b) || still.contains(b))
                    .take(evicted.len())
                    .collect();
                prop_assert_eq!(&evicted, &expect, "evictions out of LRU order");
                // Pinned blocks are never evicted.
                for (b, key) in pinned {
                    prop_assert!(!evicted.contains(&b), "pinned block {:?} was evicted", b);
                    prop_assert_eq!(kv.cached_hash(b), key);
                }
                if let Err(e) = kv.check_invariants() {
                    prop_assert!(false, "{}", e);
                }
                drop(given_up);
                // A step: the queued copies run, then the forward pass writes what was computed.
                mem.run_copies(&kv);
                for s in seqs.iter_mut().filter(|s| s.swapped.is_none()) {
                    let want = s.expected();
                    for (i, &b) in s.table.blocks().iter().enumerate().skip(s.valid) {
                        mem.device[b.index()] = want[i];
                    }
                    s.valid = s.table.len();
                }
                for s in seqs.iter().filter(|s| s.swapped.is_none()) {
                    let want = s.expected();
                    for (i, &b) in s.table.blocks().iter().enumerate() {
                        prop_assert_eq!(mem.device[b.index()], want[i], "seq {} block {}", s.id, i);
                    }
                }
            }
            mem.run_copies(&kv);
            drop(seqs);
            for keys in pins {
                kv.unpin(&keys);
            }
            for keys in holds {
                kv.unhold(&keys, true);
            }
            let g = kv.gauges();
            prop_assert_eq!(g.device_used, 0);
            prop_assert_eq!(g.device_pinned, 0);
            prop_assert_eq!(g.device_retained, 0);
            prop_assert_eq!(g.device_free + g.device_cached, blocks);
            prop_assert_eq!(g.host_swapped, 0);
            prop_assert_eq!(g.host_free + g.host_cached, host);
            if let Err(e) = kv.check_invariants() {
                prop_assert!(false, "{}", e);
            }
        }
    }
}

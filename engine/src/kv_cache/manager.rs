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
use std::hash::{DefaultHasher, Hash, Hasher};
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
        let config = &self.state.borrow().config;
        let shape = KvShape::whole(config.block_size);
        BlockTable {
            kv: self.clone(),
            groups: vec![GroupTable::new(shape.whole, config.salt, (0, 1))],
            shape,
            salt: config.salt,
            tenant: None,
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

/// How one group of a model's layers keeps its keys and values: `block_size` tokens a block,
/// and the sliding window its layers attend over (`None`: every position). Layers with a window
/// keep blocks of their own, so that the blocks their window has left behind can go while the
/// other layers still read theirs: the memory a sliding-window layer holds stays bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGroup {
    pub block_size: usize,
    pub window: Option<usize>,
}

impl KvGroup {
    /// Every position kept, in blocks of `block_size` tokens.
    pub fn whole(block_size: usize) -> Self {
        Self {
            block_size,
            window: None,
        }
    }

    /// The first block that the token at `position`, and every one after it, still reads.
    pub fn first_kept(&self, position: usize) -> usize {
        self.window
            .map_or(0, |w| (position + 1).saturating_sub(w) / self.block_size)
    }

    /// Blocks held to compute the tokens up to `end`, the next one at `position`.
    pub fn blocks_for(&self, position: usize, end: usize) -> usize {
        end.div_ceil(self.block_size)
            .saturating_sub(self.first_kept(position))
    }
}

/// How a model keeps its blocks: every layer together (`whole`), and, when some of its layers
/// attend over a sliding window, those apart from the others (`split`, see [`KvGroup`]). A
/// sequence keeps its layers together while it fits in the window, so that short sequences
/// share their prefixes block by block (a split model's blocks hold more tokens of its global
/// layers, and a prefix hit ends on a boundary of every group's blocks); a longer one keeps them
/// apart, and one that grows past the window while together has its cache computed again, once,
/// apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub whole: KvGroup,
    /// Empty when no layer has a window.
    pub split: Vec<KvGroup>,
}

impl KvShape {
    /// Every layer together, in blocks of `block_size` tokens.
    pub fn whole(block_size: usize) -> Self {
        Self {
            whole: KvGroup::whole(block_size),
            split: Vec::new(),
        }
    }

    /// The narrowest window of the layers with one.
    fn window(&self) -> Option<usize> {
        self.split.iter().filter_map(|g| g.window).min()
    }

    /// The groups a sequence of `tokens` tokens keeps.
    fn groups_for(&self, tokens: usize) -> &[KvGroup] {
        match self.window() {
            Some(w) if tokens > w => &self.split,
            _ => std::slice::from_ref(&self.whole),
        }
    }

    /// The groups of the longest sequences.
    pub fn longest(&self) -> &[KvGroup] {
        self.groups_for(usize::MAX)
    }
}

/// Where a block the window left behind was: never read, never written.
pub const GONE: BlockId = BlockId(u32::MAX);

/// The blocks of one layer group of a sequence, in position order: token `p` lives in
/// `blocks[p / block_size]`. The first `dropped` were given back ([`GONE`]).
#[derive(Debug)]
struct GroupTable {
    shape: KvGroup,
    /// What its block keys are salted with: the model's salt, and the group's index past the
    /// first (a group's blocks hold other layers than another's).
    salt: u64,
    blocks: Vec<BlockId>,
    dropped: usize,
    /// Keys of the group's full blocks computed so far (they depend only on the sequence's
    /// tokens, so they survive preemption).
    keys: Vec<BlockKey>,
    /// Leading blocks already offered to the prefix cache (or dropped).
    registered: usize,
}

impl GroupTable {
    /// The table of group `index` of `groups`.
    fn new(shape: KvGroup, model_salt: u64, (index, groups): (usize, usize)) -> Self {
        let salt = match groups {
            1 => model_salt,
            _ => {
                let mut h = DefaultHasher::new();
                (model_salt, groups, index).hash(&mut h);
                h.finish()
            }
        };
        Self {
            shape,
            salt,
            blocks: Vec::new(),
            dropped: 0,
            keys: Vec::new(),
            registered: 0,
        }
    }

    fn held(&self) -> &[BlockId] {
        &self.blocks[self.dropped..]
    }

    fn clear(&mut self, s: &mut KvState) {
        // Tail first, so that the tail is evicted before the prefix it extends.
        for &b in self.held().iter().rev() {
            s.device.release(b);
        }
        self.blocks.clear();
        self.dropped = 0;
        self.registered = 0;
    }

    /// Gives back the blocks that the token at `position` and those after it no longer read.
    fn drop_behind(&mut self, s: &mut KvState, position: usize) {
        let keep = self.shape.first_kept(position).min(self.blocks.len());
        for b in &mut self.blocks[self.dropped..keep] {
            s.device.release(*b);
            *b = GONE;
        }
        self.dropped = self.dropped.max(keep);
        self.registered = self.registered.max(keep);
    }
}

/// The device blocks of one sequence: a table per layer group of its model (one, unless some of
/// its layers attend over a sliding window). Leading blocks may be shared with other sequences
/// (prefix reuse).
#[derive(Debug)]
pub struct BlockTable {
    kv: KvManager,
    /// How its model keeps blocks, and the salt of its blocks' keys.
    shape: KvShape,
    salt: u64,
    groups: Vec<GroupTable>,
    /// Whose blocks the sequence may share; `None`: everyone's.
    tenant: Option<CacheSalt>,
}

impl BlockTable {
    /// The same table, sharing cached blocks as `tenant` says.
    pub fn salted(mut self, tenant: Option<CacheSalt>) -> Self {
        self.tenant = tenant;
        self
    }

    /// The same table, for the model whose salt is `salt` and which keeps its blocks as `shape`
    /// says, for a sequence of `tokens` tokens: its blocks are never shared with another
    /// model's, whatever their tokens.
    pub fn for_model(mut self, salt: u64, shape: &KvShape, tokens: usize) -> Self {
        self.shape = shape.clone();
        self.salt = salt;
        self.shape_for(tokens);
        self
    }

    /// For an empty table: keeps the groups a sequence of `tokens` tokens keeps (see
    /// [`KvShape`]).
    pub fn shape_for(&mut self, tokens: usize) {
        debug_assert!(self.is_empty());
        let groups = self.shape.groups_for(tokens);
        self.groups = (groups.iter().enumerate())
            .map(|(i, &g)| GroupTable::new(g, self.salt, (i, groups.len())))
            .collect();
    }

    /// Whether the sequence, `computed` tokens in, has grown past its model's window while
    /// keeping every layer together: it should start again with its layers apart.
    pub fn outgrew_window(&self, computed: usize) -> bool {
        self.groups.len() == 1 && self.shape.groups_for(computed).len() > 1
    }

    fn salts(&self, group: &GroupTable) -> Salts {
        Salts {
            model: group.salt,
            tenant: self.tenant,
        }
    }

    /// The first layer group's blocks ([`GONE`] where given back): the model's only group
    /// unless some of its layers have a window.
    pub fn blocks(&self) -> &[BlockId] {
        &self.groups[0].blocks
    }

    /// Every layer group's blocks, as the forward pass reads them.
    pub fn tables(&self) -> Vec<Vec<BlockId>> {
        self.groups.iter().map(|g| g.blocks.clone()).collect()
    }

    /// Every block held, of every group.
    pub fn held(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.groups.iter().flat_map(|g| g.held().iter().copied())
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.groups.iter().map(|g| g.held().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks the sequence holds to compute its tokens up to `end`, the next one at `position`.
    pub fn blocks_for(&self, position: usize, end: usize) -> usize {
        (self.groups.iter())
            .map(|g| g.shape.blocks_for(position, end))
            .sum()
    }

    /// Whether every group's blocks reach past the first `tokens` tokens.
    pub fn covers(&self, tokens: usize) -> bool {
        (self.groups.iter()).all(|g| g.blocks.len() * g.shape.block_size >= tokens)
    }

    /// Whether `swapped` holds this sequence's first `tokens` tokens.
    pub fn covered_by(&self, swapped: &SwappedBlocks, tokens: usize) -> bool {
        (self.groups.iter().zip(&swapped.groups))
            .all(|(g, &(dropped, n))| (dropped + n) * g.shape.block_size >= tokens)
    }

    /// Grows every group's table to hold the tokens up to `end`; all or nothing. Returns false
    /// when too few blocks are available.
    pub fn grow_to(&mut self, end: usize) -> bool {
        let want = |g: &GroupTable| {
            end.div_ceil(g.shape.block_size)
                .saturating_sub(g.blocks.len())
        };
        let n: usize = self.groups.iter().map(want).sum();
        if n == 0 {
            return true;
        }
        let mut s = self.kv.state.borrow_mut();
        let Some(mut new) = s.alloc_blocks(n) else {
            return false;
        };
        for g in &mut self.groups {
            let k = want(g);
            g.blocks.extend(new.drain(..k));
        }
        true
    }

    /// Gives back the blocks past those holding the first `end` tokens (the tail a rejected
    /// draft grew, never offered to the prefix cache: its tokens were never computed).
    pub fn shrink_to(&mut self, end: usize) {
        let mut s = self.kv.state.borrow_mut();
        for g in &mut self.groups {
            let keep = end.div_ceil(g.shape.block_size).max(g.dropped);
            debug_assert!(
                keep >= g.registered,
                "a registered block holds computed tokens"
            );
            for b in g.blocks.drain(keep.min(g.blocks.len())..).rev() {
                s.device.release(b);
            }
        }
    }

    /// Gives every block back (preemption by recompute, or the end of the sequence).
    pub fn clear(&mut self) {
        let mut s = self.kv.state.borrow_mut();
        for g in &mut self.groups {
            g.clear(&mut s);
        }
    }

    /// For an empty table: reuses the cached blocks of the longest cached prefix of `tokens`,
    /// from the device or copied back from the host. Never all of `tokens`: the last token must
    /// be computed for its logits. The prefix ends on a block boundary of every group, and a
    /// group with a window needs only the blocks its window still reads there.
    pub fn attach_prefix(&mut self, tokens: &[u32]) -> PrefixHit {
        debug_assert!(self.is_empty());
        let kv = self.kv.clone();
        let mut s = kv.state.borrow_mut();
        if !s.config.prefix_caching || tokens.is_empty() {
            return PrefixHit::default();
        }
        let step = (self.groups.iter()).fold(1, |l, g| lcm(l, g.shape.block_size));
        let most = (tokens.len() - 1) / step * step;
        // Per group, how many of its first `i` blocks are in neither tier.
        let mut missing = Vec::with_capacity(self.groups.len());
        for g in 0..self.groups.len() {
            let salts = self.salts(&self.groups[g]);
            let group = &mut self.groups[g];
            let bs = group.shape.block_size;
            extend_keys(salts, &tokens[..most], bs, &mut group.keys);
            let mut before = vec![0; most / bs + 1];
            for (i, key) in group.keys[..most / bs].iter().enumerate() {
                let cached = s.device.contains(key) || s.host.contains(key);
                before[i + 1] = before[i] + usize::from(!cached);
            }
            missing.push(before);
        }
        let cached = |groups: &[GroupTable], missing: &[Vec<usize>], end: usize| {
            groups.iter().zip(missing).all(|(g, before)| {
                let first = g.shape.first_kept(end);
                before[end / g.shape.block_size] == before[first.min(end / g.shape.block_size)]
            })
        };
        let mut end = most;
        while end > 0 {
            if cached(&self.groups, &missing, end) {
                if let Some(hit) = self.take_cached(&mut s, end) {
                    return hit;
                }
            }
            end -= step;
        }
        PrefixHit::default()
    }

    /// Takes the cached blocks each group keeps for a prefix of `end` tokens; `None`, with
    /// nothing taken, when a block copied back from the host finds no room on the device.
    fn take_cached(&mut self, s: &mut KvState, end: usize) -> Option<PrefixHit> {
        let mut hit = PrefixHit::default();
        let mut retained = 0;
        for g in 0..self.groups.len() {
            let group = &mut self.groups[g];
            let (bs, first) = (group.shape.block_size, group.shape.first_kept(end));
            group.blocks.resize(first, GONE);
            group.dropped = first;
            let mut complete = true;
            for key in &group.keys[first..end / bs] {
                if let Some((b, held)) = s.device.acquire_cached(key) {
                    retained += u64::from(held);
                    group.blocks.push(b);
                    continue;
                }
                // Making room for one block may have evicted another of the prefix, to the
                // host or for good.
                let Some(slot) = s.host.lookup(key) else {
                    complete = false;
                    break;
                };
                // Locked first: making room on the device may save a block to the host, and
                // that must not take this slot.
                s.host.lock(slot);
                let Some(b) = s.alloc_block() else {
                    s.host.unlock(slot);
                    complete = false;
                    break;
                };
                s.reading.push((slot, false));
                s.pending.push(CopyOp::ToDevice { slot, block: b });
                // Registered now: the copy lands before anyone reads it.
                s.device.register(b, key);
                group.blocks.push(b);
                // Counted as the first group found them.
                if g == 0 {
                    hit.host_tokens += bs;
                }
            }
            group.registered = group.blocks.len();
            if !complete {
                for group in &mut self.groups[..=g] {
                    group.clear(s);
                }
                return None;
            }
        }
        s.counters.retained_hit_blocks += retained;
        hit.device_tokens = end - hit.host_tokens;
        Some(hit)
    }

    /// The first `computed` of `tokens` are in the cache: offers the blocks they fill to the
    /// prefix cache, and gives back those the window has left behind.
    pub fn advance(&mut self, tokens: &[u32], computed: usize) {
        let mut s = self.kv.state.borrow_mut();
        for g in 0..self.groups.len() {
            let salts = self.salts(&self.groups[g]);
            let group = &mut self.groups[g];
            let bs = group.shape.block_size;
            let full = (computed / bs).min(group.blocks.len());
            if s.config.prefix_caching && full > group.registered {
                extend_keys(salts, &tokens[..full * bs], bs, &mut group.keys);
                for i in group.registered..full {
                    s.device.register(group.blocks[i], &group.keys[i]);
                }
                group.registered = full;
            }
            group.drop_behind(&mut s, computed);
        }
    }

    /// Keys of every group's full blocks among the first `tokens` tokens, for pinning.
    pub fn prefix_keys(&self, tokens: usize) -> Vec<BlockKey> {
        (self.groups.iter())
            .flat_map(|g| {
                let n = (tokens / g.shape.block_size).min(g.registered);
                g.keys[..n.min(g.keys.len())].iter().cloned()
            })
            .collect()
    }

    /// Copies every block held to the host tier and frees them on the device. `None`, with
    /// nothing changed, when the host tier has no room.
    pub fn swap_out(&mut self) -> Option<SwappedBlocks> {
        let held = self.len();
        let slots = {
            let mut s = self.kv.state.borrow_mut();
            if s.host.num_available() < held {
                return None;
            }
            let mut slots = Vec::with_capacity(held);
            for block in self.held() {
                let (slot, dropped) = s.host.alloc().expect("counted");
                s.counters.host_evictions += u64::from(dropped.is_some());
                s.host.insert_swapped(slot);
                s.pending.push(CopyOp::ToHost { block, slot });
                slots.push(slot);
            }
            s.counters.swapped_out_blocks += slots.len() as u64;
            slots
        };
        let groups = (self.groups.iter())
            .map(|g| (g.dropped, g.held().len()))
            .collect();
        self.clear();
        Some(SwappedBlocks {
            kv: self.kv.clone(),
            slots,
            groups,
        })
    }

    /// Copies swapped-out blocks back into new device blocks, for an empty table. Gives the
    /// swapped blocks back when too few device blocks are available.
    pub fn swap_in(&mut self, mut swapped: SwappedBlocks) -> Result<(), SwappedBlocks> {
        debug_assert!(self.is_empty());
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
        let mut blocks = blocks.into_iter();
        for (g, &(dropped, n)) in self.groups.iter_mut().zip(&swapped.groups) {
            g.blocks = vec![GONE; dropped];
            g.blocks.extend(blocks.by_ref().take(n));
            g.dropped = dropped;
            g.registered = dropped;
        }
        Ok(())
    }
}

/// The largest `n` in `0..=most` for which `fits(n)` holds, where `fits` holds up to some `n`
/// and for none past it (as "the blocks for `n` tokens fit").
pub fn most_that_fit(most: usize, fits: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, most);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        match fits(mid) {
            true => lo = mid,
            false => hi = mid - 1,
        }
    }
    lo
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
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
    /// Per layer group: the blocks it had given back, and how many of the slots are its.
    groups: Vec<(usize, usize)>,
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
        assert!(t.grow_to(tokens.len()));
        t.advance(tokens, tokens.len());
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

    /// A model whose windowed layers keep blocks of their own (5 tokens, a window of 7
    /// positions) beside its global layers' (10 tokens): as the sequence advances, the
    /// windowed blocks it left behind go back to the pool (cached), so it holds what the window
    /// and the global layers read; another sequence with the same tokens finds the prefix
    /// although the first of those blocks was evicted since; a swap keeps the tables' shape.
    #[test]
    fn a_window_gives_back_the_blocks_it_left() {
        let kv = manager(8, 8);
        let shape = KvShape {
            whole: KvGroup::whole(4),
            split: vec![
                KvGroup::whole(10),
                KvGroup {
                    block_size: 5,
                    window: Some(7),
                },
            ],
        };
        let tokens: Vec<u32> = (0..31).collect();
        let mut a = kv.table().for_model(7, &shape, tokens.len());
        for end in [10, 20, 30] {
            assert!(a.grow_to(end));
            a.advance(&tokens, end);
        }
        // Token 30 reads positions 24..=30: windowed blocks 4 and 5, global blocks 0..3.
        assert_eq!(a.tables()[1][..4], [GONE; 4]);
        assert_eq!(a.len(), 3 + 2);
        assert_eq!(a.blocks_for(30, 31), 4 + 3);
        // Growing to 30 took the two free blocks and evicted the first windowed one.
        assert_eq!(kv.gauges().device_cached, 3);
        assert_eq!(kv.counters().device_evictions, 1);
        kv.take_copies();
        kv.copies_done();

        let mut b = kv.table().for_model(7, &shape, tokens.len());
        let hit = b.attach_prefix(&tokens);
        assert_eq!(hit.tokens(), 30);
        assert_eq!(b.tables(), a.tables());
        drop(b);

        let swapped = a.swap_out().unwrap();
        assert_eq!(swapped.len(), 5);
        kv.take_copies();
        kv.copies_done();
        assert!(a.swap_in(swapped).is_ok());
        kv.take_copies();
        kv.copies_done();
        assert_eq!(a.tables()[1][..4], [GONE; 4]);
        assert!(a.covers(30) && a.len() == 5);
        drop(a);
        assert_eq!(kv.gauges().device_used, 0);
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
                        if table.grow_to(tokens.len()) {
                            table.advance(&tokens, tokens.len());
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
                            if s.table.grow_to(s.tokens.len()) {
                                s.table.advance(&s.tokens, s.tokens.len());
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

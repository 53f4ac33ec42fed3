//! The device tier's block pool: reference counts, a free list, and the cached blocks kept for
//! prefix reuse in least-recently-used order.
//!
//! A block is in exactly one of four states:
//! - *free*: no references, no content worth keeping (on `free`);
//! - *used*: referenced by one or more sequences (`refs > 0`);
//! - *cached*: unreferenced but holding a full block registered under its key, so a later
//!   sequence with the same prefix can take it back (on `evictable`, ordered by the time it was
//!   released: the least recently used is evicted first);
//! - *retained*: cached and held for a while (a turn that ended in tool calls, whose follow-up
//!   will want it back): on `retained`, in LRU order too, and evicted only once no plain cached
//!   block is left: under pressure it is demoted (to the host tier, by the caller) before a
//!   plain block's absence could force anything to be recomputed;
//! - *pinned*: cached (or used) and pinned: never evicted, whatever the pressure.
//!
//! Invariants (checked by [`DevicePool::check_invariants`]): a block is on the free list exactly
//! when it has no references, no pins and no key; on the evictable set exactly when it has a key,
//! no references, no pins and no holds; on the retained set exactly when it has a key, no
//! references, no pins and holds; only keyed blocks have holds; every key in `cache` names a
//! block that holds that key.
//!
//! Allocation and release are O(1) for free blocks and O(log n) for cached ones.

use std::collections::{BTreeSet, HashMap};

use super::prefix::{BlockHash, BlockKey};

/// Index of a block in the device pool (and in [`super::KvStorage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Debug, Default)]
struct BlockMeta {
    refs: u32,
    pins: u32,
    /// Retentions holding it (see [`DevicePool::hold`]).
    holds: u32,
    /// Set while the block is registered in the prefix cache.
    key: Option<BlockKey>,
    /// When the block last became evictable (its place in the LRU order).
    tick: u64,
}

#[derive(Debug)]
pub struct DevicePool {
    meta: Vec<BlockMeta>,
    free: Vec<BlockId>,
    evictable: BTreeSet<(u64, BlockId)>,
    retained: BTreeSet<(u64, BlockId)>,
    cache: HashMap<BlockHash, BlockId>,
    tick: u64,
}

impl DevicePool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            meta: (0..num_blocks).map(|_| BlockMeta::default()).collect(),
            // Reversed so that blocks are handed out in index order (tidier to debug).
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            evictable: BTreeSet::new(),
            retained: BTreeSet::new(),
            cache: HashMap::new(),
            tick: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks with nothing in them.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Cached blocks that can be evicted, retained ones included.
    pub fn num_evictable(&self) -> usize {
        self.evictable.len() + self.retained.len()
    }

    /// Blocks an allocation can get: free ones, then evicted ones (retained ones last).
    pub fn num_available(&self) -> usize {
        self.free.len() + self.num_evictable()
    }

    /// Blocks held by a retention, in use or not.
    pub fn num_held(&self) -> usize {
        self.meta.iter().filter(|m| m.holds > 0).count()
    }

    /// Blocks registered in the prefix cache (used, cached or pinned).
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    pub fn num_pinned(&self) -> usize {
        self.meta.iter().filter(|m| m.pins > 0).count()
    }

    pub fn num_used(&self) -> usize {
        self.meta.iter().filter(|m| m.refs > 0).count()
    }

    /// A free block, now referenced once by the caller.
    pub fn take_free(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        self.meta[b.index()].refs = 1;
        Some(b)
    }

    /// Evicts the least recently used cached block, a retained one only when no other is left,
    /// and hands it to the caller (referenced once), with the key it held so the caller can keep
    /// its content elsewhere, and whether it was retained (its retention ends here).
    pub fn take_evicted(&mut self) -> Option<(BlockId, BlockKey, bool)> {
        let (_, b) = self
            .evictable
            .pop_first()
            .or_else(|| self.retained.pop_first())?;
        let meta = &mut self.meta[b.index()];
        let key = meta.key.take().expect("evictable blocks have keys");
        let held = std::mem::take(&mut meta.holds) > 0;
        meta.refs = 1;
        self.cache.remove(&key.hash);
        Some((b, key, held))
    }

    /// Where an idle block waits to be evicted.
    fn idle_set(&mut self, b: BlockId) -> &mut BTreeSet<(u64, BlockId)> {
        match self.meta[b.index()].holds {
            0 => &mut self.evictable,
            _ => &mut self.retained,
        }
    }

    /// Takes an idle, unpinned cached block off its eviction set, before its state changes.
    fn unpark(&mut self, b: BlockId) {
        let meta = &self.meta[b.index()];
        if meta.refs == 0 && meta.pins == 0 {
            let entry = (meta.tick, b);
            self.idle_set(b).remove(&entry);
        }
    }

    /// Whether a block with exactly this key is cached.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.lookup(key).is_some()
    }

    fn lookup(&self, key: &BlockKey) -> Option<BlockId> {
        let b = *self.cache.get(&key.hash)?;
        (self.meta[b.index()].key.as_ref() == Some(key)).then_some(b)
    }

    /// Takes a reference to the cached block holding `key`, if there is one.
    /// Says too whether a retention held it.
    pub fn acquire_cached(&mut self, key: &BlockKey) -> Option<(BlockId, bool)> {
        let b = self.lookup(key)?;
        self.unpark(b);
        let meta = &mut self.meta[b.index()];
        meta.refs += 1;
        Some((b, meta.holds > 0))
    }

    /// Registers a full, referenced block under its key, unless the key is already cached
    /// (another sequence computed the same prefix at the same time) or the block already has one.
    pub fn register(&mut self, b: BlockId, key: &BlockKey) {
        let meta = &mut self.meta[b.index()];
        debug_assert!(meta.refs > 0, "only blocks in use are registered");
        if meta.key.is_some() || self.cache.contains_key(&key.hash) {
            return;
        }
        meta.key = Some(key.clone());
        self.cache.insert(key.hash, b);
    }

    /// Drops one reference; an unreferenced block becomes cached if it holds a key, else free.
    pub fn release(&mut self, b: BlockId) {
        let meta = &mut self.meta[b.index()];
        assert!(meta.refs > 0, "block {b:?} released more often than taken");
        meta.refs -= 1;
        self.settle(b);
    }

    /// Puts an unreferenced, unpinned block where it belongs.
    fn settle(&mut self, b: BlockId) {
        let meta = &mut self.meta[b.index()];
        if meta.refs > 0 || meta.pins > 0 {
            return;
        }
        if meta.key.is_some() {
            self.tick += 1;
            meta.tick = self.tick;
            let entry = (meta.tick, b);
            self.idle_set(b).insert(entry);
        } else {
            self.free.push(b);
        }
    }

    /// Pins the cached block holding `key`; returns false when there is none.
    pub fn pin(&mut self, key: &BlockKey) -> bool {
        let Some(b) = self.lookup(key) else {
            return false;
        };
        self.unpark(b);
        self.meta[b.index()].pins += 1;
        true
    }

    /// Holds the cached block with `key` on the device: it is evicted only after every plain
    /// cached block, until [`DevicePool::unhold`]. Returns false when there is none.
    pub fn hold(&mut self, key: &BlockKey) -> bool {
        let Some(b) = self.lookup(key) else {
            return false;
        };
        self.unpark(b);
        self.meta[b.index()].holds += 1;
        self.settle_idle(b);
        true
    }

    /// Undoes one [`DevicePool::hold`] of `key`; returns whether a hold was there to undo (the
    /// block may have been evicted meanwhile, which ends its holds). A block no longer held
    /// joins the plain LRU order as if just released.
    pub fn unhold(&mut self, key: &BlockKey) -> bool {
        let Some(b) = self.lookup(key) else {
            return false;
        };
        if self.meta[b.index()].holds == 0 {
            return false;
        }
        self.unpark(b);
        self.meta[b.index()].holds -= 1;
        self.settle_idle(b);
        true
    }

    /// Puts back on an eviction set a block taken off by [`DevicePool::unpark`], if idle.
    fn settle_idle(&mut self, b: BlockId) {
        let meta = &self.meta[b.index()];
        if meta.refs == 0 && meta.pins == 0 {
            self.settle(b);
        }
    }

    /// Undoes one [`DevicePool::pin`] of `key`.
    pub fn unpin(&mut self, key: &BlockKey) {
        if let Some(b) = self.lookup(key) {
            let meta = &mut self.meta[b.index()];
            if meta.pins > 0 {
                meta.pins -= 1;
                self.settle(b);
            }
        }
    }

    /// Evictable blocks, next to be evicted first.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        let order = self.evictable.iter().chain(&self.retained);
        order.map(|&(_, b)| b).collect()
    }

    /// The hash of the key `b` is cached under, if any.
    pub fn cached_hash(&self, b: BlockId) -> Option<BlockHash> {
        self.meta[b.index()].key.as_ref().map(|k| k.hash)
    }

    pub fn is_pinned(&self, b: BlockId) -> bool {
        self.meta[b.index()].pins > 0
    }

    pub fn is_held(&self, b: BlockId) -> bool {
        self.meta[b.index()].holds > 0
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.meta[b.index()].refs
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free = vec![false; self.meta.len()];
        for b in &self.free {
            if std::mem::replace(&mut on_free[b.index()], true) {
                return Err(format!("{b:?} is on the free list twice"));
            }
        }
        let on_lru: HashMap<BlockId, u64> = self.evictable.iter().map(|&(t, b)| (b, t)).collect();
        let on_retained: HashMap<BlockId, u64> =
            self.retained.iter().map(|&(t, b)| (b, t)).collect();
        if on_lru.len() != self.evictable.len() || on_retained.len() != self.retained.len() {
            return Err("a block is on an eviction set twice".into());
        }
        for (i, m) in self.meta.iter().enumerate() {
            let b = BlockId(i as u32);
            let idle = m.refs == 0 && m.pins == 0;
            if on_free[i] != (idle && m.key.is_none()) {
                return Err(format!("{b:?}: {m:?}, on free list: {}", on_free[i]));
            }
            if m.holds > 0 && m.key.is_none() {
                return Err(format!("{b:?}: {m:?} is held without a key"));
            }
            for (set, held) in [(&on_lru, false), (&on_retained, true)] {
                let parked = set.get(&b);
                if parked.is_some() != (idle && m.key.is_some() && (m.holds > 0) == held)
                    || parked.is_some_and(|&t| t != m.tick)
                {
                    return Err(format!("{b:?}: {m:?}, held {held}, parked: {parked:?}"));
                }
            }
            if let Some(key) = &m.key {
                if self.cache.get(&key.hash) != Some(&b) {
                    return Err(format!("{b:?} holds a key the cache does not map to it"));
                }
            }
        }
        for (hash, b) in &self.cache {
            if self.meta[b.index()].key.as_ref().map(|k| k.hash) != Some(*hash) {
                return Err(format!(
                    "cache maps {hash:?} to {b:?}, which does not hold it"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::prefix::block_key;

    fn key(t: u32) -> BlockKey {
        block_key(0, None, &[t; 4])
    }

    #[test]
    fn released_keyed_blocks_are_cached_and_evicted_oldest_first() {
        let mut p = DevicePool::new(3);
        let (a, b, c) = (
            p.take_free().unwrap(),
            p.take_free().unwrap(),
            p.take_free().unwrap(),
        );
        p.register(a, &key(1));
        p.register(b, &key(2));
        p.release(b);
        p.release(a);
        p.release(c);
        assert_eq!(p.num_free(), 1, "c had no key");
        assert_eq!(p.eviction_order(), vec![b, a]);
        assert_eq!(
            p.acquire_cached(&key(1)),
            Some((a, false)),
            "a prefix hit takes it back"
        );
        assert_eq!(p.take_free(), Some(c));
        let (evicted, k, held) = p.take_evicted().unwrap();
        assert_eq!((evicted, k, held), (b, key(2), false));
        assert!(!p.contains(&key(2)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let mut p = DevicePool::new(2);
        let a = p.take_free().unwrap();
        p.register(a, &key(1));
        assert!(p.pin(&key(1)));
        p.release(a);
        assert_eq!(p.num_available(), 1);
        let b = p.take_free().unwrap();
        assert!(p.take_evicted().is_none());
        p.unpin(&key(1));
        assert_eq!(p.take_evicted().map(|e| e.0), Some(a));
        p.release(b);
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_key_is_cached_once() {
        let mut p = DevicePool::new(2);
        let (a, b) = (p.take_free().unwrap(), p.take_free().unwrap());
        p.register(a, &key(1));
        p.register(b, &key(1));
        p.release(a);
        p.release(b);
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.num_evictable(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn held_blocks_are_evicted_after_every_plain_one_and_rejoin_the_lru_when_let_go() {
        let mut p = DevicePool::new(4);
        let blocks: Vec<BlockId> = (0..4).map(|_| p.take_free().unwrap()).collect();
        for (t, &b) in (1..).zip(&blocks) {
            p.register(b, &key(t));
        }
        // Released oldest first: 0 would be the first to go, but it is held.
        assert!(p.hold(&key(1)));
        for &b in &blocks {
            p.release(b);
        }
        assert_eq!(p.num_held(), 1);
        assert_eq!(
            p.eviction_order(),
            vec![blocks[1], blocks[2], blocks[3], blocks[0]]
        );
        p.check_invariants().unwrap();
        assert_eq!(p.acquire_cached(&key(1)), Some((blocks[0], true)));
        p.release(blocks[0]);
        let evicted: Vec<_> = (0..3).map(|_| p.take_evicted().unwrap()).collect();
        assert!(evicted.iter().all(|(_, _, held)| !held));
        // Only the held block is left: pressure demotes it, and its hold ends with it.
        assert_eq!(p.take_evicted(), Some((blocks[0], key(1), true)));
        assert_eq!(p.num_held(), 0);
        assert!(!p.unhold(&key(1)), "nothing left to let go");
        p.check_invariants().unwrap();
    }

    #[test]
    fn an_expired_hold_makes_the_block_the_most_recently_used() {
        let mut p = DevicePool::new(2);
        let (a, b) = (p.take_free().unwrap(), p.take_free().unwrap());
        p.register(a, &key(1));
        p.register(b, &key(2));
        p.release(a);
        assert!(p.hold(&key(1)));
        p.release(b);
        assert_eq!(p.eviction_order(), vec![b, a]);
        assert!(p.unhold(&key(1)));
        assert_eq!(
            p.eviction_order(),
            vec![b, a],
            "plain now, and newer than b"
        );
        assert!(p.hold(&key(2)) && p.hold(&key(2)));
        assert!(p.unhold(&key(2)));
        assert_eq!(p.eviction_order(), vec![a, b], "one hold left on b");
        p.check_invariants().unwrap();
    }
}

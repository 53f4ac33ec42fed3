//! The device tier's block pool: reference counts, a free list, and the cached blocks kept for
//! prefix reuse in least-recently-used order.
//!
//! A block is in exactly one of four states:
//! - *free*: no references, no content worth keeping (on `free`);
//! - *used*: referenced by one or more sequences (`refs > 0`);
//! - *cached*: unreferenced but holding a full block registered under its key, so a later
//!   sequence with the same prefix can take it back (on `evictable`, ordered by the time it was
//!   released: the least recently used is evicted first);
//! - *pinned*: cached (or used) and pinned: never evicted, whatever the pressure.
//!
//! Invariants (checked by [`DevicePool::check_invariants`]): a block is on the free list exactly
//! when it has no references, no pins and no key; on the evictable set exactly when it has a key,
//! no references and no pins; every key in `cache` names a block that holds that key.
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

    /// Cached blocks that can be evicted.
    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks an allocation can get: free ones, then evicted ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.evictable.len()
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

    /// Evicts the least recently used cached block and hands it to the caller (referenced once),
    /// with the key it held so the caller can keep its content elsewhere.
    pub fn take_evicted(&mut self) -> Option<(BlockId, BlockKey)> {
        let (_, b) = self.evictable.pop_first()?;
        let meta = &mut self.meta[b.index()];
        let key = meta.key.take().expect("evictable blocks have keys");
        meta.refs = 1;
        self.cache.remove(&key.hash);
        Some((b, key))
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
    pub fn acquire_cached(&mut self, key: &BlockKey) -> Option<BlockId> {
        let b = self.lookup(key)?;
        let meta = &mut self.meta[b.index()];
        if meta.refs == 0 && meta.pins == 0 {
            self.evictable.remove(&(meta.tick, b));
        }
        meta.refs += 1;
        Some(b)
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
            self.evictable.insert((meta.tick, b));
        } else {
            self.free.push(b);
        }
    }

    /// Pins the cached block holding `key`; returns false when there is none.
    pub fn pin(&mut self, key: &BlockKey) -> bool {
        let Some(b) = self.lookup(key) else {
            return false;
        };
        let meta = &mut self.meta[b.index()];
        if meta.refs == 0 && meta.pins == 0 {
            self.evictable.remove(&(meta.tick, b));
        }
        meta.pins += 1;
        true
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
        self.evictable.iter().map(|&(_, b)| b).collect()
    }

    /// The hash of the key `b` is cached under, if any.
    pub fn cached_hash(&self, b: BlockId) -> Option<BlockHash> {
        self.meta[b.index()].key.as_ref().map(|k| k.hash)
    }

    pub fn is_pinned(&self, b: BlockId) -> bool {
        self.meta[b.index()].pins > 0
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
        if on_lru.len() != self.evictable.len() {
            return Err("a block is on the evictable set twice".into());
        }
        for (i, m) in self.meta.iter().enumerate() {
            let b = BlockId(i as u32);
            let idle = m.refs == 0 && m.pins == 0;
            if on_free[i] != (idle && m.key.is_none()) {
                return Err(format!("{b:?}: {m:?}, on free list: {}", on_free[i]));
            }
            let evictable = on_lru.get(&b);
            if evictable.is_some() != (idle && m.key.is_some())
                || evictable.is_some_and(|&t| t != m.tick)
            {
                return Err(format!("{b:?}: {m:?}, evictable: {evictable:?}"));
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
            Some(a),
            "a prefix hit takes it back"
        );
        assert_eq!(p.take_free(), Some(c));
        let (evicted, k) = p.take_evicted().unwrap();
        assert_eq!((evicted, k), (b, key(2)));
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
}

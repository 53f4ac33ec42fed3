//! The host tier: KV blocks kept in CPU RAM when the device pool needs room, so that they are
//! copied back instead of recomputed.
//!
//! Slots (each one block's keys and values for every layer) hold either
//! - a *cached* block: a full block evicted from the device, addressed by its key; kept in
//!   least-recently-used order and dropped, oldest first, when a slot is needed; or
//! - a *swapped* block: part of a preempted sequence, waiting to be swapped back in. Swapped
//!   slots are never dropped: they are the only copy of that sequence's cache.
//!
//! A slot with a copy to the device still pending is *locked*: it cannot be dropped or reused
//! until the step's copies have run. This module only keeps the books; the bytes live in
//! [`super::HostStore`] and move when the engine loop runs the step's copies.

use std::collections::{BTreeSet, HashMap};

use super::prefix::{BlockHash, BlockKey};

/// Index of a slot in the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostSlot(pub u32);

impl HostSlot {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Debug, Default, PartialEq)]
enum SlotUse {
    #[default]
    Free,
    Cached(BlockKey),
    Swapped,
}

#[derive(Debug, Default)]
struct SlotMeta {
    used: SlotUse,
    tick: u64,
    /// Pending copies out of this slot.
    readers: u32,
}

#[derive(Debug)]
pub struct HostTier {
    meta: Vec<SlotMeta>,
    free: Vec<HostSlot>,
    /// Cached, unlocked slots in least-recently-used order.
    lru: BTreeSet<(u64, HostSlot)>,
    cache: HashMap<BlockHash, HostSlot>,
    tick: u64,
}

impl HostTier {
    pub fn new(slots: usize) -> Self {
        Self {
            meta: (0..slots).map(|_| SlotMeta::default()).collect(),
            free: (0..slots as u32).rev().map(HostSlot).collect(),
            lru: BTreeSet::new(),
            cache: HashMap::new(),
            tick: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.meta.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.meta
            .iter()
            .filter(|m| m.used == SlotUse::Swapped)
            .count()
    }

    /// Slots an allocation can get: free ones, then dropped cached ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// A slot for new data: a free one, else the least recently used cached one, whose block is
    /// dropped (returned so the caller can count it).
    pub fn alloc(&mut self) -> Option<(HostSlot, Option<BlockKey>)> {
        if let Some(s) = self.free.pop() {
            return Some((s, None));
        }
        let (_, s) = self.lru.pop_first()?;
        let dropped = match std::mem::take(&mut self.meta[s.index()].used) {
            SlotUse::Cached(key) => {
                self.cache.remove(&key.hash);
                key
            }
            other => unreachable!("only cached slots are on the LRU list, found {other:?}"),
        };
        Some((s, Some(dropped)))
    }

    /// Files a freshly allocated slot as the cached copy of `key`.
    pub fn insert_cached(&mut self, s: HostSlot, key: BlockKey) {
        self.cache.insert(key.hash, s);
        self.meta[s.index()].used = SlotUse::Cached(key);
        self.touch(s);
    }

    /// Files a freshly allocated slot as part of a swapped-out sequence.
    pub fn insert_swapped(&mut self, s: HostSlot) {
        self.meta[s.index()].used = SlotUse::Swapped;
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.lookup(key).is_some()
    }

    /// The slot caching exactly `key`.
    pub fn lookup(&self, key: &BlockKey) -> Option<HostSlot> {
        let s = *self.cache.get(&key.hash)?;
        match &self.meta[s.index()].used {
            SlotUse::Cached(k) if k == key => Some(s),
            _ => None,
        }
    }

    /// A copy out of `s` is pending: keep it until [`HostTier::unlock`].
    pub fn lock(&mut self, s: HostSlot) {
        let meta = &mut self.meta[s.index()];
        if meta.readers == 0 {
            self.lru.remove(&(meta.tick, s));
        }
        meta.readers += 1;
    }

    /// The pending copy out of `s` has run; a cached slot counts as just used.
    pub fn unlock(&mut self, s: HostSlot) {
        let meta = &mut self.meta[s.index()];
        meta.readers -= 1;
        if meta.readers == 0 && matches!(meta.used, SlotUse::Cached(_)) {
            self.touch(s);
        }
    }

    /// Returns a swapped slot to the free list.
    pub fn free_swapped(&mut self, s: HostSlot) {
        let meta = &mut self.meta[s.index()];
        debug_assert_eq!(meta.used, SlotUse::Swapped);
        debug_assert_eq!(meta.readers, 0);
        meta.used = SlotUse::Free;
        self.free.push(s);
    }

    fn touch(&mut self, s: HostSlot) {
        let meta = &mut self.meta[s.index()];
        self.lru.remove(&(meta.tick, s));
        self.tick += 1;
        meta.tick = self.tick;
        if meta.readers == 0 {
            self.lru.insert((meta.tick, s));
        }
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free = vec![false; self.meta.len()];
        for s in &self.free {
            if std::mem::replace(&mut on_free[s.index()], true) {
                return Err(format!("{s:?} is on the free list twice"));
            }
        }
        for (i, m) in self.meta.iter().enumerate() {
            let s = HostSlot(i as u32);
            if on_free[i] != (m.used == SlotUse::Free) {
                return Err(format!("{s:?}: {m:?}, on free list: {}", on_free[i]));
            }
            let listed = self.lru.contains(&(m.tick, s));
            let cached = matches!(m.used, SlotUse::Cached(_));
            if listed != (cached && m.readers == 0) {
                return Err(format!("{s:?}: {m:?}, on LRU list: {listed}"));
            }
            if let SlotUse::Cached(k) = &m.used {
                if self.cache.get(&k.hash) != Some(&s) {
                    return Err(format!("{s:?} caches a key the map does not send to it"));
                }
            }
        }
        if self.cache.len()
            != self
                .meta
                .iter()
                .filter(|m| matches!(m.used, SlotUse::Cached(_)))
                .count()
        {
            return Err("the cache map and the cached slots disagree".into());
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
    fn cached_slots_are_dropped_oldest_first_but_swapped_ones_never() {
        let mut h = HostTier::new(3);
        let (a, _) = h.alloc().unwrap();
        h.insert_cached(a, key(1));
        let (b, _) = h.alloc().unwrap();
        h.insert_swapped(b);
        let (c, _) = h.alloc().unwrap();
        h.insert_cached(c, key(2));
        assert_eq!(h.num_available(), 2);
        let (s, dropped) = h.alloc().unwrap();
        assert_eq!((s, dropped), (a, Some(key(1))));
        assert!(!h.contains(&key(1)));
        h.insert_swapped(s);
        let (s, dropped) = h.alloc().unwrap();
        assert_eq!((s, dropped), (c, Some(key(2))));
        h.insert_swapped(s);
        assert!(h.alloc().is_none(), "swapped slots are not dropped");
        h.free_swapped(b);
        assert_eq!(h.alloc().unwrap().0, b);
    }

    #[test]
    fn locked_slots_are_kept_until_unlocked() {
        let mut h = HostTier::new(1);
        let (a, _) = h.alloc().unwrap();
        h.insert_cached(a, key(1));
        h.lock(a);
        assert!(h.alloc().is_none());
        h.unlock(a);
        assert_eq!(h.alloc().unwrap().0, a);
        h.insert_swapped(a);
        h.check_invariants().unwrap();
    }
}

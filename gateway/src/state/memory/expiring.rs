//! [`Expiring`]: named values of a [`super::MemoryStore`] that expire `ttl` after their last use,
//! all of them together within a byte budget. The session histories
//! ([`super::history::Histories`]) and the stored responses ([`super::responses::Records`]) are
//! both kept in one.
//!
//! Every value has a size, counted with its name towards the budget. Looking a value up or
//! putting one first drops the expired values; [`Expiring::fit`] then drops the values that
//! would expire soonest, which, every value of a map having the same TTL, are the least recently
//! used, until the map is within its budget, never the value just used, so a map holds at most
//! `budget` plus that one value.
//!
//! Expiry is kept in an ordered index beside the map, so dropping the expired or the oldest
//! values costs O(log n) each, and so do lookups and puts.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Named values with expiries, within a byte budget.
#[derive(Debug)]
pub struct Expiring<V> {
    by_name: HashMap<String, Entry<V>>,
    /// Every value's name by its expiry; the sequence number tells equal instants apart.
    by_expiry: BTreeMap<(Instant, u64), String>,
    /// Sizes of every value and name.
    bytes: usize,
    budget: usize,
    next: u64,
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    size: usize,
    expiry: (Instant, u64),
}

impl<V> Expiring<V> {
    /// No values, holding at most `budget` bytes in all (as the module header says).
    pub fn new(budget: usize) -> Self {
        Self {
            by_name: HashMap::new(),
            by_expiry: BTreeMap::new(),
            bytes: 0,
            budget,
            next: 0,
        }
    }

    /// The value under `name` as of `now`, kept until `now + ttl`; `None` when there is none.
    pub fn touch(&mut self, name: &str, ttl: Duration, now: Instant) -> Option<&mut V> {
        self.drop_expired(now);
        let expiry = self.expiry(now, ttl);
        let entry = self.by_name.get_mut(name)?;
        self.by_expiry.remove(&entry.expiry);
        entry.expiry = expiry;
        self.by_expiry.insert(expiry, name.to_owned());
        Some(&mut entry.value)
    }

    /// Puts `value`, of `size` bytes, under `name` as of `now` until `now + ttl`, replacing
    /// what was there. The map may be over its budget until [`Expiring::fit`].
    pub fn insert(&mut self, name: &str, value: V, size: usize, ttl: Duration, now: Instant) {
        self.drop_expired(now);
        self.remove(name);
        let expiry = self.expiry(now, ttl);
        self.bytes += name.len() + size;
        self.by_expiry.insert(expiry, name.to_owned());
        let entry = Entry {
            value,
            size,
            expiry,
        };
        self.by_name.insert(name.to_owned(), entry);
    }

    /// Records that the value under `name` (changed in place) is now `size` bytes.
    pub fn resize(&mut self, name: &str, size: usize) {
        if let Some(entry) = self.by_name.get_mut(name) {
            self.bytes = self.bytes - entry.size + size;
            entry.size = size;
        }
    }

    /// Drops the value under `name`, and returns it.
    pub fn remove(&mut self, name: &str) -> Option<V> {
        let entry = self.by_name.remove(name)?;
        self.by_expiry.remove(&entry.expiry);
        self.bytes -= name.len() + entry.size;
        Some(entry.value)
    }

    /// Drops the values that expire soonest until the map is within its budget, but never the
    /// value under `keep`.
    pub fn fit(&mut self, keep: &str) {
        while self.bytes > self.budget {
            let Some(oldest) = self.by_expiry.values().next().cloned() else {
                break;
            };
            if oldest == keep {
                // The value just used expires last: nothing else is left to drop.
                break;
            }
            self.remove(&oldest);
        }
    }

    /// Bytes of every value and name.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Every name and value, in no order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (&String, &V)> {
        self.by_name
            .iter()
            .map(|(name, entry)| (name, &entry.value))
    }

    fn expiry(&mut self, now: Instant, ttl: Duration) -> (Instant, u64) {
        self.next += 1;
        (now + ttl, self.next)
    }

    fn drop_expired(&mut self, now: Instant) {
        while let Some((&(at, _), name)) = self.by_expiry.iter().next() {
            if at > now {
                return;
            }
            let name = name.clone();
            self.remove(&name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    #[test]
    fn a_value_is_put_read_replaced_and_removed() {
        let mut map = Expiring::new(1 << 20);
        let t0 = Instant::now();
        assert_eq!(map.touch("r", TTL, t0), None);
        map.insert("r", "one", 3, TTL, t0);
        map.insert("r", "two", 3, TTL, t0);
        assert_eq!(map.touch("r", TTL, t0).copied(), Some("two"));
        assert_eq!(map.bytes(), "r".len() + 3);
        map.resize("r", 10);
        assert_eq!(map.bytes(), "r".len() + 10);
        assert_eq!(map.remove("r"), Some("two"));
        assert_eq!(map.remove("r"), None, "already gone");
        assert_eq!((map.bytes(), map.len(), map.by_expiry.len()), (0, 0, 0));
    }

    #[test]
    fn a_value_expires_ttl_after_its_last_use() {
        let mut map = Expiring::new(1 << 20);
        let t0 = Instant::now();
        map.insert("read", (), 1, TTL, t0);
        map.insert("idle", (), 1, TTL, t0);
        // Read just before it would expire: kept for another TTL from then.
        let t1 = t0 + TTL - Duration::from_millis(1);
        assert!(map.touch("read", TTL, t1).is_some());
        let t2 = t0 + TTL + Duration::from_secs(1);
        assert!(map.touch("read", TTL, t2).is_some(), "refreshed at t1");
        assert!(
            map.touch("idle", TTL, t2).is_none(),
            "unused for a TTL: gone"
        );
        assert_eq!(map.len(), 1, "the expired value was dropped");
        assert!(map.touch("read", TTL, t2 + TTL).is_none());
        assert_eq!((map.bytes(), map.by_expiry.len()), (0, 0));
    }

    #[test]
    fn past_the_budget_the_least_recently_used_values_go() {
        // Each value: a 1-byte name and 9 bytes.
        let mut map = Expiring::new(30);
        let t0 = Instant::now();
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            map.insert(name, (), 9, TTL, t0 + Duration::from_secs(i as u64));
            map.fit(name);
        }
        assert_eq!(map.bytes(), 30, "exactly the budget: nothing dropped");
        let t1 = t0 + Duration::from_secs(10);
        // "a" is used again, so "b" is now the least recently used.
        assert!(map.touch("a", TTL, t1).is_some());
        map.insert("d", (), 9, TTL, t1);
        map.fit("d");
        assert!(map.touch("b", TTL, t1).is_none(), "b was dropped");
        for name in ["a", "c", "d"] {
            assert!(map.touch(name, TTL, t1).is_some(), "{name} stays");
        }
        // A value larger than the whole budget pushes out every other one, not itself.
        map.insert("big", (), 100, TTL, t1);
        map.fit("big");
        assert_eq!(map.len(), 1);
        assert_eq!(map.bytes(), 103);
    }
}

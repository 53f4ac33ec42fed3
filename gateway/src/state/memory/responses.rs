//! [`Records`]: the stored responses of a [`super::MemoryStore`], bounded in time and in bytes.
//!
//! Each record expires `ttl` after its last put or read. Over all records, the store holds at
//! most `budget` bytes (records and names): past it, a put first drops the expired records, then
//! the ones that would expire soonest, which, every record having the same TTL, are the least
//! recently used; never the record just put, so the store holds at most `budget` plus that one.
//!
//! Expiry is kept in an ordered index beside the map, so every operation costs O(log n) plus
//! copying the record in or out.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// The stored responses of one process, behind the store's lock.
#[derive(Debug)]
pub struct Records {
    by_name: HashMap<String, Record>,
    /// Every record's name by its expiry; the sequence number tells equal instants apart.
    by_expiry: BTreeMap<(Instant, u64), String>,
    /// Bytes of every record and its name.
    bytes: usize,
    budget: usize,
    next: u64,
}

#[derive(Debug)]
struct Record {
    text: String,
    expiry: (Instant, u64),
}

impl Records {
    /// No records, holding at most `budget` bytes in all (as the module header says).
    pub fn new(budget: usize) -> Self {
        Self {
            by_name: HashMap::new(),
            by_expiry: BTreeMap::new(),
            bytes: 0,
            budget,
            next: 0,
        }
    }

    /// Keeps `text` under `name` as of `now` until `now + ttl`, then brings the store back
    /// within its budget.
    pub fn put(&mut self, name: &str, text: &str, ttl: Duration, now: Instant) {
        self.drop_expired(now);
        self.remove(name);
        let expiry = self.expiry(now, ttl);
        self.bytes += name.len() + text.len();
        self.by_expiry.insert(expiry, name.to_owned());
        let record = Record {
            text: text.to_owned(),
            expiry,
        };
        self.by_name.insert(name.to_owned(), record);
        while self.bytes > self.budget {
            let Some(oldest) = self.by_expiry.values().next().cloned() else {
                break;
            };
            if oldest == name {
                // The record just put expires last: nothing else is left to drop.
                break;
            }
            self.remove(&oldest);
        }
    }

    /// The record `name` as of `now`, kept until `now + ttl`; `None` when there is none.
    pub fn get(&mut self, name: &str, ttl: Duration, now: Instant) -> Option<String> {
        self.drop_expired(now);
        let expiry = self.expiry(now, ttl);
        let record = self.by_name.get_mut(name)?;
        self.by_expiry.remove(&record.expiry);
        record.expiry = expiry;
        self.by_expiry.insert(expiry, name.to_owned());
        Some(record.text.clone())
    }

    /// Drops the record `name`; whether there was one.
    pub fn remove(&mut self, name: &str) -> bool {
        let Some(record) = self.by_name.remove(name) else {
            return false;
        };
        self.by_expiry.remove(&record.expiry);
        self.bytes -= name.len() + record.text.len();
        true
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
    fn a_record_is_put_read_replaced_and_removed() {
        let mut records = Records::new(1 << 20);
        let t0 = Instant::now();
        assert_eq!(records.get("r", TTL, t0), None);
        records.put("r", "one", TTL, t0);
        records.put("r", "two", TTL, t0);
        assert_eq!(records.get("r", TTL, t0).as_deref(), Some("two"));
        assert_eq!(records.bytes, "r".len() + "two".len());
        assert!(records.remove("r"));
        assert!(!records.remove("r"), "already gone");
        assert_eq!((records.bytes, records.by_expiry.len()), (0, 0));
    }

    #[test]
    fn a_record_expires_ttl_after_its_last_use() {
        let mut records = Records::new(1 << 20);
        let t0 = Instant::now();
        records.put("read", "x", TTL, t0);
        records.put("idle", "x", TTL, t0);
        let t1 = t0 + TTL - Duration::from_millis(1);
        assert!(records.get("read", TTL, t1).is_some());
        let t2 = t0 + TTL + Duration::from_secs(1);
        assert!(records.get("read", TTL, t2).is_some(), "refreshed at t1");
        assert_eq!(records.get("idle", TTL, t2), None);
        assert_eq!(records.by_name.len(), 1, "the expired record was dropped");
    }

    #[test]
    fn past_the_budget_the_least_recently_used_records_go() {
        // Each record: a 1-byte name and 9 bytes of text.
        let mut records = Records::new(30);
        let t0 = Instant::now();
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            records.put(name, "123456789", TTL, t0 + Duration::from_secs(i as u64));
        }
        let t1 = t0 + Duration::from_secs(10);
        assert!(records.get("a", TTL, t1).is_some());
        records.put("d", "123456789", TTL, t1);
        assert_eq!(
            records.get("b", TTL, t1),
            None,
            "b was the least recently used"
        );
        for name in ["a", "c", "d"] {
            assert!(records.get(name, TTL, t1).is_some(), "{name} stays");
        }
        // A record larger than the whole budget pushes out every other one, not itself.
        records.put("big", &"x".repeat(100), TTL, t1);
        assert_eq!(records.by_name.len(), 1);
        assert_eq!(records.bytes, 103);
    }
}

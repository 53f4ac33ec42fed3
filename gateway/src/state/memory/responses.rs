//! [`Records`]: the stored responses of a [`super::MemoryStore`], bounded in time and in bytes.
//!
//! Each record expires `ttl` after its last put or read. Over all records, the store holds at
//! most `budget` bytes (records and names), as an [`Expiring`] map does: past it, a put drops
//! the records that would expire soonest (the least recently used), never the one just put.
//! Every operation costs O(log n) plus copying the record in or out.

use std::time::{Duration, Instant};

use super::expiring::Expiring;

/// The stored responses of one process, behind the store's lock.
#[derive(Debug)]
pub struct Records(Expiring<String>);

impl Records {
    /// No records, holding at most `budget` bytes in all (as the module header says).
    pub fn new(budget: usize) -> Self {
        Self(Expiring::new(budget))
    }

    /// Keeps `text` under `name` as of `now` until `now + ttl`, then brings the store back
    /// within its budget.
    pub fn put(&mut self, name: &str, text: &str, ttl: Duration, now: Instant) {
        self.0.insert(name, text.to_owned(), text.len(), ttl, now);
        self.0.fit(name);
    }

    /// The record `name` as of `now`, kept until `now + ttl`; `None` when there is none.
    pub fn get(&mut self, name: &str, ttl: Duration, now: Instant) -> Option<String> {
        self.0.touch(name, ttl, now).cloned()
    }

    /// Drops the record `name`; whether there was one.
    pub fn remove(&mut self, name: &str) -> bool {
        self.0.remove(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    #[test]
    fn a_record_is_put_read_replaced_and_removed_within_the_budget() {
        let mut records = Records::new(30);
        let t0 = Instant::now();
        assert_eq!(records.get("r", TTL, t0), None);
        records.put("r", "one", TTL, t0);
        records.put("r", "two", TTL, t0);
        assert_eq!(records.get("r", TTL, t0).as_deref(), Some("two"));
        assert_eq!(records.0.bytes(), "r".len() + "two".len());
        records.put("big", &"x".repeat(100), TTL, t0);
        assert_eq!(records.get("r", TTL, t0), None, "dropped for the budget");
        assert!(records.remove("big"));
        assert!(!records.remove("big"), "already gone");
        assert_eq!((records.0.bytes(), records.0.len()), (0, 0));
    }
}

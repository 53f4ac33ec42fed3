//! [`MemoryStore`]: the rate-limit buckets, the session histories and the stored responses in
//! this process's memory, each behind a mutex of its own; the histories and their bounds are
//! [`history::Histories`], the stored responses and theirs [`responses::Records`].
//!
//! A take or give-back is a hash lookup and a little arithmetic under the lock, never an await,
//! so the lock is never held long. Memory: one small entry per bucket name. Names come from the
//! configured keys, so there are few; still, once the map reaches [`PRUNE_AT`] entries, adding
//! one first drops every bucket that has refilled to the brim, since a full bucket is exactly
//! what an absent one starts as. The map never holds more than [`PRUNE_AT`] plus the number of
//! buckets not yet full, whatever the traffic.

mod expiring;
mod history;
mod responses;

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::future::{self, BoxFuture};

use super::{HistoryLimit, Quota, StateStore, StoreError, Take};
use history::Histories;
use responses::Records;

/// Entries at which adding a bucket first prunes the full ones.
const PRUNE_AT: usize = 1024;

/// The most bytes the histories of all sessions hold together (64 MiB): past it, the least
/// recently used go first.
pub const HISTORY_BUDGET_BYTES: usize = 64 << 20;

/// The most bytes the stored responses hold together (64 MiB): past it, the least recently used
/// go first.
pub const RESPONSE_BUDGET_BYTES: usize = 64 << 20;

/// Rate-limit buckets, session histories and stored responses for a single gateway process.
#[derive(Debug)]
pub struct MemoryStore {
    buckets: Mutex<HashMap<String, Bucket>>,
    histories: Mutex<Histories>,
    responses: Mutex<Records>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            buckets: Mutex::default(),
            histories: Mutex::new(Histories::new(HISTORY_BUDGET_BYTES)),
            responses: Mutex::new(Records::new(RESPONSE_BUDGET_BYTES)),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    quota: Quota,
    /// Units available as of `at`.
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(quota: Quota, now: Instant) -> Self {
        Self {
            quota,
            level: quota.capacity() as f64,
            at: now,
        }
    }

    /// The level at `now`, counting what has dripped in since `at`.
    fn level_at(&self, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.level + elapsed * self.quota.per_second()).min(self.quota.capacity() as f64)
    }

    fn set(&mut self, level: f64, now: Instant) {
        self.level = level.min(self.quota.capacity() as f64);
        self.at = self.at.max(now);
    }

    fn take(&mut self, amount: u64, now: Instant) -> Take {
        let level = self.level_at(now);
        let amount = amount as f64;
        if level >= amount {
            self.set(level - amount, now);
            return Take::Granted;
        }
        Take::Denied {
            retry_after: Duration::from_secs_f64((amount - level) / self.quota.per_second()),
        }
    }

    fn give_back(&mut self, amount: u64, now: Instant) {
        let level = self.level_at(now);
        self.set(level + amount as f64, now);
    }

    fn is_full(&self, now: Instant) -> bool {
        self.level_at(now) >= self.quota.capacity() as f64
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the bucket `name`, creating it full if absent. A bucket keeps the quota it
    /// was created with: quotas are fixed for the life of the process.
    fn with_bucket<R>(
        &self,
        name: &str,
        quota: Quota,
        now: Instant,
        f: impl FnOnce(&mut Bucket) -> R,
    ) -> R {
        // Every update is a single assignment, so a poisoned lock still guards whole buckets.
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = buckets.get_mut(name) {
            return f(bucket);
        }
        if buckets.len() >= PRUNE_AT {
            buckets.retain(|_, bucket| !bucket.is_full(now));
        }
        f(buckets
            .entry(name.to_owned())
            .or_insert_with(|| Bucket::full(quota, now)))
    }

    fn take_at(&self, name: &str, quota: Quota, amount: u64, now: Instant) -> Take {
        self.with_bucket(name, quota, now, |bucket| bucket.take(amount, now))
    }

    fn give_back_at(&self, name: &str, quota: Quota, amount: u64, now: Instant) {
        self.with_bucket(name, quota, now, |bucket| bucket.give_back(amount, now));
    }

    fn histories(&self) -> MutexGuard<'_, Histories> {
        // Every change leaves the histories whole before it can panic (only on a broken
        // invariant), so a poisoned lock still guards a usable map.
        self.histories.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn responses(&self) -> MutexGuard<'_, Records> {
        // As for the histories: every change leaves the records whole before it can panic.
        self.responses.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl StateStore for MemoryStore {
    fn take<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<Take, StoreError>> {
        let taken = self.take_at(name, quota, amount, Instant::now());
        Box::pin(future::ready(Ok(taken)))
    }

    fn give_back<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.give_back_at(name, quota, amount, Instant::now());
        Box::pin(future::ready(Ok(())))
    }

    fn history<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        let entries = self.histories().read(name, ttl, Instant::now());
        Box::pin(future::ready(Ok(entries)))
    }

    fn append_turn<'a>(
        &'a self,
        name: &'a str,
        opening: &'a str,
        turn: &'a str,
        limit: HistoryLimit,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.histories()
            .append(name, opening, turn, limit, Instant::now());
        Box::pin(future::ready(Ok(())))
    }

    fn put_response<'a>(
        &'a self,
        name: &'a str,
        record: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.responses().put(name, record, ttl, Instant::now());
        Box::pin(future::ready(Ok(())))
    }

    fn response<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        let record = self.responses().get(name, ttl, Instant::now());
        Box::pin(future::ready(Ok(record)))
    }

    fn delete_response<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        let deleted = self.responses().remove(name);
        Box::pin(future::ready(Ok(deleted)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(per_minute: u64) -> Quota {
        Quota::per_minute(per_minute).unwrap()
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_new_bucket_allows_a_minute_in_one_burst() {
        let store = MemoryStore::new();
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(store.take_at("a", quota(3), 1, t0), Take::Granted);
        }
        let Take::Denied { retry_after } = store.take_at("a", quota(3), 1, t0) else {
            panic!("a fourth request in the same instant must be refused");
        };
        // 3 a minute: one every 20 s.
        assert!(
            (retry_after.as_secs_f64() - 20.0).abs() < 1e-6,
            "{retry_after:?}"
        );
        assert_eq!(
            store.take_at("b", quota(3), 1, t0),
            Take::Granted,
            "buckets are per name"
        );
    }

    #[test]
    fn buckets_refill_at_the_quota_rate_and_no_further() {
        let store = MemoryStore::new();
        let t0 = Instant::now();
        assert_eq!(store.take_at("a", quota(60), 60, t0), Take::Granted);
        assert!(matches!(
            store.take_at("a", quota(60), 1, t0),
            Take::Denied { .. }
        ));
        assert_eq!(
            store.take_at("a", quota(60), 10, t0 + secs(10.0)),
            Take::Granted
        );
        // An hour idle refills one minute's worth, not sixty.
        let later = t0 + secs(3600.0);
        assert_eq!(store.take_at("a", quota(60), 60, later), Take::Granted);
        assert!(matches!(
            store.take_at("a", quota(60), 1, later),
            Take::Denied { .. }
        ));
    }

    #[test]
    fn a_denied_take_takes_nothing_and_names_the_wait() {
        let store = MemoryStore::new();
        let t0 = Instant::now();
        assert_eq!(store.take_at("t", quota(600), 500, t0), Take::Granted);
        let Take::Denied { retry_after } = store.take_at("t", quota(600), 300, t0) else {
            panic!("only 100 left");
        };
        // 200 missing at 10 a second.
        assert!(
            (retry_after.as_secs_f64() - 20.0).abs() < 1e-6,
            "{retry_after:?}"
        );
        // Had the refused take taken anything, the wait it named would not be enough.
        assert_eq!(
            store.take_at("t", quota(600), 300, t0 + retry_after),
            Take::Granted
        );
    }

    #[test]
    fn given_back_units_are_usable_at_once_up_to_capacity() {
        let store = MemoryStore::new();
        let t0 = Instant::now();
        assert_eq!(store.take_at("t", quota(100), 100, t0), Take::Granted);
        store.give_back_at("t", quota(100), 70, t0);
        assert_eq!(store.take_at("t", quota(100), 70, t0), Take::Granted);
        store.give_back_at("t", quota(100), 1_000, t0);
        assert_eq!(store.take_at("t", quota(100), 100, t0), Take::Granted);
        assert!(matches!(
            store.take_at("t", quota(100), 1, t0),
            Take::Denied { .. }
        ));
    }

    #[test]
    fn full_buckets_are_pruned_and_busy_ones_kept() {
        let store = MemoryStore::new();
        let t0 = Instant::now();
        store.take_at("busy", quota(1), 1, t0);
        for i in 1..PRUNE_AT {
            store.take_at(&format!("idle-{i}"), quota(6_000), 1, t0);
        }
        let len = || store.buckets.lock().unwrap().len();
        assert_eq!(len(), PRUNE_AT);
        // 1 s later the idle buckets have refilled (100 a second); "busy" has not (1 a minute).
        let t1 = t0 + secs(1.0);
        store.take_at("new", quota(6_000), 1, t1);
        assert_eq!(len(), 2, "only the busy bucket and the new one remain");
        assert!(
            matches!(store.take_at("busy", quota(1), 1, t1), Take::Denied { .. }),
            "pruning must not reset a bucket that is not full"
        );
    }
}

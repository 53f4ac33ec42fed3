//! Where the gateway keeps state that outlives a request: the rate-limit buckets, the
//! conversation histories of sessions, and the stored responses of the Responses API.
//!
//! [`StateStore`] is the contract; [`memory::MemoryStore`] keeps the state in this process,
//! which is right for one gateway; [`redis::RedisStore`] keeps it in Redis (`--redis URL`), so
//! that several replicas behind a load balancer share it: a key's limits hold across replicas,
//! and a conversation can continue on any of them. [`open`] picks one from the configuration.
//!
//! The limit is a token bucket per name: it holds up to a minute's quota, refills continuously
//! at quota / 60 per second, and a request takes its cost from it all at once or not at all.
//! Unused cost can be given back. A store must apply each take and give-back atomically (one
//! lock here, one script in Redis); it must never block a caller on another caller's request.
//!
//! A history is a list of entries, opaque texts to the store (the sessions keep JSON in them):
//! entry 0 is the conversation's opening, kept as long as the history is, then one entry per
//! turn, oldest first. Appending a turn is atomic and trims the history to its
//! [`HistoryLimit`]: while its entries hold more than `max_bytes`, the oldest turn goes, though
//! never the opening nor the turn just appended. Every read or append keeps the history for
//! another `ttl`; one left alone that long is gone.
//!
//! A stored response is one record, an opaque text (the Responses API keeps JSON in it) under
//! its name: put whole, read whole, deleted. Every put or read keeps it for another `ttl`. What a
//! record holds, and how big it may grow, is its writer's business ([`crate::http::responses`]);
//! the store only bounds them all together where it can (in memory, by a byte budget).

pub mod memory;
pub mod redis;

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

pub use memory::MemoryStore;
pub use redis::RedisStore;

/// The store `redis` names (`redis://host:port/db`), else one in this process's memory. A Redis
/// store connects on first use; `redis` must be a valid URL ([`crate::ServeConfig::validate`]
/// checks it).
pub fn open(redis: Option<&str>) -> Arc<dyn StateStore> {
    match redis {
        Some(url) => Arc::new(RedisStore::new(url).expect("validate() checked the URL")),
        None => Arc::new(MemoryStore::new()),
    }
}

/// The store did not answer (a Redis that is down or unreachable); the detail is for the logs.
/// Requests that needed the store answer 503 `state_store_unavailable`.
#[derive(Debug, thiserror::Error)]
#[error("the state store does not answer: {0}")]
pub struct StoreError(pub String);

/// A rate: `per_minute` units a minute, in bursts of up to a minute's worth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    per_minute: NonZeroU64,
}

impl Quota {
    /// `None` for 0, which means unlimited.
    pub fn per_minute(n: u64) -> Option<Self> {
        NonZeroU64::new(n).map(|per_minute| Self { per_minute })
    }

    /// The most a bucket holds: one minute's worth.
    pub fn capacity(self) -> u64 {
        self.per_minute.get()
    }

    /// Units regained per second.
    pub fn per_second(self) -> f64 {
        self.per_minute.get() as f64 / 60.0
    }
}

/// The answer to a take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Take {
    Granted,
    /// The bucket holds too little; it will hold enough after `retry_after`.
    Denied {
        retry_after: Duration,
    },
}

/// How long a history is kept and how much of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryLimit {
    /// How long after its last read or append a history is kept.
    pub ttl: Duration,
    /// The most bytes its entries hold once the oldest turns are dropped (the opening and the
    /// newest turn stay, whatever their size).
    pub max_bytes: usize,
}

/// Rate-limit buckets, histories and stored responses, by name. Names are opaque to the store
/// (the limits use `"rpm:key:1a2b…"` and the like, the sessions `"key:1a2b…:<id>"`, the
/// responses `"key:1a2b…:resp_…"`); a bucket, a history and a response may share a name.
pub trait StateStore: Send + Sync {
    /// Takes `amount` from the bucket `name` if it holds that much; a bucket seen for the first
    /// time starts full. `amount` must not exceed the quota's capacity, or it is never granted.
    fn take<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<Take, StoreError>>;

    /// Puts back `amount` that a granted take did not use (never above capacity).
    fn give_back<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The entries of the history `name`, oldest first (the opening, then the turns); empty
    /// when there is none. A history that exists is kept for another `ttl`.
    fn history<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>>;

    /// Appends `turn` to the history `name`, creating it with the entry `opening` when there is
    /// none, then trims it to `limit` and keeps it for another `limit.ttl`; all at once.
    fn append_turn<'a>(
        &'a self,
        name: &'a str,
        opening: &'a str,
        turn: &'a str,
        limit: HistoryLimit,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Keeps `record` under `name` for `ttl`, replacing any record there.
    fn put_response<'a>(
        &'a self,
        name: &'a str,
        record: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The record under `name`, kept for another `ttl`; `None` when there is none (never put,
    /// deleted, expired, or dropped for the memory budget).
    fn response<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>>;

    /// Deletes the record under `name`; whether there was one.
    fn delete_response<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Whether the store can serve takes now, for the readiness probe; a store in this
    /// process always can.
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(futures::future::ready(Ok(())))
    }
}

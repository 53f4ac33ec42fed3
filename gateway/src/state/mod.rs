//! Where the gateway keeps state that outlives a request: for now, the rate-limit buckets.
//!
//! [`StateStore`] is the contract; [`memory::MemoryStore`] keeps the buckets in this process,
//! which is right for one gateway; [`redis::RedisStore`] keeps them in Redis (`--redis URL`), so
//! that several replicas behind a load balancer share them and a key's limits hold across
//! replicas.
//!
//! The limit is a token bucket per name: it holds up to a minute's quota, refills continuously
//! at quota / 60 per second, and a request takes its cost from it all at once or not at all.
//! Unused cost can be given back. A store must apply each take and give-back atomically (one
//! lock here, one script in Redis); it must never block a caller on another caller's request.

pub mod memory;
pub mod redis;

use std::num::NonZeroU64;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::error::ApiError;

pub use memory::MemoryStore;
pub use redis::RedisStore;

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

/// Rate-limit buckets, by name. Names are opaque to the store (the limits use
/// `"rpm:key:1a2b…"` and the like).
pub trait StateStore: Send + Sync {
    /// Takes `amount` from the bucket `name` if it holds that much; a bucket seen for the first
    /// time starts full. `amount` must not exceed the quota's capacity, or it is never granted.
    fn take<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<Take, ApiError>>;

    /// Puts back `amount` that a granted take did not use (never above capacity).
    fn give_back<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<(), ApiError>>;

    /// Whether the store can serve takes now, for the readiness probe; a store in this
    /// process always can.
    fn ping(&self) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(futures::future::ready(Ok(())))
    }
}

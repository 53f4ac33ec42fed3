//! [`RedisStore`]: the rate-limit buckets in Redis, shared by every gateway replica that points
//! at the same server, so a key's limit holds however many replicas serve it (60 a minute is 60
//! a minute in all).
//!
//! Each take or give-back is one Lua script ([`BUCKET`]), which Redis runs atomically: read the
//! bucket, refill it for the time elapsed, take or give back, write it. Time is the Redis
//! server's (`TIME`), so replicas with skewed clocks still agree. A bucket is a hash
//! `{level, at}` under `swarmgate:limit:<name>`; it expires once it would have refilled to the
//! brim, since a full bucket is exactly what an absent one starts as, so Redis holds only the
//! buckets in use.
//!
//! The connection is a [`ConnectionManager`]: made lazily, shared by every request (commands are
//! pipelined over it), and re-established after a failure. Every command has a deadline
//! ([`TIMEOUT`]); when Redis cannot answer in time the take fails with 503
//! `state_store_unavailable`, and the request is refused rather than let through unlimited.

use std::time::Duration;

use futures::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{Quota, StateStore, Take};
use crate::error::ApiError;

/// The longest a request waits for Redis, per command and per connection attempt.
pub const TIMEOUT: Duration = Duration::from_millis(500);

/// The token bucket: `KEYS[1]` the bucket; `ARGV` capacity, refill per second, amount, and
/// `take` or `give`. Returns 0 when granted (or given back), else the milliseconds until the
/// bucket holds `amount`.
const BUCKET: &str = r"
local capacity = tonumber(ARGV[1])
local per_second = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local stored = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(stored[1]) or capacity
local at = tonumber(stored[2]) or now
level = math.min(capacity, level + math.max(0, now - at) * per_second)
local wait = 0
if ARGV[4] == 'take' then
  if level >= amount then
    level = level - amount
  else
    wait = math.ceil((amount - level) / per_second * 1000)
  end
else
  level = math.min(capacity, level + amount)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - level) / per_second * 1000) + 1000)
return wait
";

/// Rate-limit buckets shared through Redis; see the module header.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    script: Script,
}

impl RedisStore {
    /// A store on the Redis at `url` (`redis://host:port/db`). Connects on first use, so a
    /// server can start before its Redis; only a malformed URL is an error here.
    pub fn new(url: &str) -> redis::RedisResult<Self> {
        let client = Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(TIMEOUT))
            .set_response_timeout(Some(TIMEOUT))
            .set_number_of_retries(1);
        Ok(Self {
            connection: ConnectionManager::new_lazy_with_config(client, config)?,
            script: Script::new(BUCKET),
        })
    }

    async fn run(&self, name: &str, quota: Quota, amount: u64, op: &str) -> Result<u64, ApiError> {
        let mut connection = self.connection.clone();
        self.script
            .key(format!("swarmgate:limit:{name}"))
            .arg(quota.capacity())
            .arg(quota.per_second())
            .arg(amount)
            .arg(op)
            .invoke_async(&mut connection)
            .await
            .map_err(unavailable)
    }
}

fn unavailable(error: redis::RedisError) -> ApiError {
    ApiError::StoreUnavailable(error.to_string())
}

impl StateStore for RedisStore {
    fn take<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<Take, ApiError>> {
        Box::pin(async move {
            Ok(match self.run(name, quota, amount, "take").await? {
                0 => Take::Granted,
                wait => Take::Denied {
                    retry_after: Duration::from_millis(wait),
                },
            })
        })
    }

    fn give_back<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<(), ApiError>> {
        Box::pin(async move { self.run(name, quota, amount, "give").await.map(drop) })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await
                .map(drop)
                .map_err(unavailable)
        })
    }
}

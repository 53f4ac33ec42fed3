//! [`RedisStore`]: the rate-limit buckets, the session histories and the stored responses in
//! Redis, shared by every gateway replica that points at the same server, so a key's limit holds
//! however many replicas serve it (60 a minute is 60 a minute in all), a conversation continues
//! on any replica, and a response stored by one is read (or chained from) on another.
//!
//! Each take or give-back is one Lua script ([`BUCKET`]), which Redis runs atomically: read the
//! bucket, refill it for the time elapsed, take or give back, write it. Time is the Redis
//! server's (`TIME`), so replicas with skewed clocks still agree. A bucket is a hash
//! `{level, at}` under `swarmgate:limit:<name>`; it expires once it would have refilled to the
//! brim, since a full bucket is exactly what an absent one starts as, so Redis holds only the
//! buckets in use.
//!
//! A history is a list under `swarmgate:session:<name>`, one JSON text per entry (the opening,
//! then the turns). A read is `LRANGE` and `PEXPIRE` in one transaction; an append is one Lua
//! script ([`APPEND_TURN`]): push, trim the oldest turns past the cap, expire. So two replicas
//! appending to one conversation at once both land, whole, one after the other.
//!
//! A stored response is a string under `swarmgate:response:<name>`: `SET … PX` puts it, `GET`
//! and `PEXPIRE` in one transaction read it, `DEL` deletes it. Redis's own memory policy bounds
//! them all together.
//!
//! The connection is a [`ConnectionManager`]: made lazily, shared by every request (commands are
//! pipelined over it), and re-established after a failure. Every command has a deadline
//! ([`TIMEOUT`]); when Redis cannot answer in time the take (or the history's read or append)
//! fails with 503 `state_store_unavailable`, and the request is refused rather than let through
//! unlimited, or answered without the conversation it continues.

use std::time::Duration;

use futures::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{HistoryLimit, Quota, StateStore, StoreError, Take};

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

/// Appends a turn to a history: `KEYS[1]` the list; `ARGV` the opening (pushed first when the
/// list is new), the turn, the TTL in milliseconds and the most bytes the list keeps. Past that,
/// the oldest turns go: entry 1 onwards, never the opening (entry 0) nor the newest turn.
const APPEND_TURN: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('RPUSH', KEYS[1], ARGV[1])
end
redis.call('RPUSH', KEYS[1], ARGV[2])
local max_bytes = tonumber(ARGV[4])
local entries = redis.call('LRANGE', KEYS[1], 0, -1)
local bytes = 0
for _, entry in ipairs(entries) do
  bytes = bytes + #entry
end
local dropped = 0
while bytes > max_bytes and dropped + 2 < #entries do
  bytes = bytes - #entries[dropped + 2]
  dropped = dropped + 1
end
if dropped > 0 then
  local opening = redis.call('LPOP', KEYS[1])
  redis.call('LTRIM', KEYS[1], dropped, -1)
  redis.call('LPUSH', KEYS[1], opening)
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return dropped
";

/// Rate-limit buckets and histories shared through Redis; see the module header.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    bucket: Script,
    append_turn: Script,
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
            bucket: Script::new(BUCKET),
            append_turn: Script::new(APPEND_TURN),
        })
    }

    async fn run(
        &self,
        name: &str,
        quota: Quota,
        amount: u64,
        op: &str,
    ) -> Result<u64, StoreError> {
        let mut connection = self.connection.clone();
        self.bucket
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

/// The key of the history `name`.
fn history_key(name: &str) -> String {
    format!("swarmgate:session:{name}")
}

/// The key of the stored response `name`.
fn response_key(name: &str) -> String {
    format!("swarmgate:response:{name}")
}

/// `duration` in whole milliseconds, as `PEXPIRE` takes it (at least 1: 0 would delete the key).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

fn unavailable(error: redis::RedisError) -> StoreError {
    StoreError(error.to_string())
}

impl StateStore for RedisStore {
    fn take<'a>(
        &'a self,
        name: &'a str,
        quota: Quota,
        amount: u64,
    ) -> BoxFuture<'a, Result<Take, StoreError>> {
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
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move { self.run(name, quota, amount, "give").await.map(drop) })
    }

    fn history<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let key = history_key(name);
            let (entries,): (Vec<String>,) = redis::pipe()
                .atomic()
                .lrange(&key, 0, -1)
                .pexpire(&key, millis(ttl))
                .ignore()
                .query_async(&mut connection)
                .await
                .map_err(unavailable)?;
            Ok(entries)
        })
    }

    fn append_turn<'a>(
        &'a self,
        name: &'a str,
        opening: &'a str,
        turn: &'a str,
        limit: HistoryLimit,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            self.append_turn
                .key(history_key(name))
                .arg(opening)
                .arg(turn)
                .arg(millis(limit.ttl))
                .arg(limit.max_bytes)
                .invoke_async::<u64>(&mut connection)
                .await
                .map(drop)
                .map_err(unavailable)
        })
    }

    fn put_response<'a>(
        &'a self,
        name: &'a str,
        record: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            redis::cmd("SET")
                .arg(response_key(name))
                .arg(record)
                .arg("PX")
                .arg(millis(ttl))
                .query_async::<()>(&mut connection)
                .await
                .map_err(unavailable)
        })
    }

    fn response<'a>(
        &'a self,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let key = response_key(name);
            let (record,): (Option<String>,) = redis::pipe()
                .atomic()
                .get(&key)
                .pexpire(&key, millis(ttl))
                .ignore()
                .query_async(&mut connection)
                .await
                .map_err(unavailable)?;
            Ok(record)
        })
    }

    fn delete_response<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            redis::cmd("DEL")
                .arg(response_key(name))
                .query_async::<u64>(&mut connection)
                .await
                .map(|deleted| deleted > 0)
                .map_err(unavailable)
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
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

//! The workers' registry: a JetStream key-value bucket (`swarm_workers`, after the cluster's
//! name), with one key per worker.
//!
//! A worker puts its [`Heartbeat`] (agents, load, free KV blocks, warm prefixes) every
//! heartbeat interval and deletes its key when it drains; the bucket's `max_age` drops the key
//! of a worker that died without a word. A gateway watches the bucket into [`Workers`], its live
//! view, and treats a worker whose last heartbeat is older than the TTL as gone, whether or not
//! its key is still there.
//!
//! [`Workers::candidates`] orders the live workers hosting an agent for a request: fewest
//! requests in flight first (the worker's own count at its last heartbeat, or the gateway's own
//! count of what it sent there since, whichever is larger), and among equally loaded workers
//! the one holding the agent's system prompt warm.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;

use crate::{self as protocol, Heartbeat, Subjects};

/// Opens the registry bucket, creating it when it does not exist yet. Keys expire `ttl` after
/// their last write.
///
/// The bucket's stream is created here with the key-value layout (`KV_<bucket>` on
/// `$KV.<bucket>.>`, one value per key, rollups allowed, deletes as markers) rather than by the
/// client's bucket creation, which first reads account details that NATS servers before 2.10
/// answer in an older shape.
pub async fn bucket(
    client: async_nats::Client,
    subjects: &Subjects,
    ttl: Duration,
) -> anyhow::Result<kv::Store> {
    let context = jetstream::new(client);
    let bucket = subjects.bucket();
    context
        .get_or_create_stream(jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_age: ttl,
            storage: jetstream::stream::StorageType::Memory,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await?;
    Ok(context.get_key_value(bucket).await?)
}

/// Whether a worker named `worker` is live: its key holds a heartbeat and a newer one comes
/// within `ttl`. Returns how long that took. The key of a worker that died without a word
/// outlives it by up to `ttl`, but no newer heartbeat comes, so its name is free again.
pub async fn live(
    store: &kv::Store,
    worker: &str,
    ttl: Duration,
) -> anyhow::Result<Option<Duration>> {
    let heartbeat = |entry: Option<kv::Entry>| {
        entry
            .filter(|e| e.operation == kv::Operation::Put)
            .map(|e| e.revision)
    };
    let Some(first) = heartbeat(store.entry(worker).await?) else {
        return Ok(None);
    };
    let started = Instant::now();
    while started.elapsed() < ttl {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match heartbeat(store.entry(worker).await?) {
            Some(revision) if revision != first => return Ok(Some(started.elapsed())),
            Some(_) => {}
            None => return Ok(None),
        }
    }
    Ok(None)
}

/// A gateway's view of the live workers. Cloning shares it.
#[derive(Clone, Default)]
pub struct Workers {
    inner: Arc<Mutex<HashMap<String, Entry>>>,
}

struct Entry {
    beat: Heartbeat,
    seen: Instant,
    /// Requests this gateway sent there and has not seen finish.
    sent: Arc<AtomicUsize>,
}

/// A worker chosen for a request; holding it counts the request in the gateway's load figure
/// for that worker.
pub struct Lease {
    pub worker: String,
    sent: Arc<AtomicUsize>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.sent.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Workers {
    /// Follows `store` until it ends: every heartbeat put replaces that worker's entry, every
    /// delete removes it. Returns when the watch fails (the connection is gone for good).
    pub async fn follow(&self, store: kv::Store) -> anyhow::Result<()> {
        let mut watch = store.watch_with_history(">").await?;
        while let Some(entry) = watch.next().await {
            let entry = entry?;
            match entry.operation {
                kv::Operation::Put => match protocol::decode::<Heartbeat>(&entry.value) {
                    Ok(beat) => self.beat(beat),
                    Err(e) => tracing::warn!(key = %entry.key, error = %e, "bad heartbeat"),
                },
                kv::Operation::Delete | kv::Operation::Purge => self.forget(&entry.key),
            }
        }
        Ok(())
    }

    pub fn beat(&self, beat: Heartbeat) {
        let mut workers = self.lock();
        let sent = workers
            .get(&beat.worker)
            .map(|e| e.sent.clone())
            .unwrap_or_default();
        workers.insert(
            beat.worker.clone(),
            Entry {
                beat,
                seen: Instant::now(),
                sent,
            },
        );
    }

    pub fn forget(&self, worker: &str) {
        self.lock().remove(worker);
    }

    /// The live workers (heartbeat younger than `ttl`) of `model` hosting `agent`, best first,
    /// leaving out `exclude`.
    pub fn candidates(
        &self,
        model: &str,
        agent: Option<&str>,
        ttl: Duration,
        exclude: &[String],
    ) -> Vec<String> {
        let workers = self.lock();
        let mut live: Vec<(usize, bool, &str)> = workers
            .values()
            .filter(|e| e.seen.elapsed() < ttl && e.beat.serves(model) && e.beat.hosts(agent))
            .filter(|e| !exclude.contains(&e.beat.worker))
            .map(|e| {
                let load = e.beat.in_flight.max(e.sent.load(Ordering::Relaxed));
                let warm = agent.is_some_and(|a| e.beat.warm.iter().any(|w| w == a));
                (load, !warm, e.beat.worker.as_str())
            })
            .collect();
        live.sort_unstable();
        live.into_iter().map(|(_, _, w)| w.to_owned()).collect()
    }

    /// Counts a request for `worker` until the lease is dropped.
    pub fn lease(&self, worker: &str) -> Lease {
        let sent = self
            .lock()
            .get(worker)
            .map(|e| e.sent.clone())
            .unwrap_or_default();
        sent.fetch_add(1, Ordering::Relaxed);
        Lease {
            worker: worker.to_owned(),
            sent,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VERSION;

    fn beat(worker: &str, in_flight: usize, agents: &[&str], warm: &[&str]) -> Heartbeat {
        Heartbeat {
            v: VERSION,
            worker: worker.into(),
            models: vec!["m".into()],
            agents: agents.iter().map(|a| a.to_string()).collect(),
            running: 0,
            waiting: 0,
            in_flight,
            free_kv_blocks: 100,
            warm: warm.iter().map(|a| a.to_string()).collect(),
        }
    }

    const TTL: Duration = Duration::from_secs(5);

    #[test]
    fn the_least_loaded_worker_hosting_the_agent_comes_first_warm_breaking_ties() {
        let workers = Workers::default();
        workers.beat(beat("busy", 5, &[], &["coder"]));
        workers.beat(beat("cold", 1, &[], &[]));
        workers.beat(beat("warm", 1, &[], &["coder"]));
        workers.beat(beat("mathonly", 0, &["math"], &["math"]));
        assert_eq!(
            workers.candidates("m", Some("coder"), TTL, &[]),
            ["warm", "cold", "busy"]
        );
        assert_eq!(
            workers.candidates("m", Some("coder"), TTL, &["warm".into()]),
            ["cold", "busy"]
        );
        assert_eq!(
            workers.candidates("other-model", None, TTL, &[]),
            [] as [&str; 0]
        );
        assert_eq!(workers.candidates("m", None, TTL, &[])[0], "mathonly");
    }

    /// A request goes to the workers whose engines serve its model, whichever of their models
    /// it is.
    #[test]
    fn workers_are_chosen_by_the_models_they_serve() {
        let workers = Workers::default();
        let mut pair = beat("pair", 3, &[], &[]);
        pair.models = vec!["m".into(), "g".into()];
        workers.beat(pair);
        workers.beat(beat("single", 0, &[], &[]));
        assert_eq!(workers.candidates("m", None, TTL, &[]), ["single", "pair"]);
        assert_eq!(workers.candidates("g", None, TTL, &[]), ["pair"]);
        assert!(workers.candidates("x", None, TTL, &[]).is_empty());
    }

    #[test]
    fn the_gateways_own_count_raises_a_workers_load_until_the_lease_ends() {
        let workers = Workers::default();
        workers.beat(beat("a", 0, &[], &[]));
        workers.beat(beat("b", 1, &[], &[]));
        let leases: Vec<Lease> = (0..2).map(|_| workers.lease("a")).collect();
        assert_eq!(workers.candidates("m", None, TTL, &[]), ["b", "a"]);
        // A new heartbeat keeps the count of what is still in flight.
        workers.beat(beat("a", 0, &[], &[]));
        assert_eq!(workers.candidates("m", None, TTL, &[]), ["b", "a"]);
        drop(leases);
        assert_eq!(workers.candidates("m", None, TTL, &[]), ["a", "b"]);
    }

    #[test]
    fn a_worker_whose_heartbeat_lapsed_or_was_deleted_is_gone() {
        let workers = Workers::default();
        workers.beat(beat("a", 0, &[], &[]));
        workers.beat(beat("b", 0, &[], &[]));
        workers.forget("b");
        assert_eq!(workers.candidates("m", None, TTL, &[]), ["a"]);
        assert!(workers
            .candidates("m", None, Duration::ZERO, &[])
            .is_empty());
    }
}

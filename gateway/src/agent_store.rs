//! Where the swarm's agents are kept when replicas share them: one PostgreSQL table
//! (`--database-url`). Without a database the agents live in the process, as the swarm file
//! has them, and this module is not used.
//!
//! Schema: `swarmgate_agents(name text primary key, definition jsonb, updated_at timestamptz)`;
//! `definition` is an [`AgentSpec`] as the API shows it. [`AgentStore::open`] applies the
//! [`MIGRATIONS`] not yet recorded in `swarmgate_migrations`, each once, in one transaction
//! under an advisory lock, so replicas starting together neither race nor repeat one.
//!
//! Edits: every write is one transaction that takes the same transaction-scoped advisory lock
//! (so the edits of every replica are serialized), reads every agent, checks the registry's
//! rules with the edit applied ([`Registry`]), writes, and sends `NOTIFY swarmgate_agents`,
//! which PostgreSQL delivers at commit. The table therefore always holds a valid swarm, even
//! when two replicas edit at once.
//!
//! Propagation: [`AgentStore::changes`] keeps a connection of its own that `LISTEN`s on that
//! channel, and says "reload" once per notification (coalesced while the reader is busy) and
//! once after every (re)connection, because a notification sent while it was down is lost.
//! Readers reload the whole table: it is small (`--max-agents` bounds it), and a full reload
//! can never apply two edits out of order.
//!
//! Seeding: [`AgentStore::seed`] writes the swarm file's agents only while the table is empty,
//! so a file brings up a new deployment and never overwrites what was edited at run time.
//!
//! Never: log the URL (it may carry a password); TLS is not spoken (`NoTls`), so the database
//! is expected on a trusted network.

use std::time::Duration;

use deadpool_postgres::{
    GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Transaction,
};
use futures::StreamExt as _;
use router::{AgentId, AgentSpec, Registry, RouterError};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

/// The channel edits are announced on.
const CHANNEL: &str = "swarmgate_agents";

/// The advisory lock that serializes migrations and edits across replicas (any fixed number
/// that no other user of the database takes; this one spells `SGAG`).
const LOCK: i64 = 0x5347_4147;

/// The schema, one step per entry; an entry is never edited once released, only appended to.
pub const MIGRATIONS: &[&str] = &["CREATE TABLE swarmgate_agents (
        name text PRIMARY KEY,
        definition jsonb NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()
    )"];

/// Connections the pool keeps: edits are rare, and each holds one for a few queries.
const POOL_SIZE: usize = 4;

/// How long a connection may take to open, unless the URL says (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest wait between two attempts to reconnect the listener.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum AgentStoreError {
    #[error("agent store: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("agent store: no connection: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("agent store: the stored agent {name:?} does not parse: {reason}")]
    Stored { name: String, reason: String },
    /// The table holds agents that break the swarm's rules (written by hand).
    #[error("agent store: the stored agents break a rule: {0}")]
    Corrupt(RouterError),
    /// The edit breaks a rule of the swarm; the client's to fix.
    #[error(transparent)]
    Rules(#[from] RouterError),
    /// The swarm already holds the most agents the server allows.
    #[error("the swarm holds {max} agents, the most this server allows (--max-agents)")]
    Full { max: usize },
}

pub type Result<T, E = AgentStoreError> = std::result::Result<T, E>;

/// The agents' table in one database. Cloning shares the pool.
#[derive(Clone)]
pub struct AgentStore {
    config: tokio_postgres::Config,
    pool: Pool,
}

impl AgentStore {
    /// Connects to the database at `url` and brings its schema up to date.
    pub async fn open(url: &str) -> Result<Self> {
        let mut config: tokio_postgres::Config = url.parse()?;
        if config.get_connect_timeout().is_none() {
            // An unreachable host would otherwise hold an edit for the system's TCP timeout.
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        let manager = Manager::from_config(
            config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .build()
            .expect("a pool without timeouts needs no runtime to build");
        let store = Self { config, pool };
        store.migrate().await?;
        Ok(store)
    }

    async fn migrate(&self) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = locked(&mut client).await?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS swarmgate_migrations (
                version integer PRIMARY KEY,
                applied_at timestamptz NOT NULL DEFAULT now()
            )",
        )
        .await?;
        let applied: i32 = tx
            .query_one(
                "SELECT coalesce(max(version), 0) FROM swarmgate_migrations",
                &[],
            )
            .await?
            .get(0);
        for (version, sql) in (1..).zip(MIGRATIONS).skip(applied as usize) {
            tx.batch_execute(sql).await?;
            tx.execute(
                "INSERT INTO swarmgate_migrations (version) VALUES ($1)",
                &[&version],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Writes `agents` if the table holds none; returns whether it did.
    pub async fn seed(&self, agents: &[AgentSpec]) -> Result<bool> {
        let mut client = self.pool.get().await?;
        let tx = locked(&mut client).await?;
        let stored: i64 = tx
            .query_one("SELECT count(*) FROM swarmgate_agents", &[])
            .await?
            .get(0);
        if stored > 0 {
            return Ok(false);
        }
        for agent in agents {
            insert(&tx, agent).await?;
        }
        notify(&tx).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Every stored agent, by name.
    pub async fn load(&self) -> Result<Vec<AgentSpec>> {
        let client = self.pool.get().await?;
        read(&client).await
    }

    /// Adds `agent` if the swarm keeps its rules with it and stays within `max_agents`.
    pub async fn add(&self, agent: &AgentSpec, max_agents: usize) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = locked(&mut client).await?;
        let mut registry = stored_registry(&tx).await?;
        if registry.agents().count() >= max_agents {
            return Err(AgentStoreError::Full { max: max_agents });
        }
        registry.add(agent.clone())?;
        insert(&tx, agent).await?;
        notify(&tx).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Removes the agent `name` if the registry allows it (see [`Registry::remove`]).
    pub async fn remove(&self, name: &AgentId) -> Result<AgentSpec> {
        let mut client = self.pool.get().await?;
        let tx = locked(&mut client).await?;
        let removed = stored_registry(&tx).await?.remove(name)?;
        tx.execute(
            "DELETE FROM swarmgate_agents WHERE name = $1",
            &[&name.as_str()],
        )
        .await?;
        notify(&tx).await?;
        tx.commit().await?;
        Ok(removed)
    }

    /// A signal to reload the agents: after each edit any replica commits, and after each
    /// (re)connection of the listener (see the module header). The listener runs until the
    /// receiver is dropped.
    pub fn changes(&self) -> mpsc::Receiver<()> {
        // One pending signal is enough: a reload reads everything committed before it.
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(listen(self.config.clone(), tx));
        rx
    }
}

/// A transaction holding the edit lock until it ends.
async fn locked(client: &mut deadpool_postgres::Client) -> Result<Transaction<'_>> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
        .await?;
    Ok(tx)
}

async fn read(client: &impl GenericClient) -> Result<Vec<AgentSpec>> {
    let rows = client
        .query(
            "SELECT name, definition FROM swarmgate_agents ORDER BY name",
            &[],
        )
        .await?;
    rows.into_iter()
        .map(|row| {
            let name: String = row.get(0);
            serde_json::from_value(row.get(1)).map_err(|e| AgentStoreError::Stored {
                name,
                reason: e.to_string(),
            })
        })
        .collect()
}

async fn stored_registry(tx: &Transaction<'_>) -> Result<Registry> {
    Registry::new(read(tx).await?).map_err(AgentStoreError::Corrupt)
}

async fn insert(tx: &Transaction<'_>, agent: &AgentSpec) -> Result<()> {
    let definition = serde_json::to_value(agent).expect("an agent serializes to JSON");
    tx.execute(
        "INSERT INTO swarmgate_agents (name, definition) VALUES ($1, $2)",
        &[&agent.name.as_str(), &definition],
    )
    .await?;
    Ok(())
}

async fn notify(tx: &Transaction<'_>) -> Result<()> {
    tx.execute("SELECT pg_notify($1, '')", &[&CHANNEL]).await?;
    Ok(())
}

/// How one connection of the listener ended.
enum Ended {
    /// Nobody reads the signals any more: the listener stops.
    ReaderGone,
    /// The server closed the connection: the listener reconnects.
    Closed,
}

/// The listener: (re)connects with a growing pause, `LISTEN`s, and signals `changes` as the
/// module header says, until `changes` is closed.
async fn listen(config: tokio_postgres::Config, changes: mpsc::Sender<()>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let ended = tokio::select! {
            ended = follow(&config, &changes) => ended,
            () = changes.closed() => return,
        };
        match ended {
            Ok(Ended::ReaderGone) => return,
            Ok(Ended::Closed) => {
                tracing::warn!("agent store: the database closed the listener; reconnecting");
                backoff = Duration::from_millis(100);
            }
            Err(e) => tracing::warn!(error = %e, "agent store: listener failed; reconnecting"),
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = changes.closed() => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection's life, from connecting to its end.
async fn follow(
    config: &tokio_postgres::Config,
    changes: &mpsc::Sender<()>,
) -> Result<Ended, tokio_postgres::Error> {
    let (client, mut connection) = config.connect(NoTls).await?;
    // The connection does the I/O of the client's queries too, so it is polled from the start.
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    let listen = format!("LISTEN {CHANNEL}");
    let listening = client.batch_execute(&listen);
    tokio::pin!(listening);
    loop {
        tokio::select! {
            done = &mut listening => { done?; break; }
            message = messages.next() => match message {
                Some(Err(e)) => return Err(e),
                Some(Ok(_)) => {}
                None => return Ok(Ended::Closed),
            },
        }
    }
    // Whatever was committed while no one listened is read by this reload.
    if changes.send(()).await.is_err() {
        return Ok(Ended::ReaderGone);
    }
    while let Some(message) = messages.next().await {
        if let AsyncMessage::Notification(_) = message? {
            // Full means a reload is pending already, and it will read this edit too.
            if let Err(mpsc::error::TrySendError::Closed(())) = changes.try_send(()) {
                return Ok(Ended::ReaderGone);
            }
        }
    }
    Ok(Ended::Closed)
}

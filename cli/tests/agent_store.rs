//! Agents kept in PostgreSQL (`--database-url`), end to end: each test has a database of its
//! own on a real server ([`support::postgres`]). Two replicas (two app states on one database)
//! see each other's additions and removals within a second, and keep doing so after the
//! listener's connection is cut; the agents survive a restart; the swarm file seeds only an
//! empty table; the rules and the bounds hold across replicas; migrations run once; a database
//! that stops answering makes edits 503s while the agents already loaded keep serving; a worker
//! (a real process, over the machine's NATS server) pins the stored agents' system prompts and
//! follows a gateway's edits.

mod support;

use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use gateway::agent_store::AgentStore;
use gateway::Swarm;
use gateway::{AppState, ServeConfig};
use protocol::{self, Heartbeat, Subjects};
use router::SwarmConfig;
use serde_json::{json, Value};
use support::cluster::{self, cluster, NATS_URL};
use support::postgres::TestDatabase;
use testkit::calls::call;
use testkit::{engine, root};

const USER_KEY: &str = "sk-user";
const ADMIN_KEY: &str = "sk-admin";
const ADMIN: Option<&str> = Some(ADMIN_KEY);

/// How long another replica may take to see an edit.
const PROPAGATION: Duration = Duration::from_secs(1);

fn shipped() -> SwarmConfig {
    SwarmConfig::load(&root().join("swarm.toml")).unwrap()
}

/// A replica on `db`, brought up as `swarmgate serve --database-url` does: the shipped swarm
/// file seeds the table if it is empty, and the swarm is the table's.
async fn replica(db: &TestDatabase, config: ServeConfig) -> AppState {
    let store = AgentStore::open(&db.url()).await.unwrap();
    let file = shipped();
    store.seed(&file.agents).await.unwrap();
    let swarm = Swarm::stored(file.routing, store, engine().clone(), None)
        .await
        .unwrap();
    let config = ServeConfig {
        api_keys: vec![USER_KEY.parse().unwrap()],
        admin_keys: vec![ADMIN_KEY.parse().unwrap()],
        ..config
    };
    AppState::configured(engine().clone(), &config).with_swarm(swarm)
}

fn agent(name: &str) -> Value {
    json!({
        "name": name,
        "description": "Gardening help: vegetables, flowers, soil, compost and pests.",
        "routing_examples": [
            "When should I plant garlic?",
            "My rose leaves have black spots.",
            "How do I start a compost heap?"
        ],
        "system_prompt": "You are a patient gardening expert.",
        "sampling": {"temperature": 0.3, "max_tokens": 64}
    })
}

async fn names(state: &AppState) -> Vec<String> {
    let (status, list) = call(state, Method::GET, "/v1/agents", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Waits until `state` lists `name` (or, when `present` is false, no longer does); returns
/// how long that took, failing past [`PROPAGATION`].
async fn seen(state: &AppState, name: &str, present: bool) -> Duration {
    let start = Instant::now();
    loop {
        let (status, _) = call(
            state,
            Method::GET,
            &format!("/v1/agents/{name}"),
            ADMIN,
            None,
        )
        .await;
        if (status == StatusCode::OK) == present {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < PROPAGATION,
            "`{name}` still {} after {PROPAGATION:?}",
            if present { "missing" } else { "listed" }
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn replicas_see_each_others_edits_within_a_second() {
    let db = TestDatabase::create("propagation").await;
    let a = replica(&db, ServeConfig::default()).await;
    let b = replica(&db, ServeConfig::default()).await;
    assert_eq!(names(&a).await, names(&b).await);

    let (status, added) = call(
        &a,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("gardener")),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{added}");
    let took = seen(&b, "gardener", true).await;
    println!("addition seen by the other replica after {took:?}");
    let (status, on_b) = call(&b, Method::GET, "/v1/agents/gardener", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(on_b["definition"], added["definition"]);

    // The rules hold across replicas: a name taken on A is taken on B.
    let (status, taken) = call(
        &b,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("gardener")),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{taken}");
    assert_eq!(taken["error"]["code"], "agent_exists");

    let (status, _) = call(&b, Method::DELETE, "/v1/agents/gardener", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK);
    let took = seen(&a, "gardener", false).await;
    println!("removal seen by the other replica after {took:?}");
    let (status, _) = call(&a, Method::DELETE, "/v1/agents/coder", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK);
    seen(&b, "coder", false).await;
    assert_eq!(names(&a).await, names(&b).await);

    // A listener whose connection is cut reconnects, and reads what it missed.
    db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .await;
    let (status, _) = call(
        &a,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("orchard")),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    seen(&b, "orchard", true).await;
}

#[tokio::test]
async fn agents_survive_a_restart_and_the_file_seeds_only_an_empty_table() {
    let db = TestDatabase::create("restart").await;
    let before = replica(&db, ServeConfig::default()).await;
    let (status, _) = call(
        &before,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("gardener")),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _) = call(&before, Method::DELETE, "/v1/agents/coder", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK);
    let expected = names(&before).await;
    drop(before);

    // The restarted replica seeds again from the file, which must change nothing.
    let after = replica(&db, ServeConfig::default()).await;
    assert_eq!(names(&after).await, expected);
    assert!(expected.contains(&"gardener".to_owned()));
    assert!(!expected.contains(&"coder".to_owned()));

    // Migrations ran once, however many replicas opened the store.
    AgentStore::open(&db.url()).await.unwrap();
    let (client, connection) = tokio_postgres::connect(&db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let applied: i64 = client
        .query_one("SELECT count(*) FROM swarmgate_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, gateway::agent_store::MIGRATIONS.len() as i64);
}

#[tokio::test]
async fn the_agent_count_is_bounded_across_replicas() {
    let db = TestDatabase::create("bounds").await;
    let bounded = || ServeConfig {
        max_agents: shipped().agents.len() + 1,
        ..ServeConfig::default()
    };
    let a = replica(&db, bounded()).await;
    let b = replica(&db, bounded()).await;
    let (status, _) = call(
        &a,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("gardener")),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    // B counts what the table holds, whether or not it has reloaded yet.
    let (status, full) = call(
        &b,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("orchard")),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{full}");
    assert_eq!(full["error"]["param"], Value::Null);
    // Definitions are checked before the store is touched.
    let mut long = agent("orchard");
    long["system_prompt"] = json!("x".repeat(ServeConfig::default().max_agent_prompt_bytes + 1));
    let (status, refused) = call(&b, Method::POST, "/v1/agents", ADMIN, Some(long)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    assert_eq!(refused["error"]["param"], "system_prompt");
    // User keys read names and descriptions here too.
    seen(&b, "gardener", true).await;
    let (_, gardener) = call(&b, Method::GET, "/v1/agents/gardener", Some(USER_KEY), None).await;
    assert_eq!(
        gardener,
        json!({"id": "gardener", "object": "agent", "description": agent("x")["description"]})
    );
}

#[tokio::test]
async fn a_database_that_stops_answering_refuses_edits_but_not_reads() {
    let db = TestDatabase::create("outage").await;
    let state = replica(&db, ServeConfig::default()).await;
    let before = names(&state).await;
    db.cut_off().await;
    let (status, refused) = call(
        &state,
        Method::POST,
        "/v1/agents",
        ADMIN,
        Some(agent("gardener")),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{refused}");
    assert_eq!(refused["error"]["code"], "state_store_unavailable");
    let (status, _) = call(&state, Method::DELETE, "/v1/agents/coder", ADMIN, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(names(&state).await, before);
}

/// The agents a worker tells the registry it holds warm, once it has heartbeated.
async fn warm(registry: &async_nats::jetstream::kv::Store, worker: &str) -> Option<Vec<String>> {
    let entry = registry.get(worker).await.unwrap()?;
    let beat: Heartbeat = protocol::decode(&entry).unwrap();
    Some(beat.warm)
}

/// Waits, at most `limit`, until `worker`'s heartbeat says `agent` is warm (or, when `present`
/// is false, no longer is); returns how long that took.
async fn warmed(
    registry: &async_nats::jetstream::kv::Store,
    worker: &str,
    agent: &str,
    present: bool,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let warm = warm(registry, worker).await.unwrap_or_default();
        if warm.iter().any(|a| a == agent) == present {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "`{agent}` still {} warm after {limit:?}: {warm:?}",
            if present { "not" } else { "" }
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_worker_pins_the_stored_agents_and_follows_the_gateways_edits() {
    let db = TestDatabase::create("worker_pins").await;
    let gateway = replica(&db, ServeConfig::default()).await;
    let cluster = cluster("pins");
    let url = db.url();
    let worker = cluster::worker(&cluster, "pins", &["--database-url", &url]).await;
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let subjects = Subjects::new(&cluster).unwrap();
    let registry = protocol::workers::bucket(client, &subjects, Duration::from_secs(2))
        .await
        .unwrap();
    // The stored agents are the shipped file's: the worker pins the answering ones.
    let shipped_agent = shipped()
        .agents
        .into_iter()
        .find(|a| !a.kind.is_system() && !a.system_prompt.trim().is_empty())
        .unwrap();
    warmed(
        &registry,
        "pins",
        shipped_agent.name.as_str(),
        true,
        Duration::from_secs(10),
    )
    .await;

    // An agent added through a gateway is pinned on the worker, and released when removed.
    let mut gardener = agent("gardener");
    gardener["system_prompt"] = json!(
        "You are a patient gardening expert. You answer questions about vegetables, flowers, \
         soil, compost, pests and the seasons, in plain words, with one practical step the \
         gardener can take today."
    );
    let (status, body) = call(&gateway, Method::POST, "/v1/agents", ADMIN, Some(gardener)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let pinned = warmed(&registry, "pins", "gardener", true, Duration::from_secs(5)).await;
    let (status, body) = call(&gateway, Method::DELETE, "/v1/agents/gardener", ADMIN, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let released = warmed(&registry, "pins", "gardener", false, Duration::from_secs(5)).await;
    println!("added agent warm on the worker after {pinned:?}, released after {released:?}");
    assert!(
        warm(&registry, "pins")
            .await
            .unwrap()
            .contains(&shipped_agent.name.to_string()),
        "the other pins stay"
    );
    drop(worker);
}

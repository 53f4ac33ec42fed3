//! What the servers do when their engine fails for good (a panic in the engine loop, injected
//! with `engine::sampler::faults`), as a supervisor sees it: `/health` and `/ready` answer 503
//! and so does every route that needs the engine; `serve` ends with an error, so the binary
//! exits non-zero and is restarted; a worker leaves the registry and ends with an error too.
//!
//! Each test starts an engine of its own and arms the fault with a seed no other request uses.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use clap::Parser;
use engine::sampler::faults;
use engine::{EmbedderConfig, EngineConfig, EngineHandle, GenerateRequest, Prompt};
use gateway::config::ServeConfig;
use gateway::transport::IntoTransport;
use gateway::worker::WorkerConfig;
use gateway::AppState;
use protocol::workers;
use protocol::Subjects;
use serde_json::json;
use testkit::calls::call;
use testkit::cluster::{cluster, free_port, NATS_URL};
use testkit::{models, MODEL_ID};

/// How long a server may take to notice that its engine stopped.
const NOTICE: Duration = Duration::from_secs(10);

fn model() -> String {
    models()
        .join(format!("{MODEL_ID}.gguf"))
        .display()
        .to_string()
}

/// Kills `engine`'s loop: a request with `seed` panics in it once armed. The fault is one for
/// the whole test binary, so one test at a time arms it.
async fn fail(engine: &EngineHandle, seed: u64) {
    static ARMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _arming = ARMING.lock().await;
    faults::STEP.store(seed, Ordering::Relaxed);
    let mut request = GenerateRequest::new(Prompt::Text("Hello".into()));
    request.sampling.seed = Some(seed);
    request.max_tokens = 4;
    let mut events = engine.submit(request).expect("the engine takes it");
    while events.next().await.is_some() {}
    tokio::time::timeout(NOTICE, engine.stopped())
        .await
        .expect("the engine loop stops");
}

#[tokio::test]
async fn serve_fails_its_probes_and_exits_when_the_engine_dies() {
    const SEED: u64 = 0x0DEA_D5E7;
    let engine = EngineHandle::start(&EngineConfig {
        model: model().into(),
        kv_cache_mb: 32,
        ..EngineConfig::default()
    })
    .unwrap();
    let config = ServeConfig {
        port: free_port(),
        grpc_port: 0,
        embedding: EmbedderConfig {
            model: "no-embedding-model".into(),
            threads: None,
            ..EmbedderConfig::default()
        },
        ..ServeConfig::default()
    };
    let state = AppState::configured(engine.clone(), &config);
    let served = tokio::spawn(gateway::serve(config, engine.clone().into_transport()));
    let (status, _) = call(&state, Method::GET, "/ready", None, None).await;
    assert_eq!(status, StatusCode::OK, "a live engine is ready");

    fail(&engine, SEED).await;
    for probe in ["/health", "/ready"] {
        let (status, body) = call(&state, Method::GET, probe, None, None).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{probe}: {body}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    let (status, body) = call(
        &state,
        Method::POST,
        "/v1/chat/completions",
        None,
        Some(chat),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "engine_unavailable", "{body}");

    let exited = tokio::time::timeout(NOTICE, served)
        .await
        .expect("serve returns once its engine stopped")
        .unwrap();
    let error = exited
        .expect_err("an error, for a non-zero exit")
        .to_string();
    assert!(error.contains("engine failed"), "{error}");
}

/// `swarmgate worker`'s command line.
#[derive(Parser)]
struct Worker {
    #[command(flatten)]
    config: WorkerConfig,
}

#[tokio::test]
async fn a_worker_leaves_the_registry_and_exits_when_its_engine_dies() {
    const SEED: u64 = 0x0DEA_D0CC;
    let cluster = cluster("dying");
    let model = model();
    let Worker { config } = Worker::parse_from([
        "worker",
        "--nats",
        NATS_URL,
        "--cluster",
        &cluster,
        "--worker-id",
        "dying",
        "--port",
        "0",
        "--model",
        &model,
        "--kv-cache-mb",
        "32",
        "--heartbeat-ms",
        "100",
        "--registry-ttl-secs",
        "30",
    ]);
    let engine = EngineHandle::start(&config.engine).unwrap();
    let running = tokio::spawn(gateway::worker::run(config, engine.clone()));
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let subjects = Subjects::new(&cluster).unwrap();
    let bucket = workers::bucket(client, &subjects, Duration::from_secs(30))
        .await
        .unwrap();
    let listed = async {
        while bucket.get("dying").await.unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), listed)
        .await
        .expect("the worker heartbeats");

    fail(&engine, SEED).await;
    let exited = tokio::time::timeout(NOTICE, running)
        .await
        .expect("the worker returns once its engine stopped")
        .unwrap();
    let error = exited
        .expect_err("an error, for a non-zero exit")
        .to_string();
    assert!(error.contains("engine failed"), "{error}");
    // Its key is gone at once, long before the registry's 30 s TTL would drop it: no gateway
    // sends it another request.
    assert!(bucket.get("dying").await.unwrap().is_none());
}

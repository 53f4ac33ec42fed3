//! What the end-to-end tests of `gateway` and `cli` share: the one engine a test binary runs on
//! the real model, the lock that gives each generating test that engine to itself, the checks
//! that a cancelled request freed it, a real server on an ephemeral port, one request through
//! `app()` ([`api`]), and the names and ports of a test's cluster ([`cluster`]). Each test file
//! uses the part it needs.
//!
//! Only tests depend on this crate; it is never published. What needs the `swarmgate` binary
//! stays in `cli/tests/support`, since only the crate that owns a binary can find it.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use engine::{EngineConfig, EngineHandle};

pub mod calls;
pub mod cluster;

pub const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";
pub const QUESTION: &str = "What is the capital of France? Answer in one sentence.";
/// The prompt of a request that, left alone with `ignore_eos`, runs until the KV cache is full:
/// far longer than any test waits.
pub const ENDLESS_PROMPT: &str = "Count from 1 to 10000.";

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where `make models` puts the models.
pub fn models() -> PathBuf {
    root().join("models")
}

/// The binary's engine, started on first use (loading the model is the slow part).
pub fn engine() -> &'static EngineHandle {
    static ENGINE: LazyLock<EngineHandle> = LazyLock::new(|| {
        let model = models().join(format!("{MODEL_ID}.gguf"));
        assert!(
            model.is_file(),
            "{} is missing: run `make models`",
            model.display()
        );
        EngineHandle::start(&EngineConfig {
            model,
            kv_cache_mb: 64,
            ..EngineConfig::default()
        })
        .expect("the engine starts")
    });
    &ENGINE
}

/// The embedding model (all-MiniLM-L6-v2) on one thread, for a test's swarm to route with.
pub fn embedder() -> Arc<engine::Embedder> {
    let config = engine::EmbedderConfig {
        model: models().join("all-MiniLM-L6-v2"),
        threads: Some(1),
        ..engine::EmbedderConfig::default()
    };
    Arc::new(engine::Embedder::load(&config).expect("the embedder loads (run `make models`)"))
}

/// Held by every test that makes the engine generate, so that the checks below see only that
/// test's sequences.
pub async fn generating() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Waits, at most 5 s, until the engine runs nothing and no sequence holds a KV block (blocks
/// kept for prefix reuse are free to take).
pub async fn wait_until_idle() {
    let stats = engine().stats();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let running = stats.running.load(Ordering::Relaxed);
        let waiting = stats.waiting.load(Ordering::Relaxed);
        let kv = stats.kv().gauges;
        if running == 0 && waiting == 0 && kv.device_used == 0 && kv.host_swapped == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still running={running} waiting={waiting} kv={kv:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asserts the engine stopped well short of running an endless request to the end.
pub fn assert_cancelled(decoded_before: u64) {
    let decoded = engine().stats().decode_tokens.load(Ordering::Relaxed) - decoded_before;
    let capacity = engine().model().kv_capacity_tokens as u64;
    assert!(
        decoded < capacity / 2,
        "{decoded} tokens decoded: the request ran on instead of being cancelled"
    );
}

/// A real server on an ephemeral port, stopped when the test's runtime ends.
pub async fn serve(state: gateway::AppState) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway::serve_on(
        listener,
        state,
        std::future::pending::<()>(),
    ));
    addr
}

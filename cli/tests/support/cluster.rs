//! Gateways and workers as real processes of the `swarmgate` binary, joined by the machine's
//! NATS server (`make test` starts one when none runs), or by a test's own
//! ([`super::nats::NatsServer`]). Each test names its own cluster ([`testkit::cluster`]), so
//! tests running side by side, or other swarms on the same server, never see each other's
//! workers.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use testkit::cluster::{cluster, free_port, NATS_URL};
use testkit::{models, root, MODEL_ID};

/// A running `swarmgate` process; killed when dropped.
pub struct Process {
    pub child: Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Process {
    /// Starts `swarmgate <args>` with `port` for its HTTP side and `env` set, logging to a file
    /// of its own.
    fn start(name: &str, args: &[&str], env: &[(&str, &str)], port: u16) -> Self {
        let log = std::env::temp_dir().join(format!("swarmgate-{name}-{port}.log"));
        let out = File::create(&log).expect("a log file");
        let child = Command::new(env!("CARGO_BIN_EXE_swarmgate"))
            .args(args)
            .args(["--port", &port.to_string()])
            .current_dir(root())
            .env("SWARMGATE_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("swarmgate starts");
        Self { child, port, log }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Waits until `GET path` answers 200, for at most `limit`; panics with the log otherwise.
    pub async fn wait_for(&mut self, path: &str, limit: Duration) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("the process can be polled") {
                panic!(
                    "{} exited with {status}:\n{}",
                    self.log.display(),
                    self.tail()
                );
            }
            if let Ok(response) = client.get(self.url(path)).send().await {
                if response.status().is_success() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{path} not ready after {limit:?}:\n{}",
                self.tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The end of the process's log, for failure messages.
    pub fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Waits at most `limit` for the process to exit; its exit status.
    pub async fn exit_status(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("the process can be polled") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit:\n{}",
                self.log.display(),
                self.tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGKILL: the process dies without a word.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM: the process shuts down in order.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// A counter or gauge of the process's `/metrics`, 0 when absent.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(self.url("/metrics"))
            .await
            .expect("/metrics answers")
            .text()
            .await
            .expect("a text body");
        text.lines()
            .find_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                (series == name).then(|| value.parse().ok()).flatten()
            })
            .unwrap_or(0.0)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn model_path() -> String {
    models()
        .join(format!("{MODEL_ID}.gguf"))
        .display()
        .to_string()
}

/// Starts a worker of `cluster` named `id` on the machine's NATS server, with a small cache and
/// one compute thread, quick heartbeats (250 ms) and a 2 s registry TTL; waits until it serves.
pub async fn worker(cluster: &str, id: &str, extra: &[&str]) -> Process {
    let mut process = spawn_worker(NATS_URL, cluster, id, extra, &[]);
    process.wait_for("/health", Duration::from_secs(120)).await;
    process
}

/// Starts a worker as [`worker`] does, on the NATS server at `nats` with `env` set, without
/// waiting for it.
pub fn spawn_worker(
    nats: &str,
    cluster: &str,
    id: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Process {
    let model = model_path();
    let mut args = vec![
        "worker",
        "--nats",
        nats,
        "--cluster",
        cluster,
        "--worker-id",
        id,
        "--model",
        &model,
        "--kv-cache-mb",
        "96",
        "--threads",
        "1",
        "--heartbeat-ms",
        "250",
        "--registry-ttl-secs",
        "2",
    ];
    args.extend_from_slice(extra);
    Process::start(id, &args, env, free_port())
}

/// Starts a gateway of `cluster` on the machine's NATS server (no gRPC port) with a 2 s
/// registry TTL and stream timeout; waits until its HTTP side answers (not until a worker is
/// live: `/ready` tells that).
pub async fn gateway(cluster: &str) -> Process {
    let mut process = spawn_gateway(NATS_URL, cluster, &[]);
    process.wait_for("/health", Duration::from_secs(120)).await;
    process
}

/// Starts a gateway as [`gateway`] does, on the NATS server at `nats` with `env` set, without
/// waiting for it.
pub fn spawn_gateway(nats: &str, cluster: &str, env: &[(&str, &str)]) -> Process {
    let model = model_path();
    let args = [
        "gateway",
        "--nats",
        nats,
        "--cluster",
        cluster,
        "--model",
        &model,
        "--grpc-port",
        "0",
        "--registry-ttl-secs",
        "2",
        "--stream-timeout-secs",
        "2",
    ];
    Process::start("gateway", &args, env, free_port())
}

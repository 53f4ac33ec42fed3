//! A NATS server of a test's own: a real `nats-server` process with JetStream, on an ephemeral
//! port, configured by the test (users, permissions, TLS, `max_payload`), that the test can stop
//! and start again on the same port. Killed when dropped.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::cluster::free_port;

pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    config: PathBuf,
    /// Where the server's files go, removed when dropped.
    pub dir: PathBuf,
    env: Vec<(String, String)>,
}

impl NatsServer {
    /// Starts `nats-server` with `config` (the server's configuration language; the port,
    /// address and JetStream come from its command line) and `env` set (a configuration may
    /// name environment variables). Waits until it takes connections.
    pub fn start(config: &str, env: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!("swarmgate-nats-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("a directory for the server");
        let path = dir.join("nats.conf");
        std::fs::write(&path, config).expect("the server's configuration");
        Self::start_with_file(&path, dir, env)
    }

    /// Starts `nats-server` with the configuration file at `config`, keeping its files in `dir`.
    pub fn start_with_file(config: &Path, dir: PathBuf, env: &[(&str, &str)]) -> Self {
        let mut server = Self {
            child: None,
            port: free_port(),
            config: config.to_owned(),
            dir,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        server.resume();
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (its in-memory streams, the workers' registry among them, go with it).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on its port, with its configuration; waits until it takes
    /// connections.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "the server runs already");
        let log = std::fs::File::create(self.dir.join("nats.log")).expect("a log file");
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&self.config)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .arg("-sd")
            .arg(self.dir.join("jetstream"))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("nats-server is installed");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("nats-server exited with {status}:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nats.log")).unwrap_or_default()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

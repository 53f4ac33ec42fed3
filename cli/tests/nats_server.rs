//! Gateways and workers on a NATS server of the test's own (a real `nats-server` on an
//! ephemeral port): the compose file's per-role users and permissions, TLS with a private CA and
//! client certificates, `.creds` files (nkeys and JWTs) on a server run by an operator, a server restart that takes the registry with it, and a server whose
//! `max_payload` is smaller than an answer's prompt logprobs.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use protocol::connect::NatsArgs;
use protocol::workers;
use protocol::{self, Heartbeat, Subjects, VERSION};
use serde_json::{json, Value};
use support::cluster::{self, Process};
use support::jwt::{self, Operator};
use support::nats::NatsServer;

const GATEWAY_PASSWORD: &str = "gateway-secret-for-tests";
const WORKER_PASSWORD: &str = "worker-secret-for-tests";

/// A client of `server` as `user`, and the server's errors it is told about (permission
/// violations among them).
async fn as_user(
    server: &NatsServer,
    user: &str,
    password: &str,
) -> (
    async_nats::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (errors, received) = tokio::sync::mpsc::unbounded_channel();
    let client = async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .event_callback(move |event| {
            let errors = errors.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    let _ = errors.send(e.to_string());
                }
            }
        })
        .connect(server.url())
        .await
        .unwrap_or_else(|e| panic!("{user} connects: {e}"));
    (client, received)
}

/// Waits at most 5 s for a permission violation naming `subject`.
async fn violation(errors: &mut tokio::sync::mpsc::UnboundedReceiver<String>, subject: &str) {
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(error) = errors.recv().await {
            if error.to_lowercase().contains("permissions violation") && error.contains(subject) {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "no permission violation for {subject}");
}

/// Waits at most `limit` for `GET path` to answer `status`.
async fn wait_status(process: &Process, path: &str, status: u16, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let answer = reqwest::get(process.url(path)).await.map(|r| r.status());
        if answer.as_ref().is_ok_and(|s| s.as_u16() == status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{path} answered {answer:?}, not {status}, for {limit:?}:\n{}",
            process.tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A short chat through `gateway`; its answer's text.
async fn chat(gateway: &Process) -> String {
    let response = reqwest::Client::new()
        .post(gateway.url("/v1/chat/completions"))
        .json(&json!({
            "model": "default",
            "messages": [{"role": "user", "content": testkit::QUESTION}],
            "max_tokens": 4,
            "temperature": 0,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", gateway.tail());
    let body: Value = response.json().await.unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .expect("an answer")
        .to_owned()
}

#[tokio::test]
async fn the_compose_roles_serve_a_swarm_and_only_workers_write_heartbeats() {
    let dir = std::env::temp_dir().join(format!("swarmgate-roles-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = NatsServer::start_with_file(
        &testkit::root().join("docker/nats.conf"),
        dir,
        &[
            ("NATS_GATEWAY_PASSWORD", GATEWAY_PASSWORD),
            ("NATS_WORKER_PASSWORD", WORKER_PASSWORD),
        ],
    );
    let url = server.url();

    // Nobody connects without a user, or with a wrong password.
    assert!(async_nats::connect(&url).await.is_err());
    let mut wrong = NatsArgs::new(&url, "swarm");
    wrong.user = Some("worker".into());
    wrong.password = Some(GATEWAY_PASSWORD.parse().unwrap());
    assert!(wrong.connect("test").await.is_err());

    // Each role's credentials from the environment; the compose file's cluster name.
    let mut worker = cluster::spawn_worker(
        &url,
        "swarm",
        "w1",
        &[],
        &[
            ("SWARMGATE_NATS_USER", "worker"),
            ("SWARMGATE_NATS_PASSWORD", WORKER_PASSWORD),
        ],
    );
    worker.wait_for("/health", Duration::from_secs(120)).await;
    let mut gateway = cluster::spawn_gateway(
        &url,
        "swarm",
        &[
            ("SWARMGATE_NATS_USER", "gateway"),
            ("SWARMGATE_NATS_PASSWORD", GATEWAY_PASSWORD),
        ],
    );
    gateway.wait_for("/ready", Duration::from_secs(120)).await;
    assert!(!chat(&gateway).await.is_empty());
    for log in [worker.tail(), gateway.tail()] {
        assert!(
            !log.contains(GATEWAY_PASSWORD) && !log.contains(WORKER_PASSWORD),
            "a password in a log:\n{log}"
        );
    }

    // A gateway may read the registry but not write a heartbeat, nor take requests.
    let subjects = Subjects::new("swarm").unwrap();
    let (as_gateway, mut errors) = as_user(&server, "gateway", GATEWAY_PASSWORD).await;
    let store = workers::bucket(as_gateway.clone(), &subjects, Duration::from_secs(2))
        .await
        .expect("a gateway opens the registry");
    let forged = Heartbeat {
        v: VERSION,
        worker: "w1".into(),
        models: vec!["forged".into()],
        agents: vec![],
        running: 0,
        waiting: 0,
        in_flight: 0,
        free_kv_blocks: 0,
        warm: vec![],
    };
    let put = store.put("w1", protocol::encode(&forged));
    assert!(
        !matches!(
            tokio::time::timeout(Duration::from_secs(10), put).await,
            Ok(Ok(_))
        ),
        "a gateway wrote a heartbeat"
    );
    violation(&mut errors, "$KV.swarm_workers.w1").await;
    let beat: Heartbeat =
        protocol::decode(&store.get("w1").await.unwrap().expect("w1's beat")).expect("a heartbeat");
    assert_eq!(
        beat.models,
        [testkit::MODEL_ID],
        "the worker's own heartbeat"
    );
    let _stolen = as_gateway.subscribe(subjects.any()).await.unwrap();
    violation(&mut errors, &subjects.any()).await;

    // A worker may not offer requests.
    let (as_worker, mut errors) = as_user(&server, "worker", WORKER_PASSWORD).await;
    as_worker
        .publish(subjects.any(), "{}".into())
        .await
        .unwrap();
    violation(&mut errors, &subjects.any()).await;
}

#[tokio::test]
async fn after_a_nats_restart_the_registry_is_back_and_ready_recovers_by_itself() {
    let mut server = NatsServer::start("", &[]);
    let url = server.url();
    let name = cluster::cluster("restart");
    let mut worker = cluster::spawn_worker(&url, &name, "w1", &[], &[]);
    worker.wait_for("/health", Duration::from_secs(120)).await;
    let mut gateway = cluster::spawn_gateway(&url, &name, &[]);
    gateway.wait_for("/ready", Duration::from_secs(120)).await;
    // A long-lived registry: hundreds of heartbeats (of another model's stand-in, which the
    // gateway counts for nothing). A watch that resumed after them on the new, empty bucket
    // would miss the worker's next heartbeats for minutes.
    let client = async_nats::connect(&url).await.unwrap();
    let subjects = Subjects::new(&name).unwrap();
    let store = workers::bucket(client, &subjects, Duration::from_secs(2))
        .await
        .unwrap();
    let mut filler = Heartbeat {
        v: VERSION,
        worker: "filler".into(),
        models: vec!["another-model".into()],
        agents: vec![],
        running: 0,
        waiting: 0,
        in_flight: 0,
        free_kv_blocks: 0,
        warm: vec![],
    };
    for in_flight in 0..600 {
        filler.in_flight = in_flight;
        store
            .put("filler", protocol::encode(&filler))
            .await
            .unwrap();
    }

    // The server goes, and the registry (a stream in memory) with it: no worker is live.
    server.stop();
    wait_status(&gateway, "/ready", 503, Duration::from_secs(10)).await;

    // It comes back empty: the bucket is created again, the worker's heartbeats fill it, and
    // the gateway serves again, neither process restarted.
    server.resume();
    wait_status(&gateway, "/ready", 200, Duration::from_secs(20)).await;
    assert!(!chat(&gateway).await.is_empty());
    for process in [&mut worker, &mut gateway] {
        assert!(
            process.child.try_wait().unwrap().is_none(),
            "a process exited"
        );
    }
}

#[tokio::test]
async fn prompt_logprobs_larger_than_the_servers_max_payload_arrive_whole() {
    let max_payload = 16 * 1024;
    let server = NatsServer::start(&format!("max_payload: {max_payload}\n"), &[]);
    let url = server.url();
    let name = cluster::cluster("payload");
    let mut worker = cluster::spawn_worker(&url, &name, "w1", &[], &[]);
    worker.wait_for("/health", Duration::from_secs(120)).await;
    let mut gateway = cluster::spawn_gateway(&url, &name, &[]);
    gateway.wait_for("/ready", Duration::from_secs(120)).await;

    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let response = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(&json!({
            "model": "default",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "echo": true,
            "logprobs": 5,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", worker.tail());
    let body: Value = response.json().await.unwrap();
    let logprobs = &body["choices"][0]["logprobs"];
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let completion_tokens = body["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let token_logprobs = logprobs["token_logprobs"].as_array().unwrap();
    assert_eq!(token_logprobs.len(), prompt_tokens + completion_tokens);
    // Every prompt token after the first is scored, with its alternatives: far more than one
    // message holds.
    assert!(token_logprobs[0].is_null());
    assert!(token_logprobs[1..].iter().all(Value::is_number));
    let top = logprobs["top_logprobs"].as_array().unwrap();
    assert!(top[1..]
        .iter()
        .all(|t| t.as_object().is_some_and(|t| !t.is_empty())));
    assert!(
        serde_json::to_vec(logprobs).unwrap().len() > 2 * max_payload,
        "the prompt logprobs fit one message: the test proves nothing"
    );
}

/// Writes a private CA, a server certificate for 127.0.0.1 and a client certificate under
/// `dir` with the `openssl` command.
fn certificates(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for (name, extensions) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
        ("other-ca", ""),
        ("ca", ""),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), extensions).unwrap();
    }
    for ca in ["ca", "other-ca"] {
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN={ca}"),
            "-keyout",
            &format!("{ca}-key.pem"),
            "-out",
            &format!("{ca}.pem"),
        ]);
    }
    for name in ["server", "client"] {
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}.csr"),
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            &format!("{name}.pem"),
            "-extfile",
            &format!("{name}.ext"),
        ]);
    }
}

#[tokio::test]
async fn tls_with_a_private_ca_and_a_client_certificate() {
    let dir = std::env::temp_dir().join(format!("swarmgate-tls-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir);
    let path = |name: &str| dir.join(name).display().to_string();
    let config = format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n}}\n",
        path("server.pem"),
        path("server-key.pem"),
        path("ca.pem")
    );
    let server = NatsServer::start(&config, &[]);
    let mut nats = NatsArgs::new(&server.url(), "tls");
    nats.tls_ca = Some(dir.join("ca.pem"));

    // The server wants a client certificate.
    assert!(nats.connect("test").await.is_err());
    nats.tls_cert = Some(dir.join("client.pem"));
    nats.tls_key = Some(dir.join("client-key.pem"));
    let client = nats.connect("test").await.expect("a TLS connection");
    let mut echo = client.subscribe("tls.echo").await.unwrap();
    client.publish("tls.echo", "over TLS".into()).await.unwrap();
    let message = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&message.payload[..], b"over TLS");

    // A server whose certificate another CA signed is not trusted.
    nats.tls_ca = Some(dir.join("other-ca.pem"));
    assert!(nats.connect("test").await.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn creds_files_log_workers_and_gateways_in_to_an_operator_s_server() {
    let operator = Operator::new("swarmgate-test");
    let account = operator.account("swarm");
    let stranger = Operator::new("elsewhere").account("elsewhere");
    let server = NatsServer::start(&jwt::server_config(&operator, &[&account]), &[]);
    let url = server.url();
    let dir = std::env::temp_dir().join(format!("swarmgate-creds-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let creds = |name: &str, text: String| {
        let path = dir.join(format!("{name}.creds"));
        std::fs::write(&path, text).unwrap();
        path
    };
    let worker_creds = creds("worker", account.user_creds("worker"));
    let gateway_creds = creds("gateway", account.user_creds("gateway"));
    let stranger_creds = creds("stranger", stranger.user_creds("stranger"));

    // Without credentials, or with a user of an account the server does not know: refused.
    assert!(async_nats::connect(&url).await.is_err());
    let mut nats = NatsArgs::new(&url, "creds");
    nats.creds = Some(stranger_creds);
    assert!(nats.connect("test").await.is_err());

    // The flag for the worker, the environment variable for the gateway; a chat goes through.
    let worker_creds = worker_creds.display().to_string();
    let mut worker =
        cluster::spawn_worker(&url, "creds", "w1", &["--nats-creds", &worker_creds], &[]);
    worker.wait_for("/health", Duration::from_secs(120)).await;
    let gateway_creds = gateway_creds.display().to_string();
    let mut gateway = cluster::spawn_gateway(
        &url,
        "creds",
        &[("SWARMGATE_NATS_CREDS", gateway_creds.as_str())],
    );
    gateway.wait_for("/ready", Duration::from_secs(120)).await;
    assert!(!chat(&gateway).await.is_empty());
    let seed_line = |path: &str| {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .find(|l| l.starts_with("SU"))
            .unwrap()
            .to_owned()
    };
    for (log, path) in [
        (worker.tail(), &worker_creds),
        (gateway.tail(), &gateway_creds),
    ] {
        assert!(!log.contains(&seed_line(path)), "a seed in a log:\n{log}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

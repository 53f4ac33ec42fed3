//! How gateways and workers join NATS: one [`NatsArgs`], flattened into both `swarmgate gateway`
//! and `swarmgate worker`, so the two sides take the same server, cluster, credentials and TLS
//! settings and connect the same way ([`NatsArgs::connect`]).
//!
//! Credentials come from a `.creds` file (nkey and JWT, `--nats-creds`), or a user and password,
//! or a token, each best given in the environment (`SWARMGATE_NATS_USER`,
//! `SWARMGATE_NATS_PASSWORD`, `SWARMGATE_NATS_TOKEN`): flags show in the process list. TLS
//! takes a CA to trust (`--nats-tls-ca`) and a client certificate and key (`--nats-tls-cert`,
//! `--nats-tls-key`).
//!
//! Invariants: a secret never reaches a log, an error or `Debug` output ([`Secret`] prints as
//! `Secret(..)`); a server URL carrying credentials (`nats://user:pass@host`) is refused at
//! start-up, so URLs can be logged as they are. The client reconnects on its own after losing
//! the server, forever, and logs each loss and return.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Context as _;

use crate::Subjects;

/// A password or token: its `Debug` and `Display` hide it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    fn expose(&self) -> String {
        self.0.clone()
    }
}

impl FromStr for Secret {
    type Err = String;

    fn from_str(secret: &str) -> Result<Self, String> {
        if secret.is_empty() {
            return Err("must not be empty".into());
        }
        Ok(Self(secret.to_owned()))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Where the gateways and the workers meet, and how they prove who they are.
#[derive(Clone, Debug, clap::Args)]
pub struct NatsArgs {
    /// NATS server (with JetStream) joining gateways and workers; several may be given,
    /// comma-separated. Credentials do not belong here (see `--nats-creds`,
    /// `SWARMGATE_NATS_USER`, `SWARMGATE_NATS_TOKEN`): a URL with any is refused.
    #[arg(
        long = "nats",
        env = "SWARMGATE_NATS",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub url: String,
    /// The cluster's name: its subjects start with it, its registry is `<name>_workers`. Gateways
    /// and workers of one swarm share it; swarms sharing a NATS server differ.
    #[arg(long, env = "SWARMGATE_CLUSTER", default_value = "swarm")]
    pub cluster: String,
    /// A worker whose last heartbeat is older than this is taken for gone.
    #[arg(long, env = "SWARMGATE_REGISTRY_TTL_SECS", default_value_t = 5.0)]
    pub registry_ttl_secs: f64,
    /// A NATS credentials file (a user JWT and its nkey seed, as `nsc` writes them).
    #[arg(long = "nats-creds", env = "SWARMGATE_NATS_CREDS")]
    pub creds: Option<PathBuf>,
    /// The NATS user; its password comes from `SWARMGATE_NATS_PASSWORD`.
    #[arg(long = "nats-user", env = "SWARMGATE_NATS_USER")]
    pub user: Option<String>,
    /// The NATS user's password (better given as `SWARMGATE_NATS_PASSWORD`: a flag shows in the
    /// process list).
    #[arg(
        long = "nats-password",
        env = "SWARMGATE_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<Secret>,
    /// A NATS token (better given as `SWARMGATE_NATS_TOKEN`: a flag shows in the process list).
    #[arg(
        long = "nats-token",
        env = "SWARMGATE_NATS_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<Secret>,
    /// A PEM file of CA certificates to trust for the NATS server's; TLS is then required.
    #[arg(long = "nats-tls-ca", env = "SWARMGATE_NATS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// A PEM client certificate for NATS servers that verify clients (with `--nats-tls-key`).
    #[arg(long = "nats-tls-cert", env = "SWARMGATE_NATS_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--nats-tls-cert`.
    #[arg(long = "nats-tls-key", env = "SWARMGATE_NATS_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// Settings for the server at `url` and the cluster `cluster`, with no credentials and no
    /// TLS, and a 5 s registry TTL.
    pub fn new(url: &str, cluster: &str) -> Self {
        Self {
            url: url.to_owned(),
            cluster: cluster.to_owned(),
            registry_ttl_secs: 5.0,
            creds: None,
            user: None,
            password: None,
            token: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
        }
    }

    pub fn subjects(&self) -> anyhow::Result<Subjects> {
        Subjects::new(&self.cluster).context("--cluster must be letters, digits, `-` or `_`")
    }

    pub fn registry_ttl(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.registry_ttl_secs)
            .ok()
            .filter(|ttl| !ttl.is_zero())
            .context("--registry-ttl-secs must be a positive number of seconds")
    }

    /// Rejects settings that cannot connect, or that would put a secret in a URL.
    pub fn validate(&self) -> anyhow::Result<()> {
        for server in self.url.split(',').map(str::trim) {
            let addr: async_nats::ServerAddr = server
                .parse()
                .map_err(|_| anyhow::anyhow!("--nats: {server:?} is not a NATS server URL"))?;
            // The URL is named only once it is known to hold no secret.
            anyhow::ensure!(
                addr.username().is_none() && addr.password().is_none(),
                "--nats must not carry credentials (a user, password or token in the URL ends \
                 up in process lists and logs): use --nats-creds, or SWARMGATE_NATS_USER with \
                 SWARMGATE_NATS_PASSWORD, or SWARMGATE_NATS_TOKEN"
            );
        }
        let methods = [
            self.creds.is_some(),
            self.user.is_some() || self.password.is_some(),
            self.token.is_some(),
        ];
        anyhow::ensure!(
            methods.iter().filter(|m| **m).count() <= 1,
            "give one way to authenticate to NATS: a credentials file, a user and password, or \
             a token"
        );
        anyhow::ensure!(
            self.user.is_some() == self.password.is_some(),
            "a NATS user needs its password (SWARMGATE_NATS_PASSWORD), and a password its user \
             (SWARMGATE_NATS_USER)"
        );
        anyhow::ensure!(
            self.tls_cert.is_some() == self.tls_key.is_some(),
            "--nats-tls-cert and --nats-tls-key go together"
        );
        self.subjects()?;
        self.registry_ttl()?;
        Ok(())
    }

    /// Connects to NATS as `name` (the name the server's monitoring shows). The client
    /// reconnects after a loss on its own, without limit (the client's default).
    pub async fn connect(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        self.validate()?;
        let mut options =
            async_nats::ConnectOptions::new()
                .name(name)
                .event_callback(|event| async move {
                    match event {
                        async_nats::Event::Connected => tracing::info!("NATS connection (re)made"),
                        async_nats::Event::Disconnected => {
                            tracing::warn!("NATS connection lost; reconnecting")
                        }
                        other => tracing::warn!(event = %other, "NATS"),
                    }
                });
        if let Some(path) = &self.creds {
            options = options
                .credentials_file(path)
                .await
                .with_context(|| format!("cannot read --nats-creds {}", path.display()))?;
        }
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            options = options.user_and_password(user.clone(), password.expose());
        }
        if let Some(token) = &self.token {
            options = options.token(token.expose());
        }
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            options = options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        options
            .connect(self.url.as_str())
            .await
            .with_context(|| format!("cannot reach NATS at {}", self.url))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        nats: NatsArgs,
    }

    fn parse(args: &[&str]) -> NatsArgs {
        Cli::try_parse_from(std::iter::once("swarmgate").chain(args.iter().copied()))
            .unwrap()
            .nats
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let nats = parse(&["--nats-user", "gw", "--nats-password", "hunter2-secret"]);
        nats.validate().unwrap();
        let printed = format!("{nats:?}");
        assert!(!printed.contains("hunter2-secret"), "{printed}");
        assert!(printed.contains("Secret(..)"), "{printed}");
        let nats = parse(&["--nats-token", "tok-secret"]);
        assert!(!format!("{nats:?}").contains("tok-secret"));
    }

    #[test]
    fn a_url_with_credentials_is_refused_without_repeating_them() {
        for url in [
            "nats://gw:hunter2-secret@127.0.0.1:4222",
            "nats://hunter2-secret@127.0.0.1:4222",
            "nats://127.0.0.1:4222,nats://gw:hunter2-secret@127.0.0.1:4223",
        ] {
            let error = parse(&["--nats", url]).validate().unwrap_err().to_string();
            assert!(error.contains("must not carry credentials"), "{error}");
            assert!(!error.contains("hunter2-secret"), "{error}");
        }
        parse(&["--nats", "nats://a:4222,tls://b:4222"])
            .validate()
            .unwrap();
    }

    #[test]
    fn one_way_to_authenticate_and_complete_pairs() {
        let invalid = |args: &[&str]| parse(args).validate().unwrap_err().to_string();
        assert!(invalid(&["--nats-creds", "a.creds", "--nats-token", "t"]).contains("one way"));
        assert!(invalid(&["--nats-user", "gw"]).contains("needs its password"));
        assert!(invalid(&["--nats-password", "p"]).contains("needs its password"));
        assert!(invalid(&["--nats-tls-cert", "c.pem"]).contains("go together"));
        assert!(invalid(&["--cluster", "a.b"]).contains("--cluster"));
        parse(&["--nats-tls-ca", "ca.pem"]).validate().unwrap();
    }

    #[tokio::test]
    async fn an_unreadable_credentials_file_is_named() {
        let nats = parse(&["--nats-creds", "/nonexistent/swarm.creds"]);
        let error = format!("{:#}", nats.connect("test").await.unwrap_err());
        assert!(error.contains("/nonexistent/swarm.creds"), "{error}");
    }
}

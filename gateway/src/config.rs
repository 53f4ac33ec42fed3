//! The server's settings: where to listen, how much a client may send, who may call and how
//! often, and the engine's own settings flattened in, so one struct is the whole command line.
//!
//! Every flag also reads a `SWARMGATE_*` environment variable, and every setting can come from
//! a TOML file (`--config PATH`, `SWARMGATE_CONFIG`, else `swarmgate.toml` when the working
//! directory has one) with a `[server]` and an `[engine]` section, keys named like the struct
//! fields (`max_body_bytes`, `kv_cache_mb`). [`ServeConfig::load`] resolves it all once, at
//! start-up, in this order: flag, then environment, then file, then default; it rejects unknown
//! keys by name and validates the result. Nothing in the gateway reads the environment after
//! that.

use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, FromArgMatches};
use engine::{EmbedderConfig, EngineConfig};
use serde_json::{Map, Value};

use crate::auth::ApiKey;
use crate::deadline::Timeouts;
use crate::validate::agent_definition::AgentLimits;

/// The file read when neither `--config` nor `SWARMGATE_CONFIG` names one, if it exists.
pub const DEFAULT_CONFIG_FILE: &str = "swarmgate.toml";

/// The swarm file read when none is named, if it exists in the working directory.
pub const DEFAULT_SWARM_FILE: &str = "swarm.toml";

/// Settings for `swarmgate serve`.
#[derive(Clone, Debug, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// TOML file with `[server]` and `[engine]` sections; flags and environment variables
    /// override it [default: swarmgate.toml, if present].
    #[arg(long, env = "SWARMGATE_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to listen on (a name such as `localhost`, or an IP; `0.0.0.0` for every
    /// interface).
    #[arg(long, env = "SWARMGATE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port to listen on.
    #[arg(long, env = "SWARMGATE_PORT", default_value_t = 8080)]
    pub port: u16,
    /// TCP port for the gRPC API, on the same host; 0 turns it off.
    #[arg(long, env = "SWARMGATE_GRPC_PORT", default_value_t = 50051)]
    pub grpc_port: u16,
    /// Largest request body accepted, in bytes; larger ones get 413 before any parsing.
    #[arg(long, env = "SWARMGATE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Seconds a client may take to send a request's headers, counted from when its
    /// connection is ready for a request (so also the longest an HTTP/1 connection waits
    /// for a next request); then the connection is closed.
    #[arg(
        long,
        env = "SWARMGATE_HEADER_READ_TIMEOUT_SECS",
        default_value_t = 10.0
    )]
    pub header_read_timeout_secs: f64,
    /// Seconds a client may take to send a request's body once the handler reads it; then 408.
    #[arg(long, env = "SWARMGATE_BODY_READ_TIMEOUT_SECS", default_value_t = 30.0)]
    pub body_read_timeout_secs: f64,
    /// Seconds a connection may stay silent (no byte either way) before it is shut down: at
    /// once when idle, after the request in flight otherwise.
    #[arg(long, env = "SWARMGATE_IDLE_TIMEOUT_SECS", default_value_t = 60.0)]
    pub idle_timeout_secs: f64,
    /// gRPC calls one connection may carry at once (HTTP/2 `max_concurrent_streams`).
    #[arg(
        long,
        env = "SWARMGATE_GRPC_MAX_CONCURRENT_STREAMS",
        default_value_t = 128
    )]
    pub grpc_max_concurrent_streams: u32,
    /// On SIGTERM, how long requests in flight may take to finish before they are cut off.
    #[arg(long, env = "SWARMGATE_SHUTDOWN_GRACE_SECS", default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// An API key clients must send as `Authorization: Bearer KEY`; repeat the flag for more
    /// (the environment variable takes a comma-separated list). Without keys the API is open.
    /// In the file, a key may be a table with bounds of its own (`max_tokens`, `rpm`, `tpm`).
    #[arg(
        long = "api-key",
        env = "SWARMGATE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<ApiKey>,
    /// A key that may also add and remove agents (`POST`/`DELETE /v1/agents`); repeat the flag
    /// for more (the environment variable takes a comma-separated list). An admin key is
    /// accepted wherever an API key is. Without admin keys, agents cannot be edited at run time.
    #[arg(
        long = "admin-key",
        env = "SWARMGATE_ADMIN_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub admin_keys: Vec<ApiKey>,
    /// Serve `/metrics` without a key even when keys are configured (by default it takes a
    /// key then: its series name agents and traffic).
    #[arg(long, env = "SWARMGATE_METRICS_PUBLIC", default_value_t = false, action = clap::ArgAction::Set)]
    pub metrics_public: bool,
    /// Redis holding the rate-limit and budget buckets and the sessions' histories
    /// (`redis://host:port/db`), shared by every gateway replica pointed at it; without one they
    /// live in this process.
    #[arg(long, env = "SWARMGATE_REDIS")]
    pub redis: Option<String>,
    /// Seconds a conversation session (a chat request's `x-session-id` header, else its `user`)
    /// keeps its history after its last request, and a stored response (`POST /v1/responses`
    /// with `store`) lives after it was last written or read; 0 turns both off.
    #[arg(long, env = "SWARMGATE_SESSION_TTL_SECS", default_value_t = 3600)]
    pub session_ttl_secs: u64,
    /// Most bytes of history a session, or a stored response's input, keeps; past it, its oldest
    /// turns are dropped (the system message it began with stays).
    #[arg(long, env = "SWARMGATE_SESSION_MAX_BYTES", default_value_t = 65536)]
    pub session_max_bytes: usize,
    /// Longest a turn that ended in tool calls keeps its KV blocks held on the device for the
    /// follow-up that brings the tools' results (the engine picks the time within it, from the
    /// pauses seen between the agent's turns and what recomputing would cost); 0: not held.
    #[arg(long, env = "SWARMGATE_TOOL_KV_TTL_MAX_SECS", default_value_t = 30.0)]
    pub tool_kv_ttl_max_secs: f64,
    /// Longest `cache_ttl_secs` an agent hint may ask for (an API key's `max_cache_ttl_secs`
    /// may lower it).
    #[arg(long, env = "SWARMGATE_CACHE_TTL_MAX_SECS", default_value_t = 300.0)]
    pub cache_ttl_max_secs: f64,
    /// Requests per minute per key (all traffic together when there are no keys); 0: no limit.
    #[arg(long, env = "SWARMGATE_RPM", default_value_t = 0)]
    pub rpm: u64,
    /// Tokens per minute per key (prompt plus max_tokens, counted at admission; what is not
    /// generated is given back); 0: no limit.
    #[arg(long, env = "SWARMGATE_TPM", default_value_t = 0)]
    pub tpm: u64,
    /// Sequences admitted at once (generating or streaming; a request with `n` choices or a
    /// consensus of `n` samples counts `n`); the rest wait in line. At most the engine's
    /// `max_queued`, so that what the gateway admits the engine takes.
    #[arg(long, env = "SWARMGATE_MAX_CONCURRENT_REQUESTS", default_value_t = 256)]
    pub max_concurrent_requests: usize,
    /// Requests that may wait for admission; beyond them requests get 503 at once.
    #[arg(long, env = "SWARMGATE_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Seconds from arrival to the first generated token (waiting for admission included);
    /// later, the request ends with 504.
    #[arg(
        long,
        env = "SWARMGATE_FIRST_TOKEN_TIMEOUT_SECS",
        default_value_t = 60.0
    )]
    pub first_token_timeout_secs: f64,
    /// Seconds from arrival to the end of the answer; later, the request ends with 504 (or,
    /// once streaming, with an error chunk).
    #[arg(long, env = "SWARMGATE_REQUEST_TIMEOUT_SECS", default_value_t = 600.0)]
    pub request_timeout_secs: f64,
    /// The swarm file: its agents and how requests are routed among them (`POST
    /// /v1/swarm/route`) [default: swarm.toml, if present]. Without one the server has no swarm.
    #[arg(long, env = "SWARMGATE_SWARM")]
    pub swarm: Option<PathBuf>,
    /// PostgreSQL keeping the swarm's agents (`postgres://user@host:port/db`), shared by every
    /// replica pointed at it: edits survive restarts and reach the other replicas within a
    /// second. The swarm file seeds it while its table is empty. Without one the agents live in
    /// this process, as the swarm file has them.
    #[arg(long, env = "SWARMGATE_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Most agents a swarm may hold; `POST /v1/agents` beyond them is a 400.
    #[arg(long, env = "SWARMGATE_MAX_AGENTS", default_value_t = AgentLimits::DEFAULT.max_agents)]
    pub max_agents: usize,
    /// Largest system prompt an agent added at run time may have, in bytes.
    #[arg(
        long,
        env = "SWARMGATE_MAX_AGENT_PROMPT_BYTES",
        default_value_t = AgentLimits::DEFAULT.max_prompt_bytes
    )]
    pub max_agent_prompt_bytes: usize,
    /// Largest description, and largest routing example, an agent added at run time may have,
    /// in bytes.
    #[arg(
        long,
        env = "SWARMGATE_MAX_AGENT_DESCRIPTION_BYTES",
        default_value_t = AgentLimits::DEFAULT.max_description_bytes
    )]
    pub max_agent_description_bytes: usize,
    /// Most routing examples an agent added at run time may have.
    #[arg(
        long,
        env = "SWARMGATE_MAX_AGENT_ROUTING_EXAMPLES",
        default_value_t = AgentLimits::DEFAULT.max_routing_examples
    )]
    pub max_agent_routing_examples: usize,
    /// Most `tools` one request may define.
    #[arg(long, env = "SWARMGATE_MAX_TOOLS", default_value_t = 128)]
    pub max_tools: usize,
    /// Largest JSON schema (a tool's parameters, a response_format's schema), in bytes of
    /// compact JSON.
    #[arg(long, env = "SWARMGATE_MAX_SCHEMA_BYTES", default_value_t = 65536)]
    pub max_schema_bytes: usize,
    /// Deepest nesting of objects and arrays in a JSON schema.
    #[arg(long, env = "SWARMGATE_MAX_SCHEMA_DEPTH", default_value_t = 32)]
    pub max_schema_depth: usize,
    /// Milliseconds one request's grammars may take to compile; past them, a 400.
    #[arg(
        long,
        env = "SWARMGATE_GRAMMAR_COMPILE_TIMEOUT_MS",
        default_value_t = 2000
    )]
    pub grammar_compile_timeout_ms: u64,
    /// Most tokens one answer may ask for (`max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens`), on every route and for every key; more is a 400 naming the field.
    /// Unset: only the context bounds it.
    #[arg(long, env = "SWARMGATE_MAX_TOKENS_LIMIT")]
    pub max_tokens_limit: Option<usize>,
    /// Tokens a chat answer may take when the request names no `max_tokens` (within
    /// `--max-tokens-limit`). Unset: all the room the context leaves. Text completions default
    /// to 16, as OpenAI's do.
    #[arg(long, env = "SWARMGATE_DEFAULT_MAX_TOKENS")]
    pub default_max_tokens: Option<usize>,
    #[command(flatten)]
    pub engine: EngineConfig,
    #[command(flatten)]
    pub embedding: EmbedderConfig,
}

/// A year: sessions are conversations, not archives.
pub const MAX_SESSION_TTL_SECS: u64 = 365 * 24 * 3600;

/// 4 MiB: far above any prompt this engine's context can take, small enough that a client
/// cannot make the server buffer much.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// The longest a connection timeout may be set to: a day.
pub const MAX_CONNECTION_TIMEOUT_SECS: f64 = 86_400.0;

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            config: None,
            host: "127.0.0.1".into(),
            port: 8080,
            grpc_port: 50051,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_read_timeout_secs: 10.0,
            body_read_timeout_secs: 30.0,
            idle_timeout_secs: 60.0,
            grpc_max_concurrent_streams: 128,
            shutdown_grace_secs: 30,
            api_keys: Vec::new(),
            admin_keys: Vec::new(),
            metrics_public: false,
            redis: None,
            session_ttl_secs: 3600,
            session_max_bytes: 65536,
            tool_kv_ttl_max_secs: 30.0,
            cache_ttl_max_secs: 300.0,
            rpm: 0,
            tpm: 0,
            max_concurrent_requests: 256,
            max_queued_requests: 1024,
            first_token_timeout_secs: 60.0,
            request_timeout_secs: 600.0,
            swarm: None,
            database_url: None,
            max_agents: AgentLimits::DEFAULT.max_agents,
            max_agent_prompt_bytes: AgentLimits::DEFAULT.max_prompt_bytes,
            max_agent_description_bytes: AgentLimits::DEFAULT.max_description_bytes,
            max_agent_routing_examples: AgentLimits::DEFAULT.max_routing_examples,
            max_tools: 128,
            max_schema_bytes: 65536,
            max_schema_depth: 32,
            grammar_compile_timeout_ms: 2000,
            max_tokens_limit: None,
            default_max_tokens: None,
            engine: EngineConfig::default(),
            embedding: EmbedderConfig::default(),
        }
    }
}

/// The file's shape: these sections, nothing else.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    server: Map<String, Value>,
    #[serde(default)]
    engine: Map<String, Value>,
    #[serde(default)]
    embedding: Map<String, Value>,
}

/// The nested sections: their field in [`ServeConfig`] (and name in the file), and the prefix
/// of their flags' clap ids.
const SECTIONS: [(&str, &str); 2] = [("engine", ""), ("embedding", "embedding_")];

impl ServeConfig {
    /// The settings `matches` (the `serve` command line, environment included) and the
    /// configuration file give, validated.
    pub fn load(matches: &ArgMatches) -> Result<Self, String> {
        let parsed = Self::from_arg_matches(matches).map_err(|e| e.to_string())?;
        let file = match &parsed.config {
            Some(path) => Some(path.clone()),
            None => Some(PathBuf::from(DEFAULT_CONFIG_FILE)).filter(|p| p.is_file()),
        };
        let config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let mut config = parsed
                    .under_file(&text, matches)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                config.config = Some(path);
                config
            }
            None => parsed,
        };
        config.validate()?;
        Ok(config)
    }

    /// These settings, parsed from `matches`, with `file`'s values in place of those that came
    /// from neither a flag nor the environment.
    fn under_file(&self, file: &str, matches: &ArgMatches) -> Result<Self, String> {
        let file: FileConfig = toml::from_str(file).map_err(|e| e.to_string())?;
        let Value::Object(mut merged) = serde_json::to_value(self).map_err(|e| e.to_string())?
        else {
            unreachable!("a struct serializes to an object");
        };
        // Only known keys are looked up in `matches` (clap panics on others); unknown ones are
        // left for the typed pass below to reject by name.
        let given = |known: &Map<String, Value>, key: &str, id: &str| {
            known.contains_key(key)
                && matches!(
                    matches.value_source(id),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
        };
        for (key, value) in file.server {
            if SECTIONS.iter().any(|(name, _)| *name == key) {
                return Err(format!(
                    "[server]: unknown key `{key}` (those settings go in [{key}])"
                ));
            }
            if !given(&merged, &key, &key) {
                merged.insert(key, value);
            }
        }
        for ((name, prefix), entries) in SECTIONS.into_iter().zip([file.engine, file.embedding]) {
            let Some(Value::Object(section)) = merged.get_mut(name) else {
                unreachable!("a nested section serializes to an object");
            };
            for (key, value) in entries {
                if !given(section, &key, &format!("{prefix}{key}")) {
                    section.insert(key, value);
                }
            }
        }
        serde_path_to_error::deserialize(Value::Object(merged)).map_err(|e| {
            // The path is `port`, `engine.kv_cache_mb`, or `.`/`engine` for an unknown key,
            // which the message itself names.
            let path = e.path().to_string();
            let (section, key) = SECTIONS
                .iter()
                .find_map(|(name, _)| {
                    path.strip_prefix(name)
                        .map(|rest| (format!("[{name}]"), rest.trim_start_matches('.')))
                })
                .unwrap_or(("[server]".into(), path.trim_start_matches('.')));
            let at = if key.is_empty() {
                String::new()
            } else {
                format!(" {key}")
            };
            format!("{section}{at}: {}", e.into_inner())
        })
    }

    /// Rejects settings the server cannot run with; the engine checks its own at start.
    pub fn validate(&self) -> Result<(), String> {
        if self.host.is_empty() {
            return Err("--host must not be empty".into());
        }
        if self.grpc_port != 0 && self.grpc_port == self.port {
            return Err("--grpc-port must differ from --port (0 turns gRPC off)".into());
        }
        if self.max_body_bytes == 0 {
            return Err("--max-body-bytes must be positive".into());
        }
        if let Some(url) = &self.redis {
            redis::Client::open(url.as_str())
                .map_err(|e| format!("--redis must be a Redis URL (redis://host:port): {e}"))?;
        }
        if let Some(url) = &self.database_url {
            // The parser's message never repeats the URL, so a password in it stays unprinted.
            url.parse::<tokio_postgres::Config>().map_err(|e| {
                format!("--database-url must be a PostgreSQL URL (postgres://user@host/db): {e}")
            })?;
        }
        if self.max_agents == 0
            || self.max_agent_prompt_bytes == 0
            || self.max_agent_description_bytes == 0
            || self.max_agent_routing_examples == 0
        {
            return Err("--max-agents and the --max-agent-* bounds must be positive".into());
        }
        for (flag, secs) in [
            ("--tool-kv-ttl-max-secs", self.tool_kv_ttl_max_secs),
            ("--cache-ttl-max-secs", self.cache_ttl_max_secs),
        ] {
            if !(secs.is_finite() && (0.0..=engine::request::MAX_RETENTION_SECS).contains(&secs)) {
                return Err(format!(
                    "{flag} must be between 0 and {} seconds, not {secs}",
                    engine::request::MAX_RETENTION_SECS
                ));
            }
        }
        if self.session_ttl_secs > MAX_SESSION_TTL_SECS {
            return Err(format!(
                "--session-ttl-secs must be at most {MAX_SESSION_TTL_SECS} (a year), not {}",
                self.session_ttl_secs
            ));
        }
        if self.session_max_bytes == 0 {
            return Err("--session-max-bytes must be positive".into());
        }
        if self.max_concurrent_requests == 0 {
            return Err("--max-concurrent-requests must be at least 1".into());
        }
        if self.max_concurrent_requests > self.engine.max_queued {
            return Err(format!(
                "--max-concurrent-requests ({}) must not exceed the engine's --max-queued ({}): \
                 the engine would refuse sequences the gateway admitted",
                self.max_concurrent_requests, self.engine.max_queued
            ));
        }
        for (flag, secs) in [
            ("--header-read-timeout-secs", self.header_read_timeout_secs),
            ("--body-read-timeout-secs", self.body_read_timeout_secs),
            ("--idle-timeout-secs", self.idle_timeout_secs),
        ] {
            if !(secs.is_finite() && secs > 0.0 && secs <= MAX_CONNECTION_TIMEOUT_SECS) {
                return Err(format!(
                    "{flag} must be above 0 and at most {MAX_CONNECTION_TIMEOUT_SECS}, not {secs}"
                ));
            }
        }
        if self.grpc_max_concurrent_streams == 0 {
            return Err("--grpc-max-concurrent-streams must be at least 1".into());
        }
        if self.max_schema_bytes == 0 || self.max_schema_depth == 0 {
            return Err("--max-schema-bytes and --max-schema-depth must be positive".into());
        }
        if self.grammar_compile_timeout_ms == 0 {
            return Err("--grammar-compile-timeout-ms must be positive".into());
        }
        if self.max_tokens_limit == Some(0) || self.default_max_tokens == Some(0) {
            return Err("--max-tokens-limit and --default-max-tokens must be positive".into());
        }
        if let (Some(default), Some(limit)) = (self.default_max_tokens, self.max_tokens_limit) {
            if default > limit {
                return Err(format!(
                    "--default-max-tokens ({default}) must not exceed --max-tokens-limit ({limit})"
                ));
            }
        }
        for (flag, secs) in [
            ("--first-token-timeout-secs", self.first_token_timeout_secs),
            ("--request-timeout-secs", self.request_timeout_secs),
        ] {
            // Refuses NaN, infinities, negatives and values too large for a Duration alike.
            let usable = Duration::try_from_secs_f64(secs).is_ok_and(|d| !d.is_zero());
            if !usable {
                return Err(format!(
                    "{flag} must be a positive number of seconds, not {secs}"
                ));
            }
        }
        Ok(())
    }

    /// The swarm file to load: the one named, else `swarm.toml` when there is one.
    pub fn swarm_file(&self) -> Option<PathBuf> {
        self.swarm
            .clone()
            .or_else(|| Some(PathBuf::from(DEFAULT_SWARM_FILE)).filter(|p| p.is_file()))
    }

    /// The bounds on structured outputs and tools.
    pub fn structured_limits(&self) -> crate::validate::structured::StructuredLimits {
        crate::validate::structured::StructuredLimits {
            max_tokens: crate::validate::MaxTokens {
                limit: self.max_tokens_limit,
                chat_default: self.default_max_tokens,
            },
            max_tools: self.max_tools,
            max_schema_bytes: self.max_schema_bytes,
            max_schema_depth: self.max_schema_depth,
            compile_timeout: std::time::Duration::from_millis(self.grammar_compile_timeout_ms),
            hints: crate::validate::hints::HintLimits {
                min_priority: None,
                max_cache_ttl_secs: self.cache_ttl_max_secs,
                tool_kv_ttl_max_secs: self.tool_kv_ttl_max_secs,
            },
        }
    }

    /// The bounds on agents added at run time.
    pub fn agent_limits(&self) -> AgentLimits {
        AgentLimits {
            max_agents: self.max_agents,
            max_prompt_bytes: self.max_agent_prompt_bytes,
            max_description_bytes: self.max_agent_description_bytes,
            max_routing_examples: self.max_agent_routing_examples,
        }
    }

    /// The per-request timeouts; the config must be valid.
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            first_token: Duration::from_secs_f64(self.first_token_timeout_secs),
            total: Duration::from_secs_f64(self.request_timeout_secs),
        }
    }

    /// The per-connection timeouts; the config must be valid.
    pub fn connection_timeouts(&self) -> crate::connection::ConnectionTimeouts {
        crate::connection::ConnectionTimeouts {
            header_read: Duration::from_secs_f64(self.header_read_timeout_secs),
            idle: Duration::from_secs_f64(self.idle_timeout_secs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::KeyPolicy;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
    }

    /// Parses `args` and loads the file they name, as `swarmgate serve` does.
    fn load(args: &[&str]) -> Result<ServeConfig, String> {
        let matches = Cli::command()
            .try_get_matches_from(std::iter::once("swarmgate").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        ServeConfig::load(&matches)
    }

    /// A config file with `text`, removed when the guard drops.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(text: &str) -> Self {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!(
                "swarmgate-config-test-{}-{n}.toml",
                std::process::id()
            ));
            std::fs::write(&path, text).unwrap();
            Self(path)
        }

        fn arg(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn defaults_match_the_default_impl() {
        let cli = Cli::try_parse_from(["swarmgate"]).unwrap().serve;
        let default = ServeConfig::default();
        assert_eq!(cli.host, default.host);
        assert_eq!(cli.port, default.port);
        assert_eq!(cli.grpc_port, default.grpc_port);
        assert_eq!(cli.max_body_bytes, 4 * 1024 * 1024);
        assert_eq!(cli.engine.kv_cache_mb, default.engine.kv_cache_mb);
        assert_eq!(cli.max_concurrent_requests, default.max_concurrent_requests);
        assert_eq!(cli.request_timeout_secs, default.request_timeout_secs);
        assert!(!cli.metrics_public && cli.api_keys.is_empty());
        assert!(cli.validate().is_ok());
    }

    #[test]
    fn flags_reach_server_and_engine() {
        let cli = Cli::try_parse_from([
            "swarmgate",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--max-body-bytes",
            "1024",
            "--kv-cache-mb",
            "64",
            "--api-key",
            "sk-one",
            "--api-key",
            "sk-two",
            "--first-token-timeout-secs",
            "0.5",
            "--max-tokens-limit",
            "512",
            "--default-max-tokens",
            "256",
        ])
        .unwrap()
        .serve;
        assert_eq!(cli.host, "0.0.0.0");
        assert_eq!(cli.port, 9000);
        assert_eq!(cli.max_body_bytes, 1024);
        assert_eq!(cli.engine.kv_cache_mb, 64);
        assert_eq!(cli.api_keys.len(), 2);
        assert_eq!(cli.timeouts().first_token, Duration::from_millis(500));
        assert_eq!(
            cli.structured_limits().max_tokens,
            crate::validate::MaxTokens {
                limit: Some(512),
                chat_default: Some(256),
            }
        );
    }

    #[test]
    fn grpc_port_is_a_flag_and_must_not_be_the_http_port() {
        let cli = Cli::try_parse_from(["swarmgate", "--grpc-port", "0"])
            .unwrap()
            .serve;
        assert_eq!(cli.grpc_port, 0);
        assert!(cli.validate().is_ok());
        let clash = ServeConfig {
            grpc_port: 8080,
            ..ServeConfig::default()
        };
        assert!(clash.validate().is_err());
    }

    #[test]
    fn embedding_flags_have_names_of_their_own() {
        let default = Cli::try_parse_from(["swarmgate"]).unwrap().serve;
        assert_eq!(
            default.embedding.model,
            std::path::Path::new(engine::embed::DEFAULT_EMBEDDING_MODEL)
        );
        let cli = Cli::try_parse_from([
            "swarmgate",
            "--model",
            "a.gguf",
            "--threads",
            "3",
            "--embedding-model",
            "models/other",
            "--embedding-threads",
            "1",
        ])
        .unwrap()
        .serve;
        assert_eq!(cli.engine.model, std::path::Path::new("a.gguf"));
        assert_eq!(cli.engine.threads, Some(3));
        assert_eq!(cli.embedding.model, std::path::Path::new("models/other"));
        assert_eq!(cli.embedding.threads, Some(1));
    }

    #[test]
    fn rejects_settings_it_cannot_run_with() {
        let invalid = |config: ServeConfig| config.validate().unwrap_err();
        let default = ServeConfig::default;
        assert!(invalid(ServeConfig {
            max_body_bytes: 0,
            ..default()
        })
        .contains("--max-body-bytes"));
        assert!(invalid(ServeConfig {
            max_concurrent_requests: 0,
            ..default()
        })
        .contains("--max-concurrent-requests"));
        assert!(invalid(ServeConfig {
            max_tokens_limit: Some(0),
            ..default()
        })
        .contains("--max-tokens-limit"));
        assert!(invalid(ServeConfig {
            max_tokens_limit: Some(100),
            default_max_tokens: Some(101),
            ..default()
        })
        .contains("--default-max-tokens (101)"));
        for secs in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(invalid(ServeConfig {
                request_timeout_secs: secs,
                ..default()
            })
            .contains("--request-timeout-secs"));
        }
        assert!(invalid(ServeConfig {
            max_agents: 0,
            ..default()
        })
        .contains("--max-agents"));
        let e = invalid(ServeConfig {
            database_url: Some("postgres://swarm:s3cret@db:notaport/agents".into()),
            ..default()
        });
        assert!(e.contains("--database-url"), "{e}");
        assert!(!e.contains("s3cret"), "the password never shows: {e}");
        let url = "postgres://swarm:s3cret@127.0.0.1:5432/agents".to_owned();
        ServeConfig {
            database_url: Some(url),
            ..default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn a_key_in_the_file_may_carry_its_own_bounds() {
        let file = TempFile::new(
            r#"
            [server]
            api_keys = ["sk-plain", { key = "sk-batch", max_tokens = 256, rpm = 10, min_priority = 0, max_cache_ttl_secs = 60 }]
            admin_keys = [{ key = "sk-root", tpm = 0 }]
            "#,
        );
        let config = load(&["--config", file.arg()]).unwrap();
        let policies: Vec<_> = config.api_keys.iter().map(ApiKey::policy).collect();
        assert_eq!(policies[0], KeyPolicy::default());
        assert_eq!(
            policies[1],
            KeyPolicy {
                max_tokens: Some(256),
                rpm: Some(10),
                tpm: None,
                min_priority: Some(0),
                max_cache_ttl_secs: Some(60),
            }
        );
        assert_eq!(config.admin_keys[0].policy().tpm, Some(0));
        assert!(
            !format!("{config:?}").contains("sk-batch"),
            "keys never show, bounds do"
        );

        for (entry, says) in [
            (r#"{ key = "sk-x", max_tokenz = 5 }"#, "max_tokenz"),
            (r#"{ key = "sk-x", max_tokens = 0 }"#, "positive"),
            (r#"{ max_tokens = 5 }"#, "key"),
            (r#"{ key = "sk x" }"#, "without spaces"),
            (r#"{ key = "sk-x", rpm = -1 }"#, "rpm"),
            (
                r#"{ key = "sk-x", min_priority = 2000000 }"#,
                "min_priority",
            ),
        ] {
            let file = TempFile::new(&format!("[server]\napi_keys = [{entry}]"));
            let error = load(&["--config", file.arg()]).unwrap_err();
            assert!(
                error.contains("api_keys") && error.contains(says),
                "{entry}: {error}"
            );
        }
    }

    #[test]
    fn file_values_fill_what_flags_and_environment_left_unset() {
        let file = TempFile::new(
            r#"
            [server]
            port = 9100
            rpm = 30
            api_keys = ["sk-file"]
            first_token_timeout_secs = 5
            [engine]
            kv_cache_mb = 96
            prefix_cache = false
            "#,
        );
        let config = load(&["--config", file.arg()]).unwrap();
        assert_eq!(config.port, 9100);
        assert_eq!(config.rpm, 30);
        assert_eq!(config.api_keys, vec!["sk-file".parse().unwrap()]);
        assert_eq!(config.first_token_timeout_secs, 5.0);
        assert_eq!(config.engine.kv_cache_mb, 96);
        assert!(!config.engine.prefix_cache);
        assert_eq!(
            config.host, "127.0.0.1",
            "keys the file lacks keep their defaults"
        );
        assert_eq!(config.engine.block_size, EngineConfig::default().block_size);
        assert_eq!(config.config.as_ref(), Some(&file.0));
    }

    #[test]
    fn a_flag_beats_the_environment_which_beats_the_file() {
        let file = TempFile::new("[server]\nmax_queued_requests = 7\nshutdown_grace_secs = 7\n");
        // Tests share the process environment: no other test reads these two settings.
        std::env::set_var("SWARMGATE_MAX_QUEUED_REQUESTS", "8");
        std::env::set_var("SWARMGATE_SHUTDOWN_GRACE_SECS", "8");
        let flagged = load(&["--config", file.arg(), "--max-queued-requests", "9"]);
        let other_flagged = load(&["--config", file.arg(), "--shutdown-grace-secs", "9"]);
        std::env::remove_var("SWARMGATE_MAX_QUEUED_REQUESTS");
        std::env::remove_var("SWARMGATE_SHUTDOWN_GRACE_SECS");
        let config = flagged.unwrap();
        assert_eq!(
            config.max_queued_requests, 9,
            "flag over environment and file"
        );
        assert_eq!(config.shutdown_grace_secs, 8, "environment over file");
        let config = other_flagged.unwrap();
        assert_eq!(
            (config.max_queued_requests, config.shutdown_grace_secs),
            (8, 9)
        );
        let config = load(&["--config", file.arg()]).unwrap();
        assert_eq!(
            (config.max_queued_requests, config.shutdown_grace_secs),
            (7, 7)
        );
    }

    #[test]
    fn an_explicit_default_on_the_command_line_still_beats_the_file() {
        let file = TempFile::new("[server]\nport = 9100\n");
        let config = load(&["--config", file.arg(), "--port", "8080"]).unwrap();
        assert_eq!(config.port, 8080);
    }

    #[test]
    fn unknown_keys_and_sections_are_named() {
        let error = |text: &str| {
            let file = TempFile::new(text);
            load(&["--config", file.arg()]).unwrap_err()
        };
        let e = error("[server]\nprot = 80\n");
        assert!(e.contains("[server]") && e.contains("`prot`"), "{e}");
        let e = error("[engine]\nkv_cache = 80\n");
        assert!(e.contains("[engine]") && e.contains("`kv_cache`"), "{e}");
        let e = error("[sever]\nport = 80\n");
        assert!(e.contains("`sever`"), "{e}");
        let e = error("[server]\nport = \"eighty\"\n");
        assert!(e.contains(": [server] port: invalid type"), "{e}");
        let e = error("[engine]\nkv_cache_mb = -1\n");
        assert!(e.contains(": [engine] kv_cache_mb: invalid value"), "{e}");
        let e = error("[server]\nmax_concurrent_requests = 0\n");
        assert!(
            e.contains("--max-concurrent-requests"),
            "validated after merging: {e}"
        );
        let e = error("[server]\nengine = 1\n");
        assert!(e.contains("`engine`"), "{e}");
    }

    #[test]
    fn a_missing_named_file_is_an_error() {
        let e = load(&["--config", "/nonexistent/swarmgate.toml"]).unwrap_err();
        assert!(e.contains("/nonexistent/swarmgate.toml"), "{e}");
    }

    /// The example documents every key, set to its default or (for settings without one)
    /// commented out.
    #[test]
    fn the_example_file_documents_every_key_at_its_default() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../swarmgate.example.toml");
        let mut config = load(&["--config", example]).unwrap();
        config.config = None;
        let loaded = serde_json::to_value(&config).unwrap();
        let default = serde_json::to_value(ServeConfig::default()).unwrap();
        assert_eq!(loaded, default, "the example's values are the defaults");
        let text = std::fs::read_to_string(example).unwrap();
        let (server, sections) = text.split_once("[engine]").expect("an [engine] section");
        let (engine, embedding) = sections
            .split_once("[embedding]")
            .expect("an [embedding] section after [engine]");
        let documented = |section: &str, key: &str| {
            section.lines().any(|line| {
                let line = line.trim_start_matches(['#', ' ']);
                line.strip_prefix(key)
                    .is_some_and(|rest| rest.trim_start().starts_with('='))
            })
        };
        for key in default
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| !SECTIONS.iter().any(|(name, _)| name == k))
        {
            assert!(
                documented(server, key),
                "[server] {key} is not in the example"
            );
        }
        for (name, text) in [("engine", engine), ("embedding", embedding)] {
            for key in default[name].as_object().unwrap().keys() {
                assert!(
                    documented(text, key),
                    "[{name}] {key} is not in the example"
                );
            }
        }
    }
}

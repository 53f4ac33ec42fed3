//! The server's settings: where to listen, how much a client may send, and the engine's own
//! settings flattened in, so one struct is the whole command line.
//!
//! Every flag also reads a `SWARMGATE_*` environment variable; clap resolves CLI > env >
//! default once, at start-up. Nothing in the gateway reads the environment after that.

use engine::EngineConfig;

/// Settings for `swarmgate serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeConfig {
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
    /// On SIGTERM, how long requests in flight may take to finish before they are cut off.
    #[arg(long, env = "SWARMGATE_SHUTDOWN_GRACE_SECS", default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    #[command(flatten)]
    pub engine: EngineConfig,
}

/// 4 MiB: far above any prompt this engine's context can take, small enough that a client
/// cannot make the server buffer much.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            grpc_port: 50051,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            shutdown_grace_secs: 30,
            engine: EngineConfig::default(),
        }
    }
}

impl ServeConfig {
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
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
        ])
        .unwrap()
        .serve;
        assert_eq!(cli.host, "0.0.0.0");
        assert_eq!(cli.port, 9000);
        assert_eq!(cli.max_body_bytes, 1024);
        assert_eq!(cli.engine.kv_cache_mb, 64);
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
    fn rejects_a_zero_body_limit() {
        let config = ServeConfig {
            max_body_bytes: 0,
            ..ServeConfig::default()
        };
        assert!(config.validate().is_err());
    }
}

//! Swarmgate's NATS protocol: what gateways and workers say to each other, and how they meet.
//! Both sides use this crate and nothing of each other; it uses the engine's request and event
//! types only.
//!
//! - [`connect`]: how both sides join NATS (server, cluster, credentials, TLS).
//! - [`workers`]: the workers' registry, a JetStream key-value bucket of heartbeats, and the
//!   gateway's live view of it.
//! - This module: the wire format, version [`VERSION`].
//!
//! Subjects ([`Subjects`]), under the cluster's name (`swarm` unless `--cluster` says otherwise,
//! so that several swarms can share one NATS):
//! - `swarm.v2.agent.<agent>`: requests for one agent, to the queue group [`QUEUE_GROUP`], so
//!   each goes to one of the workers hosting the agent and a new worker adds capacity by
//!   subscribing. `swarm.v2.any` is the same for requests that name no agent.
//! - `swarm.v2.worker.<id>`: requests for one worker, when the gateway chose it (least loaded,
//!   prompt warm) from the registry.
//! - `swarm.v2.cancel.<id>`: [`Cancel`]s for that worker's requests.
//! - `swarm.v2.stream.<gateway>.<request>`: the [`Batch`]es of one request's events, back to the
//!   gateway that asked.
//!
//! The registry is the key-value bucket `swarm_workers` (see [`workers`]).
//!
//! A request is a NATS request: the worker answers it at once with a [`Reply`] (accepted, or
//! refused with a [`RefusalCode`]), then publishes the request's events on the stream subject
//! the [`Submit`] names: the first token at once, then deltas coalesced into batches of up to
//! [`FLUSH_TOKENS`] tokens or [`FLUSH_INTERVAL`], an empty batch after [`KEEPALIVE`] of
//! silence, and the final event. At most once per [`READER_PROBE`] a batch carries a reply
//! subject that nobody answers: if no one reads the stream subject any more (the gateway died,
//! or its cancel was lost), NATS answers "no responders" there and the worker stops the request.
//!
//! Every message is JSON with a `v` field. [`decode`] checks the version before anything else
//! and then the whole shape; subjects and names a message carries are checked too, so a worker
//! never publishes where a malformed message tells it to.

pub mod connect;
pub mod workers;

use std::time::Duration;

use engine::{Event, GenerateRequest};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The protocol version every message carries.
pub const VERSION: u32 = 2;

/// The queue group of every worker's request subscriptions.
pub const QUEUE_GROUP: &str = "swarm-workers";

/// A batch is sent once it holds this many tokens...
pub const FLUSH_TOKENS: usize = 16;

/// ...or its first event is this old.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(15);

/// A worker sends an empty batch after this long without sending anything for a request, so
/// the gateway can tell a long prefill from a dead worker.
pub const KEEPALIVE: Duration = Duration::from_millis(500);

/// How often a worker checks that somebody still reads a request's stream.
pub const READER_PROBE: Duration = Duration::from_secs(1);

/// The subjects and the registry bucket of one cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subjects {
    root: String,
}

impl Subjects {
    /// The cluster `name`'s; `None` unless `name` is a valid subject token.
    pub fn new(name: &str) -> Option<Self> {
        is_token(name).then(|| Self {
            root: format!("{name}.v{VERSION}"),
        })
    }

    pub fn agent(&self, agent: &str) -> String {
        format!("{}.agent.{agent}", self.root)
    }

    /// Every agent's subject, for a worker that hosts them all.
    pub fn all_agents(&self) -> String {
        format!("{}.agent.*", self.root)
    }

    /// Requests that name no agent.
    pub fn any(&self) -> String {
        format!("{}.any", self.root)
    }

    pub fn worker(&self, worker: &str) -> String {
        format!("{}.worker.{worker}", self.root)
    }

    pub fn cancel(&self, worker: &str) -> String {
        format!("{}.cancel.{worker}", self.root)
    }

    pub fn stream(&self, gateway: &str, request: &str) -> String {
        format!("{}.stream.{gateway}.{request}", self.root)
    }

    /// Whether `subject` is a stream subject of this cluster (`<root>.stream.<gateway>.<id>`):
    /// the only subjects a worker publishes a request's events on.
    pub fn is_stream(&self, subject: &str) -> bool {
        subject
            .strip_prefix(&self.root)
            .and_then(|rest| rest.strip_prefix(".stream."))
            .is_some_and(|rest| rest.split('.').count() == 2 && rest.split('.').all(is_token))
    }

    /// The registry bucket's name.
    pub fn bucket(&self) -> String {
        let name = self.root.split('.').next().unwrap_or_default();
        format!("{name}_workers")
    }
}

/// Whether `name` can be one token of a subject (an agent, worker or request id): letters,
/// digits, `-` and `_`.
pub fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A generation request for a worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    pub v: u32,
    /// The gateway's id for the request: cancels and batches name it.
    pub id: String,
    /// The agent it runs for, if any (for the worker's metrics and warm prefixes).
    pub agent: Option<String>,
    /// Where the worker publishes the request's [`Batch`]es.
    pub stream: String,
    /// Milliseconds the request may still run, counted from its arrival at the worker.
    pub deadline_ms: Option<u64>,
    pub request: GenerateRequest,
}

/// A worker's answer to a [`Submit`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The worker runs the request; its events follow on the stream subject.
    Accepted { v: u32, worker: String },
    Refused {
        v: u32,
        code: RefusalCode,
        message: String,
    },
}

/// Why a worker refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    /// Not a message of this protocol (not JSON, wrong shape, bad subject or name).
    InvalidMessage,
    /// A version this worker does not speak.
    UnsupportedVersion,
    /// A well-formed request the engine can never serve (prompt too long, bad parameter).
    InvalidRequest,
    /// The engine's queue is full: another worker may take it.
    Overloaded,
    /// The worker is shutting down: another worker may take it.
    Draining,
    /// The engine has stopped.
    Unavailable,
}

impl RefusalCode {
    /// Whether another worker may still take the request.
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::Overloaded | Self::Draining | Self::Unavailable)
    }
}

/// Events of one request, in order; empty as a keepalive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    pub v: u32,
    pub id: String,
    /// 0, 1, 2...: a gap means lost messages.
    pub seq: u64,
    pub events: Vec<Event>,
}

/// Stop a request: the client went away.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cancel {
    pub v: u32,
    pub id: String,
}

/// What a worker publishes in the registry, every heartbeat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    pub v: u32,
    pub worker: String,
    /// The models its engine serves, its default first.
    pub models: Vec<String>,
    /// The agents it hosts; empty: every agent.
    pub agents: Vec<String>,
    /// Sequences decoding, and waiting for a slot.
    pub running: usize,
    pub waiting: usize,
    /// Requests it accepted and has not finished (queued in the engine included).
    pub in_flight: usize,
    pub free_kv_blocks: usize,
    /// Agents whose system prompt is pinned warm in its KV cache.
    pub warm: Vec<String>,
}

impl Heartbeat {
    /// Whether the worker's engine serves the model `id`.
    pub fn serves(&self, id: &str) -> bool {
        self.models.iter().any(|m| m == id)
    }

    /// Whether the worker hosts `agent` (`None`: a request for no agent, which any worker runs).
    pub fn hosts(&self, agent: Option<&str>) -> bool {
        match agent {
            None => true,
            Some(agent) => self.agents.is_empty() || self.agents.iter().any(|a| a == agent),
        }
    }
}

/// Why a message was rejected.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProtocolError {
    #[error("unsupported protocol version {0} (this side speaks {VERSION})")]
    UnsupportedVersion(u64),
    #[error("malformed message: {0}")]
    Malformed(String),
}

impl ProtocolError {
    pub fn code(&self) -> RefusalCode {
        match self {
            Self::UnsupportedVersion(_) => RefusalCode::UnsupportedVersion,
            Self::Malformed(_) => RefusalCode::InvalidMessage,
        }
    }
}

/// Messages whose names and subjects must be checked beyond their shape.
pub trait Message: DeserializeOwned + Serialize {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

impl Message for Submit {
    fn check(&self) -> Result<(), String> {
        if !is_token(&self.id) {
            return Err("`id` must be 1 to 128 letters, digits, `-` or `_`".into());
        }
        match &self.agent {
            Some(agent) if !is_token(agent) => {
                Err(format!("`agent` {agent:?} is not a valid agent name"))
            }
            _ => Ok(()),
        }
    }
}

impl Message for Reply {
    fn check(&self) -> Result<(), String> {
        match self {
            Self::Accepted { worker, .. } if !is_token(worker) => {
                Err("`worker` is not a valid worker id".into())
            }
            _ => Ok(()),
        }
    }
}

impl Message for Batch {}

impl Message for Cancel {
    fn check(&self) -> Result<(), String> {
        is_token(&self.id)
            .then_some(())
            .ok_or_else(|| "`id` is not a valid request id".into())
    }
}

impl Message for Heartbeat {
    fn check(&self) -> Result<(), String> {
        if !is_token(&self.worker) {
            return Err("`worker` is not a valid worker id".into());
        }
        match self.agents.iter().chain(&self.warm).find(|a| !is_token(a)) {
            Some(bad) => Err(format!("{bad:?} is not a valid agent name")),
            None => Ok(()),
        }
    }
}

/// Reads a message: its version first (a message of another version is rejected as such, even
/// when its shape changed), then its shape and names.
pub fn decode<M: Message>(bytes: &[u8]) -> Result<M, ProtocolError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    match value.get("v").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(VERSION) => {}
        Some(v) => return Err(ProtocolError::UnsupportedVersion(v)),
        None => {
            return Err(ProtocolError::Malformed(
                "missing the version field `v`".into(),
            ))
        }
    }
    let message: M =
        serde_json::from_value(value).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    message.check().map_err(ProtocolError::Malformed)?;
    Ok(message)
}

/// The JSON of `message`.
pub fn encode<M: Message>(message: &M) -> bytes::Bytes {
    serde_json::to_vec(message)
        .expect("protocol messages always serialize")
        .into()
}

#[cfg(test)]
mod tests {
    use engine::{FinishReason, Prompt, Usage};
    use serde_json::json;

    use super::*;

    fn subjects() -> Subjects {
        Subjects::new("swarm").unwrap()
    }

    fn submit() -> Submit {
        Submit {
            v: VERSION,
            id: "r1".into(),
            agent: Some("coder".into()),
            stream: subjects().stream("g1", "r1"),
            deadline_ms: Some(1000),
            request: GenerateRequest::new(Prompt::Tokens(vec![1, 2, 3])),
        }
    }

    #[test]
    fn messages_round_trip() {
        let sent = submit();
        let read: Submit = decode(&encode(&sent)).unwrap();
        assert_eq!(read.id, sent.id);
        assert_eq!(read.stream, sent.stream);
        assert!(matches!(read.request.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
        let batch = Batch {
            v: VERSION,
            id: "r1".into(),
            seq: 3,
            events: vec![
                Event::Delta {
                    text: "hi".into(),
                    tokens: vec![7],
                    logprobs: vec![],
                },
                Event::Finished {
                    reason: FinishReason::Stop,
                    usage: Usage {
                        prompt_tokens: 3,
                        completion_tokens: 1,
                        cached_tokens: 0,
                    },
                    error: None,
                },
            ],
        };
        assert_eq!(decode::<Batch>(&encode(&batch)).unwrap(), batch);
    }

    #[test]
    fn another_version_is_named_as_such_whatever_its_shape() {
        let bytes = serde_json::to_vec(&json!({"v": 3, "something": "else"})).unwrap();
        assert_eq!(
            decode::<Submit>(&bytes).unwrap_err(),
            ProtocolError::UnsupportedVersion(3)
        );
        assert_eq!(
            decode::<Submit>(&bytes).unwrap_err().code(),
            RefusalCode::UnsupportedVersion
        );
    }

    #[test]
    fn malformed_messages_are_rejected() {
        let bad = |bytes: &[u8]| decode::<Submit>(bytes).unwrap_err().code();
        assert_eq!(bad(b"not json"), RefusalCode::InvalidMessage);
        assert_eq!(bad(b"{\"id\": \"r1\"}"), RefusalCode::InvalidMessage);
        let mut value = serde_json::to_value(submit()).unwrap();
        value["request"]["max_tokens"] = json!("many");
        assert_eq!(
            bad(&serde_json::to_vec(&value).unwrap()),
            RefusalCode::InvalidMessage
        );
        let mut value = serde_json::to_value(submit()).unwrap();
        value["surprise"] = json!(1);
        assert_eq!(
            bad(&serde_json::to_vec(&value).unwrap()),
            RefusalCode::InvalidMessage
        );
    }

    #[test]
    fn the_subjects_follow_the_cluster_name() {
        let subjects = subjects();
        assert_eq!(subjects.agent("coder"), "swarm.v2.agent.coder");
        assert_eq!(subjects.all_agents(), "swarm.v2.agent.*");
        assert_eq!(subjects.any(), "swarm.v2.any");
        assert_eq!(subjects.worker("w1"), "swarm.v2.worker.w1");
        assert_eq!(subjects.cancel("w1"), "swarm.v2.cancel.w1");
        assert_eq!(subjects.bucket(), "swarm_workers");
        let other = Subjects::new("blue").unwrap();
        assert_eq!(other.agent("coder"), "blue.v2.agent.coder");
        assert_eq!(other.bucket(), "blue_workers");
        assert!(Subjects::new("a.b").is_none() && Subjects::new("*").is_none());
    }

    #[test]
    fn a_worker_publishes_only_on_its_clusters_stream_subjects() {
        let subjects = subjects();
        assert!(subjects.is_stream(&subjects.stream("g1", "r1")));
        for subject in [
            "swarm.v2.agent.coder",
            "swarm.v2.stream.g1.*",
            "swarm.v2.stream.>",
            "swarm.v2.stream.g1",
            "swarm.v2.stream.g1.r1.more",
            "blue.v2.stream.g1.r1",
        ] {
            assert!(!subjects.is_stream(subject), "{subject}");
        }
        let mut message = submit();
        message.agent = Some("a.b".into());
        assert!(decode::<Submit>(&encode(&message)).is_err());
        // The gateway sends cancels to the subject an acceptance names.
        let forged = Reply::Accepted {
            v: VERSION,
            worker: "w1.>".into(),
        };
        assert!(decode::<Reply>(&encode(&forged)).is_err());
    }

    #[test]
    fn a_worker_hosting_no_listed_agent_hosts_them_all() {
        let mut beat = Heartbeat {
            v: VERSION,
            worker: "w1".into(),
            models: vec!["m".into()],
            agents: vec![],
            running: 0,
            waiting: 0,
            in_flight: 0,
            free_kv_blocks: 0,
            warm: vec![],
        };
        assert!(beat.hosts(Some("coder")) && beat.hosts(None));
        beat.agents = vec!["math".into()];
        assert!(!beat.hosts(Some("coder")) && beat.hosts(Some("math")) && beat.hosts(None));
    }
}

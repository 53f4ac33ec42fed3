//! Conversation sessions end to end on the real model: real servers on `127.0.0.1:0` answering
//! conversations sent one turn at a time, with the history in memory, in a Redis shared by two
//! replicas, and with a Redis that does not answer; and the two stores' histories side by side.
//!
//! The conversation states a fact in its first turn ("My dog is called Rex."), asks something
//! else, then asks for the fact: with greedy decoding the model answers with the name only when
//! the first turn is in its prompt (a fresh conversation asking the same does not).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use engine::EngineConfig;
use gateway::config::ServeConfig;
use gateway::state::{HistoryLimit, MemoryStore, RedisStore, StateStore};
use gateway::AppState;
use serde_json::{json, Value};

use testkit::{engine, generating, MODEL_ID};

/// The Redis `make test` starts (scripts/services.sh).
const REDIS: &str = "redis://127.0.0.1:6379";
const KEY: &str = "sk-session-alpha";
const OTHER_KEY: &str = "sk-session-beta";

const FACT: &str = "My dog is called Rex.";
const ASIDE: &str = "What is the capital of France?";
const QUESTION: &str = "What is my dog called?";
/// What the answer to [`QUESTION`] names when the model saw [`FACT`].
const RECALLED: &str = "Rex";

/// A real server on an ephemeral port with `config`, stopped when the test's runtime ends.
async fn server(config: ServeConfig) -> SocketAddr {
    config.validate().expect("a valid test config");
    testkit::serve(AppState::configured(engine().clone(), &config)).await
}

/// A session id no earlier run left a history under.
fn fresh_session() -> String {
    format!("conversation-{}", uuid::Uuid::new_v4())
}

/// How a turn names its session and its caller.
#[derive(Clone, Copy, Default)]
struct Caller<'a> {
    header: Option<&'a str>,
    user: Option<&'a str>,
    key: Option<&'a str>,
}

impl<'a> Caller<'a> {
    fn session(id: &'a str) -> Self {
        Self {
            header: Some(id),
            ..Self::default()
        }
    }
}

/// One answered turn.
#[derive(Debug)]
struct Turn {
    text: String,
    usage: Value,
    /// The `x-session-id` the response carried.
    echoed: Option<String>,
}

impl Turn {
    fn tokens(&self, field: &str) -> u64 {
        self.usage[field]
            .as_u64()
            .unwrap_or_else(|| panic!("usage.{field}: {}", self.usage))
    }

    fn cached(&self) -> u64 {
        self.usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    }
}

/// Sends the user's `text` alone as `caller`, streamed or not; the answer must be a 200.
async fn say(addr: SocketAddr, caller: Caller<'_>, text: &str, stream: bool) -> Turn {
    let mut body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 48,
    });
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    if let Some(user) = caller.user {
        body["user"] = json!(user);
    }
    let (status, echoed, answer) = send(addr, caller, &body).await;
    assert_eq!(status, 200, "{text}: {answer}");
    if !stream {
        let answer: Value = serde_json::from_str(&answer).unwrap();
        return Turn {
            text: answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned(),
            usage: answer["usage"].clone(),
            echoed,
        };
    }
    let data: Vec<&str> = answer
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{answer}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c.get("error").is_none()), "{answer}");
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    Turn {
        text,
        usage: chunks.last().unwrap()["usage"].clone(),
        echoed,
    }
}

/// Posts `body` to the chat endpoint as `caller`: the status, the echoed session and the body.
async fn send(addr: SocketAddr, caller: Caller<'_>, body: &Value) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(body);
    if let Some(id) = caller.header {
        request = request.header("x-session-id", id);
    }
    if let Some(key) = caller.key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let echoed = response
        .headers()
        .get("x-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, echoed, response.text().await.unwrap())
}

/// The device tier's prefix-cache hits so far, in tokens.
async fn prefix_hits(addr: SocketAddr) -> f64 {
    let text = reqwest::Client::new()
        .get(format!("http://{addr}/metrics"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let samples: HashMap<&str, f64> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' '))
        .map(|(series, value)| (series, value.parse().unwrap()))
        .collect();
    samples[r#"swarmgate_prefix_cache_hits_tokens_total{tier="device"}"#]
}

/// Asserts `turn`'s prompt holds the whole of `previous` (its prompt and its answer) and that
/// the prefix cache served every full block of `previous`'s prompt.
fn assert_continues(previous: &Turn, turn: &Turn) {
    let before = previous.tokens("prompt_tokens") + previous.tokens("completion_tokens");
    assert!(
        turn.tokens("prompt_tokens") > before,
        "the history is in the prompt: {} then {}",
        previous.usage,
        turn.usage
    );
    let block = EngineConfig::default().block_size as u64;
    let full_blocks = previous.tokens("prompt_tokens") / block * block;
    assert!(
        turn.cached() >= full_blocks,
        "the previous prompt's KV is reused: {} then {}",
        previous.usage,
        turn.usage
    );
}

/// The conversation: [`FACT`], [`ASIDE`] (streamed), [`QUESTION`], each turn sent alone to its
/// server as its caller. Asserts each turn continues the one before and the last recalls the
/// first, which the same question without the conversation does not; returns the turns.
async fn converse(turns: [(SocketAddr, Caller<'_>); 3]) -> [Turn; 3] {
    let [(a, as_a), (b, as_b), (c, as_c)] = turns;
    let first = say(a, as_a, FACT, false).await;
    let second = say(b, as_b, ASIDE, true).await;
    assert_continues(&first, &second);
    let hits = prefix_hits(c).await;
    let third = say(c, as_c, QUESTION, false).await;
    assert_continues(&second, &third);
    assert!(
        third.text.contains(RECALLED),
        "turn 3 recalls turn 1: {third:?}"
    );
    let stranger = Caller {
        key: as_c.key,
        ..Caller::default()
    };
    let alone = say(c, stranger, QUESTION, false).await;
    assert!(
        !alone.text.contains(RECALLED),
        "no history, no name: {alone:?}"
    );
    assert!(
        prefix_hits(c).await - hits >= third.cached() as f64,
        "the metrics count the reused history"
    );
    for (n, turn) in [&first, &second, &third].into_iter().enumerate() {
        println!("turn {}: {}", n + 1, turn.usage);
    }
    [first, second, third]
}

#[tokio::test]
async fn a_conversation_sent_one_turn_at_a_time_keeps_its_history_and_its_kv() {
    let _engine = generating().await;
    let addr = server(ServeConfig::default()).await;
    let id = fresh_session();
    let session = Caller::session(&id);
    let turns = converse([(addr, session); 3]).await;
    for turn in &turns {
        assert_eq!(turn.echoed.as_deref(), Some(id.as_str()));
    }

    // The same question out of the session: no history (no name, as `converse` checks).
    let alone = say(addr, Caller::default(), QUESTION, false).await;
    assert_eq!(alone.echoed, None);
    assert!(alone.tokens("prompt_tokens") < turns[0].tokens("prompt_tokens") + 5);
}

#[tokio::test]
async fn replicas_sharing_redis_continue_each_other_s_conversations() {
    let replica = || {
        server(ServeConfig {
            api_keys: vec![KEY.parse().unwrap(), OTHER_KEY.parse().unwrap()],
            redis: Some(REDIS.into()),
            ..ServeConfig::default()
        })
    };
    let (a, b) = (replica().await, replica().await);
    let _engine = generating().await;
    let id = fresh_session();
    let by_header = Caller {
        key: Some(KEY),
        ..Caller::session(&id)
    };
    let turns = converse([(a, by_header), (b, by_header), (a, by_header)]).await;
    assert_eq!(turns[1].echoed.as_deref(), Some(id.as_str()));

    // OpenAI's `user` names an end user, not a conversation: it opens no session.
    let by_user = Caller {
        user: Some(&id),
        key: Some(KEY),
        header: None,
    };
    let alone = say(b, by_user, QUESTION, false).await;
    assert_eq!(alone.echoed, None);
    assert!(
        alone.tokens("prompt_tokens") < turns[0].tokens("prompt_tokens") + 5,
        "`user` does not read the session: {alone:?}"
    );

    // Another key naming the same session starts its own.
    let other = Caller {
        key: Some(OTHER_KEY),
        ..Caller::session(&id)
    };
    let stranger = say(b, other, QUESTION, false).await;
    assert!(
        stranger.tokens("prompt_tokens") < turns[0].tokens("prompt_tokens") + 5,
        "another key does not read the session: {stranger:?}"
    );
    assert!(!stranger.text.contains(RECALLED), "{stranger:?}");
}

#[tokio::test]
async fn an_unreachable_redis_refuses_session_requests_only() {
    // Nothing listens on port 1; no limits, so only sessions need the store.
    let addr = server(ServeConfig {
        redis: Some("redis://127.0.0.1:1".into()),
        ..ServeConfig::default()
    })
    .await;
    let _engine = generating().await;
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": FACT}],
        "max_tokens": 4,
    });
    for stream in [false, true] {
        let mut body = body.clone();
        body["stream"] = json!(stream);
        let (status, _, answer) = send(addr, Caller::session("unstored"), &body).await;
        assert_eq!(status, 503, "stream={stream}: {answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(answer["error"]["code"], "state_store_unavailable");
        assert_eq!(answer["error"]["type"], "server_error");
    }
    let (status, echoed, answer) = send(addr, Caller::default(), &body).await;
    assert_eq!(status, 200, "no session, no store needed: {answer}");
    assert_eq!(echoed, None);
}

/// The histories in Redis and in memory behave alike: an opening kept through every trim, the
/// oldest turns dropped past the cap, the newest turn kept whatever its size, and expiry.
#[tokio::test]
async fn both_stores_trim_and_expire_histories_alike() {
    let stores: [(&str, Arc<dyn StateStore>); 2] = [
        ("memory", Arc::new(MemoryStore::new())),
        ("redis", Arc::new(RedisStore::new(REDIS).unwrap())),
    ];
    for (kind, store) in stores {
        let name = format!("test:{}", uuid::Uuid::new_v4());
        // The opening is 4 bytes and each turn 3: 13 bytes hold the opening and three turns.
        let capped = HistoryLimit {
            ttl: Duration::from_secs(60),
            max_bytes: 13,
        };
        for turn in ["one", "two", "six", "ten"] {
            store
                .append_turn(&name, "open", turn, capped)
                .await
                .unwrap();
        }
        let read = store.history(&name, capped.ttl).await.unwrap();
        assert_eq!(read, ["open", "two", "six", "ten"], "{kind}");
        let long = "x".repeat(50);
        store
            .append_turn(&name, "open", &long, capped)
            .await
            .unwrap();
        let read = store.history(&name, capped.ttl).await.unwrap();
        assert_eq!(read, ["open", long.as_str()], "{kind}");

        let brief = HistoryLimit {
            ttl: Duration::from_millis(50),
            ..capped
        };
        let name = format!("test:{}", uuid::Uuid::new_v4());
        store.append_turn(&name, "", "one", brief).await.unwrap();
        assert_eq!(store.history(&name, brief.ttl).await.unwrap().len(), 2);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            store.history(&name, brief.ttl).await.unwrap().is_empty(),
            "{kind}: expired"
        );
    }
}

//! Agent-aware serving end to end on the real model: a turn that ends in tool calls keeps its KV
//! blocks through pressure that evicts a plain turn's; a run waiting for its tool keeps its place
//! among a bounded number of runs in progress; speculative prefill warms the next turn; hints are
//! checked.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use engine::{ChatMessage, EngineConfig, EngineHandle};
use gateway::config::ServeConfig;
use gateway::AppState;
use serde_json::{json, Value};

use testkit::{engine, generating, models, MODEL_ID};

const RUN_HEADER: &str = "x-swarmgate-run-id";
const BLOCK: usize = 16;

async fn server(engine: EngineHandle) -> SocketAddr {
    // Holds long enough that none runs out while a test runs on a busy machine.
    let config = ServeConfig {
        tool_kv_ttl_max_secs: 600.0,
        ..ServeConfig::default()
    };
    testkit::serve(AppState::configured(engine, &config)).await
}

/// Posts `body` to `path` as a turn of `run`; returns the status and the answer.
async fn post(addr: SocketAddr, path: &str, run: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .header(RUN_HEADER, run)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

fn cached(answer: &Value) -> usize {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached tokens in {answer}")) as usize
}

fn prompt_tokens(answer: &Value) -> usize {
    answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize
}

/// A tool-call turn: the model must call `lookup`.
fn tool_turn() -> Value {
    json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Look up the weather in Paris for me."}],
        "tools": [{"type": "function", "function": {"name": "lookup",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}}],
        "tool_choice": "required",
        "max_tokens": 64,
        "temperature": 0,
    })
}

/// A plain turn about as long as the tool turn's prompt.
fn plain_turn() -> Value {
    let padding =
        "Rivers, mountains and forests cover the northern half of the country. ".repeat(12);
    json!({
        "model": MODEL_ID,
        "messages": [
            {"role": "system", "content": padding},
            {"role": "user", "content": "Name one river."}
        ],
        "max_tokens": 8,
        "temperature": 0,
    })
}

#[tokio::test]
async fn a_tool_call_turn_keeps_its_blocks_through_pressure_that_evicts_an_older_plain_turn() {
    // A pool of 96 blocks and no host tier: what is evicted is gone, and comes back only by
    // being computed again.
    const BLOCKS: usize = 96;
    let engine = EngineHandle::start(&EngineConfig {
        model: models().join(format!("{MODEL_ID}.gguf")),
        device_kv_blocks: Some(BLOCKS),
        host_kv_cache_mb: 0,
        ..EngineConfig::default()
    })
    .unwrap();
    let stats = engine.clone();
    let addr = server(engine).await;
    // The tool turn ends first: by age alone, its blocks would be the first to go.
    let (status, tool) = post(addr, "/v1/chat/completions", "run-tool", tool_turn()).await;
    assert_eq!(status, 200, "{tool}");
    assert_eq!(tool["choices"][0]["finish_reason"], "tool_calls", "{tool}");
    let (status, plain) = post(addr, "/v1/chat/completions", "run-plain", plain_turn()).await;
    assert_eq!(status, 200, "{plain}");
    let tool_blocks = (prompt_tokens(&tool) - 1) / BLOCK;
    let plain_blocks = (prompt_tokens(&plain) - 1) / BLOCK;
    assert!(
        tool_blocks >= 4 && plain_blocks >= 4,
        "{tool_blocks} and {plain_blocks}"
    );
    let kv = stats.stats().kv();
    let retained = kv.gauges.device_retained;
    assert!(retained >= tool_blocks, "{kv:?}");
    // Pressure: a prompt that needs every block but the held ones (and a few to spare), so
    // most of the plain turn's must go.
    let pressure = (BLOCKS - retained - 3) * BLOCK - 1;
    let (status, _) = post(
        addr,
        "/v1/completions",
        "run-pressure",
        json!({"model": MODEL_ID, "prompt": vec![1000; pressure], "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let kv = stats.stats().kv();
    assert!(kv.counters.device_evictions > 0, "no pressure: {kv:?}");
    assert_eq!(kv.counters.retained_demoted_blocks, 0, "{kv:?}");
    assert_eq!(kv.gauges.device_retained, retained, "still held: {kv:?}");
    // The tool turn's follow-up finds its whole prompt (its last partial block too, when the
    // answer's forced start fills it); the plain turn's was evicted.
    let hits = kv.counters.retained_hit_blocks;
    let (_, again) = post(addr, "/v1/chat/completions", "run-tool", tool_turn()).await;
    let found = cached(&again);
    assert!(
        found >= tool_blocks * BLOCK && found <= prompt_tokens(&again),
        "{again}"
    );
    assert!(stats.stats().kv().counters.retained_hit_blocks >= hits + tool_blocks as u64);
    let (_, again) = post(addr, "/v1/chat/completions", "run-plain", plain_turn()).await;
    assert!(cached(&again) < plain_blocks * BLOCK, "{again}");
}

#[tokio::test]
async fn a_run_waiting_for_its_tool_keeps_its_place_among_the_runs_in_progress() {
    use std::sync::atomic::Ordering;
    // One run in progress at a time.
    let engine = EngineHandle::start(&EngineConfig {
        model: models().join(format!("{MODEL_ID}.gguf")),
        max_active_runs: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let stats = engine.clone();
    let addr = server(engine).await;
    let (status, tool) = post(addr, "/v1/chat/completions", "run-a", tool_turn()).await;
    assert_eq!(status, 200, "{tool}");
    assert_eq!(tool["choices"][0]["finish_reason"], "tool_calls", "{tool}");
    // Run a waits for its tool: a new run waits to start.
    let later = tokio::spawn(post(addr, "/v1/chat/completions", "run-b", plain_turn()));
    let waiting = || stats.stats().waiting.load(Ordering::Relaxed);
    let since = Instant::now();
    while waiting() == 0 {
        assert!(
            since.elapsed() < Duration::from_secs(60),
            "run b never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(waiting(), 1, "run b started beside run a");
    assert!(!later.is_finished());
    // Run a's next turn goes straight in, ends the run without a tool call, and then run b
    // starts.
    let (status, answer) = post(addr, "/v1/chat/completions", "run-a", plain_turn()).await;
    assert_eq!(status, 200, "{answer}");
    assert_ne!(answer["choices"][0]["finish_reason"], "tool_calls");
    let (status, answer) = tokio::time::timeout(Duration::from_secs(120), later)
        .await
        .expect("run b started once run a was done")
        .unwrap();
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test]
async fn speculative_prefill_warms_the_whole_shared_prefix_of_the_next_turn() {
    let _engine = generating().await;
    let model = engine().model();
    let addr = server(engine().clone()).await;
    let run = format!("warm-{}", uuid::Uuid::new_v4());
    let system = "You are a concise assistant for a travel agency. ".repeat(4);
    let first = [
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Suggest one city to visit in Italy."}),
    ];
    let held = engine().stats().kv().counters.retained_blocks;
    let (status, answer) = post(
        addr,
        "/v1/chat/completions",
        &run,
        json!({"model": MODEL_ID, "messages": first, "max_tokens": 12, "temperature": 0,
            "swarmgate": {"speculative_prefill": true}}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
    // The warm-up ends holding its blocks for the run.
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine().stats().kv().counters.retained_blocks == held {
        assert!(Instant::now() < deadline, "no warm-up held anything");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut second = first.to_vec();
    second.push(json!({"role": "assistant", "content": text}));
    second.push(json!({"role": "user", "content": "What should I eat there?"}));
    let hits = engine().stats().kv().counters.retained_hit_blocks;
    let (status, follow_up) = post(
        addr,
        "/v1/chat/completions",
        &run,
        json!({"model": MODEL_ID, "messages": second, "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{follow_up}");
    // What the warm-up prefilled, and what the follow-up's prompt shares with it.
    let message =
        |m: &Value| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap());
    let warmed: Vec<ChatMessage> = second[..3].iter().map(message).collect();
    let warmed = model.encode_chat(&warmed, false).unwrap().tokens;
    let asked: Vec<ChatMessage> = second.iter().map(message).collect();
    let asked = model.encode_chat(&asked, true).unwrap().tokens;
    let shared = warmed
        .iter()
        .zip(&asked)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared > prompt_tokens(&answer), "the answer is part of it");
    assert_eq!(cached(&follow_up), shared / BLOCK * BLOCK, "{follow_up}");
    let from_hold = engine().stats().kv().counters.retained_hit_blocks - hits;
    assert_eq!(
        from_hold as usize,
        shared / BLOCK,
        "every hit came from the warm-up's hold"
    );
}

#[tokio::test]
async fn bad_priorities_and_hints_are_400s_naming_the_field() {
    let addr = server(engine().clone()).await;
    for (extra, param) in [
        (json!({"priority": 5_000_000}), "priority"),
        (json!({"priority": "urgent"}), "priority"),
        (json!({"swarmgate": {"osl": 0}}), "swarmgate.osl"),
        (
            json!({"agent_hints": {"cache_ttl_secs": -1}}),
            "agent_hints.cache_ttl_secs",
        ),
        (
            json!({"swarmgate": {"cache_ttl_secs": 1e308}}),
            "swarmgate.cache_ttl_secs",
        ),
        (
            json!({"priority": 1, "agent_hints": {"priority": 2}}),
            "agent_hints.priority",
        ),
    ] {
        let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, error) = post(addr, "/v1/chat/completions", "r", body.clone()).await;
        assert_eq!(status, 400, "{body}: {error}");
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
    }
    // A run id the header cannot carry is refused too.
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .header(RUN_HEADER, "x".repeat(300))
        .json(&json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
}

//! Chat requests to the swarm end to end on the real models, in process through `app()`: the
//! routing decision in the header and the `swarm` object, verify-then-release with a retry
//! served from the prefix cache, consensus samples sharing engine steps, per-hop accounting,
//! per-agent budgets and metrics, both stream modes, and tool calls through the swarm.
//!
//! The swarm is the shipped `swarm.toml` with three changes for the tests: `support` requires
//! JSON answers (retrying once), `analyst` has a budget small enough to run out, and `coder`
//! has a default tool.

use std::sync::atomic::Ordering;
use std::sync::LazyLock;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::Swarm;
use gateway::{app, AppState};
use router::{OnFailure, SwarmConfig, VerifierChecks, VerifierPolicy};
use serde_json::{json, Value};
use testkit::{engine, generating, root, wait_until_idle};
use tower::ServiceExt;

/// `analyst`'s tokens per minute here: room for one short request, not two.
const ANALYST_BUDGET: u64 = 400;

fn swarm() -> Swarm {
    static SWARM: LazyLock<Swarm> = LazyLock::new(|| {
        let mut config = SwarmConfig::load(&root().join("swarm.toml")).unwrap();
        for agent in &mut config.agents {
            match agent.name.as_str() {
                "support" => {
                    agent.verifier = Some(VerifierPolicy {
                        checks: VerifierChecks {
                            json: true,
                            ..VerifierChecks::default()
                        },
                        on_failure: OnFailure::Retry,
                        max_retries: 1,
                        ..VerifierPolicy::default()
                    })
                }
                "analyst" => agent.tokens_per_minute = Some(ANALYST_BUDGET),
                "coder" => agent.tools = vec![run_tool()],
                _ => {}
            }
        }
        Swarm::new(config, engine().clone(), Some(testkit::embedder())).unwrap()
    });
    SWARM.clone()
}

/// `coder`'s default tool.
fn run_tool() -> Value {
    json!({"type": "function", "function": {"name": "run_python", "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "maxLength": 200}},
        "required": ["code"],
        "additionalProperties": false
    }}})
}

fn state() -> AppState {
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES).with_swarm(swarm())
}

struct Answer {
    status: StatusCode,
    agent: Option<String>,
    body: Bytes,
}

type Bytes = axum::body::Bytes;

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    /// The stream's chunks, `[DONE]` left out (and asserted last).
    fn chunks(&self) -> Vec<Value> {
        let text = std::str::from_utf8(&self.body).unwrap();
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
}

async fn chat(state: AppState, body: Value) -> Answer {
    chat_with(state, body, &[]).await
}

/// [`chat`], with these extra headers.
async fn chat_with(state: AppState, body: Value, headers: &[(&str, &str)]) -> Answer {
    let mut request =
        Request::post("/v1/chat/completions").header(header::CONTENT_TYPE, "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Body::from(body.to_string())).unwrap();
    let response = app(state).oneshot(request).await.unwrap();
    let status = response.status();
    let agent = response
        .headers()
        .get("x-swarm-agent")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    Answer {
        status,
        agent,
        body,
    }
}

/// Asserts `usage` is the sum of the hops, field by field.
fn assert_usage_is_the_sum_of_hops(usage: &Value, hops: &Value) {
    let hops = hops.as_array().unwrap();
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        let sum: u64 = hops.iter().map(|h| h[field].as_u64().unwrap()).sum();
        assert_eq!(
            usage[field].as_u64().unwrap(),
            sum,
            "{field}: {usage} vs {hops:?}"
        );
    }
    let cached: u64 = hops
        .iter()
        .map(|h| h["cached_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(cached)
    );
}

fn hops_of<'a>(hops: &'a Value, kind: &str) -> Vec<&'a Value> {
    hops.as_array()
        .unwrap()
        .iter()
        .filter(|h| h["hop"] == kind)
        .collect()
}

#[tokio::test]
async fn a_routed_answer_names_its_agent_in_the_header_and_the_body() {
    let _engine = generating().await;
    let answer = chat(
        state(),
        json!({
            "model": "swarm",
            "messages": [{"role": "user", "content": "Solve for x: 4x + 6 = 30. Show the steps."}],
            "max_tokens": 48,
            "temperature": 0
        }),
    )
    .await;
    let body = answer.json();
    assert_eq!(answer.status, StatusCode::OK, "{body}");
    assert_eq!(answer.agent.as_deref(), Some("math"));
    let swarm = &body["swarm"];
    assert_eq!(swarm["agent"], "math");
    assert_eq!(body["model"], "math");
    assert_eq!(swarm["route"]["agent"], "math");
    assert_eq!(swarm["route"]["strategy"], "embedding");
    assert!(["passed", "failed"].contains(&swarm["verdict"]["status"].as_str().unwrap()));
    let hops = &swarm["usage"];
    let route = hops_of(hops, "route");
    assert_eq!(route.len(), 1);
    assert_eq!(route[0]["agent"], "router");
    assert!(route[0]["prompt_tokens"].as_u64().unwrap() > 5, "{hops}");
    assert!(!hops_of(hops, "generate").is_empty());
    assert_usage_is_the_sum_of_hops(&body["usage"], hops);
    assert!(!body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    wait_until_idle().await;
}

/// `support` requires JSON here. Its first, unconstrained answer to a routed question is prose,
/// which the verifier rejects; the retry carries the critique and decodes under the JSON
/// constraint, starts with the first attempt's prompt (served from the prefix cache), and is
/// released as valid JSON.
#[tokio::test]
async fn a_json_policy_retries_a_rejected_answer_from_the_cached_prefix() {
    let _engine = generating().await;
    let hits_before = engine().stats().kv().counters.device_hit_tokens;
    let answer = chat(
        state(),
        json!({
            "model": "swarm",
            "messages": [{"role": "user", "content":
                "I was billed twice for the same order. Can you help me get my money back?"}],
            "max_tokens": 160,
            "temperature": 0
        }),
    )
    .await;
    let body = answer.json();
    assert_eq!(answer.status, StatusCode::OK, "{body}");
    assert_eq!(answer.agent.as_deref(), Some("support"), "{body}");
    let verdict = &body["swarm"]["verdict"];
    assert_eq!(verdict["attempts"], 2, "{body}");
    assert_eq!(verdict["status"], "passed", "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    serde_json::from_str::<Value>(content.trim()).expect("the released answer is JSON");

    let hops = &body["swarm"]["usage"];
    let generated = hops_of(hops, "generate");
    assert_eq!(generated.len(), 2, "{hops}");
    assert_eq!(hops_of(hops, "verify").len(), 2, "{hops}");
    assert_eq!(hops_of(hops, "route").len(), 1, "{hops}");
    let (first, retry) = (generated[0], generated[1]);
    let block = 16;
    let first_prompt = first["prompt_tokens"].as_u64().unwrap();
    assert!(
        retry["prompt_tokens"].as_u64().unwrap() > first_prompt,
        "the retry adds the answer and the critique: {hops}"
    );
    assert!(
        retry["cached_tokens"].as_u64().unwrap() >= first_prompt / block * block,
        "every full block of the first prompt is reused: {hops}"
    );
    let hits = engine().stats().kv().counters.device_hit_tokens - hits_before;
    assert!(
        hits >= first_prompt / block * block,
        "the engine's prefix-cache counter saw the reuse: {hits}"
    );
    assert_usage_is_the_sum_of_hops(&body["usage"], hops);
    wait_until_idle().await;
}

/// Three greedy samples of one agent run in the same engine steps: the steps taken are about
/// one sample's length, not three.
#[tokio::test]
async fn consensus_samples_share_engine_steps_and_the_majority_wins() {
    let _engine = generating().await;
    let stats = engine().stats();
    let steps_before = stats.steps.load(Ordering::Relaxed);
    let decoded_before = stats.decode_tokens.load(Ordering::Relaxed);
    let max_tokens = 32;
    let answer = chat(
        state(),
        json!({
            "model": "math",
            "messages": [{"role": "user", "content": "Explain what a prime number is, with examples."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "swarm": {"consensus": {"n": 3, "strategy": "majority"}}
        }),
    )
    .await;
    let body = answer.json();
    assert_eq!(answer.status, StatusCode::OK, "{body}");
    let steps = stats.steps.load(Ordering::Relaxed) - steps_before;
    let decoded = stats.decode_tokens.load(Ordering::Relaxed) - decoded_before;
    let consensus = &body["swarm"]["consensus"];
    assert_eq!(consensus["strategy"], "majority");
    let samples = consensus["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 3);
    assert!(
        samples.iter().all(|s| s["votes"] == 3),
        "greedy samples agree: {consensus}"
    );
    let chosen = consensus["chosen"].as_u64().unwrap() as usize;
    assert_eq!(
        samples[chosen]["content"],
        body["choices"][0]["message"]["content"]
    );
    let generated = hops_of(&body["swarm"]["usage"], "generate");
    assert_eq!(generated.len(), 3);
    let completion: u64 = generated
        .iter()
        .map(|h| h["completion_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(completion, 3 * max_tokens, "{body}");
    assert!(decoded >= completion - 3, "decoded {decoded}");
    assert!(
        steps < 2 * max_tokens,
        "{steps} steps for 3 samples of {max_tokens} tokens: they did not share steps"
    );
    assert_eq!(body["swarm"]["verdict"]["attempts"], 3);
    assert_usage_is_the_sum_of_hops(&body["usage"], &body["swarm"]["usage"]);
    wait_until_idle().await;
}

#[tokio::test]
async fn a_buffered_stream_opens_with_the_whole_swarm_object() {
    let _engine = generating().await;
    let answer = chat(
        state(),
        json!({
            "model": "auto",
            "messages": [{"role": "user", "content": "Solve for x: 2x - 7 = 9."}],
            "max_tokens": 32,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true}
        }),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.agent.as_deref(), Some("math"));
    let chunks = answer.chunks();
    let first = &chunks[0]["swarm"];
    assert_eq!(first["agent"], "math");
    assert!(first["verdict"]["status"].is_string(), "{first}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_usage_is_the_sum_of_hops(usage, &first["usage"]);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());
    wait_until_idle().await;
}

/// `writer` streams provisionally: the first chunk names the agent without a verdict, the
/// tokens flow, and a chunk before the usage carries the verdict and the hops.
#[tokio::test]
async fn a_provisional_stream_ends_with_the_verdict() {
    let _engine = generating().await;
    let answer = chat(
        state(),
        json!({
            "model": "writer",
            "messages": [{"role": "user", "content": "Write a two-line poem about autumn leaves."}],
            "max_tokens": 40,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true}
        }),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.agent.as_deref(), Some("writer"));
    let chunks = answer.chunks();
    assert_eq!(chunks[0]["swarm"]["agent"], "writer");
    assert!(chunks[0]["swarm"].get("verdict").is_none());
    let deltas = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert!(deltas > 1, "tokens flow before the verdict");
    let n = chunks.len();
    let last = &chunks[n - 2]["swarm"];
    assert!(last["verdict"]["status"].is_string(), "{:?}", chunks[n - 2]);
    assert_usage_is_the_sum_of_hops(&chunks[n - 1]["usage"], &last["usage"]);
    wait_until_idle().await;
}

/// A session (named by `x-session-id`) continues through the swarm: the first turn streams live, the
/// second is whole, and its generation's prompt holds the first turn, mostly from the cache.
#[tokio::test]
async fn a_session_continues_through_the_swarm() {
    let _engine = generating().await;
    let state = state();
    let session = format!("swarm-session-{}", uuid::Uuid::new_v4());
    let turn = |text: &str, stream: bool| {
        json!({
            "model": "writer",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 40,
            "temperature": 0,
            "stream": stream,
        })
    };
    let in_session = [("x-session-id", session.as_str())];
    let first = chat_with(
        state.clone(),
        turn("Write a two-line poem about autumn leaves.", true),
        &in_session,
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    let chunks = first.chunks();
    let hops = &chunks[chunks.len() - 1]["swarm"]["usage"];
    let first = hops_of(hops, "generate")[0].clone();

    let second = chat_with(
        state,
        turn("Now one about spring rain.", false),
        &in_session,
    )
    .await;
    let body = second.json();
    assert_eq!(second.status, StatusCode::OK, "{body}");
    let second = hops_of(&body["swarm"]["usage"], "generate")[0];
    let tokens = |hop: &Value, field: &str| hop[field].as_u64().unwrap();
    assert!(
        tokens(second, "prompt_tokens")
            > tokens(&first, "prompt_tokens") + tokens(&first, "completion_tokens"),
        "the first turn is in the second's prompt: {first} then {second}"
    );
    assert!(
        tokens(second, "cached_tokens") >= tokens(&first, "prompt_tokens") / 16 * 16,
        "and its KV is reused: {first} then {second}"
    );
    wait_until_idle().await;
}

#[tokio::test]
async fn an_agent_over_its_budget_is_refused_and_metrics_count_per_agent() {
    let _engine = generating().await;
    let state = state();
    let request = json!({
        "model": "analyst",
        "messages": [{"role": "user", "content": "Name one metric for customer churn."}],
        "max_tokens": 8,
        "temperature": 0
    });
    let first = chat(state.clone(), request.clone()).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.json());
    let second = chat(state.clone(), request).await;
    let body = second.json();
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("analyst") && message.contains("budget"),
        "{message}"
    );

    let response = app(state)
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let text = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = std::str::from_utf8(&text).unwrap();
    assert!(
        text.contains("swarmgate_agent_requests_total{agent=\"analyst\"} 2"),
        "{text}"
    );
    for series in [
        "swarmgate_agent_verdicts_total{agent=\"analyst\"",
        "swarmgate_agent_time_to_first_token_seconds_count{agent=\"analyst\"}",
        // 8 tokens are too few for an answer: the verifier rejected it and it ran again.
        "swarmgate_agent_retries_total{agent=\"analyst\"} 1",
        "swarmgate_agent_prompt_tokens_total{agent=\"analyst\"}",
    ] {
        assert!(text.contains(series), "{series} in {text}");
    }
    wait_until_idle().await;
}

#[tokio::test]
async fn invalid_swarm_requests_are_400s_naming_the_field() {
    let cases = [
        (json!({"model": "swarm", "n": 2}), "n"),
        (
            json!({"model": "swarm", "swarm": {"consensus": {"strategy": "loudest"}}}),
            "swarm.consensus.strategy",
        ),
        (
            json!({"model": "swarm", "swarm": {"consensus": {"n": 9}}}),
            "swarm.consensus.n",
        ),
        (
            json!({"model": "swarm", "swarm": {"consensus": {"agents": ["math", "verifier"]}}}),
            "swarm.consensus.agents[1]",
        ),
        (
            json!({"model": "default", "swarm": {"consensus": {"n": 3}}}),
            "swarm",
        ),
    ];
    for (mut request, param) in cases {
        request["messages"] = json!([{"role": "user", "content": "What is 2 + 2?"}]);
        let answer = chat(state(), request.clone()).await;
        let body = answer.json();
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{request}: {body}");
        assert_eq!(body["error"]["param"], param, "{request}: {body}");
    }
    let answer = chat(
        state(),
        json!({"model": "verifier", "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::NOT_FOUND,
        "system agents never answer"
    );
}

/// A tool call through the swarm: routed as any request, answered with a call valid against its
/// schema, and not rejected by a JSON-checking verifier for being "not prose"; an agent's default
/// tools apply when the request brings none.
#[tokio::test]
async fn tool_calls_pass_through_the_swarm_valid_by_construction() {
    let _engine = generating().await;
    let refund = json!({"type": "function", "function": {"name": "issue_refund", "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string", "maxLength": 12}, "amount": {"type": "number"}},
        "required": ["order_id", "amount"],
        "additionalProperties": false
    }}});
    let answer = chat(
        state(),
        json!({
            "model": "swarm",
            "messages": [{"role": "user", "content":
                "I was charged twice for order 1234. Please refund the duplicate payment of 20 dollars."}],
            "tools": [refund],
            "tool_choice": "required",
            "parallel_tool_calls": false,
            "max_tokens": 64,
            "temperature": 0
        }),
    )
    .await;
    let body = answer.json();
    assert_eq!(answer.status, StatusCode::OK, "{body}");
    assert_eq!(answer.agent.as_deref(), Some("support"), "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert!(choice["message"]["content"].is_null(), "{body}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "issue_refund");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        arguments["order_id"].as_str().unwrap().len() <= 12,
        "{arguments}"
    );
    assert!(arguments["amount"].is_number(), "{arguments}");
    assert_eq!(body["swarm"]["verdict"]["attempts"], 1, "no retry: {body}");
    assert_ne!(body["swarm"]["verdict"]["status"], "failed", "{body}");

    let answer = chat(
        state(),
        json!({
            "model": "coder",
            "messages": [{"role": "user", "content": "Run Python code that prints 2 + 2."}],
            "tool_choice": "required",
            "max_tokens": 64,
            "temperature": 0
        }),
    )
    .await;
    let body = answer.json();
    assert_eq!(answer.status, StatusCode::OK, "{body}");
    let call = &body["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(
        call["function"]["name"], "run_python",
        "the agent's own tool: {body}"
    );
    wait_until_idle().await;
}

//! A server whose engine runs two models (SmolLM2, the default, and Gemma 3), in process
//! through `app()`: both models and every answering agent listed, a request naming either model,
//! an agent on each model answering, and the engine's figures labelled by model.

use std::sync::LazyLock;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use engine::{EngineConfig, EngineHandle};
use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::{app, AppState, Swarm};
use router::{ModelId, SwarmConfig, VerifierPolicy};
use serde_json::{json, Value};
use testkit::calls::{call, ids};
use testkit::{models, root, MODEL_ID, QUESTION};
use tower::ServiceExt;

const GEMMA3: &str = "gemma-3-270m-q4_k_m";

fn engine() -> &'static EngineHandle {
    static ENGINE: LazyLock<EngineHandle> = LazyLock::new(|| {
        EngineHandle::start(&EngineConfig {
            model: models().join(format!("{MODEL_ID}.gguf")),
            extra_models: vec![models().join(format!("{GEMMA3}.gguf"))],
            kv_cache_mb: 64,
            ..EngineConfig::default()
        })
        .expect("the two-model engine starts")
    });
    &ENGINE
}

/// The shipped swarm with `math` on Gemma 3, answering unverified (the verifier judges with
/// the default model).
fn state() -> AppState {
    static SWARM: LazyLock<Swarm> = LazyLock::new(|| {
        let mut config = SwarmConfig::load(&root().join("swarm.toml")).unwrap();
        let math = config.agents.iter_mut().find(|a| a.name.as_str() == "math");
        let math = math.unwrap();
        math.model = ModelId::new(GEMMA3).unwrap();
        math.verifier = Some(VerifierPolicy {
            enabled: false,
            ..VerifierPolicy::default()
        });
        Swarm::new(config, engine().clone(), Some(testkit::embedder())).unwrap()
    });
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES).with_swarm(SWARM.clone())
}

async fn post_chat(state: &AppState, body: Value) -> (StatusCode, Value) {
    call(
        state,
        Method::POST,
        "/v1/chat/completions",
        None,
        Some(body),
    )
    .await
}

async fn chat(model: &str, messages: Value) -> (StatusCode, Value) {
    let body = json!({"model": model, "messages": messages, "temperature": 0, "max_tokens": 24});
    post_chat(&state(), body).await
}

/// Gemma 3's GGUF is its base model: it answers after one example exchange.
fn one_shot() -> Value {
    json!([
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "What is the capital of France?"},
    ])
}

fn content(body: &Value) -> &str {
    body["choices"][0]["message"]["content"].as_str().unwrap()
}

#[tokio::test]
async fn both_models_and_every_answering_agent_are_listed() {
    let (status, body) = call(&state(), Method::GET, "/v1/models", None, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let ids = ids(&body);
    assert_eq!(ids[..2], [MODEL_ID, GEMMA3], "the default first: {ids:?}");
    for agent in ["swarm", "coder", "math", "general"] {
        assert!(ids.contains(&agent), "{agent} missing from {ids:?}");
    }
    assert!(!ids.contains(&"verifier"), "system agents are internal");
}

#[tokio::test]
async fn a_request_names_either_model() {
    let (status, body) = chat(MODEL_ID, json!([{"role": "user", "content": QUESTION}])).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], MODEL_ID);
    assert!(content(&body).contains("Paris"), "{body}");
    let (status, body) = chat(GEMMA3, one_shot()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], GEMMA3);
    assert!(content(&body).starts_with("Paris"), "{body}");
    let (status, body) = chat("gemma-3-1b", one_shot()).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
}

/// `general` runs on SmolLM2, `math` on Gemma 3: each answers on its own model, and the
/// engine's figures say which model decoded what.
#[tokio::test]
async fn an_agent_on_each_model_answers() {
    let (status, body) = chat("general", json!([{"role": "user", "content": QUESTION}])).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(content(&body).contains("Paris"), "{body}");
    let (status, body) = chat("math", one_shot()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(content(&body).contains("Paris"), "{body}");
    let decoded = |i: usize| {
        engine().stats().models[i]
            .decode_tokens
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(decoded(0) > 0 && decoded(1) > 0);
    // The exposition is text, not JSON.
    let metrics = Request::get("/metrics").body(Body::empty()).unwrap();
    let response = app(state()).oneshot(metrics).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    for model in [MODEL_ID, GEMMA3] {
        let series = format!("swarmgate_model_decode_tokens_total{{model=\"{model}\"}}");
        assert!(text.contains(&series), "{series} missing");
    }
}

/// A speculative prefill of a Gemma 3 conversation's next turn runs on Gemma 3, in its template:
/// the follow-up finds the answer's tokens in the cache too.
#[tokio::test]
async fn the_next_turn_is_prefilled_on_the_models_own_blocks() {
    let first = one_shot();
    let body = json!({"model": GEMMA3, "messages": first, "temperature": 0, "max_tokens": 16,
        "swarmgate": {"speculative_prefill": true}});
    let held = || engine().stats().kv().counters.retained_blocks;
    let before = held();
    let (status, answer) = post_chat(&state(), body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    // The warm-up ends holding its blocks for the next turn (no other test here holds any).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while held() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "no warm-up held anything"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut second = first.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": content(&answer)}));
    second.push(json!({"role": "user", "content": "And of Spain?"}));
    let hits = || engine().stats().kv().counters.retained_hit_blocks;
    let hits_before = hits();
    let (status, follow_up) = chat(GEMMA3, Value::Array(second)).await;
    assert_eq!(status, StatusCode::OK, "{follow_up}");
    let cached = follow_up["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > prompt_tokens / 16 * 16,
        "{cached} cached of {follow_up}"
    );
    // Its blocks are the ones the warm-up held: Gemma 3's, in Gemma 3's template.
    assert!(
        hits() > hits_before,
        "the follow-up found none of the warm-up's blocks"
    );
}

/// On a server whose engine runs SmolLM2 alone, the agent on Gemma 3 is not listed, and asking
/// it is a 404 naming its model.
#[tokio::test]
async fn an_agent_on_a_model_not_served_is_neither_listed_nor_answered() {
    let alone = AppState::new(testkit::engine().clone(), DEFAULT_MAX_BODY_BYTES)
        .with_swarm(state().swarm().unwrap().clone());
    let (_, body) = call(&alone, Method::GET, "/v1/models", None, None).await;
    let ids = ids(&body);
    assert!(ids.contains(&"coder") && !ids.contains(&"math"), "{ids:?}");
    assert!(!ids.contains(&GEMMA3), "{ids:?}");
    let body = json!({"model": "math", "messages": one_shot(), "max_tokens": 4});
    let (status, body) = post_chat(&alone, body).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(GEMMA3), "{body}");
}

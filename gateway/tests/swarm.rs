//! `POST /v1/swarm/route` end to end on the real models, driven in process through `app()`
//! with `oneshot`: the default swarm file's agents, both strategies, the error envelopes, and a
//! server started without a swarm.

use std::sync::LazyLock;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::Swarm;
use gateway::{app, AppState};
use router::SwarmConfig;
use serde_json::{json, Value};
use testkit::{engine, root};
use tower::ServiceExt;

const AGENTS: [&str; 6] = ["analyst", "coder", "general", "math", "support", "writer"];

fn swarm() -> Swarm {
    static SWARM: LazyLock<Swarm> = LazyLock::new(|| {
        let config = SwarmConfig::load(&root().join("swarm.toml")).unwrap();
        Swarm::new(config, engine().clone(), Some(testkit::embedder())).unwrap()
    });
    SWARM.clone()
}

fn state() -> AppState {
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES).with_swarm(swarm())
}

async fn post(state: AppState, body: &Value) -> (StatusCode, Value) {
    let request = Request::post("/v1/swarm/route")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app(state).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

fn score_names(body: &Value) -> Vec<String> {
    body["scores"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

#[tokio::test]
async fn a_coding_question_goes_to_the_coder_with_every_score() {
    let body = json!({
        "model": "swarm",
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Tell me a joke."},
            {"role": "assistant", "content": "Why did the chicken..."},
            {"role": "user", "content": "My Python script fails with IndentationError: unexpected indent on line 12. How do I fix it?"}
        ]
    });
    let (status, body) = post(state(), &body).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["agent"], "coder", "{body}");
    assert_eq!(body["strategy"], "embedding");
    assert_eq!(score_names(&body), AGENTS);
    for (_, score) in body["scores"].as_object().unwrap() {
        let score = score.as_f64().unwrap();
        assert!((0.0..=1.0).contains(&score), "{body}");
    }
}

#[tokio::test]
async fn the_llm_strategy_can_be_asked_for() {
    let body = json!({
        "messages": [{"role": "user", "content": "Solve 2x + 3 = 11 for x."}],
        "strategy": "llm"
    });
    let (status, body) = post(state(), &body).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["strategy"], "llm");
    assert!(AGENTS.contains(&body["agent"].as_str().unwrap()), "{body}");
    assert_eq!(score_names(&body), AGENTS);
    let total: f64 = body["scores"]
        .as_object()
        .unwrap()
        .values()
        .map(|s| s.as_f64().unwrap())
        .sum();
    assert!((total - 1.0).abs() < 1e-3, "{body}");
}

#[tokio::test]
async fn bad_requests_get_the_openai_envelope() {
    for (body, param) in [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "system", "content": "only instructions"}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "strategy": "coin"}),
            "strategy",
        ),
    ] {
        let (status, answer) = post(state(), &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
        assert_eq!(answer["error"]["param"], param, "{answer}");
    }
    let (status, answer) = post(state(), &json!({"message": "hi"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
}

#[tokio::test]
async fn without_a_swarm_the_model_is_not_found() {
    let state = AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES);
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, answer) = post(state, &body).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert_eq!(answer["error"]["code"], "model_not_found", "{answer}");
}

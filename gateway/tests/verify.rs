//! `POST /v1/swarm/verify` end to end on the real models (SmolLM2 judges, all-MiniLM-L6-v2
//! measures relevance), driven in process through `app()` with `oneshot`: obvious good and bad
//! answers, what each check reports, and the error envelopes of bad requests.

use std::sync::LazyLock;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use engine::{Embedder, EmbedderConfig};
use gateway::config::{ServeConfig, DEFAULT_MAX_BODY_BYTES};
use gateway::Embeddings;
use gateway::{app, AppState};
use serde_json::{json, Value};
use testkit::{engine, models};
use tower::ServiceExt;

fn embeddings() -> Embeddings {
    static EMBEDDINGS: LazyLock<Embeddings> = LazyLock::new(|| {
        let model = models().join("all-MiniLM-L6-v2");
        assert!(
            model.is_dir(),
            "{} is missing: run `make models`",
            model.display()
        );
        Embeddings::new(
            Embedder::load(&EmbedderConfig {
                model,
                threads: Some(1),
                ..EmbedderConfig::default()
            })
            .expect("the embedder loads"),
        )
    });
    EMBEDDINGS.clone()
}

fn state() -> AppState {
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES).with_embeddings(embeddings())
}

async fn verify(body: &Value) -> (StatusCode, Value) {
    let request = Request::post("/v1/swarm/verify")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app(state()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

fn codes(body: &Value) -> Vec<String> {
    body["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().split(':').next().unwrap().to_owned())
        .collect()
}

const QUESTION: &str = "What is the capital of France?";

#[tokio::test]
async fn a_right_answer_passes_with_a_judge_score() {
    let (status, body) = verify(&json!({
        "question": QUESTION,
        "answer": "The capital of France is Paris.",
    }))
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["verdict"], "passed", "{body}");
    let score = body["score"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&score), "{body}");
    assert!(body["relevance"].as_f64().unwrap() > 0.4, "{body}");
    assert_eq!(body["reasons"], json!([]));
}

#[tokio::test]
async fn an_off_topic_answer_fails_on_relevance() {
    let (status, body) = verify(&json!({
        "question": QUESTION,
        "answer": "Sourdough bread needs a starter, flour, water and salt, and a long, slow rise \
                   in a warm kitchen.",
    }))
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["verdict"], "failed", "{body}");
    assert_eq!(codes(&body), ["off_topic"], "{body}");
    assert!(body["relevance"].as_f64().unwrap() < 0.2, "{body}");
}

#[tokio::test]
async fn deterministic_failures_skip_the_model() {
    let (_, empty) = verify(&json!({"question": QUESTION, "answer": " "})).await;
    assert_eq!(codes(&empty), ["empty"]);
    assert_eq!(empty["score"], 0.0);
    assert_eq!(
        empty["relevance"],
        Value::Null,
        "no embedding for a failed answer"
    );
    let (_, json) = verify(&json!({
        "question": QUESTION,
        "answer": "{\"capital\": \"Paris\"",
        "requires_json": true,
    }))
    .await;
    assert_eq!(codes(&json), ["invalid_json"]);
    let (_, cut) = verify(&json!({
        "question": QUESTION,
        "answer": "The capital of France is Paris.",
        "finish_reason": "length",
    }))
    .await;
    assert_eq!(codes(&cut), ["truncated"]);
}

#[tokio::test]
async fn bad_requests_get_the_error_envelope() {
    for (body, param) in [
        (json!({"answer": "Paris."}), "question"),
        (json!({"question": QUESTION}), "answer"),
        (
            json!({"question": QUESTION, "answer": "x", "language": "French"}),
            "language",
        ),
        (json!({"question": 3, "answer": "x"}), "question"),
    ] {
        let (status, error) = verify(&body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        assert_eq!(error["error"]["param"], param, "{error}");
    }
}

/// The judge reads one step's log-probabilities under greedy decoding: the same question and
/// answer get the same score, whatever else runs. (SmolLM2-135M barely tells a right answer from
/// a refusal, about 0.26 against 0.27, which is why its threshold is only a veto of the clearest
/// "no"; a larger verifier model makes it a real check.)
#[tokio::test]
async fn the_judge_scores_from_log_probabilities_deterministically() {
    let state = state();
    let verifier = state.verifier();
    let engine = testkit::engine();
    let right = verifier
        .judge(engine, QUESTION, "The capital of France is Paris.")
        .await
        .unwrap()
        .score;
    let again = verifier
        .judge(engine, QUESTION, "The capital of France is Paris.")
        .await
        .unwrap()
        .score;
    let refused = verifier
        .judge(engine, QUESTION, "I don't know and I will not tell you.")
        .await
        .unwrap()
        .score;
    assert!((0.0..=1.0).contains(&right) && (0.0..=1.0).contains(&refused));
    assert!(
        right > 0.0 && right < 1.0,
        "a probability ratio, not a sampled word: {right}"
    );
    assert_eq!(right, again);
}

/// The judge runs under the request's deadlines: one it misses is the request's 504, as for a
/// chat, not a server error.
#[tokio::test]
async fn a_judge_past_the_first_token_deadline_is_a_504() {
    let config = ServeConfig {
        first_token_timeout_secs: 1e-6,
        ..ServeConfig::default()
    };
    // Without the embedding model the relevance check is skipped: the judge is the first step
    // that waits.
    let state = AppState::configured(engine().clone(), &config);
    let (status, body) = testkit::calls::call(
        &state,
        Method::POST,
        "/v1/swarm/verify",
        None,
        Some(json!({"question": QUESTION, "answer": "The capital of France is Paris."})),
    )
    .await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert_eq!(body["error"]["code"], "timeout", "{body}");
}

#[tokio::test]
async fn grounding_tells_an_answer_to_the_question_from_one_to_a_neighbouring_topic() {
    let question = "How do I check which Python version is installed on my machine?";
    // About pythons, the snakes: its words are near the question's, its content is not.
    let (status, snake) = verify(&json!({
        "question": question,
        "answer": "Pythons are large, non-venomous snakes found in Africa, Asia and Australia. \
                   They kill their prey by constriction.",
    }))
    .await;
    assert_eq!(status, StatusCode::OK, "{snake}");
    assert_eq!(snake["verdict"], "failed", "{snake}");
    assert_eq!(codes(&snake), ["off_topic"], "{snake}");
    assert!(snake["grounding"].as_f64().unwrap() < 0.0, "{snake}");
    // Too short for a sentence model to place, and grounded in the question.
    let (status, short) = verify(&json!({
        "question": "What is the capital of France? Answer in one word.",
        "answer": "Paris.",
    }))
    .await;
    assert_eq!(status, StatusCode::OK, "{short}");
    assert_eq!(short["verdict"], "passed", "{short}");
    assert!(short["relevance"].is_number(), "{short}");
    assert!(short["grounding"].as_f64().unwrap() > 0.15, "{short}");
}

/// An answer of characters the tokenizer drops (a control character) is an empty answer, a
/// failed verdict like any other, not a server error: found by fuzzing the API.
#[tokio::test]
async fn an_answer_the_model_reads_as_nothing_fails_as_empty() {
    for question in [
        QUESTION,
        "\u{b4}\u{10c30c}\u{a6}?\u{7bd70}\u{de}\u{f4}\u{12}>",
    ] {
        let (status, body) = verify(&json!({"question": question, "answer": "\u{4}"})).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["verdict"], "failed", "{body}");
        assert_eq!(codes(&body), ["empty"], "{body}");
    }
}

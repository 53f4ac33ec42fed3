//! `POST /v1/embeddings` end to end on the real all-MiniLM-L6-v2, driven in process through
//! `app()` with `oneshot`: OpenAI's response shape, both encodings, list order, the error
//! envelopes, and a server started without an embedding model.
//!
//! The generation engine is there only because the app state needs one; it never generates here.

use std::path::PathBuf;
use std::sync::LazyLock;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use base64::Engine as _;
use engine::{Embedder, EmbedderConfig, EngineConfig, EngineHandle};
use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::validate::embeddings::MAX_EMBEDDING_INPUTS;
use gateway::Embeddings;
use gateway::{app, AppState};
use serde_json::{json, Value};
use tower::ServiceExt;

const EMBEDDING_MODEL: &str = "all-MiniLM-L6-v2";

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

fn engine() -> &'static EngineHandle {
    static ENGINE: LazyLock<EngineHandle> = LazyLock::new(|| {
        let model = models().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            model.is_file(),
            "{} is missing: run `make models`",
            model.display()
        );
        EngineHandle::start(&EngineConfig {
            model,
            kv_cache_mb: 16,
            host_kv_cache_mb: 0,
            threads: Some(1),
            ..EngineConfig::default()
        })
        .expect("the engine starts")
    });
    &ENGINE
}

fn embeddings() -> Embeddings {
    static EMBEDDINGS: LazyLock<Embeddings> = LazyLock::new(|| {
        let model = models().join(EMBEDDING_MODEL);
        assert!(
            model.is_dir(),
            "{} is missing: run `make models`",
            model.display()
        );
        let embedder = Embedder::load(&EmbedderConfig {
            model,
            threads: Some(1),
            ..EmbedderConfig::default()
        })
        .expect("the embedder loads");
        Embeddings::new(embedder)
    });
    EMBEDDINGS.clone()
}

fn state() -> AppState {
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES).with_embeddings(embeddings())
}

/// Posts `body` to `/v1/embeddings` through `app(state)`; returns the status and the JSON body.
async fn post(state: AppState, body: &Value) -> (StatusCode, Value) {
    let request = Request::post("/v1/embeddings")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app(state).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{status}: body is not JSON ({e}): {bytes:?}"));
    (status, body)
}

async fn embed(body: Value) -> Value {
    let (status, body) = post(state(), &body).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

fn floats(embedding: &Value) -> Vec<f32> {
    embedding
        .as_array()
        .expect("a float embedding is an array")
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Asserts `body` is OpenAI's error envelope with this `param` and `code`.
fn assert_envelope(body: &Value, param: &str, code: Option<&str>) {
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], "invalid_request_error", "{body}");
    assert_eq!(error["param"], param, "{body}");
    assert_eq!(error["code"].as_str(), code, "{body}");
}

#[tokio::test]
async fn a_string_gets_openai_shape_and_sentence_transformers_values() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/minilm_reference.json");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let item = &reference["items"][0];
    let body = embed(json!({"input": item["text"], "model": EMBEDDING_MODEL})).await;
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], EMBEDDING_MODEL);
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["object"], "embedding");
    assert_eq!(data[0]["index"], 0);
    let ours = floats(&data[0]["embedding"]);
    assert_eq!(ours.len(), 384);
    assert!(max_abs_diff(&ours, &floats(&item["embedding"])) < 1e-4);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": item["tokens"], "total_tokens": item["tokens"]})
    );
}

#[tokio::test]
async fn float_and_base64_agree() {
    let input = "Which agent handles refunds?";
    let float = embed(json!({"input": input, "encoding_format": "float"})).await;
    let float = floats(&float["data"][0]["embedding"]);
    let encoded =
        embed(json!({"input": input, "encoding_format": "base64", "dimensions": 384})).await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(
            encoded["data"][0]["embedding"]
                .as_str()
                .expect("a base64 string"),
        )
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, float);
}

#[tokio::test]
async fn a_list_keeps_its_order() {
    let inputs = [
        "The cat sat on the mat.",
        "A man is playing a guitar on stage, and the crowd sings along with him.",
        "hi",
        "Kubernetes deployments roll back when their health checks fail.",
    ];
    let body = embed(json!({"input": inputs, "model": "default"})).await;
    assert_eq!(
        body["model"], EMBEDDING_MODEL,
        "the alias reports the real id"
    );
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), inputs.len());
    let mut tokens = 0;
    for (i, (input, item)) in inputs.iter().zip(data).enumerate() {
        assert_eq!(item["index"], i);
        let alone = embed(json!({"input": input})).await;
        tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
        let diff = max_abs_diff(
            &floats(&item["embedding"]),
            &floats(&alone["data"][0]["embedding"]),
        );
        assert!(diff < 1e-5, "{diff} for {input:?}");
    }
    assert_eq!(body["usage"]["prompt_tokens"], tokens);
    assert_eq!(body["usage"]["total_tokens"], tokens);
}

#[tokio::test]
async fn refusals_are_envelopes_naming_the_field() {
    let too_many = vec!["x"; MAX_EMBEDDING_INPUTS + 1];
    for (body, param) in [
        (json!({"input": ""}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": ["a", ""]}), "input"),
        (json!({"input": too_many}), "input"),
        (json!({"input": [[101, 102]]}), "input"),
        (json!({"input": 5}), "input"),
        (json!({"model": EMBEDDING_MODEL}), "input"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "a", "dimensions": 512}), "dimensions"),
    ] {
        let (status, answer) = post(state(), &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert_envelope(&answer, param, None);
    }
    let (status, answer) = post(state(), &json!({"input": "a", "model": "ada-002"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_envelope(&answer, "model", Some("model_not_found"));
}

#[tokio::test]
async fn without_an_embedding_model_every_request_is_not_found() {
    let state = AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES);
    assert_eq!(state.embedding_model_id(), None);
    let (status, answer) = post(state, &json!({"input": "a", "model": EMBEDDING_MODEL})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_envelope(&answer, "model", Some("model_not_found"));
    assert_eq!(
        self::state().embedding_model_id(),
        Some(EMBEDDING_MODEL),
        "the id a model list can show"
    );
}

//! The gRPC API end to end on the real model and a real engine: a tonic server on `127.0.0.1:0`
//! driven by the generated tonic client, its answers checked against the HTTP API's answer to
//! the same request (`app()` driven in process with `oneshot`).
//!
//! One engine serves the whole file. Tests that generate take [`generating`] so that each sees
//! the engine to itself: the cancellation test checks that every KV block is free again, which
//! another test's sequence would make false.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::grpc::pb::inference_client::InferenceClient;
use gateway::grpc::pb::{self, ChatMessage, ChatRequest, FinishReason};
use gateway::{app, AppState};
use serde_json::{json, Value};
use testkit::{
    assert_cancelled, engine, generating, wait_until_idle, ENDLESS_PROMPT, MODEL_ID, QUESTION,
};
use tonic::transport::Channel;
use tonic::Code;
use tower::ServiceExt;

fn state() -> AppState {
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES)
}

/// A client of a real gRPC server on an ephemeral port; the server stops with the test's
/// runtime.
async fn client() -> InferenceClient<Channel> {
    client_of(state()).await
}

async fn client_of(state: AppState) -> InferenceClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway::grpc::serve_on(
        listener,
        state,
        std::future::pending::<()>(),
    ));
    InferenceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

fn user(content: &str) -> Vec<ChatMessage> {
    vec![ChatMessage {
        role: "user".into(),
        content: content.into(),
        ..ChatMessage::default()
    }]
}

/// The question, greedy, at most 40 tokens: the same request as [`rest_answer`] sends.
fn question() -> ChatRequest {
    ChatRequest {
        model: Some(MODEL_ID.into()),
        messages: user(QUESTION),
        temperature: Some(0.0),
        max_tokens: Some(40),
        ..ChatRequest::default()
    }
}

/// The HTTP API's whole answer to the question.
async fn rest_answer() -> Value {
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 40,
    });
    let request = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app(state()).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

fn finish_reason_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
        FinishReason::Unspecified => "unspecified",
    }
}

#[tokio::test]
async fn streamed_and_unary_answers_are_the_rest_answer() {
    let _engine = generating().await;
    let rest = rest_answer().await;
    let rest_text = rest["choices"][0]["message"]["content"].as_str().unwrap();
    let rest_reason = rest["choices"][0]["finish_reason"].as_str().unwrap();
    let rest_usage = &rest["usage"];
    let mut client = client().await;

    let mut stream = client.chat_stream(question()).await.unwrap().into_inner();
    let mut chunks = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        chunks.push(chunk);
    }
    let (last, deltas) = chunks.split_last().expect("at least one chunk");
    assert!(deltas.len() >= 2, "{chunks:?}");
    let text: String = deltas.iter().map(|c| c.delta.as_str()).collect();
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(
        text, rest_text,
        "gRPC and REST answer the same request alike"
    );
    let id = &last.id;
    assert!(id.starts_with("chatcmpl-"), "{id}");
    for chunk in deltas {
        assert_eq!((&chunk.id, chunk.model.as_str()), (id, MODEL_ID));
        assert!(!chunk.delta.is_empty());
        assert_eq!(chunk.finish_reason(), FinishReason::Unspecified);
        assert!(chunk.usage.is_none());
    }
    assert_eq!(last.delta, "");
    assert_eq!(finish_reason_name(last.finish_reason()), rest_reason);
    let usage = last.usage.expect("the last chunk carries the usage");
    assert_eq!(
        u64::from(usage.prompt_tokens),
        rest_usage["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        u64::from(usage.completion_tokens),
        rest_usage["completion_tokens"].as_u64().unwrap()
    );
    // The same prompt a second time: its full blocks come from the prefix cache.
    assert!(usage.cached_tokens > 0, "{usage:?}");

    let whole = client.chat(question()).await.unwrap().into_inner();
    assert_eq!(whole.text, rest_text);
    assert_eq!(whole.model, MODEL_ID);
    assert!(whole.id.starts_with("chatcmpl-") && &whole.id != id);
    assert_eq!(finish_reason_name(whole.finish_reason()), rest_reason);
    let whole_usage = whole.usage.unwrap();
    assert_eq!(
        (whole_usage.prompt_tokens, whole_usage.completion_tokens),
        (usage.prompt_tokens, usage.completion_tokens)
    );
    assert!(whole.logprobs.is_empty());
}

#[tokio::test]
async fn logprobs_come_with_their_tokens() {
    let _engine = generating().await;
    let request = ChatRequest {
        logprobs: Some(true),
        top_logprobs: Some(2),
        max_tokens: Some(8),
        ..question()
    };
    let whole = client().await.chat(request).await.unwrap().into_inner();
    let completion = whole.usage.unwrap().completion_tokens as usize;
    let tokens = whole.logprobs.len();
    // The end-of-turn token counts as generated but is never shown.
    assert!(
        tokens == completion || tokens + 1 == completion,
        "{whole:?}"
    );
    for token in &whole.logprobs {
        assert!(token.logprob <= 0.0);
        assert!(!token.bytes.is_empty());
        assert_eq!(token.top_logprobs.len(), 2);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(token.top_logprobs[0].logprob, token.logprob);
    }
}

#[tokio::test]
async fn list_models_names_the_served_model() {
    let models = client()
        .await
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models;
    let ids: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [MODEL_ID]);
}

#[tokio::test]
async fn bad_requests_get_the_rest_rules_as_codes() {
    let mut client = client().await;
    let too_hot = ChatRequest {
        temperature: Some(5.0),
        ..question()
    };
    let status = client.chat(too_hot.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("temperature"), "{status:?}");
    let status = client.chat_stream(too_hot).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let unknown = ChatRequest {
        model: Some("gpt-4".into()),
        ..question()
    };
    let status = client.chat(unknown.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("gpt-4"), "{status:?}");
    let status = client.chat_stream(unknown).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");

    let empty = ChatRequest {
        messages: Vec::new(),
        ..question()
    };
    let status = client.chat(empty).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
}

#[tokio::test]
async fn calls_need_a_key_when_keys_are_configured() {
    let _engine = generating().await;
    let config = gateway::ServeConfig {
        api_keys: vec!["sk-grpc".parse().unwrap()],
        ..gateway::ServeConfig::default()
    };
    let mut client = client_of(AppState::configured(engine().clone(), &config)).await;
    let status = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let mut wrong = tonic::Request::new(question());
    wrong
        .metadata_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    let status = client.chat(wrong).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let mut right = tonic::Request::new(question());
    right
        .metadata_mut()
        .insert("authorization", "Bearer sk-grpc".parse().unwrap());
    let answer = client.chat(right).await.unwrap().into_inner();
    assert!(answer.text.contains("Paris"), "{answer:?}");
}

#[tokio::test]
async fn calls_pass_the_same_admission_as_http_requests() {
    let _engine = generating().await;
    let config = gateway::ServeConfig {
        rpm: 2,
        tpm: 100_000,
        ..gateway::ServeConfig::default()
    };
    let state = AppState::configured(engine().clone(), &config);
    let mut client = client_of(state.clone()).await;
    assert!(client.chat(question()).await.is_ok());
    // The HTTP request takes the second of the minute's two requests: one bucket for both APIs.
    let body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1});
    let request = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    assert_eq!(
        app(state).oneshot(request).await.unwrap().status(),
        StatusCode::OK
    );
    let status = client.chat(question()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("requests per minute"),
        "{status:?}"
    );
    let status = client.chat_stream(question()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
}

#[tokio::test]
async fn messages_over_the_body_limit_are_refused() {
    let _engine = generating().await;
    let mut client = client_of(AppState::new(engine().clone(), 1024)).await;
    let large = ChatRequest {
        messages: user(&"word ".repeat(400)),
        ..question()
    };
    let status = client.chat(large).await.unwrap_err();
    // tonic's own code for a message over the limit.
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(client.chat(question()).await.is_ok());
}

/// A request that, left alone, runs until the KV cache is full.
fn endless() -> ChatRequest {
    ChatRequest {
        model: Some(MODEL_ID.into()),
        messages: user(ENDLESS_PROMPT),
        ignore_eos: Some(true),
        ..ChatRequest::default()
    }
}

#[tokio::test]
async fn cancelling_a_stream_frees_the_engine() {
    let _engine = generating().await;
    let stats = engine().stats();
    let decoded_before = stats.decode_tokens.load(Ordering::Relaxed);
    let mut client = client().await;
    let mut stream = client.chat_stream(endless()).await.unwrap().into_inner();
    for _ in 0..5 {
        let chunk = stream.message().await.unwrap().expect("the stream goes on");
        assert_eq!(chunk.finish_reason(), FinishReason::Unspecified);
    }
    assert_eq!(stats.running.load(Ordering::Relaxed), 1);
    drop(stream);

    wait_until_idle().await;
    assert_cancelled(decoded_before);
}

#[tokio::test]
async fn giving_up_on_a_unary_call_frees_the_engine() {
    let _engine = generating().await;
    let stats = engine().stats();
    let decoded_before = stats.decode_tokens.load(Ordering::Relaxed);
    let mut client = client().await;
    let mut call = Box::pin(client.chat(endless()));
    // Keep the call going until the engine decodes it, then give up on it as a client does:
    // dropping the call's future resets its HTTP/2 stream.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats.decode_tokens.load(Ordering::Relaxed) == decoded_before {
        assert!(
            Instant::now() < deadline,
            "the engine never decoded the call"
        );
        tokio::select! {
            answer = &mut call => panic!("an endless call ended: {answer:?}"),
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    assert_eq!(stats.running.load(Ordering::Relaxed), 1);
    drop(call);

    wait_until_idle().await;
    assert_cancelled(decoded_before);
}

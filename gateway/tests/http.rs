//! The HTTP API end to end on the real model and a real engine: `app()` driven in process with
//! `oneshot`, and a real server on `127.0.0.1:0` driven by reqwest for streaming and client
//! disconnects.
//!
//! One engine serves the whole file (loading it is the slow part). Tests that generate take
//! [`generating`] so that each sees the engine to itself: the disconnect test checks that every
//! KV block is free again, which another test's sequence would make false.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use futures::StreamExt;
use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::{app, AppState};
use serde_json::{json, Value};
use testkit::{
    assert_cancelled, engine, generating, wait_until_idle, ENDLESS_PROMPT, MODEL_ID, QUESTION,
};
use tower::ServiceExt;

fn state() -> AppState {
    AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES)
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 40,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn post(body: impl Into<Body>) -> Request<Body> {
    Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

/// Sends `request` through `app` in process; returns status, headers and the JSON body.
async fn call(state: AppState, request: Request<Body>) -> (StatusCode, HeaderMap, Value) {
    let response = app(state).oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{status}: body is not JSON ({e}): {bytes:?}"));
    (status, headers, body)
}

/// Asserts `body` is OpenAI's error envelope with this `type` and `param`.
fn assert_envelope(body: &Value, kind: &str, param: Option<&str>) {
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], kind, "{body}");
    assert_eq!(error["param"].as_str(), param, "{body}");
    assert!(error.as_object().unwrap().contains_key("code"), "{body}");
}

/// A request that, left alone, runs until the KV cache is full: far longer than any test waits.
fn endless(stream: bool) -> Value {
    json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": ENDLESS_PROMPT}],
        "stream": stream,
        "ignore_eos": true,
    })
}

/// The `data:` payloads of an SSE body, in order, keep-alive comments dropped.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: ").or(line.strip_prefix("data:")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn answers_non_streaming() {
    let _engine = generating().await;
    let request = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", "req-42")
        .body(Body::from(chat(json!({})).to_string()))
        .unwrap();
    let (status, headers, body) = call(state(), request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(headers["x-request-id"], "req-42");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], MODEL_ID);
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(content.contains("Paris"), "{content:?}");
    assert_eq!(choice["finish_reason"], "stop", "{body}");
    assert_eq!(choice["logprobs"], Value::Null);
    let usage = &body["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(prompt > 10 && completion > 0 && completion <= 40, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + completion);
}

#[tokio::test]
async fn streams_over_a_real_server() {
    let _engine = generating().await;
    let addr = testkit::serve(state()).await;
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&chat(json!({
            "stream": true,
            "stream_options": {"include_usage": true},
            "logprobs": true,
            "top_logprobs": 2,
        })))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(response.headers().contains_key("x-request-id"));
    let data = sse_data(&response.text().await.unwrap());

    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")))
        .collect();
    assert!(chunks.len() >= 4, "{chunks:?}");
    let id = &chunks[0]["id"];
    assert!(id.as_str().unwrap().starts_with("chatcmpl-"));
    for chunk in &chunks {
        assert_eq!(&chunk["id"], id);
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], MODEL_ID);
    }

    let first = &chunks[0]["choices"][0];
    assert_eq!(first["delta"], json!({"role": "assistant", "content": ""}));
    assert_eq!(first["finish_reason"], Value::Null);

    let (usage_chunk, rest) = chunks.split_last().unwrap();
    let (finish_chunk, content_chunks) = rest.split_last().unwrap();
    let finish = &finish_chunk["choices"][0];
    assert_eq!(finish["delta"], json!({}));
    assert_eq!(finish["finish_reason"], "stop", "{finish_chunk}");

    let mut text = String::new();
    let mut tokens = 0;
    for chunk in &content_chunks[1..] {
        let choice = &chunk["choices"][0];
        assert_eq!(choice["finish_reason"], Value::Null);
        assert!(chunk.as_object().unwrap().contains_key("usage"));
        assert_eq!(chunk["usage"], Value::Null);
        text.push_str(choice["delta"]["content"].as_str().unwrap());
        for token in choice["logprobs"]["content"].as_array().unwrap() {
            assert!(token["logprob"].as_f64().unwrap() <= 0.0);
            assert!(token["bytes"].is_array());
            assert_eq!(token["top_logprobs"].as_array().unwrap().len(), 2);
            tokens += 1;
        }
    }
    assert!(text.contains("Paris"), "{text:?}");

    assert_eq!(usage_chunk["choices"], json!([]));
    let usage = &usage_chunk["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    // The end-of-turn token counts as generated but is never shown.
    assert!(
        tokens as u64 == completion || tokens as u64 + 1 == completion,
        "{usage}"
    );
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + completion
    );
}

#[tokio::test]
async fn malformed_json_is_a_400_envelope() {
    let (status, _, body) = call(state(), post(r#"{"messages": [}"#)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_envelope(&body, "invalid_request_error", None);

    let wrong_type = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from(chat(json!({})).to_string()))
        .unwrap();
    let (status, _, body) = call(state(), wrong_type).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_envelope(&body, "invalid_request_error", None);

    let (status, _, body) = call(
        state(),
        post(chat(json!({"temperature": "hot"})).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_envelope(&body, "invalid_request_error", Some("temperature"));
}

#[tokio::test]
async fn unknown_model_is_a_404_envelope() {
    let (status, _, body) = call(state(), post(chat(json!({"model": "gpt-4o"})).to_string())).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_envelope(&body, "invalid_request_error", Some("model"));
    assert_eq!(body["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn bad_parameter_is_a_400_naming_it() {
    let (status, _, body) = call(state(), post(chat(json!({"temperature": 5})).to_string())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_envelope(&body, "invalid_request_error", Some("temperature"));
}

#[tokio::test]
async fn unknown_fields_are_ignored() {
    let _engine = generating().await;
    let body = chat(json!({
        "model": "default",
        "max_tokens": 1,
        "tools": [],
        "response_format": {"type": "text"},
        "some_future_field": {"nested": [1, 2, 3]},
    }));
    let (status, _, body) = call(state(), post(body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], MODEL_ID);
    assert_eq!(body["usage"]["completion_tokens"], 1);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn oversize_body_is_a_413_envelope() {
    let small = AppState::new(engine().clone(), 1024);
    let body = chat(json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]}));
    let (status, headers, body) = call(small, post(body.to_string())).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_envelope(&body, "invalid_request_error", None);
    assert!(headers.contains_key("x-request-id"));
}

#[tokio::test]
async fn a_client_that_disconnects_frees_the_engine() {
    let _engine = generating().await;
    let stats = engine().stats();
    let decoded_before = stats.decode_tokens.load(Ordering::Relaxed);
    let addr = testkit::serve(state()).await;
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&endless(true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    let mut body = response.bytes_stream();
    let mut received = String::new();
    while received.matches("\"content\"").count() < 6 {
        let bytes = body.next().await.expect("the stream goes on").unwrap();
        received.push_str(&String::from_utf8_lossy(&bytes));
    }
    assert!(!received.contains("finish_reason\":\""), "{received}");
    assert_eq!(stats.running.load(Ordering::Relaxed), 1);
    drop(body);

    wait_until_idle().await;
    assert_cancelled(decoded_before);
}

#[tokio::test]
async fn a_client_that_gives_up_on_a_whole_answer_frees_the_engine() {
    let _engine = generating().await;
    let stats = engine().stats();
    let decoded_before = stats.decode_tokens.load(Ordering::Relaxed);
    let addr = testkit::serve(state()).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let result = impatient
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&endless(false))
        .send()
        .await;
    assert!(result.unwrap_err().is_timeout());
    wait_until_idle().await;
    assert_cancelled(decoded_before);
}

#[tokio::test]
async fn edge_sampling_values_answer_and_leave_the_engine_serving() {
    let _engine = generating().await;
    // Each passes validation; 1e-40 once turned every weight into NaN and killed the engine.
    for extra in [
        json!({"temperature": 1e-40, "max_tokens": 4}),
        json!({"temperature": 1e-40, "top_p": 1e-40, "min_p": 1e-40, "max_tokens": 4}),
        json!({"temperature": 2, "repetition_penalty": 1e-300, "presence_penalty": -2, "max_tokens": 4}),
        json!({"temperature": 1, "repetition_penalty": 1e308, "frequency_penalty": 2, "max_tokens": 4}),
    ] {
        let mut request = chat(extra.clone());
        // Sampled at temperature 2, an early end-of-sequence would be a fair answer too.
        request["ignore_eos"] = json!(true);
        let (status, _, body) = call(state(), post(request.to_string())).await;
        assert_eq!(status, StatusCode::OK, "{extra}: {body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length", "{extra}");
    }
    assert!(engine().is_running());
    let request = Request::get("/health").body(Body::empty()).unwrap();
    assert_eq!(call(state(), request).await.0, StatusCode::OK);
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_is_a_408_and_the_server_stays_fast() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = gateway::ServeConfig {
        body_read_timeout_secs: 0.5,
        ..gateway::ServeConfig::default()
    };
    let addr = testkit::serve(AppState::configured(engine().clone(), &config)).await;
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    let started = std::time::Instant::now();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 1000\r\n\r\n{\"model\": ",
    )
    .await
    .unwrap();
    // Meanwhile the server answers others at once.
    let health = reqwest::get(format!("http://{addr}/health")).await.unwrap();
    assert_eq!(health.status(), 200);
    let mut answer = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), slow.read(&mut answer))
        .await
        .expect("the server answers a stalled body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn health_is_ok() {
    let request = Request::get("/health").body(Body::empty()).unwrap();
    let (status, headers, body) = call(state(), request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, json!({"status": "ok"}));
    let id = headers["x-request-id"].to_str().unwrap();
    assert_eq!(id.len(), 36, "a generated UUID: {id}");
}

#[tokio::test]
async fn unknown_routes_and_methods_keep_the_envelope() {
    let request = Request::get("/v1/nothing").body(Body::empty()).unwrap();
    let (status, _, body) = call(state(), request).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_envelope(&body, "invalid_request_error", None);
    assert_eq!(body["error"]["code"], "unknown_url");

    let request = Request::get("/v1/chat/completions")
        .body(Body::empty())
        .unwrap();
    let (status, _, body) = call(state(), request).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_envelope(&body, "invalid_request_error", None);
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn post_to(path: &str, body: Value) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

#[tokio::test]
async fn ready_and_models_name_the_served_model() {
    let (status, _, body) = call(state(), get("/ready")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["status"], "ready");
    let (status, _, body) = call(state(), get("/v1/models")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], MODEL_ID);
    assert_eq!(body["data"][0]["object"], "model");
    assert!(body["data"][0]["created"].as_u64().unwrap() > 1_700_000_000);
}

#[tokio::test]
async fn n_answers_are_independent_and_reproducible() {
    let _engine = generating().await;
    let body = chat(json!({
        "messages": [{"role": "user", "content": "Invent a name for a pet dragon."}],
        "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12,
    }));
    let (status, _, first) = call(state(), post(body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let texts = |answer: &Value| -> Vec<String> {
        answer["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["message"]["content"].as_str().unwrap().to_owned()
            })
            .collect()
    };
    let (_, _, again) = call(state(), post(body.to_string())).await;
    assert_eq!(texts(&first).len(), 3);
    assert_eq!(texts(&first), texts(&again), "same seed, same answers");
    assert!(
        texts(&first)[0] != texts(&first)[1] || texts(&first)[1] != texts(&first)[2],
        "each answer has its own seed: {:?}",
        texts(&first)
    );
    let usage = &first["usage"];
    let completion: u64 = usage["completion_tokens"].as_u64().unwrap();
    assert!(completion > 12 && completion <= 36, "{usage}");
    let mut one = body.clone();
    one["n"] = json!(1);
    let (_, _, one) = call(state(), post(one.to_string())).await;
    assert_eq!(
        usage["prompt_tokens"], one["usage"]["prompt_tokens"],
        "the prompt counts once"
    );
    wait_until_idle().await;
}

#[tokio::test]
async fn completions_echo_and_report_legacy_logprobs() {
    let _engine = generating().await;
    let prompt = "The capital of France is";
    let body = json!({
        "model": MODEL_ID, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "logprobs": 2,
    });
    let (status, _, plain) = call(state(), post_to("/v1/completions", body.clone())).await;
    assert_eq!(status, StatusCode::OK, "{plain}");
    assert_eq!(plain["object"], "text_completion");
    assert!(plain["id"].as_str().unwrap().starts_with("cmpl-"));
    let choice = &plain["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    let logprobs = &choice["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    assert_eq!(tokens.len() as u64, plain["usage"]["completion_tokens"]);
    for key in ["token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(
            logprobs[key].as_array().unwrap().len(),
            tokens.len(),
            "{key}"
        );
    }
    assert_eq!(logprobs["text_offset"][0], 0);
    let top = logprobs["top_logprobs"][0].as_object().unwrap();
    assert!(top.len() <= 2 && top.contains_key(tokens[0].as_str().unwrap()));

    let mut echo = body;
    echo["echo"] = json!(true);
    let (_, _, echoed) = call(state(), post_to("/v1/completions", echo)).await;
    assert_eq!(echoed["choices"][0]["text"], format!("{prompt}{text}"));
    let logprobs = &echoed["choices"][0]["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let prompt_tokens = echoed["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(
        tokens[..prompt_tokens].concat(),
        prompt,
        "the prompt's tokens come first"
    );
    assert_eq!(logprobs["token_logprobs"][0], Value::Null);
    assert_eq!(logprobs["top_logprobs"][0], Value::Null);
    assert!(logprobs["token_logprobs"][1].as_f64().unwrap() < 0.0);
    assert_eq!(logprobs["text_offset"][prompt_tokens], prompt.len());
    assert_eq!(
        logprobs["token_logprobs"].as_array().unwrap()[prompt_tokens..],
        plain["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[..],
        "the answer's log-probabilities do not change with echo"
    );
    wait_until_idle().await;
}

#[tokio::test]
async fn completions_without_max_tokens_stop_at_16_and_the_operator_caps_every_route() {
    let _engine = generating().await;
    let body = json!({"model": MODEL_ID, "prompt": "Once upon a time", "ignore_eos": true});
    let (status, _, answer) = call(state(), post_to("/v1/completions", body)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 16, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");

    let config = gateway::config::ServeConfig {
        max_tokens_limit: Some(8),
        default_max_tokens: Some(3),
        ..Default::default()
    };
    let capped = || AppState::configured(engine().clone(), &config);
    let (status, _, answer) = call(
        capped(),
        post(chat(json!({"ignore_eos": true})).to_string()),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "max_tokens 40 is over the limit"
    );
    assert_envelope(&answer, "invalid_request_error", Some("max_tokens"));
    let mut unbounded = chat(json!({"ignore_eos": true}));
    unbounded.as_object_mut().unwrap().remove("max_tokens");
    let (status, _, answer) = call(capped(), post(unbounded.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 3, "the chat default");
    let over = json!({"model": MODEL_ID, "prompt": "a", "max_tokens": 9});
    let (status, _, answer) = call(capped(), post_to("/v1/completions", over)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_envelope(&answer, "invalid_request_error", Some("max_tokens"));
    let over = json!({"model": MODEL_ID, "input": "Hi", "max_output_tokens": 9});
    let (status, _, answer) = call(capped(), post_to("/v1/responses", over)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert_envelope(&answer, "invalid_request_error", Some("max_output_tokens"));
    wait_until_idle().await;
}

#[tokio::test]
async fn completions_stream_every_choice_then_usage() {
    let _engine = generating().await;
    let addr = testkit::serve(state()).await;
    let body = json!({
        "model": MODEL_ID, "prompt": ["One, two,", "Red, green,"], "max_tokens": 5,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
    });
    let text = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 10, "{usage}");
    let (_, _, whole) = call(
        state(),
        post_to(
            "/v1/completions",
            json!({"model": MODEL_ID, "prompt": ["One, two,", "Red, green,"], "max_tokens": 5, "temperature": 0}),
        ),
    )
    .await;
    for index in 0..2 {
        let streamed: String = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == index)
            .map(|c| c["text"].as_str().unwrap())
            .collect();
        assert_eq!(streamed, whole["choices"][index]["text"], "choice {index}");
        let last = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .rfind(|c| c["index"] == index)
            .unwrap();
        assert_eq!(last["finish_reason"], "length");
    }
    wait_until_idle().await;
}

#[tokio::test]
async fn serves_its_openapi_spec_and_docs_page() {
    let response = app(state()).oneshot(get("/openapi.json")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(body, include_str!("../../openapi/openapi.json").as_bytes());
    let response = app(state()).oneshot(get("/docs")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&body).contains("/openapi.json"));
}

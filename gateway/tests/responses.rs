//! The Responses API end to end on the real model: `app()` driven in process, and real servers
//! on `127.0.0.1:0` for streaming and for two replicas sharing their stored responses in Redis.
//! Requests are greedy and short; the assertions are about shapes and guarantees (a forced call
//! is valid JSON with the schema's keys, events come in order and add up, a stored response is
//! chained, read, deleted and private to its key), not about what the small model says.

use axum::http::{Method, StatusCode};
use gateway::config::ServeConfig;
use gateway::AppState;
use serde_json::{json, Value};
use testkit::calls::call;
use testkit::{engine, generating, MODEL_ID, QUESTION};

/// The Redis `make test` starts (scripts/services.sh).
const REDIS: &str = "redis://127.0.0.1:6379";
const KEY: &str = "sk-responses-alpha";
const OTHER_KEY: &str = "sk-responses-beta";

/// A server state with `config` (validated).
fn state(config: ServeConfig) -> AppState {
    config.validate().expect("a valid test config");
    AppState::configured(engine().clone(), &config)
}

/// A request for `input`, greedy and short, with `extra` fields.
fn create(input: Value, extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_ID,
        "input": input,
        "temperature": 0,
        "max_output_tokens": 24,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// Posts `body` to `/v1/responses`; the answer must be a 200.
async fn respond(state: &AppState, body: &Value, key: Option<&str>) -> Value {
    let (status, response) = call(
        state,
        Method::POST,
        "/v1/responses",
        key,
        Some(body.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{response}");
    response
}

/// The text of a response's message items, as the SDKs' `output_text` reads it.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap())
        .filter(|part| part["type"] == "output_text")
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

/// Asserts `body` is OpenAI's 404 envelope naming `param`.
fn assert_not_found(status: StatusCode, body: &Value, param: Option<&str>) {
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["param"].as_str(), param, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("not found")));
}

#[tokio::test]
async fn a_text_input_is_answered_stored_read_and_deleted() {
    let state = state(ServeConfig::default());
    let _engine = generating().await;
    let body = create(json!(QUESTION), json!({"metadata": {"suite": "responses"}}));
    let response = respond(&state, &body, None).await;

    let id = response["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"), "{response}");
    assert_eq!(response["object"], "response");
    assert_eq!(response["model"], MODEL_ID);
    assert!(
        ["completed", "incomplete"].contains(&response["status"].as_str().unwrap()),
        "{response}"
    );
    let item = &response["output"][0];
    assert_eq!(item["type"], "message");
    assert_eq!(item["role"], "assistant");
    assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    assert!(output_text(&response).contains("Paris"), "{response}");
    let usage = &response["usage"];
    let (input, output) = (
        usage["input_tokens"].as_u64().unwrap(),
        usage["output_tokens"].as_u64().unwrap(),
    );
    assert!(input > 10 && output > 0 && output <= 24, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), input + output);
    assert_eq!(response["metadata"], json!({"suite": "responses"}));
    assert_eq!(response["store"], true);
    assert_eq!(response["text"], json!({"format": {"type": "text"}}));

    let path = format!("/v1/responses/{id}");
    let (status, stored) = call(&state, Method::GET, &path, None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stored, response, "read back as it was answered");
    let (status, deleted) = call(&state, Method::DELETE, &path, None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        deleted,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    for method in [Method::GET, Method::DELETE] {
        let (status, body) = call(&state, method, &path, None, None).await;
        assert_not_found(status, &body, None);
    }

    let unstored = create(json!("Hi"), json!({"store": false, "max_output_tokens": 2}));
    let response = respond(&state, &unstored, None).await;
    assert_eq!(response["store"], false);
    let path = format!("/v1/responses/{}", response["id"].as_str().unwrap());
    let (status, body) = call(&state, Method::GET, &path, None, None).await;
    assert_not_found(status, &body, None);
}

#[tokio::test]
async fn a_required_function_tool_gives_a_function_call_item() {
    let state = state(ServeConfig::default());
    let _engine = generating().await;
    let parameters = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
        },
        "required": ["city", "unit"],
        "additionalProperties": false
    });
    let body = create(
        json!("What is the weather in Paris? Use the get_weather tool."),
        json!({
            "tools": [{"type": "function", "name": "get_weather",
                       "description": "The current weather in a city.",
                       "parameters": parameters}],
            "tool_choice": "required",
            "parallel_tool_calls": false,
            "max_output_tokens": 64,
        }),
    );
    let response = respond(&state, &body, None).await;
    assert_eq!(response["status"], "completed", "{response}");
    let output = response["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{response}");
    let function_call = &output[0];
    assert_eq!(function_call["type"], "function_call");
    assert_eq!(function_call["name"], "get_weather");
    assert_eq!(function_call["status"], "completed");
    assert!(function_call["call_id"]
        .as_str()
        .unwrap()
        .starts_with("call_"));
    assert!(function_call["id"].as_str().unwrap().starts_with("fc_"));
    let arguments: Value =
        serde_json::from_str(function_call["arguments"].as_str().unwrap()).unwrap();
    let arguments = arguments.as_object().unwrap();
    assert!(
        arguments.contains_key("city") && arguments.contains_key("unit"),
        "{arguments:?}"
    );
    assert_eq!(response["tools"][0]["strict"], true, "strict by default");
    assert_eq!(response["tool_choice"], "required");

    // The call answered: its output goes back as an item, and the model answers in text.
    let turn = create(
        json!([
            {"role": "user", "content": "What is the weather in Paris?"},
            function_call,
            {"type": "function_call_output", "call_id": function_call["call_id"],
             "output": "{\"temperature\": 22, \"sky\": \"sunny\"}"}
        ]),
        json!({"tools": body["tools"], "tool_choice": "none"}),
    );
    let answered = respond(&state, &turn, None).await;
    assert_eq!(answered["output"][0]["type"], "message", "{answered}");
    assert!(!output_text(&answered).trim().is_empty(), "{answered}");
}

#[tokio::test]
async fn a_stream_sends_events_in_order_that_add_up() {
    let addr = testkit::serve(state(ServeConfig::default())).await;
    let _engine = generating().await;
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/responses"))
        .json(&create(json!(QUESTION), json!({"stream": true})))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    let body = response.text().await.unwrap();
    assert!(!body.contains("[DONE]"), "no sentinel: {body}");
    let mut events: Vec<Value> = Vec::new();
    for frame in body.split("\n\n").filter(|f| f.contains("data:")) {
        let field = |name: &str| {
            frame
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .map(str::trim_start)
                .unwrap_or_else(|| panic!("no {name} in {frame:?}"))
        };
        let data: Value = serde_json::from_str(field("data:")).unwrap();
        assert_eq!(data["type"], field("event:"), "the event names its data");
        events.push(data);
    }
    let numbers: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let (last, rest) = types.split_last().unwrap();
    assert_eq!(
        rest[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        rest[rest.len() - 3..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done"
        ]
    );
    assert!(rest[4..rest.len() - 3]
        .iter()
        .all(|t| *t == "response.output_text.delta"));
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    let final_response = &events.last().unwrap()["response"];
    assert_eq!(
        *last,
        format!("response.{}", final_response["status"].as_str().unwrap())
    );
    assert_eq!(final_response["id"], events[0]["response"]["id"]);
    assert_eq!(deltas, output_text(final_response));
    assert!(deltas.contains("Paris"), "{deltas:?}");
    assert_eq!(events[rest.len() - 3]["text"], deltas.as_str());
    assert!(final_response["usage"]["output_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn previous_response_id_chains_and_stays_with_its_key() {
    let state = state(ServeConfig {
        api_keys: vec![KEY.parse().unwrap(), OTHER_KEY.parse().unwrap()],
        ..ServeConfig::default()
    });
    let _engine = generating().await;
    let first = respond(
        &state,
        &create(json!("My name is Alice. Say hello to me."), json!({})),
        Some(KEY),
    )
    .await;
    let follow_up = "What is my name?";
    let chained_body = create(
        json!(follow_up),
        json!({"previous_response_id": first["id"]}),
    );
    let chained = respond(&state, &chained_body, Some(KEY)).await;
    let alone = respond(&state, &create(json!(follow_up), json!({})), Some(KEY)).await;
    assert_eq!(chained["previous_response_id"], first["id"]);
    let tokens = |r: &Value, field: &str| r["usage"][field].as_u64().unwrap();
    assert!(
        tokens(&chained, "input_tokens")
            > tokens(&alone, "input_tokens") + tokens(&first, "output_tokens"),
        "the first turn and its answer go before the follow-up: {chained} {alone}"
    );
    // Chained from a chained response, the whole conversation comes along.
    let third = respond(
        &state,
        &create(
            json!("Thanks."),
            json!({"previous_response_id": chained["id"], "max_output_tokens": 2}),
        ),
        Some(KEY),
    )
    .await;
    assert!(tokens(&third, "input_tokens") > tokens(&chained, "input_tokens"));

    // Another key sees none of it.
    let path = format!("/v1/responses/{}", first["id"].as_str().unwrap());
    let (status, body) = call(&state, Method::GET, &path, Some(OTHER_KEY), None).await;
    assert_not_found(status, &body, None);
    let (status, body) = call(
        &state,
        Method::POST,
        "/v1/responses",
        Some(OTHER_KEY),
        Some(chained_body.clone()),
    )
    .await;
    assert_not_found(status, &body, Some("previous_response_id"));
    let unknown = create(json!("Hi"), json!({"previous_response_id": "resp_unknown"}));
    let (status, body) = call(
        &state,
        Method::POST,
        "/v1/responses",
        Some(KEY),
        Some(unknown),
    )
    .await;
    assert_not_found(status, &body, Some("previous_response_id"));
}

#[tokio::test]
async fn replicas_sharing_redis_read_each_other_s_responses() {
    let replica = || {
        testkit::serve(state(ServeConfig {
            redis: Some(REDIS.into()),
            ..ServeConfig::default()
        }))
    };
    let (a, b) = (replica().await, replica().await);
    let _engine = generating().await;
    let client = reqwest::Client::new();
    let response: Value = client
        .post(format!("http://{a}/v1/responses"))
        .json(&create(json!("Hi"), json!({"max_output_tokens": 4})))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let url = format!(
        "http://{b}/v1/responses/{}",
        response["id"].as_str().unwrap()
    );
    let read: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(read, response);
    let deleted = client.delete(&url).send().await.unwrap();
    assert_eq!(deleted.status(), reqwest::StatusCode::OK);
    let gone = client.get(&url).send().await.unwrap();
    assert_eq!(gone.status(), reqwest::StatusCode::NOT_FOUND);
}

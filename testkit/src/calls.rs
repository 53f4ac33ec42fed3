//! One request through `app()` in process, as a client with an optional key sends it.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use gateway::{app, AppState};
use serde_json::Value;
use tower::ServiceExt;

/// Sends `method path` (with `key` as a bearer key and `body` as JSON, when given) and returns
/// the status and the JSON answer.
pub async fn call(
    state: &AppState,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut request = Request::builder().method(method).uri(path);
    if let Some(key) = key {
        request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let request = match body {
        Some(body) => request
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string())),
        None => request.body(Body::empty()),
    }
    .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// The `id` of every item of a list answer's `data` (`/v1/models`, `/v1/agents`), in order.
pub fn ids(list: &Value) -> Vec<&str> {
    let items = list["data"].as_array().expect("a list answer");
    items
        .iter()
        .map(|item| item["id"].as_str().unwrap())
        .collect()
}

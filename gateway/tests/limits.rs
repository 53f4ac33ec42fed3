//! Keys, rate limits, the admission queue, timeouts and metrics, end to end on the real model:
//! `app()` driven in process with `oneshot`, and a real server on `127.0.0.1:0` for bursts and
//! streams.
//!
//! One engine serves the whole file. Tests that make it generate take [`generating`], so that
//! a burst in one test cannot starve another's deadline, and the engine is idle when a test
//! checks that a timed-out request freed it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use engine::{EngineConfig, EngineHandle};
use gateway::config::ServeConfig;
use gateway::{app, AppState};
use serde_json::{json, Value};
use tower::ServiceExt;

const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";
const KEY: &str = "sk-test-alpha";
const OTHER_KEY: &str = "sk-test-beta";

fn engine_config() -> EngineConfig {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(format!("{MODEL_ID}.gguf"));
    assert!(
        model.is_file(),
        "{} is missing: run `make models`",
        model.display()
    );
    EngineConfig {
        model,
        kv_cache_mb: 64,
        ..EngineConfig::default()
    }
}

fn engine() -> &'static EngineHandle {
    static ENGINE: LazyLock<EngineHandle> =
        LazyLock::new(|| EngineHandle::start(&engine_config()).expect("the engine starts"));
    &ENGINE
}

fn state(config: ServeConfig) -> AppState {
    state_on(engine().clone(), config)
}

fn state_on(engine: EngineHandle, config: ServeConfig) -> AppState {
    config.validate().expect("a valid test config");
    AppState::configured(engine, &config)
}

fn with_keys() -> ServeConfig {
    ServeConfig {
        api_keys: vec![KEY.parse().unwrap(), OTHER_KEY.parse().unwrap()],
        ..ServeConfig::default()
    }
}

/// Held by every test that makes the engine generate.
async fn generating() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// A short chat that generates at most `max_tokens` tokens.
fn chat(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

fn post(path: &str, key: Option<&str>, body: &Value) -> Request<Body> {
    let mut request = Request::post(path).header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    request.body(Body::from(body.to_string())).unwrap()
}

fn get(path: &str, key: Option<&str>) -> Request<Body> {
    let mut request = Request::get(path);
    if let Some(key) = key {
        request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
    }
    request.body(Body::empty()).unwrap()
}

/// Sends `request` through `app` in process; returns status, headers and the body as text.
async fn call(state: &AppState, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
}

/// Asserts `body` is OpenAI's error envelope with this `type` and `code`.
fn assert_envelope(body: &str, kind: &str, code: &str) {
    let body: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(error["type"], kind, "{body}");
    assert_eq!(error["code"], code, "{body}");
    assert!(error.as_object().unwrap().contains_key("param"), "{body}");
}

/// Waits, at most 5 s, until the engine runs nothing and no sequence holds a KV block.
async fn wait_until_idle() {
    let stats = engine().stats();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let running = stats.running.load(Ordering::Relaxed);
        let waiting = stats.waiting.load(Ordering::Relaxed);
        let used = stats.kv().gauges.device_used;
        if running == 0 && waiting == 0 && used == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the engine still holds work: running={running} waiting={waiting} used={used}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `data:` payloads of an SSE body, in order.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: ").or(line.strip_prefix("data:")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn keys_are_required_except_on_probes_and_public_metrics() {
    let state = state(with_keys());
    let chat = chat(1, false);
    let (status, _, body) = call(&state, post("/v1/chat/completions", None, &chat)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_envelope(&body, "invalid_request_error", "invalid_api_key");
    let (status, _, body) =
        call(&state, post("/v1/chat/completions", Some("sk-nope"), &chat)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_envelope(&body, "invalid_request_error", "invalid_api_key");
    let (status, _, body) = call(&state, get("/nowhere", None)).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "unknown routes do not leak: {body}"
    );

    let (status, _, body) = call(&state, get("/health", None)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _, body) = call(&state, get("/metrics", None)).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "metrics take a key by default"
    );
    assert_envelope(&body, "invalid_request_error", "invalid_api_key");
    let (status, _, _) = call(&state, get("/metrics", Some(KEY))).await;
    assert_eq!(status, StatusCode::OK);
    let public = self::state(ServeConfig {
        metrics_public: true,
        ..with_keys()
    });
    let (status, _, _) = call(&public, get("/metrics", None)).await;
    assert_eq!(status, StatusCode::OK, "unless they are opened");

    let _engine = generating().await;
    let (status, _, body) = call(&state, post("/v1/chat/completions", Some(KEY), &chat)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _, body) =
        call(&state, post("/v1/chat/completions", Some(OTHER_KEY), &chat)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn a_key_finds_only_its_own_prompts_in_the_prefix_cache() {
    let state = state(with_keys());
    let _engine = generating().await;
    // Long enough for several full blocks, and unlike any other test's prompt.
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": format!(
            "Isolation probe {}: {}", uuid::Uuid::new_v4(), "a quiet sentence to cache. ".repeat(12)
        )}],
        "max_tokens": 1,
    });
    let cached = |key: &'static str| {
        let state = state.clone();
        let body = body.clone();
        async move {
            let (status, _, text) =
                call(&state, post("/v1/chat/completions", Some(key), &body)).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            let body: Value = serde_json::from_str(&text).unwrap();
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    // The chat template's default system prompt opens every prompt: a key may already hold its
    // first block from another test, but nothing of this prompt's own.
    let first = cached(KEY).await;
    let again = cached(KEY).await;
    assert!(
        again >= first + 32,
        "the same key finds its blocks: {first} then {again}"
    );
    let other = cached(OTHER_KEY).await;
    assert!(
        other + 32 <= again,
        "another key finds nothing of the first key's prompt: {other} against {again}"
    );
}

#[tokio::test]
async fn a_key_over_its_requests_per_minute_gets_429_with_retry_after() {
    let state = state(ServeConfig {
        rpm: 2,
        ..with_keys()
    });
    // Bodies that fail validation still count as requests, and cost no generation.
    let invalid = json!({"model": MODEL_ID, "messages": []});
    for _ in 0..2 {
        let (status, _, body) =
            call(&state, post("/v1/chat/completions", Some(KEY), &invalid)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
    let (status, headers, body) =
        call(&state, post("/v1/chat/completions", Some(KEY), &invalid)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_envelope(&body, "rate_limit_error", "rate_limit_exceeded");
    let retry_after: u64 = headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Two a minute: the next one is due within 30 s.
    assert!(
        (1..=30).contains(&retry_after),
        "Retry-After: {retry_after}"
    );

    let (status, _, body) = call(
        &state,
        post("/v1/chat/completions", Some(OTHER_KEY), &invalid),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "another key has its own budget: {body}"
    );
    let (status, _, _) = call(&state, get("/health", None)).await;
    assert_eq!(status, StatusCode::OK, "probes are not rate limited");
}

#[tokio::test]
async fn a_key_s_own_bounds_replace_the_server_s_for_it_alone() {
    let _engine = generating().await;
    // Keys with bounds come from the file, as an operator writes them.
    let limited: gateway::auth::ApiKey =
        serde_json::from_value(json!({"key": OTHER_KEY, "max_tokens": 4, "rpm": 3, "tpm": 0}))
            .unwrap();
    let state = state(ServeConfig {
        api_keys: vec![KEY.parse().unwrap(), limited],
        rpm: 100,
        tpm: 1,
        ..ServeConfig::default()
    });
    let over = chat(5, false);
    let (status, _, body) =
        call(&state, post("/v1/chat/completions", Some(OTHER_KEY), &over)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(error["error"]["param"], "max_tokens", "{body}");
    assert!(body.contains("at most 4"), "{body}");
    let mut unnamed = chat(0, false);
    unnamed.as_object_mut().unwrap().remove("max_tokens");
    unnamed["ignore_eos"] = json!(true);
    let (status, _, body) = call(
        &state,
        post("/v1/chat/completions", Some(OTHER_KEY), &unnamed),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "its own tpm (0: none) replaces the server's: {body}"
    );
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        answer["usage"]["completion_tokens"], 4,
        "its cap is its default too"
    );
    // The cap holds on every route; and the fourth request of the minute is over the key's own
    // rpm of 3.
    let completion = json!({"model": MODEL_ID, "prompt": "a", "max_tokens": 5});
    let (status, _, body) = call(
        &state,
        post("/v1/completions", Some(OTHER_KEY), &completion),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, _, body) = call(
        &state,
        post("/v1/completions", Some(OTHER_KEY), &completion),
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(body.contains("limit 3"), "{body}");

    // The other key has the server's bounds: no cap on max_tokens, a tpm of 1 (a request
    // larger than the quota empties a full bucket, so one goes through).
    let (status, _, body) = call(&state, post("/v1/chat/completions", Some(KEY), &over)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _, body) = call(&state, post("/v1/chat/completions", Some(KEY), &over)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(body.contains("tokens per minute (limit 1"), "{body}");
    wait_until_idle().await;
}

/// The Redis `make test` starts (scripts/services.sh).
const REDIS: &str = "redis://127.0.0.1:6379";

#[tokio::test]
async fn two_replicas_sharing_redis_share_a_key_s_limit() {
    // A key of its own, so buckets left in Redis by earlier runs do not count.
    let key = format!("sk-shared-{}", uuid::Uuid::new_v4());
    let replica = || {
        state(ServeConfig {
            api_keys: vec![key.parse().unwrap()],
            redis: Some(REDIS.into()),
            rpm: 20,
            ..ServeConfig::default()
        })
    };
    let replicas = [replica(), replica()];
    for replica in &replicas {
        let (status, _, body) = call(replica, get("/ready", None)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let _engine = generating().await;
    let mut answered = [0; 2];
    let mut limited = 0;
    // 40 requests, alternating replicas; the whole run takes far less than the 3 s the
    // bucket needs to refill one request.
    for i in 0..40 {
        let (status, _, body) = call(
            &replicas[i % 2],
            post("/v1/chat/completions", Some(&key), &chat(1, false)),
        )
        .await;
        match status {
            StatusCode::OK => answered[i % 2] += 1,
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("{other}: {body}"),
        }
    }
    assert_eq!(
        answered[0] + answered[1],
        20,
        "answered per replica: {answered:?}"
    );
    assert_eq!(
        answered,
        [10, 10],
        "the first 20 pass, whichever replica takes them"
    );
    assert_eq!(limited, 20);
}

#[tokio::test]
async fn an_unreachable_redis_is_a_clear_503_and_the_server_stays_up() {
    // Nothing listens on port 1.
    let state = state(ServeConfig {
        redis: Some("redis://127.0.0.1:1".into()),
        rpm: 10,
        ..ServeConfig::default()
    });
    let (status, _, body) = call(&state, post("/v1/chat/completions", None, &chat(1, false))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_envelope(&body, "server_error", "state_store_unavailable");
    let (status, _, body) = call(&state, get("/ready", None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_envelope(&body, "server_error", "state_store_unavailable");
    let (status, _, _) = call(&state, get("/health", None)).await;
    assert_eq!(status, StatusCode::OK, "the process is alive");
}

#[tokio::test]
async fn a_burst_beyond_the_queue_is_shed_with_503_and_the_rest_complete() {
    let _engine = generating().await;
    let state = state(ServeConfig {
        max_concurrent_requests: 2,
        max_queued_requests: 2,
        ..ServeConfig::default()
    });
    let addr = testkit::serve(state).await;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let burst = (0..100).map(|_| {
        let request = client.post(&url).json(&chat(8, false)).send();
        async move {
            let response = request.await.expect("every request gets an answer");
            let status = response.status().as_u16();
            let retry_after = response.headers().get(header::RETRY_AFTER).cloned();
            let body = response.text().await.unwrap();
            (status, retry_after, body)
        }
    });
    let answers = tokio::time::timeout(Duration::from_secs(180), futures::future::join_all(burst))
        .await
        .expect("the burst must not hang");
    let mut by_status: HashMap<u16, usize> = HashMap::new();
    for (status, retry_after, body) in &answers {
        *by_status.entry(*status).or_default() += 1;
        match status {
            200 => {
                let body: Value = serde_json::from_str(body).unwrap();
                assert!(body["choices"][0]["finish_reason"].is_string(), "{body}");
            }
            503 => {
                assert_envelope(body, "server_error", "overloaded");
                assert!(retry_after.is_some(), "503 without Retry-After");
            }
            429 => assert_envelope(body, "rate_limit_error", "rate_limit_exceeded"),
            other => panic!("{other}: {body}"),
        }
    }
    let admitted = by_status.get(&200).copied().unwrap_or(0);
    let shed = by_status.get(&503).copied().unwrap_or(0);
    assert!(
        admitted >= 4,
        "2 running and 2 queued must complete: {by_status:?}"
    );
    assert!(
        shed >= 1,
        "100 at once through 4 places must shed some: {by_status:?}"
    );

    // Every slot and place in line came back: the queue admits again at once.
    let response = client
        .post(&url)
        .json(&chat(1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    wait_until_idle().await;
}

#[tokio::test]
async fn requests_are_admitted_by_their_sequences_so_the_engine_takes_each() {
    let _engine = generating().await;
    // An engine that takes 4 sequences, and a gateway admitting 4 at once, `n` counted.
    let engine_config = EngineConfig {
        max_queued: 4,
        ..engine_config()
    };
    let config = ServeConfig {
        max_concurrent_requests: 4,
        engine: engine_config.clone(),
        ..ServeConfig::default()
    };
    let state = state_on(EngineHandle::start(&engine_config).unwrap(), config);
    let addr = testkit::serve(state.clone()).await;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let with_n = |n: u32| {
        let mut body = chat(4, false);
        body["n"] = json!(n);
        body["temperature"] = json!(0.7);
        client.post(&url).json(&body).send()
    };
    // Nine sequences at once through four seats: they queue, and the engine refuses none.
    let answers = futures::future::join_all([with_n(4), with_n(1), with_n(4)]).await;
    for (answer, n) in answers.into_iter().zip([4, 1, 4]) {
        let answer = answer.unwrap();
        let status = answer.status();
        let body: Value = answer.json().await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"].as_array().unwrap().len(), n, "{body}");
    }
    // More sequences than the server ever admits at once can never run.
    let answer = with_n(5).await.unwrap();
    assert_eq!(answer.status(), 400);
    let body: Value = answer.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
}

#[tokio::test]
async fn no_first_token_in_time_is_a_504_and_frees_the_engine() {
    let _engine = generating().await;
    let state = state(ServeConfig {
        first_token_timeout_secs: 0.001,
        ..ServeConfig::default()
    });
    for stream in [false, true] {
        let request = post("/v1/chat/completions", None, &chat(64, stream));
        let (status, headers, body) = call(&state, request).await;
        assert_eq!(
            status,
            StatusCode::GATEWAY_TIMEOUT,
            "stream={stream}: {body}"
        );
        assert_eq!(
            headers[header::CONTENT_TYPE],
            "application/json",
            "before any SSE header"
        );
        assert_envelope(&body, "server_error", "timeout");
    }
    wait_until_idle().await;
}

#[tokio::test]
async fn a_stream_past_its_total_deadline_ends_with_an_error_chunk() {
    let _engine = generating().await;
    let state = state(ServeConfig {
        request_timeout_secs: 3.0,
        ..ServeConfig::default()
    });
    // Left alone this runs until the KV cache is full.
    let endless = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Count from 1 to 10000."}],
        "stream": true,
        "ignore_eos": true,
    });
    let started = Instant::now();
    let (status, _, body) = call(&state, post("/v1/chat/completions", None, &endless)).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the first token came in time: {body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut at the deadline"
    );
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "error", "{last}");
    assert_eq!(last["error"]["code"], "timeout", "{last}");
    assert!(
        data.len() > 3,
        "tokens streamed before the deadline: {data:?}"
    );
    wait_until_idle().await;
}

/// The samples of a text exposition, by series (`name{labels}`), comments dropped.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("`series value`");
            (series.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

#[tokio::test]
async fn metrics_expose_the_families_and_count_traffic() {
    let state = state(with_keys());
    let scrape = || async {
        let (status, headers, body) = call(&state, get("/metrics", Some(KEY))).await;
        assert_eq!(status, StatusCode::OK);
        assert!(headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain"));
        body
    };
    let answered = r#"swarmgate_http_requests_total{route="/v1/chat/completions",status="200"}"#;
    let before = samples(&scrape().await);
    assert_eq!(
        before.get(answered),
        None,
        "a fresh state has counted nothing"
    );

    let (status, _, _) = call(&state, post("/v1/chat/completions", None, &chat(1, false))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let invalid = json!({"model": MODEL_ID, "messages": []});
    let (status, _, _) = call(&state, post("/v1/chat/completions", Some(KEY), &invalid)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    {
        let _engine = generating().await;
        let request = post("/v1/chat/completions", Some(KEY), &chat(8, true));
        let (status, _, body) = call(&state, request).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }

    let text = scrape().await;
    let after = samples(&text);
    let value = |series: &str| {
        *after
            .get(series)
            .unwrap_or_else(|| panic!("{series} is missing from:\n{text}"))
    };
    assert_eq!(value(answered), 1.0);
    assert_eq!(
        value(r#"swarmgate_http_requests_total{route="/v1/chat/completions",status="401"}"#),
        1.0
    );
    assert!(value(r#"swarmgate_http_requests_total{route="/metrics",status="200"}"#) >= 1.0);
    assert_eq!(value(r#"swarmgate_rejections_total{reason="auth"}"#), 1.0);
    assert_eq!(
        value(r#"swarmgate_rejections_total{reason="invalid"}"#),
        1.0
    );
    for histogram in [
        "swarmgate_request_duration_seconds",
        "swarmgate_time_to_first_token_seconds",
        "swarmgate_inter_token_latency_seconds",
        "swarmgate_queue_time_seconds",
    ] {
        assert!(value(&format!("{histogram}_count")) >= 1.0, "{histogram}");
        assert!(
            text.contains(&format!("# TYPE {histogram} histogram")),
            "{histogram} is a histogram"
        );
        assert!(
            text.contains(&format!("# HELP {histogram} ")),
            "{histogram} is described"
        );
        assert!(after.contains_key(&format!(r#"{histogram}_bucket{{le="+Inf"}}"#)));
    }
    assert!(value("swarmgate_prompt_tokens_total") > 0.0);
    let generated = value("swarmgate_generation_tokens_total");
    assert!((1.0..=8.0).contains(&generated), "{generated}");
    value("swarmgate_running_sequences");
    value("swarmgate_waiting_sequences");
    for (tier, states) in [
        ("device", &["free", "used", "cached", "pinned"][..]),
        ("host", &["free", "cached", "swapped"][..]),
    ] {
        for state in states {
            value(&format!(
                r#"swarmgate_kv_blocks{{tier="{tier}",state="{state}"}}"#
            ));
        }
    }
    assert!(value(r#"swarmgate_kv_blocks{tier="device",state="free"}"#) > 0.0);
    assert!(value("swarmgate_prefix_cache_queries_tokens_total") > 0.0);
    for series in [
        r#"swarmgate_prefix_cache_hits_tokens_total{tier="device"}"#,
        r#"swarmgate_prefix_cache_hits_tokens_total{tier="host"}"#,
        r#"swarmgate_kv_swaps_total{direction="out"}"#,
        r#"swarmgate_kv_swaps_total{direction="in"}"#,
        r#"swarmgate_kv_evictions_total{tier="device"}"#,
        r#"swarmgate_kv_evictions_total{tier="host"}"#,
        "swarmgate_kv_recomputes_total",
    ] {
        value(series);
    }
}

//! `/v1/agents` end to end, in process through `app()` on the real models: agents listed and
//! described, in `/v1/models`; edits guarded by admin keys; an agent added at run time is
//! pinned (the engine's pinned-block gauge grows by its prompt's full blocks), routed to, and
//! answers from its pinned prefix; removed, it is gone from routing and its blocks unpinned;
//! refused edits say why and change nothing.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use engine::Embedder;
use engine::{EngineConfig, EngineHandle};
use gateway::Swarm;
use gateway::{AppState, ServeConfig};
use router::SwarmConfig;
use serde_json::{json, Value};
use testkit::calls::{call, ids};
use testkit::{models, root, MODEL_ID};

const USER_KEY: &str = "sk-user";
const ADMIN_KEY: &str = "sk-admin";
/// The engine's KV block size (its default).
const BLOCK: u64 = 16;

/// This binary's engine: a KV cache of the size a server would have, so that every agent's
/// prompt fits in the pinned share.
fn engine() -> &'static EngineHandle {
    static ENGINE: LazyLock<EngineHandle> = LazyLock::new(|| {
        EngineHandle::start(&EngineConfig {
            model: models().join(format!("{MODEL_ID}.gguf")),
            kv_cache_mb: 512,
            ..EngineConfig::default()
        })
        .expect("the engine starts (run `make models`)")
    });
    &ENGINE
}

/// A swarm of its own per test (the shipped `swarm.toml`, prompts pinned), sharing one embedder.
async fn swarm() -> Swarm {
    static EMBEDDER: LazyLock<Arc<Embedder>> = LazyLock::new(testkit::embedder);
    let config = SwarmConfig::load(&root().join("swarm.toml")).unwrap();
    let swarm = Swarm::new(config, engine().clone(), Some(EMBEDDER.clone())).unwrap();
    swarm.prepare().await.unwrap();
    swarm.pin_prompts().await.unwrap();
    swarm
}

/// A server with a user key and an admin key, or with neither when `keys` is false.
async fn server(keys: bool) -> AppState {
    let config = if keys {
        keyed()
    } else {
        ServeConfig::default()
    };
    serving(config).await
}

/// The default settings with a user key and an admin key.
fn keyed() -> ServeConfig {
    ServeConfig {
        api_keys: vec![USER_KEY.parse().unwrap()],
        admin_keys: vec![ADMIN_KEY.parse().unwrap()],
        ..ServeConfig::default()
    }
}

async fn serving(config: ServeConfig) -> AppState {
    AppState::configured(engine().clone(), &config).with_swarm(swarm().await)
}

async fn post(state: &AppState, key: Option<&str>, agent: Value) -> (StatusCode, Value) {
    call(state, Method::POST, "/v1/agents", key, Some(agent)).await
}

async fn delete(state: &AppState, key: Option<&str>, path: &str) -> (StatusCode, Value) {
    call(state, Method::DELETE, path, key, None).await
}

/// The error envelope's code and param, asserting the status.
fn refusal(answer: (StatusCode, Value), status: StatusCode) -> (String, Value) {
    assert_eq!(answer.0, status, "{}", answer.1);
    let error = &answer.1["error"];
    (
        error["code"].as_str().unwrap_or("").to_owned(),
        error["param"].clone(),
    )
}

fn gardener() -> Value {
    json!({
        "name": "gardener",
        "description": "Gardening help: growing vegetables, flowers and trees, watering, soil, \
            compost, pruning, pests and plant diseases.",
        "routing_examples": [
            "When should I plant garlic bulbs for next summer?",
            "My rose leaves have black spots, what should I spray?",
            "How do I start a compost heap in a small backyard?",
            "Which vegetables grow well in a shady balcony planter?"
        ],
        "system_prompt": "You are Fern, a patient gardening expert. Give practical, seasonal \
            advice for home gardeners: what to plant, when and how to water, how to improve \
            soil, and how to deal with pests organically. Ask for the climate zone when the \
            answer depends on it, and keep answers short and concrete.",
        "sampling": {"temperature": 0.3, "max_tokens": 200},
        "priority": 1
    })
}

async fn pinned_blocks() -> u64 {
    engine().stats().kv().gauges.device_pinned as u64
}

/// Waits (at most 10 s) until the engine's pinned-block gauge reads `want`.
async fn wait_for_pinned(want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pinned_blocks().await != want {
        assert!(
            Instant::now() < deadline,
            "pinned blocks: {} (want {want})",
            pinned_blocks().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn routed(state: &AppState, text: &str) -> String {
    let body = json!({"messages": [{"role": "user", "content": text}]});
    let (status, route) = call(
        state,
        Method::POST,
        "/v1/swarm/route",
        Some(USER_KEY),
        Some(body),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{route}");
    route["agent"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn agents_are_listed_described_and_served_as_models() {
    let state = server(false).await;
    let (status, list) = call(&state, Method::GET, "/v1/agents", None, None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let names = ids(&list);
    assert_eq!(
        names,
        ["analyst", "coder", "general", "math", "router", "support", "verifier", "writer"]
    );

    let (status, coder) = call(&state, Method::GET, "/v1/agents/coder", None, None).await;
    assert_eq!(status, StatusCode::OK, "{coder}");
    assert_eq!(coder["object"], "agent");
    assert_eq!(coder["definition"]["name"], "coder");
    assert_eq!(coder["definition"]["kind"], "specialist");
    assert!(
        coder["definition"]["routing_examples"]
            .as_array()
            .unwrap()
            .len()
            >= 3
    );
    assert!(!coder["definition"]["system_prompt"]
        .as_str()
        .unwrap()
        .is_empty());
    assert!(
        coder["pinned_prompt_tokens"].as_u64().unwrap() > 0,
        "{coder}"
    );
    let (_, router) = call(&state, Method::GET, "/v1/agents/router", None, None).await;
    assert_eq!(
        router["pinned_prompt_tokens"], 0,
        "system agents answer no user"
    );

    let (code, param) = refusal(
        call(&state, Method::GET, "/v1/agents/poet", None, None).await,
        StatusCode::NOT_FOUND,
    );
    assert_eq!((code.as_str(), param), ("agent_not_found", json!("name")));

    let (status, models) = call(&state, Method::GET, "/v1/models", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let ids = ids(&models);
    for id in [
        "swarm", "coder", "math", "writer", "support", "analyst", "general",
    ] {
        assert!(ids.contains(&id), "{id} missing from {ids:?}");
    }
    assert!(
        !ids.contains(&"router") && !ids.contains(&"verifier"),
        "{ids:?}"
    );
}

#[tokio::test]
async fn edits_need_an_admin_key() {
    let open = server(false).await;
    let (code, _) = refusal(post(&open, None, gardener()).await, StatusCode::FORBIDDEN);
    assert_eq!(code, "admin_disabled");

    let state = server(true).await;
    for key in [None, Some("sk-wrong")] {
        refusal(
            post(&state, key, gardener()).await,
            StatusCode::UNAUTHORIZED,
        );
    }
    let (code, _) = refusal(
        post(&state, Some(USER_KEY), gardener()).await,
        StatusCode::FORBIDDEN,
    );
    assert_eq!(code, "admin_key_required");
    let (code, _) = refusal(
        delete(&state, Some(USER_KEY), "/v1/agents/coder").await,
        StatusCode::FORBIDDEN,
    );
    assert_eq!(code, "admin_key_required");
    // A user key still reads, and nothing changed.
    let (status, list) = call(&state, Method::GET, "/v1/agents", Some(USER_KEY), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["data"].as_array().unwrap().len(), 8);
}

#[tokio::test]
async fn an_added_agent_is_pinned_routed_to_and_removed() {
    let state = server(true).await;
    let admin = Some(ADMIN_KEY);
    let question = "How often should I water tomato plants in a hot summer, and should I mulch?";
    assert_ne!(routed(&state, question).await, "gardener");
    let before = pinned_blocks().await;

    // Refused edits name what is wrong and change nothing.
    let mut two_examples = gardener();
    two_examples["routing_examples"] = json!(["Prune roses?", "Water ferns?"]);
    let mut elsewhere = gardener();
    elsewhere["model"] = json!("llama-70b");
    let mut unknown_field = gardener();
    unknown_field["colour"] = json!("green");
    for (body, param) in [
        (two_examples, "routing_examples"),
        (elsewhere, "model"),
        (json!({"name": "Not A Name!"}), "name"),
    ] {
        let (_, at) = refusal(post(&state, admin, body).await, StatusCode::BAD_REQUEST);
        assert_eq!(at, json!(param));
    }
    refusal(
        post(&state, admin, unknown_field).await,
        StatusCode::BAD_REQUEST,
    );
    let (code, _) = refusal(
        post(
            &state,
            admin,
            json!({"name": "coder", "description": "x", "routing_examples": ["a", "b", "c"]}),
        )
        .await,
        StatusCode::CONFLICT,
    );
    assert_eq!(code, "agent_exists");
    let (code, _) = refusal(
        post(
            &state,
            admin,
            json!({"name": "fallback", "kind": "general"}),
        )
        .await,
        StatusCode::CONFLICT,
    );
    assert_eq!(code, "swarm_invariant");
    for (name, code) in [
        ("general", "agent_protected"),
        ("router", "agent_protected"),
        ("poet", "agent_not_found"),
    ] {
        let status = if code == "agent_not_found" {
            StatusCode::NOT_FOUND
        } else {
            StatusCode::CONFLICT
        };
        let (got, _) = refusal(
            delete(&state, admin, &format!("/v1/agents/{name}")).await,
            status,
        );
        assert_eq!(got, code);
    }

    // Added: described, pinned, routed to, listed, and answering from its pinned prefix.
    let (status, added) = post(&state, admin, gardener()).await;
    assert_eq!(status, StatusCode::CREATED, "{added}");
    assert_eq!(added["id"], "gardener");
    assert_eq!(added["definition"]["model"], "default");
    let temperature = added["definition"]["sampling"]["temperature"]
        .as_f64()
        .unwrap();
    assert!((temperature - 0.3).abs() < 1e-6, "{added}");
    let pinned_tokens = added["pinned_prompt_tokens"].as_u64().unwrap();
    assert!(pinned_tokens > BLOCK, "{added}");
    wait_for_pinned(before + pinned_tokens / BLOCK).await;
    assert_eq!(routed(&state, question).await, "gardener");
    let (_, models) = call(&state, Method::GET, "/v1/models", admin, None).await;
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "gardener"));

    let body = json!({
        "model": "gardener",
        "messages": [{"role": "user", "content": "When do I sow carrots?"}],
        "max_tokens": 8,
    });
    let (status, answer) = call(
        &state,
        Method::POST,
        "/v1/chat/completions",
        admin,
        Some(body),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["swarm"]["agent"], "gardener");
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= pinned_tokens / BLOCK * BLOCK,
        "cached {cached} of {answer}"
    );

    // Removed: gone from the registry, from routing, and its blocks unpinned.
    let (status, deleted) = delete(&state, admin, "/v1/agents/gardener").await;
    assert_eq!(status, StatusCode::OK, "{deleted}");
    assert_eq!(
        deleted,
        json!({"id": "gardener", "object": "agent", "deleted": true})
    );
    wait_for_pinned(before).await;
    refusal(
        call(&state, Method::GET, "/v1/agents/gardener", admin, None).await,
        StatusCode::NOT_FOUND,
    );
    assert_ne!(routed(&state, question).await, "gardener");
}

#[tokio::test]
async fn user_keys_see_names_and_descriptions_admin_keys_see_definitions() {
    let state = server(true).await;
    let (status, list) = call(&state, Method::GET, "/v1/agents", Some(USER_KEY), None).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let agents = list["data"].as_array().unwrap();
    assert_eq!(agents.len(), 8);
    for agent in agents {
        let mut fields: Vec<&str> = agent
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        fields.sort_unstable();
        assert_eq!(fields, ["description", "id", "object"], "{agent}");
    }
    let (status, coder) = call(
        &state,
        Method::GET,
        "/v1/agents/coder",
        Some(USER_KEY),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{coder}");
    assert!(coder.get("definition").is_none(), "{coder}");
    assert_eq!(coder["object"], "agent");

    let (_, full) = call(
        &state,
        Method::GET,
        "/v1/agents/coder",
        Some(ADMIN_KEY),
        None,
    )
    .await;
    assert_eq!(full["definition"]["description"], coder["description"]);
    assert!(!full["definition"]["system_prompt"]
        .as_str()
        .unwrap()
        .is_empty());
    let (_, list) = call(&state, Method::GET, "/v1/agents", Some(ADMIN_KEY), None).await;
    assert!(list["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|a| a["definition"]["name"] == a["id"]));

    // Admin keys alone leave the API open, but definitions still need one.
    let config = ServeConfig {
        admin_keys: vec![ADMIN_KEY.parse().unwrap()],
        ..ServeConfig::default()
    };
    let state = serving(config).await;
    let (status, coder) = call(&state, Method::GET, "/v1/agents/coder", None, None).await;
    assert_eq!(status, StatusCode::OK, "{coder}");
    assert!(coder.get("definition").is_none(), "{coder}");
}

#[tokio::test]
async fn definitions_beyond_the_bounds_or_the_context_are_refused_by_field() {
    let config = ServeConfig {
        max_agents: 9,
        max_agent_prompt_bytes: 1024,
        max_agent_description_bytes: 256,
        max_agent_routing_examples: 6,
        ..keyed()
    };
    let state = serving(config).await;
    let admin = Some(ADMIN_KEY);
    let model = engine().model();
    let context = model.context_length.min(model.kv_capacity_tokens);
    let with = |field: &str, value: Value| {
        let mut agent = gardener();
        let mut at = &mut agent;
        let mut path = field.split('.').peekable();
        while let Some(key) = path.next() {
            if path.peek().is_none() {
                at[key] = value.clone();
                break;
            }
            at = &mut at[key];
        }
        agent
    };
    for (agent, param) in [
        (
            with("system_prompt", json!("x".repeat(1025))),
            "system_prompt",
        ),
        (with("description", json!("d".repeat(257))), "description"),
        (
            with(
                "routing_examples",
                json!((0..7).map(|i| format!("plant {i}")).collect::<Vec<_>>()),
            ),
            "routing_examples",
        ),
        (
            with("sampling.stop", json!(["a", "b", "c", "d", "e"])),
            "sampling.stop",
        ),
        (
            with("sampling.max_tokens", json!(context)),
            "sampling.max_tokens",
        ),
    ] {
        let (_, at) = refusal(post(&state, admin, agent).await, StatusCode::BAD_REQUEST);
        assert_eq!(at, json!(param));
    }
    let (status, list) = call(&state, Method::GET, "/v1/agents", admin, None).await;
    assert_eq!(
        (status, list["data"].as_array().unwrap().len()),
        (StatusCode::OK, 8)
    );

    // The ninth agent fits; a tenth does not.
    let (status, added) = post(&state, admin, gardener()).await;
    assert_eq!(status, StatusCode::CREATED, "{added}");
    let (status, full) = post(&state, admin, with("name", json!("orchard"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{full}");
    assert!(
        full["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-agents"),
        "{full}"
    );
}

//! The committed OpenAPI document (`openapi/openapi.json`) is the one the code generates
//! (gateway/tests/http.rs checks that the server serves it).

use serde_json::Value;

const COMMITTED: &str = include_str!("../../openapi/openapi.json");

#[test]
fn the_committed_spec_is_current() {
    assert!(
        gateway::openapi::spec_json() == COMMITTED,
        "openapi/openapi.json is out of date: run `swarmgate openapi --write openapi/openapi.json`"
    );
}

#[test]
fn the_spec_covers_every_endpoint_and_error() {
    let spec: Value = serde_json::from_str(COMMITTED).unwrap();
    for (path, method) in [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/responses", "post"),
        ("/v1/responses/{id}", "get"),
        ("/v1/responses/{id}", "delete"),
        ("/v1/embeddings", "post"),
        ("/v1/swarm/verify", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/ready", "get"),
        ("/metrics", "get"),
    ] {
        assert!(spec["paths"][path][method].is_object(), "{method} {path}");
    }
    let chat = &spec["paths"]["/v1/chat/completions"]["post"]["responses"];
    for status in [
        "200", "400", "401", "404", "413", "429", "500", "503", "504",
    ] {
        assert!(chat[status].is_object(), "chat documents {status}");
    }
    let schemas = &spec["components"]["schemas"];
    let temperature = &schemas["GenerationOptions"]["properties"]["temperature"];
    assert_eq!(
        temperature["minimum"], 0.0,
        "validation's bounds are in the spec"
    );
    assert_eq!(temperature["maximum"], 2.0);
}

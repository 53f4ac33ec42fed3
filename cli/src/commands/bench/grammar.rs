//! `swarmgate bench --scenario grammar-compile`: how long structured requests' grammars take to
//! compile, cold (the cache cannot help: each compile's schema differs by a `$comment`).
//!
//! The schemas are those the real-client tests use: a person (formats, bounds, arrays), a
//! recursive tree (`$defs` / `$ref`), a mix of enums, consts and `anyOf`, and the whole tool
//! envelope of a request with three tools. Only the model's metadata is read: no weights, no
//! engine. Reported per schema: p50 and p95 over `--requests` compiles (default 20).

use std::time::Instant;

use anyhow::{Context, Result};
use engine::{ModelInfo, ResponseFormat};
use gateway::validate::structured::{structured, StructuredLimits};
use serde::Serialize;
use serde_json::{json, Value};

use super::BenchArgs;
use crate::commands::stats::{ms, percentile};

#[derive(Debug, Serialize)]
struct Report {
    schema: &'static str,
    compiles: usize,
    p50_ms: f64,
    p95_ms: f64,
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let compiles = args.requests.unwrap_or(20);
    let model = ModelInfo::load(&args.engine.model)?;
    let mut reports = Vec::new();
    for (name, format) in formats()? {
        let mut times = Vec::with_capacity(compiles);
        for i in 0..compiles {
            let format = uncached(&format, i);
            let started = Instant::now();
            model
                .grammars
                .compile(&format)
                .with_context(|| format!("compiling {name}"))?;
            times.push(ms(started.elapsed()));
        }
        reports.push(Report {
            schema: name,
            compiles,
            p50_ms: percentile(&mut times, 50.0),
            p95_ms: percentile(&mut times, 95.0),
        });
    }
    if args.json {
        for r in &reports {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!(
            "{:>10} {:>9} {:>9} {:>9}",
            "schema", "compiles", "p50 ms", "p95 ms"
        );
        for r in &reports {
            println!(
                "{:>10} {:>9} {:>9.2} {:>9.2}",
                r.schema, r.compiles, r.p50_ms, r.p95_ms
            );
        }
    }
    Ok(())
}

/// `format` made distinct for compile `i`, so that no compile is a cache hit.
fn uncached(format: &ResponseFormat, i: usize) -> ResponseFormat {
    match format {
        ResponseFormat::JsonSchema { schema, strict } => {
            let mut schema = schema.clone();
            schema["$comment"] = json!(format!("compile {i}"));
            ResponseFormat::JsonSchema {
                schema,
                strict: *strict,
            }
        }
        ResponseFormat::Lark(grammar) => ResponseFormat::Lark(format!("// compile {i}\n{grammar}")),
        other => other.clone(),
    }
}

fn formats() -> Result<Vec<(&'static str, ResponseFormat)>> {
    let schema = |schema: Value| ResponseFormat::JsonSchema {
        schema,
        strict: true,
    };
    let person = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "born": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["name", "age", "email", "born", "tags"],
        "additionalProperties": false
    });
    let tree = json!({
        "$defs": {"node": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 12},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}
            },
            "required": ["label", "children"],
            "additionalProperties": false
        }},
        "$ref": "#/$defs/node"
    });
    let mixed = json!({
        "type": "object",
        "properties": {
            "kind": {"enum": ["a", "b", "c"]},
            "version": {"const": 2},
            "id": {"type": "string", "format": "uuid"},
            "value": {"anyOf": [{"type": "number"}, {"type": "string", "pattern": "^[a-z]+$"}]},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}]}
        },
        "required": ["kind", "version", "id", "value", "pair"]
    });
    let tool = |name: &str, parameters: Value| json!({"type": "function", "function": {"name": name, "parameters": parameters}});
    let request = serde_json::from_value(json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [
            tool("get_weather", json!({"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}
            }, "required": ["city", "unit"]})),
            tool("add", json!({"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}
            }, "required": ["a", "b"]})),
            tool("person", person.clone()),
        ]
    }))?;
    let envelope = structured(&request, &StructuredLimits::default())
        .map_err(|e| anyhow::anyhow!("the tool request: {e}"))?
        .format;
    Ok(vec![
        ("person", schema(person)),
        ("tree", schema(tree)),
        ("mixed", schema(mixed)),
        ("tools", envelope),
    ])
}

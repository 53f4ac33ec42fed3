"""Fuzz cases for the reliability probes, from an OpenAPI document: each POST route's example body
(else one generated from its schema), swept with edge values over every numeric property, and
mutated at random (edge values anywhere, fields removed or added, broken JSON). Standard library
only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

def operations(spec: dict):
    for path, item in spec.get("paths", {}).items():
        for method, operation in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                yield path, method, operation


EDGE_NUMBERS = [0, 1e-40, -1e-40, 1e308, -1e308, "NaN", "Infinity", -1, 2**31, 2**63, -(2**63) - 1, 1e-7]

# Raw JSON texts no Python value dumps to: placed where a value goes.
DEEP = 100_000
RAW_VALUES = {
    "deep_array": "[" * DEEP + "]" * DEEP,
    "deep_object": '{"a":' * 20_000 + "1" + "}" * 20_000,
    "invalid_utf8": b'"\xff\xfe\xc3\x28 \xed\xa0\x80"',
    "nan_literal": "NaN",
    "long_number": "1" + "0" * 5000,
    "big_exponent": "1e999999",
    "lone_surrogate": '"\\ud800"',
}


def edge_values(rng: random.Random):
    """A random edge value: (label, Python value or raw JSON bytes)."""
    choice = rng.randrange(5)
    if choice == 0:
        value = rng.choice(EDGE_NUMBERS)
        return f"number {value!r}", value
    if choice == 1:
        label = rng.choice(list(RAW_VALUES))
        raw = RAW_VALUES[label]
        return label, raw.encode() if isinstance(raw, str) else raw
    if choice == 2:
        size = rng.choice([10_000, 100_000])
        item = rng.choice([0, "x", {"role": "user", "content": "hi"}, [], None])
        return f"list of {size} {type(item).__name__}", [item] * size
    if choice == 3:
        value = rng.choice(["", "x" * 200_000, "\u0000", "<|im_start|>system", "\ud83d\ude00" * 1000])
        return f"string len {len(value)}", value
    value = rng.choice([None, True, False, {}, [], {"unexpected": 1}, [[]], 1.5])
    return f"value {json.dumps(value)}", value


@dataclass
class Case:
    path: str
    body: bytes
    what: str


SENTINEL = "\u0001fuzz-sentinel\u0001"


def encode(document, raw: bytes | None) -> bytes:
    """The document as JSON, the sentinel string replaced by `raw` when given."""
    text = json.dumps(document).encode()
    if raw is None:
        return text
    return text.replace(json.dumps(SENTINEL).encode(), raw, 1)


def place(value) -> tuple[object, bytes | None]:
    """A value as a document node: raw JSON becomes the sentinel, substituted at encoding."""
    return (SENTINEL, value) if isinstance(value, bytes) else (value, None)


def resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def properties(spec: dict, schema: dict) -> dict[str, dict]:
    """An object schema's properties, through `$ref` and `allOf`."""
    schema = resolve(spec, schema)
    found = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        found.update(properties(spec, part))
    return found


def is_numeric(spec: dict, schema: dict) -> bool:
    schema = resolve(spec, schema)
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if "number" in kinds or "integer" in kinds:
        return True
    return any(is_numeric(spec, s) for s in schema.get("oneOf", []) + schema.get("anyOf", []))


def generate(spec: dict, schema: dict, depth: int = 0):
    """A small value of `schema`: required properties only."""
    schema = resolve(spec, schema)
    if "example" in schema:
        return schema["example"]
    for key in ("oneOf", "anyOf"):
        if key in schema:
            options = [s for s in schema[key] if resolve(spec, s).get("type") != "null"]
            return generate(spec, options[0], depth + 1) if options else None
    if "enum" in schema:
        return schema["enum"][0]
    kinds = schema.get("type", "object")
    kind = next((k for k in ([kinds] if isinstance(kinds, str) else kinds) if k != "null"), "null")
    if kind == "object" or "allOf" in schema:
        required = set(schema.get("required", []))
        for part in schema.get("allOf", []):
            required |= set(resolve(spec, part).get("required", []))
        props = properties(spec, schema)
        return {name: generate(spec, props.get(name, {}), depth + 1) for name in sorted(required) if depth < 6}
    if kind == "array":
        return [generate(spec, schema.get("items", {}), depth + 1)] if depth < 6 else []
    return {"string": "probe", "integer": 1, "number": 0.5, "boolean": False}.get(kind)


def post_routes(spec: dict) -> list[tuple[str, dict, list[str]]]:
    """(path, base body, numeric top-level properties) for every POST route with a JSON body."""
    routes = []
    for path, method, operation in operations(spec):
        content = (operation.get("requestBody") or {}).get("content", {}).get("application/json")
        if method != "post" or content is None or "{" in path:
            continue
        schema = content.get("schema", {})
        base = content.get("example") or generate(spec, schema)
        numeric = sorted(name for name, prop in properties(spec, schema).items() if is_numeric(spec, prop))
        routes.append((path, base, numeric))
    return routes


def edge_sweep(routes):
    """Every numeric property of every route, set to every edge number, on the route's base."""
    for path, base, numeric in routes:
        for name in numeric:
            for value in EDGE_NUMBERS:
                yield Case(path, json.dumps({**base, name: value}).encode(), f"{name}={value!r}")


def nodes(document, trail=()):
    """Every (parent, key) inside a document, for replacement."""
    if isinstance(document, dict):
        for key, value in document.items():
            yield document, key, trail + (key,)
            yield from nodes(value, trail + (key,))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield document, index, trail + (index,)
            yield from nodes(value, trail + (index,))


def mutate(rng: random.Random, path: str, base) -> Case:
    document = json.loads(json.dumps(base))
    kind = rng.randrange(10)
    if kind <= 4 and isinstance(document, dict):
        # One node, anywhere in the body, replaced by an edge value.
        parent, key, trail = rng.choice(list(nodes(document)))
        label, value = edge_values(rng)
        parent[key], raw = place(value)
        return Case(path, encode(document, raw), f"{'.'.join(map(str, trail))} = {label}")
    if kind == 5 and isinstance(document, dict):
        label, value = edge_values(rng)
        document[rng.choice(["unknown_field", "stream", "n", "logprobs", "tools", "stop"])], raw = place(value)
        return Case(path, encode(document, raw), f"extra field = {label}")
    if kind == 6 and isinstance(document, dict) and document:
        parent, key, trail = rng.choice(list(nodes(document)))
        del parent[key]
        return Case(path, encode(document, None), f"removed {'.'.join(map(str, trail))}")
    text = json.dumps(document).encode()
    whole = [
        ("truncated", lambda: text[: rng.randrange(len(text))]),
        ("flipped bytes", lambda: bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.05 else b for b in text)),
        ("invalid utf-8 inside", lambda: text.replace(b'"', b'"\xc3\x28\xff', 2)),
        ("empty", lambda: b""),
        ("not an object", lambda: rng.choice([b"null", b"[]", b"1e308", b'"x"', b"true"])),
        ("trailing garbage", lambda: text + b"}{]"),
        ("duplicate keys", lambda: text[:-1] + b"," + text[1:] if text.startswith(b"{") and len(text) > 2 else text),
    ]
    label, make = rng.choice(whole)
    return Case(path, make(), label)

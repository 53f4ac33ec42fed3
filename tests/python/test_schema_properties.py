"""Structured outputs against random schemas: hypothesis draws JSON schemas from the subset the
server supports (nested objects with required properties, enum and const, arrays with item
bounds, strings with lengths, patterns and formats, bounded integers and numbers, anyOf, $defs
and $ref), the server answers each with a couple of seeded samples at temperature 1, and every
answer that finished (finish_reason "stop") must be valid against its schema, formats included
(Draft 2020-12, python-jsonschema's FormatChecker). An answer cut at max_tokens may be
incomplete, but such answers are counted and must stay a minority.

The example count is small and the draw derandomized, so every run sends the same few dozen
short requests; shrinking is off, so a failure costs no further requests (the failing schema and
answer are in the assertion message).
"""

import json
import re

import jsonschema
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import MODEL

MAX_TOKENS = 200
SEEDS = (11, 12)
EXAMPLES = 12

NAMES = ["id", "name", "kind", "size", "tags", "color", "score", "owner", "items", "when"]
PATTERNS = [
    r"^[a-z]{3,8}$",
    r"^[A-Z][a-z]{1,6}$",
    r"^[0-9]{3}-[0-9]{4}$",
    r"^(red|green|blue)$",
    r"^[a-f0-9]{4}$",
]
FORMATS = ["date", "date-time", "email", "uuid"]
SCALARS = st.one_of(
    st.sampled_from(["alpha", "beta", "gamma", "delta", "x"]),
    st.integers(min_value=-50, max_value=50),
    st.booleans(),
    st.none(),
)


@st.composite
def string_schemas(draw):
    kind = draw(st.sampled_from(["length", "pattern", "format"]))
    if kind == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(PATTERNS))}
    if kind == "format":
        return {"type": "string", "format": draw(st.sampled_from(FORMATS))}
    low = draw(st.integers(min_value=0, max_value=3))
    return {"type": "string", "minLength": low, "maxLength": low + draw(st.integers(1, 12))}


@st.composite
def number_schemas(draw):
    kind = draw(st.sampled_from(["integer", "number"]))
    low = draw(st.integers(min_value=-1000, max_value=1000))
    schema = {"type": kind, "minimum": low, "maximum": low + draw(st.integers(0, 2000))}
    if draw(st.booleans()):
        # One bound only, sometimes.
        del schema[draw(st.sampled_from(["minimum", "maximum"]))]
    return schema


def leaf_schemas():
    return st.one_of(
        string_schemas(),
        number_schemas(),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(SCALARS, min_size=1, max_size=4, unique_by=lambda v: json.dumps(v)).map(
            lambda values: {"enum": values}
        ),
        SCALARS.map(lambda value: {"const": value}),
        st.just({"type": ["string", "null"], "maxLength": 8}),
    )


def extend(children):
    """One level of structure around `children`: an object, an array or an anyOf."""

    @st.composite
    def objects(draw):
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        properties = {name: draw(children) for name in names}
        required = [name for name in names if draw(st.booleans())]
        schema = {"type": "object", "properties": properties, "required": required}
        if draw(st.sampled_from([True, True, True, False])):
            schema["additionalProperties"] = False
        return schema

    @st.composite
    def arrays(draw):
        low = draw(st.integers(min_value=0, max_value=2))
        schema = {"type": "array", "minItems": low, "maxItems": low + draw(st.integers(0, 2))}
        if draw(st.integers(0, 3)) == 0:
            schema["prefixItems"] = [draw(children)]
            schema["items"] = draw(children)
        else:
            schema["items"] = draw(children)
        return schema

    return st.one_of(
        objects(),
        arrays(),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    )


def nested_schemas():
    return st.recursive(leaf_schemas(), extend, max_leaves=6)


TREE = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 6},
        "children": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2},
    },
    "required": ["label"],
    "additionalProperties": False,
}


@st.composite
def root_schemas(draw):
    """An object at the root (as OpenAI requires), sometimes with a $defs entry that one or
    more properties reach through $ref, or with the recursive tree."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    properties = {name: draw(nested_schemas()) for name in names}
    schema = {
        "type": "object",
        "properties": properties,
        "required": [name for name in names if draw(st.booleans())],
        "additionalProperties": False,
    }
    defs = draw(st.sampled_from([None, "shared", "tree"]))
    if defs == "shared":
        schema["$defs"] = {"shared": draw(nested_schemas())}
        for name in draw(st.lists(st.sampled_from(names), min_size=1, unique=True)):
            properties[name] = {"$ref": "#/$defs/shared"}
    elif defs == "tree":
        schema["$defs"] = {"tree": TREE}
        properties[names[0]] = {"$ref": "#/$defs/tree"}
    return schema


def format_checker():
    """python-jsonschema's checker, less three calendar facts that a regular grammar (the
    decoder's format patterns) does not encode: 29 February in a year that has none, the year
    0000, and the leap second :60. Those are normalized before the usual check; anything else
    wrong with a date still fails."""
    checker = jsonschema.FormatChecker()
    for name in ("date", "date-time"):
        check, raises = checker.checkers[name]

        def lenient(value, check=check):
            if isinstance(value, str):
                value = re.sub(r"^0000-", "2000-", value)
                value = re.sub(r"^(\d{4})-02-29", r"\g<1>-02-28", value)
                value = re.sub(r"(T\d{2}:\d{2}):60", r"\1:59", value, flags=re.I)
            return check(value)

        checker.checks(name, raises=raises)(lenient)
    return checker


FORMAT_CHECKER = format_checker()


def test_date_time_formats_are_really_checked():
    """The checker rejects what it should (date-time needs rfc3339-validator installed: without
    it python-jsonschema silently accepts any string)."""
    validator = jsonschema.Draft202012Validator
    for fmt, bad in [
        ("date", "2024-13-01"),
        ("date-time", "2024-01-01 10:00"),
        ("email", "nobody"),
        ("uuid", "1234"),
    ]:
        assert not validator({"format": fmt}, format_checker=FORMAT_CHECKER).is_valid(bad), fmt
    assert validator({"format": "date"}, format_checker=FORMAT_CHECKER).is_valid("2023-02-29")


def test_answers_that_finish_are_valid_against_random_schemas(client):
    outcomes = []  # (finish_reason, schema, content)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(root_schemas())
    def check(schema):
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
        for seed in SEEDS:
            response = client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": "Fill in this JSON object with example values."}
                ],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "example", "schema": schema, "strict": True},
                },
                temperature=1.0,
                seed=seed,
                max_tokens=MAX_TOKENS,
            )
            choice = response.choices[0]
            content = choice.message.content or ""
            outcomes.append((choice.finish_reason, schema, content))
            assert choice.finish_reason in ("stop", "length"), choice.finish_reason
            if choice.finish_reason == "stop":
                context = f"schema {json.dumps(schema)}\nanswer {content!r}"
                try:
                    instance = json.loads(content)
                except json.JSONDecodeError as error:
                    raise AssertionError(f"not JSON: {error}\n{context}") from None
                errors = [e.message for e in validator.iter_errors(instance)]
                assert not errors, f"{errors}\n{context}"

    check()

    assert len(outcomes) == EXAMPLES * len(SEEDS)
    cut = [(schema, content) for finish, schema, content in outcomes if finish == "length"]
    assert len(cut) * 2 < len(outcomes), (
        f"{len(cut)} of {len(outcomes)} answers were cut at {MAX_TOKENS} tokens: "
        + "; ".join(f"{json.dumps(s)} -> {c[:80]!r}" for s, c in cut[:3])
    )

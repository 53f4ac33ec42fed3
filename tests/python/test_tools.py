"""Function calling and JSON-schema structured outputs through Chat Completions, as the official
Python SDK sees them, against a running `swarmgate serve`.

The model is small (135M parameters), so the tests assert what the server guarantees by
construction rather than what the model chooses to say: a forced tool call (tool_choice
"required" or a named function) always comes back as well-formed calls whose arguments are valid
against that tool's parameters schema; a json_schema answer that finished is valid against its
schema; streamed calls reassemble into the same calls; refused requests carry OpenAI's error
envelope. Every request is greedy (temperature 0) and short, and every schema bounds its strings
and numbers so that an answer fits in the few tokens each test allows.
"""

import json

import jsonschema
import openai
import pydantic
import pytest

from conftest import MODEL

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city's name", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def function_tool(name, description, parameters, strict=True):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": strict,
        },
    }


WEATHER = function_tool("get_weather", "Get the current weather in a city.", WEATHER_PARAMETERS)
ADD = function_tool("add", "Add two integers.", ADD_PARAMETERS)
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
WEATHER_QUESTION = "What is the weather in Paris right now? Use the get_weather tool."
# Tool-call syntax a model may write as text; none of it may reach `content`.
MARKUP = ("<tool_call>", "</tool_call>", '{"tool_calls"', '"arguments"')


def ask(client, content, **params):
    params.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **params
    )


def check_calls(message, forced=True, schemas=SCHEMAS):
    """Asserts the message's tool calls are well formed, each with arguments valid against its
    tool's schema; returns them as (name, arguments) pairs. A forced call comes alone; a call
    the model chose may follow some text, but never with tool-call markup in it."""
    assert message.tool_calls, "a call was asked for"
    if forced:
        assert not message.content, f"a forced call has no text: {message.content!r}"
    else:
        check_no_markup(message.content or "")
    ids = [call.id for call in message.tool_calls]
    assert len(set(ids)) == len(ids), f"call ids are unique: {ids}"
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_"), call.id
        assert call.type == "function"
        assert call.function.name in schemas, call.function.name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schemas[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def check_no_markup(text):
    for markup in MARKUP:
        assert markup not in text, f"tool-call markup in the text: {text!r}"


def check_text(message, tools_offered=True):
    """A text answer. Where the model could call a tool (tool_choice auto) the server reads any
    call out of the text, so no markup may be left in it; where it could not (tool_choice none,
    or no tools), what the model writes is only text, whatever it looks like."""
    assert not message.tool_calls
    assert isinstance(message.content, str) and message.content.strip()
    if tools_offered:
        check_no_markup(message.content)


def check_call_or_text(choice):
    """Under tool_choice auto: well-formed calls, or a text answer without markup."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message, forced=False)
    else:
        assert choice.finish_reason in ("stop", "length")
        check_text(choice.message)


# Tool calls


def test_required_tool_choice_gives_valid_calls(client):
    response = ask(
        client, WEATHER_QUESTION, tools=[WEATHER, ADD], tool_choice="required", max_tokens=320
    )

    assert response.object == "chat.completion"
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant"
    check_calls(choice.message)
    assert 0 < response.usage.completion_tokens <= 320


def test_named_tool_choice_calls_that_tool(client):
    # The question is about the weather; the named tool is the other one: the choice wins.
    response = ask(
        client,
        WEATHER_QUESTION,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        max_tokens=64,
    )

    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = check_calls(choice.message)
    assert [name for name, _ in calls] == ["add"]


def test_auto_tool_choice_gives_a_valid_call_or_plain_text(client):
    response = ask(
        client,
        WEATHER_QUESTION,
        tools=[WEATHER, ADD],
        tool_choice="auto",
        parallel_tool_calls=False,
        max_tokens=96,
    )

    check_call_or_text(response.choices[0])


def test_tool_choice_none_answers_in_text(client):
    response = ask(client, WEATHER_QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=32)

    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    check_text(choice.message, tools_offered=False)


def test_parallel_tool_calls_false_gives_one_call(client):
    response = ask(
        client,
        "What is the weather in Paris, in London and in Rome? Call get_weather for each city.",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
    )

    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(check_calls(choice.message)) == 1


def test_streamed_tool_calls_reassemble_into_the_same_calls(client):
    params = dict(
        tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False, max_tokens=64
    )
    expected = check_calls(ask(client, WEATHER_QUESTION, **params).choices[0].message)

    chunks = list(ask(client, WEATHER_QUESTION, stream=True, **params))

    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1, "one id for the whole stream"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.content for d in deltas), "a call streams no text"
    assert deltas[0].role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["tool_calls"], "one finish_reason, the last"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"

    calls = {}  # index -> {"id", "name", "arguments"}
    for delta in deltas:
        for part in delta.tool_calls or []:
            if part.index not in calls:
                # The first delta of a call names it.
                assert part.id and part.id.startswith("call_"), part.id
                assert part.type == "function"
                assert part.function and part.function.name
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            elif part.function and part.function.name:
                assert part.function.name == calls[part.index]["name"]
            if part.function and part.function.arguments:
                calls[part.index]["arguments"] += part.function.arguments

    assert sorted(calls) == list(range(len(calls))), "indices count from 0"
    assert len({c["id"] for c in calls.values()}) == len(calls)
    streamed = []
    for index in sorted(calls):
        call = calls[index]
        arguments = json.loads(call["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["name"]])
        streamed.append((call["name"], arguments))
    assert streamed == expected, "greedy: the stream carries the same calls"


# Conversations with tool results


def weather_conversation(result_content):
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_weather0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_weather0", "content": result_content},
    ]


def test_a_tool_result_is_answered_in_text(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=weather_conversation('{"temperature": 22, "sky": "sunny"}'),
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=32,
    )

    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    check_text(choice.message, tools_offered=False)
    assert response.usage.prompt_tokens > 0


def test_a_tool_result_in_text_parts_is_accepted_with_auto(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=weather_conversation([{"type": "text", "text": "22 degrees and sunny."}]),
        tools=[WEATHER],
        tool_choice="auto",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )

    check_call_or_text(response.choices[0])


def test_a_tool_result_without_tools_is_answered_in_text(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=weather_conversation('{"temperature": 22, "sky": "sunny"}'),
        temperature=0,
        max_tokens=32,
    )

    check_text(response.choices[0].message, tools_offered=False)
    assert response.choices[0].finish_reason in ("stop", "length")


# Structured outputs

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "code", "skills", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
}
PERSON_PROMPT = "Describe a person as JSON: name, age, role, code, skills and address."


def test_json_schema_answer_is_valid(client):
    response = ask(client, PERSON_PROMPT, response_format=PERSON_FORMAT, max_tokens=96)

    choice = response.choices[0]
    assert choice.finish_reason == "stop", "the schema bounds the answer well below max_tokens"
    assert not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_streamed_json_schema_answer_is_the_same(client):
    expected = ask(client, PERSON_PROMPT, response_format=PERSON_FORMAT, max_tokens=96)

    chunks = list(
        ask(client, PERSON_PROMPT, response_format=PERSON_FORMAT, max_tokens=96, stream=True)
    )

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)


def test_parse_returns_the_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the name, country and population of Paris."}],
        response_format=City,
        temperature=0,
        max_tokens=64,
    )

    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content)
    assert message.refusal is None


def test_recursive_schema_answer_is_valid(client):
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 8},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["label", "children"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
        "additionalProperties": False,
    }
    response = ask(
        client,
        "Write a small tree as JSON: a root node with labelled children.",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "tree", "schema": schema, "strict": True},
        },
        max_tokens=96,
    )

    choice = response.choices[0]
    content = choice.message.content
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(content), schema)
    else:
        # A recursive schema has no bound on its size; a cut answer is still a prefix of JSON.
        assert choice.finish_reason == "length"
        assert content.startswith('{"root"')


# Refusals


def check_bad_request(caught, param):
    error = caught.value
    assert error.status_code == 400
    assert error.type == "invalid_request_error"
    assert error.param and error.param.startswith(param), error.param
    assert error.message
    assert error.response.json()["error"]["param"] == error.param


def test_unknown_named_tool_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(
            client,
            WEATHER_QUESTION,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}},
            max_tokens=8,
        )
    check_bad_request(caught, "tool_choice")


# `not` is a keyword the constrained decoder cannot enforce.
UNSUPPORTED_SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 12, "not": {"const": "no"}}},
    "required": ["word"],
    "additionalProperties": False,
}


def test_unsupported_keyword_with_strict_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(
            client,
            "Say a word as JSON.",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "word", "schema": UNSUPPORTED_SCHEMA, "strict": True},
            },
            max_tokens=8,
        )
    check_bad_request(caught, "response_format")


def test_unsupported_keyword_in_a_strict_tool_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(
            client,
            "Say a word.",
            tools=[function_tool("say", "Say a word.", UNSUPPORTED_SCHEMA)],
            tool_choice="required",
            max_tokens=8,
        )
    check_bad_request(caught, "tools")


def test_malformed_schema_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(
            client,
            "Say a word as JSON.",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": 5}, "strict": True},
            },
            max_tokens=8,
        )
    check_bad_request(caught, "response_format")


def test_too_many_tools_is_a_bad_request(client):
    tools = [
        function_tool(f"tool_{i}", f"Tool number {i}.", {"type": "object", "properties": {}})
        for i in range(129)
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "Hi", tools=tools, max_tokens=8)
    check_bad_request(caught, "tools")


def test_unsupported_keyword_without_strict_is_dropped_with_a_warning(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say a word as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "word", "schema": UNSUPPORTED_SCHEMA, "strict": False},
        },
        temperature=0,
        max_tokens=32,
    )

    assert raw.status_code == 200
    warnings = raw.headers.get("x-swarmgate-schema-warnings")
    assert warnings and "not" in warnings, warnings
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop"
    # Valid against the schema less the keyword it could not enforce.
    enforced = json.loads(json.dumps(UNSUPPORTED_SCHEMA))
    del enforced["properties"]["word"]["not"]
    jsonschema.validate(json.loads(choice.message.content), enforced)

"""The Responses API (POST /v1/responses and its stored responses) as the official Python SDK
sees it, against a running `swarmgate serve`.

As in the Chat Completions tests, the assertions are about shapes and guarantees (a forced
function call is valid against its parameters, stream events arrive in order with increasing
sequence numbers and add up to the final response, a stored response can be chained, retrieved
and deleted) rather than about what the small model says. Requests are greedy and short.
"""

import json

import jsonschema
import openai
import pytest

from conftest import MODEL

QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# The Responses API's flat function tool.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
WEATHER_QUESTION = "What is the weather in Paris right now? Use the get_weather tool."


def create(client, input, **params):
    params.setdefault("temperature", 0)
    params.setdefault("max_output_tokens", 32)
    return client.responses.create(model=MODEL, input=input, **params)


def check_usage(response, max_output_tokens):
    usage = response.usage
    assert usage.input_tokens > 0
    assert 0 < usage.output_tokens <= max_output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def check_finished(response):
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def function_calls(response):
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.name == "get_weather"
        assert call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    return calls


def test_string_input_gives_output_text(client):
    response = create(client, QUESTION, metadata={"suite": "responses"})

    assert response.object == "response"
    assert response.id
    assert response.model == MODEL
    check_finished(response)
    assert "Paris" in response.output_text
    messages = [item for item in response.output if item.type == "message"]
    assert len(messages) == 1
    assert messages[0].role == "assistant"
    assert [part.type for part in messages[0].content] == ["output_text"]
    assert messages[0].content[0].text == response.output_text
    check_usage(response, 32)
    assert response.metadata == {"suite": "responses"}


def test_message_items_and_instructions(client):
    as_string = create(client, QUESTION)
    as_items = create(client, [{"role": "user", "content": QUESTION}])
    assert as_items.output_text == as_string.output_text, "the same prompt, the same greedy answer"

    # Instructions are the system message: the answer is the one Chat Completions gives.
    instructions = "You answer in French."
    instructed = create(client, QUESTION, instructions=instructions)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": QUESTION},
        ],
        temperature=0,
        max_tokens=32,
    )
    assert instructed.output_text == chat.choices[0].message.content
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens


def test_required_tool_choice_gives_a_valid_function_call(client):
    response = create(
        client,
        WEATHER_QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
    )

    assert response.status == "completed"
    calls = function_calls(response)
    assert len(calls) == 1
    assert not response.output_text
    assert response.tools[0].name == "get_weather"


def test_function_call_output_is_answered_in_text(client):
    response = create(
        client,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_weather0",
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}',
            },
            {
                "type": "function_call_output",
                "call_id": "call_weather0",
                "output": '{"temperature": 22, "sky": "sunny"}',
            },
        ],
        tools=[WEATHER],
        tool_choice="none",
    )

    check_finished(response)
    assert response.output_text.strip()
    assert not function_calls(response)


def test_json_schema_text_format_is_valid(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "capital"],
        "additionalProperties": False,
    }
    response = create(
        client,
        "Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=64,
    )

    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def collect(stream):
    events = list(stream)
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    # The last event says how the response ended: completed, or incomplete at max_output_tokens.
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert sum(t in ("response.completed", "response.incomplete") for t in types) == 1
    numbers = [event.sequence_number for event in events]
    assert all(a < b for a, b in zip(numbers, numbers[1:])), numbers
    assert events[0].response.status == "in_progress"
    final = events[-1].response
    assert final.id == events[0].response.id
    assert types[-1] == f"response.{final.status}"
    return events, types, final


def test_stream_events_arrive_in_order_and_add_up(client):
    expected = create(client, QUESTION)

    events, types, final = collect(create(client, QUESTION, stream=True))

    for before, after in [
        ("response.output_item.added", "response.content_part.added"),
        ("response.content_part.added", "response.output_text.delta"),
        ("response.output_text.delta", "response.output_text.done"),
        ("response.output_text.done", "response.content_part.done"),
        ("response.content_part.done", "response.output_item.done"),
    ]:
        assert before in types and after in types, types
        assert types.index(before) < types.index(after), (before, after, types)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == expected.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [text]
    assert final.status == expected.status
    check_usage(final, 32)


def test_streamed_function_call_arguments_add_up(client):
    events, types, final = collect(
        create(
            client,
            WEATHER_QUESTION,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=64,
            stream=True,
        )
    )

    assert "response.output_text.delta" not in types
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    assert added[0].item.name == "get_weather"
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [arguments]
    assert types.index("response.function_call_arguments.done") < types.index(
        "response.output_item.done"
    )
    calls = function_calls(final)
    assert [c.arguments for c in calls] == [arguments]
    assert final.status == "completed"


def test_previous_response_id_continues_the_conversation(client):
    first = create(client, "My name is Alice. Say hello to me.")
    follow_up = "What is my name?"

    chained = create(client, follow_up, previous_response_id=first.id)
    alone = create(client, follow_up)

    assert chained.previous_response_id == first.id
    assert chained.output_text.strip()
    # The chained prompt holds the first turn and its answer before the follow-up.
    assert chained.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens


def test_stored_response_is_retrieved_then_deleted(client):
    response = create(client, QUESTION)

    retrieved = client.responses.retrieve(response.id)
    assert retrieved.id == response.id
    assert retrieved.output_text == response.output_text
    assert retrieved.status == response.status

    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(response.id)
    assert caught.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_unstored_response_cannot_be_retrieved(client):
    response = create(client, "Hi", store=False, max_output_tokens=4)
    assert response.id

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)

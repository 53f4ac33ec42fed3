"""Instructor, unmodified, against a running `swarmgate serve`: in Mode.TOOLS (a forced call of
one function named after the response model, its schema not strict) and Mode.JSON_SCHEMA (a
json_schema response_format), `create(response_model=...)` returns an instance of the response
model, and `create_partial` builds one up from a streamed call.

Instructor retries a request whose answer fails validation; retries are off here, so the answer
must be valid the first time. Instructor's own environment has the newest openai release it
accepts (see frameworks/instructor.txt).
"""

import openai
import pydantic
import pytest

from conftest import API_KEY, MODEL, REQUEST_TIMEOUT, framework

instructor = framework("instructor")


class City(pydantic.BaseModel):
    """A city and where it is."""

    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)


MODES = {"tools": instructor.Mode.TOOLS, "json_schema": instructor.Mode.JSON_SCHEMA}
PROMPT = [{"role": "user", "content": "Describe Paris: its name, its country and its population."}]


def client(server, mode):
    return instructor.from_openai(
        openai.OpenAI(
            base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT
        ),
        mode=MODES[mode],
    )


@pytest.mark.parametrize("mode", sorted(MODES))
def test_response_model_is_returned(server, mode):
    city, completion = client(server, mode).chat.completions.create_with_completion(
        model=MODEL,
        response_model=City,
        messages=PROMPT,
        max_retries=0,
        temperature=0,
        max_tokens=96,
    )

    assert isinstance(city, City), city
    assert len(city.name) <= 20 and 0 <= city.population <= 50_000_000
    choice = completion.choices[0]
    if mode == "tools":
        assert choice.finish_reason == "tool_calls"
        assert [call.function.name for call in choice.message.tool_calls] == ["City"]
        arguments = choice.message.tool_calls[0].function.arguments
        assert City.model_validate_json(arguments).model_dump() == city.model_dump()
    else:
        assert choice.finish_reason == "stop"
        assert City.model_validate_json(choice.message.content).model_dump() == city.model_dump()


def test_streamed_partial_response_model(server):
    partials = list(
        client(server, "tools").chat.completions.create_partial(
            model=MODEL,
            response_model=City,
            messages=PROMPT,
            max_retries=0,
            temperature=0,
            max_tokens=96,
        )
    )

    assert partials, "at least the final object"
    final = partials[-1]
    assert isinstance(final.name, str) and len(final.name) <= 20
    assert isinstance(final.population, int) and 0 <= final.population <= 50_000_000
    assert City.model_validate(final.model_dump())

"""LangChain's OpenAI chat model (`langchain-openai`), unmodified, against a running
`swarmgate serve`: `bind_tools` with a forced tool_choice returns tool calls whose arguments
validate (through Chat Completions and, with use_responses_api, the Responses API; plain and
streamed), and `with_structured_output` returns the schema's pydantic model (through a
json_schema response_format and through function calling).
"""

from typing import Literal

import pydantic
import pytest

from conftest import API_KEY, MODEL, REQUEST_TIMEOUT, framework

framework("langchain_openai")

from langchain_openai import ChatOpenAI  # noqa: E402


class GetWeather(pydantic.BaseModel):
    """Get the current weather in a city."""

    city: str = pydantic.Field(max_length=24, description="The city's name")
    unit: Literal["celsius", "fahrenheit"]


class Add(pydantic.BaseModel):
    """Add two integers."""

    a: int = pydantic.Field(ge=-1000, le=1000)
    b: int = pydantic.Field(ge=-1000, le=1000)


class City(pydantic.BaseModel):
    """A city and where it is."""

    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)


TOOLS = {"GetWeather": GetWeather, "Add": Add}
QUESTION = "What is the weather in Paris? Use a tool."


def chat_model(server, api="chat"):
    return ChatOpenAI(
        model=MODEL,
        base_url=server.base_url,
        api_key=API_KEY,
        temperature=0,
        max_tokens=64,
        max_retries=0,
        timeout=REQUEST_TIMEOUT,
        use_responses_api=api == "responses",
    )


def called(message):
    """The names of the message's tool calls, each checked: an id, arguments valid for it."""
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    assert message.tool_calls, "a call was forced"
    for call in message.tool_calls:
        assert call["id"]
        TOOLS[call["name"]].model_validate(call["args"])
    return [call["name"] for call in message.tool_calls]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_required_tool_choice_returns_tool_calls(server, api):
    model = chat_model(server, api).bind_tools(
        [GetWeather, Add], tool_choice="required", parallel_tool_calls=False
    )

    message = model.invoke(QUESTION)

    assert len(called(message)) == 1


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_named_tool_choice_streams_that_tool(server, api):
    model = chat_model(server, api).bind_tools([GetWeather, Add], tool_choice="Add")

    chunks = list(model.stream("Add 2 and 3."))

    assert len(chunks) > 1, "streamed in pieces"
    message = chunks[0]
    for chunk in chunks[1:]:
        message = message + chunk
    assert set(called(message)) == {"Add"}


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_returns_the_model(server, method):
    model = chat_model(server).with_structured_output(City, method=method)

    city = model.invoke("Describe Paris: its name, its country and its population.")

    assert isinstance(city, City), city
    assert len(city.name) <= 20 and 0 <= city.population <= 50_000_000

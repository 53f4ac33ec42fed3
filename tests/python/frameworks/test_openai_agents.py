"""OpenAI's Agents SDK (`openai-agents`), unmodified, against a running `swarmgate serve`: an
agent with one function tool, driven once through Chat Completions and once through the
Responses API, each plain and streamed.

The agent must call its tool, once (tool_choice "required", parallel_tool_calls false), and
stops on that call's result (tool_use_behavior "stop_on_first_tool"), so each run is one model
request however the small model behaves, and the tool's arguments reach the Python function validated by the SDK.
Tracing is off: it would try to export spans to the vendor's servers.
"""

import asyncio
from typing import Annotated, Literal

import openai
import pydantic
import pytest

from conftest import API_KEY, MODEL, REQUEST_TIMEOUT, framework

framework("agents")

from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)

MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


def weather_agent(server, api, calls):
    @function_tool
    def get_weather(
        city: Annotated[str, pydantic.Field(max_length=24, description="The city's name")],
        unit: Literal["celsius", "fahrenheit"],
    ) -> str:
        """Get the current weather in a city."""
        calls.append((city, unit))
        return f"22 degrees {unit} and sunny in {city}"

    client = openai.AsyncOpenAI(
        base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT
    )
    return Agent(
        name="Weather",
        instructions="You answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=MODELS[api](model=MODEL, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
        ),
        tool_use_behavior="stop_on_first_tool",
    )


async def run_streamed(agent, prompt):
    result = Runner.run_streamed(agent, prompt, max_turns=2)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds, kinds
    return result


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", sorted(MODELS))
def test_agent_calls_its_function_tool(server, api, stream):
    calls = []
    agent = weather_agent(server, api, calls)
    prompt = "What is the weather in Paris?"

    if stream:
        result = asyncio.run(run_streamed(agent, prompt))
    else:
        result = Runner.run_sync(agent, prompt, max_turns=2)

    assert len(calls) == 1, calls
    city, unit = calls[0]
    assert isinstance(city, str) and len(city) <= 24
    assert unit in ("celsius", "fahrenheit")
    assert result.final_output == f"22 degrees {unit} and sunny in {city}"
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    call = result.new_items[0].raw_item
    assert call.name == "get_weather"
    assert result.new_items[1].output == result.final_output
    assert len(result.raw_responses) == 1, "the first call ends the run"

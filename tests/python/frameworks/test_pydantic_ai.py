"""Pydantic AI (`pydantic-ai-slim[openai]`), unmodified, against a running `swarmgate serve`: an
agent whose output_type is a pydantic model returns an instance of that model.

Pydantic AI's default structured output is a forced call of its output tool, so this goes
through function calling (Chat Completions and the Responses API); NativeOutput goes through a
json_schema response_format instead. Each model field is bounded, so the answer fits in the
few tokens allowed, and output retries are off: a run must succeed on its first request.
"""

import datetime

import openai
import pydantic
import pytest

from conftest import API_KEY, MODEL, REQUEST_TIMEOUT, framework

framework("pydantic_ai")

from pydantic_ai import Agent, NativeOutput  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


class City(pydantic.BaseModel):
    """A city and where it is."""

    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)
    founded: datetime.date | None = None


MODELS = {"chat": OpenAIChatModel, "responses": OpenAIResponsesModel}
OUTPUTS = {"tool": City, "native": NativeOutput(City)}
SETTINGS = {"temperature": 0, "max_tokens": 96}


def agent(server, api, output):
    client = openai.AsyncOpenAI(
        base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT
    )
    model = MODELS[api](MODEL, provider=OpenAIProvider(openai_client=client))
    return Agent(
        model,
        output_type=OUTPUTS[output],
        instructions="You describe cities.",
        retries=0,
    )


@pytest.mark.parametrize("output", sorted(OUTPUTS))
@pytest.mark.parametrize("api", sorted(MODELS))
def test_output_type_gives_an_instance_of_the_model(server, api, output):
    result = agent(server, api, output).run_sync(
        "Describe Paris: its name, its country and its population.", model_settings=SETTINGS
    )

    assert isinstance(result.output, City), result.output
    assert len(result.output.name) <= 20
    assert 0 <= result.output.population <= 50_000_000
    usage = result.usage
    assert usage.requests == 1
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 96

"""Agent frameworks against `localllm serve` as their users run them (issue 39): instructor in its
JSON (the schema in the prompt only: its field names are the ones the small model writes unasked),
JSON_SCHEMA and TOOLS modes, pydantic-ai's `output_type`, langchain's `bind_tools` and
`with_structured_output` — each through its own client code, on the real default model. Before
issue 39 a forced tool call came back as markup with finish "length" and these raised."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import real_server

from conftest import need

need("openai", "pip install openai")
need("instructor", "pip install instructor")
need("pydantic_ai", "pip install 'pydantic-ai-slim[openai]'")
need("langchain_openai", "pip install langchain-openai")

import instructor  # noqa: E402
import openai  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from localllm.server.runner import BackgroundServer  # noqa: E402

ASK = "Which city is the capital of France, and in which country is it?"


class City(BaseModel):
    """A city and its country."""

    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with real_server(tmp_path_factory.mktemp("home"), parallel=2) as s:
        yield s


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON, instructor.Mode.JSON_SCHEMA])
def test_instructor(server: BackgroundServer, mode: instructor.Mode) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                                    mode=mode)  # fmt: skip
    city = client.chat.completions.create(model="smollm2", response_model=City, max_retries=0, temperature=0,
                                          max_tokens=200, messages=[{"role": "user", "content": ASK}])  # fmt: skip
    assert isinstance(city, City) and city.city and city.country


def test_pydantic_ai_output_type(server: BackgroundServer) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=City, retries=0)
    result = agent.run_sync(ASK, model_settings={"temperature": 0, "max_tokens": 200})
    assert isinstance(result.output, City) and result.output.city


def test_langchain_bind_tools_and_structured_output(server: BackgroundServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model="smollm2", base_url=server.url + "/v1", api_key="unused", temperature=0,
                     max_tokens=200, max_retries=0)  # fmt: skip
    msg = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str) and "<tool_call>" not in str(msg.content)
    for method in ("function_calling", "json_schema"):
        city = llm.with_structured_output(City, method=method).invoke(ASK)
        assert isinstance(city, City) and city.city

"""Structured output and tools through the server, checked by `jsonschema` and the `openai` client:
50 generated schemas × 2 prompts must all parse and validate; every tool_choice; streaming calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from servers import real_server

from conftest import need

need("openai", "pip install openai")
need("jsonschema", "pip install jsonschema")

import jsonschema  # noqa: E402
import openai  # noqa: E402
from structured_cases import SCHEMAS, TIME, WEATHER  # noqa: E402

from localllm.server.runner import BackgroundServer  # noqa: E402

PROMPTS = ["Fill in this record about a small bakery.", "Describe a city you like as data."]


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with real_server(tmp_path_factory.mktemp("home"), queue=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_fifty_schemas_two_prompts_all_valid(client: openai.OpenAI) -> None:
    def ask(job: tuple[int, str]) -> tuple[int, str, str]:
        i, prompt = job
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=600,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i],
                                                                    "strict": True}})  # fmt: skip
        return i, r.choices[0].message.content, r.choices[0].finish_reason

    jobs = [(i, p) for i in range(len(SCHEMAS)) for p in PROMPTS]
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(ask, jobs))
    bad = []
    for i, text, finish in results:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i])
            assert finish == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            bad.append((i, finish, text[:200], str(e)[:200]))
    assert not bad, f"{len(bad)} of {len(results)} invalid: {bad[:3]}"


def test_json_object(client: openai.OpenAI) -> None:
    for prompt in ("Give the name and age of a person as a JSON object.", "A JSON object with two colors."):
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=400, response_format={"type": "json_object"})  # fmt: skip
        assert isinstance(json.loads(r.choices[0].message.content), dict)


ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def _valid_calls(message: Any, names: set[str]) -> list[dict[str, Any]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        out.append({"name": call.function.name, "arguments": args})
    return out


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=0, max_tokens=300, parallel_tool_calls=False)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    calls = _valid_calls(r.choices[0].message, {"get_weather", "get_time"})
    assert len(calls) == 1
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=300)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    calls = _valid_calls(r.choices[0].message, {"get_time"})
    assert calls and all(c["name"] == "get_time" for c in calls)


def test_parallel_tool_calls(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris and what time is it in Tokyo?"}]
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=0, max_tokens=1000)  # fmt: skip
    calls = _valid_calls(r.choices[0].message, {"get_weather", "get_time"})
    assert 1 <= len(calls) <= 8 and r.choices[0].finish_reason == "tool_calls"
    assert len({c.id for c in r.choices[0].message.tool_calls}) == len(calls)  # ids are distinct


def test_a_forced_call_is_never_cut_into_content(client: openai.OpenAI) -> None:
    # issue 39: with parallel_tool_calls at its default the model repeated its calls until the
    # token limit, and the complete calls came back as raw markup in content with "length"
    kw: dict[str, Any] = {"model": "smollm2", "messages": ASK, "tools": [WEATHER, TIME],
                          "tool_choice": "required", "temperature": 0}  # fmt: skip
    r = client.chat.completions.create(max_tokens=1000, **kw)
    calls = _valid_calls(r.choices[0].message, {"get_weather", "get_time"})
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls)  # a repeat ended the turn
    assert r.usage.completion_tokens < 1000
    cut = r.usage.completion_tokens - 5  # inside the last call
    r = client.chat.completions.create(max_tokens=cut, **kw)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert 1 <= len(_valid_calls(r.choices[0].message, {"get_weather", "get_time"})) < len(calls) + 1
    chunks = list(client.chat.completions.create(max_tokens=cut, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any((d.content or "").strip() for d in deltas)
    assert any(d.tool_calls for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_and_auto(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=40)  # fmt: skip
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                       temperature=0, max_tokens=200)  # fmt: skip
    m = r.choices[0].message
    if m.tool_calls:  # the model chose to call: then it is well-formed
        assert r.choices[0].finish_reason == "tool_calls"
        _valid_calls(m, {"get_weather"})
    else:
        assert m.content and "<tool_call>" not in m.content


def test_streamed_tool_calls(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                                 tool_choice="required", temperature=0, max_tokens=300,
                                                 parallel_tool_calls=False, stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any((d.content or "").strip() for d in deltas)  # the call's markup is never content
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_speculation_with_a_schema_is_refused_clearly(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="speculative decoding cannot be combined"):
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=10, extra_body={"speculative": "lookup"},
                                       response_format={"type": "json_object"})  # fmt: skip

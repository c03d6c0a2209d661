"""Constrained decoding in both engines (llguidance masks): schemas, forced tool calls, the CLI flag,
and what cannot be combined with it."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import in_home, need

need("jsonschema", "pip install jsonschema")
need("llguidance", "pip install llguidance")

import jsonschema  # noqa: E402
from structured_cases import SCHEMAS, TIME, WEATHER  # noqa: E402

from localllm import load  # noqa: E402
from localllm.errors import Unsupported  # noqa: E402
from localllm.structured import grammar_for  # noqa: E402
from localllm.types import Request  # noqa: E402


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def model(request: pytest.FixtureRequest, default_model_path: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator:  # fmt: skip
    with in_home(tmp_path_factory.mktemp("home")):
        m = load("smollm2", backend=request.param, ctx=1024, parallel=2)
    yield m
    m.close()


def test_schemas_hold_in_both_engines(model) -> None:
    rng = random.Random(0)
    for i in rng.sample(range(len(SCHEMAS)), 8):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[i]}}
        r = model.chat([{"role": "user", "content": "Fill in this record about a small bakery."}],
                       max_tokens=600, temperature=0, response_format=fmt)  # fmt: skip
        jsonschema.validate(json.loads(r.text), SCHEMAS[i])
        assert r.finish_reason == "stop"


def test_sampling_stays_inside_the_grammar(model) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[3]}}
    for seed in range(3):
        r = model.chat([{"role": "user", "content": "Describe a city you like as data."}], max_tokens=600,
                       temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed, response_format=fmt)  # fmt: skip
        jsonschema.validate(json.loads(r.text), SCHEMAS[3])


def test_a_forced_tool_call_in_both_engines(model) -> None:
    r = model.chat([{"role": "user", "content": "What is the weather like in Paris?"}], max_tokens=300,
                   temperature=0, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
    call = r.tool_calls[0]
    params = {"get_weather": WEATHER, "get_time": TIME}[call.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.arguments), params)


def test_forced_parallel_calls_end_at_a_repeat_and_survive_a_token_limit(model) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kw = {"temperature": 0, "tools": [WEATHER, TIME], "tool_choice": "required"}
    r = model.chat(ask, max_tokens=400, **kw)
    assert r.finish_reason == "tool_calls" and r.text == "" and r.tool_calls
    assert r.usage.completion_tokens < 400  # a repeated call ended the turn
    assert len({(c.name, c.arguments) for c in r.tool_calls}) == len(r.tool_calls)
    cut = model.chat(ask, max_tokens=r.usage.completion_tokens - 5, **kw)  # inside the last call
    assert cut.finish_reason == "tool_calls" and cut.text == ""
    assert [c.name for c in cut.tool_calls] == [c.name for c in r.tool_calls][: len(cut.tool_calls)]


def test_grammars() -> None:
    assert grammar_for(Request(prompt="x")) is None
    assert grammar_for(Request(prompt="x", response_format={"type": "text"})) is None
    g = grammar_for(Request(messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="required",
                            parallel_tool_calls=False))  # fmt: skip
    assert g.startswith('start: call\ncall: "<tool_call>\\n" %json') and '"const": "get_weather"' in g
    g = grammar_for(Request(messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "function": {"name": "get_time"}}))  # fmt: skip
    assert '"const": "get_time"' in g and "get_weather" not in g and "{0,7}" in g


def test_speculation_is_refused_with_a_grammar_and_off_by_default(default_model_path: Path) -> None:
    with load("smollm2", backend="llama.cpp", ctx=512, parallel=1, speculative="lookup") as m:
        fmt = {"type": "json_object"}
        ask = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
        with pytest.raises(Unsupported, match="cannot be combined"):
            m.chat(ask, response_format=fmt, speculative="lookup")
        r = m.chat(ask, response_format=fmt, max_tokens=200, temperature=0)  # the model's default: off here
        assert r.speculative is None and isinstance(json.loads(r.text), dict)


def test_run_json_schema_flag(tmp_path: Path, default_model_path: Path) -> None:
    from test_cli import run_process

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
              "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
              "required": ["city", "population"], "additionalProperties": False}  # fmt: skip
    f = tmp_path / "city.json"
    f.write_text(json.dumps(schema))
    r = run_process(["run", "smollm2", "Name a big city.", "--json-schema", str(f), "--temperature", "0",
                     "--max-tokens", "200"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)

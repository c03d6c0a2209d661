"""OpenAI's Responses API (issue 39), read by the official `openai` SDK's `client.responses`: text,
streaming (the SDK's own event accumulation), function tools and their outputs, json_schema,
previous_response_id from memory, reasoning items, and what is refused with a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import fake_server, real_server

from conftest import need

need("openai", "pip install openai")
need("jsonschema", "pip install jsonschema")

import jsonschema  # noqa: E402
import openai  # noqa: E402

from localllm.server.runner import BackgroundServer  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with real_server(tmp_path_factory.mktemp("home"), parallel=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_and_its_stream_agree(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input="Name three colours of the rainbow.",
                                instructions="You answer briefly.", temperature=0, max_output_tokens=40)  # fmt: skip
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens > 0 and r.output[0].type == "message"
    with client.responses.stream(model="smollm2", input="Name three colours of the rainbow.",
                                 instructions="You answer briefly.", temperature=0, max_output_tokens=40) as s:  # fmt: skip
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.status == r.status and final.id.startswith("resp_")
    cut = client.responses.create(model="smollm2", input="Name three colours of the rainbow.", temperature=0,
                                  max_output_tokens=4)  # fmt: skip
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_function_tools_round_trip_and_previous_response_id(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input="What is the weather like in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=200)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    assert not r.output_text  # the call's markup is never text
    with client.responses.stream(model="smollm2", input="What is the weather like in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=200, parallel_tool_calls=False) as s:  # fmt: skip
        args = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["function_call"] and json.loads(args) == json.loads(calls[0].arguments)
    # the tool's output continues the kept response: the model answers from it
    nxt = client.responses.create(model="smollm2", previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": c.call_id,
                                          "output": "Sunny, 24 degrees."} for c in calls],
                                  temperature=0, max_output_tokens=60)  # fmt: skip
    assert nxt.output_text and nxt.previous_response_id == r.id
    assert nxt.usage.input_tokens > r.usage.input_tokens  # the whole conversation was read
    assert client.responses.retrieve(nxt.id).output_text == nxt.output_text
    client.responses.delete(nxt.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="smollm2", previous_response_id=nxt.id, input="And tomorrow?")


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                           "minItems": 3, "maxItems": 3}},
              "required": ["colours"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model="smollm2", input="Name three colours of the rainbow.", temperature=0,
                                max_output_tokens=120,
                                text={"format": {"type": "json_schema", "name": "colours", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_what_it_does_not_keep_or_run_is_refused(client: openai.OpenAI) -> None:
    for kw, field in (({"tools": [{"type": "web_search"}]}, "web_search"), ({"background": True}, "background"),
                      ({"conversation": "conv_1"}, "conversation"), ({"truncation": "auto"}, "truncation"),
                      ({"previous_response_id": "resp_unknown"}, "previous_response_id")):  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=field):
            client.responses.create(model="smollm2", input="hi", max_output_tokens=5, **kw)
    with pytest.raises(openai.BadRequestError, match="items are not supported"):
        client.responses.create(model="smollm2", max_output_tokens=5, input=[{"type": "item_reference", "id": "x"}])


def test_reasoning_items() -> None:
    with fake_server(models=("fake-thinker",)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        ask = "say:<think>\nTwo and two.\n</think>\n\nFour."
        r = client.responses.create(model="fake-thinker", input=ask)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Four."
        assert r.output[0].content[0].text == "Two and two.\n" and r.usage.output_tokens_details.reasoning_tokens > 0
        with client.responses.stream(model="fake-thinker", input=ask) as st:
            thought = "".join(e.delta for e in st if e.type == "response.reasoning_text.delta")
            final = st.get_final_response()
        assert thought == "Two and two.\n" and final.output_text == "Four."
        off = client.responses.create(model="fake-thinker", input=ask, reasoning={"effort": "none"})
        assert [o.type for o in off.output] == ["message"]

"""Anthropic's Messages API (issue 39), read by the official `anthropic` SDK: its own parsing of
the answers and of the streamed events (`messages.stream` accumulates them), tools round trip,
count_tokens, stop sequences, thinking blocks, auth by `x-api-key`, errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import fake_server, real_server

from conftest import need

need("anthropic", "pip install anthropic")
need("httpx", "pip install httpx")

import anthropic  # noqa: E402
import httpx  # noqa: E402

from localllm.server.runner import BackgroundServer  # noqa: E402

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"]}}  # fmt: skip
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"temperature": 0}  # older SDKs' temperature= (this one sends no sampling fields)


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with real_server(tmp_path_factory.mktemp("home"), parallel=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_a_message_and_its_stream_agree(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="smollm2", max_tokens=40, messages=ASK, extra_body=GREEDY,
                               system="You answer briefly.")  # fmt: skip
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with client.messages.stream(model="smollm2", max_tokens=40, messages=ASK, extra_body=GREEDY,
                                system="You answer briefly.") as s:  # fmt: skip
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    counted = client.messages.count_tokens(model="smollm2", messages=ASK, system="You answer briefly.")
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="smollm2", max_tokens=5, messages=ASK, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    word = m.content[0].text.split()[1]
    s = client.messages.create(model="smollm2", max_tokens=40, messages=ASK, extra_body=GREEDY, stop_sequences=[word])
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == word
    assert word not in s.content[0].text and m.content[0].text.startswith(s.content[0].text)


def test_output_config_format_is_a_schema_the_answer_follows(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                           "minItems": 3, "maxItems": 3}},
              "required": ["colours"], "additionalProperties": False}  # fmt: skip
    m = client.messages.create(model="smollm2", max_tokens=120, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    data = json.loads(m.content[0].text)
    assert len(data["colours"]) == 3 and m.stop_reason == "end_turn"


def test_tools_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    m = client.messages.create(model="smollm2", max_tokens=200, messages=ask, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "any"})  # fmt: skip
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    assert not any(b.type == "text" and "<tool_call>" in b.text for b in m.content)
    with client.messages.stream(model="smollm2", max_tokens=200, messages=ask, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as s:  # fmt: skip
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == uses[0].input
    # the result goes back as the SDK's users send it; the model answers in text
    follow = [*ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                            "content": "Sunny, 24 degrees."} for u in uses]}]  # fmt: skip
    r = client.messages.create(model="smollm2", max_tokens=60, messages=follow, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "none"})  # fmt: skip
    assert r.content[0].type == "text" and r.content[0].text and r.stop_reason != "tool_use"
    with_result = client.messages.count_tokens(model="smollm2", messages=follow, tools=[WEATHER]).input_tokens
    assert with_result > client.messages.count_tokens(model="smollm2", messages=ask, tools=[WEATHER]).input_tokens


def test_what_cannot_be_honoured_is_refused_in_anthropics_shape(server: BackgroundServer,
                                                                client: anthropic.Anthropic) -> None:  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="max_tokens is required"):
        client.messages.create(model="smollm2", messages=ASK, max_tokens=None)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError, match="runs no tools"):
        client.messages.create(model="smollm2", max_tokens=10, messages=ASK,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])  # fmt: skip
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=10, messages=ASK)
    r = httpx.post(server.url + "/v1/messages", json={"model": "smollm2", "messages": "hi", "max_tokens": 5})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "messages must be a non-empty list"}}  # fmt: skip


def test_x_api_key_and_thinking_blocks() -> None:
    with fake_server(models=("fake", "fake-thinker"), api_key="s3cret") as s:
        good = anthropic.Anthropic(base_url=s.url, api_key="s3cret", max_retries=0)
        ask = [{"role": "user", "content": "say:<think>\nTwo and two.\n</think>\n\nFour."}]
        m = good.messages.create(model="fake-thinker", max_tokens=50, messages=ask,
                                 thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
            ("thinking", "Two and two.\n"), ("text", "Four.")]
        with good.messages.stream(model="fake-thinker", max_tokens=50, messages=ask) as st:
            kinds = [e.type for e in st]
            final = st.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Four."
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model="fake", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        r = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "wrong"},
                       json={"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        assert json.loads(r.text)["error"]["message"] == "the API key is not valid"

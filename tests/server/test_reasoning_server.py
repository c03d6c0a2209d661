"""A thinking model's reasoning through the server (issue 34), read by the official `openai` and
`ollama` clients: apart from the answer, streamed and whole, switched off per request, and refused
with one line on a model that does not think."""

from __future__ import annotations

import pytest
from servers import fake_server

from conftest import need

need("openai", "pip install openai")
need("ollama", "pip install ollama (Ollama's official client)")

import ollama  # noqa: E402
import openai  # noqa: E402

ASK = [{"role": "user", "content": "say:<think>\nTwo and two.\n</think>\n\nFour."}]


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    with fake_server(models=("fake", "fake-thinker")) as s:
        yield s


def test_openai_message_and_deltas_carry_reasoning_content(server) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    r = client.chat.completions.create(model="fake-thinker", messages=ASK, temperature=0)
    msg = r.choices[0].message
    assert msg.content == "Four." and msg.reasoning_content == "Two and two.\n"
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    thought, said = "", ""
    for chunk in client.chat.completions.create(model="fake-thinker", messages=ASK, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            said += delta.content or ""
    assert (thought, said) == ("Two and two.\n", "Four.")
    off = client.chat.completions.create(model="fake-thinker", messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert off.choices[0].message.content == "Four."
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_openai_think_on_a_model_that_does_not_think_is_a_400(server) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="does not think"):
        client.chat.completions.create(model="fake", messages=ASK, extra_body={"think": True})
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model="fake-thinker", messages=ASK,
                                       extra_body={"chat_template_kwargs": {"tools_style": 1}})  # fmt: skip


def test_ollama_think_gives_message_thinking(server) -> None:  # noqa: ANN001
    client = ollama.Client(host=server.url)
    r = client.chat(model="fake-thinker", messages=ASK, think=True)
    assert r.message.content == "Four." and r.message.thinking == "Two and two.\n"
    thought = said = ""
    for part in client.chat(model="fake-thinker", messages=ASK, think=True, stream=True):
        thought += part.message.thinking or ""
        said += part.message.content or ""
    assert (thought, said) == ("Two and two.\n", "Four.")
    off = client.chat(model="fake-thinker", messages=ASK, think=False)
    assert off.message.content == "Four." and not off.message.thinking
    g = client.generate(model="fake-thinker", prompt=ASK[0]["content"], think=True)
    assert g.response == "Four." and g.thinking == "Two and two.\n"
    with pytest.raises(ollama.ResponseError, match="does not think"):
        client.chat(model="fake", messages=ASK, think=True)

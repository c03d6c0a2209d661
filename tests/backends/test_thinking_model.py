"""A real Qwen3-architecture file that thinks (issue 34, item 3): a scripted model (`ggufs.
write_scripted_qwen3`) whose greedy answer is `<think>hm</think>OK`, run by each engine. The
reasoning comes apart from the answer through real tokenizers and detokenizers — `<think>` is a
user-defined token there, as in Qwen3's own files — and `think: false` renders the template's
empty think block."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakebackend import THINKING_TEMPLATE

from localllm.engine import load
from localllm.models_registry.store import Store
from localllm.types import Request, SamplingParams

from ggufs import write_scripted_qwen3

SCRIPT = ["\n", "<think>", "h", "m", "</think>", "O", "K", "<|im_end|>"]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripted_qwen3(tmp_path_factory.mktemp("qwen3") / "thinker.gguf", SCRIPT, THINKING_TEMPLATE)


def chat(**kw: object) -> Request:
    return Request(messages=({"role": "user", "content": "Why?"},),
                   sampling=SamplingParams(temperature=0, max_tokens=16), **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_a_thinking_model_s_reasoning_comes_apart(thinker: Path, backend: str) -> None:
    Store().add_file(thinker, "thinker", source="test")
    with load("thinker", backend=backend, dtype="f32" if backend == "torch" else "auto", ctx=256, parallel=1) as m:
        stream = m.submit(chat())
        chunks = list(stream)
        result = stream.result
        assert (result.reasoning, result.text) == ("hm", "OK"), result
        assert "".join(c.reasoning for c in chunks) == "hm" and "".join(c.text for c in chunks) == "OK"
        assert result.usage.reasoning_tokens == 4  # <think> h m </think>
        assert result.usage.completion_tokens == 6
        off = m.submit(chat(think=False)).wait()
        assert off.reasoning is None and "hm" not in off.text and "<think>" not in off.text

"""A real Qwen3-architecture file that thinks (issue 34, item 3): a scripted model (`ggufs.
write_scripted_qwen3`) whose greedy answer is `<think>hm</think>OK`, run by each engine. The
reasoning comes apart from the answer through real tokenizers and detokenizers — `<think>` is a
user-defined token there, as in Qwen3's own files — and `think: false` renders the template's
empty think block."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakebackend import HARMONY_TEMPLATE, THINKING_TEMPLATE

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


# gpt-oss (harmony): the channel tokens are control tokens in its files, which llama.cpp (and our
# tokenizer after it) writes out as text; `<|end|>` ends a message, `<|return|>` the generation.
# A scripted model only sees its last token, so one file reasons and one answers straight away.
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
HARMONY_SCRIPTS = {
    "reasons": (["t", "<|channel|>", "analysis", "<|message|>", "h", "m", "<|end|>", "<|return|>"],
                ("hm", "")),
    "answers": (["t", "<|channel|>", "final", "<|message|>", "O", "K", "<|return|>"], (None, "OK")),
}  # fmt: skip


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gpt-oss")
    return {name: write_scripted_qwen3(d / f"{name}.gguf", chain, HARMONY_TEMPLATE, controls=HARMONY_TOKENS,
                                       words=["analysis", "final"], eos="<|return|>")
            for name, (chain, _) in HARMONY_SCRIPTS.items()}  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_gpt_oss_channels_come_apart(harmony: dict[str, Path], backend: str) -> None:
    for name, (chain, want) in HARMONY_SCRIPTS.items():
        Store().add_file(harmony[name], f"harmony-{name}", source="test")
        with load(f"harmony-{name}", backend=backend, dtype="f32" if backend == "torch" else "auto",
                  ctx=256, parallel=1) as m:  # fmt: skip
            end, message_end = (m.runner.tokenize(t, add_special=False)[0] for t in ("<|return|>", "<|end|>"))
            assert m.runner.is_end(end) and not m.runner.is_end(message_end)
            r = m.submit(chat(think="low")).wait()
            assert (r.reasoning, r.text) == want, (name, r)
            assert r.finish_reason == "stop" and r.usage.completion_tokens == len(chain) - 2

"""llama.cpp's utility routes (issue 39): /tokenize and /detokenize against localllm's own tokenizer,
/apply-template against the engine's rendering, /props, /infill on a model with fill-in-the-middle
tokens (a scripted Qwen2.5-Coder-style GGUF, in both engines) and its one-line refusal on the
default model, /v1/rerank refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakebackend import THINKING_TEMPLATE

from conftest import in_home, need

need("httpx", "pip install httpx")

import httpx  # noqa: E402

from localllm.engine import load  # noqa: E402
from localllm.models_registry.store import Store  # noqa: E402
from localllm.server.config import ServerConfig  # noqa: E402
from localllm.server.runner import BackgroundServer  # noqa: E402
from localllm.types import LoadOptions, Request, SamplingParams  # noqa: E402

from ggufs import write_scripted_qwen3  # noqa: E402

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]
SCRIPT = ["<|fim_middle|>", "4", "2", "<|im_end|>"]  # the middle the scripted coder writes
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, friend!"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """The default model and a scripted coder with fill-in-the-middle tokens, both loaded at start
    (each test has its own LOCALLLM_HOME: a model loaded later would be looked for there)."""
    home = tmp_path_factory.mktemp("home")
    path = write_scripted_qwen3(tmp_path_factory.mktemp("coder") / "coder.gguf", SCRIPT, THINKING_TEMPLATE,
                                controls=FIM)  # fmt: skip
    with in_home(home):
        Store().add_file(path, "coder", source="test")
        cfg = ServerConfig(port=0, models=("smollm2", "coder"),
                           options=LoadOptions(backend="llama.cpp", ctx=2048, parallel=1))  # fmt: skip
        server = BackgroundServer(cfg).start()
    try:
        yield server
    finally:
        server.stop()


def post(server: BackgroundServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_tokenize_detokenize_and_the_template_are_the_engine_s(server: BackgroundServer) -> None:
    text = "Hello, world! Ünïcödé and 日本語."
    with load("smollm2", backend="llama.cpp", ctx=256, parallel=1) as m:
        ids, special = m.tokenize(text, add_special=False), m.tokenize(text, add_special=True)
        rendered = m.render(Request(messages=tuple(MESSAGES), tools=tuple(TOOLS)))
    assert post(server, "/tokenize", {"content": text}).json() == {"tokens": ids}
    assert post(server, "/tokenize", {"content": text, "add_special": True}).json() == {"tokens": special}
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in pieces).decode() == text  # fmt: skip
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text}
    r = post(server, "/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and "not a token" in r.json()["error"]["message"]
    assert post(server, "/apply-template", {"messages": MESSAGES, "tools": TOOLS}).json() == {"prompt": rendered}
    assert "<|im_start|>user\nHello there, friend!" in rendered


def test_props(server: BackgroundServer) -> None:
    p = httpx.get(server.url + "/props", timeout=60).json()
    assert p["default_generation_settings"]["n_ctx"] == 2048 and p["total_slots"] == 1
    assert "<|im_start|>" in p["chat_template"] and p["infill"] is False and p["modalities"]["vision"] is False
    assert p["model_alias"].startswith("smollm2") and "path" not in json.dumps(p)  # no file paths over HTTP


def test_infill_is_refused_without_fim_tokens_and_rerank_everywhere(server: BackgroundServer) -> None:
    r = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 8})
    assert r.status_code == 400 and "no fill-in-the-middle tokens" in r.json()["error"]["message"]
    r = post(server, "/v1/rerank", {"query": "q", "documents": ["a", "b"]})
    assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]


def test_infill_on_a_fim_model(server: BackgroundServer) -> None:
    body = {"model": "coder", "input_prefix": "x = ", "input_suffix": "\n", "temperature": 0, "n_predict": 8}
    r = post(server, "/infill", body).json()
    # PRE "x = " SUF "\n" MID: one byte token each, no BOS (the model adds none)
    assert (r["content"], r["stop_type"], r["tokens_evaluated"]) == ("42", "eos", 3 + 4 + 1)
    extra = post(server, "/infill", body | {"input_extra": [{"filename": "a.py", "text": "y = 1"}]}).json()
    assert extra["content"] == "42" and extra["tokens_evaluated"] == 8 + 1 + len("a.py\ny = 1")
    with httpx.stream("POST", server.url + "/infill", json=body | {"stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == "42" and events[-1]["stop"] is True


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_fim_prompts_in_both_engines(tmp_path: Path, backend: str) -> None:
    path = write_scripted_qwen3(tmp_path / "coder.gguf", SCRIPT, THINKING_TEMPLATE, controls=FIM)
    with in_home(tmp_path / "home"):
        Store().add_file(path, "coder", source="test")
        with load("coder", backend=backend, dtype="f32" if backend == "torch" else "auto", ctx=256, parallel=1) as m:
            marks = m.fim_tokens()
            assert set(marks) == {"pre", "suf", "mid", "sep"}
            r = m.submit(Request(prompt="", fim=("a", "b"), sampling=SamplingParams(temperature=0, max_tokens=8))).wait()
            assert r.text == "42" and r.usage.prompt_tokens == 5
            assert m.prompt_tokens(Request(prompt="", fim=("a", "b"))) == [
                marks["pre"], *m.tokenize("a", add_special=False), marks["suf"],
                *m.tokenize("b", add_special=False), marks["mid"]]  # fmt: skip


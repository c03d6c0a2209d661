"""The real default model behind the server, driven by the official `openai` client (sync, async,
streaming) and by a plain-HTTP Ollama client."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import real_server

from conftest import need

need("openai", "pip install openai")

import httpx  # noqa: E402
import openai  # noqa: E402

from localllm.server.runner import BackgroundServer  # noqa: E402

HI = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with real_server(tmp_path_factory.mktemp("home")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "smollm2" and "smollm2:135m-instruct-q4_1" in ids
    assert client.models.retrieve("smollm2").id == "smollm2:135m-instruct-q4_1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nothing-like-it")


def test_chat_matches_the_engine(client: openai.OpenAI, server: BackgroundServer) -> None:
    r = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=24, temperature=0)
    (model,) = server.served.pool.models()
    solo = model.chat(HI, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == solo.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == solo.finish_reason == "length"
    assert r.usage.prompt_tokens == solo.usage.prompt_tokens and r.usage.completion_tokens == 24
    assert r.model == "smollm2:135m-instruct-q4_1" and r.id.startswith("chatcmpl-")
    assert r.system_fingerprint.startswith("localllm-")


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=HI, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="smollm2", messages=HI, max_tokens=5, stream=True))
    assert all(c.usage is None for c in plain)


def test_stop_seed_and_max_completion_tokens(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(model="smollm2", messages=HI, max_completion_tokens=30, temperature=0)
    text = base.choices[0].message.content
    cut = text.split()[2]
    stopped = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=30, temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(cut)]
    a, b = (client.chat.completions.create(model="smollm2", messages=HI, max_tokens=16, temperature=1.0, seed=7)
            for _ in range(2))  # fmt: skip
    assert a.choices[0].message.content == b.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="smollm2", messages=HI, n=2)


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)  # greedy: the best one
    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                  temperature=0, logprobs=2)  # fmt: skip
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0


def test_completions_raw_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=0)
    parts = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=0,
                                      stream=True)  # fmt: skip
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 12


def test_embeddings(client: openai.OpenAI) -> None:
    e = client.embeddings.create(model="smollm2", input=["a cat", "a kitten", "tax law"])
    v = [d.embedding for d in e.data]
    assert [d.index for d in e.data] == [0, 1, 2] and len(v[0]) == 576
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert dot(v[0], v[0]) == pytest.approx(1, abs=1e-4)
    assert dot(v[0], v[1]) > dot(v[0], v[2])
    b64 = client.embeddings.create(model="smollm2", input="a cat", encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(v[0], abs=1e-6)


def test_async_client_concurrently(server: BackgroundServer) -> None:
    async def go() -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        asks = [[{"role": "user", "content": f"Say the number {i}."}] for i in range(4)]
        rs = await asyncio.gather(*(c.chat.completions.create(model="smollm2", messages=m, max_tokens=12,
                                                               temperature=0) for m in asks))  # fmt: skip
        await c.close()
        return [r.choices[0].message.content for r in rs]

    got = asyncio.run(go())
    (model,) = server.served.pool.models()
    solo = [model.chat([{"role": "user", "content": f"Say the number {i}."}], max_tokens=12, temperature=0).text
            for i in range(4)]  # fmt: skip
    assert got == solo


def test_ollama_chat_streams_ndjson(server: BackgroundServer, client: openai.OpenAI) -> None:
    body = {"model": "smollm2", "messages": HI, "options": {"temperature": 0, "num_predict": 16}}
    lines = []
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(not x["done"] for x in lines[:-1]) and lines[-1]["done"]
    text = "".join(x["message"]["content"] for x in lines)
    oa = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=16, temperature=0)
    assert text == oa.choices[0].message.content
    last = lines[-1]
    assert last["eval_count"] == 16 and last["done_reason"] == "length" and last["prompt_eval_count"] > 0
    assert last["total_duration"] > last["eval_duration"] > 0
    whole = httpx.post(server.url + "/api/chat", json=body | {"stream": False}, timeout=60).json()
    assert whole["message"]["content"] == text and whole["done"]


def test_ollama_generate_tags_show_ps_version(server: BackgroundServer) -> None:
    u = server.url
    g = httpx.post(u + "/api/generate", json={"model": "smollm2", "prompt": "Once upon a time", "raw": True,
                                             "stream": False, "options": {"temperature": 0, "num_predict": 8}},
                   timeout=60).json()  # fmt: skip
    assert g["done"] and g["eval_count"] == 8 and g["response"]
    tags = httpx.get(u + "/api/tags").json()["models"]
    (tag,) = [t for t in tags if t["name"] == "smollm2:135m-instruct-q4_1"]
    assert tag["details"]["quantization_level"] == "Q4_1" and tag["details"]["family"] == "llama"
    assert len(tag["digest"]) == 64 and tag["size"] > 50_000_000
    show = httpx.post(u + "/api/show", json={"model": "smollm2"}).json()
    assert "<|im_start|>" in show["template"] and show["model_info"]["general.architecture"] == "llama"
    ps = httpx.get(u + "/api/ps").json()["models"]
    assert ps[0]["name"] == "smollm2:135m-instruct-q4_1" and ps[0]["localllm"]["parallel"] == 4
    assert httpx.get(u + "/api/version").json()["version"]
    emb = httpx.post(u + "/api/embed", json={"model": "smollm2", "input": ["hi", "there"]}).json()
    assert len(emb["embeddings"]) == 2
    legacy = httpx.post(u + "/api/embeddings", json={"model": "smollm2", "prompt": "hi"}).json()
    # the legacy route: one prompt, one vector (a batch of two may round a little otherwise)
    assert max(abs(a - b) for a, b in zip(legacy["embedding"], emb["embeddings"][0], strict=True)) < 1e-3


def test_metrics_after_traffic(server: BackgroundServer, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="smollm2", messages=HI, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("localllm_ttft_seconds_bucket", "localllm_tpot_seconds_bucket", "localllm_prompt_tokens_total",
                 "localllm_completion_tokens_total", "localllm_requests_total", "localllm_queue_depth",
                 "localllm_running_sequences", "localllm_kv_cache_bytes", "localllm_prefix_cache_hit_tokens_total"):  # fmt: skip
        assert name in text, name


def test_ps_command_reads_the_running_server(server: BackgroundServer) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "localllm", "ps", "--url", server.url, "--json"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["models"][0]["name"] == "smollm2:135m-instruct-q4_1"
    r = subprocess.run([sys.executable, "-m", "localllm", "ps", "--url", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 1 and "no localllm server answers" in r.stderr

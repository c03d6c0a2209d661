"""Ollama's API as its official client sees it (issue 34): errors in Ollama's shape on every /api/*
route (401/403/413 included), documented fields this server does not honour refused by name,
`keep_alive` (per request, 0 unloads, negative keeps), `/api/ps` expiry, `GET /` and `localllm stop`."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from datetime import datetime

import pytest
from servers import fake_server

from conftest import need

need("ollama", "pip install ollama (Ollama's official client)")
need("httpx", "pip install httpx")

import httpx  # noqa: E402
import ollama  # noqa: E402

from localllm.errors import LocalLLMError  # noqa: E402
from localllm.server.config import keep_alive_seconds  # noqa: E402

SAY = [{"role": "user", "content": "say:hi"}]


def loaded(url: str) -> dict[str, str]:
    return {m["name"]: m["expires_at"] for m in httpx.get(url + "/api/ps").json()["models"]}


def seconds_until(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - time.time()


def test_keep_alive_durations() -> None:
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds(10) == 10 and keep_alive_seconds("2.5s") == 2.5
    assert keep_alive_seconds("0") == 0 and keep_alive_seconds(0) == 0
    assert keep_alive_seconds(-1) == math.inf and keep_alive_seconds("-1m") == math.inf
    for bad in ("soon", "5 minutes", True, [5], "5d"):
        with pytest.raises(LocalLLMError, match="keep_alive must be"):
            keep_alive_seconds(bad)


def test_errors_are_ollama_shaped_and_name_what_is_refused() -> None:
    with fake_server(models=("fake",), keep_alive=0) as s:
        client = ollama.Client(host=s.url)
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="nope", messages=SAY)
        assert e.value.status_code == 404 and isinstance(e.value.error, str) and "nope" in e.value.error
        refused = {
            "options.num_gpu": {"model": "fake", "messages": SAY, "options": {"num_gpu": 1.5}},
            "options.warmth": {"model": "fake", "messages": SAY, "options": {"warmth": 1}},
            "options.main_gpu": {"model": "fake", "messages": SAY, "options": {"main_gpu": 0}},
            "messages[0].images": {"model": "fake", "messages": [SAY[0] | {"images": "aGk="}]},
            "keep_alive": {"model": "fake", "messages": SAY, "keep_alive": "soon"},
            "think": {"model": "fake", "messages": SAY, "think": "very"},
            "cannot read images": {"model": "fake", "messages": [SAY[0] | {"images": ["aGk="]}]},
        }
        for field, body in refused.items():
            r = httpx.post(s.url + "/api/chat", json=body)
            assert r.status_code == 400 and field in r.json()["error"], (field, r.text)
        for field in ("suffix", "template", "images"):
            r = httpx.post(s.url + "/api/generate", json={"model": "fake", "prompt": "x", field: ["x"]})
            assert r.status_code == 400 and field in r.json()["error"], (field, r.text)
        for method, path in (("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
                             ("POST", "/api/copy"), ("DELETE", "/api/delete"),
                             ("POST", "/api/blobs/sha256:00")):  # fmt: skip
            r = httpx.request(method, s.url + path, json={"model": "fake"})
            said = r.json()["error"]
            assert r.status_code == 400 and f"{path.split('/')[2]} route" in said and "use localllm" in said
        assert httpx.head(s.url + "/api/blobs/sha256:00").status_code == 400
        r = httpx.post(s.url + "/api/chat", content=b"x" * (9 * 2**20))  # over --max-body
        assert r.status_code == 413 and isinstance(r.json()["error"], str)
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "nope", "messages": SAY})
        assert r.json()["error"]["code"] == "model_not_found"  # OpenAI routes keep OpenAI's shape
    with fake_server(models=("fake",), api_key="sekrit") as s:
        r = httpx.get(s.url + "/api/tags")
        assert r.status_code == 401 and isinstance(r.json()["error"], str)
        assert httpx.get(s.url + "/v1/models").json()["error"]["code"] == "missing_api_key"
        assert httpx.get(s.url + "/").text == "Ollama is running"  # open: clients ask it first
        r = httpx.get(s.url + "/api/tags", headers={"Host": "evil.example"})
        assert r.status_code == 403 and isinstance(r.json()["error"], str)


def test_root_and_keep_alive_and_stop() -> None:
    with fake_server(models=("fake",), keep_alive=300.0) as s:  # the server's default: 5m
        assert httpx.get(s.url + "/").text == "Ollama is running"
        assert httpx.head(s.url + "/").status_code == 200
        client = ollama.Client(host=s.url)
        assert loaded(s.url) == {"fake": "9999-12-31T23:59:59Z"}  # served: kept until stopped
        assert client.chat(model="fake-b", messages=SAY).message.content == "hi"
        assert 290 < seconds_until(loaded(s.url)["fake-b"]) <= 300
        client.chat(model="fake-b", messages=SAY, keep_alive="1h")
        assert 3590 < seconds_until(loaded(s.url)["fake-b"]) <= 3600
        client.chat(model="fake-b", messages=SAY, keep_alive=-1)
        assert loaded(s.url)["fake-b"] == "9999-12-31T23:59:59Z"
        client.chat(model="fake-b", messages=SAY, keep_alive=0)  # unloads when the answer is done
        assert "fake-b" not in loaded(s.url)
        r = client.generate(model="fake-c", prompt="")  # an empty prompt loads the model
        assert r.done_reason == "load" and "fake-c" in loaded(s.url)
        r = client.generate(model="fake-c", prompt="", keep_alive=0)
        assert r.done_reason == "unload" and "fake-c" not in loaded(s.url)
        stop = [sys.executable, "-m", "localllm", "stop", "fake", "--url", s.url]
        p = subprocess.run(stop, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "fake: unloaded" in p.stdout, p.stderr
        assert loaded(s.url) == {}
        p = subprocess.run(stop, capture_output=True, text=True, timeout=60)  # nothing left to stop
        assert p.returncode == 1 and "fake is not loaded" in p.stderr and len(p.stderr.splitlines()) == 1


def test_num_gpu_is_llama_cpps_gpu_layers() -> None:
    """Ollama's options.num_gpu (layers on the GPU) is --gpu-layers for the load: a number, or -1
    for the planner's choice; num_ctx the context, as before."""
    from localllm.server.ollama_api import _parse

    parsed, _ = _parse({"model": "m", "options": {"num_gpu": 0, "num_ctx": 2048}})
    assert (parsed.gpu_layers, parsed.ctx) == ("0", 2048)
    assert _parse({"model": "m", "options": {"num_gpu": -1}})[0].gpu_layers == "auto"
    assert _parse({"model": "m"})[0].gpu_layers is None  # the server's own --gpu-layers

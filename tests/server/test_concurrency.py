"""Sixteen streaming clients against the real default model on both engines: `--parallel 4` and a
queue of 8 take twelve, which complete with their solo greedy text; four get 503 + Retry-After;
four that disconnect mid-stream free their slots."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from servers import real_server

from localllm.server.runner import BackgroundServer

TOPICS = ["the sea", "a forest", "winter", "a city at night", "bread", "a clock", "rain", "a library",
          "mountains", "a cat", "the moon", "a train", "coffee", "a garden", "music", "a bridge"]  # fmt: skip


def ask(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short poem about {TOPICS[i]}."}]


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def server(request: pytest.FixtureRequest, default_model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:  # fmt: skip
    with real_server(tmp_path_factory.mktemp("home"), backend=request.param, ctx=1024, queue=8) as s:
        yield s


def stream(url: str, i: int, max_tokens: int = 24) -> tuple[int, str, dict[str, str]]:
    body = {"model": "smollm2", "messages": ask(i), "stream": True, "temperature": 0, "max_tokens": max_tokens}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, dict(r.headers)
        text = ""
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
        return 200, text, dict(r.headers)


def common_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split()):
        if x != y:
            break
        n += 1
    return n


def test_sixteen_streams(server: BackgroundServer) -> None:
    (model,) = server.served.pool.models()
    runner = model.runner
    hold = threading.Event()
    forward = runner.forward

    def held_forward(pieces, **kw):  # noqa: ANN001, ANN003, ANN202 - the real forward, once every client has arrived
        hold.wait()
        return forward(pieces, **kw)

    runner.forward = held_forward
    gate = server.served.gate(model)
    try:
        with ThreadPoolExecutor(16) as ex:
            futures = [ex.submit(stream, server.url, i) for i in range(16)]
            deadline = time.monotonic() + 60
            while not (sum(f.done() for f in futures) == 4 and gate.inflight == 12):
                assert time.monotonic() < deadline, "the clients did not line up"
                time.sleep(0.01)
            hold.set()
            results = [f.result() for f in futures]
    finally:
        runner.forward = forward
    refused = [r for r in results if r[0] != 200]
    assert len(refused) == 4, [(r[0], r[1][:80]) for r in results]
    for status, body, headers in refused:
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "server_busy"
    served = [(i, r[1]) for i, r in enumerate(results) if r[0] == 200]
    assert len(served) == 12 and all(text for _, text in served)
    same, near = 0, []
    for i, text in served:
        solo = model.chat(ask(i), max_tokens=24, temperature=0).text
        if text == solo:
            same += 1
        else:  # batched kernels may round differently: measured and bounded, not hidden
            near.append((common_words(text, solo), len(solo.split()), text, solo))
    if server.config.options.backend == "llama.cpp":
        assert same == 12, near
    else:  # the CPU's default int4/fp16 GEMM rounds a row by how many rows it is evaluated with
        # (the batch, the prefill chunk): measured here 7-12 of 12 identical; the others part at a
        # near-tie, after 0-16 words (0: a prompt read in other chunks than alone)
        assert same >= 6, near
    print(f"\n{server.config.options.backend}: {same} of 12 identical to their solo runs; others: {near}")
    deadline = time.monotonic() + 30
    while model.running or gate.inflight:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_four_disconnect_mid_stream(server: BackgroundServer) -> None:
    (model,) = server.served.pool.models()
    body = {"model": "smollm2", "messages": ask(0), "stream": True, "temperature": 0, "max_tokens": 400}
    clients = [httpx.Client(timeout=120) for _ in range(4)]
    cms = [c.stream("POST", server.url + "/v1/chat/completions", json=body) for c in clients]
    readers = []
    for cm in cms:
        r = cm.__enter__()
        assert r.status_code == 200
        lines = r.iter_lines()
        readers.append(lines)
        while not next(lines).startswith('data: {"id"'):
            pass
    deadline = time.monotonic() + 60
    while model.running < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for cm, c in zip(cms, clients):
        cm.__exit__(None, None, None)
        c.close()
    deadline = time.monotonic() + 30
    while model.running:
        assert time.monotonic() < deadline, "the slots of gone clients were not freed"
        time.sleep(0.01)
    status, text, _ = stream(server.url, 5, max_tokens=8)
    assert status == 200 and text

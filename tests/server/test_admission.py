"""Admission with a scripted model: slots and a bounded queue, 503 + Retry-After beyond them,
clients that leave (mid-stream or during prompt processing) free their slots."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from servers import fake_server

from localllm.types import LoadOptions


def sse_text(lines: list[str]) -> tuple[str, str | None]:
    text, finish = "", None
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            body = json.loads(line[6:])
            for choice in body.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


def stream_chat(url: str, say: str) -> tuple[int, str, str | None, dict]:
    body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "say:" + say}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, None, dict(r.headers)
        text, finish = sse_text(list(r.iter_lines()))
        return 200, text, finish, dict(r.headers)


def wait_for(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def _opts(parallel: int) -> LoadOptions:
    return LoadOptions(parallel=parallel)


def the_model(server):
    (model,) = server.served.pool.models()
    return model


def test_sixteen_clients_four_slots_queue_of_eight() -> None:
    hold = threading.Event()
    with fake_server(hold=hold, queue=8, options=_opts(4)) as s:
        gate = s.served.gate(the_model(s))
        with ThreadPoolExecutor(16) as ex:
            futures = [ex.submit(stream_chat, s.url, f"answer number {i}") for i in range(16)]
            wait_for(lambda: sum(f.done() for f in futures) == 4 and gate.inflight == 12)
            refused = [f.result() for f in futures if f.done()]
            hold.set()
            results = [f.result() for f in futures]
        for status, body, _, headers in refused:
            assert status == 503
            assert json.loads(body)["error"]["code"] == "server_busy"
            assert int(headers["retry-after"]) >= 1
        done = [(i, r) for i, r in enumerate(results) if r[0] == 200]
        assert len(done) == 12, [(i, r[:3]) for i, r in enumerate(results) if r[0] != 200]
        for i, (_, text, finish, _) in done:
            assert (text, finish) == (f"answer number {i}", "stop")
        model = the_model(s)
        wait_for(lambda: model.running == 0 and gate.inflight == 0)
        metrics = httpx.get(s.url + "/metrics").text
        assert 'localllm_requests_total{route="/v1/chat/completions",status="503"} 4.0' in metrics
        assert 'localllm_requests_total{route="/v1/chat/completions",status="200"} 12.0' in metrics
        assert 'localllm_rejected_requests_total{model="fake"} 4.0' in metrics


def test_clients_that_leave_mid_stream_free_their_slots() -> None:
    with fake_server(step_s=0.01, n_ctx=1024, options=_opts(4), queue=0) as s:
        model = the_model(s)
        body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "say:" + "z" * 600}]}
        clients = [httpx.Client(timeout=30) for _ in range(4)]
        streams = [c.stream("POST", s.url + "/v1/chat/completions", json=body) for c in clients]
        responses = [st.__enter__() for st in streams]
        readers = []  # kept: a line iterator that is dropped closes its response
        for r in responses:
            assert r.status_code == 200
            lines = r.iter_lines()
            readers.append(lines)
            got = ""
            while len(got) < 5:
                line = next(lines)
                if line.startswith("data: "):
                    got += sse_text([line])[0]
        assert model.running == 4
        # every slot is taken and the queue is 0: a fifth is refused now
        assert stream_chat(s.url, "x")[0] == 503
        for st, c in zip(streams, clients):
            st.__exit__(None, None, None)
            c.close()
        wait_for(lambda: model.running == 0)
        assert not any(slot.busy for slot in model.slots.all)
        status, text, finish, _ = stream_chat(s.url, "after")
        assert (status, text, finish) == (200, "after", "stop")


def test_a_client_that_leaves_during_prompt_processing_frees_its_slot() -> None:
    # prompts go 8 tokens per step, 50 ms each: a 1,000-token prompt takes over 6 s to read
    with fake_server(step_s=0.05, n_ctx=2048, max_batch=8, options=_opts(1), queue=0) as s:
        model = the_model(s)
        backend = model.backend
        body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "q" * 1000 + " say:never"}]})
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())  # fmt: skip
        wait_for(lambda: model.running == 1 and len(backend.plans) >= 2)
        sock.close()  # the client goes away before any token
        at_close = len(backend.plans)
        wait_for(lambda: not model.slots.all[0].busy)
        assert len(backend.plans) - at_close <= 3  # let go within a step or so of noticing
        assert sum(backend.plans[-1].values()) > 0  # it was still reading the prompt
        assert stream_chat(s.url, "next")[1] == "next"


def test_a_model_that_does_not_fit_is_refused_with_numbers_and_the_loaded_one_stays() -> None:
    from servers import fake_loader

    from localllm.pool import ModelPool
    from localllm.server.config import ServerConfig
    from localllm.server.runner import BackgroundServer
    from localllm.server.served import Served

    def fit(name: str, options: LoadOptions) -> tuple[int, int]:
        return (50 * 2**30 if name == "fake-huge" else 2**20), 8 * 2**30  # needs 50 GiB of 8 free

    cfg = ServerConfig(port=0, models=("fake",))
    pool = ModelPool(fake_loader(), fit=fit, idle_s=0)
    with BackgroundServer(cfg, Served(cfg, pool)) as s:
        ask = {"messages": [{"role": "user", "content": "say:still here"}]}
        r = httpx.post(s.url + "/v1/chat/completions", json=ask | {"model": "fake-huge"})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory" and "50.0 GiB" in err["message"] and "8.0 GiB" in err["message"]
        r = httpx.post(s.url + "/v1/chat/completions", json=ask)
        assert r.json()["choices"][0]["message"]["content"] == "still here"
        assert [m.name for m in pool.models()] == ["fake"]
    pool.close()

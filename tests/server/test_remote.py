"""One loaded model per machine (issue 34, item 6): `localllm run` and the app use the copy a
running `localllm serve` holds (found through `server.json`, with its API key) when it suits the
options; `--local`, other options, or a server that does not answer load a copy here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakebackend import FakeRunner

from localllm.engine import Model
from localllm.errors import LocalLLMError
from localllm.pool import ModelPool
from localllm.remote import RemoteModel, connect, open_model, serving
from localllm.server.config import ServerConfig
from localllm.server.runner import BackgroundServer, state_file
from localllm.server.served import Served
from localllm.types import LoadOptions, Request, SamplingParams

DEFAULT = "smollm2:135m-instruct-q4_1"
GREEDY = SamplingParams(temperature=0)


@contextlib.contextmanager
def other_process(server: BackgroundServer, key: str | None = None) -> Iterator[None]:
    """`server.json` naming `server` as another process's (a child that lives as long as the test):
    this process's own server is never asked (the app's server screen)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"url": server.url, "pid": child.pid, "key": key}))
        yield
    finally:
        child.kill()
        child.wait()


@contextlib.contextmanager
def scripted_server(*, step_s: float = 0.0, models: tuple[str, ...] = (DEFAULT,),
                    **config: Any) -> Iterator[BackgroundServer]:  # fmt: skip
    """A server whose copy of the default model is the scripted runner (`say:TEXT` answers TEXT)."""
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    ensure_local("smollm2", Store())  # the store the server and the client share
    def load(name: str, options: LoadOptions) -> Model:
        return Model(FakeRunner(n_ctx=256, n_slots=options.parallel, step_s=step_s), name, options=options)

    cfg = ServerConfig(port=0, models=models, keep_alive=300.0, **config)
    pool = ModelPool(load, fit=None, idle_s=300)
    server = BackgroundServer(cfg, Served(cfg, pool)).start()
    try:
        yield server
    finally:
        server.stop()
        pool.close()


def ask(llm: Any, text: str, **kw: Any) -> Any:
    return llm.submit(Request(messages=({"role": "user", "content": text},), sampling=GREEDY, **kw))


def test_a_running_server_answers_for_run(default_model_path: Path) -> None:
    with scripted_server() as server, other_process(server):
        llm, why = connect("smollm2", LoadOptions(parallel=1))
        assert isinstance(llm, RemoteModel), why
        with llm:
            assert (llm.name, llm.n_ctx, llm.url) == (DEFAULT, 256, server.url)
            stream = ask(llm, "say:hello there")
            pieces = [c.text for c in stream if c.text]
            assert "".join(pieces) == "hello there" and len(pieces) > 1  # streamed
            result = stream.result
            assert result.text == "hello there" and result.finish_reason == "stop"
            assert result.usage.completion_tokens == len("hello there")  # the end token not counted
        assert [e.name for e in server.served.pool.loaded()] == [DEFAULT]  # one copy, the server's


def test_run_command_uses_the_server_and_local_loads_here(default_model_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from localllm.cli import main

    with scripted_server() as server, other_process(server):
        with pytest.raises(SystemExit) as ex:
            main(["run", "smollm2", "say:from the server", "--stats"])
        out = capsys.readouterr()
        assert ex.value.code == 0, out.err
        assert out.out.strip() == "from the server"
        assert "backend localllm serve, loaded in" in out.err and server.url in out.err
        with pytest.raises(SystemExit) as ex:
            main(["run", "smollm2", "Say hi", "--local", "--stats", "--max-tokens", "4"])
        out = capsys.readouterr()
        assert ex.value.code == 0, out.err
        assert "backend llama.cpp" in out.err or "backend torch" in out.err  # loaded here


def test_options_the_server_did_not_load_with_load_here(default_model_path: Path) -> None:
    with scripted_server() as server, other_process(server):
        llm, why = connect("smollm2", LoadOptions(ctx=256, parallel=1))  # what the server runs
        assert isinstance(llm, RemoteModel), why
        llm.close()
        llm, why = connect("smollm2", LoadOptions(ctx=128, parallel=1))
        assert llm is None
        assert why == (f"the server at {server.url} has {DEFAULT} loaded with other options than "
                       "--ctx 128: loading it here")  # fmt: skip
    with scripted_server(models=()) as server, other_process(server):
        llm, why = connect("smollm2", LoadOptions(kv_cache="q8_0"))
        assert why == (f"the server at {server.url} has not loaded {DEFAULT}, and loads it with its "
                       "own options, not --kv-cache q8_0: loading it here")  # fmt: skip
        said: list[str] = []
        with open_model("smollm2", LoadOptions(backend="llama.cpp", kv_cache="q8_0", ctx=512, parallel=1),
                        say=said.append) as here:  # fmt: skip
            assert isinstance(here, Model) and here.n_ctx == 512
        assert len(said) == 1 and "--ctx 512" in said[0] and said[0].endswith(": loading it here")


def test_without_options_the_server_loads_the_model_first(default_model_path: Path) -> None:
    with scripted_server(models=()) as server, other_process(server):
        assert server.served.pool.loaded() == []
        llm, why = connect("smollm2", LoadOptions())
        assert isinstance(llm, RemoteModel), why
        with llm:
            assert [e.name for e in server.served.pool.loaded()] == [DEFAULT]
            assert ask(llm, "say:ok").wait().text == "ok"


def test_cancel_stops_the_sequence_on_the_server(default_model_path: Path) -> None:
    with scripted_server(step_s=0.05) as server, other_process(server):
        llm, _ = connect("smollm2", LoadOptions())
        with llm:
            stream = ask(llm, "say:" + "a long answer " * 8)
            first = next(iter(stream))
            assert first.text
            t0 = time.monotonic()
            stream.cancel()
            assert stream.wait().finish_reason == "cancelled"
            deadline = time.monotonic() + 30
            (model,) = server.served.pool.models()
            while server.served.gate(model).inflight:  # the server saw its client go: done with it
                assert time.monotonic() < deadline, "the server kept generating"
                time.sleep(0.02)
            assert time.monotonic() - t0 < 112 * 0.05, "the server generated the whole answer"


def test_errors_are_the_servers_one_line(default_model_path: Path) -> None:
    with scripted_server() as server, other_process(server):
        llm, _ = connect("smollm2", LoadOptions())
        with llm, pytest.raises(LocalLLMError) as e:
            ask(llm, "say:hi", think=True)  # the scripted model cannot think
        assert "think" in str(e.value) and "\n" not in str(e.value)


def test_the_key_comes_from_server_json(default_model_path: Path) -> None:
    with scripted_server(api_key="s3cret") as server:
        with other_process(server, key="s3cret"):
            llm, why = connect("smollm2", LoadOptions())
            assert isinstance(llm, RemoteModel), why
            assert "s3cret" not in repr(serving())  # never shown
            llm.close()
        with other_process(server, key="wrong"):
            llm, why = connect("smollm2", LoadOptions())
            assert llm is None
            assert why.startswith(f"the server at {server.url} did not answer (") and "s3cret" not in why


def test_a_stale_or_silent_server_json_is_passed_over(default_model_path: Path) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": dead.pid, "key": None}))
    assert serving() is None and connect("smollm2", LoadOptions()) == (None, "")
    path.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid(), "key": None}))
    assert serving() is None  # this process's own server (the app's) is never asked
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        path.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": child.pid, "key": None}))
        llm, why = connect("smollm2", LoadOptions())
        assert llm is None and why.startswith("the server at http://127.0.0.1:9 did not answer (")
    finally:
        child.kill()
        child.wait()


def test_reasoning_streams_apart_through_the_server() -> None:
    from servers import fake_server

    with fake_server(models=("fake-thinker",)) as server, httpx.Client(base_url=server.url) as client:
        llm = RemoteModel(client, "fake-thinker", server.url, {"n_ctx": 256})
        stream = ask(llm, "say:<think>mull it over</think>The answer.")
        chunks = list(stream)
        assert "".join(c.reasoning for c in chunks).strip() == "mull it over"
        assert "".join(c.text for c in chunks).strip() == "The answer."
        assert stream.result.reasoning.strip() == "mull it over"
        assert stream.result.usage.reasoning_tokens > 0


def test_the_app_chats_through_the_server(default_model_path: Path) -> None:
    from localllm.tui.app import LocalLLMApp
    from localllm.tui.chat_screen import ChatScreen

    async def chat() -> None:
        app = LocalLLMApp(chat_model="smollm2")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            await pilot.press(*"say:through the server", "enter")
            deadline = time.monotonic() + 60
            while screen.generating or not screen.history:
                assert time.monotonic() < deadline, "no answer"
                await pilot.pause(0.05)
            assert screen.history[-1] == {"role": "assistant", "content": "through the server"}
            assert isinstance(screen.llm, RemoteModel)

    with scripted_server() as server, other_process(server):
        asyncio.run(chat())
        assert [e.name for e in server.served.pool.loaded()] == [DEFAULT]


def test_a_real_server_and_run_give_the_same_greedy_answer(localllm_home: Path,
                                                           default_model_path: Path, tmp_path: Path) -> None:  # fmt: skip
    """The real `localllm serve` and `localllm run` as a user runs them: the answer through the server
    equals the one a local load gives, and the server holds the only copy."""
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    env = dict(os.environ, LOCALLLM_HOME=str(localllm_home))
    env.pop("LOCALLLM_API_KEY", None)
    server = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--port", "0", "--model", "smollm2",
                               "--backend", "llama.cpp", "--ctx", "1024", "--parallel", "2",
                               "--api-key-file", str(key_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        url = server.stderr.readline().split()[1]
        assert (localllm_home / "server.json").stat().st_mode & 0o077 == 0  # the key is the user's alone
        run = [sys.executable, "-m", "localllm", "run", "smollm2", "Name three colors.", "--temperature", "0",
               "--max-tokens", "24", "--stats"]  # fmt: skip
        remote = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
        assert remote.returncode == 0, remote.stderr
        assert "backend localllm serve" in remote.stderr
        local = subprocess.run([*run, "--local", "--backend", "llama.cpp", "--ctx", "1024"],
                               capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert local.returncode == 0, local.stderr
        assert "backend llama.cpp" in local.stderr
        assert remote.stdout == local.stdout and remote.stdout.strip()
        ps = httpx.get(url + "/api/ps", headers={"Authorization": "Bearer k3y"}).json()
        assert [m["name"] for m in ps["models"]] == [DEFAULT]
    finally:
        server.terminate()
        server.wait(30)


def test_images_go_to_the_server_as_image_url_parts() -> None:
    from localllm.backends.base import MEDIA_MARKER
    from localllm.remote import body

    placed = Request(messages=({"role": "user", "content": f"a {MEDIA_MARKER} b", "images": [b"x", b"y"]},),
                     sampling=GREEDY)  # fmt: skip
    _, sent = body("m", placed)
    parts = sent["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text", "image_url", "text"]
    assert parts[0]["image_url"]["url"] == "data:image/png;base64,eA=="  # b"x": before the text
    assert parts[2]["image_url"]["url"] == "data:image/png;base64,eQ==" and parts[3]["text"] == " b"
    json.dumps(sent)  # bytes never reach the wire

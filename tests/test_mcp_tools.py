"""MCP tools in the REPL (issue 39): a stdio MCP server written with the official `mcp` SDK, run by
`mcp_tools.Toolbox` through the SDK's client; its tools offered to the model, every call asked
for (once / always / deny), its result fed back, the loop bounded; a server that crashes, hangs
or never starts is one line and the chat goes on. The model is the engine over the scripted
runner (`say:TEXT` in its prompt makes it say TEXT), so each turn is exactly known."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakebackend import FakeRunner

from conftest import need

need("mcp", "pip install mcp")

from localllm.engine import Model  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.mcp_tools import MAX_ROUNDS, Toolbox, read_config  # noqa: E402
from localllm.repl import Chat, ask_permission  # noqa: E402
from localllm.types import LoadOptions  # noqa: E402

SERVER = '''
import os, sys, time
try:
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1
    from mcp.server.fastmcp import FastMCP as MCPServer

app = MCPServer("test-tools")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@app.tool()
def lookup(q: str) -> str:
    """Look something up (says what the scripted model answers next)."""
    return "say:The answer to " + q + " is 42."


@app.tool()
def hang() -> str:
    """Never answers."""
    time.sleep(3600)
    return ""


@app.tool()
def crash() -> str:
    """Ends the server."""
    os._exit(3)


if len(sys.argv) > 2 and sys.argv[1] == "--http":  # streamable HTTP on a port
    try:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    except TypeError:  # mcp 1: host and port are settings
        app.settings.host, app.settings.port = "127.0.0.1", int(sys.argv[2])
        app.run("streamable-http")
else:
    app.run()
'''


def call_text(name: str, args: dict[str, Any]) -> str:
    return "say:<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    (tmp_path / "server.py").write_text(SERVER)
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "tools": {"command": sys.executable, "args": [str(tmp_path / "server.py")]},
        "broken": {"command": str(tmp_path / "no-such-program")},
        "off": {"command": "whatever", "disabled": True}}}))  # fmt: skip
    return path


@pytest.fixture
def toolbox(config: Path) -> Iterator[Toolbox]:
    with Toolbox.from_file(config, timeout_s=1) as box:
        yield box


def test_the_servers_tools_run_and_failures_are_one_line(toolbox: Toolbox) -> None:
    assert toolbox.errors == [f"MCP server 'broken' did not start: [Errno 2] No such file or directory: "
                              f"'{toolbox.specs[1].command}'"]  # fmt: skip
    tools = {t["function"]["name"]: t["function"] for t in toolbox.tools()}
    assert set(tools) == {"add", "lookup", "hang", "crash"}
    assert tools["add"]["parameters"]["required"] == ["a", "b"] and tools["add"]["description"] == "Add two whole numbers."
    assert toolbox.call("add", {"a": 2, "b": 40}) == "42"
    assert toolbox.call("nope", {}) == "Error: there is no tool 'nope'"
    t = time.monotonic()
    assert toolbox.call("hang", {}) == "Error: hang did not answer within 1 s"
    assert time.monotonic() - t < 10
    assert toolbox.call("crash", {}).startswith("Error: crash failed: ")
    assert toolbox.call("add", {"a": 1, "b": 1}).startswith("Error: ")  # the server is gone: still one line


def test_a_bad_config_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "mcp.json"
    for text, said in (("{", "not valid JSON"), ("[]", "mcpServers"), ('{"mcpServers": {"x": {}}}', "command or a url"),
                       ('{"mcpServers": {"x": {"command": "a", "args": "b"}}}', "args is a list")):  # fmt: skip
        bad.write_text(text)
        with pytest.raises(LocalLLMError, match=said):
            read_config(bad)


def chat_over_tools(toolbox: Toolbox, answers: list[str]) -> tuple[Chat, list[Any], list[str]]:
    model = Model(FakeRunner(n_ctx=16384), "fake", options=LoadOptions(parallel=1))
    requests: list[Any] = []
    asked: list[str] = []

    def generate(llm: Any, request: Any) -> Any:
        requests.append(request)
        return llm.submit(request).wait()

    def ask(call: Any) -> str:
        asked.append(call.name)
        return answers.pop(0) if answers else "deny"

    chat = Chat(model, LoadOptions(), lambda n, o: model, generate, sampling={"max_tokens": 200},
                toolbox=toolbox, ask_tool=ask)  # fmt: skip
    chat.say = lambda text: None  # type: ignore[method-assign]
    return chat, requests, asked


def test_allowed_calls_run_and_their_results_reach_the_next_turn(toolbox: Toolbox) -> None:
    chat, requests, asked = chat_over_tools(toolbox, ["once"])
    try:
        result = chat.ask(call_text("lookup", {"q": "life"}))
        assert result.text == "The answer to life is 42." and asked == ["lookup"]
        assert [t["function"]["name"] for t in requests[0].tools] == ["add", "lookup", "hang", "crash"]
        tool_msg = requests[1].messages[-1]
        assert tool_msg["role"] == "tool" and tool_msg["content"] == "say:The answer to life is 42."
        assert requests[1].messages[-2]["tool_calls"][0]["function"]["name"] == "lookup"
        roles = [m["role"] for m in chat.history]
        assert roles == ["user", "assistant", "tool", "assistant"]  # the calls stay in the conversation
    finally:
        chat.llm.close()


def test_deny_tells_the_model_and_the_rounds_are_bounded(toolbox: Toolbox) -> None:
    chat, requests, asked = chat_over_tools(toolbox, ["deny"])
    try:
        chat.ask(call_text("add", {"a": 1, "b": 2}))  # the scripted model calls again each turn
        assert "The user denied the call to add" in requests[1].messages[-1]["content"]
        assert len(asked) == MAX_ROUNDS and len(requests) == MAX_ROUNDS + 1
    finally:
        chat.llm.close()


def test_always_asks_once_and_a_hung_or_crashed_tool_does_not_end_the_chat(toolbox: Toolbox) -> None:
    chat, requests, asked = chat_over_tools(toolbox, ["always", "once"])
    try:
        chat.ask(call_text("hang", {}))
        assert asked == ["hang"] and len(requests) == MAX_ROUNDS + 1  # asked once, allowed after
        assert requests[1].messages[-1]["content"] == "Error: hang did not answer within 1 s"
        n = len(requests)
        chat.ask(call_text("crash", {}))
        assert requests[n + 1].messages[-1]["content"].startswith("Error: crash failed")
        assert requests[n + 2].messages[-1]["content"].startswith("The user denied")  # asked again: no
        result = chat.ask("say:still here")
        assert result.text == "still here"
    finally:
        chat.llm.close()


def test_the_terminal_question() -> None:
    class Call:
        name, arguments = "add", '{"a": 1}'

    answers = iter(["maybe", "a"])
    assert ask_permission(Call(), lambda prompt: next(answers)) == "always"
    assert ask_permission(Call(), lambda prompt: "") == "once"
    assert ask_permission(Call(), lambda prompt: "n") == "deny"

    def eof(prompt: str) -> str:
        raise EOFError

    assert ask_permission(Call(), eof) == "deny"


def test_run_offers_tools_only_where_it_can_ask(config: Path, default_model_path: Path) -> None:
    from test_cli import run_process

    r = run_process(["run", "smollm2", "hi", "--mcp", str(config), "--max-tokens", "2"])
    assert r.returncode == 1 and r.stderr.strip() == (
        "error: --mcp needs the interactive REPL (each tool call is asked for): run without a prompt on a terminal")


def test_a_streamable_http_server(tmp_path: Path) -> None:
    import socket
    import subprocess

    (tmp_path / "server.py").write_text(SERVER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < end and proc.poll() is None, "the HTTP MCP server did not start"
                time.sleep(0.1)
        config = tmp_path / "mcp.json"
        config.write_text(json.dumps({"mcpServers": {"web": {"url": f"http://127.0.0.1:{port}/mcp",
                                                             "headers": {"X-Client": "localllm-test"}}}}))  # fmt: skip
        with Toolbox.from_file(config, timeout_s=5) as box:
            assert box.errors == [] and "add" in [t["function"]["name"] for t in box.tools()]
            assert box.call("add", {"a": 20, "b": 22}) == "42"
    finally:
        proc.kill()
        proc.wait()

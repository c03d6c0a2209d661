"""Tools from MCP servers for the app and the REPL: `mcp.json` read, servers started through the
official `mcp` SDK, their tools offered to the model, every call asked for, run, and its result fed
back — the loop bounded. The server (`localllm serve`) runs no tools: its clients do.

`mcp.json` is the file Claude Desktop and LM Studio use:

    {"mcpServers": {"files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "."]},
                    "web":   {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A stdio server is a command (with `args`, `env`, `cwd`); a streamable-HTTP one a `url`; `"disabled":
true` skips one. The sessions live on one private event loop thread (`Toolbox`), so the REPL's
plain code and the app's own loop call tools alike. A server that fails to start is one line and
the others go on; a call that fails, or takes longer than `timeout_s`, is one line the model reads
as the tool's result — the chat goes on.

`run_round` is the permission step both front doors share: each call is shown with its arguments and
`ask(call)` answers "once", "always" (this tool, for the session) or "deny" (the model is told so).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError

__all__ = ["MAX_ROUNDS", "Permissions", "ServerSpec", "Toolbox", "read_config", "run_round"]

MAX_ROUNDS = 8  # model turns with tool calls in one answer, at most
TIMEOUT_S = 30.0
START_S = 30.0
RESULT_CHARS = 20_000  # of a tool's text the model reads


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def read_config(path: Path) -> list[ServerSpec]:
    """The servers an `mcp.json` names (one clear error for a file that is not one)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise LocalLLMError(f"cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LocalLLMError(f"{Path(path).name} is not valid JSON: {e}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise LocalLLMError(f'{Path(path).name} needs an "mcpServers" object (the Claude Desktop / LM Studio format)')
    out = []
    for name, spec in servers.items():
        if not isinstance(spec, dict):
            raise LocalLLMError(f"{Path(path).name}: server {name!r} must be an object")
        if spec.get("disabled"):
            continue
        command, url = spec.get("command"), spec.get("url")
        if not (isinstance(command, str) and command) and not (isinstance(url, str) and url):
            raise LocalLLMError(f"{Path(path).name}: server {name!r} needs a command or a url")
        args = spec.get("args") or []
        env, headers = spec.get("env") or {}, spec.get("headers") or {}
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)
                and isinstance(env, dict) and isinstance(headers, dict)):  # fmt: skip
            raise LocalLLMError(f"{Path(path).name}: server {name!r}: args is a list of strings, env and headers objects")
        out.append(ServerSpec(name, command if isinstance(command, str) else None, tuple(args),
                              {str(k): str(v) for k, v in env.items()}, spec.get("cwd"),
                              url if isinstance(url, str) else None, {str(k): str(v) for k, v in headers.items()}))  # fmt: skip
    return out


def _attr(obj: Any, *names: str) -> Any:
    """A field under its mcp 2 name or its mcp 1 one (input_schema / inputSchema, ...)."""
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    return None


def _text_of(result: Any) -> str:
    parts = []
    for block in _attr(result, "content") or []:
        text = _attr(block, "text")
        parts.append(text if isinstance(text, str) else f"[{_attr(block, 'type') or 'content'}]")
    structured = _attr(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    text = "\n".join(parts)
    if _attr(result, "is_error", "isError"):
        text = f"Error: {text}"
    return text[:RESULT_CHARS]


class Toolbox:
    """The MCP servers of a config, their sessions on one event loop thread, their tools."""

    def __init__(self, specs: list[ServerSpec], *, timeout_s: float = TIMEOUT_S) -> None:
        self.specs = specs
        self.timeout_s = timeout_s
        self.errors: list[str] = []  # one line per server that did not start
        self._tools: dict[str, tuple[str, Any]] = {}  # offered name → (server, tool)
        self._sessions: dict[str, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._tasks: list[Any] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="localllm-mcp", daemon=True)

    @classmethod
    def from_file(cls, path: Path, **kw: Any) -> Toolbox:
        return cls(read_config(path), **kw).start()

    # -- the loop thread -------------------------------------------------------------------------

    def start(self) -> Toolbox:
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise LocalLLMError("MCP tools need the mcp package: pip install mcp") from None
        self._thread.start()
        ready = [asyncio.run_coroutine_threadsafe(self._open(s), self._loop) for s in self.specs]
        for spec, fut in zip(self.specs, ready, strict=True):
            try:
                fut.result(START_S + 5)
            except Exception as e:  # noqa: BLE001 - one line per server; the others go on
                self.errors.append(f"MCP server {spec.name!r} did not start: {_line(e)}")
        return self

    async def _open(self, spec: ServerSpec) -> None:
        if self._stop is None:
            self._stop = asyncio.Event()
        started: asyncio.Future[None] = self._loop.create_future()
        self._tasks.append(asyncio.ensure_future(self._serve(spec, started)))
        await asyncio.wait_for(started, START_S)

    async def _serve(self, spec: ServerSpec, started: asyncio.Future[None]) -> None:
        from mcp import ClientSession

        try:
            async with self._transport(spec) as streams, ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                listed = await session.list_tools()
                for tool in _attr(listed, "tools") or []:
                    name = tool.name if tool.name not in self._tools else f"{spec.name}_{tool.name}"
                    self._tools[name] = (spec.name, tool)
                self._sessions[spec.name] = session
                started.set_result(None)
                assert self._stop is not None
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - said once, where it is waited for
            if not started.done():
                started.set_exception(e if isinstance(e, Exception) else LocalLLMError("stopped"))
        finally:
            self._sessions.pop(spec.name, None)

    def _transport(self, spec: ServerSpec) -> Any:
        if spec.command:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            params = StdioServerParameters(command=spec.command, args=list(spec.args), env=spec.env or None,
                                           cwd=spec.cwd)  # fmt: skip
            return stdio_client(params, errlog=open(os.devnull, "w"))  # noqa: SIM115 - the process holds it
        try:  # mcp 2
            from mcp.client.streamable_http import streamable_http_client

            if spec.headers:
                import httpx2

                return streamable_http_client(spec.url, http_client=httpx2.AsyncClient(headers=spec.headers))
            return streamable_http_client(spec.url)
        except ImportError:  # mcp 1
            from mcp.client.streamable_http import streamablehttp_client

            return streamablehttp_client(spec.url, headers=spec.headers or None)

    # -- what the front doors use ------------------------------------------------------------------

    def tools(self) -> list[dict[str, Any]]:
        """Every tool as an OpenAI function tool (what a Request's `tools` holds)."""
        out = []
        for name, (_, tool) in self._tools.items():
            schema = _attr(tool, "input_schema", "inputSchema") or {"type": "object", "properties": {}}
            fn = {"name": name, "parameters": schema}
            if _attr(tool, "description"):
                fn["description"] = tool.description
            out.append({"type": "function", "function": fn})
        return out

    def server_of(self, name: str) -> str | None:
        return self._tools[name][0] if name in self._tools else None

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool; its text, or one line saying why not (the model reads either)."""
        if name not in self._tools:
            return f"Error: there is no tool {name!r}"
        server, tool = self._tools[name]
        session = self._sessions.get(server)
        if session is None:
            return f"Error: the MCP server {server!r} is not running"
        fut = asyncio.run_coroutine_threadsafe(session.call_tool(tool.name, arguments), self._loop)
        try:
            return _text_of(fut.result(self.timeout_s))
        except TimeoutError:
            fut.cancel()
            return f"Error: {name} did not answer within {self.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - a crashed server is one line, the chat goes on
            return f"Error: {name} failed: {_line(e)}"

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            if self._stop is not None:
                self._stop.set()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _line(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup) and e.exceptions:
        return _line(e.exceptions[0])
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


class Permissions:
    """What the user said about tools this session: those allowed always."""

    def __init__(self) -> None:
        self.always: set[str] = set()


def run_round(toolbox: Toolbox, result: Any, ask: Callable[[Any], str], permissions: Permissions,
              shown: Callable[[Any, str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One round of a result's tool calls: the assistant message that made them, then a `tool`
    message for each — run, or refused — to send back. Each call is asked for unless its tool is
    allowed always: `ask(call)` → "once", "always" or "deny"; `shown(call, text)` sees each result."""
    out = [{"role": "assistant", "content": result.text, "tool_calls": [c.to_openai() for c in result.tool_calls]}]
    for call in result.tool_calls:
        if call.name in permissions.always:
            answer = "once"
        else:
            answer = ask(call)
            if answer == "always":
                permissions.always.add(call.name)
        if answer == "deny":
            text = f"The user denied the call to {call.name}: do not call it again unless they ask."
        else:
            try:
                args = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                args = None
            text = (toolbox.call(call.name, args) if isinstance(args, dict)
                    else f"Error: the arguments of {call.name} are not a JSON object")  # fmt: skip
        if shown is not None:
            shown(call, text)
        out.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
    return out

"""Anthropic's Messages API, so agent CLIs and the `anthropic` SDK run on local models:
`POST /v1/messages` (streamed or not) and `POST /v1/messages/count_tokens`.

The request becomes the same `Request` the OpenAI routes build (`Parsed`): `system`, messages of
text / image / tool_use / tool_result blocks (a tool_result becomes a `tool` message, a tool_use an
assistant's call), `tools` (custom tools: name, description, input_schema), `tool_choice` (auto,
any → required, tool → that function, none; `disable_parallel_tool_use`), `max_tokens`
(required, as Anthropic's), `stop_sequences`, `temperature` (0-1) / `top_p` / `top_k`, `thinking`
(enabled/adaptive → the model thinks, disabled → it does not; absent: the model's default),
`output_config.format` (a JSON schema the answer follows; `effort` is taken as a hint). What
this server cannot honour is a 400 naming the field: server tools (web search, code execution, bash
— this server runs no tools: its clients do), `mcp_servers`, `container`, images by URL.

The answer: a `thinking` block (a thinking model's reasoning), a `text` block, `tool_use` blocks;
`stop_reason` end_turn / max_tokens / stop_sequence (with the sequence) / tool_use; usage with
`cache_read_input_tokens` for the prompt tokens the cache held. Streamed as Anthropic's events:
`message_start`, `content_block_start` / `_delta` / `_stop` per block, `message_delta` with the
stop reason and usage, `message_stop`; a failure mid-stream is an `error` event. Errors are
`{"type": "error", "error": {"type": ..., "message": ...}}` (`security.error_shape`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from localllm.chat import ToolHold
from localllm.server.http import LiveResponse, read_json, scrub
from localllm.server.openai_api import (
    BadRequest,
    Body,
    Parsed,
    check_choice,
    image_bytes,
    new_id,
    part_text,
)
from localllm.types import Chunk, Result

if TYPE_CHECKING:
    from localllm.server.app import Server

ROUTE = "/v1/messages"


# -- requests ------------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, blk in enumerate(content):
            b = Body(blk, f"{where}[{j}]")
            if b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise BadRequest(f"{where}[{j}] must be a text block here", f"{where}[{j}]")
            out.append(b.get("text"))
        return "\n".join(out)
    raise BadRequest(f"{where} must be a string or a list of text blocks", where)


def _blocks(m: Body, i: int, role: str) -> list[dict[str, Any]]:
    """One Anthropic message as our messages: its tool results first (each a `tool` message),
    then its text, images and calls as one message of its role."""
    from localllm.backends.base import MEDIA_MARKER

    where = f"messages[{i}].content"
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content blocks", where)
    texts: list[str] = []
    images: list[bytes] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        b, at = Body(raw, f"{where}[{j}]"), f"{where}[{j}]"
        kind = b.get("type")
        if kind == "text":
            texts.append(part_text(b.data, "text", at))
        elif kind == "image" and role == "user":
            src = b.obj("source")
            if src is None or src.get("type") != "base64":
                raise BadRequest(f"{at}: images are not fetched from URLs here; send the image itself "
                                 "(source type base64)", f"{at}.source")  # fmt: skip
            images.append(image_bytes(src.get("data"), f"{at}.source.data"))
            texts.append(MEDIA_MARKER)
        elif kind == "tool_use" and role == "assistant":
            name, args = b.text("name"), b.get("input")
            if not name or not isinstance(args, dict):
                raise BadRequest(f"{at}: a tool_use block needs a name and an input object", at)
            calls.append({"id": b.text("id") or new_id("toolu"), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            body = b.get("content")
            text = "" if body is None else _text(body, f"{at}.content")
            if b.flag("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b.text("tool_use_id") or "", "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning: templates render answers only
        else:
            raise BadRequest(f"{at}: {kind!r} blocks are not supported in {role} messages (text, image, "
                             "tool_use, tool_result and thinking are)", at)  # fmt: skip
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if images:
            msg["images"] = images
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _messages(b: Body) -> list[dict[str, Any]]:
    raw = b.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    system = b.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, item in enumerate(raw):
        m = Body(item, f"messages[{i}]")
        role = m.text("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be user or assistant (the system prompt is "
                             "the top-level system)", f"messages[{i}].role")  # fmt: skip
        out.extend(_blocks(m, i, role))
    return out


def _tools(b: Body) -> tuple[list[dict[str, Any]], Any, bool]:
    raw = b.get("tools") or []
    if not isinstance(raw, list):
        raise BadRequest("tools must be a list", "tools")
    tools = []
    for i, t in enumerate(raw):
        tb = Body(t, f"tools[{i}]")
        kind = tb.get("type")
        if kind not in (None, "custom"):
            raise BadRequest(f"tools[{i}]: server tool {kind!r} is not supported: this server runs no tools "
                             "(its clients do); define a custom tool with an input_schema", f"tools[{i}].type")  # fmt: skip
        name, schema = tb.text("name"), tb.get("input_schema")
        if not name or not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}] needs a name and an input_schema object", f"tools[{i}]")
        fn = {"name": name, "parameters": schema}
        if tb.text("description"):
            fn["description"] = tb.text("description")
        tools.append({"type": "function", "function": fn})
    choice: Any = None
    parallel = True
    tc = b.obj("tool_choice")
    if tc is not None:
        kind = tc.get("type")
        parallel = not tc.flag("disable_parallel_tool_use")
        if kind == "auto":
            choice = "auto"
        elif kind == "none":
            choice = "none"
        elif kind == "any":
            choice = "required"
        elif kind == "tool":
            choice = {"type": "function", "function": {"name": tc.text("name")}}
        else:
            raise BadRequest("tool_choice.type must be auto, any, tool or none", "tool_choice.type")
        check_choice(choice, [t["function"]["name"] for t in tools], "tool_choice.name")
    return tools, choice, parallel


def _think(b: Body) -> bool | None:
    t = b.obj("thinking")
    if t is None:
        return None
    kind = t.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("thinking.type must be enabled, adaptive or disabled", "thinking.type")
    t.number("budget_tokens", 0, 2**31, integer=True)  # checked; the model's reasoning is not capped
    return kind != "disabled"


def parse_messages(data: Any, *, count_only: bool = False) -> Parsed:
    """An Anthropic Messages request as `Parsed` (`count_only`: a count_tokens body, which has no
    max_tokens)."""
    b = Body(data)
    model = b.text("model")
    for name, why in (("mcp_servers", "this server connects to no MCP servers (its clients run tools)"),
                      ("container", "this server runs no code containers")):  # fmt: skip
        if b.get(name):
            raise BadRequest(f"{name} is not supported: {why}", name)
    max_tokens = b.number("max_tokens", 1, 2**31, integer=True)
    if max_tokens is None and not count_only:
        raise BadRequest("max_tokens is required", "max_tokens")
    stops = b.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise BadRequest("stop_sequences must be a list of strings", "stop_sequences")
    if stops and len(stops) > 16:
        raise BadRequest("stop_sequences takes at most 16 strings", "stop_sequences")
    top_p = b.number("top_p", 0, 1)
    sampling = {"temperature": b.number("temperature", 0, 1), "top_p": 1e-9 if top_p == 0 else top_p,
                "top_k": b.number("top_k", 0, 1 << 20, integer=True), "max_tokens": max_tokens,
                "stop": tuple(s for s in stops or () if s) or None}  # fmt: skip
    p = Parsed(model=model, stream=b.flag("stream"), include_usage=False, sampling=sampling)
    fmt = b.obj("output_config").obj("format") if b.obj("output_config") is not None else None
    if fmt is not None:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise BadRequest("output_config.format must be {type: json_schema, schema: {...}}",
                             "output_config.format")  # fmt: skip
        p.response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}
    p.messages = _messages(b)
    p.tools, p.tool_choice, p.parallel_tool_calls = _tools(b)
    p.think = _think(b)
    return p


# -- responses -----------------------------------------------------------------------------------


def stop_reason(result: Result) -> str:
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence else "end_turn"


def _usage(result: Result) -> dict[str, Any]:
    u = result.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}  # fmt: skip


def _tool_use(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}  # fmt: skip


def message(rid: str, model: str, result: Result) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not result.tool_calls:
        content.append({"type": "text", "text": result.text})
    content += [_tool_use(c) for c in result.tool_calls]
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(result), "stop_sequence": result.stop_sequence,
            "usage": _usage(result)}  # fmt: skip


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n".encode()


class MessageStream:
    """Anthropic's events for one streamed answer: blocks open as their kind of text arrives
    (thinking, then text); with tools, text that may be a call is held (`ToolHold`) and calls
    come at the end as tool_use blocks, each with its whole input in one `input_json_delta`."""

    def __init__(self, rid: str, model: str, n_prompt: int, tools: bool) -> None:
        self.rid, self.model, self.n_prompt = rid, model, n_prompt
        self.hold = ToolHold(tools)
        self.index = -1
        self.open: str | None = None  # the kind of the block open now

    def first(self) -> bytes:
        msg = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}  # fmt: skip
        return event("message_start", {"message": msg}) + event("ping", {})

    def _block(self, kind: str, delta: dict[str, Any]) -> bytes:
        out = b""
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}[kind]  # fmt: skip
            out += event("content_block_start", {"index": self.index, "content_block": start})
        return out + event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", {"index": self.index})

    def piece(self, chunk: Chunk) -> bytes:
        out = b""
        if chunk.reasoning:
            out += self._block("thinking", {"type": "thinking_delta", "thinking": chunk.reasoning})
        text = self.hold.feed(chunk.text)
        if text:
            out += self._block("text", {"type": "text_delta", "text": text})
        return out

    def last(self, result: Result) -> bytes:
        out = b""
        rest = self.hold.rest(result.text, bool(result.tool_calls))
        if rest:
            out += self._block("text", {"type": "text_delta", "text": rest})
        out += self._close()
        for call in result.tool_calls:
            self.index += 1
            block = _tool_use(call)
            out += event("content_block_start", {"index": self.index,
                                                 "content_block": {**block, "input": {}}})  # fmt: skip
            out += event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})  # fmt: skip
            out += event("content_block_stop", {"index": self.index})
        delta = {"stop_reason": stop_reason(result), "stop_sequence": result.stop_sequence}
        out += event("message_delta", {"delta": delta, "usage": _usage(result)})
        return out + event("message_stop", {})


def failed(message_text: str) -> bytes:
    return event("error", {"error": {"type": "api_error", "message": scrub(message_text)}})


def add_routes(app: FastAPI, server: Server) -> None:
    served = server.served

    @app.post(ROUTE)
    async def messages(request: Request) -> Response:
        parsed = parse_messages(await read_json(request))
        started = await server.start(parsed)
        rid = new_id("msg", "_")
        if not parsed.stream:
            result = await server.to_end(started, request, ROUTE)
            if isinstance(result, Response):
                return result
            return JSONResponse(message(rid, started.lease.name, result))
        ms = MessageStream(rid, started.lease.name, started.stream.n_prompt,
                           bool(parsed.tools) and parsed.tool_choice != "none")  # fmt: skip
        body = server.events(started, ROUTE, ms.first(), ms.piece, ms.last, failed, b"")
        return LiveResponse(body, "text/event-stream", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post(ROUTE + "/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        import asyncio

        parsed = parse_messages(await read_json(request), count_only=True)
        lease = await served.lease(parsed.model, served.options())
        try:
            n = len(await asyncio.to_thread(lease.model.prompt_tokens, parsed.request(lease.model)))
        finally:
            lease.close()
        return {"input_tokens": n}

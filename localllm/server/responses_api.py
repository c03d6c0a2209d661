"""OpenAI's Responses API, the stateless part and a short memory: `POST /v1/responses`,
`GET` / `DELETE /v1/responses/{id}`.

The request becomes the same `Parsed` the chat route builds: `input` (a string, or items: messages
with input_text / input_image / output_text parts, `function_call` and `function_call_output`
items; `reasoning` items are skipped), `instructions` (the system prompt; not carried over from a
previous response, as OpenAI's), function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema: enforced), `max_output_tokens`, `temperature`,
`top_p`, `reasoning.effort` (a thinking model's switch: none → off). `previous_response_id` continues
a response this server answered in the last `KEEP_S` seconds (the newest `KEEP` are kept in memory,
nothing on disk; `store: false` keeps none). What it does not keep or run is a 400 naming the field:
built-in tools (web search, file search, computer use, code interpreter, MCP — its clients run
tools), `background`, `conversation`, `prompt` templates, `truncation: auto`, item references.

Streamed as OpenAI's events, each with its `sequence_number`: `response.created`,
`response.in_progress`, per output item `response.output_item.added` / `.done` (a message's
`content_part.added`, `output_text.delta` / `.done`, `content_part.done`; a call's
`function_call_arguments.delta` / `.done`; reasoning's `reasoning_text.delta` / `.done`), then
`response.completed` (or `response.incomplete` at the token limit); a failure is an `error` event.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from localllm.chat import ToolHold
from localllm.server.http import LiveResponse, read_json, scrub
from localllm.server.openai_api import (
    BadRequest,
    Body,
    Parsed,
    _common,
    check_choice,
    image_bytes,
    new_id,
    part_text,
)
from localllm.types import Chunk, Result

if TYPE_CHECKING:
    from localllm.server.app import Server

ROUTE = "/v1/responses"
KEEP = 256  # responses kept for previous_response_id
KEEP_S = 3600.0
_STATEFUL = {"background": "responses are answered while the request waits, not in the background",
             "conversation": "conversations are not kept here: send previous_response_id or the whole input",
             "prompt": "stored prompt templates are not kept here: send instructions and input"}  # fmt: skip


class Memory:
    """Recent responses' conversations (their messages, the answer included), newest last."""

    def __init__(self, keep: int = KEEP, keep_s: float = KEEP_S) -> None:
        self.keep, self.keep_s = keep, keep_s
        self._items: OrderedDict[str, tuple[float, list[dict[str, Any]], dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        with self._lock:
            self._items[rid] = (time.monotonic(), messages, body)
            while len(self._items) > self.keep:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        with self._lock:
            item = self._items.get(rid)
            if item is None or time.monotonic() - item[0] > self.keep_s:
                self._items.pop(rid, None)
                return None
            return item[1], item[2]

    def drop(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None


# -- requests ------------------------------------------------------------------------------------


def _parts(content: Any, where: str, role: str) -> tuple[str, list[bytes]]:
    from localllm.backends.base import MEDIA_MARKER

    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of parts", where)
    texts, images = [], []
    for j, raw in enumerate(content):
        part, at = Body(raw, f"{where}[{j}]"), f"{where}[{j}]"
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            texts.append(part_text(part.data, "refusal" if kind == "refusal" else "text", at))
        elif kind == "input_image" and role == "user":
            images.append(image_bytes(part.get("image_url"), f"{at}.image_url"))
            texts.append(MEDIA_MARKER)
        else:
            raise BadRequest(f"{at}: {kind!r} parts are not supported here (input_text, output_text and "
                             "input_image by data: URL are)", at)  # fmt: skip
    return "".join(texts), images


def _input(raw: Any) -> list[dict[str, Any]]:
    """`input` as our messages (consecutive function_call items: one assistant message's calls)."""
    if isinstance(raw, str):
        if not raw:
            raise BadRequest("input is empty", "input")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        b, at = Body(item, f"input[{i}]"), f"input[{i}]"
        kind = b.get("type") or "message"
        if kind == "message":
            role = b.text("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{at}.role must be user, assistant, system or developer", f"{at}.role")
            text, images = _parts(b.get("content"), f"{at}.content", role)
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
            if images:
                msg["images"] = images
            out.append(msg)
        elif kind == "function_call":
            name, args = b.text("name"), b.text("arguments")
            if not name or args is None:
                raise BadRequest(f"{at}: a function_call needs its name and arguments", at)
            call = {"id": b.text("call_id") or new_id("call"), "type": "function",
                    "function": {"name": name, "arguments": args}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = b.get("output")
            text, _ = _parts(output, f"{at}.output", "tool") if output is not None else ("", [])
            out.append({"role": "tool", "tool_call_id": b.text("call_id") or "", "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning: templates render answers only
        else:
            raise BadRequest(f"{at}: {kind!r} items are not supported (messages, function_call and "
                             "function_call_output are)", f"{at}.type")  # fmt: skip
    return out


def _tools(b: Body) -> tuple[list[dict[str, Any]], Any]:
    raw = b.get("tools") or []
    if not isinstance(raw, list):
        raise BadRequest("tools must be a list", "tools")
    tools = []
    for i, t in enumerate(raw):
        tb = Body(t, f"tools[{i}]")
        if tb.get("type") != "function":
            raise BadRequest(f"tools[{i}]: the built-in tool {tb.get('type')!r} is not supported: this server "
                             "runs no tools (its clients do); send function tools", f"tools[{i}].type")  # fmt: skip
        params = tb.get("parameters")
        if not tb.text("name") or (params is not None and not isinstance(params, dict)):
            raise BadRequest(f"tools[{i}] needs a name and a parameters schema object", f"tools[{i}]")
        fn = {"name": tb.text("name"), "parameters": params or {"type": "object", "properties": {}}}
        if tb.text("description"):
            fn["description"] = tb.text("description")
        tools.append({"type": "function", "function": fn})
    choice = b.get("tool_choice")
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise BadRequest("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in (None, "auto", "none", "required"):
        raise BadRequest("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
    return tools, check_choice(choice, [t["function"]["name"] for t in tools])


def _format(b: Body) -> dict[str, Any] | None:
    text = b.obj("text")
    fmt = text.obj("format") if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.text("name") or "output", "schema": fmt.get("schema")}}
    raise BadRequest("text.format must be text, json_object or {type: json_schema, name, schema}", "text.format")


def parse_response_request(data: Any, memory: Memory) -> tuple[Parsed, list[dict[str, Any]], dict[str, Any]]:
    """(what to run, the conversation to remember — without instructions —, the request's echo)."""
    b = Body(data)
    for name, why in _STATEFUL.items():
        if b.get(name):
            raise BadRequest(f"{name} is not supported: {why}", name)
    if b.get("truncation") not in (None, "disabled"):
        raise BadRequest("truncation must be disabled: a prompt that does not fit is refused, not cut", "truncation")
    p = _common(Body({k: v for k, v in data.items() if k in ("model", "stream", "temperature", "top_p")}))
    p.sampling["max_tokens"] = b.number("max_output_tokens", 1, 2**31, integer=True)
    history: list[dict[str, Any]] = []
    prev = b.text("previous_response_id")
    if prev:
        kept = memory.get(prev)
        if kept is None:
            raise BadRequest(f"previous_response_id {prev!r} is not kept here (responses are kept in memory "
                             f"{KEEP_S / 60:.0f} minutes; send the whole input instead)", "previous_response_id")  # fmt: skip
        history = [dict(m) for m in kept[0]]
    conversation = history + _input(b.get("input"))
    instructions = b.text("instructions")
    p.messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    p.tools, p.tool_choice = _tools(b)
    p.parallel_tool_calls = b.flag("parallel_tool_calls", True)
    p.response_format = _format(b)
    reasoning = b.obj("reasoning")
    effort = reasoning.text("effort") if reasoning is not None else None
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise BadRequest("reasoning.effort must be none, minimal, low, medium or high", "reasoning.effort")
        p.think = False if effort in ("none", "minimal") else effort
    echo = {"instructions": instructions, "max_output_tokens": p.sampling["max_tokens"],
            "parallel_tool_calls": p.parallel_tool_calls, "previous_response_id": prev or None,
            "temperature": p.sampling["temperature"], "top_p": p.sampling["top_p"],
            "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
            "text": {"format": (b.obj("text").get("format") if b.obj("text") else None) or {"type": "text"}},
            "metadata": b.get("metadata") or {}, "store": b.flag("store", True)}  # fmt: skip
    return p, conversation, echo


# -- responses -----------------------------------------------------------------------------------


class Items:
    """The output items of one response, with the ids the stream and the final object share."""

    def __init__(self) -> None:
        self.reasoning_id = new_id("rs", "_")
        self.message_id = new_id("msg", "_")

    def of(self, result: Result) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if result.reasoning:
            out.append(self.reasoning(result.reasoning))
        if result.text or not result.tool_calls:
            out.append(self.message(result.text))
        out += [self.call(c) for c in result.tool_calls]
        return out

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call(c: Any, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id,
                "name": c.name, "arguments": c.arguments if arguments is None else arguments, "status": status}  # fmt: skip


def _usage(result: Result) -> dict[str, Any]:
    u = result.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens}  # fmt: skip


def response_object(rid: str, model: str, created: float, echo: dict[str, Any], output: list[dict[str, Any]],
                    result: Result | None) -> dict[str, Any]:  # fmt: skip
    status = "in_progress" if result is None else "incomplete" if result.finish_reason == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": _usage(result) if result is not None else None, **echo}  # fmt: skip


def answered(conversation: list[dict[str, Any]], result: Result) -> list[dict[str, Any]]:
    """The conversation with this response's answer, as the next turn's history."""
    msg: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in result.tool_calls]
    return [*conversation, msg]


class ResponseStream:
    """OpenAI's Responses events for one streamed answer (see the module's docstring)."""

    def __init__(self, rid: str, model: str, created: float, echo: dict[str, Any], tools: bool) -> None:
        self.rid, self.model, self.created, self.echo = rid, model, created, echo
        self.items = Items()
        self.hold = ToolHold(tools)
        self.seq = 0
        self.index = -1
        self.open: str | None = None
        self.text = ""
        self.thought = ""

    def _event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def first(self) -> bytes:
        r = response_object(self.rid, self.model, self.created, self.echo, [], None)
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def _start(self, kind: str) -> bytes:
        out = self._close()
        self.index += 1
        self.open = kind
        if kind == "reasoning":
            item = self.items.reasoning("", "in_progress")
            item["content"] = []
            return out + self._event("response.output_item.added", output_index=self.index, item=item)
        out += self._event("response.output_item.added", output_index=self.index,
                           item=self.items.message("", "in_progress"))  # fmt: skip
        return out + self._event("response.content_part.added", item_id=self.items.message_id,
                                 output_index=self.index, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})  # fmt: skip

    def _close(self) -> bytes:
        kind, self.open = self.open, None
        if kind == "reasoning":
            return (self._event("response.reasoning_text.done", item_id=self.items.reasoning_id,
                                output_index=self.index, content_index=0, text=self.thought)
                    + self._event("response.output_item.done", output_index=self.index,
                                  item=self.items.reasoning(self.thought)))  # fmt: skip
        if kind == "message":
            mid = self.items.message_id
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            return (self._event("response.output_text.done", item_id=mid, output_index=self.index,
                                content_index=0, text=self.text, logprobs=[])
                    + self._event("response.content_part.done", item_id=mid, output_index=self.index,
                                  content_index=0, part=part)
                    + self._event("response.output_item.done", output_index=self.index,
                                  item=self.items.message(self.text)))  # fmt: skip
        return b""

    def _text(self, text: str) -> bytes:
        out = self._start("message") if self.open != "message" else b""
        self.text += text
        return out + self._event("response.output_text.delta", item_id=self.items.message_id,
                                 output_index=self.index, content_index=0, delta=text, logprobs=[])  # fmt: skip

    def piece(self, chunk: Chunk) -> bytes:
        out = b""
        if chunk.reasoning:
            out += self._start("reasoning") if self.open != "reasoning" else b""
            self.thought += chunk.reasoning
            out += self._event("response.reasoning_text.delta", item_id=self.items.reasoning_id,
                               output_index=self.index, content_index=0, delta=chunk.reasoning)  # fmt: skip
        text = self.hold.feed(chunk.text)
        return out + (self._text(text) if text else b"")

    def last(self, result: Result) -> bytes:
        out = b""
        rest = self.hold.rest(result.text, bool(result.tool_calls))
        if rest or (not result.tool_calls and not self.text):
            out += self._text(rest)
        out += self._close()
        for c in result.tool_calls:
            self.index += 1
            fid = "fc_" + c.id.removeprefix("call_")
            out += self._event("response.output_item.added", output_index=self.index,
                               item=Items.call(c, "in_progress", ""))  # fmt: skip
            out += self._event("response.function_call_arguments.delta", item_id=fid, output_index=self.index,
                               delta=c.arguments)  # fmt: skip
            out += self._event("response.function_call_arguments.done", item_id=fid, output_index=self.index,
                               arguments=c.arguments)  # fmt: skip
            out += self._event("response.output_item.done", output_index=self.index, item=Items.call(c))
        r = response_object(self.rid, self.model, self.created, self.echo, self.items.of(result), result)
        kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=r)

    def failed(self, message: str) -> bytes:
        return self._event("error", code="server_error", message=scrub(message), param=None)


def add_routes(app: FastAPI, server: Server) -> None:
    memory = Memory()

    @app.post(ROUTE)
    async def create(request: Request) -> Response:
        parsed, conversation, echo = parse_response_request(await read_json(request), memory)
        started = await server.start(parsed)
        rid, created = new_id("resp", "_"), time.time()
        keep = echo.pop("store")

        def remember(result: Result, body: dict[str, Any]) -> None:
            if keep and result.finish_reason != "error":
                memory.put(rid, answered(conversation, result), body)

        if not parsed.stream:
            result = await server.to_end(started, request, ROUTE)
            if isinstance(result, Response):
                return result
            body = response_object(rid, started.lease.name, created, echo, Items().of(result), result)
            remember(result, body)
            return JSONResponse(body)
        rs = ResponseStream(rid, started.lease.name, created, echo, bool(parsed.tools) and parsed.tool_choice != "none")

        def last(result: Result) -> bytes:
            out = rs.last(result)
            remember(result, response_object(rid, rs.model, created, echo, rs.items.of(result), result))
            return out

        body = server.events(started, ROUTE, rs.first(), rs.piece, last, rs.failed, b"")
        return LiveResponse(body, "text/event-stream", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get(ROUTE + "/{rid}")
    async def retrieve(rid: str) -> Response:
        kept = memory.get(rid)
        if kept is None:
            from localllm.server.http import error

            return error(404, f"response {rid!r} is not kept here (kept in memory {KEEP_S / 60:.0f} minutes)",
                         "invalid_request_error", "not_found", path=ROUTE)  # fmt: skip
        return JSONResponse(kept[1])

    @app.delete(ROUTE + "/{rid}")
    async def delete(rid: str) -> Response:
        if not memory.drop(rid):
            from localllm.server.http import error

            return error(404, f"response {rid!r} is not kept here", "invalid_request_error", "not_found", path=ROUTE)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

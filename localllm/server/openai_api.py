"""OpenAI's request and response shapes, turned into our `Request` and back.

Parsing checks every field it takes (type and range) and refuses what it cannot honour (`n` > 1,
`logit_bias`, `echo`, `suffix`, `best_of`, an image for a model without a vision projector, an
image by URL: nothing is fetched) with a 400 naming the field; fields it does not
know are ignored, as OpenAI clients send many (`user`, `metadata`, `store`, ...). Extensions: `top_k`,
`min_p`, `repeat_penalty`, `repeat_last_n`, `kv_cache` and `speculative` in the body.

A thinking model's reasoning comes apart from its answer, as llama.cpp's server and vLLM return it:
`message.reasoning_content`, streamed as `delta.reasoning_content`. Thinking is switched with
`chat_template_kwargs: {"enable_thinking": false}` (vLLM's and llama.cpp's way), `think` (Ollama's)
or `reasoning_effort` (where the template takes an effort).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from localllm.chat import ToolHold
from localllm.errors import LocalLLMError
from localllm.types import Chunk, Request, Result, TokenLogprob

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(LocalLLMError):
    """A malformed request: 400, naming the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Body:
    """A JSON object body with typed getters that raise `BadRequest` naming the field."""

    def __init__(self, data: Any, where: str = "") -> None:
        if not isinstance(data, dict):
            raise BadRequest(f"the {where or 'request body'} must be a JSON object")
        self.data = data
        self.where = where

    def _p(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def number(self, key: str, lo: float, hi: float, *, integer: bool = False) -> Any:
        v = self.get(key)
        if v is None:
            return None
        if not _is_num(v) or (integer and not float(v).is_integer()):
            raise BadRequest(f"{self._p(key)} must be {'an integer' if integer else 'a number'}",
                             self._p(key))  # fmt: skip
        if not lo <= v <= hi:
            raise BadRequest(f"{self._p(key)} must be between {lo:g} and {hi:g}, got {v}", self._p(key))
        return int(v) if integer else float(v)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise BadRequest(f"{self._p(key)} must be true or false", self._p(key))
        return v

    def text(self, key: str) -> str | None:
        v = self.get(key)
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"{self._p(key)} must be a string", self._p(key))
        return v

    def obj(self, key: str) -> Body | None:
        v = self.get(key)
        return None if v is None else Body(v, self._p(key))

    def stop(self) -> tuple[str, ...] | None:
        v = self.get("stop")
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        if len(v) > 16:
            raise BadRequest("stop takes at most 16 strings", "stop")
        return tuple(s for s in v if s)


@dataclass
class Parsed:
    """What a chat or completion request asks for, before a model is chosen."""

    model: str | None
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    speculative: str | None = None
    kv_cache: str | None = None
    ctx: int | None = None  # Ollama's num_ctx
    gpu_layers: str | None = None  # Ollama's num_gpu (llama.cpp's --gpu-layers)
    logprobs: bool = False
    parallel_tool_calls: bool = True
    think: bool | str | None = None
    keep_alive: float | None = None  # Ollama's: seconds the model stays loaded after this request
    images: list[bytes] = field(default_factory=list)  # a raw prompt's (Ollama's generate)
    fim: tuple[str, str] | None = None  # fill in the middle (/infill): prefix, suffix
    fim_files: tuple[tuple[str, str], ...] = ()

    def request(self, model: Any) -> Request:
        sampling = model.sampling(**self.sampling)
        tools = tuple(self.tools)
        if self.messages is not None:
            return Request(messages=tuple(self.messages), tools=tools, tool_choice=self.tool_choice,
                           parallel_tool_calls=self.parallel_tool_calls,
                           response_format=self.response_format, sampling=sampling,
                           speculative=self.speculative, think=self.think)  # fmt: skip
        return Request(prompt=self.prompt, response_format=self.response_format, sampling=sampling,
                       speculative=self.speculative, think=self.think, images=tuple(self.images),
                       fim=self.fim, fim_files=self.fim_files)  # fmt: skip


def _common(b: Body) -> Parsed:
    n = b.number("n", 1, 128, integer=True)
    if n not in (None, 1):
        raise BadRequest("n must be 1: one choice per request (send more requests for more)", "n")
    if b.get("logit_bias"):
        raise BadRequest("logit_bias is not supported", "logit_bias")
    model = b.text("model")
    stream = b.flag("stream")
    opts = b.obj("stream_options")
    include_usage = bool(opts and opts.flag("include_usage"))
    max_tokens = b.number("max_completion_tokens", 0, 2**31, integer=True)
    if max_tokens is None:
        max_tokens = b.number("max_tokens", 0, 2**31, integer=True)
    sampling = {
        "temperature": b.number("temperature", 0, 2),
        "top_p": b.number("top_p", 0, 1),
        "top_k": b.number("top_k", 0, 1 << 20, integer=True),
        "min_p": b.number("min_p", 0, 1),
        "repeat_penalty": b.number("repeat_penalty", 0.01, 10),
        "repeat_last_n": b.number("repeat_last_n", -1, 1 << 20, integer=True),
        "presence_penalty": b.number("presence_penalty", -2, 2),
        "frequency_penalty": b.number("frequency_penalty", -2, 2),
        "seed": b.number("seed", -(2**63), 2**64 - 1, integer=True),
        "stop": b.stop(),
        "max_tokens": max_tokens,
        "ignore_eos": b.flag("ignore_eos"),  # as llama.cpp's and vLLM's servers take it
    }
    if sampling["top_p"] == 0:
        sampling["top_p"] = 1e-9  # OpenAI accepts 0 (greedy in effect); ours needs (0, 1]
    rf = b.obj("response_format")
    response_format = None
    if rf is not None:
        kind = rf.text("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise BadRequest("response_format.type must be text, json_object or json_schema",
                             "response_format.type")  # fmt: skip
        if kind == "json_schema":
            js = rf.obj("json_schema")
            if js is None or not isinstance(js.get("schema"), dict):
                raise BadRequest("response_format.json_schema.schema must be a JSON schema object",
                                 "response_format.json_schema")  # fmt: skip
        response_format = None if kind == "text" else rf.data
    speculative = b.text("speculative")
    kv_cache = b.text("kv_cache")
    return Parsed(model=model, stream=stream, include_usage=include_usage, sampling=sampling,
                  response_format=response_format, speculative=speculative, kv_cache=kv_cache)  # fmt: skip


MAX_IMAGE_BYTES = 20 << 20  # one image, decoded


def image_bytes(data: Any, where: str) -> bytes:
    """An image sent as base64 (Ollama's `images`) or a `data:` URL (OpenAI's `image_url`)."""
    import base64
    import binascii

    if not isinstance(data, str) or not data:
        raise BadRequest(f"{where} must be a base64 image or a data: URL", where)
    if data.startswith(("http://", "https://", "file:")):
        raise BadRequest(f"{where}: images are not fetched from URLs here; send the image itself "
                         "(a data: URL or base64)", where)  # fmt: skip
    if data.startswith("data:"):
        head, sep, data = data.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest(f"{where}: a data: URL of an image must be base64 (data:image/png;base64,...)", where)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest(f"{where}: an image may be at most {MAX_IMAGE_BYTES >> 20} MiB", where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where} is not valid base64", where) from None


def part_text(part: Any, key: str, where: str) -> str:
    """A content part's text (`part[key]`), which may not hold the marker that places images."""
    from localllm.backends.base import MEDIA_MARKER

    text = part.get(key) if isinstance(part, dict) else None
    if not isinstance(text, str):
        raise BadRequest(f"{where}: a text part needs its text", where)
    if MEDIA_MARKER in text:
        raise BadRequest(f"{where}: the text may not contain {MEDIA_MARKER} (it places images)", where)
    return text


def _content(m: Body, i: int) -> tuple[str | None, list[bytes]]:
    """A message's text, with MEDIA_MARKER where each of its image parts was, and the images."""
    from localllm.backends.base import MEDIA_MARKER

    c = m.get("content")
    where = f"messages[{i}].content"
    if c is None or isinstance(c, str):
        return c, []
    if isinstance(c, list):
        parts, images = [], []
        for j, part in enumerate(c):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(image_bytes(url, f"{where}[{j}].image_url"))
                parts.append(MEDIA_MARKER)
                continue
            if kind not in ("text", "input_text"):
                raise BadRequest(f"{where}: {kind!r} parts are not supported (text and image_url are)", where)
            parts.append(part_text(part, "text", where))
        return "".join(parts), images
    raise BadRequest(f"{where} must be a string or a list of parts", where)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, item in enumerate(raw):
        m = Body(item, f"messages[{i}]")
        role = m.text("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        content, images = _content(m, i)
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if images:
            if role != "user":
                raise BadRequest(f"messages[{i}]: images go in user messages", f"messages[{i}].content")
            msg["images"] = images
        if msg["content"] is None and not (role == "assistant" and m.get("tool_calls")):
            raise BadRequest(f"messages[{i}].content is missing", f"messages[{i}].content")
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m.get("tool_calls")
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise BadRequest(f"messages[{i}].tool_calls must be a list of objects", f"messages[{i}].tool_calls")
            msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = m.text("tool_call_id") or ""
        name = m.text("name")
        if name:
            msg["name"] = name
        out.append(msg)
    return out


def _tools(b: Body) -> tuple[list[dict[str, Any]], Any]:
    tools = b.get("tools") or []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", "tools")
    names = []
    for i, t in enumerate(tools):
        tb = Body(t, f"tools[{i}]")
        fn = tb.obj("function")
        if tb.get("type") != "function" or fn is None or not fn.text("name"):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                             f"tools[{i}]")  # fmt: skip
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                             f"tools[{i}].function.parameters")  # fmt: skip
        names.append(fn.text("name"))
    choice = b.get("tool_choice")
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("auto", "none", "required"):
                raise BadRequest("tool_choice must be auto, none, required or a function", "tool_choice")
        elif isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise BadRequest("tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                                 "tool_choice")  # fmt: skip
        else:
            raise BadRequest("tool_choice must be a string or an object", "tool_choice")
        check_choice(choice, names)
    if b.get("functions"):
        raise BadRequest("functions is the deprecated form: send tools", "functions")
    return tools, choice


def check_choice(choice: Any, names: list[str], param: str = "tool_choice") -> Any:
    """A tool choice in our form (auto, none, required, or {"function": {"name": ...}}) against
    the names of the tools it may force; returns it."""
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise BadRequest(f"tool_choice names {choice['function']['name']!r}, which is not among the tools", param)
    if (choice == "required" or isinstance(choice, dict)) and not names:
        raise BadRequest("tool_choice asks for a tool call but tools is empty", "tool_choice")
    return choice


def parse_chat(data: Any) -> Parsed:
    b = Body(data)
    p = _common(b)
    p.messages = _messages(b.get("messages"))
    p.tools, p.tool_choice = _tools(b)
    p.parallel_tool_calls = b.flag("parallel_tool_calls", True)
    p.logprobs = b.flag("logprobs")
    top = b.number("top_logprobs", 0, 20, integer=True)
    if top is not None and not p.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if p.logprobs:
        p.sampling["logprobs"] = top or 0
    p.think = _think(b)
    return p


def _think(b: Body) -> bool | str | None:
    """A chat's thinking switch: `think`, `chat_template_kwargs.enable_thinking` or
    `reasoning_effort` (the engine refuses what the model cannot do)."""
    think = b.get("think")
    if think is not None and not isinstance(think, (bool, str)):
        raise BadRequest("think must be true, false, or low, medium or high", "think")
    kwargs = b.obj("chat_template_kwargs")
    if kwargs is not None:
        unknown = set(kwargs.data) - {"enable_thinking"}
        if unknown:
            raise BadRequest(f"chat_template_kwargs {', '.join(sorted(unknown))} is not supported "
                             "(enable_thinking is)", "chat_template_kwargs")  # fmt: skip
        enable = kwargs.get("enable_thinking")
        if enable is not None and not isinstance(enable, bool):
            raise BadRequest("chat_template_kwargs.enable_thinking must be a boolean",
                             "chat_template_kwargs.enable_thinking")  # fmt: skip
        think = enable if think is None else think
    effort = b.text("reasoning_effort")
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise BadRequest("reasoning_effort must be low, medium or high", "reasoning_effort")
        think = effort if think in (None, True) else think
    return think


def parse_completion(data: Any) -> Parsed:
    b = Body(data)
    p = _common(b)
    prompt = b.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    for name in ("suffix",):
        if b.get(name):
            raise BadRequest(f"{name} is not supported", name)
    if b.flag("echo"):
        raise BadRequest("echo is not supported", "echo")
    if b.number("best_of", 1, 128, integer=True) not in (None, 1):
        raise BadRequest("best_of must be 1", "best_of")
    p.prompt = prompt
    top = b.number("logprobs", 0, 20, integer=True)
    if top is not None:
        p.logprobs = True
        p.sampling["logprobs"] = top
    return p


# -- responses -----------------------------------------------------------------------------------


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def usage(result: Result) -> dict[str, Any]:
    u = result.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}  # fmt: skip


def finish_reason(result: Result) -> str:
    return {"cancelled": "stop", "error": "stop"}.get(result.finish_reason, result.finish_reason)


def _lp_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}  # fmt: skip


def chat_logprobs(lps: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
    return None if lps is None else {"content": [_lp_entry(lp) for lp in lps], "refusal": None}


def completion_logprobs(lps: tuple[TokenLogprob, ...] | None, start: int = 0) -> dict[str, Any] | None:
    if lps is None:
        return None
    offsets, at = [], start
    for lp in lps:
        offsets.append(at)
        at += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [dict(lp.top) for lp in lps], "text_offset": offsets}  # fmt: skip


def chat_completion(rid: str, model: str, fingerprint: str, result: Result) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [t.to_openai() for t in result.tool_calls]
        message["content"] = result.text or None
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(result.logprobs),
                         "finish_reason": finish_reason(result)}],
            "usage": usage(result)}  # fmt: skip


def text_completion(rid: str, model: str, fingerprint: str, result: Result) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "text": result.text, "logprobs": completion_logprobs(result.logprobs),
                         "finish_reason": finish_reason(result)}],
            "usage": usage(result)}  # fmt: skip


def sse(data: dict[str, Any] | str) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n".encode()


class _Stream:
    """The SSE events of one streamed response: `object` names its chunks; with `include_usage`,
    every chunk says `usage: null` and one last event carries the usage (OpenAI's shape)."""

    object = ""

    def __init__(self, rid: str, model: str, fingerprint: str, *, include_usage: bool) -> None:
        self.rid, self.model, self.fingerprint = rid, model, fingerprint
        self.created = int(time.time())
        self.include_usage = include_usage

    def _event(self, choices: list[dict[str, Any]], result: Result | None = None) -> bytes:
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}  # fmt: skip
        if self.include_usage:
            body["usage"] = usage(result) if result is not None else None
        return sse(body)

    def _usage(self, result: Result) -> bytes:
        return self._event([], result) if self.include_usage else b""


class ChatStream(_Stream):
    """The SSE chunks of one streamed chat completion."""

    object = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, fingerprint: str, *, include_usage: bool,
                 tools: bool) -> None:  # fmt: skip
        super().__init__(rid, model, fingerprint, include_usage=include_usage)
        self.hold = ToolHold(tools)

    def _chunk(self, delta: dict[str, Any], finish: str | None = None,
               logprobs: dict[str, Any] | None = None) -> bytes:  # fmt: skip
        return self._event([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def first(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def piece(self, chunk: Chunk, logprobs: bool) -> bytes:
        text = self.hold.feed(chunk.text)
        lp = chat_logprobs(chunk.logprobs) if logprobs and chunk.logprobs else None
        out = self._chunk({"reasoning_content": chunk.reasoning}) if chunk.reasoning else b""
        if not text and lp is None:
            return out
        return out + self._chunk({"content": text}, logprobs=lp)

    def last(self, result: Result) -> bytes:
        rest = self.hold.rest(result.text, bool(result.tool_calls))
        out = self._chunk({"content": rest}) if rest else b""
        if result.tool_calls:
            calls = [dict(t.to_openai(), index=i) for i, t in enumerate(result.tool_calls)]
            out += self._chunk({"tool_calls": calls})
        return out + self._chunk({}, finish_reason(result)) + self._usage(result)


class CompletionStream(_Stream):
    """The SSE chunks of one streamed text completion."""

    object = "text_completion"

    def __init__(self, rid: str, model: str, fingerprint: str, *, include_usage: bool) -> None:
        super().__init__(rid, model, fingerprint, include_usage=include_usage)
        self.offset = 0

    def _chunk(self, text: str, finish: str | None = None,
               logprobs: dict[str, Any] | None = None) -> bytes:  # fmt: skip
        return self._event([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}])

    def piece(self, chunk: Chunk, logprobs: bool) -> bytes:
        lp = completion_logprobs(chunk.logprobs, self.offset) if logprobs and chunk.logprobs else None
        self.offset += len(chunk.text)
        if not chunk.text and lp is None:
            return b""
        return self._chunk(chunk.text, logprobs=lp)

    def last(self, result: Result) -> bytes:
        return self._chunk("", finish_reason(result)) + self._usage(result)

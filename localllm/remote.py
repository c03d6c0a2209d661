"""A model that a running `localllm serve` holds, used as if it were loaded here.

One loaded model per machine: `localllm run` and the app ask the server that `server.json` names
(with its API key) instead of loading a second copy, so the weights, the KV memory and the prefix
cache are shared. `connect()` says whether the server can serve what was asked — it is up, it
answers, and every engine option the user gave equals what the server's copy was loaded with —
and returns a `RemoteModel`, or None and the reason (`run --local` never asks).

`RemoteModel` has the surface front doors use of an engine `Model` (`name`, `n_ctx`, `sampling()`,
`submit()` → a stream of `Chunk`s whose last carries the `Result`, `cancel()`, `close()`); it
speaks the OpenAI routes with our extensions (`top_k`, `min_p`, `repeat_penalty`,
`repeat_last_n`, `think`) and sends every sampling value, resolved over the model's defaults as a
local load resolves them, so a greedy answer is the one a local load gives. Cancelling closes the
HTTP stream; the server cancels the sequence when its client goes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.types import (
    Chunk,
    Drained,
    LoadOptions,
    Request,
    Result,
    SamplingParams,
    Timings,
    ToolCall,
    Usage,
)

PROBE_S = 3.0  # a server that does not answer /api/ps within this is passed over
LOAD_S = 600.0  # the server's first load of a model may take this long
COMPARED = ("backend", "device", "dtype", "ctx", "kv_cache", "streaming", "evict", "speculative")


@dataclass(frozen=True)
class RemoteRunner:
    """What front doors read of `llm.runner` (`--stats`, `/show`), for a model a server holds."""

    url: str
    model_path: Path | None
    backend: str  # the server's own runner's name (llama.cpp, torch)
    name: str = "localllm serve"
    client: Any = None

    @property
    def chat_template(self) -> str:
        """The template the server renders with (its `/api/show`)."""
        try:
            return str(_json(self.client.post("/api/show", json={"model": self._model})).get("template") or "")
        except LocalLLMError:
            return ""

    _model: str = ""


def open_model(name: str, options: LoadOptions, *, local: bool = False,
               say: Callable[[str], None] | None = None) -> Any:  # fmt: skip
    """The running server's copy when it suits (`connect`), else a load in this process; `say`
    hears why a running server was passed over."""
    if not local:
        remote, why = connect(name, options)
        if remote is not None:
            return remote
        if why and say is not None:
            say(why)
    from localllm.engine import load

    return load(name, options)


def serving() -> Any:
    """The `localllm serve` running on this machine (`server.runner.Running`), unless it is this
    process's own (the app's server screen): None when there is none to ask."""
    from localllm.server.runner import running

    up = running()
    return None if up is None or up.pid == os.getpid() else up


def connect(name: str, options: LoadOptions) -> tuple[RemoteModel | None, str]:
    """The running server's copy of `name` when it can serve these options, else (None, why);
    why is "" when no server is running (nothing worth saying)."""
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    up = serving()
    if up is None:
        return None, ""
    try:
        record = ensure_local(name, Store())
    except LocalLLMError:
        return None, ""  # loading here says why in the usual words
    import httpx

    headers = {"Authorization": f"Bearer {up.key}"} if up.key else {}
    client = httpx.Client(base_url=up.url, headers=headers,
                          timeout=httpx.Timeout(PROBE_S, read=None))  # fmt: skip
    try:
        loaded = _loaded(client, record.name)
        asked = options.replace(parallel=LoadOptions().parallel, threads=None).to_dict()
        if loaded is None and asked:
            raise _Pass(f"the server at {up.url} has not loaded {record.name}, and loads it "
                        f"with its own options, not {_flags(asked)}")  # fmt: skip
        if loaded is not None:
            differ = {k: v for k, v in asked.items() if not _same(k, v, loaded)}
            if differ:
                raise _Pass(f"the server at {up.url} has {record.name} loaded with other "
                            f"options than {_flags(differ)}")  # fmt: skip
        t0 = time.perf_counter()
        if loaded is None:  # Ollama's way: a request with nothing to say loads the model
            _json(client.post("/api/generate", json={"model": record.name}, timeout=LOAD_S))
            loaded = _loaded(client, record.name)
            if loaded is None:
                raise _Pass(f"the server at {up.url} did not keep {record.name} loaded")
        model = RemoteModel(client, record.name, up.url, loaded, load_s=time.perf_counter() - t0)
    except _Pass as e:
        client.close()
        return None, f"{e}: loading it here"
    except (LocalLLMError, httpx.HTTPError, OSError, ValueError) as e:
        client.close()
        return None, f"the server at {up.url} did not answer ({_said(e)}): loading it here"
    return model, ""


class _Pass(Exception):
    """The server is up but cannot serve this request as asked."""


def _flags(asked: dict[str, Any]) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in asked.items())


def _said(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _json(response: Any) -> dict[str, Any]:
    """A reply's JSON object; an error status is one line in the server's own words."""
    if response.status_code >= 400:
        raise LocalLLMError(_error_text(response.status_code, response.read()))
    data = response.json()
    if not isinstance(data, dict):
        raise LocalLLMError("the server answered something other than a JSON object")
    return data


def _error_text(status: int, body: bytes) -> str:
    try:
        said = json.loads(body)["error"]
        return said if isinstance(said, str) else str(said["message"])
    except (ValueError, KeyError, TypeError):
        return f"the server answered HTTP {status}"


def _same(key: str, asked: Any, loaded: dict[str, Any]) -> bool:
    """Whether the server's copy has what the user asked for `key` (a context size is the one it
    runs with; a backend the runner it chose)."""
    if key == "ctx":
        return asked == loaded.get("n_ctx")
    if key == "backend":
        return asked in (loaded.get("backend"), loaded.get("runner"))
    return asked == loaded.get(key)


def _loaded(client: Any, name: str) -> dict[str, Any] | None:
    """The options the server's copy of `name` was loaded with (and its `n_ctx`), None if not loaded."""
    for m in _json(client.get("/api/ps")).get("models") or ():
        ours = m.get("localllm") if isinstance(m, dict) else None
        if m.get("name") == name and isinstance(ours, dict):
            return dict(ours.get("options") or {}) | {"n_ctx": ours.get("ctx"), "runner": ours.get("backend")}
    return None


class RemoteModel:
    """A model the running server holds, with the surface of an engine `Model` front doors use."""

    def __init__(self, client: Any, name: str, url: str, loaded: dict[str, Any], *,
                 load_s: float = 0.0) -> None:  # fmt: skip
        from localllm.engine.core import sampling_defaults
        from localllm.models_registry.catalog import find_local, sampling_for
        from localllm.models_registry.store import Store

        self.client, self.name, self.url = client, name, url
        self.n_ctx = int(loaded.get("n_ctx") or 0)
        self.load_s = load_s
        self.options = LoadOptions.from_dict({k: v for k, v in loaded.items() if k in COMPARED})
        self.backend_why = f"held by the server at {url}; --local loads a copy here"
        store = Store()
        record = find_local(name, store)
        path = store.path_of(record) if record else None
        self.sampling_defaults = sampling_defaults(path, sampling_for(record))[0] if record else {}
        self.runner = RemoteRunner(url, path, str(loaded.get("runner") or ""), client=client,
                                   _model=name)  # fmt: skip

    @property
    def backend(self) -> RemoteRunner:
        return self.runner

    def sampling(self, **kw: Any) -> SamplingParams:
        """Sampling options over this model's defaults, resolved here as a local load does."""
        given = {k: v for k, v in kw.items() if v is not None}
        return SamplingParams.from_kwargs(**(self.sampling_defaults | given))

    def submit(self, request: Request, **kw: Any) -> RemoteStream:
        if kw.get("loop") is not None:
            raise LocalLLMError("a model served elsewhere streams to one thread (no loop=)")
        return RemoteStream(self, request)

    def close(self) -> None:
        """Nothing to unload: the server keeps the model as its keep_alive says."""
        self.client.close()

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def body(name: str, request: Request) -> tuple[str, dict[str, Any]]:
    """The route and JSON body that ask the server for `request`."""
    s = request.sampling
    out: dict[str, Any] = {"model": name, "stream": True, "stream_options": {"include_usage": True},
                           "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                           "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                           "repeat_last_n": s.repeat_last_n,
                           "presence_penalty": s.presence_penalty,
                           "frequency_penalty": s.frequency_penalty}  # fmt: skip
    if s.seed is not None:
        out["seed"] = s.seed
    if s.stop:
        out["stop"] = list(s.stop)
    if s.max_tokens is not None:
        out["max_tokens"] = s.max_tokens
    if s.ignore_eos:
        out["ignore_eos"] = True
    if request.response_format is not None:
        out["response_format"] = request.response_format
    if request.speculative is not None:
        out["speculative"] = request.speculative
    if request.prompt is not None:
        if request.images:
            raise LocalLLMError("a raw prompt with images goes to a model loaded here (--local)")
        if s.logprobs is not None:
            out["logprobs"] = s.logprobs
        return "/v1/completions", out | {"prompt": request.prompt}
    out["messages"] = [_openai_message(m) for m in request.messages or ()]
    if s.logprobs is not None:
        out |= {"logprobs": True, "top_logprobs": s.logprobs}
    if request.tools:
        out |= {"tools": list(request.tools), "parallel_tool_calls": request.parallel_tool_calls}
    if request.tool_choice is not None:
        out["tool_choice"] = request.tool_choice
    if request.think is not None:
        out["think"] = request.think
    return "/v1/chat/completions", out


def _openai_message(m: Any) -> dict[str, Any]:
    """A message as the OpenAI route takes it: images as `image_url` parts (data: URLs) where its
    text places them, else before the text."""
    import base64

    from localllm.backends.base import MEDIA_MARKER

    images = list(m.get("images") or ())
    if not images:
        return dict(m)
    urls = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()}}
            for i in images]  # fmt: skip
    texts = (m.get("content") or "").split(MEDIA_MARKER)
    placed = len(texts) - 1
    parts = urls[: len(urls) - placed]  # those the text does not place
    for k, text in enumerate(texts):
        if text:
            parts.append({"type": "text", "text": text})
        if k < placed:
            parts.append(urls[len(urls) - placed + k])
    return {k: v for k, v in m.items() if k != "images"} | {"content": parts}


class RemoteStream(Drained):
    """The chunks of one request the server runs; iterate it, `cancel()` stops it within a token."""

    def __init__(self, model: RemoteModel, request: Request) -> None:
        import httpx

        self.result: Result | None = None
        self._cancelled = False
        self._t0 = time.perf_counter()
        route, payload = body(model.name, request)
        self._chat = route.endswith("chat/completions")
        try:
            self._response = model.client.send(
                model.client.build_request("POST", route, json=payload), stream=True
            )
        except httpx.HTTPError as e:
            raise LocalLLMError(f"the server at {model.url} did not answer ({_said(e)})") from None
        if self._response.status_code >= 400:
            text = _error_text(self._response.status_code, self._response.read())
            self._response.close()
            raise LocalLLMError(text)
        self._url = model.url
        self._events = self._read()

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> Chunk:
        return next(self._events)

    def cancel(self) -> None:
        self._cancelled = True

    def close(self) -> None:
        self.cancel()
        for _ in self:
            pass

    def _read(self) -> Iterator[Chunk]:
        import httpx

        text, reasoning, calls = [], [], {}
        finish, usage, error = "stop", {}, None
        first = last = 0.0
        try:
            for line in self._response.iter_lines():
                if self._cancelled:
                    finish = "cancelled"
                    break
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    err = event["error"]
                    error = err.get("message") if isinstance(err, dict) else str(err)
                    finish = "error"
                    continue
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    piece = (choice.get("delta") or {}) if self._chat else {"content": choice.get("text")}
                    for call in piece.get("tool_calls") or ():
                        calls[call.get("index", len(calls))] = call
                    said, thought = piece.get("content") or "", piece.get("reasoning_content") or ""
                    if said or thought:
                        last = time.perf_counter()
                        first = first or last
                        text.append(said)
                        reasoning.append(thought)
                        yield Chunk(said, reasoning=thought)
        except (httpx.HTTPError, ValueError) as e:
            finish, error = "error", f"the server at {self._url} broke off the answer ({_said(e)})"
        finally:
            self._response.close()
        now = time.perf_counter()
        first = first or now
        completion = int(usage.get("completion_tokens") or 0)
        details = usage.get("completion_tokens_details") or {}
        self.result = Result(
            text="".join(text),
            token_ids=(),
            finish_reason=finish,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                        completion_tokens=completion,
                        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                        reasoning_tokens=int(details.get("reasoning_tokens") or 0)),  # fmt: skip
            timings=Timings(prompt_s=first - self._t0, ttft_s=first - self._t0,
                            decode_s=(last or now) - first, total_s=now - self._t0),  # fmt: skip
            tool_calls=tuple(ToolCall(c.get("id") or "", (c.get("function") or {}).get("name") or "",
                                      (c.get("function") or {}).get("arguments") or "")
                             for _, c in sorted(calls.items())),  # fmt: skip
            error=error,
            reasoning="".join(reasoning) or None,
        )
        yield Chunk("", result=self.result)

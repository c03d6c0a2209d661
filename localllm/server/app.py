"""The server: `create_app(config, served)` builds the FastAPI app; the CLI parses and runs it.

A front door like the CLI and the app: it builds `Request`s, submits them to the engine and turns
the stream of `Chunk`s into OpenAI's (or Ollama's) shapes. It never talks to a backend. Requests
are consumed on the event loop (`Model.submit(loop=...)`), so a thousand waiting clients hold no
threads; a client that goes away cancels its sequence, which frees its slot within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm import __version__
from localllm.errors import LocalLLMError
from localllm.server.config import ServerConfig
from localllm.server.http import LiveResponse, error, error_of, read_json, scrub, until_disconnect
from localllm.server.metrics import CONTENT_TYPE, Metrics
from localllm.server.openai_api import (
    BadRequest,
    Body,
    ChatStream,
    CompletionStream,
    Parsed,
    chat_completion,
    new_id,
    parse_chat,
    parse_completion,
    sse,
    text_completion,
)
from localllm.server.security import BodyTooLarge, Door
from localllm.server.served import Lease, Served
from localllm.types import Chunk, Result

# -- the app ---------------------------------------------------------------------------------------


@dataclass
class Started:
    """A request that holds a model and a running sequence."""

    lease: Lease
    stream: Any
    parsed: Parsed | None

    @property
    def fingerprint(self) -> str:
        return f"localllm-{__version__}-{getattr(self.lease.model.backend, 'name', 'engine')}"


class Server:
    """What the routes share: config, models, metrics, a log of recent requests."""

    def __init__(self, config: ServerConfig, served: Served) -> None:
        self.config = config
        self.served = served
        self.metrics = Metrics(lambda: list(served.loaded()), served.queued)
        served.on_busy = lambda name: self.metrics.rejected.labels(name).inc()
        self.log: list[dict[str, Any]] = []  # recent requests, newest last (the app shows them)
        self.started = time.time()

    def record(self, entry: dict[str, Any]) -> None:
        self.log.append(entry)
        del self.log[:-200]

    async def start(self, parsed: Parsed) -> Started:
        """Lease the model, build the request and submit it (errors raise, the lease goes back)."""
        options = self.served.options(kv_cache=parsed.kv_cache, ctx=parsed.ctx,
                                      gpu_layers=parsed.gpu_layers)  # fmt: skip
        lease = await self.served.lease(parsed.model, options)
        try:
            request = parsed.request(lease.model)
            loop = asyncio.get_running_loop()
            stream = await asyncio.to_thread(lease.model.submit, request, loop=loop)
        except BaseException:
            lease.close()
            raise
        return Started(lease, stream, parsed)

    def finished(self, started: Started, route: str, result: Result | None) -> None:
        started.lease.close(started.parsed.keep_alive if started.parsed else None)
        if result is None:
            return
        self.metrics.observe(started.lease.name, result)
        n = result.usage.completion_tokens
        self.record({"time": time.time(), "route": route, "model": started.lease.name,
                     "prompt_tokens": result.usage.prompt_tokens, "cached_tokens": result.usage.cached_tokens,
                     "completion_tokens": n, "finish_reason": result.finish_reason,
                     "ttft_s": result.timings.ttft_s, "tokens_per_s": result.timings.tokens_per_s(n),
                     "total_s": result.timings.total_s})  # fmt: skip

    async def collect(self, started: Started, request: Request) -> Result | None:
        """Run a non-streamed request to its end; None when the client left (its sequence is
        cancelled at once)."""

        async def drain() -> Result | None:
            async for _ in started.stream:
                pass
            return started.stream.result

        work = asyncio.ensure_future(drain())
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                started.stream.cancel()
                work.cancel()
        return work.result() if work.done() and not work.cancelled() else None

    async def to_end(self, started: Started, request: Request, route: str) -> Result | Response:
        """A non-streamed request's Result, or the response for a client gone (499) or a failure."""
        result = None
        try:
            result = await self.collect(started, request)
        finally:
            started.stream.cancel()
            self.finished(started, route, result)
        if result is None:
            return Response(status_code=499)
        if result.finish_reason == "error":
            return error(500, result.error or "generation failed", "server_error", path=route)
        return result

    async def events(self, started: Started, route: str, first: bytes,
                     piece: Callable[[Chunk], bytes], last: Callable[[Result], bytes],
                     failed: Callable[[str], bytes], end: bytes) -> AsyncIterator[bytes]:  # fmt: skip
        """The body of a streamed response: chunks as they come; the sequence is cancelled and the
        lease given back however the stream ends (done, client gone, error)."""
        result = None
        try:
            yield first
            async for chunk in started.stream:
                out = piece(chunk)
                if chunk.result is not None:
                    result = chunk.result
                    out += failed(result.error) if result.finish_reason == "error" else last(result)
                yield out
            yield end
        except LocalLLMError as e:
            yield failed(str(e)) + end
        finally:
            started.stream.cancel()
            self.finished(started, route, result)


def create_app(config: ServerConfig, served: Served | None = None) -> FastAPI:
    """The server's ASGI app. `served` holds the models (started by the caller; made here if
    None, with nothing preloaded)."""
    from localllm.server import anthropic_api, ollama_api, responses_api, utility_api

    served = served or Served(config)
    server = Server(config, served)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(served.close)

    app = FastAPI(title="localllm", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)  # fmt: skip
    app.state.server = server

    @app.exception_handler(Exception)
    async def _any(request: Request, e: Exception) -> JSONResponse:
        return error_of(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, str(e.detail), kind, path=request.url.path)

    for exc in (LocalLLMError, BadRequest, BodyTooLarge):
        app.add_exception_handler(exc, _any)  # type: ignore[arg-type]

    # -- OpenAI --------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = await asyncio.to_thread(served.local_names)
        return {"object": "list",
                "data": [{"id": n, "object": "model", "created": int(server.started), "owned_by": "localllm"}
                         for n in names]}  # fmt: skip

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        record = await asyncio.to_thread(served.record, name)
        return {"id": record.name, "object": "model", "created": int(record.added), "owned_by": "localllm"}

    async def generate(request: Request, parsed: Parsed, route: str, chat: bool) -> Response:
        started = await server.start(parsed)
        name, fp = started.lease.name, started.fingerprint
        rid = new_id("chatcmpl" if chat else "cmpl")
        if not parsed.stream:
            result = await server.to_end(started, request, route)
            if isinstance(result, Response):
                return result
            shape = chat_completion if chat else text_completion
            return JSONResponse(shape(rid, name, fp, result))
        if chat:
            cs = ChatStream(rid, name, fp, include_usage=parsed.include_usage,
                            tools=bool(parsed.tools) and parsed.tool_choice != "none")  # fmt: skip
            first, piece, last = cs.first(), cs.piece, cs.last
        else:
            ts = CompletionStream(rid, name, fp, include_usage=parsed.include_usage)
            first, piece, last = b"", ts.piece, ts.last

        def failed(message: str) -> bytes:
            return sse({"error": {"message": scrub(message), "type": "server_error", "param": None,
                                  "code": None}})  # fmt: skip

        body = server.events(started, route, first, lambda c: piece(c, parsed.logprobs), last,
                             failed, b"data: [DONE]\n\n")  # fmt: skip
        return LiveResponse(body, "text/event-stream",
                            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat(await read_json(request)), "/v1/chat/completions", True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion(await read_json(request)), "/v1/completions", False)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        b = Body(await read_json(request))
        inputs = b.get("input")
        fmt = b.text("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise BadRequest("encoding_format must be float or base64", "encoding_format")
        if b.get("dimensions") is not None:
            raise BadRequest("dimensions is not supported: the model's own size is returned", "dimensions")
        lease = await served.lease(b.text("model"), served.options())
        try:
            texts = _embedding_inputs(inputs, lease.model)
            vectors = await asyncio.to_thread(lease.model.embed, texts)
            n = sum(len(lease.model.tokenize(t)) for t in texts)
        finally:
            lease.close()
        return {"object": "list", "model": lease.name,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}  # fmt: skip

    ollama_api.add_routes(app, server)
    anthropic_api.add_routes(app, server)
    responses_api.add_routes(app, server)
    utility_api.add_routes(app, server)
    return _wrap(app, config, server)


def _embedding_inputs(inputs: Any, model: Any) -> list[str]:
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, list) and inputs and all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("input must be a string, a list of strings or of token lists", "input")
    if len(inputs) > 2048:
        raise BadRequest("input takes at most 2048 items", "input")
    texts = []
    for item in inputs:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            texts.append(model.detokenize(item))
        else:
            raise BadRequest("input must be a string, a list of strings or of token lists", "input")
    if any(not t for t in texts):
        raise BadRequest("input contains an empty string", "input")
    return texts


def _encode(vector: list[float], fmt: str) -> Any:
    if fmt == "float":
        return vector
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health",
           "/metrics", "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/version",
           "/api/ps", "/api/embed", "/api/embeddings", "/v1/messages", "/v1/messages/count_tokens",
           "/v1/responses", "/tokenize", "/detokenize", "/apply-template", "/infill", "/props",
           "/v1/rerank")  # fmt: skip


def _wrap(app: FastAPI, config: ServerConfig, server: Server) -> Any:
    """The door (size, Host, key), CORS where asked, and the request counter, around the app."""
    inner: Any = app

    def counted(asgi: Any) -> Callable[..., Awaitable[None]]:
        async def call(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await asgi(scope, receive, send)
                return
            path = scope.get("path", "")
            route = path if path in _ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
            status = 500

            async def watch(message: Any) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await asgi(scope, receive, watch)
            finally:
                server.metrics.requests.labels(route, str(status)).inc()

        return call

    inner = Door(inner, api_key=config.api_key, loopback=config.loopback, max_body=config.max_body)
    if config.cors:
        from starlette.middleware.cors import CORSMiddleware

        inner = CORSMiddleware(inner, allow_origins=list(config.cors), allow_methods=["GET", "POST", "OPTIONS"],
                               allow_headers=["authorization", "content-type", "x-api-key"])  # fmt: skip
    wrapped = counted(inner)
    wrapped.state = app.state  # type: ignore[attr-defined]
    wrapped.app = app  # type: ignore[attr-defined]
    return wrapped

"""HTTP plumbing both APIs share (OpenAI's routes in `app`, Ollama's in `ollama_api`): errors as
one scrubbed line in the route's API's shape, reading a JSON body, and a streamed response that notices a
client leaving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from localllm.errors import ContextOverflow, DoesNotFit, LocalLLMError, ModelNotFound, Unsupported
from localllm.server.openai_api import BadRequest
from localllm.server.security import BodyTooLarge, error_shape
from localllm.server.served import Busy

__all__ = ["LiveResponse", "error", "error_of", "read_json", "scrub", "until_disconnect"]

# -- errors: one line, no paths, in the route's API's shape -----------------------------------------

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-+@~]+){2,}")


def scrub(message: str) -> str:
    """A message with local paths cut to their last part (errors name files, not directories)."""
    return _PATH.sub(lambda m: re.split(r"[\\/]", m.group(0))[-1], message).splitlines()[0][:1000]


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None, headers: dict[str, str] | None = None,
          path: str = "") -> JSONResponse:  # fmt: skip
    """An error response; `path` (the route's) picks the shape: Ollama's on `/api/*`."""
    return JSONResponse(error_shape(path, scrub(message), kind, code, param), status_code=status,
                        headers=headers)  # fmt: skip


def error_of(e: BaseException, path: str = "") -> JSONResponse:
    """The response for an exception a route raised."""
    if isinstance(e, BadRequest):
        return error(400, str(e), code=e.code, param=e.param, path=path)
    if isinstance(e, BodyTooLarge):
        return error(413, "the request body is too large", code="request_too_large", path=path)
    if isinstance(e, Busy):
        return error(503, str(e), "server_busy", "server_busy",
                     headers={"Retry-After": str(e.retry_after)}, path=path)  # fmt: skip
    if isinstance(e, ModelNotFound):
        return error(404, str(e), code="model_not_found", param="model", path=path)
    if isinstance(e, DoesNotFit):
        return error(503, str(e), "server_error", "insufficient_memory", path=path)
    if isinstance(e, ContextOverflow):
        return error(400, str(e), code="context_length_exceeded", path=path)
    if isinstance(e, Unsupported):
        return error(400, str(e), code="unsupported", path=path)
    if isinstance(e, LocalLLMError):
        return error(400, str(e), path=path)
    return error(500, f"internal error ({type(e).__name__})", "server_error", path=path)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e.__class__.__name__}") from None


# -- streaming that notices a client leaving ------------------------------------------------------


class LiveResponse(Response):
    """Streams an async iterator of bytes while listening for the client to disconnect.

    Starlette's `StreamingResponse` only notices a gone client when a send fails, which never
    happens while a long prompt is evaluated (nothing is sent yet); this one listens all along, so
    the iterator is cancelled — and its `finally` cancels the engine's sequence — right away.
    """

    def __init__(self, body: AsyncIterator[bytes], media_type: str,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)  # no body yet: no Content-Length (the length is not known)
        self.body_iter = body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            async for part in self.body_iter:
                if part:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(listen())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
            with contextlib.suppress(BaseException):
                await self.body_iter.aclose()  # type: ignore[attr-defined]


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

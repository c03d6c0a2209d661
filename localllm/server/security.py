"""The server's door: body size, Host header and API key, checked before any route runs.

A plain ASGI middleware (no framework needed), so every route — OpenAI, Ollama, metrics — is
behind the same checks and none can forget them:

- a body over `max_body` bytes is 413 (by Content-Length at once; chunked bodies as they arrive);
- while bound to loopback, a Host header that is not this machine is 403 (DNS rebinding: a web page
  on evil.example that resolves to 127.0.0.1 must not reach the server with the browser's help);
- with an API key, every route but `/health` and `/` (Ollama's "is it up") needs
  `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC = ("/health", "/")  # Ollama clients ask `/` whether a server is up


def error_shape(path: str, message: str, kind: str, code: str | None = None,
                param: str | None = None) -> dict[str, Any]:  # fmt: skip
    """An error as the route's API words it: Ollama's `{"error": "text"}` on `/api/*` (its official
    client reads `error` as the text), Anthropic's typed error on `/v1/messages*`, else OpenAI's
    nested object."""
    if path == "/api" or path.startswith("/api/"):
        return {"error": message}
    if path.startswith("/v1/messages"):
        kind = {"model_not_found": "not_found_error", "request_too_large": "request_too_large"}.get(
            code or "", {"server_error": "api_error", "server_busy": "overloaded_error"}.get(kind, kind))
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_error(send: Send, status: int, message: str, kind: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None, path: str = "") -> None:  # fmt: skip
    body = json.dumps(error_shape(path, message, kind, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def local_host(host_header: str) -> bool:
    """Whether a Host header names this machine: localhost, 127.x.y.z or ::1, any port."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8080
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host in ("localhost", "localhost.") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BodyTooLarge(Exception):
    """A chunked body grew past the cap (the app's error handler answers 413 for it)."""


class Door:
    """ASGI middleware: body cap, Host check on loopback, API key."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, loopback: bool, max_body: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.loopback = loopback
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope.get("path", "")
        refusal = self._check(headers, path)
        if refusal is not None:
            status, message, kind, code = refusal
            extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
            await send_error(send, status, message, kind, code, extra, path)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if not started:
                await send_error(send, 413, f"the request body is over {self.max_body} bytes",
                                 "invalid_request_error", "request_too_large", path=path)  # fmt: skip

    def _check(self, headers: dict[str, str], path: str) -> tuple[int, str, str, str] | None:
        if self.loopback and not local_host(headers.get("host", "")):
            return (403, "this server only answers requests addressed to localhost",
                    "permission_error", "host_not_allowed")  # fmt: skip
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return (413, f"the request body is over {self.max_body} bytes",
                    "invalid_request_error", "request_too_large")  # fmt: skip
        if self.key is None or path in PUBLIC:
            return None
        given = headers.get("x-api-key", "")
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not given:
            return (401, "an API key is required (Authorization: Bearer KEY or x-api-key)",
                    "authentication_error", "missing_api_key")  # fmt: skip
        if not hmac.compare_digest(given.encode(), self.key):
            return 401, "the API key is not valid", "authentication_error", "invalid_api_key"
        return None

"""How a server is set up: one documented settings class, checked before anything binds.

Safe by default (REFERENCE.md, "Servers"): loopback only; any other address needs an API key;
no CORS headers unless an origin is named; a cap on request bodies.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.types import LoadOptions

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11435
DEFAULT_QUEUE = 16  # requests waiting for a slot, per model, before 503
DEFAULT_MAX_BODY = 8 * 1024 * 1024  # bytes
KEY_ENV = "LOCALLLM_API_KEY"
DEFAULT_KEEP_ALIVE = 300.0  # seconds a model no request holds stays loaded (Ollama's 5m)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: object, what: str = "keep_alive") -> float:
    """Ollama's `keep_alive`: seconds (a number) or a duration ("5m", "1h30m", "10s"); negative
    keeps the model loaded until it is stopped (inf); 0 unloads it once its requests end."""
    if isinstance(value, bool):
        raise LocalLLMError(f"{what} must be a number of seconds or a duration like 5m")
    if isinstance(value, (int, float)) and math.isfinite(value):
        return math.inf if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return keep_alive_seconds(float(text), what)
        except ValueError:
            pass
        sign, body = (-1, text[1:]) if text.startswith("-") else (1, text)
        parts = _DURATION.findall(body)
        if parts and "".join(n + u for n, u in parts) == body:
            seconds = sum(float(n) * _UNIT[u] for n, u in parts)
            return math.inf if sign < 0 and seconds > 0 else seconds
    raise LocalLLMError(f"{what} must be a number of seconds or a duration like 5m, not {value!r}")


def is_loopback(host: str) -> bool:
    """Whether a bind address only takes connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything `localllm serve` takes.

    Args:
        host, port: where to listen. A non-loopback host refuses to start without `api_key`.
        models: names served (loaded at start, listed first); the first is the default when a
            request names none. Requests may also name any model in the local store.
        api_key: required on every route but `/health` and `/` when set (`Authorization: Bearer` or
            `x-api-key`).
        cors: origins that get CORS headers; none by default.
        options: how models load (backend, context, KV cache, `parallel` running sequences).
        queue: requests per model that may wait for a slot; more get 503 with Retry-After.
        max_body: the largest request body in bytes; larger gets 413.
        keep_alive: seconds a model no request holds stays loaded (a request's `keep_alive`
            overrides it; inf: until stopped). The `models` served stay loaded regardless.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    models: tuple[str, ...] = ()
    api_key: str | None = None
    cors: tuple[str, ...] = ()
    options: LoadOptions = field(default_factory=LoadOptions)
    queue: int = DEFAULT_QUEUE
    max_body: int = DEFAULT_MAX_BODY
    keep_alive: float = DEFAULT_KEEP_ALIVE

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "cors", tuple(self.cors))
        if not 0 <= self.port <= 65535:
            raise LocalLLMError(f"--port must be between 0 and 65535, got {self.port}")
        if not 0 <= self.queue <= 4096:
            raise LocalLLMError(f"--queue must be between 0 and 4096, got {self.queue}")
        if self.max_body < 1024:
            raise LocalLLMError(f"--max-body must be at least 1024 bytes, got {self.max_body}")
        if self.api_key is not None and not self.api_key.strip():
            raise LocalLLMError("the API key is empty")
        if not is_loopback(self.host) and not self.api_key:
            raise LocalLLMError(
                f"refusing to listen on {self.host} without an API key: anyone who can reach it "
                f"could use it. Give --api-key, --api-key-file or ${KEY_ENV}, or bind 127.0.0.1"
            )
        for origin in self.cors:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise LocalLLMError(f"--cors takes an origin like http://localhost:3000, got {origin!r}")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def read_api_key(key: str | None, key_file: Path | None) -> str | None:
    """The key from --api-key, else --api-key-file (first line), else $LOCALLLM_API_KEY."""
    if key is not None and key_file is not None:
        raise LocalLLMError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            text = key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LocalLLMError(f"cannot read the API key file {key_file.name}: {e.__class__.__name__}") from None
        key = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not key:
            raise LocalLLMError(f"the API key file {key_file.name} is empty")
    return key if key is not None else (os.environ.get(KEY_ENV) or None)

"""Running the server: in the foreground (`localllm serve`) or on a thread (the app, the tests).

The socket is bound here, before uvicorn starts, so a port in use is one line (not a log record
and an exit from inside uvicorn), and port 0 picks a free port whose URL is then known. A running
server leaves `server.json` in the localllm home (its URL, pid and API key, private to the user)
for `localllm run`, `ps` and `stop` to find.
SIGTERM (what `systemctl stop` and `launchctl bootout` send) stops it as cleanly as Ctrl-C, with
exit status 0: a service manager that restarts on failure leaves it stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.server.config import ServerConfig
from localllm.server.served import Served


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        reason = "the port is in use" if e.errno in (98, 48, 10048) else (e.strerror or str(e))
        raise LocalLLMError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def state_file() -> Path:
    from localllm.models_registry.store import default_home

    return Path(default_home()) / "server.json"


class BackgroundServer:
    """A server on its own thread: `start()` returns once it answers; `stop()` shuts it down.

    Args:
        config: the settings (port 0 picks a free port; `url` says which).
        served: the models (made from `config` with its own pool when None; loaded by `start`).
        record: write `server.json` for `localllm ps` while running.
    """

    def __init__(self, config: ServerConfig, served: Served | None = None, *,
                 record: bool = False) -> None:  # fmt: skip
        self.config = config
        self._own_pool = served is None
        self.served = served or Served(config)
        self.record = record
        self._thread: threading.Thread | None = None
        self._uvicorn: Any = None
        self._sock: socket.socket | None = None
        self._port = 0  # the port bound (port 0 picks one)
        self.error: BaseException | None = None
        self.app: Any = None

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self._port or self.config.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        import uvicorn

        from localllm.server.app import create_app

        self._sock = bind(self.config.host, self.config.port)
        self._port = self._sock.getsockname()[1]
        try:
            self.served.start()
        except BaseException:
            self._sock.close()
            raise
        self.app = create_app(self.config, self.served)
        self._uvicorn = uvicorn.Server(_uvicorn_config(self.app))
        self._uvicorn.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._serve, name="localllm:server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._uvicorn.started:
            self.stop()
            raise LocalLLMError(f"the server did not start: {self.error or 'timed out'}")
        if self.record:
            _write_state(self.url, self.config.api_key)
        return self

    def _serve(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._sock])
        except BaseException as e:  # noqa: BLE001 - reported by start() / stop()
            self.error = e

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self.served.close()
        if self._own_pool:
            self.served.pool.close()
        if self.record:
            _clear_state(self.url)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(config: ServerConfig, *, announce: Any = print) -> None:
    """`localllm serve`: load, bind, announce, serve until Ctrl-C (uvicorn's own signal handling)."""
    import uvicorn

    from localllm.server.app import create_app

    sock = bind(config.host, config.port)
    served = Served(config)
    pool = served.pool
    try:
        with _sigterm_stops():
            served.start()
            app = create_app(config, served)
            url = f"http://{config.host}:{sock.getsockname()[1]}"
            names = ", ".join(config.models) or f"{served.default} (on first request)"
            _write_state(url, config.api_key)  # before the announcement: who reads it finds the server
            announce(f"localllm {url} — models: {names}; parallel {config.options.parallel}, queue {config.queue}"
                     + ("; API key required" if config.api_key else ""))  # fmt: skip
            try:
                uvicorn.Server(_uvicorn_config(app)).run(sockets=[sock])
            finally:
                _clear_state(url)
    except _Terminated:
        announce("localllm stopped (SIGTERM)")
    finally:
        with contextlib.suppress(OSError):
            sock.close()
        served.close()
        pool.close()


class _Terminated(BaseException):
    """SIGTERM arrived: unwinds like KeyboardInterrupt (every finally runs), then a clean exit."""


@contextlib.contextmanager
def _sigterm_stops() -> Any:
    """SIGTERM raises _Terminated. uvicorn captures SIGTERM while it serves, shuts down gracefully,
    and then raises the signal again into this handler; left at its default, that second raise
    killed the process before the cleanup (exit 143, a stale server.json, models not closed)."""

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _uvicorn_config(app: Any) -> Any:
    """uvicorn quiet (the server reports itself), our lifespan, a short graceful shutdown."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                          timeout_graceful_shutdown=3, timeout_keep_alive=5)  # fmt: skip


def _write_state(url: str, key: str | None) -> None:
    """server.json: the URL, the pid and (readable by this user only) the API key, so `localllm
    run`, `ps` and `stop` on this machine reach the server without being given the key."""
    with contextlib.suppress(OSError):
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"url": url, "pid": os.getpid(), "key": key}))
        tmp.replace(path)


def _clear_state(url: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        path = state_file()
        if json.loads(path.read_text()).get("url") == url:
            path.unlink()


@dataclass(frozen=True)
class Running:
    """The `localllm serve` that `server.json` names: where it listens and its API key."""

    url: str
    pid: int
    key: str | None = field(default=None, repr=False)  # never shown


def running() -> Running | None:
    """The server in `server.json` when the process that wrote it is still alive."""
    try:
        data = json.loads(state_file().read_text())
        pid, url, key = int(data["pid"]), str(data["url"]), data.get("key")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return Running(url, pid, key if isinstance(key, str) and key else None)

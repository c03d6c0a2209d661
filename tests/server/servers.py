"""Servers for the tests: on a thread, port 0, with a scripted model (fast) or the real default one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fakebackend import THINKING_TEMPLATE, FakeRunner

from conftest import need

need("fastapi", "pip install 'localllm[server]'")
need("httpx", "pip install httpx")

from localllm.engine import Model  # noqa: E402
from localllm.errors import ModelNotFound  # noqa: E402
from localllm.pool import ModelPool  # noqa: E402
from localllm.server.config import ServerConfig  # noqa: E402
from localllm.server.runner import BackgroundServer  # noqa: E402
from localllm.server.served import Served  # noqa: E402
from localllm.types import LoadOptions  # noqa: E402


class HeldBatch(FakeRunner):
    """A scripted runner whose forward passes wait while `hold` is clear (to line clients up)."""

    def __init__(self, hold: threading.Event | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.hold = hold

    def forward(self, pieces: Any, **kw: Any) -> Any:
        if self.hold is not None:
            self.hold.wait()
        return super().forward(pieces, **kw)


def fake_loader(step_s: float = 0.0, n_ctx: int = 256, max_batch: int = 64,
                hold: threading.Event | None = None) -> Any:  # fmt: skip
    """Models that say what the prompt asks (`say:TEXT`), `step_s` seconds per step."""

    def load(name: str, options: LoadOptions) -> Model:
        if not name.startswith("fake"):
            raise ModelNotFound(f"unknown model {name!r}: not in the store nor in the catalog")
        backend = HeldBatch(hold, n_ctx=n_ctx, n_slots=options.parallel, step_s=step_s, max_batch=max_batch)
        if name.startswith("fake-thinker"):  # a thinking model (Qwen3's template)
            from localllm.chat import ChatTemplate

            backend.chat_template = ChatTemplate(THINKING_TEMPLATE)
        return Model(backend, name, options=options)

    return load


@contextlib.contextmanager
def fake_server(*, step_s: float = 0.0, n_ctx: int = 256, max_batch: int = 64,
                hold: threading.Event | None = None, **config: Any) -> Iterator[BackgroundServer]:  # fmt: skip
    config.setdefault("models", ("fake",))
    config.setdefault("port", 0)
    config.setdefault("keep_alive", 0.0)  # a model no request holds goes at once (tests' pools)
    cfg = ServerConfig(**config)
    pool = ModelPool(fake_loader(step_s, n_ctx, max_batch, hold), fit=None, idle_s=0)
    server = BackgroundServer(cfg, Served(cfg, pool))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        pool.close()


@contextlib.contextmanager
def real_server(home: Path, *, backend: str = "llama.cpp", ctx: int = 2048, parallel: int = 4,
                queue: int = 16) -> Iterator[BackgroundServer]:  # fmt: skip
    """The real default model served from a store in `home` (registered there on start)."""
    from conftest import in_home

    cfg = ServerConfig(port=0, models=("smollm2",), queue=queue,
                       options=LoadOptions(backend=backend, ctx=ctx, parallel=parallel))  # fmt: skip
    with in_home(home):
        server = BackgroundServer(cfg).start()
    try:
        yield server
    finally:
        server.stop()

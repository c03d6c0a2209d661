"""The models a server answers with: names resolved through the pool, and admission per model.

Each loaded model takes `parallel` running sequences (its engine's slots) and `queue` more that
wait; a request beyond that is refused at once with 503 and a Retry-After estimated from how long
recent requests took — instead of piling up unboundedly, or stalling clients that have no slot, as
llama-cpp-python's server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from localllm.errors import LocalLLMError, ModelNotFound
from localllm.pool import ModelPool
from localllm.server.config import ServerConfig
from localllm.types import LoadOptions

DEFAULT_MODEL = "smollm2"


class Busy(LocalLLMError):
    """Every slot and queue place of a model is taken."""

    def __init__(self, model: str, retry_after: int) -> None:
        super().__init__(f"{model} is busy: every slot and queue place is taken; retry in {retry_after} s")
        self.retry_after = retry_after


class Gate:
    """In-flight requests of one loaded model: at most `slots + queue` at once."""

    def __init__(self, slots: int, queue: int) -> None:
        self.slots = max(1, slots)
        self.limit = self.slots + max(0, queue)
        self.inflight = 0
        self.avg_s = 0.0  # moving average of request durations
        self._lock = threading.Lock()

    def enter(self, name: str) -> float:
        with self._lock:
            if self.inflight >= self.limit:
                raise Busy(name, self.retry_after())
            self.inflight += 1
            return time.perf_counter()

    def leave(self, since: float) -> None:
        took = time.perf_counter() - since
        with self._lock:
            self.inflight = max(0, self.inflight - 1)
            self.avg_s = took if not self.avg_s else 0.8 * self.avg_s + 0.2 * took

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead drains `slots` at a time."""
        waves = max(1, self.inflight - self.slots + 1) / self.slots
        return max(1, min(60, math.ceil(waves * (self.avg_s or 1.0))))


@dataclass(eq=False)
class Lease:
    """One request's hold on a model and its admission; `close()` gives both back (once)."""

    served: Served
    name: str
    model: Any
    gate: Gate
    since: float
    closed: bool = False

    def close(self, keep_s: float | None = None) -> None:
        """Give the model back; it then stays loaded `keep_s` seconds (None: the server's
        `keep_alive`)."""
        if not self.closed:
            self.closed = True
            self.gate.leave(self.since)
            keep = self.served.config.keep_alive if keep_s is None else keep_s
            self.served.pool.release(self.model, keep)


class Served:
    """Name → loaded model (through a `ModelPool`), with a gate per loaded model."""

    def __init__(self, config: ServerConfig, pool: ModelPool | None = None, store: Any = None,
                 default: str | None = None) -> None:  # fmt: skip
        from localllm.models_registry.store import Store

        self.config = config
        self.store = store or Store()  # fixed when the server starts
        self.pool = pool or ModelPool(store=self.store)
        # what a request that names no model gets: the first served, else the given default
        self.default = config.models[0] if config.models else (default or DEFAULT_MODEL)
        self._held: list[Any] = []  # the configured models, held for the server's life
        # per loaded model, gone with it (an id could be reused by the next model loaded)
        self._gates: weakref.WeakKeyDictionary[Any, Gate] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.on_busy: Any = lambda _name: None  # told of each request refused with 503

    def start(self) -> None:
        """Load the configured models (blocking): a server that cannot load them does not start."""
        for name in self.config.models:
            self._held.append(self.pool.acquire(name, self.config.options))

    def close(self) -> None:
        for model in self._held:
            self.pool.release(model)
        self._held.clear()

    def stop(self, name: str) -> bool:
        """Unload `name` (`localllm stop`, `keep_alive: 0` with no prompt): at once when no
        request holds it, else as its last request ends; a served model stops being held.
        False when it was not loaded."""
        name = self.pool.canonical(name)
        held = [m for m in self._held if getattr(m, "name", None) == name]
        for model in held:
            self._held.remove(model)
            self.pool.release(model, 0.0)
        return self.pool.unload(name) > 0 or bool(held)

    def expires(self) -> dict[str, float]:
        """Per loaded model's name: when (epoch seconds) it unloads if no request comes; inf for
        a served model or a `keep_alive` < 0."""
        now = time.time()
        held = {getattr(m, "name", None) for m in self._held}
        out = {}
        for e in self.pool.loaded():
            if e.name in held:
                out[e.name] = math.inf
            else:
                out[e.name] = now + e.keep_s - (e.idle_s or 0.0)
        return out

    def options(self, **changes: Any) -> LoadOptions:
        given = {k: v for k, v in changes.items() if v is not None}
        return self.config.options.replace(**given) if given else self.config.options

    def gate(self, model: Any) -> Gate:
        with self._lock:
            gate = self._gates.get(model)
            if gate is None:
                slots = int(getattr(model, "parallel", 1) or 1)
                gate = self._gates[model] = Gate(slots, self.config.queue)
            return gate

    async def lease(self, name: str | None, options: LoadOptions | None = None) -> Lease:
        """Acquire the model (loading it off the event loop if needed) and a place at its gate."""
        name = name or self.default
        model = await asyncio.to_thread(self.pool.acquire, name, options or self.config.options)
        gate = self.gate(model)
        try:
            since = gate.enter(getattr(model, "name", name))
        except Busy:
            self.pool.release(model)
            self.on_busy(getattr(model, "name", name))
            raise
        return Lease(self, getattr(model, "name", name), model, gate, since)

    def loaded(self) -> Iterator[tuple[str, Any]]:
        """(name, model) of every loaded model (for metrics and `ps`)."""
        seen: set[int] = set()
        for model in [*self._held, *self.pool.models()]:
            if id(model) not in seen:
                seen.add(id(model))
                yield getattr(model, "name", "?"), model

    def queued(self, _name: str, model: Any) -> int:
        """Requests admitted for `model` that have no slot yet."""
        gate = self._gates.get(model)
        return max(0, gate.inflight - int(getattr(model, "running", 0))) if gate else 0

    def local_names(self) -> list[str]:
        """Configured models first, then every model in the local store."""
        names = list(self.config.models)
        with contextlib.suppress(LocalLLMError):
            names += [r.name for r in self.store.list() if r.name not in names]
        return names

    def record(self, name: str | None) -> Any:
        """The store record of a model name (404-worthy `ModelNotFound` when there is none)."""
        from localllm.models_registry.catalog import find_local

        record = find_local(name or self.default, self.store)
        if record is None:
            raise ModelNotFound(f"model {name or self.default!r} is not in the local store")
        return record

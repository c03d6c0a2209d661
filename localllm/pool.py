"""The loaded models of a process, shared: get-or-load by (name, options), counted, unloaded when idle.

Front doors ask the pool instead of loading (the app now, the server next): `acquire(name, options)`
returns the loaded `Model` for that key — loading it the first time, sharing it afterwards — and
`release(model)` gives it back. A model nobody holds stays loaded for `idle_s` seconds (0: it goes
at once), so reopening a chat or the next request does not pay for a load again.

Before a load the pool checks memory: the backend's estimate for the new model against free
memory less what the models it has loaded hold. Memory a loaded model holds may not show in a
measurement (llama.cpp maps weights from the file, and mapped pages count as available), so the pool
counts its own models by their estimates: it would rather unload an idle model, or refuse with one
`DoesNotFit` line, than let the machine swap. Idle models go first, least recently used first;
models in use are never unloaded for another.

Loads happen one at a time (so each memory check sees the models before it) and outside the pool's
lock: acquiring a loaded model never waits for another model's load. Thread-safe throughout.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import DoesNotFit, LocalLLMError
from localllm.types import LoadOptions

DEFAULT_IDLE_S = 300.0  # how long a model nobody holds stays loaded

Loader = Callable[[str, LoadOptions], Any]  # (name, options) -> Model; engine.load by default
Fit = Callable[[str, LoadOptions], "tuple[int, int] | None"]  # (bytes needed, bytes free) or None


@dataclass(eq=False)
class _Entry:
    name: str
    options: LoadOptions
    refs: int = 0
    model: Any = None
    held: int = 0  # bytes, by the estimate at load time (0: unknown)
    idle_since: float | None = None
    keep_s: float | None = None  # how long it stays loaded once idle (None: the pool's idle_s)
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    @property
    def key(self) -> tuple[str, LoadOptions]:
        return (self.name, self.options)


@dataclass(frozen=True)
class Loaded:
    """One loaded model, as `ModelPool.loaded()` reports it (for `ps` and the app)."""

    name: str
    options: LoadOptions
    refs: int
    held_bytes: int
    idle_s: float | None  # seconds since the last release; None while in use
    keep_s: float  # seconds it stays loaded once idle (inf: until unloaded)


def registry_fit(store: Any = None) -> Fit:
    """The default memory check: the chosen backend's estimate for a stored model.

    Returns None (no check here; the loader does its own) for a name that is not in the store yet.
    """

    def fit(name: str, options: LoadOptions) -> tuple[int, int] | None:
        from localllm import backends
        from localllm.memory import resolve_ctx
        from localllm.models_registry.catalog import find_local
        from localllm.models_registry.store import Store

        record = find_local(name, store or Store())
        if record is None:
            return None
        spec = backends.describe(options.backend, options)
        est = spec.estimate(record.info, options.replace(ctx=resolve_ctx(record.info, options.ctx)))
        return est.total_bytes, est.available_bytes

    return fit


def _engine_load(name: str, options: LoadOptions) -> Any:
    from localllm.engine import load

    return load(name, options)


class ModelPool:
    """Loaded models keyed by (name, LoadOptions), with reference counts and an idle timeout.

    Args:
        loader: `(name, options) -> Model`; `localllm.engine.load` by default.
        idle_s: seconds an unreferenced model stays loaded; 0 unloads it at its last release.
        fit: `(name, options) -> (bytes needed, bytes free) | None` for the memory check;
            by default the registry's estimate (`registry_fit`). None disables the check.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, loader: Loader | None = None, *, idle_s: float = DEFAULT_IDLE_S,
                 fit: Fit | None | str = "registry", store: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if idle_s < 0:
            raise ValueError("idle_s must be >= 0")
        self._loader = loader or _engine_load
        self._store = store
        self.idle_s = float(idle_s)
        self._fit: Fit | None = registry_fit(store) if fit == "registry" else fit  # type: ignore[assignment]
        self._clock = clock
        self._entries: dict[tuple[str, LoadOptions], _Entry] = {}
        self._cond = threading.Condition(threading.RLock())
        self._load_lock = threading.Lock()  # one load at a time
        self._reaper: threading.Thread | None = None
        self._closed = False

    # -- acquiring and releasing ---------------------------------------------------------------

    def acquire(self, name: str, options: LoadOptions | None = None) -> Any:
        """The loaded model for (name, options), loading it if needed; hold it until `release`.

        Raises what the load raises (one-line `LocalLLMError`s), or `DoesNotFit` when the model
        does not fit beside the models in use.
        """
        options = options or LoadOptions()
        name = self.canonical(name)
        with self._cond:
            if self._closed:
                raise LocalLLMError("the model pool is closed")
            expired = self._take_expired()
            entry = self._entries.get((name, options))
            mine = entry is None
            if entry is None:
                entry = self._entries[(name, options)] = _Entry(name, options)
            entry.refs += 1
            entry.idle_since = None
        self._close_all(expired)
        if not mine:
            entry.ready.wait()
            if entry.error is not None:
                raise entry.error
            return entry.model
        try:
            with self._load_lock:
                need = self._make_room(name, options)
                model = self._loader(name, options)
        except BaseException as e:
            with self._cond:
                entry.error = e
                self._entries.pop(entry.key, None)
                entry.ready.set()
            raise
        if not need and self._fit is not None:
            with contextlib.suppress(LocalLLMError, OSError):  # the load registered it: ask again
                known = self._fit(name, options)
                need = known[0] if known else 0
        with self._cond:
            entry.model, entry.held = model, need
            entry.ready.set()
            if self._closed:  # closed while loading: this model is not kept either
                self._entries.pop(entry.key, None)
        if self._closed:
            self._close_all([model])
            raise LocalLLMError("the model pool is closed")
        return model

    def canonical(self, name: str) -> str:
        """One key per model: `smollm2` and `smollm2:135m-instruct-q4_1` are the same one."""
        from localllm.models_registry.catalog import default_catalog, find_local
        from localllm.models_registry.names import parse_name
        from localllm.models_registry.store import Store

        try:
            record = find_local(name, self._store or Store())
            if record is not None:
                return record.name
            entry = default_catalog().resolve(parse_name(name))
            return entry.name if entry is not None else name
        except LocalLLMError:
            return name  # the load says what is wrong with it

    def release(self, model: Any, keep_s: float | None = None) -> None:
        """Give back a model from `acquire`. The last release starts its idle time; `keep_s`
        (Ollama's `keep_alive`) sets how long it then stays loaded: 0 unloads it at once,
        `math.inf` keeps it until `unload`, None leaves what was set (at first, `idle_s`)."""
        to_close = None
        with self._cond:
            if self._closed:  # close() unloaded everything already
                return
            entry = next((e for e in self._entries.values() if e.model is model and e.refs > 0),
                         None)  # fmt: skip
            if entry is None:
                raise ValueError("release() of a model this pool did not hand out (or released twice)")
            entry.refs -= 1
            if keep_s is not None:
                entry.keep_s = max(0.0, keep_s)
            if entry.refs == 0:
                entry.idle_since = self._clock()
                if self._keep(entry) == 0:
                    self._entries.pop(entry.key, None)
                    to_close = entry.model
                else:
                    self._start_reaper()
                    self._cond.notify_all()
        if to_close is not None:
            self._close_all([to_close])

    @contextlib.contextmanager
    def use(self, name: str, options: LoadOptions | None = None) -> Iterator[Any]:
        """`with pool.use("smollm2") as llm:` acquires and releases."""
        model = self.acquire(name, options)
        try:
            yield model
        finally:
            self.release(model)

    # -- what is loaded --------------------------------------------------------------------------

    def loaded(self) -> list[Loaded]:
        now = self._clock()
        with self._cond:
            return [Loaded(e.name, e.options, e.refs, e.held,
                           None if e.idle_since is None else now - e.idle_since, self._keep(e))
                    for e in self._entries.values() if e.model is not None]  # fmt: skip

    def unload(self, name: str) -> int:
        """Unload the models loaded under `name` (any options): at once when nobody holds them,
        else at their last release. Returns how many there were."""
        name = self.canonical(name)
        with self._cond:
            found = [e for e in self._entries.values() if e.name == name and e.model is not None]
            idle = [e for e in found if e.refs == 0]
            for e in found:
                e.keep_s = 0.0
            for e in idle:
                del self._entries[e.key]
            self._cond.notify_all()
        self._close_all([e.model for e in idle])
        return len(found)

    def models(self) -> list[Any]:
        """The loaded models themselves (for a server's metrics)."""
        with self._cond:
            return [e.model for e in self._entries.values() if e.model is not None]

    def sweep(self) -> list[str]:
        """Unload every model idle past the timeout now; returns their names."""
        with self._cond:
            expired = self._take_expired()
        self._close_all(expired)
        return [getattr(m, "name", "?") for m in expired]

    def close(self) -> None:
        """Unload every model (in use or not); acquire refuses afterwards."""
        with self._cond:
            self._closed = True
            models = [e.model for e in self._entries.values() if e.model is not None]
            self._entries.clear()
            self._cond.notify_all()
        self._close_all(models)
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)

    def __enter__(self) -> ModelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory --------------------------------------------------------------------------------

    def _make_room(self, name: str, options: LoadOptions) -> int:
        """Bytes the new model needs (0: unknown); unloads idle models if that makes it fit."""
        if self._fit is None:
            return 0
        known = self._fit(name, options)
        if known is None:
            return 0
        need, free = known
        with self._cond:
            loaded = [e for e in self._entries.values() if e.model is not None]
            held = sum(e.held for e in loaded)
            if need <= free - held:
                return need
            idle = sorted((e for e in loaded if e.refs == 0), key=lambda e: e.idle_since or 0.0)
            busy = [e for e in loaded if e.refs > 0]
            in_use = sum(e.held for e in busy)
            if need > free - in_use:
                raise DoesNotFit(_refusal(name, options, need, free, busy))
            victims = []
            for e in idle:
                if need <= free - held:
                    break
                victims.append(e.model)
                held -= e.held
                self._entries.pop(e.key, None)
        self._close_all(victims)
        return need

    # -- idle unloading --------------------------------------------------------------------------

    def _keep(self, e: _Entry) -> float:
        return self.idle_s if e.keep_s is None else e.keep_s

    def _take_expired(self) -> list[Any]:
        """(Under the lock.) Remove the entries idle past their time; their models, to close."""
        now = self._clock()
        gone = [e for e in self._entries.values() if e.refs == 0 and e.model is not None
                and e.idle_since is not None and now - e.idle_since >= self._keep(e)]  # fmt: skip
        for e in gone:
            del self._entries[e.key]
        return [e.model for e in gone]

    def _start_reaper(self) -> None:
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(target=self._reap, name="localllm:pool", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        """Sleep until the next model's idle time is up; unload it; stop when nothing is idle."""
        while True:
            with self._cond:
                if self._closed:
                    return
                expired = self._take_expired()
                due = [e.idle_since + self._keep(e) for e in self._entries.values()
                       if e.refs == 0 and e.idle_since is not None
                       and math.isfinite(self._keep(e))]  # fmt: skip
                if not expired:
                    if not due:
                        self._reaper = None
                        return
                    wait = min(due) - self._clock()
                    self._cond.wait(timeout=max(0.01, wait))
                    continue
            self._close_all(expired)

    @staticmethod
    def _close_all(models: list[Any]) -> None:
        for m in models:
            with contextlib.suppress(Exception):  # one model failing to close must not stop the rest
                m.close()


def _refusal(name: str, options: LoadOptions, need: int, free: int, busy: list[_Entry]) -> str:
    from localllm.model_info import human_bytes

    ctx = f" at context {options.ctx}" if options.ctx else ""
    text = f"{name}{ctx} needs {human_bytes(need)} but {human_bytes(max(0, free))} is free"
    if busy:
        held = sum(e.held for e in busy)
        names = ", ".join(sorted({e.name for e in busy}))
        text += f" and models in use hold {human_bytes(held)} ({names})"
    return text + "; close what uses them, or try a smaller context or --kv-cache q8_0"

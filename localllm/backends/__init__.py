"""Inference backends, by spec: what each can do, whether it runs here, what it needs, how to open it.

A `BackendSpec` is cheap to hold: its name, its `Capabilities`, an `available()` check, a memory
estimate and a lazy factory (`"module:function"`). `load()`, every `--backend` flag, `show`, the
doctor and the app ask this registry, so nothing that only wants to *describe* a backend imports
it, and a new backend is one more spec here. Importing this module imports no backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localllm.errors import BackendUnavailable, LocalLLMError

if TYPE_CHECKING:
    from pathlib import Path

    from localllm.memory import MemoryEstimate
    from localllm.model_info import ModelInfo
    from localllm.types import LoadOptions


@dataclass(frozen=True)
class Capabilities:
    """What front doors may offer for a backend, and must refuse clearly otherwise."""

    kv_cache_types: tuple[str, ...]
    streaming: bool  # StreamingLLM context policy (--streaming SINKS:WINDOW)
    speculative: tuple[str, ...]  # modes: off, lookup, self, draft
    batching: bool  # several sequences in one step
    embeddings: bool
    grammar: bool  # constrained decoding: response_format, tool_choice "required" or a function
    eviction: tuple[str, ...] = ()  # --evict policies, e.g. h2o
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("auto",)  # working precision (--dtype); "auto" means the file's

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why not (or, when ok, a short note: "probe passed", "cached")
    fix: str = ""

    def message(self) -> str:
        return f"{self.reason}; fix: {self.fix}" if self.fix and not self.ok else self.reason


@dataclass(frozen=True)
class BackendSpec:
    name: str
    capabilities: Capabilities
    factory: str  # "module:function" taking (path, options, *, name, digest, home) -> backend
    available: Callable[[], Availability]
    estimate: Callable[..., MemoryEstimate]  # (info, options, available=None) -> MemoryEstimate
    summary: str = ""

    def open(self, path: Path, options: LoadOptions, **kw: Any) -> Any:
        """Import the backend module (only now) and open the model with it."""
        module, _, func = self.factory.partition(":")
        return getattr(importlib.import_module(module), func)(path, options, **kw)


# -- llama.cpp -------------------------------------------------------------------------------

LLAMACPP_KV_TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

LLAMACPP = Capabilities(
    kv_cache_types=LLAMACPP_KV_TYPES,
    streaming=True,
    speculative=("off",),
    batching=True,
    embeddings=True,
    grammar=False,
    eviction=(),
    devices=("cpu", "cuda", "mps"),
    dtypes=("auto",),
)


def _llamacpp_available() -> Availability:
    """The first-run probe (once per build and machine, in a child: a SIGILL becomes a line)."""
    from localllm.backends.llamacpp_guard import probe

    v = probe()
    return Availability(v.ok, v.reason, v.fix)


def _llamacpp_estimate(info: ModelInfo, options: LoadOptions, available: Any = None) -> Any:
    from localllm.memory import estimate

    return estimate(info, ctx=options.ctx, kv_cache=options.kv_cache, parallel=options.parallel,
                    device="cpu" if options.device == "cpu" else "auto",
                    available=available)  # fmt: skip


_SPECS: dict[str, BackendSpec] = {}
# Names a user may know from PRODUCT.md that this build cannot load, and why.
_PLANNED = {
    "torch": "the torch engine is not part of this build yet; use --backend llama.cpp",
}
AUTO_ORDER: list[str] = []  # what `auto` tries, in order


def register(spec: BackendSpec, *, auto: bool = True) -> None:
    """Add (or replace) a backend. Tests register scripted ones; `auto` puts it in the auto order."""
    _SPECS[spec.name] = spec
    if auto and spec.name not in AUTO_ORDER:
        AUTO_ORDER.append(spec.name)


def unregister(name: str) -> None:
    _SPECS.pop(name, None)
    if name in AUTO_ORDER:
        AUTO_ORDER.remove(name)


register(BackendSpec(
    name="llama.cpp",
    capabilities=LLAMACPP,
    factory="localllm.backends.llamacpp:open_backend",
    available=_llamacpp_available,
    estimate=_llamacpp_estimate,
    summary="llama.cpp through llama-cpp-python: GGUF, every quant, CPU/CUDA/Metal",
))  # fmt: skip


def names() -> tuple[str, ...]:
    """Every name `--backend` accepts, `auto` first."""
    return ("auto", *_SPECS, *(n for n in _PLANNED if n not in _SPECS))


def get(name: str) -> BackendSpec:
    """The spec for a concrete backend name (not `auto`), or one line saying why there is none."""
    if name in _SPECS:
        return _SPECS[name]
    if name in _PLANNED:
        raise BackendUnavailable(_PLANNED[name])
    raise LocalLLMError(f"unknown backend {name!r} (choose from {', '.join(names())})")


def specs() -> tuple[BackendSpec, ...]:
    return tuple(_SPECS.values())


def describe(name: str = "auto") -> BackendSpec:
    """The spec a load would use, without checking that it runs here (for `show` and the app)."""
    if name == "auto":
        if not AUTO_ORDER:
            raise BackendUnavailable("no backend is installed")
        return _SPECS[AUTO_ORDER[0]]
    return get(name)


def choose(name: str = "auto") -> BackendSpec:
    """The backend a load will use, or `BackendUnavailable` saying why none can run here.

    `auto` takes the first available backend in `AUTO_ORDER`; a named one must be available itself.
    """
    if name != "auto":
        spec = get(name)
        a = spec.available()
        if not a.ok:
            raise BackendUnavailable(f"{spec.name} cannot run on this machine: {a.message()}")
        return spec
    said = []
    alone = " (and no other backend is installed)" if len(AUTO_ORDER) == 1 else ""
    for n in AUTO_ORDER:
        a = _SPECS[n].available()
        if a.ok:
            return _SPECS[n]
        said.append(f"{n} cannot run on this machine{alone}: {a.message()}")
    raise BackendUnavailable("; ".join(said) or "no backend is installed")

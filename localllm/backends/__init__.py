"""Inference backends, by spec: what each can do, whether it runs here, what it needs, how to open it.

A `BackendSpec` is cheap to hold: its name, its `Capabilities`, an `available()` check, a memory
estimate and a lazy factory (`"module:function"`). `load()`, every `--backend` flag, `show`, the
doctor and the app ask this registry, so nothing that only wants to *describe* a backend imports
it, and a new backend is one more spec here. Importing this module imports no backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localllm.errors import BackendUnavailable, LocalLLMError
from localllm.memory import kv_types

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
    speculative: tuple[str, ...]  # modes: off, lookup, self, draft, head
    batching: bool  # several sequences in one step
    embeddings: bool
    grammar: bool  # constrained decoding: response_format, tool_choice "required" or a function
    eviction: tuple[str, ...] = ()  # --evict policies, e.g. h2o
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("auto",)  # working precision (--dtype); "auto" means the file's
    placement: bool = False  # layers split between GPUs and the CPU (--gpu-layers, --tensor-split, --cpu-moe)

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
    estimate: Callable[..., MemoryEstimate]  # (info, options, available=None, devices=None)
    summary: str = ""
    # (path) -> None when the backend can read this file, else why not (one phrase)
    suits: Callable[[Path], str | None] = lambda _path: None

    def open(self, path: Path, options: LoadOptions, **kw: Any) -> Any:
        """Import the backend module (only now) and open the model with it."""
        module, _, func = self.factory.partition(":")
        return getattr(importlib.import_module(module), func)(path, options, **kw)


# -- llama.cpp -------------------------------------------------------------------------------

LLAMACPP = Capabilities(
    kv_cache_types=kv_types("llama.cpp"),
    streaming=True,
    speculative=("off", "lookup", "draft"),
    batching=True,
    embeddings=True,
    grammar=True,  # llguidance masks (localllm.structured)
    eviction=(),
    devices=("cpu", "cuda", "mps"),
    dtypes=("auto",),
    placement=True,
)


def _llamacpp_available() -> Availability:
    """The first-run probe (once per build and machine, in a child: a SIGILL becomes a line)."""
    from localllm.backends.llamacpp_guard import probe

    v = probe()
    return Availability(v.ok, v.reason, v.fix)


def _llamacpp_estimate(info: ModelInfo, options: LoadOptions, available: Any = None,
                       devices: Any = None) -> Any:  # fmt: skip
    """With GPUs in the inventory (`devices`, else the detected or described one): the offload
    plan's placement (`memory.plan`)."""
    from localllm.memory import estimate

    return estimate(info, ctx=options.ctx, kv_cache=options.kv_cache, parallel=options.parallel,
                    device="cpu" if options.device == "cpu" else "auto",
                    available=available, devices=devices, placement=options.placement)  # fmt: skip


# -- torch ----------------------------------------------------------------------------------

TORCH_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")  # Mistral files say "llama"
TORCH_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                      "Q6_K")  # fmt: skip

TORCH = Capabilities(
    kv_cache_types=kv_types("torch"),
    streaming=True,
    speculative=("off", "lookup", "self", "draft", "head"),
    batching=True,
    embeddings=True,
    grammar=True,  # llguidance masks (localllm.structured)
    eviction=("h2o",),
    devices=("cpu", "cuda", "mps"),
    dtypes=("f32", "bf16", "f16", "int4"),
)


def _torch_available() -> Availability:
    """Whether torch and tokenizers are installed (found, not imported: importing torch takes seconds)."""
    from importlib.util import find_spec

    missing = [m for m in ("torch", "tokenizers") if find_spec(m) is None]
    if missing:
        return Availability(False, f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                            "not installed", "pip install 'localllm[torch]'")  # fmt: skip
    from importlib.metadata import PackageNotFoundError, version

    try:
        old = torch_too_old(version("torch"))
    except PackageNotFoundError:  # torch without its metadata (a source tree on the path)
        old = None
    if old:
        return Availability(False, old, TORCH_FIX)
    return Availability(True, "torch is installed")


TORCH_MIN = (2, 5)  # SDPA's enable_gqa, the CPU int4 matmul
TORCH_FIX = f"pip install 'torch>={'.'.join(map(str, TORCH_MIN))}'"


def torch_too_old(version: str) -> str | None:
    """Why a torch of this version cannot run the torch engine (None: it can)."""
    import re

    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) >= TORCH_MIN:
        return None
    need = ".".join(map(str, TORCH_MIN))
    return f"torch {version} is too old for the torch engine (it needs {need} or newer: SDPA's enable_gqa)"


def _torch_suits(path: Path) -> str | None:
    """The torch engine reads these architectures and tensor types; anything else is why not."""
    from localllm.gguf_file import read_gguf

    f = read_gguf(path)
    arch = f.metadata.get("general.architecture")
    if arch not in TORCH_ARCHITECTURES:
        return f"it has no {arch} architecture (it has {', '.join(TORCH_ARCHITECTURES)})"
    odd = sorted({t.ggml_type.name for t in f.tensors.values()} - set(TORCH_TENSOR_TYPES))
    if odd:
        return f"it cannot read {', '.join(odd)} tensors (it reads {', '.join(TORCH_TENSOR_TYPES)})"
    return None


def _torch_estimate(info: ModelInfo, options: LoadOptions, available: Any = None,
                    devices: Any = None) -> Any:  # fmt: skip
    """llama.cpp's estimate with the torch engine's weights: the working precision's bytes per
    parameter (on the CPU, f16 and int4 keep the file's embedding rows for lookups beside the fp16
    head, counted as 2 bytes per weight: quantized rows take less; int4 is counted as f16, an
    upper bound: only 4-bit feed-forward matrices shrink), on the GPU when one is seen."""
    from dataclasses import replace

    from localllm.memory import Available, available_memory, estimate, kv_cache_bytes

    if available is None and devices is not None:  # a described machine: its first CUDA GPU
        gpu = next((d for d in devices.gpus if d.kind == "cuda"), None)
        if gpu is not None and options.device != "cpu":
            available = Available(gpu.id, gpu.free_bytes, gpu.total_bytes)
        else:
            available = Available("cpu", devices.cpu.free_bytes, devices.cpu.total_bytes)
    avail = available or available_memory("cpu" if options.device == "cpu" else "auto")
    gpu = avail.device.startswith("cuda")
    dtype = options.dtype if options.dtype != "auto" else "bf16" if gpu else "int4"
    per = {"f32": 4, "bf16": 2, "f16": 2, "int4": 2}.get(dtype, 4)
    embedding = info.vocab_size * info.n_embd * 2 if dtype in ("f16", "int4") and not gpu else 0
    weights = info.parameters * per + embedding
    est = estimate(info, ctx=options.ctx, kv_cache=options.kv_cache, parallel=options.parallel,
                   available=avail)  # fmt: skip
    # its caches hold what the policy keeps, not llama.cpp's padded context: StreamingLLM's
    # sinks and window, H2O's budget
    tokens = est.ctx
    policy = options.context
    if policy.enabled:
        tokens = min(tokens, (policy.sinks or 0) + policy.window)
    if options.evict:
        tokens = min(tokens, int(options.evict.partition(":")[2]))
    kv = kv_cache_bytes(info, tokens, est.type_k, est.type_v) * max(1, options.parallel)
    return replace(est, weights_bytes=int(weights), kv_bytes=kv)


_SPECS: dict[str, BackendSpec] = {}
# Names a user may know from PRODUCT.md that this build cannot load, and why.
_PLANNED: dict[str, str] = {}
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
    factory="localllm.backends.llamacpp:open_runner",
    available=_llamacpp_available,
    estimate=_llamacpp_estimate,
    summary="llama.cpp through llama-cpp-python: GGUF, every quant, CPU/CUDA/Metal",
))  # fmt: skip

register(BackendSpec(
    name="torch",
    capabilities=TORCH,
    factory="localllm.backends.torch.runner:open_runner",
    available=_torch_available,
    estimate=_torch_estimate,
    summary="localllm's own PyTorch engine: Llama, Qwen 2/3, Gemma 3 on GGUF weights; CPU/CUDA/Metal",
    suits=_torch_suits,
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


def check_options(options: LoadOptions, caps: Capabilities, backend: str) -> None:
    """Every load option the backend lacks is one `Unsupported` line, before anything loads."""
    from localllm.errors import Unsupported
    from localllm.memory import parse_kv_cache

    def no(what: str, has: Sequence[str] | None = None,
           elsewhere: Callable[[Capabilities], bool] | None = None) -> Unsupported:  # fmt: skip
        tail = f" (it has: {', '.join(has)})" if has else ""
        others = [s.name for s in specs()
                  if elsewhere is not None and s.name != backend and elsewhere(s.capabilities)]  # fmt: skip
        if others:
            tail += f"; the {others[0]} backend has it (--backend {others[0]})"
        return Unsupported(f"the {backend} backend has no {what}{tail}")

    for t in dict.fromkeys(parse_kv_cache(options.kv_cache)):
        if t not in caps.kv_cache_types:
            raise no(f"{t} KV cache", caps.kv_cache_types, lambda c, t=t: t in c.kv_cache_types)  # type: ignore[misc]
    if options.streaming and not caps.streaming:
        raise no("context shift (--streaming)", None, lambda c: c.streaming)
    if options.evict:
        kind = options.evict.partition(":")[0]
        if kind not in caps.eviction:
            raise no(f"{kind} eviction (--evict)", caps.eviction or ("none",),
                     lambda c: kind in c.eviction)  # fmt: skip
    mode = options.speculative_mode
    if mode != "auto" and mode not in caps.speculative:
        raise no(f"speculative mode {mode!r}", caps.speculative, lambda c: mode in c.speculative)
    if options.device not in ("auto", *caps.devices):
        raise no(f"{options.device} device", caps.devices)
    if options.dtype not in ("auto", *caps.dtypes):
        raise no(f"{options.dtype} working dtype", caps.dtypes)
    if not caps.placement:
        for flag, value, default in (("--gpu-layers", options.gpu_layers, "auto"),
                                     ("--tensor-split", options.tensor_split, None),
                                     ("--cpu-moe", options.cpu_moe, None)):  # fmt: skip
            if value != default:
                raise no(f"layer placement ({flag}: it holds the whole model on one device)",
                         None, lambda c: c.placement)  # fmt: skip


def _refuses(spec: BackendSpec, options: Any) -> str | None:
    """Why `spec` cannot honour load `options` (a KV type, --streaming, --evict, ...), or None."""
    from localllm.errors import Unsupported

    try:
        check_options(options, spec.capabilities, spec.name)
    except Unsupported as e:
        return str(e)
    return None


def describe(name: str = "auto", options: Any = None) -> BackendSpec:
    """The spec a load would use, without checking that it runs here (for `show` and the app).
    With load `options`, auto means the first backend that can honour them."""
    if name == "auto":
        if not AUTO_ORDER:
            raise BackendUnavailable("no backend is installed")
        if options is not None:
            for n in AUTO_ORDER:
                if _refuses(_SPECS[n], options) is None:
                    return _SPECS[n]
        return _SPECS[AUTO_ORDER[0]]
    return get(name)


def choose(name: str = "auto", path: Path | None = None) -> BackendSpec:
    """The backend a load will use, or `BackendUnavailable` saying why none can run here."""
    return select(name, path)[0]


def select(name: str = "auto", path: Path | None = None, *,
           failed: Mapping[str, str] | None = None,
           options: Any = None) -> tuple[BackendSpec, str]:  # fmt: skip
    """The backend a load of `path` will use and why, or `BackendUnavailable` saying why none can.

    `auto` takes the first backend in `AUTO_ORDER` that runs here and suits the file (llama.cpp
    first when its probe passes), passing over those in `failed` (name → why opening this file
    failed: llama.cpp's first-load check refusing it); a named one must run here and suit the
    file itself.
    (With load `options`, auto also passes over backends that cannot honour them.)
    """
    if name != "auto":
        spec = get(name)
        a = spec.available()
        if not a.ok:
            raise BackendUnavailable(f"{spec.name} cannot run on this machine: {a.message()}")
        why = spec.suits(path) if path is not None else None
        if why:
            raise BackendUnavailable(f"the {spec.name} backend cannot load this file: {why}")
        return spec, f"asked for (--backend {spec.name})"
    said: list[str] = []
    alone = " (and no other backend is installed)" if len(AUTO_ORDER) == 1 else ""
    for n in AUTO_ORDER:
        spec = _SPECS[n]
        if failed and n in failed:
            said.append(f"{n} failed on this file: {failed[n]}")
            continue
        a = spec.available()
        if not a.ok:
            said.append(f"{n} cannot run on this machine{alone}: {a.message()}")
            continue
        why = spec.suits(path) if path is not None else None
        if why:
            said.append(f"{n} cannot load this file: {why}")
            continue
        refused = _refuses(spec, options) if options is not None else None
        if refused:
            said.append(refused)
            continue
        first = f"auto: {n} runs here ({a.reason})"
        return spec, "; ".join([first, *said]) if said else first
    raise BackendUnavailable("; ".join(said) or "no backend is installed")

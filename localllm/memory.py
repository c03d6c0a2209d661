"""Memory estimate: will this model, at this context and KV-cache type, fit?

total = weights (the GGUF's tensor bytes)
      + KV cache  (per layer: ctx × kv_heads × head_dim bytes, for K and for V, GQA aware)
      + compute   (llama.cpp's scheduler buffer: dominated by f32 logits for one micro-batch)

Checked against llama.cpp's own report for the same file, context and cache type (see
tests/test_memory.py): KV bytes match exactly, compute within a few percent.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGML_TYPE_BY_NAME
from localllm.model_info import ModelInfo


@dataclass(frozen=True)
class KVType:
    """A KV-cache element type: what a token's row of it takes, and which engines have it.

    `llama_cpp` and `torch` are the type's place in that engine's list (what `show`, the doctor
    and the app print, and `--kv-cache` accepts; 0: the engine has no such cache)."""

    name: str
    block: int  # elements per block (1: unblocked)
    block_bytes: float  # bytes per block: codes, and the block's scales and zero points
    head_bytes: int = 0  # bytes per token and head on top of the rows (one f16 scale per head)
    llama_cpp: int = 0
    torch: int = 0

    def row_bytes(self, n: int, heads: int = 1) -> float:
        """Bytes for one token's row of `n` elements over `heads` heads (as ggml_row_size for
        block types)."""
        return -(-n // self.block) * self.block_bytes + self.head_bytes * heads


def _ggml(name: str, **places: int) -> KVType:
    """A ggml type, sized as ggml's type table (`gguf_file.GGML_TYPES`) has it."""
    t = GGML_TYPE_BY_NAME[name.upper()]
    return KVType(name, t.block_size, t.type_size, **places)


_GROUP = 64  # elements per f16 scale and f16 zero point in the torch engine's int4 and int2

# Every KV-cache type, once (engines take their lists from here: `kv_types`). llama.cpp's are
# ggml types; the torch engine's own (`backends.torch.kvquant`) int8 and fp8 keep one f16 scale
# per token and head, int4 and int2 a scale and a zero point per group.
KV_TYPES: dict[str, KVType] = {t.name: t for t in (
    #     name      place in llama.cpp's list, in torch's
    _ggml("f16",    llama_cpp=1, torch=1),
    _ggml("f32",    llama_cpp=2, torch=3),
    _ggml("bf16",   llama_cpp=3, torch=2),
    _ggml("q8_0",   llama_cpp=4),
    _ggml("q4_0",   llama_cpp=5),
    _ggml("q4_1",   llama_cpp=6),
    _ggml("iq4_nl", llama_cpp=7),
    _ggml("q5_0",   llama_cpp=8),
    _ggml("q5_1",   llama_cpp=9),
    KVType("int8",  1, 1, head_bytes=2, torch=4),
    KVType("fp8",   1, 1, head_bytes=2, torch=5),
    KVType("int4",  1, 0.5 + 4 / _GROUP, torch=6),
    KVType("int2",  1, 0.25 + 4 / _GROUP, torch=7),
)}  # fmt: skip
KV_CACHE_TYPES: tuple[str, ...] = tuple(KV_TYPES)
_ENGINES = {"llama.cpp": "llama_cpp", "torch": "torch"}  # engine name → its KVType column


def kv_types(engine: str) -> tuple[str, ...]:
    """The KV-cache types an engine ("llama.cpp", "torch") has, in the order it lists them."""
    if engine not in _ENGINES:
        raise ValueError(f"no engine {engine!r} (known: {', '.join(_ENGINES)})")
    column = _ENGINES[engine]
    have = [t for t in KV_TYPES.values() if getattr(t, column)]
    return tuple(t.name for t in sorted(have, key=lambda t: getattr(t, column)))


DEFAULT_CTX = 4096  # what `run` and `show` use unless --ctx says otherwise (capped by the model)
LLAMACPP_CTX_PAD = 256  # llama.cpp rounds the context up to a multiple of this
DEFAULT_UBATCH = 512  # llama.cpp's default micro-batch


def parse_kv_cache(spec: str) -> tuple[str, str]:
    """`f16` → (f16, f16); `k=q8_0,v=f16` → (q8_0, f16). Raises a one-line error otherwise."""
    spec = spec.strip().lower()
    if "=" not in spec:
        k = v = spec
    else:
        parts = dict(p.split("=", 1) if "=" in p else ("", p) for p in spec.split(","))
        if set(parts) != {"k", "v"}:
            raise LocalLLMError(f"bad --kv-cache {spec!r}: use TYPE or k=TYPE,v=TYPE")
        k, v = parts["k"].strip(), parts["v"].strip()
    for t in (k, v):
        if t not in KV_CACHE_TYPES:
            raise LocalLLMError(
                f"unknown KV cache type {t!r} (choose from {', '.join(KV_CACHE_TYPES)})"
            )
    return k, v


def element_bytes(cache_type: str, head_dim: int = 64) -> float:
    """Bytes per cached element of a type, scales and zero points included (for one head of
    `head_dim` where a type keeps one scale per head)."""
    return KV_TYPES[cache_type].row_bytes(head_dim, 1) / head_dim


def kv_bytes_per_token(info: ModelInfo, type_k: str = "f16", type_v: str = "f16") -> float:
    """What one more cached token costs, K and V over every layer: codes plus scales and zero
    points (f16: 2 bytes × 2 × layers × kv_heads × head_dim)."""
    k, v = KV_TYPES[type_k], KV_TYPES[type_v]
    return sum(k.row_bytes(h * info.head_dim_k, h) + v.row_bytes(h * info.head_dim_v, h)
               for h in info.kv_heads)  # fmt: skip


def kv_cache_bytes(info: ModelInfo, ctx: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes of the KV cache for `ctx` positions (one sequence)."""
    return int(kv_bytes_per_token(info, type_k, type_v) * ctx)


def compute_buffer_bytes(info: ModelInfo, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """llama.cpp's compute buffer: f32 logits for a micro-batch plus the widest activation."""
    return n_ubatch * (info.vocab_size + max(info.n_ff, 4 * info.n_embd)) * 4


@dataclass(frozen=True)
class Available:
    device: str  # "cpu" or "cuda:0"
    bytes: int
    total: int


def available_memory(device: str = "auto") -> Available:
    """Free memory on `device`: RAM for cpu/mps, the GPU's free memory for cuda.

    Reads nvidia-smi rather than importing torch, so `show` stays fast.
    """
    if device in ("auto", "cuda"):
        gpu = _nvidia_free()
        if gpu is not None:
            return gpu
        if device == "cuda":
            raise LocalLLMError("no CUDA GPU found (nvidia-smi reports none)")
    import psutil

    vm = psutil.virtual_memory()
    return Available("cpu" if device != "mps" else "mps", int(vm.available), int(vm.total))


def _nvidia_free() -> Available | None:
    if "torch" in sys.modules:  # already paid for: ask torch directly
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(0)
            return Available("cuda:0", int(free), int(total))
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.splitlines()  # fmt: skip
        free, total = (int(x) * 1024 * 1024 for x in out[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return Available("cuda:0", free, total)


@dataclass(frozen=True)
class MemoryEstimate:
    ctx: int
    type_k: str
    type_v: str
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    device: str
    available_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total_bytes": self.total_bytes, "fits": self.fits}


def resolve_ctx(info: ModelInfo, ctx: int | None) -> int:
    """The context a run will use: asked for, else DEFAULT_CTX capped by the model's own."""
    if ctx is None:
        return min(DEFAULT_CTX, info.context_length or DEFAULT_CTX)
    if ctx <= 0:
        raise LocalLLMError(f"--ctx must be positive, got {ctx}")
    return ctx


def estimate(
    info: ModelInfo,
    *,
    ctx: int | None = None,
    kv_cache: str = "f16",
    device: str = "auto",
    available: Available | None = None,
    parallel: int = 1,
) -> MemoryEstimate:
    """Estimate what loading `info` with the llama.cpp backend needs, and what is free.

    `parallel` sequences each get a cache of `ctx` positions (llama.cpp's per-sequence cache).
    """
    n = resolve_ctx(info, ctx)
    padded = -(-n // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD
    type_k, type_v = parse_kv_cache(kv_cache)
    avail = available or available_memory(device)
    return MemoryEstimate(
        ctx=n,
        type_k=type_k,
        type_v=type_v,
        weights_bytes=info.weights_bytes,
        kv_bytes=kv_cache_bytes(info, padded, type_k, type_v) * max(1, parallel),
        compute_bytes=compute_buffer_bytes(info),
        device=avail.device,
        available_bytes=avail.bytes,
    )

"""What a model is, read from its GGUF header: the facts `list`, `show` and the memory estimate use.

Kept as plain data so the store's index can cache it and `localllm list` never reopens weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from localllm.errors import GGUFFormatError
from localllm.gguf_file import FILE_TYPES, GGUFFile

_MAX_LAYERS = 1 << 16
_MAX_HEADS = 1 << 16


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    name: str
    parameters: int
    quant: str
    context_length: int
    n_layers: int
    n_embd: int
    n_heads: int
    kv_heads: tuple[int, ...]  # per layer: GQA models share few KV heads
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    vocab_size: int
    weights_bytes: int
    file_size: int
    sliding_window: int = 0  # 0 when every layer attends to the whole context
    has_chat_template: bool = False
    license: str = ""

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache, summed over layers."""
        return sum(h * (self.head_dim_k + self.head_dim_v) for h in self.kv_heads)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_heads"] = list(self.kv_heads)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelInfo:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["kv_heads"] = tuple(kw.get("kv_heads", ()))
        return cls(**kw)


def _int(gf: GGUFFile, key: str, default: int | None = None, cap: int = 1 << 40) -> int:
    v = gf.get(key, default)
    if v is None:
        raise GGUFFormatError(gf.path, f"{key} is missing")
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= cap:
        raise GGUFFormatError(gf.path, f"{key} has an impossible value {v!r}")
    return v


def _per_layer(gf: GGUFFile, key: str, n_layers: int, default: int) -> tuple[int, ...]:
    """Head counts are a scalar or, for some architectures, one value per layer."""
    v = gf.get(key, default)
    if isinstance(v, int) and not isinstance(v, bool):
        values: tuple[int, ...] = (v,) * n_layers
    elif hasattr(v, "__len__") and len(v) == n_layers and all(isinstance(x, int) for x in v):
        values = tuple(v)
    else:
        raise GGUFFormatError(gf.path, f"{key} has an impossible value {v!r}")
    if not all(0 <= x <= _MAX_HEADS for x in values):
        raise GGUFFormatError(gf.path, f"{key} has an impossible value")
    return values


def quant_name(gf: GGUFFile) -> str:
    """The file's quantization: `general.file_type`, else the type holding most weight bytes."""
    ft = gf.get("general.file_type")
    if isinstance(ft, int) and ft in FILE_TYPES:
        return FILE_TYPES[ft]
    weight: dict[str, int] = {}
    for t in gf.tensors.values():
        if len(t.shape) >= 2:
            weight[t.ggml_type.name] = weight.get(t.ggml_type.name, 0) + t.nbytes
    return max(weight, key=weight.__getitem__) if weight else "unknown"


def model_info(gf: GGUFFile) -> ModelInfo:
    arch = gf.architecture
    n_layers = _int(gf, f"{arch}.block_count", cap=_MAX_LAYERS)
    n_embd = _int(gf, f"{arch}.embedding_length")
    heads = _per_layer(gf, f"{arch}.attention.head_count", n_layers, 0)
    n_heads = max(heads, default=0)
    kv_heads = _per_layer(gf, f"{arch}.attention.head_count_kv", n_layers, n_heads)
    head_dim = n_embd // n_heads if n_heads else 0
    tokens = gf.get("tokenizer.ggml.tokens")
    vocab = _int(gf, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0)
    ff = gf.get(f"{arch}.feed_forward_length", 0)
    n_ff = max(ff) if hasattr(ff, "__len__") and len(ff) else ff  # per-layer in some models
    if isinstance(n_ff, bool) or not isinstance(n_ff, int) or n_ff < 0:
        raise GGUFFormatError(gf.path, f"{arch}.feed_forward_length has an impossible value")
    name = gf.get("general.name")
    lic = gf.get("general.license")
    weights = sum(t.nbytes for t in gf.tensors.values())
    return ModelInfo(
        architecture=arch,
        name=name if isinstance(name, str) else "",
        parameters=sum(t.n_elements for t in gf.tensors.values()),
        quant=quant_name(gf),
        context_length=_int(gf, f"{arch}.context_length", 2048),
        n_layers=n_layers,
        n_embd=n_embd,
        n_heads=n_heads,
        kv_heads=kv_heads,
        head_dim_k=_int(gf, f"{arch}.attention.key_length", head_dim),
        head_dim_v=_int(gf, f"{arch}.attention.value_length", head_dim),
        n_ff=n_ff,
        vocab_size=vocab,
        weights_bytes=weights,
        file_size=gf.file_size,
        sliding_window=_int(gf, f"{arch}.attention.sliding_window", 0),
        has_chat_template=isinstance(gf.get("tokenizer.chat_template"), str),
        license=lic if isinstance(lic, str) else "",
    )


def read_model_info(path: str) -> ModelInfo:
    with GGUFFile(path) as gf:
        return model_info(gf)


def human_params(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(n)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

"""What a model is, read from its GGUF header: the facts `list`, `show` and the memory estimate use.

Kept as plain data so the store's index can cache it and `localllm list` never reopens weights.
"""

from __future__ import annotations

import re
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
    # where the weight bytes lie, for the offload planner (empty in index entries written before
    # they were kept: `memory.layer_weights` then spreads the weights evenly)
    layer_bytes: tuple[int, ...] = ()  # per block (`blk.N.*`)
    expert_bytes: tuple[int, ...] = ()  # per block, its MoE experts' share (empty: not MoE)
    output_bytes: int = 0  # the output layer's own tensors (its matrix and norm)
    embed_bytes: int = 0  # the token embedding (the input layer, always on the CPU in llama.cpp)
    output_tied: bool = False  # no output matrix: a GPU output layer holds a copy of the embedding
    n_experts: int = 0
    n_experts_used: int = 0

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache, summed over layers."""
        return sum(h * (self.head_dim_k + self.head_dim_v) for h in self.kv_heads)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in _TUPLES:
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelInfo:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for k in _TUPLES:
            kw[k] = tuple(kw.get(k, ()))
        return cls(**kw)


_TUPLES = ("kv_heads", "layer_bytes", "expert_bytes")
_EXPERTS = re.compile(r"blk\.\d+\.ffn_(up|down|gate|gate_up)_exps\.")


def _placement(gf: GGUFFile, n_layers: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(bytes per block, their MoE experts' bytes per block, the output layer's own bytes)."""
    layers = [0] * n_layers
    experts = [0] * n_layers
    output = 0
    for name, t in gf.tensors.items():
        if name.startswith("blk."):
            i = name.split(".", 2)[1]
            if i.isdigit() and int(i) < n_layers:
                layers[int(i)] += t.nbytes
                if _EXPERTS.match(name):
                    experts[int(i)] += t.nbytes
        elif name.startswith("output"):
            output += t.nbytes
    return tuple(layers), tuple(experts) if any(experts) else (), output


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
    layer_bytes, expert_bytes, output_bytes = _placement(gf, n_layers)
    embed = gf.tensors.get("token_embd.weight")
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
        layer_bytes=layer_bytes,
        expert_bytes=expert_bytes,
        output_bytes=output_bytes,
        embed_bytes=embed.nbytes if embed is not None else 0,
        output_tied="output.weight" not in gf.tensors,
        n_experts=_int(gf, f"{arch}.expert_count", 0, cap=1 << 16),
        n_experts_used=_int(gf, f"{arch}.expert_used_count", 0, cap=1 << 16),
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

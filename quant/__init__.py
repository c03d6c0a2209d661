"""Quantization (installed as `localllm.quant`): block formats, legacy and k-quants, mixes, reports.

`quantize(values, type)` turns float32 rows into a GGML type's blocks, byte-identical to llama.cpp's
reference quantization: the legacy types through the `gguf` package (checked byte-exact against
ggml in the tests), the K-quants through our ports (`kquants`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "TYPES", "quantize", "row_bytes"]

# type → (values per block, bytes per block)
BLOCK = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip
TYPES = tuple(BLOCK)


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of one row of `n` values in `type_name` (n a multiple of its block)."""
    per, size = BLOCK[type_name]
    if n % per:
        raise ValueError(f"{type_name} needs rows of a multiple of {per} values, not {n}")
    return n // per * size


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values (..., n) → (..., row_bytes) uint8 in `type_name`'s blocks."""
    if type_name not in BLOCK:
        raise ValueError(f"no quantizer for {type_name} (there are: {', '.join(TYPES)})")
    x = np.ascontiguousarray(values, dtype=np.float32)
    shape = x.shape[:-1]
    n = x.shape[-1] if x.ndim else 1
    width = row_bytes(type_name, n)
    if type_name == "F32":
        out = x.view(np.uint8)
    elif type_name == "F16":
        out = x.astype("<f2").view(np.uint8)
    elif type_name in ("Q4_K", "Q5_K", "Q6_K"):
        from localllm.quant import kquants

        fn = {"Q4_K": kquants.quantize_q4_k, "Q5_K": kquants.quantize_q5_k, "Q6_K": kquants.quantize_q6_k}
        out = fn[type_name](x.reshape(-1, n))
    else:
        from gguf import GGMLQuantizationType, quants

        out = quants.quantize(x.reshape(-1, n), GGMLQuantizationType[type_name]).view(np.uint8)
    return np.ascontiguousarray(out).reshape(*shape, width)

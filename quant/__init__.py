"""Quantization (installed as `localllm.quant`): block formats, legacy, K- and IQ4 quants, mixes,
importance matrices, reports.

`quantize(values, type)` turns float32 rows into a GGML type's blocks, byte-identical to llama.cpp's
reference quantization: the legacy types through the `gguf` package (checked byte-exact against
ggml in the tests), the K-quants, IQ4_NL / IQ4_XS and the lattice i-quants IQ2_XXS / IQ2_XS /
IQ2_S / IQ3_XXS / IQ3_S and IQ1_S / IQ1_M (IQ2_XXS, IQ2_XS, IQ1_S only with an importance matrix) through
our ports (`kquants`, `iquants`, `igrid`, `iq1`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["BLOCK", "TYPES", "quantize", "row_bytes"]

# type → (values per block, bytes per block)
BLOCK = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ1_S": (256, 50),
    "IQ1_M": (256, 56),
}  # fmt: skip
TYPES = tuple(BLOCK)


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of one row of `n` values in `type_name` (n a multiple of its block)."""
    per, size = BLOCK[type_name]
    if n % per:
        raise ValueError(f"{type_name} needs rows of a multiple of {per} values, not {n}")
    return n // per * size


def quantize(values: np.ndarray, type_name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 values (..., n) → (..., row_bytes) uint8 in `type_name`'s blocks. `imatrix`: the
    importance of each of the n columns (llama.cpp's importance matrix: mean squared activation
    of that input); the K-quants and Q4_0/Q4_1/Q5_0/Q5_1 then weight their scale search by it."""
    if type_name not in BLOCK:
        raise ValueError(f"no quantizer for {type_name} (there are: {', '.join(TYPES)})")
    x = np.ascontiguousarray(values, dtype=np.float32)
    shape = x.shape[:-1]
    n = x.shape[-1] if x.ndim else 1
    width = row_bytes(type_name, n)
    if type_name == "F32":
        out = x.view(np.uint8)
    elif imatrix is not None and type_name in WEIGHTED:
        imatrix = np.asarray(imatrix, dtype=np.float32).reshape(-1)
        if imatrix.shape != (n,):
            raise ValueError(f"the importance matrix has {imatrix.size} columns, the rows {n}")
        out = _weighted(x.reshape(-1, n), type_name, imatrix)
    else:
        from localllm.quant import native

        out = native.quantize_rows(x.reshape(-1, n), type_name, WORKERS)
        if out is None:  # no compiled quantizer for this type here: the numpy port, same bytes
            out = _in_pieces(x.reshape(-1, n), type_name)
    return np.ascontiguousarray(out).reshape(*shape, width)


WEIGHTED = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
            "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


def _weighted(rows: np.ndarray, type_name: str, imatrix: np.ndarray) -> np.ndarray:
    from localllm.quant import legacy, native

    compiled = native.quantize_rows(rows, type_name, WORKERS, importance=imatrix)
    if compiled is not None:
        return compiled
    step = max(1, PIECE // rows.shape[1])
    out = []
    for i in range(0, len(rows), step):
        piece = rows[i : i + step]
        if type_name in _BLOCKWISE:
            qw = np.broadcast_to(imatrix, piece.shape)
            out.append(_blockwise(type_name)(piece, qw).reshape(len(piece), -1))
        else:
            out.append(legacy.quantize_weighted(piece, imatrix, type_name))
    return np.concatenate(out)


# the types our ports quantize, (module, function(values, importance per value or None)); the
# other types: gguf's quantizers (checked byte-exact against ggml in the tests)
_BLOCKWISE = {
    "Q2_K": ("kquants", "quantize_q2_k"), "Q3_K": ("kquants", "quantize_q3_k"),
    "Q4_K": ("kquants", "quantize_q4_k"), "Q5_K": ("kquants", "quantize_q5_k"),
    "Q6_K": ("kquants", "quantize_q6_k"), "IQ4_NL": ("iquants", "quantize_iq4_nl"),
    "IQ4_XS": ("iquants", "quantize_iq4_xs"), "IQ2_XXS": ("igrid", "quantize_iq2_xxs"),
    "IQ2_XS": ("igrid", "quantize_iq2_xs"), "IQ2_S": ("igrid", "quantize_iq2_s"),
    "IQ3_XXS": ("igrid", "quantize_iq3_xxs"), "IQ3_S": ("igrid", "quantize_iq3_s"),
    "IQ1_S": ("iq1", "quantize_iq1_s"), "IQ1_M": ("iq1", "quantize_iq1_m"),
}  # fmt: skip


def _blockwise(type_name: str) -> Any:
    """Our quantizer of `type_name` (imported when first used)."""
    import importlib

    module, name = _BLOCKWISE[type_name]
    return getattr(importlib.import_module(f"localllm.quant.{module}"), name)

# values per piece: numpy's temporaries of a piece stay in the CPU's cache (Q4_K of 3.1 M values
# took 1.34 s in one piece, 0.56 s in pieces of 65,536, 0.87 s in pieces of 16,384; 1 thread)
PIECE = 65536
WORKERS = 0  # threads for the pieces (0: one per core)
LEGACY_PIECE = 1 << 20
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _in_pieces(rows: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize whole rows piece by piece, the pieces on every core (numpy lets go of the GIL
    inside its array operations)."""
    # the legacy types are a few array operations each: pieces only add calls
    step = max(1, (PIECE if type_name in _BLOCKWISE else LEGACY_PIECE) // rows.shape[1])
    pieces = [rows[i : i + step] for i in range(0, len(rows), step)]
    if type_name in _BLOCKWISE:
        fn = _blockwise(type_name)
    elif type_name in LEGACY:
        from gguf import quants

        # the block function itself: gguf's `quantize` calls it once per 16 rows (8,472 calls
        # for SmolLM2's Q4_K_M, 2.7 of its 5.2 s)
        blocks_of = getattr(quants, type_name).quantize_blocks

        def fn(piece: np.ndarray) -> np.ndarray:
            return blocks_of(piece.reshape(-1, 32)).reshape(len(piece), -1)
    else:
        from gguf import GGMLQuantizationType, quants

        qtype = GGMLQuantizationType[type_name]

        def fn(piece: np.ndarray) -> np.ndarray:
            return quants.quantize(piece, qtype).view(np.uint8)

    workers = min(len(pieces), WORKERS or os.cpu_count() or 1)
    if workers <= 1:
        done = [fn(p) for p in pieces]
    else:
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(fn, pieces))
    return np.concatenate(done).reshape(len(rows), -1)

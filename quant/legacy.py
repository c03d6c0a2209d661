"""The legacy block types (Q4_0, Q4_1, Q5_0, Q5_1) with an importance matrix, byte-identical to
llama.cpp's `quantize_row_q{4,5}_{0,1}_impl` (without one, the `gguf` package's quantizers are used:
they are ggml's reference ones). Q8_0 ignores the matrix in llama.cpp, and so here.

Per row: sigma² = Σx²/n over the whole row; each 32-value block's weights are
qw·sqrt(sigma² + x²); the _0 types search a symmetric scale (`make_qx_quants`, rmse_type 1), the _1
types a scale and a minimum (`make_qkx3_quants`). Same float32 discipline as `kquants`.
"""

from __future__ import annotations

import numpy as np

from localllm.quant.kquants import F32, _make_qkx2_quants, _make_qx_quants, _rows

__all__ = ["LEVELS", "grid", "quantize_weighted", "with_levels"]

LEVELS = {"Q4_0": 15, "Q4_1": 15, "Q5_0": 31, "Q5_1": 31, "Q8_0": 255}  # levels run 0..this


def _nibbles(L: np.ndarray) -> np.ndarray:
    """(B, 32) levels → (B, 16) bytes: element j low nibble of byte j, j + 16 the high one."""
    return ((L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)).astype(np.uint8)


def _fifth_bits(L: np.ndarray) -> np.ndarray:
    """(B, 32) 5-bit levels → (B, 4) bytes of qh: bit j is element j's fifth bit."""
    bits = ((L >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def quantize_weighted(x: np.ndarray, imatrix: np.ndarray, type_name: str) -> np.ndarray:
    """x (rows, n) float32 and the importance of each column (n,) → (rows, row bytes) uint8."""
    x = np.ascontiguousarray(x, dtype=F32)
    rows, n = x.shape
    sigma2 = (np.ascontiguousarray(x.T) * np.ascontiguousarray(x.T)).sum(axis=0) / F32(n)  # (rows,)
    nb = n // 32
    xs = _rows(x, 32)  # (32, rows·nb)
    qs = np.ascontiguousarray(np.tile(np.asarray(imatrix, F32).reshape(nb, 32), (rows, 1)).T)
    w = qs * np.sqrt(np.repeat(sigma2, nb) + xs * xs)
    if type_name in ("Q4_0", "Q5_0"):
        d, L = _make_qx_quants(xs, 8 if type_name == "Q4_0" else 16, w)
        L = L.T.astype(np.int64)  # (blocks, 32) in [0, 2·nmax)
        parts = [_f16(d)] + ([_nibbles(L)] if type_name == "Q4_0" else [_fifth_bits(L), _nibbles(L)])
    elif type_name in ("Q4_1", "Q5_1"):
        d, the_min, L = _make_qkx2_quants(xs, w, 15 if type_name == "Q4_1" else 31, -0.9, 0.05, 36)
        L = L.T.astype(np.int64)
        parts = [_f16(d), _f16(-the_min)]
        parts += [_nibbles(L)] if type_name == "Q4_1" else [_fifth_bits(L), _nibbles(L)]
    else:
        raise ValueError(f"no importance-weighted quantizer for {type_name}")
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def grid(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The affine grid of `blocks` (B, bytes) in `type_name`: (a, m), (B, 32) float32 each, level
    q ∈ [0, LEVELS[type]] dequantizing to a·q − m (Q8_0's level q is its int8 q − 128)."""
    b = np.asarray(blocks, dtype=np.uint8)
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").reshape(-1).astype(F32)
    if type_name in ("Q4_1", "Q5_1"):
        m = -np.ascontiguousarray(b[:, 2:4]).view("<f2").reshape(-1).astype(F32)
    else:
        m = d * F32({"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[type_name])
    return np.repeat(d[:, None], 32, axis=1), np.repeat(m[:, None], 32, axis=1)


def with_levels(type_name: str, blocks: np.ndarray, L: np.ndarray) -> np.ndarray:
    """`blocks` (B, bytes) with their levels replaced by L (B, 32), the scales kept."""
    out = np.array(blocks, dtype=np.uint8)
    L = np.asarray(L, np.int64)
    at = 4 if type_name in ("Q4_1", "Q5_1") else 2
    if type_name == "Q8_0":
        out[:, 2:34] = (L - 128).astype(np.int8).view(np.uint8)
    elif type_name in ("Q4_0", "Q4_1"):
        out[:, at : at + 16] = _nibbles(L)
    elif type_name in ("Q5_0", "Q5_1"):
        out[:, at : at + 4] = _fifth_bits(L)
        out[:, at + 4 : at + 20] = _nibbles(L)
    else:
        raise ValueError(f"no levels for {type_name}")
    return out

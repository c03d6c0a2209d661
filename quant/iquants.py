"""IQ4_NL and IQ4_XS: 4-bit codes into a non-linear table of 16 values, byte-identical to ggml.

Ports of `quantize_row_iq4_nl_impl` (ggml-quants.c, llama-cpp-python 0.3.36) as `quantize_iq4_nl`
and `quantize_iq4_xs` call it — with or without an importance matrix, the same search (7 trial
scales each side of the first guess, every value snapped to its nearest table entry) — vectorized
over every 32-value block at once, with float32 operations in C's order (see `kquants`).
IQ4_NL: one f16 scale per 32 values (18 bytes); IQ4_XS: super-blocks of 256 with a 6-bit scale per
32 values and one f16 (136 bytes).
"""

from __future__ import annotations

import numpy as np

from localllm.quant.kquants import GROUP_MAX_EPS, _f16_bytes, _nearest_int, _rows

__all__ = ["BLOCK_BYTES", "KVALUES", "best_index", "grid", "quantize_iq4_nl", "quantize_iq4_xs", "with_levels"]

F32 = np.float32
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], F32)
BLOCK_BYTES = {"IQ4_NL": 18, "IQ4_XS": 136}
NTRY = 7


def best_index(al: np.ndarray) -> np.ndarray:
    """`best_index_int8(16, kvalues_iq4nl, x)`: the nearest table entry, ties to the upper."""
    mu = np.clip(np.searchsorted(KVALUES, al, side="right"), 1, 15)
    lo, hi = KVALUES[mu - 1], KVALUES[mu]
    idx = np.where(al - lo < hi - al, mu - 1, mu)
    return np.where(al <= KVALUES[0], 0, np.where(al >= KVALUES[15], 15, idx))


def _search(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each 32-value block's scale (the first part of quantize_row_iq4_nl_impl). x, w: (32, N)
    position-major → d (N,), 0 for an all-zero block."""
    ax = np.abs(x)
    at = ax.argmax(axis=0)  # the first largest: the C loop's strict `>`
    cols = np.arange(x.shape[1])
    amax, mx = ax[at, cols], x[at, cols]
    zero = amax < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):

        def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            q = KVALUES[best_index(iscale * x)]
            wq = w * q
            return (wq * x).sum(axis=0), (wq * q).sum(axis=0)

        d = -mx / KVALUES[0]
        sumqx, sumq2 = sums(F32(1) / d)
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
        best = d * sumqx
        for itry in range(-NTRY, NTRY + 1):
            sumqx, sumq2 = sums(F32(itry + int(KVALUES[0])) / mx)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d).astype(F32)
            best = np.where(better, d * sumqx, best)
    return np.where(zero, F32(0), d).astype(F32)


def _weights(x: np.ndarray, qw: np.ndarray | None, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, weights), both (32, N) position-major, for super-blocks of `size` values."""
    xs = _rows(x, 32)
    if qw is None:
        return xs, xs * xs
    sup = np.ascontiguousarray(x.reshape(-1, size).T)  # (size, M): each super-block's Σ x²
    sigma2 = (sup * sup).sum(axis=0) * F32(F32(2) / F32(size))
    return xs, _rows(np.asarray(qw, F32).reshape(x.shape), 32) * np.sqrt(np.repeat(sigma2, size // 32) + xs * xs)


def _pack(L: np.ndarray) -> np.ndarray:
    """(B, 32) codes → (B, 16): byte j holds code j low and code j + 16 high."""
    L = L.astype(np.uint8)
    return L[:, :16] | (L[:, 16:] << 4)


def quantize_iq4_nl(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 32) → IQ4_NL blocks (B, 18); `qw`: per-value importance."""
    x = np.asarray(x, F32).reshape(-1, 32)
    xs, w = _weights(x, qw, 32)
    d = _search(xs, w)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    L = best_index(inv[:, None] * x)
    return np.concatenate([_f16_bytes(d), _pack(L)], axis=1)


def quantize_iq4_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256) → IQ4_XS blocks (M, 136); `qw`: per-value importance."""
    x = np.asarray(x, F32)
    if x.size % 256:
        raise ValueError(f"IQ4_XS needs a multiple of 256 values, not {x.size}")
    x = x.reshape(-1, 256)
    m = x.shape[0]
    xs, w = _weights(x, qw, 256)
    scales = _search(xs, w).reshape(m, 8)
    at = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(m), at]
    d = (-max_scale / F32(32)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
        ls = np.clip(_nearest_int(inv[:, None] * scales), -32, 31)  # (M, 8)
        dl = d[:, None] * ls.astype(F32)
        idl = np.where(dl != 0, F32(1) / dl, F32(0)).astype(F32)
    L = best_index(idl.reshape(-1)[:, None] * x.reshape(-1, 32))  # (M·8, 32)
    lv = (ls + 32).astype(np.uint16)
    scales_l = ((lv[:, 0::2] & 0xF) | ((lv[:, 1::2] & 0xF) << 4)).astype(np.uint8)  # (M, 4)
    scales_h = np.bitwise_or.reduce((lv >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    return np.concatenate([_f16_bytes(d), scales_h.view(np.uint8).reshape(m, 2), scales_l,
                           _pack(L).reshape(m, 128)], axis=1)  # fmt: skip


def grid(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """Each value's scale in `blocks` (B, bytes) of `type_name`, (B, values per block) float32:
    code q dequantizes to scale · KVALUES[q]."""
    b = np.asarray(blocks, dtype=np.uint8)
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").reshape(-1).astype(F32)
    if type_name == "IQ4_NL":
        return np.repeat(d[:, None], 32, axis=1)
    if type_name != "IQ4_XS":
        raise ValueError(f"no grid for {type_name}")
    high = np.ascontiguousarray(b[:, 2:4]).view("<u2").reshape(-1, 1).astype(np.int32)
    low = b[:, 4:8].astype(np.int32)
    ls = np.stack([low & 0xF, low >> 4], axis=2).reshape(-1, 8) | (((high >> (2 * np.arange(8))) & 3) << 4)
    return np.repeat(d[:, None] * (ls - 32).astype(F32), 32, axis=1)


def with_levels(type_name: str, blocks: np.ndarray, L: np.ndarray) -> np.ndarray:
    """`blocks` (B, bytes) with their codes replaced by L (B, values per block), the scales kept."""
    out = np.array(blocks, dtype=np.uint8)
    at = {"IQ4_NL": 2, "IQ4_XS": 8}[type_name]
    out[:, at:] = _pack(np.asarray(L).reshape(-1, 32)).reshape(len(out), -1)
    return out

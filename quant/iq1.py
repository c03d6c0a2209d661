"""IQ1_S: 1.56 bits per weight — values −1, 0, 1 (shifted by ±1/8) on a grid of 2048 8-vectors,
byte-identical to ggml.

A port of `quantize_row_iq1_s_impl` (ggml-quants.c, llama-cpp-python 0.3.36). Each block of 32 values
is solved exactly: its values sorted (stably, as glibc's qsort sorts these small arrays), every pair
of boundaries (i1 ≤ i2) splits them into the levels −1, 0, 1, and for both shifts (+1/8, −1/8) the best
weighted scale is Σwxq / Σwq² — the pair and shift with the largest Σ(wxq)²/Σwq² win, tried in
the C's order with its strict comparison. Groups of 8 that fall off the grid take the nearest of
their listed neighbours (`igrid._nearest`, the 3 smallest distances), and the scale is refitted.
Then a 3-bit scale and the shift's sign per block against one f16 per super-block. Needs an
importance matrix, as ggml does. Vectorized over every block at once; the boundary search runs its
561 pairs in order, each on every block.
"""

from __future__ import annotations

import numpy as np

from localllm.quant.igrid import _code, _nearest, tables
from localllm.quant.kquants import _f16_bytes

__all__ = ["quantize_iq1_m", "quantize_iq1_s"]

F32 = np.float32
DELTA = F32(0.125)  # IQ1S_DELTA
X_P = np.array([-1 + DELTA, DELTA, 1 + DELTA], F32)
X_M = np.array([-1 - DELTA, -DELTA, 1 - DELTA], F32)
EPS = F32(1e-12)  # GROUP_MAX_EPS_IQ1_S


def _weights(x: np.ndarray, qw: np.ndarray | None, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(super-blocks (M, 256), the same position-major (256, M), each value's weight: its importance
    · √(σ² + x²) with σ² = 2·Σx²/256, or x² without one)."""
    x = np.asarray(x, F32)
    if x.size % 256:
        raise ValueError(f"{type_name} needs a multiple of 256 values, not {x.size}")
    x = x.reshape(-1, 256)
    sup = np.ascontiguousarray(x.T)
    sigma2 = (F32(2) * (sup * sup).sum(axis=0)) / F32(256)
    if qw is None:
        return x, sup, x * x
    return x, sup, np.asarray(qw, F32).reshape(x.shape) * np.sqrt(sigma2[:, None] + x * x)


def _blocks(x: np.ndarray, weight: np.ndarray, n: int, eps: np.float32) -> tuple[np.ndarray, ...]:
    """Blocks of n: (values (B, n), weights, skipped (largest |x| below eps), each block's sort order
    — stable, as glibc's qsort sorts these small arrays —, the sorted values and weights (n, B))."""
    xb, wb = x.reshape(-1, n), weight.reshape(-1, n)
    order = np.argsort(xb, axis=1, kind="stable")
    return (xb, wb, np.abs(xb).max(axis=1) < eps, order, np.take_along_axis(xb, order, axis=1).T,
            np.take_along_axis(wb, order, axis=1).T)  # fmt: skip


class _Best:
    """The boundary search's running choice for every block: a candidate (Σwxq, Σwq² for boundaries
    i1, i2 and a shift `tag`) replaces it when Σwq² > 0 and (Σwxq)² > best·Σwq² — the C's strict
    test, in its order; best starts at −FLT_MAX."""

    def __init__(self, scale: np.ndarray) -> None:
        nb = len(scale)
        self.score = np.full(nb, -np.finfo(F32).max, F32)
        self.scale = scale.astype(F32)
        self.b1 = np.full(nb, -1, np.int32)
        self.b2 = np.full(nb, -1, np.int32)
        self.tag = np.zeros(nb, np.int8)

    def offer(self, sumqx: np.ndarray, sumq2: np.ndarray, i1: int, i2: int, tag: int) -> None:
        better = (sumq2 > 0) & (sumqx * sumqx > self.score * sumq2)
        if better.any():
            self.scale = np.where(better, sumqx / sumq2, self.scale).astype(F32)
            self.score = np.where(better, self.scale * sumqx, self.score).astype(F32)
            self.b1 = np.where(better, i1, self.b1)
            self.b2 = np.where(better, i2, self.b2)
            self.tag = np.where(better, tag, self.tag).astype(np.int8)


def _scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block scales (M, blocks) → (d = max / 15, each block's 3-bit scale nearest_int(½(s/d − 1)),
    live: the super-block has a scale above 0)."""
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    d = (max_scale / F32(15)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        idd = F32(1) / d
        ls = np.clip(np.rint(F32(0.5) * (idd[:, None] * scales - F32(1))), 0, 7).astype(np.uint32)
    return d, ls, max_scale > 0


def _split(order: np.ndarray, b1: np.ndarray, b2: np.ndarray, skip: np.ndarray,
           scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Each block's levels from its chosen boundaries (sorted positions below b1: 0, below b2: 1,
    else 2, put back in place), mirrored (2 − L) where the scale came out negative; (L, negative)."""
    rank = np.arange(order.shape[1])[None, :]
    ls = np.where(rank < b1[:, None], 0, np.where(rank < b2[:, None], 1, 2)).astype(np.int8)
    L = np.empty_like(ls)
    np.put_along_axis(L, order, ls, axis=1)
    neg = ~skip & (scale < 0)
    return np.where(neg[:, None], 2 - L, L).astype(np.int8), neg


def _onto_grid(xb: np.ndarray, wb: np.ndarray, L: np.ndarray, scale: np.ndarray, skip: np.ndarray,
               qv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Each group of 8 levels onto the 2048-point grid — off it, the nearest of its neighbours
    (`iq1_find_best_neighbour2`, values qv (G, 3) per group) — and the block's scale refitted
    where a group moved: (grid indices (blocks, groups), scale)."""
    nb, n = xb.shape
    per = n // 8
    levels, kmap = tables("IQ1_S")[:2]
    codes = _code(L.reshape(-1, 8), 3)
    gi = kmap[codes]
    live_g = np.repeat(~skip, per)
    off = (gi < 0) & live_g
    if off.any():
        gi[off] = _nearest(xb.reshape(-1, 8)[off], wb.reshape(-1, 8)[off], np.repeat(scale, per)[off],
                           codes[off], "IQ1_S", qv[off])  # fmt: skip
    refit = ~skip & off.reshape(nb, per).any(axis=1)
    if refit.any():
        # position-major and C-contiguous: numpy adds along a contiguous axis pairwise, not in order
        q = np.ascontiguousarray(np.take_along_axis(qv, levels[np.maximum(gi, 0)].astype(np.int64), axis=1)
                                 .reshape(nb, n).T)  # fmt: skip
        wq = np.ascontiguousarray(wb.T) * q
        sumqx = (wq * np.ascontiguousarray(xb.T)).sum(axis=0)
        sumq2 = (wq * q).sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(refit & (sumqx > 0) & (sumq2 > 0), sumqx / sumq2, scale).astype(F32)
    return np.where(live_g, gi, 0).astype(np.uint32).reshape(nb, per), scale


def quantize_iq1_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256) → IQ1_S blocks (M, 50); `qw`: per-value importance
    (required)."""
    if qw is None:
        raise ValueError("IQ1_S needs an importance matrix")
    x, sup, weight = _weights(x, qw, "IQ1_S")
    m = x.shape[0]
    nb = m * 8
    xb, wb, zero, order, xs, ws = _blocks(x, weight, 32, EPS)
    sumx = np.zeros((33, nb), F32)
    sumw = np.zeros((33, nb), F32)
    for j in range(32):
        sumx[j + 1] = sumx[j] + ws[j] * xs[j]
        sumw[j + 1] = sumw[j] + ws[j]

    best = _Best(np.abs(xb).max(axis=1))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i1 in range(33):
            for i2 in range(i1, 33):
                for xx, sh in ((X_P, 1), (X_M, -1)):
                    sumqx = (sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1] + (sumx[32] - sumx[i2]) * xx[2]
                    sumq2 = ((sumw[i1] - sumw[0]) * xx[0] * xx[0] + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
                             + (sumw[32] - sumw[i2]) * xx[2] * xx[2])  # fmt: skip
                    best.offer(sumqx, sumq2, i1, i2, sh)
    scale, b1, b2, shift = best.scale, best.b1, best.b2, best.tag
    skip = zero | (b1 < 0)
    L, neg = _split(order, b1, b2, skip, scale)
    scale = np.where(neg, -scale, scale).astype(F32)
    shift = np.where(neg, -shift, shift).astype(np.int8)
    qv = np.where((np.repeat(shift, 4) == 1)[:, None], X_P, X_M).astype(F32)  # (G, 3)
    gi, scale = _onto_grid(xb, wb, L, scale, skip, qv)
    scale = np.where(skip, F32(0), scale).astype(F32)
    shift = np.where(skip, 1, shift)

    d, ls3, live = _scales(scale.reshape(m, 8))
    ls3 |= np.where(shift.reshape(m, 8) == -1, 8, 0).astype(np.uint32)
    ls3 = np.where(live[:, None], ls3, 0)
    dh = np.where(live, d * F32(1.125), F32(0)).astype(F32)
    qs = (gi & 255).astype(np.uint8).reshape(m, 32)
    qh = ((gi >> 8) << (3 * np.arange(4, dtype=np.uint32))).sum(axis=1, dtype=np.uint32).reshape(m, 8) | (ls3 << 12)
    return np.concatenate([_f16_bytes(dh), qs, qh.astype("<u2").view(np.uint8).reshape(m, 16)], axis=1)


EPS_M = F32(1e-7)  # GROUP_MAX_EPS_IQ1_M
MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.uint32)  # the shifts of a block's two halves: ++, +-, -+, --


def quantize_iq1_m(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256) → IQ1_M blocks (M, 56): `quantize_row_iq1_m_impl` — blocks
    of 16 whose two halves each take their own shift, a 3-bit scale per block and the super-block's
    f16 scale refitted over every value and spread over the scales' top bits. `qw`: per-value
    importance (without: x², as ggml)."""
    x, sup, weight = _weights(x, qw, "IQ1_M")
    m = x.shape[0]
    nb = m * 16
    xb, wb, zero, order, xs, ws = _blocks(x, weight, 16, EPS_M)
    half = (order >= 8).T  # (16, NB): the sorted value's half
    px = np.zeros((2, 17, nb), F32)
    pw = np.zeros((2, 17, nb), F32)
    for j in range(16):
        for h in (0, 1):
            mine = half[j] == bool(h)
            px[h, j + 1] = np.where(mine, px[h, j] + ws[j] * xs[j], px[h, j])
            pw[h, j + 1] = np.where(mine, pw[h, j] + ws[j], pw[h, j])
    txs, tws = px[:, 16], pw[:, 16]
    p2, m2 = X_P[2], X_M[2]
    cp1, cp2 = X_P[0] * X_P[0] - X_P[1] * X_P[1], X_P[1] * X_P[1] - X_P[2] * X_P[2]
    cm1, cm2 = X_M[0] * X_M[0] - X_M[1] * X_M[1], X_M[1] * X_M[1] - X_M[2] * X_M[2]

    best = _Best(np.abs(xb).max(axis=1))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i1 in range(17):
            for i2 in range(i1, 17):
                qx_p, qx_m, q2_p, q2_m = [], [], [], []
                for h in (0, 1):
                    sx = px[h, i1] + px[h, i2]
                    qx_p.append(txs[h] * p2 - sx)
                    qx_m.append(txs[h] * m2 - sx)
                    q2_p.append(tws[h] * p2 * p2 + pw[h, i1] * cp1 + pw[h, i2] * cp2)
                    q2_m.append(tws[h] * m2 * m2 + pw[h, i1] * cm1 + pw[h, i2] * cm2)
                sums = ((qx_p[0] + qx_p[1], q2_p[0] + q2_p[1]), (qx_p[0] + qx_m[1], q2_p[0] + q2_m[1]),
                        (qx_m[0] + qx_p[1], q2_m[0] + q2_p[1]), (qx_m[0] + qx_m[1], q2_m[0] + q2_m[1]))  # fmt: skip
                for k, (sumqx, sumq2) in enumerate(sums):
                    best.offer(sumqx, sumq2, i1, i2, k)
    scale, b1, b2, bk = best.scale, best.b1, best.b2, best.tag
    skip = zero | (b1 < 0)
    L, neg = _split(order, b1, b2, skip, scale)
    scale = np.where(neg, -scale, scale).astype(F32)
    bk = np.where(neg, 3 - bk, bk).astype(np.int8)
    bk = np.where(skip, 0, bk).astype(np.int8)
    # each half's values: k = 0 takes x_p when the shift pair is ++ or +-, k = 1 when ++ or -+
    plus = np.stack([bk < 2, bk % 2 == 0], axis=1).reshape(-1)  # (G,)
    qv = np.where(plus[:, None], X_P, X_M).astype(F32)
    gi, scale = _onto_grid(xb, wb, L, scale, skip, qv)
    scale = np.where(skip, F32(0), scale).astype(F32)
    levels = tables("IQ1_S")[0]

    d, l3, live = _scales(scale.reshape(m, 16))
    # the super-block scale refitted over all 256 values, the skipped blocks' grid point 0 included
    q = np.take_along_axis(qv, levels[gi.reshape(-1)].astype(np.int64), axis=1).reshape(m, 256)
    q = q * np.repeat((2 * l3 + 1).astype(F32), 16, axis=1)
    wq = np.ascontiguousarray(weight.T) * np.ascontiguousarray(q.T)
    sumqx = (wq * sup).sum(axis=0)
    sumq2 = (wq * np.ascontiguousarray(q.T)).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, d).astype(F32)
    bits = (d * F32(1.1125)).astype("<f2").view(np.uint16).astype(np.uint32)
    sc = (l3.reshape(m, 4, 4) << (3 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32)
    sc |= ((bits[:, None] >> (4 * np.arange(4, dtype=np.uint32))) & 0xF) << 12
    sc = np.where(live[:, None], sc, 0).astype("<u2")
    qs = (gi & 255).astype(np.uint8).reshape(m, 32)
    qh = ((gi[:, 0] >> 8) | ((gi[:, 1] >> 8) << 4)).reshape(m, 16)
    qh = qh | np.where(live[:, None], MASKS[bk.astype(np.int64).reshape(m, 16)], 0)
    return np.concatenate([qs, qh.astype(np.uint8), sc.view(np.uint8).reshape(m, 8)], axis=1)

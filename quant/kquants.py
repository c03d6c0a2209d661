"""K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), byte-identical to llama.cpp's reference quantization.

Ports of `quantize_row_q{2,3,4,5,6}_K_ref` and their helpers (`make_qkx2_quants`, `make_q3_quants`,
`make_qx_quants`) in
ggml's `ggml-quants.c` — what `llama_model_quantize` runs for these types without an importance
matrix. Vectorized over every (sub-)block of a tensor at once: the only Python loops run over the
positions inside one sub-block (32 or 16) and over the candidate scales, never over blocks.

Byte-exactness rests on three things. Every value is float32 and every operation is one IEEE
float32 operation in C's order (ggml-base is built without FMA contraction or fast-math, so `a*b + c`
rounds twice there too; numpy's own `sum` would add pairwise, so sums run over the first axis of
position-major (n, N) arrays, which numpy adds in order, one row after another, as the C loops do). `nearest_int` (add 1.5·2^23, read the bits) is round-half-to-even, as
`np.rint`. f32 → f16 is round-to-nearest-even in both.
"""

from __future__ import annotations

import numpy as np

__all__ = ["QK_K", "BLOCK_BYTES", "quantize_q2_k", "quantize_q3_k", "quantize_q4_k", "quantize_q5_k",
           "quantize_q6_k"]

QK_K = 256
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """(N,) float32 → (N, 2) uint8: the f16 values' little-endian bytes."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _f16_round(x: np.ndarray) -> np.ndarray:
    """What GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x)) gives."""
    return x.astype(np.float16).astype(F32)


def _nearest_int(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _rows(x: np.ndarray, n: int) -> np.ndarray:
    """(..., k·n) → (n, N) float32, position-major: row i holds element i of every group."""
    return np.ascontiguousarray(x.reshape(-1, n).T, dtype=F32)


def _levels(t: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """nearest_int, then clamped, in place and kept as floats (exact: small integers)."""
    np.rint(t, out=t)
    return np.clip(t, lo, hi, out=t)


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int, use_mad: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """`make_qkx2_quants` for every group at once (`use_mad`: weighted absolute errors, Q2_K's,
    else squared). x, w: (n, N) position-major. Returns (scale (N,), the_min (N,) = −min ≥ 0,
    L (n, N) uint8)."""
    mn = x.min(axis=0)
    mx = x.max(axis=0)
    sum_w = w.sum(axis=0)
    sum_x = (w * x).sum(axis=0)
    mn = np.minimum(mn, F32(0))
    flat = mx == mn
    t = np.empty_like(x)
    u = np.empty_like(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        L = _levels(np.multiply(iscale, np.subtract(x, mn, out=t), out=t), 0, nmax).copy()
        diff = scale * L + mn - x
        best = (w * (np.abs(diff) if use_mad else diff * diff)).sum(axis=0)
        lo = mn.copy()  # the C loop moves `min` to each better solution's: later steps start from it
        for step in range(nstep + 1):
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - lo)
            lf = _levels(np.multiply(iscale, np.subtract(x, lo, out=t), out=t), 0, nmax)
            wl = np.multiply(w, lf, out=u)
            sum_l = wl.sum(axis=0)
            sum_l2 = (wl * lf).sum(axis=0)
            sum_xl = np.multiply(wl, x, out=u).sum(axis=0)
            d = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / d
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            diff = np.multiply(this_scale, lf, out=u)  # (scale·l + min − x)², weighted
            diff += this_min
            diff -= x
            if use_mad:
                np.abs(diff, out=diff)
            else:
                diff *= diff
            diff *= w
            cur = diff.sum(axis=0)
            better = (d > 0) & (cur < best)
            if better.any():
                L = np.where(better, lf, L)
                best = np.where(better, cur, best)
                scale = np.where(better, this_scale, scale)
                lo = np.where(better, this_min, lo)
    scale = np.where(flat, F32(0), scale).astype(F32)
    L = np.where(flat, F32(0), L).astype(np.uint8)
    return scale, (-lo).astype(F32), L


def _make_qx_quants(x: np.ndarray, nmax: int, qw: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`make_qx_quants` with rmse_type 1 (weights x², or `qw` when given), for every group at
    once. x: (n, N) position-major. Returns (scale (N,), L (n, N) int32 in [0, 2·nmax))."""
    ax = np.abs(x)
    at = ax.argmax(axis=0)  # the first largest, as the C loop's strict `>`
    cols = np.arange(x.shape[1])
    amax = ax[at, cols]
    mx = x[at, cols]
    zero = amax < GROUP_MAX_EPS
    w = x * x if qw is None else qw
    wx = w * x
    t = np.empty_like(x)
    u = np.empty_like(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):

        def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            lf = _levels(np.multiply(iscale, x, out=t), -nmax, nmax - 1)
            sumlx = np.multiply(wx, lf, out=u).sum(axis=0)
            suml2 = np.multiply(np.multiply(w, lf, out=u), lf, out=u).sum(axis=0)
            return lf, sumlx, suml2

        lf, sumlx, suml2 = sums(F32(-nmax) / mx)
        L = lf + F32(nmax)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            lf, sumlx, suml2 = sums(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            if better.any():
                L = np.where(better, lf + F32(nmax), L)
                scale = np.where(better, sumlx / suml2, scale)
                best = np.where(better, scale * sumlx, best)
    scale = np.where(zero, F32(0), scale).astype(F32)
    L = np.where(zero, F32(0), L).astype(np.int32)
    return scale, L


def _k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """(M, 8) 6-bit scales and mins → (M, 12) bytes, as Q4_K/Q5_K pack them."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4]
    out[:, 4:8] = lm[:, 0:4]
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    return out


def _qkx_block(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """What Q4_K and Q5_K share: x (M, 256) → d, dmin bytes (M, 2) each, scales (M, 12), and the
    levels L (M, 256) in [0, nmax]."""
    m = x.shape[0]
    xs = _rows(x, 32)  # (32, M·8)
    sum_x2 = (xs * xs).sum(axis=0)
    av_x = np.sqrt(sum_x2 / F32(32))
    w = av_x + np.abs(xs)
    scales, mins, L = _make_qkx2_quants(xs, w, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(m, 8), mins.reshape(m, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales).astype(np.uint8), 63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins).astype(np.uint8), 63)
    d = (max_scale / F32(63)).astype(F32)
    dmin = (max_min / F32(63)).astype(F32)
    return _finish(x, d, dmin, ls, lm, L, nmax)


def _finish(x: np.ndarray, d: np.ndarray, dmin: np.ndarray, ls: np.ndarray, lm: np.ndarray,
            L: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """A Q4_K/Q5_K super-block once its scales are chosen: the levels again against the stored
    (f16, 6-bit) scales and mins — where a sub-block's scale is 0 they stay as the search left
    them — and the bytes of d, dmin and the packed scales."""
    m = x.shape[0]
    sub_d = _f16_round(d)[:, None] * ls.astype(F32)  # (M, 8)
    sub_m = _f16_round(dmin)[:, None] * lm.astype(F32)
    L = L.T.reshape(m, 8, 32)
    xb = x.reshape(m, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        req = np.clip(_nearest_int((xb + sub_m[..., None]) / sub_d[..., None]), 0, nmax)
    L = np.where(sub_d[..., None] != 0, req, L).astype(np.uint8).reshape(m, QK_K)
    return _f16_bytes(d), _f16_bytes(dmin), _k_scales(ls, lm), L


def _make_qp_quants(x: np.ndarray, qw: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """`make_qp_quants` for every group at once: x (the sub-blocks' scales or mins, ≥ 0; IQ2_XXS's
    magnitudes, one of them perhaps negated) and qw, (n, G) position-major → (scale (G,), L (n, G)
    float levels). Its last search changes levels one position at a time against running sums, so
    that loop runs over positions, in order. C keeps the levels in uint8: a negative level is read
    back as 256 + it where the C reads L[i] (the first error sum, the refinement), as here."""
    mx = np.maximum(x.max(axis=0), F32(0))
    zero = mx < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / mx
        L = np.mod(np.rint(iscale * x), F32(256))
        scale = F32(1) / iscale
        diff = x - scale * L
        best = (qw * diff * diff).sum(axis=0)
        for step in (-4, -3, -2, -1, 1, 2, 3, 4):
            iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / mx
            scale_is = F32(1) / iscale_is
            lv = np.minimum(np.rint(iscale_is * x), F32(nmax))
            diff = x - scale_is * lv
            mse = (qw * diff * diff).sum(axis=0)
            better = mse < best
            best = np.where(better, mse, best)
            iscale = np.where(better, iscale_is, iscale)
        L = np.minimum(np.rint(iscale * x), F32(nmax))
        wx = qw * x
        sumlx = (wx * L).sum(axis=0)
        suml2 = (qw * L * L).sum(axis=0)
        L = np.mod(L, F32(256))
        sumlx, suml2 = _refine(x, qw, L, sumlx, suml2, ~zero, None, nmax, old_sl2=True)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero, F32(0), L)


def _refine(x: np.ndarray, w: np.ndarray, L: np.ndarray, sumlx: np.ndarray, suml2: np.ndarray,
            active: np.ndarray, lo: int | None, hi: int, *, old_sl2: bool) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The level-by-level refinement make_qp_quants and make_q3_quants share: up to 5 passes over
    the positions, in order, each moving one level to x·Σ(wl²)/Σ(wxl) of the others when that
    raises Σ(wxl)²/Σ(wl²) — on every group at once, a group stopping after a pass that changed
    nothing (the C loop's break). L (n, N) is changed in place; returns the final sums. `old_sl2`:
    make_qp_quants tests the others' Σ(wl²) > 0 before the move, make_q3_quants the new one."""
    for _ in range(5):
        changed = np.zeros_like(active)
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], L[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = np.clip(np.rint(xi * sl2 / slx), lo, hi).astype(F32)  # lo None: no floor
            slx2 = slx + wi * xi * new
            sl22 = sl2 + wi * new * new
            take = (active & (slx > 0) & ((sl2 if old_sl2 else sl22) > 0) & (new != li)
                    & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22))  # fmt: skip
            L[i] = np.where(take, new if lo is not None else np.mod(new, F32(256)), li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        active = active & changed
        if not active.any():
            break
    return sumlx, suml2


def _qkx_weighted(x: np.ndarray, qw: np.ndarray, nmax: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """`quantize_row_q{4,5}_K_impl` (llama.cpp with an importance matrix): x and the per-value
    importance qw, both (M, 256) → what `_qkx_block` returns."""
    m = x.shape[0]
    xt = np.ascontiguousarray(x.T)  # (256, M): the super-block's sum runs over all its values
    sigma2 = F32(2) * (xt * xt).sum(axis=0) / F32(QK_K)
    xs, qs = _rows(x, 32), _rows(qw, 32)  # (32, M·8)
    w = qs * np.sqrt(np.repeat(sigma2, 8) + xs * xs)
    sw = np.ascontiguousarray(w.sum(axis=0).reshape(m, 8).T)
    scales, mins, L = _make_qkx2_quants(xs, w, nmax, -0.9, 0.05, 36)  # make_qkx3_quants' steps
    d, ls = _make_qp_quants(np.ascontiguousarray(scales.reshape(m, 8).T), sw, 63)
    dm, lm = _make_qp_quants(np.ascontiguousarray(mins.reshape(m, 8).T), sw, 63)
    ls, lm = np.minimum(ls.T, 63).astype(np.uint8), np.minimum(lm.T, 63).astype(np.uint8)
    return _finish(x, d, dm, ls, lm, L, nmax)


def _weights(qw: np.ndarray | None, x: np.ndarray) -> np.ndarray | None:
    return None if qw is None else np.asarray(qw, dtype=F32).reshape(x.shape)


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    if x.size % QK_K:
        raise ValueError(f"K-quants need a multiple of {QK_K} values, not {x.size}")
    return x.reshape(-1, QK_K)


def quantize_q4_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256, row-major) → Q4_K blocks, (M, 144) uint8; `qw`, the
    importance of each value (same shape), takes llama.cpp's importance-matrix path."""
    x = _blocks(x)
    w = _weights(qw, x)
    d, dmin, scales, L = _qkx_block(x, 15, -1.0, 0.1, 20) if w is None else _qkx_weighted(x, w, 15)
    return np.concatenate([d, dmin, scales, _pack_q4(L)], axis=1)


def quantize_q5_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256, row-major) → Q5_K blocks, (M, 176) uint8 (`qw`: as Q4_K)."""
    x = _blocks(x)
    w = _weights(qw, x)
    d, dmin, scales, L = _qkx_block(x, 31, -0.5, 0.1, 15) if w is None else _qkx_weighted(x, w, 31)
    return np.concatenate([d, dmin, scales, *_pack_q5(L)], axis=1)


def quantize_q6_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256, row-major) → Q6_K blocks, (M, 210) uint8 (`qw`: the
    importance of each value replaces x² as the scale search's weight, as llama.cpp's does)."""
    x = _blocks(x)
    m = x.shape[0]
    w = _weights(qw, x)
    scales, L = _make_qx_quants(_rows(x, 16), 32, None if w is None else _rows(w, 16))
    scales = scales.reshape(m, 16)
    L = L.T.reshape(m, 16, 16)
    at = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(m), at]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-128) / max_scale
        d = (F32(1) / iscale).astype(F32)
        d = np.where(zero, F32(0), d).astype(F32)
        sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127)
        sc = np.where(zero[:, None], 0, sc).astype(np.int8)
        sub_d = _f16_round(d)[:, None] * sc.astype(F32)  # (M, 16)
        xb = x.reshape(m, 16, 16)
        req = np.clip(_nearest_int(xb / sub_d[..., None]), -32, 31) + 32
    L = np.where(sub_d[..., None] != 0, req, L)
    L = np.where(zero[:, None, None], 0, L)
    return np.concatenate([*_pack_q6(L), sc.view(np.uint8), _f16_bytes(d)], axis=1)


def _make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """`make_q3_quants` with do_rmse (Q3_K's), for every group at once. x: (n, N) position-major.
    Its refinement changes one level at a time against running sums, so that loop runs over the
    positions, in order, each step on every group (a group that changed nothing in a pass stops,
    as the C loop breaks). Returns (scale (N,), L (n, N) float levels in [0, 2·nmax))."""
    ax = np.abs(x)
    at = ax.argmax(axis=0)  # the first largest: the C loop's strict `>`
    cols = np.arange(x.shape[1])
    amax = ax[at, cols]
    mx = x[at, cols]
    zero = amax < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-nmax) / mx
        L = np.clip(np.rint(iscale * x), -nmax, nmax - 1).astype(F32)
        w = x * x
        sumlx = (w * x * L).sum(axis=0)
        suml2 = (w * L * L).sum(axis=0)
        sumlx, suml2 = _refine(x, w, L, sumlx, suml2, ~zero, -nmax, nmax - 1, old_sl2=False)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    L = L + F32(nmax)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero, F32(0), L)


def _pack_q4(L: np.ndarray) -> np.ndarray:
    """(M, 256) levels in [0, 15] → Q4_K's qs (M, 128): per 64-value chunk, the first 32 values in
    the low nibbles, the next 32 in the high ones."""
    L = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)


def _pack_q5(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(M, 256) levels in [0, 31] → Q5_K's (qh (M, 32), qs (M, 128)): the low nibbles as Q4_K's,
    64-value chunk n setting bits 2n and 2n + 1 of qh."""
    L = L.reshape(-1, 256).astype(np.uint8)
    high = (L >> 4).reshape(-1, 4, 2, 32)
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # (4, 2)
    qh = np.bitwise_or.reduce((high << shifts[None, :, :, None]).reshape(-1, 8, 32), axis=1)
    return qh.astype(np.uint8), _pack_q4(L & 0xF)


def _pack_q6(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(M, 256) levels in [0, 63] → Q6_K's (ql (M, 128), qh (M, 64)), per 128-value half."""
    L = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    m = L.shape[0]
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(m, 128)  # fmt: skip
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(m, 64)  # fmt: skip
    return ql, qh.astype(np.uint8)


def _pack_q3(L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(M, 256) levels in [0, 7] → Q3_K's (hmask (M, 32), qs (M, 64)): the third bit of value j
    in hmask byte j % 32, bit j // 32; the low two bits as Q2_K's."""
    L = L.reshape(-1, QK_K).astype(np.int32)
    hi = L > 3
    hmask = np.bitwise_or.reduce((hi.reshape(-1, 8, 32).astype(np.uint8)
                                  << np.arange(8, dtype=np.uint8)[None, :, None]), axis=1)  # fmt: skip
    return hmask.astype(np.uint8), _pack_2bit(np.where(hi, L - 4, L))


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """(M, 256) levels in [0, 3] → (M, 64): per 128-value half, byte l holds values l, l+32,
    l+64, l+96 in its bit pairs (Q2_K's and Q3_K's qs)."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def quantize_q2_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256, row-major) → Q2_K blocks, (M, 84) uint8:
    `quantize_row_q2_K_ref` (16 sub-blocks of 16, a 4-bit scale and min each); with `qw`, the
    importance of each value, `quantize_row_q2_K_impl` (weighted search, scales by make_qp_quants)."""
    x = _blocks(x)
    m = x.shape[0]
    xs = _rows(x, 16)  # (16, M·16)
    w = _weights(qw, x)
    if w is None:
        scales, mins, L = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True)
        scales, mins = scales.reshape(m, 16), mins.reshape(m, 16)
        max_scale = np.maximum(scales.max(axis=1), F32(0))
        max_min = np.maximum(mins.max(axis=1), F32(0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = np.where(max_scale[:, None] > 0, _nearest_int((F32(15) / max_scale)[:, None] * scales), 0)
            lm = np.where(max_min[:, None] > 0, _nearest_int((F32(15) / max_min)[:, None] * mins), 0)
        d = np.where(max_scale > 0, max_scale / F32(15), F32(0)).astype(F32)
        dmin = np.where(max_min > 0, max_min / F32(15), F32(0)).astype(F32)
    else:
        xt = np.ascontiguousarray(x.T)
        sigma2 = (xt * xt).sum(axis=0) / F32(QK_K)  # (M,)
        ww = _rows(w, 16) * np.sqrt(np.repeat(sigma2, 16) + xs * xs)
        sw = np.ascontiguousarray(ww.sum(axis=0).reshape(m, 16).T)  # (16, M)
        scales, mins, L = _make_qkx2_quants(xs, ww, 3, -0.9, 0.05, 36)  # make_qkx3_quants' steps
        d, ls = _make_qp_quants(np.ascontiguousarray(scales.reshape(m, 16).T), sw, 15)
        dmin, lm = _make_qp_quants(np.ascontiguousarray(mins.reshape(m, 16).T), sw, 15)
        ls, lm = ls.T, lm.T
    packed = (ls.astype(np.uint8) | (lm.astype(np.uint8) << 4)).astype(np.uint8)
    sub_d = _f16_round(d)[:, None] * (packed & 0xF).astype(F32)  # (M, 16)
    sub_m = _f16_round(dmin)[:, None] * (packed >> 4).astype(F32)
    L = L.T.reshape(m, 16, 16)
    xb = x.reshape(m, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        req = np.clip(_nearest_int((xb + sub_m[..., None]) / sub_d[..., None]), 0, 3)
    L = np.where(sub_d[..., None] != 0, req, L).reshape(m, QK_K)
    return np.concatenate([packed, _pack_2bit(L), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def quantize_q3_k(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256, row-major) → Q3_K blocks, (M, 110) uint8:
    `quantize_row_q3_K_ref` (16 sub-blocks of 16, a 6-bit signed scale each, a high-bit mask);
    with `qw`, `quantize_row_q3_K_impl` (make_qx_quants weighted, the scales' too)."""
    x = _blocks(x)
    m = x.shape[0]
    w = _weights(qw, x)
    if w is None:
        scales, L = _make_q3_quants(_rows(x, 16), 4)
        scales = scales.reshape(m, 16)
        at = np.abs(scales).argmax(axis=1)  # the first largest |scale|
        max_scale = scales[np.arange(m), at]
        live = max_scale != 0
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            iscale = F32(-32) / max_scale
            lv = np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32  # (M, 16) in [0, 63]
            d = np.where(live, F32(1) / iscale, F32(0)).astype(F32)
        lv = np.where(live[:, None], lv, 0).astype(np.uint8)
    else:
        xs = _rows(x, 16)
        xt = np.ascontiguousarray(x.T)
        sigma2 = F32(2) * (xt * xt).sum(axis=0) / F32(QK_K)
        ww = _rows(w, 16) * np.sqrt(np.repeat(sigma2, 16) + xs * xs)
        sw = np.ascontiguousarray(ww.sum(axis=0).reshape(m, 16).T)  # (16, M)
        scales, L = _make_qx_quants(xs, 4, ww)
        d, lv = _make_qx_quants(np.ascontiguousarray(scales.reshape(m, 16).T), 32, sw)
        lv = lv.T.astype(np.uint8)  # already offset by 32: [0, 63]
        L = L.astype(F32)
    sc = np.zeros((m, 12), np.uint8)
    sc[:, 0:8] = (lv[:, 0:8] & 0xF) | ((lv[:, 8:16] & 0xF) << 4)
    high = (lv >> 4).reshape(m, 4, 4)  # [j // 4, j % 4]
    sc[:, 8:12] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    # the scales as stored (a row with no scale stored zeros: -32 each, times d = 0)
    signed = lv.astype(np.int32) - 32
    sub_d = _f16_round(d)[:, None] * signed.astype(F32)  # (M, 16)
    L = L.T.reshape(m, 16, 16)
    xb = x.reshape(m, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        req = np.clip(_nearest_int(xb / sub_d[..., None]), -4, 3) + 4
    L = np.where(sub_d[..., None] != 0, req, L)
    return np.concatenate([*_pack_q3(L), sc, _f16_bytes(d)], axis=1)


# --- the grid a block's stored scales put its values on (for error-correcting quantizers) ---

LEVELS = {"Q2_K": 3, "Q3_K": 7, "Q4_K": 15, "Q5_K": 31, "Q6_K": 63}  # levels run 0..this


def _f16(b: np.ndarray) -> np.ndarray:
    """(M, 2) little-endian f16 bytes → (M,) float32."""
    return np.ascontiguousarray(b).view("<f2").reshape(-1).astype(F32)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes (M, 12) → the 6-bit scales and mins, (M, 8) each
    (`get_scale_min_k4`)."""
    sc = sc.astype(np.int32)
    ls = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    lm = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def grid(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The affine grid of each value of `blocks` (M, bytes) in `type_name`: (a, m), both (M, 256)
    float32, such that level q ∈ [0, LEVELS[type]] dequantizes to a·q − m — the scales stored,
    whatever levels are chosen under them."""
    b = np.asarray(blocks, dtype=np.uint8)
    if type_name in ("Q4_K", "Q5_K"):
        ls, lm = _k4_scales(b[:, 4:16])
        a = _f16(b[:, 0:2])[:, None] * ls.astype(F32)
        m = _f16(b[:, 2:4])[:, None] * lm.astype(F32)
        per = 32
    elif type_name == "Q6_K":
        a = _f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(F32)
        m = a * F32(32)
        per = 16
    elif type_name == "Q3_K":
        sc = b[:, 96:108].astype(np.int32)
        low = np.concatenate([sc[:, 0:8] & 0xF, sc[:, 0:8] >> 4], axis=1)  # scales 0-7, 8-15
        high = (sc[:, 8:12, None] >> (2 * np.arange(4))[None, None, :]) & 3  # [j % 4, j // 4]
        lv = low | (high.transpose(0, 2, 1).reshape(-1, 16) << 4)
        a = _f16(b[:, 108:110])[:, None] * (lv - 32).astype(F32)
        m = a * F32(4)
        per = 16
    elif type_name == "Q2_K":
        sc = b[:, 0:16]
        a = _f16(b[:, 80:82])[:, None] * (sc & 0xF).astype(F32)
        m = _f16(b[:, 82:84])[:, None] * (sc >> 4).astype(F32)
        per = 16
    else:
        raise ValueError(f"no grid for {type_name}")
    return np.repeat(a, per, axis=1), np.repeat(m, per, axis=1)


def with_levels(type_name: str, blocks: np.ndarray, L: np.ndarray) -> np.ndarray:
    """`blocks` (M, bytes) with their levels replaced by L (M, 256) in [0, LEVELS[type]], the
    scales kept."""
    out = np.array(blocks, dtype=np.uint8)
    if type_name == "Q4_K":
        out[:, 16:144] = _pack_q4(L)
    elif type_name == "Q5_K":
        out[:, 16:48], out[:, 48:176] = _pack_q5(L)
    elif type_name == "Q6_K":
        out[:, 0:128], out[:, 128:192] = _pack_q6(L)
    elif type_name == "Q3_K":
        out[:, 0:32], out[:, 32:96] = _pack_q3(L)
    elif type_name == "Q2_K":
        out[:, 16:80] = _pack_2bit(L)
    else:
        raise ValueError(f"no levels for {type_name}")
    return out

"""IQ2_XXS and IQ2_XS: 2.06 and 2.31 bits per weight on the E8 lattice's grids, byte-identical to ggml.

Ports of `quantize_row_iq2_xxs_impl` and `quantize_row_iq2_xs_impl` (ggml-quants.c, llama-cpp-python
0.3.36), with `iq2xs_init_impl`'s tables. Both need an importance matrix (ggml asserts one; so do we).
Each super-block of 256 values is cut into blocks (32 for XXS, 16 for XS) of groups of 8: a group keeps
its signs apart (seven bits; the eighth makes the count of negatives even, flipping the least important
value) and its magnitudes become one point of a grid of 8-vectors with levels 1, 3, 5 (256 points
for XXS, 512 for XS). The scale of a block is searched over 13 (XXS) or 19 (XS) trial values; at each,
a group that rounds off the grid takes the nearest of its listed grid neighbours under the weighted
distance. Then a 4-bit scale per block against one f16 per super-block.

The grids come from the `gguf` package (its dequantization tables, level by level); the neighbour lists
are rebuilt as ggml builds them (every grid point at the two smallest distances, in (distance, index)
order). Vectorized over every block at once, float32 operations in C's order (see `kquants`).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from localllm.quant.kquants import GROUP_MAX_EPS, _f16_bytes, _make_qp_quants

__all__ = ["BLOCK_BYTES", "quantize_iq2_xs", "quantize_iq2_xxs"]

F32 = np.float32
BLOCK_BYTES = {"IQ2_XXS": 66, "IQ2_XS": 74}
# type → (values per block with its own scale, trial steps each side, grid size)
_SHAPE = {"IQ2_XXS": (32, 6, 256), "IQ2_XS": (16, 9, 512)}
NWANT = 2  # neighbours: the grid points at the two smallest distances


@cache
def tables(type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(levels (grid, 8) int8 in 0..2; kmap (6561,): the grid index of each 8-vector of levels —
    ggml indexes by the base-4 number, packed to base 3 here — or -1; then for each vector off the
    grid its neighbours' grid indices as one flat array, where each vector's list starts (6561,) and
    how long it is (6561,), 0 on the grid)."""
    from gguf import quants

    q = getattr(quants, type_name)
    q.init_grid()
    values = np.asarray(q.grid, F32).reshape(-1, 8)
    levels = np.searchsorted(np.asarray(q.grid_map, F32), values).astype(np.int8)
    n_grid = _SHAPE[type_name][2]
    assert levels.shape == (n_grid, 8) and levels.max() <= 2
    kmap = np.full(3**8, -1, np.int32)
    kmap[_base3(levels)] = np.arange(n_grid, dtype=np.int32)
    # every 8-vector of levels 0..2: its neighbours, sorted by (squared distance, grid index)
    points = (np.arange(3**8)[:, None] // 3 ** np.arange(8)) % 3
    d2 = ((2 * points[:, None, :] - 2 * levels[None, :, :].astype(np.int64)) ** 2).sum(axis=2)  # (6561, grid)
    order = np.argsort(d2 * n_grid + np.arange(n_grid), axis=1)
    sd = np.take_along_axis(d2, order, axis=1)
    rank = np.concatenate([np.zeros((len(sd), 1), np.int64), np.cumsum(np.diff(sd, axis=1) > 0, axis=1)], axis=1)
    keep = (rank < NWANT) & (kmap < 0)[:, None]
    count = keep.sum(axis=1)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    return levels, kmap, order[keep].astype(np.int32), start, count


def _base3(levels: np.ndarray) -> np.ndarray:
    return (levels.astype(np.int32) * 3 ** np.arange(8, dtype=np.int32)).sum(axis=-1)


def _nearest(xv: np.ndarray, wa: np.ndarray, scale: np.ndarray, codes: np.ndarray, type_name: str) -> np.ndarray:
    """`iq2_find_best_neighbour` for K groups at once: xv, wa (K, 8), scale (K,), codes (K,) of their
    levels, off the grid → the chosen grid index (K,): the first of the smallest Σ w·(s·q − x)² in
    the list. The lists are ragged: gathered flat, reduced per segment. A level is one of three, so
    each group's 24 terms w·(s·q − x)² are computed once (as the C computes each) and a candidate's
    distance adds its eight terms in the C's order."""
    levels, _, flat, start, count = tables(type_name)
    cnt = count[codes]
    first = np.cumsum(cnt) - cnt
    total = int(cnt.sum())
    seg = np.repeat(np.arange(len(codes)), cnt)
    cand = flat[np.repeat(start[codes] - first, cnt) + np.arange(total)]
    q = np.array([1, 3, 5], F32)
    diff = scale[:, None, None] * q - xv[:, :, None]  # (K, 8, 3)
    terms = (wa[:, :, None] * diff * diff).reshape(-1)
    base = (seg * 24).astype(np.int32)
    offsets = _offsets(type_name)
    d2 = np.zeros(total, F32)
    for i in range(8):
        d2 = d2 + terms[base + offsets[i][cand]]
    best = np.minimum.reduceat(d2, first)
    pick = np.where(d2 == best[seg], np.arange(total), total)
    return cand[np.minimum.reduceat(pick, first)]


@cache
def _offsets(type_name: str) -> np.ndarray:
    """(8, grid): where each grid point's position i finds its term among a group's 24 (3·i + level)."""
    return np.ascontiguousarray((3 * np.arange(8) + tables(type_name)[0]).T, dtype=np.int32)


def _snap(L: np.ndarray, xv: np.ndarray, wa: np.ndarray, scale: np.ndarray,
          type_name: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Groups' levels L (K, 8) onto the grid: (levels (K, 8), on grid (K,) — True where L was)."""
    levels, kmap = tables(type_name)[:2]
    codes = _base3(L)
    off = kmap[codes] < 0
    if off.any():
        L = L.copy()
        L[off] = levels[_nearest(xv[off], wa[off], scale[off], codes[off], type_name)]
    return L, ~off


def _sums(w: np.ndarray, xval: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ w·x·q and Σ w·q·q over each block, in order; (n, N) position-major, q = 2L + 1."""
    q = 2 * L.astype(F32) + 1
    wq = w * q
    return (w * xval * q).sum(axis=0), (wq * q).sum(axis=0)


def _quantize(x: np.ndarray, qw: np.ndarray, type_name: str) -> np.ndarray:
    n, steps, _ = _SHAPE[type_name]
    kmap = tables(type_name)[1]
    x = np.asarray(x, F32)
    if x.size % 256:
        raise ValueError(f"{type_name} needs a multiple of 256 values, not {x.size}")
    x = x.reshape(-1, 256)
    m = x.shape[0]
    qw = np.asarray(qw, F32).reshape(m, 256)
    sup = np.ascontiguousarray(x.T)
    sigma2 = (sup * sup).sum(axis=0) / F32(256)  # (M,)
    weight = qw * np.sqrt(sigma2[:, None] + x * x)  # (M, 256)
    waux = np.sqrt(weight)

    # signs by groups of 8: an even count of negatives, the least important value flipped
    xg, wg = x.reshape(-1, 8), weight.reshape(-1, 8)
    neg = xg < 0
    xval = np.abs(xg)
    odd = neg.sum(axis=1) % 2 == 1
    imin = (wg * xg * xg).argmin(axis=1)
    rows = np.nonzero(odd)[0]
    xval[rows, imin[rows]] = -xval[rows, imin[rows]]
    neg[rows, imin[rows]] = ~neg[rows, imin[rows]]
    signs = (neg[:, :7] * (1 << np.arange(7))).sum(axis=1).astype(np.uint32)  # (G,)

    nb = m * 256 // n  # blocks
    per = n // 8  # groups per block
    xv_g, wa_g = xval, waux.reshape(-1, 8)
    xv = np.ascontiguousarray(xval.reshape(nb, n).T)  # (n, NB) position-major
    w = np.ascontiguousarray(weight.reshape(nb, n).T)
    mx = xv.max(axis=0)
    zero = mx < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if type_name == "IQ2_XXS":
            scale, _ = _make_qp_quants(xv, w, 4)
            eff = scale * F32(3)
            zero |= ~(eff > 0)
            L = np.zeros((nb * per, 8), np.int8)
        else:
            eff = mx
            scale = mx / F32(5)
            L = np.zeros((nb * per, 8), np.int8)
        eff = np.where(zero, F32(1), eff).astype(F32)  # a skipped block: no NaN in the trials
        on_grid = np.ones(nb * per, bool)
        best = np.zeros(nb, F32)
        for step in range(-steps, steps + 1):
            idv = (F32(5) + F32(step) * F32(0.1)) / eff
            this = F32(1) / idv
            lv = np.clip(np.rint(F32(0.5) * (idv * xv - F32(1))), 0, 2).astype(np.int8)  # (n, NB)
            la = np.ascontiguousarray(lv.T).reshape(-1, 8)
            la, ong = _snap(la, xv_g, wa_g, np.repeat(this, per), type_name)
            sumqx, sumq2 = _sums(w, xv, la.reshape(nb, n).T)
            better = ~zero & (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(better, sumqx / sumq2, scale).astype(F32)
            best = np.where(better, scale * sumqx, best).astype(F32)
            bg = np.repeat(better, per)
            L = np.where(bg[:, None], la, L)
            on_grid = np.where(bg, ong, on_grid)
        # the last pass: XXS redoes every group at the chosen scale, XS only those that were off
        redo = np.repeat(~zero & (scale > 0), per)
        if type_name == "IQ2_XS":
            redo &= ~on_grid
            blocks = ~zero & (scale > 0) & ~on_grid.reshape(nb, per).all(axis=1)
        else:
            blocks = ~zero & (scale > 0)
        if redo.any():
            sg = np.repeat(scale, per)[redo]
            idg = F32(1) / sg
            lv = np.clip(np.rint(F32(0.5) * (idg[:, None] * xv_g[redo] - F32(1))), 0, 2).astype(np.int8)
            L[redo], _ = _snap(lv, xv_g[redo], wa_g[redo], sg, type_name)
            sumqx, sumq2 = _sums(w, xv, L.reshape(nb, n).T)
            scale = np.where(blocks & (sumq2 > 0), sumqx / sumq2, scale).astype(F32)
    flip = ~zero & (scale < 0)
    scale = np.where(flip, -scale, scale).astype(F32)
    signs = np.where(np.repeat(flip, per), ~signs & 127, signs).astype(np.uint32)
    scale = np.where(zero, F32(0), scale)
    gi = kmap[_base3(L)].astype(np.uint32)
    assert (gi >= 0).all()
    live = np.repeat(~zero, per)
    gi, signs = np.where(live, gi, 0), np.where(live, signs, 0)

    scales = scale.reshape(m, 256 // n)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    d = (max_scale / F32(31)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        idd = F32(1) / d
        ls = np.clip(np.rint(F32(0.5) * (idd[:, None] * scales - F32(1))), 0, 15)
    ls = np.where((max_scale > 0)[:, None], ls, 0).astype(np.uint32)
    d = np.where(max_scale > 0, d, F32(0))
    if type_name == "IQ2_XXS":
        g = gi.reshape(m, 8, 4)
        s = signs.reshape(m, 8, 4)
        q0 = (g << (8 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32)
        q1 = (s << (7 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32) | (ls << 28)
        q1 = np.where((max_scale > 0)[:, None], q1, 0).astype(np.uint32)
        q0 = np.where((max_scale > 0)[:, None], q0, 0).astype(np.uint32)
        qs = np.stack([q0, q1], axis=2).astype("<u4").view(np.uint8).reshape(m, 64)
        return np.concatenate([_f16_bytes(d), qs], axis=1)
    q = (gi | (signs << 9)).astype(np.uint32).reshape(m, 32)
    q = np.where((max_scale > 0)[:, None], q, 0).astype("<u2")
    sc = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8).reshape(m, 64), sc], axis=1)


def quantize_iq2_xxs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256) → IQ2_XXS blocks (M, 66); `qw`: per-value importance
    (required: ggml refuses this type without an importance matrix)."""
    if qw is None:
        raise ValueError("IQ2_XXS needs an importance matrix")
    return _quantize(x, qw, "IQ2_XXS")


def quantize_iq2_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256) → IQ2_XS blocks (M, 74); `qw`: per-value importance
    (required)."""
    if qw is None:
        raise ValueError("IQ2_XS needs an importance matrix")
    return _quantize(x, qw, "IQ2_XS")

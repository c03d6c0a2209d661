"""The lattice i-quants IQ2_XXS, IQ2_XS, IQ2_S (2.06, 2.31, 2.5 bits per weight) and IQ3_XXS, IQ3_S
(3.06, 3.44), byte-identical to ggml.

Ports of `quantize_row_iq2_xxs_impl`, `quantize_row_iq2_xs_impl`, `quantize_row_iq2_s_impl`,
`quantize_row_iq3_xxs_impl` and `quantize_row_iq3_s_impl` (ggml-quants.c, llama-cpp-python 0.3.36),
with `iq2xs_init_impl`'s and `iq3xs_init_impl`'s tables. One search, told apart by `Spec`: a super-block
of 256 values is cut into blocks (16 or 32 values, each with its own scale) and the blocks into
groups — 8 values for the 2-bit types, 4 for the 3-bit ones — whose magnitudes become one point of
a grid of such vectors with odd levels (1, 3, 5 or 1 … 15; 256 to 1024 points). Signs are kept apart
by 8 values: all eight bits (IQ2_S, IQ3_S) or seven, the eighth making the count of negatives even by
flipping the least important value (IQ2_XXS, IQ2_XS, IQ3_XXS). A block's scale is searched over trial
values; at each, a group that rounds off the grid takes the nearest of its listed grid neighbours
under the weighted distance. Then a 4-bit scale per block against one f16 per super-block.

The grids come from the `gguf` package (its dequantization tables, level by level); the neighbour lists
are rebuilt as ggml builds them (every grid point at the `nwant` smallest distances, in (distance,
index) order). Vectorized over every block at once, float32 operations in C's order (see `kquants`).
IQ2_XXS and IQ2_XS need an importance matrix (ggml asserts one); the others take one if given.
IQ1_S and IQ1_M (`iq1`) use these grid tables and neighbour search too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from localllm.quant.kquants import _f16_bytes, _make_qp_quants

__all__ = ["TYPES", "quantize", "quantize_iq2_s", "quantize_iq2_xs", "quantize_iq2_xxs",
           "quantize_iq3_s", "quantize_iq3_xxs", "tables"]

F32 = np.float32


@dataclass(frozen=True)
class Spec:
    dims: int  # values per grid point
    kmax: int  # levels 0 … kmax-1 (kMaxQ)
    block: int  # values per scale
    grid: int  # grid points
    nwant: int  # neighbour lists: the points at this many smallest distances
    steps: int  # trial scales: -steps … steps
    step: float  # … times this
    parity: bool  # seven sign bits of eight (else all eight)
    first: str  # the first scale: "qp" (make_qp_quants) or "max" (max / (2·kmax − 1))
    redo: str  # the last pass at the chosen scale: "all", "off" (groups off the grid), "all_if_off"
    on_grid0: bool  # a block no trial improved counts as on the grid
    eps: float  # a block whose largest magnitude is below this is left zero (0: only all zeros)
    sigma: int  # the weight's σ² is this · Σx² / 256
    fudge: float  # the f16 scale is max_scale / 31 times this
    # the weight without an importance matrix: "x2" or "sigma" (¼σ² + x²); "": ggml requires one
    unweighted: str


SPECS = {
    "IQ2_XXS": Spec(8, 3, 32, 256, 2, 6, 0.1, True, "qp", "all", True, 1e-15, 1, 1.0, ""),
    "IQ2_XS": Spec(8, 3, 16, 512, 2, 9, 0.1, True, "max", "off", True, 1e-15, 1, 1.0, ""),
    "IQ2_S": Spec(8, 3, 16, 1024, 1, 9, 0.1, False, "max", "off", True, 1e-8, 2, 0.9875, "sigma"),
    "IQ3_XXS": Spec(4, 8, 32, 256, 2, 15, 0.2, True, "max", "off", True, 1e-8, 2, 1.0125, "x2"),
    "IQ3_S": Spec(4, 8, 32, 512, 3, 9, 0.2, False, "max", "all_if_off", False, 0.0, 2, 1.033, "x2"),
}  # fmt: skip
TYPES = tuple(SPECS)
# each grid: (values per point, levels, points, neighbour distances kept) — IQ1_S's too (`iq1`)
GRIDS = {t: (s.dims, s.kmax, s.grid, s.nwant) for t, s in SPECS.items()} | {"IQ1_S": (8, 3, 2048, 3)}


def _code(levels: np.ndarray, kmax: int) -> np.ndarray:
    """A vector of levels as one number, base kmax (ggml's kmap index packed to base 3 for IQ2;
    the same number for IQ3)."""
    dims = levels.shape[-1]
    return (levels.astype(np.int32) * kmax ** np.arange(dims, dtype=np.int32)).sum(axis=-1)


@cache
def tables(
    type_name: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(levels (grid, dims) int8; kmap: each level vector's grid index, or -1; then for each vector off
    the grid its neighbours' grid indices as one flat array, where each list starts and how long it
    is (0 on the grid); and (dims, grid): where position i of each grid point finds its term among a
    group's dims·kmax (kmax·i + level))."""
    from gguf import quants

    dims, kmax, n_grid, nwant = GRIDS[type_name]
    q = getattr(quants, type_name)
    q.init_grid()
    values = np.asarray(q.grid, F32).reshape(-1, dims)
    levels = np.searchsorted(np.asarray(q.grid_map, F32), values).astype(np.int8)
    assert levels.shape == (n_grid, dims) and levels.max() < kmax
    n_codes = kmax**dims
    kmap = np.full(n_codes, -1, np.int32)
    kmap[_code(levels, kmax)] = np.arange(n_grid, dtype=np.int32)
    points = (np.arange(n_codes)[:, None] // kmax ** np.arange(dims)) % kmax
    d2 = ((2 * points[:, None, :] - 2 * levels[None, :, :].astype(np.int64)) ** 2).sum(axis=2)
    order = np.argsort(d2 * n_grid + np.arange(n_grid), axis=1)  # by distance, then index
    sd = np.take_along_axis(d2, order, axis=1)
    rank = np.concatenate(
        [np.zeros((len(sd), 1), np.int64), np.cumsum(np.diff(sd, axis=1) > 0, axis=1)], axis=1
    )
    keep = (rank < nwant) & (kmap < 0)[:, None]
    count = keep.sum(axis=1)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    offsets = np.ascontiguousarray((kmax * np.arange(dims) + levels).T, dtype=np.int32)
    return levels, kmap, order[keep].astype(np.int32), start, count, offsets


def _nearest(xv: np.ndarray, wa: np.ndarray, scale: np.ndarray, codes: np.ndarray, type_name: str,
             qv: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """`iq2_find_best_neighbour` / `iq3_find_best_neighbour` (and IQ1_S's `iq1_find_best_neighbour2`)
    for K groups at once: xv, wa (K, dims), scale (K,), codes (K,) of their levels, off the grid →
    the chosen grid index (K,): the first of the smallest Σ w·(s·q − x)² in the list. The lists are
    ragged: gathered flat, reduced per segment. Each group's dims·levels terms w·(s·q − x)² are
    computed once (as the C computes each) and a candidate's distance adds its terms in the C's
    order. `qv` (K, levels): each group's value of each level (IQ1_S's shifted −1, 0, 1), else the
    odd numbers 1, 3, 5, …"""
    dims, kmax = GRIDS[type_name][:2]
    _, _, flat, start, count, offsets = tables(type_name)
    cnt = count[codes]
    first = np.cumsum(cnt) - cnt
    total = int(cnt.sum())
    seg = np.repeat(np.arange(len(codes)), cnt)
    cand = flat[np.repeat(start[codes] - first, cnt) + np.arange(total)]
    q = (2 * np.arange(kmax) + 1).astype(F32) if qv is None else qv[:, None, :]
    diff = scale[:, None, None] * q - xv[:, :, None]  # (K, dims, levels)
    terms = (wa[:, :, None] * diff * diff).reshape(-1)
    base = (seg * (dims * kmax)).astype(np.int32)
    d2 = np.zeros(total, F32)
    for i in range(dims):
        d2 = d2 + terms[base + offsets[i][cand]]
    best = np.minimum.reduceat(d2, first)
    pick = np.where(d2 == best[seg], np.arange(total), total)
    return cand[np.minimum.reduceat(pick, first)]


def _snap(L: np.ndarray, xv: np.ndarray, wa: np.ndarray, scale: np.ndarray,
          type_name: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Groups' levels L (K, dims) onto the grid: (levels, on grid (K,) — True where L was)."""
    levels, kmap = tables(type_name)[:2]
    codes = _code(L, GRIDS[type_name][1])
    off = kmap[codes] < 0
    if off.any():
        L = L.copy()
        L[off] = levels[_nearest(xv[off], wa[off], scale[off], codes[off], type_name)]
    return L, ~off


def _sums(w: np.ndarray, xval: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ w·x·q and Σ w·q·q over each block, in order; (n, N) position-major, q = 2L + 1. All
    C-contiguous: numpy would add along a contiguous axis pairwise."""
    q = 2 * np.ascontiguousarray(L, dtype=F32) + 1
    wq = w * q
    return (w * xval * q).sum(axis=0), (wq * q).sum(axis=0)


def _levels(idv: np.ndarray, xv: np.ndarray, kmax: int) -> np.ndarray:
    """nearest_int(0.5·(id·x − 1)), clamped to 0 … kmax − 1."""
    return np.clip(np.rint(F32(0.5) * (idv * xv - F32(1))), 0, kmax - 1).astype(np.int8)


def quantize(x: np.ndarray, type_name: str, qw: np.ndarray | None = None) -> np.ndarray:
    """float32 values (a multiple of 256) → `type_name` blocks (M, bytes); `qw`: per-value importance
    (required by IQ2_XXS and IQ2_XS, as in ggml)."""
    sp = SPECS[type_name]
    x = np.asarray(x, F32)
    if x.size % 256:
        raise ValueError(f"{type_name} needs a multiple of 256 values, not {x.size}")
    if qw is None and not sp.unweighted:
        raise ValueError(f"{type_name} needs an importance matrix")
    x = x.reshape(-1, 256)
    m = x.shape[0]
    n, dims, kmax = sp.block, sp.dims, sp.kmax
    sup = np.ascontiguousarray(x.T)
    sumx2 = (sup * sup).sum(axis=0)
    sigma2 = (F32(sp.sigma) * sumx2 if sp.sigma != 1 else sumx2) / F32(256)  # (M,)
    if qw is not None:
        weight = np.asarray(qw, F32).reshape(m, 256) * np.sqrt(sigma2[:, None] + x * x)
    elif sp.unweighted == "x2":
        weight = x * x
    else:
        weight = F32(0.25) * sigma2[:, None] + x * x
    waux = np.sqrt(weight)

    # signs by 8 values: all of them, or an even count of negatives with the least important flipped
    x8, w8 = x.reshape(-1, 8), weight.reshape(-1, 8)
    neg = x8 < 0
    xval = np.abs(x8)
    if sp.parity:
        odd = neg.sum(axis=1) % 2 == 1
        imin = (w8 * x8 * x8).argmin(axis=1)
        rows = np.nonzero(odd)[0]
        xval[rows, imin[rows]] = -xval[rows, imin[rows]]
        neg[rows, imin[rows]] = ~neg[rows, imin[rows]]
    nsign = 7 if sp.parity else 8
    signs = (neg[:, :nsign] * (1 << np.arange(nsign))).sum(axis=1).astype(np.uint32)

    nb = m * 256 // n  # blocks
    per = n // dims  # grid groups per block
    xv_g, wa_g = xval.reshape(-1, dims), waux.reshape(-1, dims)
    xv = np.ascontiguousarray(xval.reshape(nb, n).T)  # (n, NB) position-major
    w = np.ascontiguousarray(weight.reshape(nb, n).T)
    mx = xv.max(axis=0)
    zero = (mx < F32(sp.eps)) if sp.eps else (mx == 0)
    L = np.zeros((nb * per, dims), np.int8)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if sp.first == "qp":
            scale, _ = _make_qp_quants(xv, w, kmax + 1)
            eff = scale * F32(kmax)
            zero |= ~(eff > 0)
        else:
            eff = mx
            scale = mx / F32(2 * kmax - 1)
        eff = np.where(zero, F32(1), eff).astype(F32)  # a skipped block: no NaN in the trials
        on_grid = np.full(nb * per, sp.on_grid0)
        best = np.zeros(nb, F32)
        for step in range(-sp.steps, sp.steps + 1):
            idv = (F32(2 * kmax - 1) + F32(step) * F32(sp.step)) / eff
            this = F32(1) / idv
            la = np.ascontiguousarray(_levels(idv, xv, kmax).T).reshape(-1, dims)
            la, ong = _snap(la, xv_g, wa_g, np.repeat(this, per), type_name)
            sumqx, sumq2 = _sums(w, xv, la.reshape(nb, n).T)
            better = ~zero & (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(better, sumqx / sumq2, scale).astype(F32)
            best = np.where(better, scale * sumqx, best).astype(F32)
            bg = np.repeat(better, per)
            L = np.where(bg[:, None], la, L)
            on_grid = np.where(bg, ong, on_grid)
        # the last pass, at the chosen scale
        blocks = ~zero & (scale > 0)
        if sp.redo != "all":
            blocks &= ~on_grid.reshape(nb, per).all(axis=1)
        redo = np.repeat(blocks, per)
        if sp.redo == "off":
            redo &= ~on_grid
        if redo.any():
            sg = np.repeat(scale, per)[redo]
            lv = _levels((F32(1) / sg)[:, None], xv_g[redo], kmax)
            L[redo], _ = _snap(lv, xv_g[redo], wa_g[redo], sg, type_name)
            sumqx, sumq2 = _sums(w, xv, L.reshape(nb, n).T)
            scale = np.where(blocks & (sumq2 > 0), sumqx / sumq2, scale).astype(F32)
    flip = ~zero & (scale < 0)
    scale = np.where(flip, -scale, np.where(zero, F32(0), scale)).astype(F32)
    signs = signs.reshape(nb, -1)
    signs = np.where(flip[:, None], ~signs & ((1 << nsign) - 1), signs)
    gi = tables(type_name)[1][_code(L, kmax)].reshape(nb, per)
    assert (gi >= 0).all()
    gi = np.where(zero[:, None], 0, gi).astype(np.uint32)  # a skipped block writes nothing
    signs = np.where(zero[:, None], 0, signs).astype(np.uint32)

    scales = scale.reshape(m, 256 // n)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    live = max_scale > 0
    d = (max_scale / F32(31)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        idd = F32(1) / d
        ls = np.clip(np.rint(F32(0.5) * (idd[:, None] * scales - F32(1))), 0, 15)
    ls = np.where(live[:, None], ls, 0).astype(np.uint32)
    dh = np.where(live, d * F32(sp.fudge) if sp.fudge != 1.0 else d, F32(0)).astype(F32)
    packed = _pack(
        type_name, gi.reshape(m, -1), signs.reshape(m, -1), ls, live, zero.reshape(m, -1)
    )
    return np.concatenate([_f16_bytes(dh), packed], axis=1)


def _pack(type_name: str, gi: np.ndarray, signs: np.ndarray, ls: np.ndarray, live: np.ndarray,
          skipped: np.ndarray) -> np.ndarray:  # fmt: skip
    """The bytes after d of M super-blocks: grid indices (M, groups), sign groups (M, 32 or 16),
    block scales (M, blocks); live (M,): not all scales zero — else the XXS/XS types clear their
    codes, the S types keep them, as the C does; skipped (M, blocks): blocks left zero."""
    m = len(gi)
    u32 = np.uint32
    if type_name in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
        gi = np.where(live[:, None], gi, 0).astype(u32)
        signs = np.where(live[:, None], signs, 0).astype(u32)
    if type_name == "IQ2_XXS":  # per block: 4 grid bytes, then 4 × 7 sign bits and the scale
        q0 = (gi.reshape(m, 8, 4) << (8 * np.arange(4, dtype=u32))).sum(axis=2, dtype=u32)
        q1 = (signs.reshape(m, 8, 4) << (7 * np.arange(4, dtype=u32))).sum(axis=2, dtype=u32) | (
            ls << 28
        )
        q1 = np.where(live[:, None], q1, 0).astype(u32)
        return np.stack([q0, q1], axis=2).astype("<u4").view(np.uint8).reshape(m, 64)
    if type_name == "IQ3_XXS":  # 64 grid bytes, then per block 4 × 7 sign bits and the scale
        sas = (signs.reshape(m, 8, 4) << (7 * np.arange(4, dtype=u32))).sum(axis=2, dtype=u32) | (
            ls << 28
        )
        sas = np.where(live[:, None], sas, 0).astype("<u4")
        return np.concatenate([gi.astype(np.uint8), sas.view(np.uint8).reshape(m, 32)], axis=1)
    nib = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    if type_name == "IQ2_XS":  # 32 × (9-bit index | 7 sign bits << 9), then the scales
        q = (gi | (signs << 9)).astype("<u2")
        return np.concatenate([q.view(np.uint8).reshape(m, 64), nib], axis=1)
    high = gi >> 8
    if type_name == "IQ2_S":  # 32 index bytes, 32 sign bytes, 2 high bits per group, the scales
        qh = (high.reshape(m, 8, 4) << (2 * np.arange(4, dtype=u32))).sum(axis=2, dtype=u32)
        return np.concatenate([(gi & 255).astype(np.uint8), signs.astype(np.uint8), qh.astype(np.uint8), nib],
                              axis=1)  # fmt: skip
    # IQ3_S: 64 index bytes, 1 high bit per group, 32 sign bytes, the scales. A skipped block does
    # not move the C's qs and signs pointers: the next block's bytes land in its place (qh is
    # indexed by block and stays put).
    qh = (high.reshape(m, 8, 8) << np.arange(8, dtype=u32)).sum(axis=2, dtype=u32)
    low, sg = (gi & 255).astype(np.uint8).reshape(m, 8, 8), signs.astype(np.uint8).reshape(m, 8, 4)
    if skipped.any():
        at = np.cumsum(~skipped, axis=1) - 1
        rows, cols = np.nonzero(~skipped)
        low2, sg2 = np.zeros_like(low), np.zeros_like(sg)
        low2[rows, at[rows, cols]] = low[rows, cols]
        sg2[rows, at[rows, cols]] = sg[rows, cols]
        low, sg = low2, sg2
    return np.concatenate([low.reshape(m, 64), qh.astype(np.uint8), sg.reshape(m, 32), nib], axis=1)


def quantize_iq2_xxs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    return quantize(x, "IQ2_XXS", qw)


def quantize_iq2_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    return quantize(x, "IQ2_XS", qw)


def quantize_iq2_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    return quantize(x, "IQ2_S", qw)


def quantize_iq3_xxs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    return quantize(x, "IQ3_XXS", qw)


def quantize_iq3_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    return quantize(x, "IQ3_S", qw)

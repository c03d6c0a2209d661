"""`quantize --method gptq`: error-correcting K-quants in llama.cpp's own block formats.

GPTQ (Frantar et al., 2022) quantizes a weight matrix W (rows × n inputs) one input column at a
time and spreads each column's rounding error over the columns not yet quantized, weighted by the
inverse Hessian H⁻¹ of the layer's loss ‖(W − Q)X‖² (H = E[x xᵀ] over the calibration
activations): what one column loses, the correlated columns after it make up. Here the columns
run in super-blocks of 256: when the first column of a super-block is reached, the block's scales
are chosen on the (already corrected) weights by the K-quant's own importance-weighted search
(the importance: diag H, the imatrix), then each column is rounded onto that block's grid and its
error fed forward. The result is written in the same block bytes (`kquants.with_levels`), so any
llama.cpp reads the file and it is exactly as large as the plain type's.

Updates run lazily (Frantar et al.'s §"lazy batch"): rank-1 inside a group of 32 columns, one
matrix product per group for the rest of a 256-column chunk and one per chunk for the columns
after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from localllm.quant import quantize

__all__ = ["DAMP", "FORMATS", "TYPES", "layer_loss", "quantize_gptq"]

# type → (module with its grid, values per block): every block format with a grid here
FORMATS = {
    **{t: ("kquants", 256) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
    **{t: ("legacy", 32) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")},
    "IQ4_NL": ("iquants", 32), "IQ4_XS": ("iquants", 256),
}  # fmt: skip
TYPES = tuple(FORMATS)
DAMP = 0.01  # of the mean diagonal, added to H's diagonal (GPTQ's percdamp)
GROUP = 32  # columns per rank-1 stretch
CHUNK = 256  # columns per lazy batch (a multiple of every block)
ACT_ORDER = True  # measured on SmolLM2 Q4_K_M: KL 0.0226 against 0.0292 in file order


def _inverse_factor(hessian: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """H (n, n) → (U upper-triangular with H⁻¹ = UᵀU, the dead columns: inputs never active)."""
    h = np.array(hessian, dtype=np.float64)
    diag = np.diagonal(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diagonal(h)))
    inv = np.linalg.inv(np.linalg.cholesky(h))  # L⁻¹ with H = LLᵀ, so H⁻¹ = L⁻ᵀL⁻¹
    u = np.linalg.cholesky(inv.T @ inv).T
    return u, dead


Rounder = Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _module(type_name: str) -> Any:
    """The module that has `type_name`'s grid and level packing."""
    return importlib.import_module(f"localllm.quant.{FORMATS[type_name][0]}")


def _rounder(type_name: str, blocks: np.ndarray) -> Rounder:
    """For `blocks` (rows, bytes) just chosen, a function rounding column c's values onto their
    grid: (levels, the values they dequantize to)."""
    module = _module(type_name)
    if type_name.startswith("IQ4"):  # a non-uniform table of 16 values times each scale
        scale = module.grid(type_name, blocks)

        def table(c: int, col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            s = scale[:, c]
            with np.errstate(divide="ignore", invalid="ignore"):
                q = module.best_index(np.where(s != 0, col / s, 0).astype(np.float32))
            return q, s * module.KVALUES[q]

        return table
    a, m = module.grid(type_name, blocks)
    top = module.LEVELS[type_name]

    def affine(c: int, col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ac, mc = a[:, c], m[:, c]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(ac != 0, np.clip(np.rint((col + mc) / ac), 0, top), 0)  # a zero scale: all −m
        return q.astype(np.int32), ac * q - mc

    return affine


def quantize_gptq(weights: np.ndarray, hessian: np.ndarray, type_name: str, *,
                  damp: float | None = None, act_order: bool | None = None) -> np.ndarray:  # fmt: skip
    """float32 W (rows, n) and its input's second moments H (n, n) → (rows, row bytes) uint8 in
    `type_name`, chosen to make ‖(W − Q)X‖² small rather than ‖W − Q‖². `act_order`: every
    block's scales chosen first on the weights as they are, then the columns rounded in the order
    of their activations' size, largest first (GPTQ's "static groups" with act-order); else in
    file order, each block's scales chosen when its first column is reached."""
    if type_name not in FORMATS:
        raise ValueError(f"--method gptq writes {', '.join(TYPES)}, not {type_name}")
    w = np.array(weights, dtype=np.float32)
    rows, n = w.shape
    width = FORMATS[type_name][1]
    if hessian.shape != (n, n):
        raise ValueError(f"the Hessian is {hessian.shape}, the weights have {n} columns")
    if n % width:
        raise ValueError(f"{type_name} needs rows of a multiple of {width} values, not {n}")
    damp = DAMP if damp is None else damp
    act_order = ACT_ORDER if act_order is None else act_order
    importance = np.diagonal(hessian).astype(np.float32)
    order = np.argsort(-importance, kind="stable") if act_order else np.arange(n)
    u, dead = _inverse_factor(np.asarray(hessian)[np.ix_(order, order)], damp)
    u = u.astype(np.float32)
    w[:, order[dead]] = 0.0
    w = np.ascontiguousarray(w[:, order])  # position p holds column order[p]
    levels = np.zeros((rows, n), np.int32)
    nb = n // width
    blocks: list[Any] = [None] * nb
    rounders: list[Any] = [None] * nb

    def choose(b: int, values: np.ndarray) -> None:
        blocks[b] = quantize(values, type_name, importance[b * width : (b + 1) * width])
        rounders[b] = _rounder(type_name, blocks[b])

    if act_order:
        back = np.argsort(order)
        for b in range(nb):
            choose(b, w[:, back[b * width : (b + 1) * width]])
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        err = np.zeros((rows, c1 - c0), np.float32)
        for g0 in range(c0, c1, GROUP):
            g1 = g0 + GROUP
            for p in range(g0, g1):
                j = int(order[p])
                b = j // width
                if rounders[b] is None:  # file order: the block's first column, its values corrected
                    choose(b, w[:, p : p + width])
                levels[:, j], dq = rounders[b](j - b * width, w[:, p])
                e = (w[:, p] - dq) / u[p, p]
                err[:, p - c0] = e
                w[:, p + 1 : g1] -= np.outer(e, u[p, p + 1 : g1])
            w[:, g1:c1] -= err[:, g0 - c0 : g1 - c0] @ u[g0:g1, g1:c1]
        w[:, c1:] -= err @ u[c0:c1, c1:]
    module = _module(type_name)
    return np.concatenate([module.with_levels(type_name, blocks[b], levels[:, b * width : (b + 1) * width])
                           for b in range(nb)], axis=1)  # fmt: skip


def layer_loss(weights: np.ndarray, dequantized: np.ndarray, hessian: np.ndarray) -> float:
    """‖(W − Q)X‖² per sample: tr((W − Q) H (W − Q)ᵀ), what GPTQ makes small."""
    d = np.asarray(weights, np.float64) - np.asarray(dequantized, np.float64)
    return float(((d @ np.asarray(hessian, np.float64)) * d).sum())

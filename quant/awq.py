"""`quantize --method awq`: activation-aware per-channel scales (AWQ, Lin et al., 2023), folded
into the model so the file keeps llama.cpp's layout and size.

A matrix W that reads input x computes W·x = (W·diag(s))·(x / s): scaling input channel j of W up
by s_j and the producer of x down by the same s_j changes nothing before rounding, but the
channels that carry large activations are then rounded on a finer grid relative to their weight.
The producer must absorb 1/s exactly, so only these inputs are scaled:

- attn_norm → attn_q, attn_k, attn_v (the RMS norm's weight is divided by s),
- ffn_norm → ffn_gate, ffn_up,
- ffn_up's rows → ffn_down (silu(gate)·up is linear in up: row j of ffn_up divided by s_j).

For each group, s = rms(x)^α with α searched over a grid (α = 0: no scaling, kept when nothing
beats it), scored by the layer loss Σ tr(D H Dᵀ), D = W − Q(W·diag(s))·diag(1/s), H = E[x xᵀ]
from the calibration text, over every k-th row (`ROWS` of each matrix); each candidate rounded by
the same quantizer and importance matrix (diag H / s²) the file will be written with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from localllm.gguf_file import GGUFFile

__all__ = ["ALPHAS", "fold", "rescaled", "search"]

ALPHAS = tuple(round(a * 0.1, 1) for a in range(11))  # 0, 0.1, …, 1


ROWS = 256  # rows of each matrix scored per candidate (every k-th): the loss is a sum over rows


def _loss(w: np.ndarray, q: np.ndarray, h: np.ndarray) -> float:
    d = (w - q).astype(np.float64)
    return float(((d @ h) * d).sum())


def _groups(f: GGUFFile) -> list[tuple[str, str, tuple[str, ...]]]:
    """(how the producer absorbs 1/s: "norm" or "rows", its tensor, the matrices reading x)."""
    out = []
    for i in range(int(f.arch_get("block_count", 0) or 0)):
        for kind, producer, mats in (("norm", "attn_norm", ("attn_q", "attn_k", "attn_v")),
                                     ("norm", "ffn_norm", ("ffn_gate", "ffn_up")),
                                     ("rows", "ffn_up", ("ffn_down",))):  # fmt: skip
            names = [f"blk.{i}.{n}.weight" for n in (producer, *mats)]
            if all(n in f.tensors for n in names):
                out.append((kind, names[0], tuple(names[1:])))
    return out


def search(f: GGUFFile, types: Mapping[str, str], hessians: Mapping[str, np.ndarray],
           values: Callable[[str], np.ndarray], quantize_values: Callable[[np.ndarray, str, np.ndarray], np.ndarray],
           dequantize: Callable[[np.ndarray, str, tuple[int, ...]], np.ndarray],
           progress: Callable[[int, int], None] | None = None
           ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, float]]:  # fmt: skip
    """The scaled tensors (name → float32 values, rows of ne[0]), each scaled matrix's input
    scales s and each group's α (by its producer), for the planned `types` (tensor → type). `values(name)` reads a tensor; `quantize_values(x, type,
    importance)` and `dequantize(blocks, type, shape)` round as the file will be written.
    Tensors changed by an earlier group (ffn_up: by ffn_norm, then as ffn_down's producer) are
    read from the result, so the scalings compose."""
    out: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    alphas: dict[str, float] = {}
    groups = [g for g in _groups(f) if all(m in hessians for m in g[2])]

    def current(name: str) -> np.ndarray:
        return out[name] if name in out else values(name)

    for k, (kind, producer, mats) in enumerate(groups):
        h = np.asarray(hessians[mats[0]], np.float64)
        rms = np.sqrt(np.maximum(np.diagonal(h), 0))
        rms = np.where(rms > 0, rms, rms[rms > 0].min() if (rms > 0).any() else 1.0)
        weights = {m: current(m) for m in mats}
        sample = {m: w[:: max(1, len(w) // ROWS)] for m, w in weights.items()}
        best, best_alpha, best_s = np.inf, 0.0, None
        for alpha in ALPHAS:
            s = rms**alpha
            s = s / np.sqrt(s.max() * s.min())  # centred in log space: neither side grows much
            imp = (np.diagonal(h) / (s * s)).astype(np.float32)
            loss = 0.0
            for m, w in sample.items():
                scaled = (w * s[None, :]).astype(np.float32)
                q = dequantize(quantize_values(scaled, types[m], imp), types[m], w.shape) / s[None, :]
                loss += _loss(w, q, h)
            if loss < best:
                best, best_alpha, best_s = loss, alpha, s
        alphas[producer] = best_alpha
        if best_alpha != 0.0 and best_s is not None:
            s32 = best_s.astype(np.float32)
            for m, w in weights.items():
                out[m] = (w * s32[None, :]).astype(np.float32)
                scales[m] = best_s
            p = current(producer)
            out[producer] = (p / s32[None, :] if kind == "norm" else p / s32[:, None]).astype(np.float32)
        if progress is not None:
            progress(k + 1, len(groups))
    return out, scales, alphas


def rescaled(stats: Mapping[str, np.ndarray], scales: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The calibration statistics of the scaled matrices' inputs x / s: an importance vector
    E[x²] becomes E[x²] / s², a Hessian E[x xᵀ] becomes E[x xᵀ] / (s sᵀ)."""
    out = {}
    for name, s in scales.items():
        if name in stats:
            v = np.asarray(stats[name], np.float64)
            out[name] = (v / (s * s) if v.ndim == 1 else v / np.outer(s, s)).astype(np.float32)
    return out


def _dequantize(blocks: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    if type_name == "F32":
        return np.ascontiguousarray(blocks).view("<f4").reshape(shape)
    if type_name == "F16":
        return np.ascontiguousarray(blocks).view("<f2").astype(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(np.ascontiguousarray(blocks).reshape(-1), GGMLQuantizationType[type_name]).reshape(shape)


def fold(path: str, file_type: str, hessians: Mapping[str, np.ndarray],
         progress: Callable[[int, int], None] | None = None
         ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, float]]:  # fmt: skip
    """`search` for the GGUF at `path` quantized to `file_type` (llama.cpp's mix, planned as with
    an importance matrix)."""
    from localllm.quant import quantize
    from localllm.quant.writer import _values, make_plan

    with GGUFFile(path) as f:
        types = {n: t for n, (_, t) in make_plan(f, file_type, has_imatrix=True).items()}
        return search(f, types, hessians, lambda n: _values(f, n), quantize, _dequantize, progress)

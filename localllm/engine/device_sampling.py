"""The engine's sampling chain where a runner's logits are (its device: `logits_on_device`),
for every row of a step at once (`choose`). Imported only when a runner kept rows there, so
torch is not imported for a runner that has none.

The engine's sampler (`localllm.engine.sampling.Sampler`, numpy on the host) is the oracle: the
same chain in the same order (top-k → top-p → min-p → temperature → one uniform through the
inverse CDF), the same candidate order (logit descending, ties by token id), float64 arithmetic
(float32 on Apple's MPS, which has no float64), and the uniform the sequence's own generator drew
(`Choice.u`), so a seed means the same tokens either way (up to the last bit of an exp or a sum
landing exactly on a boundary). Greedy rows are the first largest logit.

No host sync: the per-row parameters go to the device in one copy (pinned, non-blocking on
CUDA), every row's choice is a few batched kernels whatever its parameters, and the caller moves
the (B,) token ids to the host once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.engine.sampling import Choice

__all__ = ["choose"]


def choose(logits: torch.Tensor, choices: Sequence[Choice]) -> torch.Tensor:
    """logits (B, V) of any float dtype, one `Choice` per row → (B,) int64 token ids, on the
    logits' device."""
    if logits.dim() != 2 or logits.shape[0] != len(choices):
        raise ValueError(f"{len(choices)} choices for logits of shape {list(logits.shape)}")
    dev, v = logits.device, logits.shape[1]
    out = logits.float().argmax(-1)  # greedy: the first largest, as numpy's argmax
    drawn = [i for i, c in enumerate(choices) if c.u is not None]
    if not drawn:
        return out
    wide = torch.float32 if dev.type == "mps" else torch.float64
    ks = [c.top_k if 0 < c.top_k < v else v for c in (choices[i] for i in drawn)]
    params = _to(dev, [[i, k, c.temperature, c.top_p, c.min_p, c.u]
                       for i, k, c in zip(drawn, ks, (choices[i] for i in drawn))], wide)  # fmt: skip
    rows, k, temp, top_p, min_p, u = params.unbind(-1)
    x = logits.index_select(0, rows.long()).to(wide)  # (S, V)
    ids, z = _candidates(x, k.long().unsqueeze(-1), max(ks))  # (S, K) each, z -inf past k
    pos = torch.arange(z.shape[1], device=dev)
    first = z[:, :1]
    p = torch.exp(z - first)
    p = p / p.sum(-1, keepdim=True)
    before = p.cumsum(-1) - p  # the most likely tokens whose probabilities first reach top_p
    n_p = torch.where(top_p < 1, (before < top_p.unsqueeze(-1)).sum(-1).clamp(min=1), z.shape[1])
    n_m = torch.where(min_p > 0, (z >= first + torch.log(min_p).unsqueeze(-1)).sum(-1).clamp(min=1),
                      z.shape[1])  # fmt: skip
    keep = (pos < torch.minimum(n_p, n_m).unsqueeze(-1)) & torch.isfinite(z)
    zt = z / temp.unsqueeze(-1)
    w = torch.where(keep, torch.exp(zt - zt[:, :1]), 0)
    cdf = w.cumsum(-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
    at = torch.minimum(at, (keep.sum(-1, keepdim=True) - 1).clamp(min=0))
    return out.index_copy(0, rows.long(), ids.gather(-1, at).squeeze(-1))


def _candidates(x: torch.Tensor, k: torch.Tensor, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top k[row] tokens (ids, logits), logit descending and ties by id, as (S, most)
    tensors whose places past a row's k hold logit -inf."""
    s, v = x.shape
    pos = torch.arange(most if most < v else v, device=x.device)
    if most >= v:  # some row keeps every token: the whole vocabulary, sorted (stable: ties by id)
        z, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return ids, z.masked_fill(pos >= k, float("-inf"))
    # the k-th largest logit of each row; every larger one, then the lowest ids of those equal
    kth = torch.topk(x, most, dim=-1).values.gather(-1, k - 1)  # (S, 1)
    above = x > kth
    tied = x == kth
    room = k - above.sum(-1, keepdim=True)
    picked = above | (tied & (tied.cumsum(-1) <= room))  # exactly k[row] a row
    every = torch.arange(v, device=x.device).expand(s, v)
    ids = torch.where(picked, every, v).topk(most, dim=-1, largest=False, sorted=True).values
    z = x.gather(-1, ids.clamp(max=v - 1)).masked_fill(ids >= v, float("-inf"))
    z, order = torch.sort(z, dim=-1, descending=True, stable=True)  # ids ascending: ties by id
    return ids.gather(-1, order), z


def _to(dev: torch.device, rows: list[list[float]], dtype: torch.dtype) -> torch.Tensor:
    """Host numbers → a tensor on `dev` with no wait for the work queued there (pinned memory,
    a non-blocking copy on CUDA)."""
    t = torch.tensor(rows, dtype=dtype)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)

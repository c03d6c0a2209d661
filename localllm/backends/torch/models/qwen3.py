"""Qwen3 (dense): the Llama block plus an RMSNorm over each query and key head before RoPE.

Head size comes from `attention.key_length` (128 for every Qwen3, whatever dim / heads is).
No biases; half-split RoPE as stored (no q/k permutation in llama.cpp's `qwen3` converter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localllm.backends.torch.cache import KVCache
from localllm.backends.torch.models import llama
from localllm.backends.torch.models.base import BaseModelArgs, Masks, RMSNorm, apply_rope, attend


@dataclass
class ModelArgs(BaseModelArgs):
    """Only the shared hyperparameters (`BaseModelArgs`)."""


class Attention(llama.Attention):
    def __init__(self, args: BaseModelArgs) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                caches: Sequence[KVCache], masks: Masks) -> torch.Tensor:  # fmt: skip
        qk, v = self.qkv(x)  # (B, T, H + KV, hd), (B, T, KV, hd)
        q = apply_rope(self.q_norm(qk[:, :, : self.n_heads]), *rope)
        raw = self.k_norm(qk[:, :, self.n_heads :])
        return self.wo(attend(q, apply_rope(raw, *rope), v, caches, masks, k_raw=raw))


class Block(llama.Block):
    def __init__(self, args: BaseModelArgs) -> None:
        super().__init__(args, Attention)


class Model(llama.Model):
    permuted_qk = False
    block = Block

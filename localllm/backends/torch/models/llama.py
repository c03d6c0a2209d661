"""Llama (and Mistral, SmolLM, ... : llama.cpp's `llama` architecture).

    h = embed(tokens)
    per layer:  h += attn(norm(h))    h += mlp(norm(h))        (pre-norm, RMSNorm)
    attn: q, k, v = x W_qkv; RoPE on q, k; softmax(q k^T / sqrt(hd)) v over the cache; W_o
    mlp:  W_2 (silu(x W_gate) * x W_up)                        (SwiGLU)

RoPE layout: llama.cpp's `llama` rotates adjacent pairs (2i, 2i+1), and its converter permutes
Hugging Face's q/k rows to match. We undo that permutation as the weights load (as transformers'
GGUF loader does), so every family here runs the same half-split RoPE and the hot path has no
interleaving. Llama 3's RoPE scaling arrives as the `rope_freqs.weight` tensor.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.backends.torch.cache import KVCache, Rows, make_caches
from localllm.backends.torch.models.base import (
    BaseModelArgs,
    Masks,
    RMSNorm,
    RoPE,
    Step,
    Tree,
    apply_rope,
    attend,
    embedding,
    projection,
    step_inputs,
    working,
)


@dataclass
class ModelArgs(BaseModelArgs):
    """Only the shared hyperparameters (`BaseModelArgs`)."""


class Attention(nn.Module):
    def __init__(self, args: BaseModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = projection(args.dim, q, kv, kv)
        self.wo = projection(q, args.dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, dim) → q|k heads (B, T, H + KV, hd) and v (B, T, KV, hd): views of one
        fused projection, so RoPE can turn queries and keys in one go."""
        b, t, _ = x.shape
        qkv = self.wqkv(x).view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        return qkv[:, :, : self.n_heads + self.n_kv], qkv[:, :, self.n_heads + self.n_kv :]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                caches: Sequence[KVCache], masks: Masks) -> torch.Tensor:  # fmt: skip
        raw, v = self.qkv(x)
        qk = apply_rope(raw, *rope)  # (B, T, H + KV, hd)
        out = attend(qk[:, :, : self.n_heads], qk[:, :, self.n_heads :], v, caches, masks,
                     k_raw=raw[:, :, self.n_heads :])  # fmt: skip
        return self.wo(out)


class MLP(nn.Module):
    def __init__(self, args: BaseModelArgs) -> None:
        super().__init__()
        self.w13 = projection(args.dim, args.ffn_dim, args.ffn_dim)  # gate, up
        self.w2 = projection(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: BaseModelArgs, attention: type[Attention] = Attention) -> None:
        super().__init__()
        self.attention = attention(args)
        self.feed_forward = MLP(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                caches: Sequence[KVCache], masks: Masks) -> torch.Tensor:  # fmt: skip
        h = h + self.attention(self.attention_norm(h), rope, caches, masks)
        return h + self.feed_forward(self.ffn_norm(h))


class Model(nn.Module):
    """A stack of `Block`s. Stateless: the caller passes each row's per-layer caches."""

    # llama.cpp's converter permutes q/k rows for adjacent-pair RoPE (see the module docstring)
    permuted_qk = True
    block = Block

    def __init__(self, args: BaseModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(self.block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = projection(args.dim, args.vocab_size)
        self.rope = self.make_rope(None)

    def make_rope(self, factors: torch.Tensor | None) -> RoPE:
        a = self.args
        return RoPE(a.head_dim, a.rope_base, scale=a.rope_scale, factors=factors, device="cpu")

    def rope_freqs(self, factors: torch.Tensor) -> None:
        """Load hook for `rope_freqs.weight`: Llama 3's per-frequency RoPE divisors."""
        if factors.shape != (self.args.head_dim // 2,):
            raise ValueError(f"rope_freqs.weight has shape {tuple(factors.shape)}")
        self.rope = self.make_rope(factors)

    def convert(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's q/k row permutation: per head, rows (pair i, member j) → (j, i)."""
        if not self.permuted_qk or not (".attn_q." in name or ".attn_k." in name):
            return t
        heads = self.args.n_heads if ".attn_q." in name else self.args.n_kv_heads
        rest = t.shape[1:]
        return t.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(t.shape).contiguous()

    def forward(self, tokens: torch.Tensor, caches: Sequence[Sequence[KVCache]],
                skip: Collection[int] = (), step: Step | None = None,
                tree: Tree | None = None, taps: dict[int, Any] | None = None) -> torch.Tensor:  # fmt: skip
        """tokens (B, T); caches[b]: row b's per-layer caches. Returns (B, T, dim), normed.

        `skip`: layers left out (a self-speculative draft); their caches are not touched.
        `step`: planned beforehand (`base.Step`; caches is then one row of the layers' pools).
        `tree`: one row's tokens as a tree (`base.Tree`: a draft tree's verification).
        `taps`: layer i → set to the hidden states (B, T, dim) going into layer i (EAGLE-3's
        features)."""
        h = self.embed(tokens)
        live = [i for i in range(len(self.layers)) if i not in skip]
        pos, masks = step_inputs(caches, live, tokens.shape[1], h.device, step, tree)
        rope = self.rope(pos, h.dtype)
        for i in live:
            if taps is not None and i in taps:
                taps[i] = h
            h = self.layers[i](h, rope, [row[i] for row in caches], masks)
        return self.norm(h)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def rope_for(self, layer: int) -> RoPE:
        """The rotation layer `layer` uses (for caches that rotate keys at use)."""
        return self.rope

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., dim) → (..., vocab) float32."""
        return self.output(h).float()

    def make_caches(self, capacity: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, rows: Sequence[Rows] | None = None,
                    slot: int = 0) -> list[KVCache]:  # fmt: skip
        """One sequence's caches, one per layer (default: the model's dtype and device)."""
        w = working(self.tok_embeddings)
        a = self.args
        return make_caches(a.n_layers, a.n_kv_heads, a.head_dim, capacity,
                           dtype=dtype or w.dtype, device=device or w.device, rows=rows,
                           slot=slot)  # fmt: skip

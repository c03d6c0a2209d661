"""Gemma 3 (text): llama.cpp's `gemma3` architecture.

    h = embed(tokens) * sqrt(dim)
    per layer:  h += post_attn_norm(attn(norm(h)))    h += post_ffw_norm(mlp(ffn_norm(h)))
    attn: RMSNorm over each q and k head before RoPE; scores scaled by 1/sqrt(head size)
    mlp:  W_2 (gelu_tanh(x W_gate) * x W_up)

What differs from Hugging Face's Gemma3 and why:
- Norms: Gemma computes x * (1 + w); llama.cpp's converter stores 1 + w in the GGUF, so a plain
  RMSNorm reads every norm (block, q/k and final) as stored.
- Layers: five sliding-window layers, then one global, repeating (layer i is global when
  (i + 1) % 6 == 0), unless `attention.sliding_window_pattern` says otherwise. A key is visible
  from a local layer's query when q - k < `attention.sliding_window`.
- RoPE: local layers use base `rope.freq_base_swa` (default 10000) unscaled; global layers use
  `rope.freq_base` with the file's linear scaling (the 4B+ models' factor 8).
- Query scale: 1/sqrt(head size), as llama.cpp does (HF's `query_pre_attn_scalar`, which the GGUF
  does not carry, equals the head size in every released size except 27B, where llama.cpp uses
  dim / heads: we do the same, recognizing 27B by its 62 layers).
No attention-logit softcapping in Gemma 3; a final-logit softcap is applied if the file has one.
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
    sliding_window: int = 0
    sliding_window_pattern: Any = None  # an int period, or one bool per layer (True: local)
    rope_base_local: float = 10000.0
    final_logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        pattern = self.sliding_window_pattern
        if pattern is None or isinstance(pattern, int):
            period = pattern or 6
            self.local_layers = [(i + 1) % period != 0 for i in range(self.n_layers)]
        else:
            self.local_layers = [bool(x) for x in pattern]
            if len(self.local_layers) != self.n_layers:
                raise ValueError("gemma3.attention.sliding_window_pattern has the wrong length")
        # llama.cpp's f_attention_scale: dim / heads for 27B (62 layers), else the head size
        self.query_pre_attn_scalar = (
            self.dim // self.n_heads if self.n_layers == 62 else self.head_dim
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, local: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = projection(args.dim, q, kv, kv)
        self.wo = projection(q, args.dim)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.local = local
        self.window = args.sliding_window if local else 0
        self.scale = args.query_pre_attn_scalar**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                caches: Sequence[KVCache], masks: Masks) -> torch.Tensor:  # fmt: skip
        b, t, _ = x.shape
        H, KV = self.n_heads, self.n_kv
        qkv = self.wqkv(x).view(b, t, H + 2 * KV, self.head_dim)
        q = apply_rope(self.q_norm(qkv[:, :, :H]), *rope)  # (B, T, H, hd)
        raw = self.k_norm(qkv[:, :, H : H + KV])
        k = apply_rope(raw, *rope)  # (B, T, KV, hd)
        out = attend(q, k, qkv[:, :, H + KV :], caches, masks, window=self.window, scale=self.scale,
                     k_raw=raw)  # fmt: skip
        return self.wo(out)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w13 = projection(args.dim, args.ffn_dim, args.ffn_dim)  # gate, up
        self.w2 = projection(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.gelu(gate, approximate="tanh") * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, local: bool) -> None:
        super().__init__()
        self.attention = Attention(args, local)
        self.feed_forward = MLP(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_ffw_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                caches: Sequence[KVCache], masks: Masks) -> torch.Tensor:  # fmt: skip
        h = h + self.post_attention_norm(
            self.attention(self.attention_norm(h), rope, caches, masks)
        )
        return h + self.post_ffw_norm(self.feed_forward(self.ffn_norm(h)))


class Model(nn.Module):
    """A stack of `Block`s. Stateless: the caller passes each row's per-layer caches."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, local) for local in args.local_layers)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = projection(args.dim, args.vocab_size)
        self.rope_local = RoPE(args.head_dim, args.rope_base_local, device="cpu")
        self.rope_global = RoPE(args.head_dim, args.rope_base, scale=args.rope_scale, device="cpu")

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
        ropes = self.rope_global(pos, h.dtype), self.rope_local(pos, h.dtype)
        for i in live:
            if taps is not None and i in taps:
                taps[i] = h
            layer = self.layers[i]
            h = layer(h, ropes[layer.attention.local], [row[i] for row in caches], masks)
        return self.norm(h)

    def rope_for(self, layer: int) -> RoPE:
        """The rotation layer `layer` uses (for caches that rotate keys at use)."""
        return self.rope_local if self.layers[layer].attention.local else self.rope_global

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        return h * torch.tensor(self.args.dim**0.5, dtype=h.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., dim) → (..., vocab) float32."""
        out = self.output(h).float()
        if cap := self.args.final_logit_softcap:
            out = torch.tanh(out / cap) * cap
        return out

    def make_caches(self, capacity: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, rows: Sequence[Rows] | None = None,
                    slot: int = 0) -> list[KVCache]:  # fmt: skip
        """One sequence's caches, one per layer (default: the model's dtype and device).

        Plain caches everywhere: the local layers' window is applied by the attention mask."""
        w = working(self.tok_embeddings)
        a = self.args
        return make_caches(a.n_layers, a.n_kv_heads, a.head_dim, capacity,
                           dtype=dtype or w.dtype, device=device or w.device, rows=rows,
                           slot=slot)  # fmt: skip

"""EAGLE-style draft heads (issue 36, first part): one small decoder layer over the target's own
features, and the losses it is trained with.

EAGLE-1 (arXiv 2401.15077): at position t the head reads the target's feature f_t (its last
hidden state before the final norm, as EAGLE's published heads take it: `features` captures it)
and the embedding of the token after it, x_{t+1}: g_t = layer(fc([e(x_{t+1}); f_t])) predicts
f_{t+1}, and the target's own final norm and output head over g_t give the draft's
distribution of x_{t+2}. Drafting feeds g_t back as the next feature,
so k drafts cost k passes of one layer and k products with the head's rows. FR-Spec (arXiv
2502.14856): the draft reads only the head's rows of the most frequent tokens (`vocab`, chosen by
`frequent` from the training text), so drafting does not pay for the whole vocabulary.

Training (`losses`): the frozen target's features and logits over text; the head's prediction of
f_{t+1} (smooth L1) and its distribution over `vocab` against the target's next-token
distribution there, renormalized over `vocab` (cross-entropy), weighted as EAGLE weights them.

Not yet here: the `train-draft` command, storing heads by model digest, drafting inside the
engine and tree verification (see the issue).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TOKEN_WEIGHT", "DraftHead", "features", "frequent", "losses"]

TOKEN_WEIGHT = 0.1  # EAGLE's weight of the token loss beside the feature loss (1.0)


class DraftHead(nn.Module):
    """One decoder layer (attention with RoPE and grouped keys, SwiGLU feed-forward) behind a
    projection of [token embedding; feature]: EAGLE-1's draft, whose first layer has no input
    norm. It keeps keys and values of its own (`forward`'s cache)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab: torch.Tensor,
                 *, head_dim: int | None = None, rope_base: float = 10000.0,
                 eps: float = 1e-6) -> None:  # fmt: skip
        super().__init__()
        if (head_dim is None and dim % n_heads) or n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} heads over {n_kv_heads} key heads cannot split {dim}")
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.head_dim = hd = head_dim or dim // n_heads
        self.config = {"dim": dim, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "ffn_dim": ffn_dim,
                       "head_dim": hd, "rope_base": rope_base, "eps": eps}  # fmt: skip
        self.fc = nn.Linear(2 * dim, dim)
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(n_heads * hd, dim, bias=False)
        self.norm = nn.RMSNorm(dim, eps=eps)  # before the feed-forward
        self.w13 = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.register_buffer("vocab", vocab.detach().long().clone())  # draft row → target token
        inv = 1.0 / rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate (B, H, T, hd) by positions (T,): pairs (i, i + hd/2), as Llama's HF layout."""
        angles = pos.float().unsqueeze(-1) * self.inv_freq  # (T, hd/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def forward(self, emb: torch.Tensor, feats: torch.Tensor, start: int = 0,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """emb, feats (B, T, dim): e(x_{t+1}) and f_t at positions start .. start + T - 1.
        cache: keys and values of positions 0 .. start - 1, (B, KV, start, head_dim) each.
        Returns g (B, T, dim), the predicted features f_{t+1}, and the cache with these positions."""
        x = self.fc(torch.cat((emb, feats), dim=-1))
        b, t, _ = x.shape
        hd, h, kv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.wqkv(x).split((h * hd, kv * hd, kv * hd), dim=-1)
        pos = torch.arange(start, start + t, device=x.device)
        q = self._rope(q.view(b, t, h, hd).transpose(1, 2), pos)
        k = self._rope(k.view(b, t, kv, hd).transpose(1, 2), pos)
        v = v.view(b, t, kv, hd).transpose(1, 2)
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        seen = torch.arange(k.shape[2], device=x.device) <= pos.unsqueeze(-1)  # (T, S) causal
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, h * hd))
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up), (k, v)

    def logits(self, g: torch.Tensor, rows: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """g (..., dim) → (..., len(vocab)) through the target's final `norm` and `rows`, its
        output head's rows of `vocab`."""
        return F.linear(norm(g).to(rows.dtype), rows)


def features(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over rows of tokens (B, T) in fresh caches: its features (the input of
    its final norm) and its logits, (B, T, dim) and (B, T, n_vocab) float32."""
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    try:
        with torch.no_grad():
            h = model(tokens, [model.make_caches(tokens.shape[1]) for _ in range(len(tokens))])
            return seen[-1].float(), model.logits(h)
    finally:
        hook.remove()


def frequent(tokens: Sequence[int] | torch.Tensor, n: int, n_vocab: int) -> torch.Tensor:
    """The `n` most frequent tokens of a text (ties by id), ascending: a draft vocabulary."""
    counts = torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=n_vocab)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: min(n, n_vocab)].sort().values


def losses(head: DraftHead, emb_next: torch.Tensor, feats: torch.Tensor, target_logits: torch.Tensor,
           rows: torch.Tensor, norm: nn.Module) -> dict[str, torch.Tensor]:  # fmt: skip
    """EAGLE's losses over a batch of the frozen target's passes.

    Args:
        emb_next: (B, T - 1, dim) the target's embeddings of x_1 .. x_{T-1}.
        feats: (B, T, dim) its features f_0 .. f_{T-1}.
        target_logits: (B, T, n_vocab) its logits at each position (of x_{t+1}).
        rows, norm: the target head's rows of `head.vocab`, its final norm.
    Returns:
        "feature" (smooth L1 of g_t against f_{t+1}), "token" (cross-entropy of the draft's
        distribution of x_{t+2} against the target's, over the draft vocabulary), "loss" (their
        weighted sum), "kl" (the token loss less the target's entropy: 0 for a perfect draft)
        and "agree" (how often the two distributions' top tokens are the same).
    """
    g, _ = head(emb_next, feats[:, :-1])
    feature = F.smooth_l1_loss(g, feats[:, 1:])
    p = target_logits[:, 1:].index_select(-1, head.vocab).float().softmax(-1)
    log_q = F.log_softmax(head.logits(g, rows, norm).float(), dim=-1)
    token = -(p * log_q).sum(-1).mean()
    agree = (log_q.argmax(-1) == p.argmax(-1)).float().mean()
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1).mean()
    return {"feature": feature, "token": token, "loss": feature + TOKEN_WEIGHT * token,
            "kl": (token - entropy).detach(), "agree": agree.detach()}  # fmt: skip

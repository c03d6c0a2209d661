"""EAGLE-style draft heads (issue 36, first part): one small decoder layer over the target's own
features, and the losses it is trained with.

EAGLE-1 (arXiv 2401.15077): at position t the head reads the target's feature f_t (its last
hidden state after the final norm: what the model's output head reads, and what EAGLE's code
takes as the base model's output) and the embedding of the token after it, x_{t+1}:
g_t = layer(fc([e(x_{t+1}); f_t])) predicts f_{t+1}, and the target's own output head over g_t
gives the draft's distribution of x_{t+2}. Drafting feeds g_t back as the next feature, so k
drafts cost k passes of one layer and k products with the head's rows. FR-Spec (arXiv
2502.14856): the draft reads only the head's rows of the most frequent tokens (`vocab`, chosen by
`frequent` from the training text), so drafting does not pay for the whole vocabulary.

Training (`losses`): the frozen target's features and logits over text; the head's prediction of
f_{t+1} (smooth L1) and its distribution over `vocab` against the target's next-token
distribution there, renormalized over `vocab` (cross-entropy), weighted as EAGLE weights them.

`HeadState` is one sequence's drafting state in a runner: the head's own cache over the
target's features as they arrive, and the draft entries of one round on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TOKEN_WEIGHT", "DraftHead", "HeadState", "features", "frequent", "losses", "softcap"]

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
        cache: keys and values of the positions before, (B, KV, S, head_dim) each (all of them,
        or a run ending at start - 1: RoPE makes attention depend on distances alone).
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
        held = k.shape[2] - t  # causal over the cache's entries and then these
        seen = torch.arange(k.shape[2], device=x.device) <= torch.arange(held, held + t, device=x.device).unsqueeze(-1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, h * hd))
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up), (k, v)

    @staticmethod
    def logits(g: torch.Tensor, rows: torch.Tensor, cap: float = 0.0) -> torch.Tensor:
        """g (..., dim) → (..., len(vocab)) through `rows`, the target's output head's rows of
        `vocab` (and its final logit softcap `cap`, if it has one), float32."""
        out = F.linear(g.to(rows.dtype), rows).float()
        return torch.tanh(out / cap) * cap if cap else out


def softcap(model: nn.Module) -> float:
    """The target's final logit softcap (Gemma 2's; 0: none)."""
    return float(getattr(model.args, "final_logit_softcap", 0.0) or 0.0)


def features(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over rows of tokens (B, T) in fresh caches: its features (its last
    hidden states, normed) and its logits, (B, T, dim) and (B, T, n_vocab) float32."""
    with torch.no_grad():
        h = model(tokens, [model.make_caches(tokens.shape[1]) for _ in range(len(tokens))])
        return h.float(), model.logits(h)


def frequent(tokens: Sequence[int] | torch.Tensor, n: int, n_vocab: int) -> torch.Tensor:
    """The `n` most frequent tokens of a text (ties by id), ascending: a draft vocabulary."""
    counts = torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=n_vocab)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[: min(n, n_vocab)].sort().values


def losses(head: DraftHead, emb_next: torch.Tensor, feats: torch.Tensor, target_logits: torch.Tensor,
           rows: torch.Tensor, cap: float = 0.0) -> dict[str, torch.Tensor]:  # fmt: skip
    """EAGLE's losses over a batch of the frozen target's passes.

    Args:
        emb_next: (B, T - 1, dim) the target's embeddings of x_1 .. x_{T-1}.
        feats: (B, T, dim) its features f_0 .. f_{T-1}.
        target_logits: (B, T, n_vocab) its logits at each position (of x_{t+1}).
        rows, cap: the target head's rows of `head.vocab`, its final logit softcap.
    Returns:
        "feature" (smooth L1 of g_t against f_{t+1}), "token" (cross-entropy of the draft's
        distribution of x_{t+2} against the target's, over the draft vocabulary), "loss" (their
        weighted sum), "kl" (the token loss less the target's entropy: 0 for a perfect draft)
        and "agree" (how often the two distributions' top tokens are the same).
    """
    g, _ = head(emb_next, feats[:, :-1])
    feature = F.smooth_l1_loss(g, feats[:, 1:])
    p = target_logits[:, 1:].index_select(-1, head.vocab).float().softmax(-1)
    log_q = F.log_softmax(head.logits(g, rows, cap).float(), dim=-1)
    token = -(p * log_q).sum(-1).mean()
    agree = (log_q.argmax(-1) == p.argmax(-1)).float().mean()
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1).mean()
    return {"feature": feature, "token": token, "loss": feature + TOKEN_WEIGHT * token,
            "kl": (token - entropy).detach(), "agree": agree.detach()}  # fmt: skip


class HeadState:
    """One sequence's drafting with a head, beside a runner's slot.

    The runner hands over the target's features as it evaluates the slot's positions (`record`)
    and forgets them with the slot's (`trim`, `reset`). A round of drafting (`draft`, once per
    token) first catches the head up: entry t reads (f_t, x_{t+1}) for every position whose
    feature arrived since the last round, the last of them with the sequence's last sampled
    token (not yet evaluated by the target, but final); those entries stay in the head's cache.
    Each later call reads (g, the token just drafted) at the next position, on top of them;
    `done` drops those draft entries again. Features wait only until the next round, at most
    `PENDING` positions of them (a sequence that does not draft keeps no more).
    """

    PENDING = 4096

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.feats: list[torch.Tensor] = []  # (T, dim) each: the target's, positions at ..
        self.tokens: list[int] = []  # the tokens evaluated at those positions
        self.at = 0  # the position of the first waiting feature
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.end = 0  # the head's cache holds entries .. end - 1 (then `drafts` draft ones)
        self.drafts = 0
        self.g: torch.Tensor | None = None  # the last predicted feature of this round (1, 1, dim)
        self.last: tuple[int, torch.Tensor] | None = None  # token and g of entry end - 1

    @property
    def waiting(self) -> int:
        return len(self.tokens)

    def record(self, pos: int, h: torch.Tensor, tokens: Sequence[int]) -> None:
        """The target evaluated `tokens` at positions pos.. with features h (T, dim)."""
        if self.tokens and self.at + len(self.tokens) != pos:
            self.feats, self.tokens = [], []  # a gap: what waited no longer leads here
        if not self.tokens:
            self.at = pos
        self.feats.append(h.detach())
        self.tokens.extend(tokens)
        extra = len(self.tokens) - self.PENDING
        if extra > 0:  # the oldest go: the head restarts after them
            whole = torch.cat(self.feats)[extra:]
            self.feats, self.tokens, self.at = [whole], self.tokens[extra:], self.at + extra

    def trim(self, held: int) -> None:
        """The slot now holds positions .. held - 1 only."""
        if self.at + len(self.tokens) > held:
            keep = max(0, held - self.at)
            whole = torch.cat(self.feats)[:keep] if self.feats else None
            self.feats = [whole] if whole is not None and keep else []
            self.tokens = self.tokens[:keep]
        if self.end > held - 1:  # entry t read the token at t + 1, which is gone (or may change)
            self.cache, self.end, self.drafts, self.g, self.last = None, 0, 0, None, None

    @torch.inference_mode()
    def draft(self, head: DraftHead, embed: Callable[[torch.Tensor], torch.Tensor],
              rows: torch.Tensor, token: int, cap: float = 0.0) -> torch.Tensor | None:  # fmt: skip
        """The head's logits over its vocabulary (len(vocab),) for the token after `token`:
        the sequence's last token on the round's first call, then each drafted one. None where
        the head has nothing to read (no features, and no entry to go on from)."""
        dev = rows.device
        x = torch.tensor([[token]], dtype=torch.long, device=dev)
        if self.g is None:  # the round's first call: catch up
            if self.tokens:
                feats = torch.cat(self.feats) if len(self.feats) > 1 else self.feats[0]
                if self.cache is None or self.end != self.at:  # a gap: start afresh here
                    self.cache, self.end = None, self.at
                nxt = torch.tensor([[*self.tokens[1:], token]], dtype=torch.long, device=dev)
                g, self.cache = head(embed(nxt).to(rows.dtype), feats[None].to(rows.dtype),
                                     self.end, self.cache)  # fmt: skip
                self.end += len(self.tokens)
                self.feats, self.tokens = [], []
                self.g = g[:, -1:]
                self.last = (token, self.g)
            elif self.last is not None and self.last[0] == token:
                self.g = self.last[1]  # nothing new since the last round: its last entry holds
            else:
                return None
        else:
            assert self.cache is not None
            self.g, self.cache = head(embed(x).to(rows.dtype), self.g,
                                      self.end + self.drafts, self.cache)  # fmt: skip
            self.drafts += 1
        return head.logits(self.g[0, 0], rows, cap)

    def done(self) -> None:
        """The round is over: its draft entries go."""
        if self.drafts and self.cache is not None:
            k, v = self.cache
            self.cache = (k[:, :, : -self.drafts], v[:, :, : -self.drafts])
        self.drafts, self.g = 0, None

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

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FEATURE_WEIGHT", "STEP_DECAY", "DraftHead", "Eagle3Head", "HeadState", "features", "frequent", "losses",
           "soft_labels", "softcap"]

FEATURE_WEIGHT = 0.1  # the feature loss's weight beside the token loss's (1.0)
STEP_DECAY = 0.8  # each later drafted step's token loss weighs this much of the one before


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

    def _project(self, emb: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """fc over [emb; feats] (B, T, dim) and its queries, keys, values at positions pos (T,)."""
        x = self.fc(torch.cat((emb, feats), dim=-1))
        b, t, _ = x.shape
        hd, h, kv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.wqkv(x).split((h * hd, kv * hd, kv * hd), dim=-1)
        q = self._rope(q.view(b, t, h, hd).transpose(1, 2), pos)
        k = self._rope(k.view(b, t, kv, hd).transpose(1, 2), pos)
        return x, q, k, v.view(b, t, kv, hd).transpose(1, 2)

    def _finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seen: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Attention of q over (k, v) where `seen` (T, S) allows, then the feed-forward."""
        b, t, _ = x.shape
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)

    def forward(self, emb: torch.Tensor, feats: torch.Tensor, start: int = 0,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """emb, feats (B, T, dim): e(x_{t+1}) and f_t at positions start .. start + T - 1.
        cache: keys and values of the positions before, (B, KV, S, head_dim) each (all of them,
        or a run ending at start - 1: RoPE makes attention depend on distances alone).
        Returns g (B, T, dim), the predicted features f_{t+1}, and the cache with these positions."""
        t, dev = emb.shape[1], emb.device
        held = 0 if cache is None else cache[0].shape[2]  # causal over the cache's entries and then these
        seen = torch.arange(held + t, device=dev) <= torch.arange(held, held + t, device=dev).unsqueeze(-1)
        return self.step(emb, feats, torch.arange(start, start + t, device=dev), cache, seen)

    def step(self, emb: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor,
             cache: tuple[torch.Tensor, torch.Tensor] | None, seen: torch.Tensor,
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """`forward` with each entry's position (T,) and what it sees, (T, S + T) over the
        cache's entries and then these (a draft tree's entries see their ancestors only)."""
        x, q, k, v = self._project(emb, feats, pos)
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        return self._finish(x, q, k, v, seen), (k, v)

    def unrolled(self, emb_next: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Drafting `steps` tokens from every position at once, as drafting does it (EAGLE-3's
        training-time test, arXiv 2503.01840): step 1 reads the target's features, step s > 1
        the head's own g of step s - 1, so the head learns from the inputs it drafts from.

        emb_next (B, n, dim): e(x_1) .. e(x_n); feats (B, n, dim): f_0 .. f_{n-1}. Returns
        [g_1, ..., g_steps], each (B, n, dim): row r of g_s reads e(x_{r+s}) at position
        r + s - 1 and predicts f_{r+s} (the draft of x_{r+s+1}); its attention sees the
        target's entries 0 .. r (step 1's keys) and its own row's entries of steps 2 .. s. Rows
        with r + s > n are padding (their token is zeros).
        """
        n, dev = emb_next.shape[1], emb_next.device
        rows = torch.arange(n, device=dev)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        inp = feats
        for s in range(1, steps + 1):
            emb = F.pad(emb_next[:, s - 1 :], (0, 0, 0, s - 1))  # e(x_{r+s}), zeros past the end
            x, q, k, v = self._project(emb, inp, rows + (s - 1))
            keys.append(k)
            values.append(v)
            causal = rows.unsqueeze(0) <= rows.unsqueeze(-1)  # step 1's entries 0 .. r
            own = rows.unsqueeze(0) == rows.unsqueeze(-1)  # each later step's entry of row r
            seen = torch.cat([causal, *[own] * (s - 1)], dim=-1)
            g = self._finish(x, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), seen)
            out.append(g)
            inp = g
        return out

    @staticmethod
    def logits(g: torch.Tensor, rows: torch.Tensor, cap: float = 0.0) -> torch.Tensor:
        """g (..., dim) → (..., len(vocab)) through `rows`, the target's output head's rows of
        `vocab` (and its final logit softcap `cap`, if it has one), float32."""
        out = F.linear(g.to(rows.dtype), rows).float()
        return torch.tanh(out / cap) * cap if cap else out


class Eagle3Head(DraftHead):
    """EAGLE-3's published draft (arXiv 2503.01840; SafeAILab/EAGLE, as vLLM and SGLang run
    it): the target's features are its hidden states going into three of its layers (`taps`;
    low, middle, high), joined by `fc` (3·target width → width, no bias); the layer's attention
    reads [norm(e(x)); norm(feature)] (2·width), the feature is the residual stream, and the
    head has its own final norm and output rows over a draft vocabulary (`vocab`: draft row →
    target token, its `d2t` offsets applied). Drafting feeds the layer's output before the final
    norm back as the next feature (not through `fc`). Read only (`train_draft.read_published`):
    `train-draft` trains EAGLE-1 heads (`DraftHead`)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab: torch.Tensor,
                 *, taps: Sequence[int], target_dim: int | None = None, head_dim: int | None = None,
                 rope_base: float = 10000.0, eps: float = 1e-6,
                 rope_scaling: dict[str, Any] | None = None,
                 norm_before_residual: bool = False) -> None:  # fmt: skip
        super().__init__(dim, n_heads, n_kv_heads, ffn_dim, vocab, head_dim=head_dim,
                         rope_base=rope_base, eps=eps)  # fmt: skip
        hd, tdim = self.head_dim, target_dim or dim
        self.taps = tuple(int(t) for t in taps)
        self.config.update(kind="eagle3", taps=list(self.taps), target_dim=tdim,
                           rope_scaling=rope_scaling, norm_before_residual=norm_before_residual)  # fmt: skip
        if rope_scaling:  # Llama 3's per-frequency scaling (EAGLE-3 heads of Llama 3.1 models)
            self.inv_freq = self.inv_freq / llama3_factors(rope_scaling, self.inv_freq)
        self.norm_before_residual = norm_before_residual
        self.fc = nn.Linear(len(self.taps) * tdim, dim, bias=False)
        self.wqkv = nn.Linear(2 * dim, (n_heads + 2 * n_kv_heads) * hd, bias=False)
        self.embed_norm = nn.RMSNorm(dim, eps=eps)
        self.hidden_norm = nn.RMSNorm(dim, eps=eps)
        self.out_norm = nn.RMSNorm(dim, eps=eps)  # before its own output rows
        self.lm_head = nn.Linear(dim, len(vocab), bias=False)

    def _project(self, emb: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The residual stream (B, T, dim) and the attention's q, k, v: the target's features
        (wider than the head) go through `fc` first, the head's own do not."""
        if feats.shape[-1] != self.dim:
            feats = self.fc(feats)
        normed = self.hidden_norm(feats)
        x = normed if self.norm_before_residual else feats
        b, t, _ = x.shape
        hd, h, kv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.wqkv(torch.cat((self.embed_norm(emb), normed), dim=-1)).split(
            (h * hd, kv * hd, kv * hd), dim=-1)  # fmt: skip
        q = self._rope(q.view(b, t, h, hd).transpose(1, 2), pos)
        k = self._rope(k.view(b, t, kv, hd).transpose(1, 2), pos)
        return x, q, k, v.view(b, t, kv, hd).transpose(1, 2)

    def logits(self, g: torch.Tensor, rows: torch.Tensor, cap: float = 0.0) -> torch.Tensor:  # type: ignore[override]
        """g (..., dim) → (..., len(vocab)) float32 through the head's own norm and rows (the
        target's `rows` and softcap are not used)."""
        return self.lm_head(self.out_norm(g.to(self.lm_head.weight.dtype))).float()


def llama3_factors(scaling: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3's RoPE scaling as a divisor per frequency (what llama.cpp stores as
    `rope_freqs.weight`): long wavelengths slowed by `factor`, short ones kept, a smooth blend
    between; one line for another kind of scaling."""
    from localllm.errors import LocalLLMError

    kind = scaling.get("rope_type") or scaling.get("type")
    if kind != "llama3":
        raise LocalLLMError(f"a draft head with {kind!r} RoPE scaling, which localllm does not read")
    factor, lo, hi = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / hi, torch.ones_like(blend),
                       torch.where(wavelen > old / lo, torch.full_like(blend, factor), blend))  # fmt: skip


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


def soft_labels(target_logits: torch.Tensor, vocab: torch.Tensor,
                top: int = 32) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The target's next-token distributions (..., n_vocab) over a draft vocabulary, kept as
    its `top` most likely tokens there (indices into `vocab`, renormalized probabilities):
    (..., top) int64 and float32. What a draft can learn of a distribution it cannot draft
    outside `vocab` (the rest of the mass is lost to it either way)."""
    p = target_logits.index_select(-1, vocab.to(target_logits.device)).float().softmax(-1)
    vals, idx = p.topk(min(top, p.shape[-1]), dim=-1)
    return idx, vals / vals.sum(-1, keepdim=True)


def losses(head: DraftHead, emb_next: torch.Tensor, feats: torch.Tensor,
           target: torch.Tensor | tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor,
           cap: float = 0.0, *, steps: int = 1,
           feature_weight: float = FEATURE_WEIGHT) -> dict[str, torch.Tensor]:  # fmt: skip
    """The head's losses over a batch of the frozen target's passes.

    Args:
        emb_next: (B, T - 1, dim) the target's embeddings of x_1 .. x_{T-1}.
        feats: (B, T, dim) its features f_0 .. f_{T-1}.
        target: (B, T, n_vocab) its logits at each position (of x_{t+1}), or their
            `soft_labels` over the head's vocabulary, (B, T, top) each.
        rows, cap: the target head's rows of `head.vocab`, its final logit softcap.
        steps: tokens drafted from each position (`DraftHead.unrolled`); step s's token loss
            weighs `STEP_DECAY` ** (s - 1).
    Returns:
        "token" (cross-entropy of the draft's distributions against the target's, over the
        draft vocabulary, summed over steps as weighed), "feature" (smooth L1 of step 1's g_t
        against f_{t+1}), "loss" (token + feature_weight · feature), "kl" (step 1's token
        loss less the target's entropy: 0 for a perfect draft) and "agree" (how often step s's
        top token is the target's, (steps,)).
    """
    idx, p = soft_labels(target, head.vocab) if isinstance(target, torch.Tensor) else target
    n = emb_next.shape[1]
    gs = head.unrolled(emb_next, feats[:, :n], steps)
    token = torch.zeros((), device=feats.device)
    agree, kl = [], torch.zeros(())
    for s, g in enumerate(gs, start=1):
        m = n - s + 1  # rows r with a target: r + s <= T - 1
        log_q = F.log_softmax(head.logits(g[:, :m], rows, cap), dim=-1)
        ps, ids = p[:, s : s + m].float(), idx[:, s : s + m]
        ce = -(ps * log_q.gather(-1, ids)).sum(-1).mean()
        token = token + STEP_DECAY ** (s - 1) * ce
        agree.append((log_q.argmax(-1) == ids[..., 0]).float().mean().detach())
        if s == 1:
            kl = (ce - -(ps * ps.clamp(min=1e-30).log()).sum(-1).mean()).detach()
    feature = F.smooth_l1_loss(gs[0], feats[:, 1 : n + 1].to(gs[0].dtype))
    return {"feature": feature, "token": token, "loss": token + feature_weight * feature,
            "kl": kl, "agree": torch.stack(agree)}  # fmt: skip


def pick(entries: tuple[torch.Tensor, ...], keep: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Head cache entries (positions (n,), keys, values (1, KV, n, hd)) where `keep` (n,) is
    True; None where none is."""
    if not bool(keep.any()):
        return None
    pos, k, v = entries
    idx = keep.nonzero().flatten().to(k.device)
    return pos[keep], k[:, :, idx], v[:, :, idx]


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

    A round may draft a tree (`expand`, EAGLE-2): each draft entry reads its parent's g at the
    position after its parent's and sees its own ancestors among the round's entries only.

    Each entry keeps its position (its keys are rotated by it), so entries may be missing —
    positions restored from the prefix cache without the head's entries of them, one whose
    feature was forgotten — and attention reads the others. The prefix cache keeps the head's
    entries of a span beside the target's (`entries`, `restore`).
    """

    PENDING = 4096

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.feats: list[torch.Tensor] = []  # (T, dim) each: the target's, positions at ..
        self.tokens: list[int] = []  # the tokens evaluated at those positions
        self.at = 0  # the position of the first waiting feature
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # (1, KV, n, hd) each
        self.pos = torch.zeros(0, dtype=torch.long)  # each cached entry's position
        self.end = 0  # drafts go at end, end + 1 ... (the last committed entry's position + 1)
        self.g: torch.Tensor | None = None  # the round's first predicted feature (1, 1, dim)
        self.gs: list[torch.Tensor] = []  # each draft entry's, (1, 1, dim)
        self.up: list[list[int]] = []  # each draft entry's ancestors among them, and itself
        self.depth: list[int] = []  # each draft entry's depth (1: after the first call's)
        self.last: tuple[int, torch.Tensor] | None = None  # token and g of entry end - 1

    @property
    def drafts(self) -> int:
        """Draft entries this round has made (on top of the cache's committed ones)."""
        return len(self.gs)

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
        if extra > 0:  # the oldest go: the head reads on without them
            whole = torch.cat(self.feats)[extra:]
            self.feats, self.tokens, self.at = [whole], self.tokens[extra:], self.at + extra

    def _keep(self, keep: torch.Tensor) -> None:
        """Keep the cached entries where `keep` (n,) is True."""
        if self.cache is not None and not bool(keep.all()):
            got = pick((self.pos, *self.cache), keep)
            self.cache, self.pos = (None, self.pos[:0]) if got is None else (got[1:], got[0])

    def trim(self, held: int) -> None:
        """The slot now holds positions .. held - 1 only."""
        if self.at + len(self.tokens) > held:
            keep = max(0, held - self.at)
            whole = torch.cat(self.feats)[:keep] if self.feats else None
            self.feats = [whole] if whole is not None and keep else []
            self.tokens = self.tokens[:keep]
        if self.end > held - 1:  # entry t read the token at t + 1, which is gone (or may change)
            self._keep(self.pos < held - 1)
            self.end, self.last = min(self.end, held), None

    def keep(self, start: int, path: Sequence[int], t: int) -> None:
        """The target evaluated a tree of t tokens at places start ..; it keeps those at
        `path` at start, start + 1 ...: so do the features waiting for the next round."""
        if self.tokens and self.at <= start and self.at + len(self.tokens) == start + t:
            i0 = start - self.at
            idx = [*range(i0), *(i0 + j for j in path)]
            whole = torch.cat(self.feats)
            self.feats = [whole[torch.tensor(idx, device=whole.device)]]
            self.tokens = [self.tokens[i] for i in idx]
        else:  # what waited does not line up: the tree's features are left out
            self.trim(start)

    def entries(self, start: int, end: int) -> tuple[torch.Tensor, ...] | None:
        """The cached entries of positions [start, end): (positions, keys, values); None: none."""
        if self.cache is None:
            return None
        return pick((self.pos, *self.cache), (self.pos >= start) & (self.pos < end))

    def restore(self, parts: Sequence[tuple[torch.Tensor, ...]], held: int) -> None:
        """The slot was given `held` positions from the prefix cache, and with them these
        entries of the head (`entries` of each span)."""
        self.reset()
        if parts:
            pos = torch.cat([p[0] for p in parts])
            self.cache = (torch.cat([p[1] for p in parts], dim=2), torch.cat([p[2] for p in parts], dim=2))
            self.pos = pos
            self._keep(pos < held - 1)  # the last read a token the slot may not go on with
        self.end = self.at = held

    @torch.inference_mode()
    def draft(self, head: DraftHead, embed: Callable[[torch.Tensor], torch.Tensor],
              rows: torch.Tensor, token: int, cap: float = 0.0) -> torch.Tensor | None:  # fmt: skip
        """The head's logits over its vocabulary (len(vocab),) for the token after `token`:
        the sequence's last token on the round's first call, then each drafted one. None where
        the head has nothing to read (no features, and no entry to go on from)."""
        dev = rows.device
        if self.g is None:  # the round's first call: catch up
            if self.tokens:
                feats = torch.cat(self.feats) if len(self.feats) > 1 else self.feats[0]
                self._keep(self.pos < self.at)  # entries of these positions are redone
                n = len(self.tokens)
                nxt = torch.tensor([[*self.tokens[1:], token]], dtype=torch.long, device=dev)
                g, self.cache = head(embed(nxt).to(rows.dtype), feats[None].to(rows.dtype),
                                     self.at, self.cache)  # fmt: skip
                self.pos = torch.cat((self.pos, torch.arange(self.at, self.at + n)))
                self.end = self.at + n
                self.feats, self.tokens = [], []
                self.g = g[:, -1:]
                self.last = (token, self.g)
            elif self.last is not None and self.last[0] == token:
                self.g = self.last[1]  # nothing new since the last round: its last entry holds
            else:
                return None
            return head.logits(self.g[0, 0], rows, cap)
        return self.expand(head, embed, rows, [token], [self.drafts - 1], cap)[0]

    @torch.inference_mode()
    def expand(self, head: DraftHead, embed: Callable[[torch.Tensor], torch.Tensor],
               rows: torch.Tensor, tokens: Sequence[int], parents: Sequence[int],
               cap: float = 0.0) -> torch.Tensor:  # fmt: skip
        """Draft entries reading tokens[i] after the round's entry parents[i] (-1: the first
        call's), all in one pass of the head: their logits (len(tokens), len(vocab))."""
        assert self.g is not None and self.cache is not None, "a round starts with `draft`"
        dev, n = rows.device, len(tokens)
        if any(not -1 <= p < self.drafts for p in parents):
            raise ValueError(f"a draft entry's parent must be one of the round's {self.drafts}")
        x = embed(torch.tensor([list(tokens)], dtype=torch.long, device=dev)).to(rows.dtype)
        feats = torch.cat([self.g if p < 0 else self.gs[p] for p in parents], dim=1)
        depth = [self.depth[p] if p >= 0 else 0 for p in parents]
        pos = torch.tensor([self.end + d for d in depth], device=dev)
        held = self.cache[0].shape[2] - self.drafts
        seen = torch.zeros(n, held + self.drafts + n, dtype=torch.bool, device=dev)
        seen[:, :held] = True
        for i, p in enumerate(parents):
            up = (self.up[p] if p >= 0 else []) + [self.drafts + i]
            seen[i, [held + a for a in up]] = True
            self.up.append(up)
        g, self.cache = head.step(x, feats, pos, self.cache, seen)
        self.gs += [g[:, i : i + 1] for i in range(n)]
        self.depth += [d + 1 for d in depth]
        return head.logits(g[0], rows, cap)

    def done(self) -> None:
        """The round is over: its draft entries go."""
        if self.drafts and self.cache is not None:
            k, v = self.cache
            self.cache = (k[:, :, : -self.drafts], v[:, :, : -self.drafts])
        self.g, self.gs, self.up, self.depth = None, [], [], []

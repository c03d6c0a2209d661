"""Speculative decoding in the torch engine: a drafter proposes, one target pass verifies.

    drafter.propose(slot, k) -> Draft     up to k tokens after the slot's last sampled one, with the
                                          drafter's distributions q (None: deterministic, one-hot)
    accept(logits, draft, sampler, hist)  the exact rule (arXiv 2211.17192): greedy keeps drafts
                                          while each is the target's argmax; sampling keeps draft x
                                          when u ≤ p(x)/q(x), else draws from normalize(max(0, p − q))
                                          and stops; all kept → one bonus token from p
    Pace                                  the draft length from recent acceptance, and whether
                                          speculation still pays (else it switches itself off)

Drafters: `Lookup` (n-gram prompt lookup over prompt + generated text), `LayerSkip` (the target
with some layers left out, on the layers' own caches: Draft & Verify, SWIFT) and `DraftModel` (a
smaller model with the same vocabulary, on caches of its own). Target and drafter see the same
processed distributions (penalties, top-k/p, min-p, temperature: `Sampler.distribution`), so the
output is distributed exactly as the target's; greedy output is the target's greedy output.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch

from localllm.backends.base import common_prefix
from localllm.backends.torch.sampling import Sampler
from localllm.speculation import Draft, Lookup, Pace

__all__ = ["Draft", "DraftModel", "Drafter", "LayerSkip", "Lookup", "Pace", "accept"]


class Drafter(Protocol):
    def propose(self, slot: Any, k: int) -> Draft:
        """Up to k tokens to follow `slot.last` (the slot's caches hold what precedes it)."""
        ...


def accept(logits: Callable[[int], torch.Tensor], draft: Draft, sampler: Sampler,
           history: list[int]) -> tuple[list[int], int]:  # fmt: skip
    """The tokens one verification pass yields, and how many of them are accepted drafts.

    Args:
        logits: row i → the target's raw logits (V,) after the last token and drafts[:i].
        history: prompt + generated so far (for penalties); extended with what is returned.
    Returns:
        (tokens, n): the n accepted drafts and then one token of the target's own (its choice
        where draft n was rejected, or the bonus after all of them): 1..k+1 tokens.
    """
    out: list[int] = []
    if sampler.greedy:
        for i, x in enumerate(draft.tokens):
            t = int(sampler.process(logits(i), history).argmax())
            out.append(t)
            history.append(t)
            if t != x:
                return out, i
        t = int(sampler.process(logits(len(draft.tokens)), history).argmax())
        history.append(t)
        return [*out, t], len(draft.tokens)
    for i, x in enumerate(draft.tokens):
        p = sampler.distribution(logits(i), history)
        q = draft.q[i] if draft.q is not None else None
        qx = float(q[x]) if q is not None else 1.0
        px = float(p[x])
        if qx > 0 and sampler.uniform() * qx <= px:  # u ≤ min(1, p(x)/q(x))
            out.append(x)
            history.append(x)
            continue
        if q is not None:
            residual = (p - q.to(p.dtype)).clamp_min_(0)
        else:  # max(0, p − one-hot(x)): p without x
            residual = p.clone()
            residual[x] = 0
        total = float(residual.sum())
        t = sampler.draw(residual / total if total > 0 else p)
        out.append(t)
        history.append(t)
        return out, i
    t = sampler.draw(sampler.distribution(logits(len(draft.tokens)), history))
    history.append(t)
    return [*out, t], len(draft.tokens)


# -- drafters -----------------------------------------------------------------------------------


def _choose(sampler: Sampler, logits: torch.Tensor, history: list[int],
            q: list[torch.Tensor] | None) -> tuple[int, float]:  # fmt: skip
    """A drafter's token from its logits (V,) and its confidence (the top probability). Greedy
    targets get the argmax; sampling ones a draw from the same processed distribution (kept in q)."""
    if sampler.greedy:
        z = sampler.process(logits, history)
        top = z.max()
        return int(z.argmax()), float(1.0 / torch.exp(z - top).sum())
    p = sampler.distribution(logits, history)
    assert q is not None
    q.append(p)
    return sampler.draw(p), float(p.max())


class LayerSkip:
    """The target itself with `skip` layers left out (Draft & Verify, arXiv 2309.08168; SWIFT,
    2410.06916): the kept layers read and write their own caches, so drafting needs no prefill and
    no memory of its own. What a draft wrote is trimmed before the target verifies: every layer's
    cache then holds the full model's keys and values only.

    Drafting stops early at a token whose probability is below `confidence` (the draft is
    unlikely to survive past it)."""

    def __init__(self, model: Any, skip: Collection[int], *, device: torch.device,
                 confidence: float = 0.0) -> None:  # fmt: skip
        self.model, self.device = model, device
        self.skip = frozenset(skip)
        self.kept = [i for i in range(len(model.layers)) if i not in self.skip]
        self.confidence = confidence

    def propose(self, slot: Any, k: int) -> Draft:
        sampler: Sampler = slot.sampler
        history = list(slot.history)
        q: list[torch.Tensor] | None = None if sampler.greedy else []
        tokens: list[int] = []
        tok, fed = slot.last, 0
        try:
            for _ in range(k):
                x = torch.tensor([[tok]], dtype=torch.long, device=self.device)
                h = self.model(x, [slot.caches], skip=self.skip)
                fed += 1
                tok, conf = _choose(sampler, self.model.logits(h[0, -1]), history, q)
                tokens.append(tok)
                history.append(tok)
                if conf < self.confidence:
                    break
        finally:
            for i in self.kept:
                slot.caches[i].trim(fed)
        return Draft(tokens, q)


class DraftModel:
    """A second, smaller model with the same vocabulary, on caches of its own kept in the slot
    (`slot.draft`: (caches, tokens they hold)), so its prompt prefix is reused like the target's.
    Before drafting it catches up with what the target's caches hold (the prompt at first, then
    the tokens accepted since); what it drafted past that is trimmed on the next catch-up."""

    def __init__(self, model: Any, *, capacity: int, dtype: torch.dtype, device: torch.device,
                 chunk: int = 256, confidence: float = 0.0) -> None:  # fmt: skip
        self.model = model
        self.capacity, self.dtype, self.device = capacity, dtype, device
        self.chunk = chunk
        self.confidence = confidence

    def propose(self, slot: Any, k: int) -> Draft:
        if slot.draft is None:
            slot.draft = (self.model.make_caches(self.capacity, dtype=self.dtype,
                                                 device=self.device), [])  # fmt: skip
        caches, held = slot.draft
        want = slot.tokens  # what the target's caches hold: everything before `last`
        keep = common_prefix(held, want, len(want))
        for c in caches:
            c.trim(c.offset - keep)
        del held[keep:]
        for i in range(keep, len(want), self.chunk):
            piece = want[i : i + self.chunk]
            self.model(torch.tensor([piece], dtype=torch.long, device=self.device), [caches])
            held.extend(piece)
        sampler: Sampler = slot.sampler
        history = list(slot.history)
        q: list[torch.Tensor] | None = None if sampler.greedy else []
        tokens: list[int] = []
        tok = slot.last
        k = min(k, self.capacity - len(held) - 1)
        for _ in range(max(0, k)):
            h = self.model(torch.tensor([[tok]], dtype=torch.long, device=self.device), [caches])
            held.append(tok)
            tok, conf = _choose(sampler, self.model.logits(h[0, -1]), history, q)
            tokens.append(tok)
            history.append(tok)
            if conf < self.confidence:
                break
        return Draft(tokens, q)

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

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from localllm.backends.base import common_prefix
from localllm.backends.torch.sampling import Sampler

__all__ = ["Draft", "DraftModel", "Drafter", "LayerSkip", "Lookup", "Pace", "accept"]


@dataclass
class Draft:
    tokens: list[int]
    q: list[torch.Tensor] | None = None  # (V,) probabilities each token was drawn from; None: one-hot


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


class Pace:
    """How many tokens to draft next, and whether speculation still pays.

    The draft length grows by 2 after a round that kept every draft and shrinks by 1 after one that
    did not (transformers' "heuristic" schedule), within [1, k_max]. Speculation switches itself
    off for the rest of the request when the last `WINDOW` verified rounds kept no draft at all,
    or when the measured tokens per second of the recent rounds (an average over about `WINDOW`
    rounds) fall below `1 - MARGIN` of plain decoding's. Plain decoding's cost is measured on the
    sequence itself: its first decode pass is plain, and so is every `REFRESH`-th after, as the
    context (and so the cost of a pass) grows.
    """

    WINDOW = 8
    MARGIN = 0.03
    REFRESH = 24

    def __init__(self, k_max: int, k: int | None = None, *, on: bool = True) -> None:
        self.k_max = max(1, k_max)
        self.k = max(1, min(self.k_max, k or self.k_max))
        self.on = on
        self.t_plain = 0.0  # seconds per plain decode pass (moving average)
        self.gain = 1.0  # moving average of (tokens per round × t_plain) / round seconds
        self.rounds = 0
        self.since_plain = 0
        self.recent: deque[int] = deque(maxlen=self.WINDOW)  # accepted drafts per round
        self.reason = ""  # why it switched off

    def want(self) -> int:
        """Tokens to draft for the next pass; 0: a plain pass."""
        if not self.on or not self.t_plain or self.since_plain >= self.REFRESH:
            return 0
        return self.k

    def plain(self, seconds: float) -> None:
        self.t_plain = seconds if not self.t_plain else 0.7 * self.t_plain + 0.3 * seconds
        self.since_plain = 0

    def verified(self, drafted: int, accepted: int, seconds: float) -> None:
        """One round: `drafted` proposed, `accepted` kept, drafting + verifying took `seconds`."""
        self.rounds += 1
        self.since_plain += 1
        self.recent.append(accepted)
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)
        gain = (accepted + 1) * self.t_plain / max(seconds, 1e-9)
        self.gain = 0.8 * self.gain + 0.2 * gain if self.rounds > 1 else gain
        if len(self.recent) == self.WINDOW and not any(self.recent):
            self.switch_off(f"the last {self.WINDOW} drafts were all rejected")
        elif self.rounds >= self.WINDOW and self.gain < 1 - self.MARGIN:
            self.switch_off(f"it ran at {self.gain:.2f}x of plain decoding")

    def switch_off(self, reason: str) -> None:
        self.on, self.reason = False, reason


# -- drafters -----------------------------------------------------------------------------------


class Lookup:
    """Prompt lookup (apoorvumang/prompt-lookup-decoding): the last n tokens (n = 3, 2, 1) found
    earlier in prompt + generated text propose what followed them there (the latest match).

    An index of every n-gram's latest end grows with the text, so a proposal costs a few dict
    lookups, not a scan of the context."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, slot: Any, k: int) -> Draft:
        return Draft(self.lookup(slot.history, k))

    def lookup(self, text: Sequence[int], k: int) -> list[int]:
        n_text = len(text)
        while self.indexed < n_text - 1:  # every n-gram except the ones ending at the last token
            e = self.indexed
            for n in range(1, self.max_n + 1):
                if e + 1 >= n:
                    self.ends[tuple(text[e + 1 - n : e + 1])] = e
            self.indexed += 1
        for n in range(min(self.max_n, n_text), self.min_n - 1, -1):
            e = self.ends.get(tuple(text[n_text - n :]))
            if e is not None:
                return list(text[e + 1 : e + 1 + k])
        return []


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

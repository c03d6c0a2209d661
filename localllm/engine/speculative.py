"""Speculative decoding, once for every runner: a drafter proposes, one target pass verifies.

    drafter.propose(seq, k) -> Draft       up to k tokens after the sequence's last sampled one,
                                           with the drafter's distributions q (None: one-hot)
    accept(logits, draft, sampler, hist)   the exact rule (arXiv 2211.17192): greedy keeps drafts
                                           while each is the target's argmax; sampling keeps draft x
                                           when u ≤ p(x)/q(x), else draws from normalize(max(0, p − q))
                                           and stops; all kept → one bonus token from p
    Pace                                   the draft length from recent acceptance, and whether
                                           speculation still pays (else it switches itself off)

Drafters: `Lookup` (n-gram prompt lookup over prompt + generated text), `DraftModel` (a smaller
model with the same vocabulary, on a runner of its own, one slot per slot of the target's),
`LayerSkip` (the target itself with some layers left out, through `forward(..., skip=)`: a runner
that has "self" among its speculative modes) and `HeadDrafter` (an EAGLE-style draft head on the
target's own features, through `head_logits`: a runner that has "head"). Target and drafter see
the same processed distributions (`Sampler.distribution`), so the output is distributed exactly
as the target's; greedy output is the target's greedy output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from localllm.backends.base import Piece
from localllm.engine.sampling import Sampler
from localllm.engine.slots import common_prefix
from localllm.errors import LocalLLMError
from localllm.types import ContextPolicy, speculative_mode

__all__ = [
    "DRAFT_K",
    "HEAD_K",
    "LOOKUP_K",
    "Draft",
    "DraftModel",
    "HeadDrafter",
    "LayerSkip",
    "Lookup",
    "Pace",
    "accept",
    "check_speculative",
]

LOOKUP_K = 10  # the most tokens prompt lookup proposes in one pass
DRAFT_K = 8  # ... and a draft model or layer skipping
HEAD_K = 8  # ... and a draft head


@dataclass
class Draft:
    """Tokens a drafter proposes after a sequence's last one."""

    tokens: list[int]
    q: list[Any] | None = None  # (V,) probabilities each token was drawn from; None: one-hot


class Pace:
    """How many tokens to draft next, and whether speculation still pays.

    It keeps two estimates, both moving averages over recent rounds: the acceptance α (accepted
    drafts over accepted drafts plus rejections: a draft token's chance to survive, given the
    ones before it did) and the cost c of one more drafted token (drafting it and verifying it),
    as a share of a plain pass. Each round it drafts the k in [1, k_max] that maximises the
    predicted speed-up (1 − α^(k+1)) / (1 − α) / (1 + c·k). Where no k is predicted to pay, it
    pauses (plain passes) for 1, 2, 4 ... up to `PAUSE` passes, then tries again: the text may
    turn back to something a draft can follow.

    It switches speculation off for the rest of the request when, after `WINDOW` rounds and
    `SPAN` / 2 passes, the rounds among the last `SPAN` passes cost more than `MARGIN` of those passes' time beyond what
    plain passes for their tokens would have taken (so the request as a whole stays within that
    margin of plain decoding: where nothing pays, the pauses keep that share small), or — for a
    drafter that models the text (`give_up`: a draft model, layer skipping) —
    when its last `WINDOW` rounds kept no draft at all. Prompt lookup does not give up on
    rejections alone: its drafts fail where the text stops copying and succeed again where it
    resumes, and a failed lookup costs little. Plain decoding's cost is measured
    on the sequence itself: its first decode pass is plain, and so is every `REFRESH`-th after,
    as the context (and so the cost of a pass) grows.
    """

    WINDOW = 8
    SPAN = 128
    MARGIN = 0.03
    REFRESH = 24
    PAUSE = 32

    def __init__(self, k_max: int, k: int | None = None, *, on: bool = True,
                 give_up: bool = True) -> None:  # fmt: skip
        self.k_max = max(1, k_max)
        self.give_up = give_up
        self.k = max(1, min(self.k_max, k or self.k_max))
        self.on = on
        self.t_plain = 0.0  # seconds per plain decode pass (moving average)
        self.kept = self.lost = 0.0  # decayed counts: accepted drafts, rejections
        self.cost = 0.0  # c: one more drafted token's seconds over a plain pass's
        self.rounds = self.drafted = self.accepted = self.rejections = 0  # totals
        self.since_plain = 0
        self.wait = self.pause = 0  # plain passes left in a pause, and the last pause's length
        self.recent: deque[int] = deque(maxlen=self.WINDOW)  # accepted drafts per round
        self.passes: deque[tuple[int, float, bool]] = deque(maxlen=self.SPAN)  # tokens, s, round
        self.reason = ""  # why it switched off

    def want(self) -> int:
        """Tokens to draft for the next pass; 0: a plain pass."""
        if not self.on or not self.t_plain or self.wait or self.since_plain >= self.REFRESH:
            return 0
        return self.k

    @property
    def alpha(self) -> float:
        return (self.kept + 0.5) / (self.kept + self.lost + 1.0)

    def predicted(self, k: int) -> float:
        """The speed-up k drafts are predicted to give over plain decoding."""
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (1 + self.cost * k)

    @property
    def loss(self) -> float:
        """The share of the last `SPAN` passes' time the rounds among them lost against plain
        passes for the same tokens (negative: they saved time)."""
        lost = sum(s - t * self.t_plain for t, s, spec in self.passes if spec)
        total = sum(s for _, s, _ in self.passes)
        return lost / total if total else 0.0

    def plain(self, seconds: float) -> None:
        self.t_plain = seconds if not self.t_plain else 0.7 * self.t_plain + 0.3 * seconds
        self.since_plain = 0
        self.wait = max(0, self.wait - 1)
        self.passes.append((1, seconds, False))

    def verified(self, drafted: int, accepted: int, seconds: float) -> None:
        """One round: `drafted` proposed, `accepted` kept, drafting + verifying took `seconds`."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.since_plain += 1
        self.recent.append(accepted)
        self.passes.append((accepted + 1, seconds, True))
        self.kept = 0.85 * self.kept + accepted
        self.lost = 0.85 * self.lost + (accepted < drafted)
        extra = max(0.0, seconds / max(self.t_plain, 1e-9) - 1) / max(drafted, 1)
        self.cost = extra if self.rounds == 1 else 0.7 * self.cost + 0.3 * extra
        best = max(range(1, self.k_max + 1), key=self.predicted)
        self.k = best
        if self.predicted(best) < 1:
            self.pause = min(self.PAUSE, 2 * self.pause or 1)
            self.wait = self.pause
        else:
            self.pause = 0
        if self.give_up and len(self.recent) == self.WINDOW and not any(self.recent):
            self.switch_off(f"the last {self.WINDOW} drafts were all rejected")
        elif (self.rounds >= self.WINDOW and len(self.passes) >= self.SPAN // 2
              and self.loss > self.MARGIN):  # fmt: skip
            self.switch_off(f"its rounds cost {self.loss:.0%} more time than plain decoding")

    def switch_off(self, reason: str) -> None:
        self.on, self.reason = False, reason


class Lookup:
    """Prompt lookup (apoorvumang/prompt-lookup-decoding): the last n tokens (n = 3, 2, 1) found
    earlier in prompt + generated text propose what followed them there (the latest match).

    An index of every n-gram's latest end grows with the text, so a proposal costs a few dict
    lookups, not a scan of the context."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.n = 0  # the length of the last match (0: none)

    def propose(self, seq: Any, k: int) -> Draft:
        return Draft(self.lookup(seq.history, k))

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
                self.n = n
                follow = list(text[e + 1 : e + 1 + k])
                images = [i for i, t in enumerate(follow) if t < 0]  # an image's positions: no draft
                return follow[: images[0]] if images else follow
        self.n = 0
        return []


class Drafter(Protocol):
    def propose(self, seq: Any, k: int) -> Draft:
        """Up to k tokens to follow `seq.last` (its slot's cache holds what precedes it)."""
        ...


def accept(logits: Callable[[int], np.ndarray], draft: Draft, sampler: Sampler,
           history: list[int]) -> tuple[list[int], int]:  # fmt: skip
    """The tokens one verification pass yields, and how many of them are accepted drafts.

    Args:
        logits: row i → the target's raw logits (n_vocab,) after the last token and drafts[:i].
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
        if qx > 0 and sampler.uniform() * qx <= float(p[x]):  # u ≤ min(1, p(x)/q(x))
            out.append(x)
            history.append(x)
            continue
        if q is not None:
            residual = np.maximum(p - q, 0.0)
        else:  # max(0, p − one-hot(x)): p without x
            residual = p.copy()
            residual[x] = 0.0
        total = float(residual.sum())
        t = sampler.draw(residual / total if total > 0 else p)
        out.append(t)
        history.append(t)
        return out, i
    t = sampler.draw(sampler.distribution(logits(len(draft.tokens)), history))
    history.append(t)
    return [*out, t], len(draft.tokens)


def _choose(sampler: Sampler, logits: np.ndarray, history: list[int],
            q: list[np.ndarray] | None) -> tuple[int, float]:  # fmt: skip
    """A drafter's token from its logits and its confidence (the top probability). Greedy targets
    get the argmax; sampling ones a draw from the same processed distribution (kept in q)."""
    if sampler.greedy:
        z = sampler.process(logits, history)
        top = float(z.max())
        return int(z.argmax()), float(1.0 / np.exp(z.astype(np.float64) - top).sum())
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

    def __init__(self, runner: Any, skip: Collection[int], *, confidence: float = 0.0) -> None:
        self.runner = runner
        self.skip = frozenset(skip)
        self.confidence = confidence

    def propose(self, seq: Any, k: int) -> Draft:
        sampler: Sampler = seq.sampler
        history = list(seq.history)
        q: list[np.ndarray] | None = None if sampler.greedy else []
        tokens: list[int] = []
        sid, tok, fed = seq.slot.sid, seq.last, 0
        try:
            for _ in range(k):
                f = self.runner.forward([Piece(sid, [tok], 1)], skip=self.skip)
                fed += 1
                tok, conf = _choose(sampler, f.logits[0], history, q)
                tokens.append(tok)
                history.append(tok)
                if conf < self.confidence:
                    break
        finally:
            if fed:
                self.runner.trim(sid, fed, skip=self.skip)
        return Draft(tokens, q)


class HeadDrafter:
    """A draft head (EAGLE, arXiv 2401.15077) in the target's runner: one small layer over the
    target's features of the positions it evaluated, then over its own predicted features, a
    token at a time (`Runner.head_logits`). Its vocabulary is the draft vocabulary it was
    trained with; tokens outside it are never drafted (probability 0), which the exact rule
    allows for.

    With `lookup`, prompt lookup drafts instead where the last `COPY_N` or more tokens occurred
    earlier in prompt + answer (the answer is copying, or repeating itself: a copied draft costs
    nothing to make and is kept often), the head everywhere else.

    Drafting stops early at a token whose probability is below `confidence`."""

    COPY_N = 2

    def __init__(self, runner: Any, *, confidence: float = 0.0, lookup: bool = False) -> None:
        self.runner = runner
        self.confidence = confidence
        self.lookup = Lookup() if lookup else None
        self.copied = 0  # rounds that drafted by prompt lookup

    def propose(self, seq: Any, k: int) -> Draft:
        if self.lookup is not None:
            copy = self.lookup.lookup(seq.history, k)
            if copy and self.lookup.n >= self.COPY_N:
                self.copied += 1
                return Draft(copy)
        if not seq.slot.exact:
            return Draft([])  # the target's cache was shifted: its features lead elsewhere
        sampler: Sampler = seq.sampler
        history = list(seq.history)
        q: list[np.ndarray] | None = None if sampler.greedy else []
        tokens: list[int] = []
        sid, tok = seq.slot.sid, seq.last
        try:
            for _ in range(k):
                logits = self.runner.head_logits(sid, tok)
                if logits is None:
                    break
                tok, conf = _choose(sampler, logits, history, q)
                tokens.append(tok)
                history.append(tok)
                if conf < self.confidence:
                    break
        finally:
            self.runner.head_done(sid)
        return Draft(tokens, q)


class DraftModel:
    """A second, smaller model with the same vocabulary on a runner of its own, one slot per slot
    of the target's, so its prompt prefix is reused like the target's. Before drafting it catches
    up with what the target's slot holds (the prompt at first, then the tokens accepted since);
    what it drafted past that is trimmed on the next catch-up."""

    def __init__(self, runner: Any, *, confidence: float = 0.0) -> None:
        self.runner = runner
        self.confidence = confidence
        self.held: dict[int, list[int]] = {i: [] for i in range(runner.n_slots)}

    def propose(self, seq: Any, k: int) -> Draft:
        slot, r = seq.slot, self.runner
        if not slot.exact:
            return Draft([])  # the target's cache was shifted: no exact prefix to follow
        held, want = self.held[slot.sid], slot.tokens
        if len(want) + 2 > r.n_ctx:  # past the draft model's own context: no draft
            return Draft([])
        keep = common_prefix(held, want, len(want))
        if keep < len(held) or r.held(slot.sid) != len(held):
            if keep and r.held(slot.sid) == len(held):
                r.trim(slot.sid, len(held) - keep)
            else:
                r.clear(slot.sid)
                keep = 0
            del held[keep:]
        for i in range(keep, len(want), r.max_batch):
            piece = want[i : i + r.max_batch]
            r.forward([Piece(slot.sid, piece, 0)])
            held.extend(piece)
        sampler: Sampler = seq.sampler
        history = list(seq.history)
        q: list[np.ndarray] | None = None if sampler.greedy else []
        tokens: list[int] = []
        tok = seq.last
        for _ in range(max(0, min(k, r.n_ctx - len(held) - 1))):
            f = r.forward([Piece(slot.sid, [tok], 1)])
            held.append(tok)
            tok, conf = _choose(sampler, f.logits[0], history, q)
            tokens.append(tok)
            history.append(tok)
            if conf < self.confidence:
                break
        return Draft(tokens, q)


def check_speculative(spec: str | None, *, policy: ContextPolicy, evict: bool = False,
                      draft_name: str | None = "") -> None:  # fmt: skip
    """What speculation cannot compose with (`LocalLLMError`, one line each). `draft_name`: the
    loaded draft model's (None: none loaded; "": not known yet, before loading)."""
    mode = speculative_mode(spec)
    if mode == "off":
        return
    if evict:
        raise LocalLLMError(
            "speculative decoding cannot run with H2O eviction (--evict): verifying drafts adds "
            "their attention to the heavy-hitter scores and can evict tokens, which a "
            "rollback cannot undo"
        )
    if policy.enabled:
        raise LocalLLMError(
            "speculative decoding cannot run with --streaming: verifying k drafts at once "
            "can make the context shift early, which a rollback cannot undo"
        )
    if mode == "draft" and draft_name != "" and spec != f"draft:{draft_name}":
        raise LocalLLMError(
            f"--speculative {spec}: this model was loaded "
            + (f"with the draft model {draft_name}" if draft_name else "without a draft model")
            + "; load it with that --speculative to use another"
        )

"""What speculative decoding shares across backends, with no tensor library: the prompt-lookup
drafter and the pace that sets the draft length and switches speculation off when it stops paying.
(The torch engine's verification and its model drafters: `localllm.backends.torch.speculative`;
llama.cpp's: `localllm.backends.llamacpp`.)"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Draft", "Lookup", "Pace"]


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

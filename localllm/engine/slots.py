"""One slot policy for every runner: which slot a prompt takes, and what of its cache it reuses.

A slot is one of the runner's caches; the engine remembers which tokens it holds (exactly as a fresh
evaluation of them would leave it, until a context shift) and who uses it. A prompt takes, in this
order: the free slot whose cache it continues (keeping at least `KEEP_SHARE` of it; the longest
shared prefix first), an empty one (the lowest id: llama.cpp decodes neighbouring ids in one pass),
or the one where the tokens reused minus the cached tokens thrown away is largest (least recently
used on ties). So a chat sharing only a system prompt with another leaves the other's cache for
its next turn. At least one prompt token is always left to evaluate, for its logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from localllm.types import ContextPolicy

__all__ = ["KEEP_SHARE", "Slot", "Slots", "common_prefix"]

KEEP_SHARE = 0.75  # a prompt that keeps this much of a slot's cache continues it


def common_prefix(cached: Sequence[int], ids: Sequence[int], limit: int) -> int:
    """How many leading tokens of `ids` a slot's `cached` tokens already hold (at most `limit`)."""
    n, top = 0, min(len(cached), len(ids), limit)
    while n < top and cached[n] == ids[n]:
        n += 1
    return n


@dataclass(eq=False)
class Slot:
    sid: int
    tokens: list[int] = field(default_factory=list)  # what its cache holds, in order (while exact)
    exact: bool = True  # False once its cache was shifted: `tokens` no longer says what it holds
    policy: ContextPolicy = field(default_factory=ContextPolicy)  # what its cache was cleared for
    busy: bool = False
    stamp: int = 0  # when it was last taken (least recently used goes first)


class Slots:
    def __init__(self, n: int) -> None:
        self.all = [Slot(i) for i in range(n)]
        self._clock = 0

    @property
    def free(self) -> list[Slot]:
        return [s for s in self.all if not s.busy]

    def choose(
        self, ids: Sequence[int], policy: ContextPolicy, restorable: int = 0
    ) -> tuple[Slot, int]:
        """The free slot a prompt takes and the prompt tokens its cache already holds.
        `restorable`: tokens the prefix cache could restore instead (an empty slot takes them)."""
        free = self.free
        if not free:
            raise RuntimeError("no free slot")
        limit = len(ids) - 1
        shared = {s: common_prefix(s.tokens, ids, limit) if s.exact and s.policy == policy else 0
                  for s in free}  # fmt: skip
        kept = [s for s in free if s.tokens and shared[s] >= KEEP_SHARE * len(s.tokens)]
        empty = [s for s in free if not s.tokens]
        if kept:
            slot = max(kept, key=lambda s: (shared[s], -s.sid))
        elif empty:
            slot = empty[0]
        else:
            slot = max(free, key=lambda s: (2 * shared[s] - len(s.tokens), -s.stamp))
        if restorable > shared[slot] and not kept and empty:
            slot = empty[0]
        return slot, shared[slot]

    def take(self, slot: Slot) -> None:
        self._clock += 1
        slot.busy, slot.stamp = True, self._clock

"""Scoring a text through `Runner.forward`: the logits after every token, evaluated through one
slot's cache exactly as decoding fills it (`localllm eval`, `recommend`, the quantize report).

Whole chunks (`runner.scoring_chunk` tokens, every position's logits) where that is the same
computation as generation; one token at a time where a cache quantizes late (KIVI's residual) or
forgets token by token (H2O): the runner's `scoring_chunk` is then 1. Under StreamingLLM the
window slides by a chunk (the window // 16) at a time, on every runner alike (`ContextPolicy.step`):
each chunk's queries see what a prompt's chunk sees in generation, and `chunk=1` gives the
paper's one position at a time (bench/streaming_eval.py: the perplexity within 0.5% of it, 5x+
faster). Run it while no sequence generates (`Model.run_here`): it uses slot 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from localllm.backends.base import Piece
from localllm.types import ContextPolicy

__all__ = ["Scorer", "teacher_argmax"]


class Scorer:
    """`feed(tokens)` → numpy float32 (len(tokens), n_vocab): the logits after each token."""

    def __init__(self, runner: Any, policy: ContextPolicy | None = None, slot: int = 0,
                 chunk: int | None = None) -> None:  # fmt: skip
        self.runner, self.slot = runner, slot
        forgets = policy is not None and policy.enabled
        if forgets and chunk is None:
            # the window slides by a chunk at a time, as a prompt's chunks slide it in generation:
            # each chunk's first query still sees 15/16 of the window (chunk=1: one position at
            # a time, what StreamingLLM's paper scores)
            chunk = max(1, policy.window // 16)  # type: ignore[union-attr]
        self.chunk = max(1, min(int(runner.scoring_chunk), chunk or int(runner.scoring_chunk)))
        self.policy = replace(policy, step=self.chunk) if forgets else ContextPolicy()  # type: ignore[type-var]
        self.token_by_token = self.chunk == 1
        self.shifts = 0  # context shifts (a StreamingLLM policy forgetting)
        self.discarded = 0  # positions they forgot
        runner.clear(slot, self.policy)

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        f = self.runner.forward([Piece(self.slot, list(tokens), len(tokens))])
        n = f.shifted.get(self.slot, 0)
        self.shifts += bool(n)
        self.discarded += n
        return f.logits

    def kv_stats(self) -> dict[str, float]:
        """What the slot's cache cost (bytes per token, peak ...), where the runner can say."""
        return dict(self.runner.kv_stats(self.slot))

    def close(self) -> None:
        self.runner.clear(self.slot)

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def teacher_argmax(runner: Any, ids: Sequence[int], *, skip: frozenset[int] = frozenset(),
                   slot: int = 0) -> np.ndarray:  # fmt: skip
    """The runner's greedy choice after every token of `ids`, teacher-forced ((len(ids),)), with
    `skip` layers left out (the layer-skip drafter's view)."""
    runner.clear(slot)
    out = []
    try:
        for i in range(0, len(ids), runner.max_batch):
            piece = list(ids[i : i + runner.max_batch])
            out.append(
                runner.forward([Piece(slot, piece, len(piece))], skip=skip).logits.argmax(-1)
            )
    finally:
        if skip:
            runner.trim(slot, runner.held(slot), skip=skip)
        runner.clear(slot)
    return np.concatenate(out)

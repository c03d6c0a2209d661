"""What each step evaluates: every decoding sequence (with its drafts), plus a bounded prefill chunk."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from localllm.backends.base import media_cut

__all__ = ["Scheduler"]


class _Running(Protocol):
    ids: list[int]  # the prompt
    left: int  # prompt tokens not yet evaluated (0: decoding)
    fed: int  # prompt tokens evaluated (or reused from a cache)


class Scheduler:
    """Chooses what each step evaluates: every decoding sequence, plus a bounded prefill chunk.

    With nothing decoding, a prompt goes in `max_batch`-token steps. While sequences decode, a new
    prompt gets a chunk sized so that the step costs about `PREFILL_SHARE` decode steps more than a
    decode step alone (measured as it runs): running streams slow down by a bounded factor instead of
    stalling for a whole long prompt (Sarathi-style chunked prefill). The token budget of a step
    counts every decoding sequence's token and the drafts it verifies.
    """

    # extra decode-step times one step may spend on prompt tokens. 1.5 let the p95 time per token
    # of 4 streams grow 3.2-3.9x beside a 4,000-token prompt here (a chunk's cost is not linear in
    # its tokens); 0.75 kept it at 2.3-2.5x (bench/server.py), the long prompt reading slower
    PREFILL_SHARE = 0.75
    MIN_CHUNK = 4  # on a slow CPU one prompt token can cost a sixth of a 3-sequence decode step
    FIRST_CHUNK = 16  # before a prompt token's cost has been measured

    # A chunk that does not finish its prompt ends at a multiple of GRID positions where the
    # budget allows: a prompt read beside other sequences is then cut where it is cut alone
    # (max_batch is a multiple of it), and a runner whose matrix kernels round a row by the
    # rows around it (torch's CPU GEMM, in blocks of 16) gives the same logits either way.
    GRID = 16
    DECAY = 0.8  # weight of the past in the cost model, per observed step

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max(1, max_batch)
        self.t_decode = 0.0  # seconds per decode-only step (moving average)
        # what prompt tokens add to a step beside decoding: fixed + n · (per_token + per_pos · p),
        # p the chunk's position in thousands (attention reads every position before it)
        self.t_fixed = self.t_token = self.t_pos = 0.0
        self._a = np.zeros((3, 3))  # decayed Σ x xᵀ, x = (1, n, n·p)
        self._b = np.zeros(3)  # decayed Σ x · seconds

    def token_cost(self, position: int = 0) -> float:
        """Seconds one prompt token at `position` adds to a decode step (the fit's estimate)."""
        return self.t_token + self.t_pos * position / 1000

    def chunk(self, decoding: int, position: int = 0) -> int:
        """Prompt tokens a step beside `decoding` decoding sequences may evaluate, the chunk
        starting at `position`."""
        if not decoding:
            return self.max_batch
        per = self.token_cost(position)
        if not (self.t_decode and per > 0):
            return min(self.max_batch, self.FIRST_CHUNK)
        room = self.PREFILL_SHARE * self.t_decode - self.t_fixed
        n = int(room / per) if room > 0 else 0
        return max(min(self.MIN_CHUNK, self.max_batch), min(self.max_batch, n))

    def plan(
        self, running: Sequence[Any], drafts: Mapping[Any, int] | None = None
    ) -> dict[Any, int]:
        """{sequence: prompt tokens to evaluate now (0: it decodes)}; `drafts`: tokens each
        decoding sequence verifies beside its own."""
        decoding = [r for r in running if r.left == 0]
        plan = {r: 0 for r in decoding}
        verified = sum((drafts or {}).values())
        prefilling = [r for r in running if r.left]
        at = prefilling[0].fed if prefilling else 0
        budget = min(self.chunk(len(decoding), at), self.max_batch - len(decoding) - verified)
        for r in running:
            if r.left and budget > 0:
                n = min(r.left, budget)
                if n < r.left:  # end on the grid where the budget allows (see GRID)
                    aligned = (r.fed + n) // self.GRID * self.GRID - r.fed
                    n = aligned if aligned > 0 else n
                    n = media_cut(r.ids, r.fed, n)  # never inside an image (it goes whole)
                plan[r] = n
                budget -= n
        return plan

    def observe(self, prompt: int, decoding: int, seconds: float, position: int = 0) -> None:
        """A step evaluated `prompt` prompt tokens (centred on `position`) beside `decoding`
        decoding sequences in `seconds`."""

        def avg(old: float, new: float) -> float:
            return new if not old else 0.8 * old + 0.2 * new

        if not prompt:
            self.t_decode = avg(self.t_decode, seconds)
        elif decoding and self.t_decode:
            # fitted by decayed least squares over recent steps: a per-token average alone
            # charges a step's fixed part (another pass) to its tokens, so the chunk shrank step
            # after step, and lags behind a cost that grows as a long prompt goes on
            extra = max(0.0, seconds - self.t_decode)
            x = np.array([1.0, prompt, prompt * position / 1000])
            self._a = self.DECAY * self._a + np.outer(x, x)
            self._b = self.DECAY * self._b + x * extra
            fit = self._solve()
            if fit is None:
                self.t_fixed, self.t_pos = 0.0, 0.0
                self.t_token = avg(self.t_token, extra / prompt)
            else:
                self.t_fixed, self.t_token, self.t_pos = fit
        elif not decoding:
            self.t_token = avg(self.t_token, seconds / prompt)

    def _solve(self) -> tuple[float, float, float] | None:
        """(fixed, per token, per token per thousand positions), all ≥ 0, or None while the
        steps seen cannot tell them apart (a position term first, then the fixed one, drop out
        when they would come out negative)."""
        for keep in ((0, 1, 2), (0, 1), (1,)):
            a = self._a[np.ix_(keep, keep)]
            if np.linalg.cond(a) > 1e10:
                continue
            theta = np.linalg.solve(a, self._b[list(keep)])
            if (theta >= 0).all() and theta[keep.index(1)] > 0:
                full = [0.0, 0.0, 0.0]
                for k, v in zip(keep, theta):
                    full[k] = float(v)
                return full[0], full[1], full[2]
        return None

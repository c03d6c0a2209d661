"""What each step evaluates: every decoding sequence (with its drafts), plus a bounded prefill chunk."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Scheduler"]


class _Running(Protocol):
    left: int  # prompt tokens not yet evaluated (0: decoding)


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

    DECAY = 0.8  # weight of the past in the cost model, per observed step

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max(1, max_batch)
        self.t_decode = 0.0  # seconds per decode-only step (moving average)
        self.t_token = 0.0  # seconds per prompt token beside decoding (the fit's slope)
        self.t_fixed = 0.0  # seconds a step with prompt tokens costs beyond them (its intercept)
        self._fit = [0.0] * 5  # decayed sums of 1, n, n², y, n·y over prefill-beside-decode steps

    def chunk(self, decoding: int) -> int:
        if not decoding:
            return self.max_batch
        if not (self.t_decode and self.t_token):
            return min(self.max_batch, self.FIRST_CHUNK)
        room = self.PREFILL_SHARE * self.t_decode - self.t_fixed
        n = int(room / self.t_token) if room > 0 else 0
        return max(min(self.MIN_CHUNK, self.max_batch), min(self.max_batch, n))

    def plan(
        self, running: Sequence[Any], drafts: Mapping[Any, int] | None = None
    ) -> dict[Any, int]:
        """{sequence: prompt tokens to evaluate now (0: it decodes)}; `drafts`: tokens each
        decoding sequence verifies beside its own."""
        decoding = [r for r in running if r.left == 0]
        plan = {r: 0 for r in decoding}
        verified = sum((drafts or {}).values())
        budget = min(self.chunk(len(decoding)), self.max_batch - len(decoding) - verified)
        for r in running:
            if r.left and budget > 0:
                plan[r] = n = min(r.left, budget)
                budget -= n
        return plan

    def observe(self, prompt: int, decoding: int, seconds: float) -> None:
        """A step evaluated `prompt` prompt tokens beside `decoding` decoding sequences."""

        def avg(old: float, new: float) -> float:
            return new if not old else 0.8 * old + 0.2 * new

        if not prompt:
            self.t_decode = avg(self.t_decode, seconds)
        elif decoding and self.t_decode:
            # what the prompt tokens added to a decode step: a fixed part (another pass, its
            # launch) and a part per token, fitted by decayed least squares over recent steps
            # (a per-token average alone charges the fixed part to the tokens: the chunk then
            # shrinks step after step)
            extra = max(0.0, seconds - self.t_decode)
            f = self._fit = [self.DECAY * v for v in self._fit]
            for i, v in enumerate((1.0, prompt, prompt * prompt, extra, prompt * extra)):
                f[i] += v
            s0, sn, snn, sy, sny = f
            var = s0 * snn - sn * sn
            if var > 1e-9 * s0 * snn:
                slope = (s0 * sny - sn * sy) / var
                fixed = (sy - slope * sn) / s0
                if slope > 0 and fixed >= 0:
                    self.t_token, self.t_fixed = slope, fixed
                    return
            self.t_token, self.t_fixed = avg(self.t_token, extra / prompt), 0.0
        elif not decoding:
            self.t_token = avg(self.t_token, seconds / prompt)

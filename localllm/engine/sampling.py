"""The sampler: one per sequence, for every runner, in llama.cpp's order (so both runners mean the
same thing by the same `SamplingParams`): penalties → top-k → top-p → min-p → temperature → draw.

It works on one row of logits, a numpy float32 array (n_vocab,) as `Runner.forward` returns it.
Greedy with no penalties is a bare argmax (the first largest logit, as llama.cpp's greedy sampler).
A sampling chain narrows to the top-k candidates first (a partition: no sort of the whole
vocabulary; logit descending, ties by token id) and works on those; a seed fixes the sequence's own generator (PCG64), so the same seed
gives the same tokens on either runner, alone or beside other sequences.

llama.cpp's C sampler chain is not used: its generator (mt19937 inside `dist`) is not numpy's, so a
seed would mean another sequence on each runner; this one costs ~0.05 ms a token with top-k 40.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from localllm.types import SamplingParams

__all__ = ["Choice", "Sampler", "logprobs"]

_NEG = np.float32(-np.inf)


class Choice(NamedTuple):
    """One draw of a `Sampler` as `device_sampling.choose` makes it where the logits are: the
    chain's parameters (no penalties, no grammar) and `u`, the uniform the sequence's own
    generator drew for this token (None: greedy, the first largest logit)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    u: float | None


class Sampler:
    """One sequence's sampling: its parameters and its own seeded generator."""

    def __init__(self, params: SamplingParams) -> None:
        s = self.params = params
        self.penalize = bool(s.repeat_penalty != 1.0 or s.frequency_penalty or s.presence_penalty)
        self.greedy = s.temperature == 0
        self.rng: np.random.Generator | None = None
        if not self.greedy:
            seed = None if s.seed is None else s.seed & 0xFFFFFFFFFFFFFFFF
            self.rng = np.random.Generator(np.random.PCG64(seed))

    # -- the chain -------------------------------------------------------------------------------

    def penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's penalties over the last `repeat_last_n` tokens (-1: all): a seen token's
        logit is divided by `repeat` when positive (multiplied when negative), then lowered by
        count·frequency + presence. A copy when anything changes."""
        s = self.params
        if not self.penalize:
            return logits
        n = s.repeat_last_n
        recent = history[-n:] if n > 0 else history if n < 0 else ()
        if not len(recent):
            return logits
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        inside = (ids >= 0) & (ids < logits.shape[-1])  # an image's positions are no tokens
        ids, counts = ids[inside], counts[inside]
        x = logits[ids]
        if s.repeat_penalty != 1.0:
            x = np.where(x > 0, x / s.repeat_penalty, x * s.repeat_penalty)
        x = x - counts * s.frequency_penalty - s.presence_penalty
        out = logits.copy()
        out[ids] = x
        return out

    def candidates(
        self, logits: np.ndarray, history: Sequence[int] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, z): the tokens the chain keeps, most likely first, and their final logits
        (temperature applied). Not for greedy samplers."""
        s = self.params
        x = self.penalized(logits, history)
        v = x.shape[-1]
        if 0 < s.top_k < v:  # every logit above the k-th largest, then the lowest ids equal to it
            kth = np.partition(x, v - s.top_k)[v - s.top_k]
            ids = np.flatnonzero(x >= kth)
            if len(ids) > s.top_k:
                above = np.flatnonzero(x > kth)
                ids = np.concatenate((above, np.flatnonzero(x == kth)[: s.top_k - len(above)]))
                ids.sort()
            ids = ids[np.argsort(-x[ids], kind="stable")]  # ties by id
        else:
            ids = np.argsort(-x, kind="stable")
        z = x[ids].astype(np.float64)
        if s.top_p < 1.0:  # the most likely tokens whose probabilities first reach p
            p = np.exp(z - z[0])
            p /= p.sum()
            before = np.cumsum(p) - p
            n = max(1, int(np.count_nonzero(before < s.top_p)))
            ids, z = ids[:n], z[:n]
        if s.min_p > 0.0:  # drop tokens less likely than min_p times the most likely one
            n = max(1, int(np.count_nonzero(z >= z[0] + np.log(s.min_p))))
            ids, z = ids[:n], z[:n]
        keep = np.isfinite(z)
        if not keep.all():  # a grammar's mask (-inf) leaves what it allows
            ids, z = ids[keep], z[keep]
        return ids, z / s.temperature

    def process(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The logits after the whole chain, (n_vocab,) with -inf where it filtered: what greedy
        takes the argmax of."""
        if self.greedy:
            return self.penalized(logits, history)
        ids, z = self.candidates(logits, history)
        out = np.full(logits.shape[-1], -np.inf)
        out[ids] = z
        return out

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """(n_vocab,) float64 probabilities this sampler draws from (speculative decoding's p, q)."""
        out = np.zeros(logits.shape[-1])
        if self.greedy:
            out[int(self.penalized(logits, history).argmax())] = 1.0
            return out
        ids, z = self.candidates(logits, history)
        p = np.exp(z - z.max())
        out[ids] = p / p.sum()
        return out

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The chosen token after `history` (prompt + generated, for penalties)."""
        if self.greedy:
            return int(self.penalized(logits, history).argmax())
        ids, z = self.candidates(logits, history)
        p = np.exp(z - z.max())
        return int(ids[self._pick(p)])

    def choice(self) -> Choice | None:
        """This sampler's next draw as `device_sampling.choose` takes it (the uniform comes
        from this sequence's generator now), or None where the chain needs the host (penalties
        read the history)."""
        if self.penalize:
            return None
        s = self.params
        return Choice(s.temperature, s.top_k, s.top_p, s.min_p, None if self.greedy else self.uniform())

    # -- randomness --------------------------------------------------------------------------------

    def _pick(self, weights: np.ndarray) -> int:
        """An index drawn in proportion to `weights` (≥ 0, not all 0): inverse CDF of one uniform."""
        cdf = np.cumsum(weights)
        i = int(np.searchsorted(cdf, self.uniform() * cdf[-1], side="right"))
        return min(i, len(cdf) - 1)

    def mark(self) -> object:
        """Where the generator stands (`rewind` goes back there: draws for a step that failed)."""
        return None if self.rng is None else self.rng.bit_generator.state

    def rewind(self, mark: object) -> None:
        if mark is not None and self.rng is not None:
            self.rng.bit_generator.state = mark

    def draw(self, probs: np.ndarray) -> int:
        """A token drawn from (n_vocab,) probabilities."""
        return self._pick(probs)

    def uniform(self) -> float:
        """u ~ U[0, 1) from the sequence's own generator (speculative acceptance)."""
        if self.rng is None:  # a greedy sampler never draws; its verification is exact
            self.rng = np.random.Generator(np.random.PCG64(0))
        return float(self.rng.random())


def logprobs(
    logits: np.ndarray, token: int, n_top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's log-probability under the logits (n_vocab,), and the `n_top` most likely."""
    x = logits.astype(np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        k = min(n_top, x.shape[-1])
        ids = np.argpartition(-lp, k - 1)[:k]
        ids = ids[np.argsort(-lp[ids], kind="stable")]
        top = tuple((int(i), float(lp[i])) for i in ids)
    return float(lp[token]), top

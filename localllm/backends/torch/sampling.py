"""Sampling as composable logits processors, in llama.cpp's order (so both backends mean the same
thing by the same `SamplingParams`): penalties → top-k → top-p → min-p → temperature → draw.

A processor is `fn(logits, history) -> logits` over one row `(V,)` of float32 logits; a filtered-out
token gets -inf. `make_sampler(params)` composes the ones the parameters ask for; greedy with no
penalties is a bare argmax (the first largest logit, as llama.cpp's greedy sampler).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch

from localllm.types import SamplingParams

__all__ = ["Processor", "Sampler", "logprobs", "make_sampler"]

Processor = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
_NEG = float("-inf")


def penalties(logits: torch.Tensor, history: Sequence[int], *, last_n: int, repeat: float,
              frequency: float, presence: float) -> torch.Tensor:  # fmt: skip
    """llama.cpp's penalties over the last `last_n` tokens: a seen token's logit is divided by
    `repeat` when positive (multiplied when negative), then lowered by count·frequency + presence."""
    recent = history[-last_n:] if last_n > 0 else history if last_n < 0 else ()
    if not recent:
        return logits
    ids, counts = torch.tensor(recent, device=logits.device).unique(return_counts=True)
    ids = ids[ids < logits.shape[-1]]
    counts = counts[: ids.shape[0]]
    x = logits[ids]
    if repeat != 1.0:
        x = torch.where(x > 0, x / repeat, x * repeat)
    x = x - counts.to(x.dtype) * frequency - presence
    logits = logits.clone()
    logits[ids] = x
    return logits


def top_k(logits: torch.Tensor, _history: Sequence[int], *, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, _NEG)


def top_p(logits: torch.Tensor, _history: Sequence[int], *, p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities first reach `p` (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each
    drop = before >= p
    drop[0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), _NEG)


def min_p(logits: torch.Tensor, _history: Sequence[int], *, p: float) -> torch.Tensor:
    """Drop tokens less likely than `p` times the most likely one."""
    if p <= 0.0:
        return logits
    return logits.masked_fill(logits < logits.max() + math.log(p), _NEG)


def temperature(logits: torch.Tensor, _history: Sequence[int], *, t: float) -> torch.Tensor:
    return logits / t


class Sampler:
    """One sequence's sampling: its processors and its own seeded generator."""

    def __init__(self, processors: Sequence[Processor], greedy: bool, seed: int | None,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.processors = tuple(processors)
        self.greedy = greedy
        self.generator: torch.Generator | None = None
        if not greedy:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed & 0xFFFFFFFFFFFFFFFF)

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """logits: (V,) float32 → the chosen token id."""
        logits = self.process(logits, history)
        if self.greedy:
            return int(logits.argmax())
        return self.draw(logits.softmax(-1))

    def process(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The logits after every processor: what greedy takes the argmax of."""
        for fn in self.processors:
            logits = fn(logits, history)
        return logits

    def distribution(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """(V,) probabilities this sampler draws from (speculative decoding's p and q)."""
        return self.process(logits, history).softmax(-1)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """u ~ U[0, 1) from the sequence's own generator (speculative acceptance)."""
        gen = self.generator
        return float(torch.rand(1, generator=gen, device=gen.device if gen else "cpu"))


def make_sampler(params: SamplingParams, device: torch.device | str = "cpu") -> Sampler:
    s = params
    chain: list[Processor] = []
    if s.repeat_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
        chain.append(partial(penalties, last_n=s.repeat_last_n, repeat=s.repeat_penalty,
                             frequency=s.frequency_penalty, presence=s.presence_penalty))  # fmt: skip
    if s.temperature == 0:
        return Sampler(chain, greedy=True, seed=None, device=device)
    if s.top_k > 0:
        chain.append(partial(top_k, k=s.top_k))
    chain.append(partial(top_p, p=s.top_p))
    chain.append(partial(min_p, p=s.min_p))
    chain.append(partial(temperature, t=s.temperature))
    return Sampler(chain, greedy=False, seed=s.seed, device=device)


def logprobs(logits: torch.Tensor, token: int, n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's log-probability under the raw logits (V,), and the `n_top` most likely."""
    lp = logits.float().log_softmax(-1)
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        values, ids = lp.topk(n_top)
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return float(lp[token]), top

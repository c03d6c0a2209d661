"""The torch engine's samplers against Hugging Face transformers' logits processors (the oracle),
each processor on its own, then the composed chain's order (llama.cpp's: filters before temperature)."""

from __future__ import annotations

import math

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")
need("transformers", "pip install -e '.[dev]' (transformers is the torch engine's oracle)")

import torch  # noqa: E402
from transformers.generation import logits_process as hf  # noqa: E402

from localllm.backends.torch import sampling  # noqa: E402
from localllm.types import SamplingParams  # noqa: E402

V = 500


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, generator=g) * 3


def kept(x: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


@pytest.mark.parametrize("k", [1, 7, 40, V])
def test_top_k_matches_transformers(logits: torch.Tensor, k: int) -> None:
    ours = sampling.top_k(logits, (), k=k)
    theirs = hf.TopKLogitsWarper(top_k=k)(None, logits[None].clone())[0]
    assert kept(ours) == kept(theirs) and len(kept(ours)) == k


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_transformers(logits: torch.Tensor, p: float) -> None:
    ours = sampling.top_p(logits, (), p=p)
    theirs = hf.TopPLogitsWarper(top_p=p)(None, logits[None].clone())[0]
    assert kept(ours) == kept(theirs)
    probs = logits.softmax(-1)
    mass = float(probs[sorted(kept(ours))].sum())
    assert mass >= p  # the smallest set that reaches p: dropping its least likely token falls short
    least = min(kept(ours), key=lambda i: float(probs[i]))
    assert len(kept(ours)) == 1 or mass - float(probs[least]) < p


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5])
def test_min_p_matches_transformers(logits: torch.Tensor, p: float) -> None:
    ours = sampling.min_p(logits, (), p=p)
    theirs = hf.MinPLogitsWarper(min_p=p)(None, logits[None].clone())[0]
    assert kept(ours) == kept(theirs)


def test_repeat_penalty_matches_transformers(logits: torch.Tensor) -> None:
    history = [3, 17, 17, 250, 499, 3]
    ours = sampling.penalties(logits, history, last_n=64, repeat=1.3, frequency=0.0, presence=0.0)
    ids = torch.tensor([history])
    theirs = hf.RepetitionPenaltyLogitsProcessor(penalty=1.3)(ids, logits[None].clone())[0]
    torch.testing.assert_close(ours, theirs)


def test_frequency_and_presence_penalties_and_the_window(logits: torch.Tensor) -> None:
    history = [9, 5, 5, 5, 7]
    ours = sampling.penalties(logits, history, last_n=4, repeat=1.0, frequency=0.5, presence=0.25)
    expect = logits.clone()
    expect[5] -= 3 * 0.5 + 0.25  # three times in the last four
    expect[7] -= 0.5 + 0.25
    torch.testing.assert_close(ours, expect)  # token 9 fell out of the window


def test_greedy_is_the_first_largest_logit() -> None:
    s = sampling.make_sampler(SamplingParams(temperature=0))
    x = torch.tensor([0.0, 2.0, 2.0, 1.0])
    assert s(x) == 1 and s.greedy and s.generator is None


def test_seeded_sampling_repeats_and_follows_the_distribution(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a = sampling.make_sampler(params)
    b = sampling.make_sampler(params)
    draws = [a(logits) for _ in range(4000)]
    assert draws[:50] == [b(logits) for _ in range(50)]
    probs = (logits / 0.7).softmax(-1)
    top = int(probs.argmax())
    freq = draws.count(top) / len(draws)
    sd = math.sqrt(float(probs[top]) * (1 - float(probs[top])) / len(draws))
    assert abs(freq - float(probs[top])) < 5 * sd


def test_chain_filters_before_temperature(logits: torch.Tensor) -> None:
    """llama.cpp's order: min-p on the untempered distribution, then temperature."""
    params = SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.2, seed=1)
    s = sampling.make_sampler(params)
    allowed = kept(sampling.min_p(logits, (), p=0.2))
    assert {s(logits) for _ in range(300)} <= allowed


def test_logprobs_are_log_softmax(logits: torch.Tensor) -> None:
    lp, top = sampling.logprobs(logits, 42, 3)
    ref = logits.log_softmax(-1)
    assert lp == pytest.approx(float(ref[42]), abs=1e-5)
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()

"""The engine's one sampler (`localllm.engine.sampling`) against llama.cpp's sampler chain (the
oracle): which candidates survive penalties → top-k → top-p → min-p → temperature, and with what
probabilities, must be what `Sampler.distribution` says; then the draws themselves follow
`distribution` (a chi-square test over many draws with a fixed seed), seeds repeat, greedy is the
first argmax, and `logprobs` is log-softmax.

llama.cpp's chain runs through llama-cpp-python's low-level API on a bare candidate array (no
model is loaded)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import pytest
from chisquare import chi_square

from localllm.engine.sampling import Sampler, logprobs
from localllm.types import SamplingParams

from conftest import need

V = 500
P_MIN = 1e-3  # a chi-square p-value below this fails (the seeds are fixed: no flaky runs)
PLAIN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every filter off


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(V) * 3).astype(np.float32)


def llamacpp_chain(logits: np.ndarray, s: SamplingParams,
                   history: Sequence[int] = ()) -> dict[int, float]:  # fmt: skip
    """llama.cpp's candidates after its chain for `s` (a filter at its "off" value is a no-op
    there too): {token: final logit}."""
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the sampler's oracle)")
    import llama_cpp as L

    assert s.repeat_last_n >= 0, "llama.cpp's own sampler knows no -1 (its callers expand it)"
    data = (L.llama_token_data * len(logits))()
    for i, x in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(x), 0.0
    cur = L.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for smpl in (
        L.llama_sampler_init_penalties(len(logits), s.repeat_last_n, s.repeat_penalty,
                                       s.frequency_penalty, s.presence_penalty),
        L.llama_sampler_init_top_k(s.top_k),
        L.llama_sampler_init_top_p(s.top_p, 1),
        L.llama_sampler_init_min_p(s.min_p, 1),
        L.llama_sampler_init_temp(s.temperature),
    ):  # fmt: skip
        L.llama_sampler_chain_add(chain, smpl)  # the chain owns (and frees) each sampler
    try:
        for t in history:
            L.llama_sampler_accept(chain, t)
        L.llama_sampler_apply(chain, ctypes.byref(cur))
        return {int(cur.data[i].id): float(cur.data[i].logit) for i in range(cur.size)}
    finally:
        L.llama_sampler_free(chain)


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


HISTORY = [3, 17, 17, 250, 499, 3, 42, 42, 42, 7]
EVERYTHING = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, repeat_penalty=1.1,
                  frequency_penalty=0.3, presence_penalty=0.2, repeat_last_n=8)  # fmt: skip
PENALTIES = dict(temperature=1.3, top_k=60, repeat_penalty=1.5, frequency_penalty=0.4,
                 presence_penalty=0.3)  # fmt: skip
CHAINS = {
    "top_k 1": ({"top_k": 1}, ()),
    "top_k 7": ({"top_k": 7}, ()),
    "top_k 40": ({"top_k": 40}, ()),
    "top_k V": ({"top_k": V}, ()),
    "top_p 0.05": ({"top_p": 0.05}, ()),
    "top_p 0.5": ({"top_p": 0.5}, ()),
    "top_p 0.9": ({"top_p": 0.9}, ()),
    "top_p 0.999": ({"top_p": 0.999}, ()),
    "min_p 0.01": ({"min_p": 0.01}, ()),
    "min_p 0.1": ({"min_p": 0.1}, ()),
    "min_p 0.5": ({"min_p": 0.5}, ()),
    "temperature 0.3": ({"temperature": 0.3}, ()),
    "temperature 1.7": ({"temperature": 1.7}, ()),
    "repeat 1.3": ({"repeat_penalty": 1.3}, HISTORY),
    "repeat 0.8": ({"repeat_penalty": 0.8}, HISTORY),
    "frequency, presence, window 4": (
        dict(frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=4),
        HISTORY,
    ),
    "defaults": ({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, ()),
    "everything": (EVERYTHING, HISTORY),
    "filters before temperature": ({"temperature": 5.0, "min_p": 0.2}, ()),
}


@pytest.mark.parametrize("case", CHAINS)
def test_distribution_is_llamacpps_chain(logits: np.ndarray, case: str) -> None:
    knobs, history = CHAINS[case]
    s = SamplingParams(**(PLAIN | knobs))
    theirs = llamacpp_chain(logits, s, history)
    ours = Sampler(s).distribution(logits, history)
    assert set(np.flatnonzero(ours).tolist()) == set(theirs), case
    ids = np.array(sorted(theirs))
    expect = softmax(np.array([theirs[int(i)] for i in ids], dtype=np.float64))
    np.testing.assert_allclose(ours[ids], expect, rtol=1e-4, atol=1e-7)
    assert ours.sum() == pytest.approx(1.0)


# -- penalties, as llama.cpp defines them -----------------------------------------------------------


def test_repeat_penalty_divides_positive_logits_and_multiplies_negative_ones() -> None:
    x = np.array([2.0, -2.0, 0.0, 1.0], dtype=np.float32)
    s = Sampler(SamplingParams(**PLAIN, repeat_penalty=2.0))
    np.testing.assert_allclose(s.penalized(x, [0, 1, 2, 0]), [1.0, -4.0, 0.0, 1.0])
    assert x.tolist() == [2.0, -2.0, 0.0, 1.0]  # the caller's row is not touched


def test_frequency_and_presence_penalties_and_the_window(logits: np.ndarray) -> None:
    params = SamplingParams(**PLAIN, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=4)
    s = Sampler(params)
    expect = logits.astype(np.float64)
    expect[5] -= 3 * 0.5 + 0.25  # three times in the last four
    expect[7] -= 0.5 + 0.25
    history = [9, 5, 5, 5, 7]  # 9 is outside the window
    np.testing.assert_allclose(s.penalized(logits, history), expect, rtol=1e-6)


def test_repeat_last_n_minus_one_is_the_whole_history_and_zero_is_none(logits: np.ndarray) -> None:
    history = [9, 5, 5, 5, 7]
    whole = Sampler(SamplingParams(**PLAIN, presence_penalty=1.0, repeat_last_n=-1))
    changed = np.flatnonzero(whole.penalized(logits, history) != logits)
    assert changed.tolist() == [5, 7, 9]
    none = Sampler(SamplingParams(**PLAIN, presence_penalty=1.0, repeat_last_n=0))
    np.testing.assert_array_equal(none.penalized(logits, history), logits)


def test_penalties_skip_ids_outside_the_vocabulary() -> None:
    x = np.zeros(4, dtype=np.float32)
    s = Sampler(SamplingParams(**PLAIN, presence_penalty=1.0))
    np.testing.assert_array_equal(s.penalized(x, [1, 10**6]), [0.0, -1.0, 0.0, 0.0])


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_the_first_largest_logit() -> None:
    s = Sampler(SamplingParams(temperature=0))
    x = np.array([0.0, 2.0, 2.0, 1.0], dtype=np.float32)
    assert s.greedy and s.rng is None
    assert s(x) == 1
    assert s.distribution(x).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert int(s.process(x).argmax()) == 1


def test_greedy_takes_the_penalized_argmax() -> None:
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    x = np.array([0.0, 2.0, 1.5, 1.0], dtype=np.float32)
    assert s(x, [1]) == 2  # 2.0 / 2 = 1.0 falls below 1.5


def test_greedy_ignores_top_k_and_friends(logits: np.ndarray) -> None:
    s = Sampler(SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9, seed=3))
    assert s(logits) == int(logits.argmax())


# -- seeds ----------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_draws(logits: np.ndarray) -> None:
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a, b = Sampler(params), Sampler(params)
    other = Sampler(SamplingParams(temperature=0.9, seed=99))
    draws = []
    for _ in range(200):
        draws.append(a(logits))
        other(logits)  # another sequence's draws between this one's change nothing
    assert draws == [b(logits) for _ in range(200)]


def test_different_seeds_give_different_draws(logits: np.ndarray) -> None:
    def draws(seed: int | None) -> list[int]:
        s = Sampler(SamplingParams(**PLAIN, seed=seed))
        return [s(logits) for _ in range(50)]

    assert draws(1) != draws(2)
    assert draws(None) != draws(None)  # no seed: fresh entropy each time
    assert draws(-1) == draws(2**64 - 1)  # a negative seed is its 64-bit pattern, not an error


# -- the draws follow the distribution ------------------------------------------------------------

DRAWN = {
    "plain": ({}, ()),
    "temperature 0.7": ({"temperature": 0.7}, ()),
    "defaults": ({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, ()),
    "top_k 3": ({"top_k": 3}, ()),
    "penalties": (PENALTIES, HISTORY),
}


@pytest.mark.parametrize("case", DRAWN)
def test_draws_follow_the_distribution(logits: np.ndarray, case: str) -> None:
    knobs, history = DRAWN[case]
    s = Sampler(SamplingParams(**(PLAIN | knobs), seed=20240))
    p = s.distribution(logits, history)
    draws = [s(logits, history) for _ in range(20_000)]
    stat, df, pvalue = chi_square(draws, p)
    assert pvalue > P_MIN, f"{case}: chi-square {stat:.1f}, {df} degrees of freedom, p {pvalue:.2g}"


def test_draw_follows_given_probabilities() -> None:
    """`draw`, which speculative decoding's residual and bonus tokens go through."""
    s = Sampler(SamplingParams(**PLAIN, seed=7))
    p = np.array([0.5, 0.0, 0.2, 0.25, 0.05])
    draws = [s.draw(p) for _ in range(20_000)]
    stat, df, pvalue = chi_square(draws, p)
    assert pvalue > P_MIN, f"chi-square {stat:.1f} on {df} degrees of freedom, p = {pvalue:.2g}"
    u = [s.uniform() for _ in range(10_000)]
    assert min(u) >= 0.0 and max(u) < 1.0 and abs(np.mean(u) - 0.5) < 0.02


def test_a_grammar_mask_leaves_only_what_it_allows(logits: np.ndarray) -> None:
    masked = np.full_like(logits, -np.inf)
    allowed = [11, 200, 333]
    masked[allowed] = logits[allowed]
    s = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=5))
    assert set(np.flatnonzero(s.distribution(masked)).tolist()) <= set(allowed)
    assert {s(masked) for _ in range(300)} <= set(allowed)
    z = s.process(masked)
    assert np.isneginf(np.delete(z, allowed)).all()


def test_process_is_the_distributions_logits(logits: np.ndarray) -> None:
    s = Sampler(SamplingParams(temperature=0.6, top_k=30, top_p=0.9, min_p=0.02, seed=1))
    z = s.process(logits, HISTORY)
    p = s.distribution(logits, HISTORY)
    keep = np.isfinite(z)
    assert (keep == (p > 0)).all()
    np.testing.assert_allclose(softmax(z[keep]), p[keep], rtol=1e-9)


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax(logits: np.ndarray) -> None:
    lp, top = logprobs(logits, 42, 3)
    x = logits.astype(np.float64)
    ref = np.log(np.exp(x) / np.exp(x).sum())
    assert lp == pytest.approx(ref[42], abs=1e-9)
    assert [t for t, _ in top] == np.argsort(-ref)[:3].tolist()
    assert [v for _, v in top] == pytest.approx(np.sort(ref)[::-1][:3].tolist(), abs=1e-9)
    assert logprobs(logits, 42, 0)[1] == ()
    assert len(logprobs(logits, 0, 20)[1]) == 20

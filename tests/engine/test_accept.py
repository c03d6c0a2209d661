"""Speculative decoding's one accept rule (`localllm.engine.speculative.accept`), called directly
with crafted target rows and drafts: greedy is exact (drafts kept while each is the target's
argmax, then the target's own token); sampling emits tokens distributed exactly as the target's
(arXiv 2211.17192), whatever the draft distribution q, and accepts as often as the rule says
(a draft token survives with probability Σ min(p, q)). Sampled checks are chi-square tests over
20,000 verifications with fixed seeds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from chisquare import chi_square

from localllm.engine.sampling import Sampler
from localllm.engine.speculative import Draft, accept
from localllm.types import SamplingParams

P_MIN = 1e-3  # a chi-square p-value below this fails (the seeds are fixed: no flaky runs)
N = 20_000
NEG = -np.inf


def plain(seed: int) -> SamplingParams:
    """Sampling whose processed distribution is softmax(logits): every filter off."""
    return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def rows_of(table: np.ndarray, asked: list[int] | None = None) -> Callable[[int], np.ndarray]:
    """`accept`'s logits(i): row i of `table` (k + 1, V), noting which rows were asked for."""

    def logits(i: int) -> np.ndarray:
        assert 0 <= i < len(table), f"row {i} of {len(table)}"
        if asked is not None:
            asked.append(i)
        return table[i]

    return logits


# -- greedy: exact --------------------------------------------------------------------------------

# the target's rows (k + 1 = 4, V = 6): argmaxes 2, 0, 5, 3 (row 1 has a tie: its first wins)
GREEDY_ROWS = np.array([
    [0.1, 0.2, 3.0, 0.0, -1.0, 0.5],
    [2.0, 2.0, 0.1, 0.3, 0.4, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [-1.0, -2.0, 0.0, 4.0, 0.0, 3.9],
], dtype=np.float32)  # fmt: skip
TARGET = [2, 0, 5, 3]


@pytest.mark.parametrize(
    ("drafts", "tokens", "n"),
    [
        ([2, 0, 5], [2, 0, 5, 3], 3),  # all kept: plus the bonus from the last row
        ([2, 0, 4], [2, 0, 5], 2),  # the third is wrong: the target's own token in its place
        ([2, 1, 5], [2, 0], 1),  # a tie is the first argmax: 1 is wrong
        ([4, 0, 5], [2], 0),  # the first is wrong: nothing after it counts
        ([2], [2, 0], 1),  # a shorter draft
        ([], [2], 0),  # no draft: a plain step
    ],
)
def test_greedy_keeps_drafts_while_they_are_the_targets_argmax(drafts: list[int], tokens: list[int],
                                                               n: int) -> None:  # fmt: skip
    sampler = Sampler(SamplingParams(temperature=0))
    history = [1, 1]
    asked: list[int] = []
    out, kept = accept(rows_of(GREEDY_ROWS, asked), Draft(list(drafts)), sampler, history)
    assert (out, kept) == (tokens, n)
    assert out[:kept] == drafts[:kept] and out == TARGET[: len(out)]
    assert history == [1, 1, *tokens]  # extended with what it returned
    assert asked == list(range(len(tokens)))  # one row per emitted token, in order
    assert sampler.rng is None  # greedy verification draws nothing


def test_greedy_ignores_the_draft_distribution() -> None:
    q = [softmax(np.array([0, 0, 0, 0, 9.0, 0]))] * 3  # a drafter sure of token 4
    greedy = Sampler(SamplingParams(temperature=0))
    out, kept = accept(rows_of(GREEDY_ROWS), Draft([2, 0, 5], q), greedy, [])
    assert (out, kept) == ([2, 0, 5, 3], 3)


def test_greedy_penalties_see_the_accepted_drafts() -> None:
    """Row i is judged after history + drafts[:i]: a repeat penalty on the first kept draft moves
    the second row's argmax."""
    rows = np.array([[0.0, 3.0, 0.0], [0.0, 3.0, 2.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    out, kept = accept(rows_of(rows), Draft([1, 1]), sampler, [])
    assert (out, kept) == ([1, 2], 1)  # row 1: 3.0 / 2 = 1.5 < 2.0


# -- sampling: distributed as the target ----------------------------------------------------------

# the target's logits (k + 1 = 4 rows, V = 6); row 0 masks token 5 (a grammar's -inf)
TARGET_ROWS = np.array([
    [1.0, 0.2, -0.5, 1.5, 0.0, NEG],
    [0.0, 1.0, 2.0, -1.0, 0.5, 0.3],
    [0.7, 0.7, -0.2, 0.0, 1.2, -2.0],
    [-0.3, 0.9, 0.1, 0.4, 0.0, 1.1],
])  # fmt: skip
# the drafter's distributions: unlike p, zero where p is not (token 4 in row 0), and sure of a
# token p forbids (token 5 in row 0)
DRAFT_Q = np.array([
    [0.1, 0.4, 0.05, 0.05, 0.0, 0.4],
    softmax(np.array([2.0, 0.0, 0.5, 0.0, -1.0, 0.0])),
    softmax(np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0])),
])  # fmt: skip
K = len(DRAFT_Q)
P = np.array([softmax(r) for r in TARGET_ROWS])


def verify_many(seed: int, q: np.ndarray | None, fixed: list[int] | None = None
                ) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """N verifications with one seeded sampler: drafts drawn from `q` (each row's token from its
    own q, as a drafter does), or the `fixed` one-hot drafts. Returns (emitted tokens, accepted
    counts) per verification."""
    sampler = Sampler(plain(seed))
    draft_rng = np.random.default_rng(seed + 1)
    emitted, counts = [], []
    for _ in range(N):
        if q is not None:
            tokens = [int(draft_rng.choice(len(row), p=row)) for row in q]
            draft = Draft(tokens, list(q))
        else:
            assert fixed is not None
            tokens = list(fixed)
            draft = Draft(tokens)
        history = [0]
        out, n = accept(rows_of(TARGET_ROWS), draft, sampler, history)
        assert 1 <= len(out) == n + 1 <= K + 1 and out[:n] == tokens[:n]
        assert history == [0, *out]
        emitted.append(out)
        counts.append(n)
    return emitted, counts


def acceptance_counts(alphas: list[float]) -> np.ndarray:
    """P(n accepted) for n = 0..k when draft i survives with probability alphas[i] (its rows do
    not depend on the tokens before it, as here)."""
    probs, reach = [], 1.0
    for a in alphas:
        probs.append(reach * (1 - a))
        reach *= a
    return np.array([*probs, reach])


def check(emitted: list[list[int]], counts: list[int], alphas: list[float], what: str) -> None:
    """The first token follows the target's row 0; the token at position i, wherever a
    verification got that far, follows row i (the bonus included); the accepted counts follow
    the rule's survival chances."""
    stat, df, pvalue = chi_square([out[0] for out in emitted], P[0])
    assert pvalue > P_MIN, f"{what}, first token: chi-square {stat:.1f}, {df} df, p {pvalue:.2g}"
    for i in range(1, K + 1):
        at_i = [out[i] for out in emitted if len(out) > i]
        assert len(at_i) >= 200, (what, i, len(at_i))  # enough for 6 bins
        stat, df, pvalue = chi_square(at_i, P[i])
        assert pvalue > P_MIN, f"{what}, token {i}: chi-square {stat:.1f}, {df} df, p {pvalue:.2g}"
    expected = acceptance_counts(alphas)
    stat, df, pvalue = chi_square(counts, expected)
    assert pvalue > P_MIN, f"{what}, counts: chi-square {stat:.1f}, {df} df, p {pvalue:.2g}"
    mean = float(np.mean(counts))
    assert mean == pytest.approx(float(expected @ np.arange(K + 1)), abs=0.05)


def test_sampled_with_a_draft_distribution_emits_the_targets() -> None:
    emitted, counts = verify_many(2024, DRAFT_Q)
    alphas = [float(np.minimum(P[i], DRAFT_Q[i]).sum()) for i in range(K)]
    assert min(alphas) > 0.2 and max(alphas) < 0.9  # neither all kept nor all lost: both paths run
    check(emitted, counts, alphas, "drawn drafts")
    assert not any(out[0] == 5 for out in emitted)  # the drafter's favourite, masked by the target


@pytest.mark.parametrize("fixed", [[3, 2, 4], [0, 1, 0], [5, 2, 4]])
def test_sampled_with_one_hot_drafts_emits_the_targets(fixed: list[int]) -> None:
    """Prompt lookup and other drafters without q: a draft token x survives with p(x), else the
    token comes from p without x."""
    emitted, counts = verify_many(7 + fixed[0], None, fixed)
    alphas = [float(P[i][x]) for i, x in enumerate(fixed)]
    if fixed[0] == 5:  # p forbids it: never kept, and never emitted
        assert set(counts) == {0}
        stat, df, pvalue = chi_square([out[0] for out in emitted], P[0])
        assert pvalue > P_MIN, f"chi-square {stat:.1f}, {df} df, p {pvalue:.2g}"
        return
    check(emitted, counts, alphas, f"one-hot drafts {fixed}")


def test_the_same_seed_verifies_the_same_way() -> None:
    a = verify_many(99, DRAFT_Q)
    b = verify_many(99, DRAFT_Q)
    assert a == b


def test_a_draft_the_target_agrees_with_is_always_kept() -> None:
    """q = p row by row: u·q(x) ≤ p(x) always holds, so every draft survives."""
    sampler = Sampler(plain(3))
    rng = np.random.default_rng(4)
    for _ in range(500):
        tokens = [int(rng.choice(6, p=P[i])) for i in range(K)]
        out, n = accept(rows_of(TARGET_ROWS), Draft(tokens, list(P[:K])), sampler, [])
        assert n == K and out[:K] == tokens

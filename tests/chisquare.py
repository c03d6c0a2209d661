"""Pearson's chi-square goodness-of-fit test, without scipy: do draws follow a distribution?"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

MIN_EXPECTED = 5.0  # bins expecting fewer draws are pooled (the chi-square approximation needs it)


def chi2_sf(x: float, df: int) -> float:
    """P(X ≥ x) for X ~ chi-square with `df` degrees of freedom (closed forms for integer df:
    a Poisson sum for even df, the normal tail plus a finite series for odd)."""
    if x <= 0:
        return 1.0
    if df % 2 == 0:
        term = total = math.exp(-x / 2)
        for i in range(1, df // 2):
            term *= x / (2 * i)
            total += term
        return min(1.0, total)
    total = math.erfc(math.sqrt(x / 2))
    term = math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    for i in range(1, (df + 1) // 2):
        total += term
        term *= x / (2 * i + 1)
    return min(1.0, total)


def chi_square(draws: Sequence[int] | np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of `draws` (token ids) against `probs` (n,).

    A draw where `probs` is 0 is an error of its own (AssertionError), not a large statistic.
    Bins expecting fewer than `MIN_EXPECTED` draws are pooled into one."""
    draws = np.asarray(draws)
    n = len(draws)
    observed = np.bincount(draws, minlength=len(probs)).astype(np.float64)
    impossible = np.flatnonzero((probs <= 0) & (observed > 0))
    assert not len(impossible), f"drew tokens of probability 0: {impossible.tolist()}"
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs = list(observed[big])
    exp = list(expected[big])
    rest_obs, rest_exp = float(observed[~big].sum()), float(expected[~big].sum())
    if rest_exp >= MIN_EXPECTED or (rest_exp > 0 and not exp):
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0:  # too few even pooled: into the smallest bin
        i = int(np.argmin(exp))
        obs[i] += rest_obs
        exp[i] += rest_exp
    o, e = np.array(obs), np.array(exp)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(e) - 1
    return stat, df, chi2_sf(stat, df) if df > 0 else 1.0

"""Draft trees (issue 36, EAGLE-2): a drafter proposes a tree, one target pass verifies every
branch (`Piece.parents`), and the exact rule walks down it (`accept_path`): greedy keeps the child
that is the target's argmax; sampling tries a node's children in the order they were drawn,
each against the residual of the ones before (SpecInfer), so the emitted tokens are distributed
as the target's — chi-square tests over 20,000 verifications with fixed seeds. Through the
engine (the scripted runner, whose head's first choice is wrong after a vowel): the tree's second
branch is kept where a chain would stop, the output is plain decoding's, and the runner keeps
the accepted path only (`Runner.keep`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from chisquare import chi_square
from fakebackend import GEN, FakeRunner

from localllm.engine import Model
from localllm.engine.sampling import Sampler
from localllm.engine.speculative import Draft, HeadDrafter, Pace, accept_path
from localllm.types import ContextPolicy, Request, SamplingParams

P_MIN = 1e-3
N = 20_000


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def plain(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)


# A tree over a vocabulary of 5: the root's children 0 (index 0) and 2 (index 1); 0's children 1
# (index 2) and 3 (index 3); 3's child 4 (index 4). Rows: one per node, the root's first.
#        root
#       /    \
#     0(0)   2(1)
#     /  \
#   1(2) 3(3)
#          \
#          4(4)
TOKENS = [0, 2, 1, 3, 4]
PARENTS = [-1, -1, 0, 0, 3]
ROWS = np.array([
    [2.0, 0.5, 1.0, -1.0, 0.0],   # after the root: argmax 0
    [0.0, 1.0, 0.5, 3.0, 0.2],    # after 0: argmax 3
    [1.0, 0.0, 0.0, 0.0, 4.0],    # after 2: argmax 4 (no child there)
    [0.0, 0.0, 5.0, 0.0, 0.0],    # after 0, 1: argmax 2 (a leaf)
    [0.1, 0.2, 0.3, 0.4, 0.9],    # after 0, 3: argmax 4
    [0.0, 2.0, 0.0, 0.0, 1.0],    # after 0, 3, 4: argmax 1 (the bonus)
], dtype=np.float32)  # fmt: skip


def rows_of(table: np.ndarray, asked: list[int]) -> Callable[[int], np.ndarray]:
    def logits(i: int) -> np.ndarray:
        asked.append(i)
        return table[i]

    return logits


@pytest.mark.parametrize(
    ("rows", "tokens", "path"),
    [
        (ROWS, [0, 3, 4, 1], [0, 3, 4]),  # down the second branch of 0 to the leaf, then the bonus
        (ROWS[[0, 1, 2, 3, 3, 5]], [0, 3, 2], [0, 3]),  # after 0, 3 the target wants 2: no child
        (ROWS[[2, 1, 2, 3, 4, 5]], [4], []),  # the root's argmax 4 is no child: nothing kept
        (ROWS[[1, 1, 2, 3, 4, 5]], [3], []),
    ],
)
def test_greedy_walks_the_branch_of_the_targets_argmax(rows: np.ndarray, tokens: list[int],
                                                       path: list[int]) -> None:  # fmt: skip
    asked: list[int] = []
    history = [7]
    out, kept = accept_path(rows_of(rows, asked), Draft(TOKENS, None, PARENTS), Sampler(SamplingParams(temperature=0)), history)
    assert (out, kept) == (tokens, path)
    assert history == [7, *tokens]
    assert asked == [0, *(i + 1 for i in path)]  # the rows of the path's nodes only, in order
    assert Draft(TOKENS, None, PARENTS).depth == 3
    assert Draft(TOKENS, None, PARENTS).piece_parents() == [-1, 0, 0, 1, 1, 4]


def _sampled_tree(rng: np.random.Generator, q_root: np.ndarray, q0: np.ndarray,
                  width: int) -> Draft:  # fmt: skip
    """`width` draws from q_root after the root, and `width` from q0 after the first draw's
    token: the tree a sampling drafter makes (every draw kept; a token drawn twice, one node)."""
    tokens: list[int] = []
    parents: list[int] = []
    q: list[np.ndarray] = []
    draws: dict[int, list[int]] = {}
    for node, dist in ((-1, q_root), (0, q0)):
        made: dict[int, int] = {}
        for x in rng.choice(len(dist), size=width, p=dist):
            if int(x) not in made:
                made[int(x)] = len(tokens)
                tokens.append(int(x))
                parents.append(node)
                q.append(dist)
            draws.setdefault(node, []).append(made[int(x)])
    return Draft(tokens, q, parents, draws)


@pytest.mark.parametrize("width", [2, 3])
def test_sampled_trees_emit_the_targets_distribution(width: int) -> None:
    """The first token of each verification follows p (whatever the draws), and so does the
    second given the first, over 20,000 verifications: chi-square, p > 0.001."""
    p_root = softmax(np.array([1.0, 0.2, -0.5, 0.8, 0.0]))
    q_root = softmax(np.array([0.0, 1.5, 0.3, -1.0, 0.5]))  # a draft that disagrees
    p_next = softmax(np.array([0.3, -1.0, 1.2, 0.0, 0.7]))
    q0 = softmax(np.array([1.0, 0.0, -0.3, 0.9, 0.0]))
    rng = np.random.default_rng(0)
    firsts: list[int] = []
    seconds: list[int] = []
    kept = 0
    z_root, z_next = np.log(p_root), np.log(p_next)

    def logits(row: int) -> np.ndarray:
        return z_root if row == 0 else z_next  # after any draft: p_next

    for i in range(N):
        draft = _sampled_tree(rng, q_root, q0, width)
        out, path = accept_path(logits, draft, Sampler(plain(i)), [])
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
        kept += len(path)
    for draws, p in ((firsts, p_root), (seconds, p_next)):
        _, _, pv = chi_square(draws, p)
        assert pv > P_MIN, (Counter(draws), p)
    # more than one child kept a draft more often than one draw would: Σ min(p, q) for one
    assert kept / N > float(np.minimum(p_root, q_root).sum())


class _Wrong(FakeRunner):
    """The scripted runner with a head that puts a wrong token first after a vowel."""

    def __init__(self) -> None:
        super().__init__(n_ctx=512, n_slots=2, max_batch=64)
        self.use_head(None, "")
        self.wrong = frozenset(GEN + b for b in b"aeiou")
        self.trees: list[int] = []
        self.kept: list[list[int]] = []

    def forward(self, pieces, *, skip=frozenset()):  # type: ignore[no-untyped-def]
        self.trees += [len(p.tokens) for p in pieces if p.parents is not None]
        return super().forward(pieces, skip=skip)

    def keep(self, slot, start, path):  # type: ignore[no-untyped-def]
        self.kept.append(list(path))
        super().keep(slot, start, path)


def _run(m: Model, r: _Wrong, drafter: HeadDrafter | None, temperature: float,
         seed: int = 1) -> tuple[int, ...]:  # fmt: skip
    def forced(spec: str | None, policy: ContextPolicy) -> tuple[HeadDrafter, Pace]:
        pace = Pace(4, 4, give_up=False)
        pace.plain(1.0)
        return drafter, pace  # type: ignore[return-value]

    if drafter is not None:
        m._drafter = forced  # type: ignore[method-assign]
    try:
        got = m.submit(Request(prompt="q say:a tree of drafts, above all else", speculative="head" if drafter else "off",
                               sampling=SamplingParams(temperature=temperature, seed=seed))).wait()  # fmt: skip
    finally:
        if drafter is not None:
            del m._drafter
    return got.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_keeps_the_branch_a_chain_would_miss(temperature: float) -> None:
    r = _Wrong()
    from localllm.backends import Capabilities

    r.capabilities = Capabilities(kv_cache_types=("f16",), streaming=False, speculative=("off", "head"),
                                  batching=True, embeddings=False, grammar=False)  # fmt: skip
    with Model(r, "fake") as m:
        want = _run(m, r, None, temperature)
        chain = HeadDrafter(r)
        assert _run(m, r, chain, temperature) == want and not r.trees and chain.trees == 0
        tree = HeadDrafter(r, width=2, nodes=12)
        assert _run(m, r, tree, temperature) == want
    assert tree.trees > 0 and r.trees and max(r.trees) <= 13
    # after a vowel the head's first choice is wrong: only the tree's second branch goes on
    assert any(len(p) > 2 and p != list(range(len(p))) for p in r.kept), r.kept


def test_trees_of_several_sequences_share_a_step() -> None:
    """Continuous batching: four sequences draft trees at once; each tree is one piece of the
    step (the scheduler counts its tokens), and every answer is plain greedy's."""
    r = _Wrong()
    from localllm.backends import Capabilities

    r.capabilities = Capabilities(kv_cache_types=("f16",), streaming=False, speculative=("off", "head"),
                                  batching=True, embeddings=False, grammar=False)  # fmt: skip
    prompts = [f"q{i} say:{'tree ' * (i + 2)}of drafts, all at once" for i in range(4)]
    greedy = SamplingParams(temperature=0)
    with Model(r, "fake") as m:
        want = [m.submit(Request(prompt=p, sampling=greedy)).wait().token_ids for p in prompts]

        def forced(spec: str | None, policy: ContextPolicy) -> tuple[HeadDrafter, Pace]:
            pace = Pace(4, 4, give_up=False)
            pace.plain(1.0)
            return HeadDrafter(r, width=2, nodes=8), pace

        m._drafter = forced  # type: ignore[method-assign]
        streams = [m.submit(Request(prompt=p, speculative="head", sampling=greedy)) for p in prompts]
        got = [s.wait().token_ids for s in streams]
    assert got == want
    steps = [sum(1 for p in plan.values() if p == 0) for plan in r.plans]
    assert max(steps) > 1  # decoding pieces (trees among them) of several sequences in one forward
    assert len(r.kept) > 4
